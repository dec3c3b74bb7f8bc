"""The engine's units: each owns its parameters' gather, release and gradient buffer (as FSDP2's
``FSDPParamGroup`` owns unshard, reshard and post_backward). The hooks (``_hooks.py``) decide when;
a unit does the work with the C++ ``ZeroEngine`` (no partitioning, paging or optimizer here: those
are the engine's).

Units. Each module that directly owns trainable parameters (``module._parameters``) is one engine
module ("unit"): its parameters flattened, in registration order, into one fp32 vector. A module
marked as a leaf (``set_z3_leaf_modules``: DeepSpeed's ``_z3_leaf`` attribute) is one unit with
every parameter of its subtree, and its children get no hooks. A parameter that appears again
(tied weights: GPT-2's ``lm_head.weight`` is ``wte.weight``) belongs to the first unit that holds
it; every other module that holds it gathers that unit too. Frozen parameters
(``requires_grad=False`` when ``initialize`` runs: PEFT freezes the base after the model is built)
are engine state too, in units of their own: a module with both gets a trainable unit and a frozen
one. A frozen unit is paged, gathered, released and prefetched like any other, in the working
dtype, but the engine keeps no master weights, gradient or optimizer state for it and never writes
it back; backward gathers it again only when autograd unpacks a saved view of it (the input
gradient of a frozen Linear). (``build_units``.)

Gather. ``Unit.gather`` asks the engine for the unit (``ZeroEngine.gather``: stage 3 pins the
shard, or all-gathers it, loading it from its home tier ahead of time by the engine's recorded
trace) and points each parameter's ``.data`` at its slice of the gathered memory: a view, no copy.
With several ranks every all-gather first checks that all ranks gather the same unit, and the
next unit the ``NextUnitPredictor`` names is all-gathered ahead (``ZeroEngine.prefetch_gather``).
``Unit.release`` puts the placeholders back (``_params.py``). The gathered memory itself is freed
by torch's reference counting (the engine's scope ends when the storage does), so a view that
autograd or the user kept stays valid, and no view can outlive the memory. ``Unit.backward_flat``
is the gather for a tensor autograd saved (phase "backward": the engine's trace prefetches it in
order), kept while something still holds it.

Gradients. Each trainable parameter's gradient is copied into its unit's fp32 gradient buffer
(``Unit.accumulate_grad``; a unit of one fp32 parameter takes autograd's gradient itself as its
buffer: no copy); when every trainable parameter of the unit has arrived, the buffer goes to
``ZeroEngine.reduce_gradients`` (the engine's reduce path: the reduce-scatter and the accumulation
into its gradient partitions), while backward goes on with the modules before it. A unit whose
parameters did not all get a gradient is reduced when the backward ends (``Unit.end_backward``).
The engine sums what it is given (mean_over_micro_batches false): torch's convention.

CUDA. A model on a CUDA device computes on copies: each gathered unit is copied from the engine's
(host) memory to the device when it is gathered, the parameters view that copy, and torch's
caching allocator owns it (so stream ordering is torch's own). Gradients are copied out to the
unit's fp32 host buffer. This is the same data flow as tiermem-train's CUDA backend, which copies
each module in per step; it has not been run on a GPU yet (the CPU tests force the copy path with
``EngineLink.copy_in``).

Thread-safety: one thread drives a model (as torch's autograd does).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from ._params import holds_placeholder, placeholder, raw_data, set_raw_data
from ._init_store import give_back_stored, held_in_memory, lend_stored, take_stored

__all__ = ["Unit", "EngineLink", "UnitMap", "build_units", "in_backward", "unit_of", "NOT_PICKLABLE"]

NOT_PICKLABLE = ("a model trained by a tiermem engine cannot be pickled or deep-copied whole: its parameters live "
                 "in the engine; save them with engine.save_fp32_model(path) (or model.state_dict()) and checkpoints "
                 "with engine.save_checkpoint(dir)")


def unit_of(x) -> Optional["Unit"]:
    """The engine unit that holds `x` when `x` is a parameter a tiermem engine manages, else None
    (any other object, or after ``engine.close()``). The one way the torch face reaches a
    parameter's unit, and through ``Unit.engine`` its engine."""
    return x.__dict__.get("_tm_unit") if isinstance(x, torch.nn.Parameter) else None


def in_backward() -> bool:
    """Whether autograd is running a backward node on this thread now."""
    return torch._C._current_autograd_node() is not None


class EngineLink:
    """What the units of one model share: the engine they gather from and reduce into (None until
    attached), the working dtype, where the model computes, and with several ranks the collectives'
    module check (``dist_ops``) and the next-unit predictor."""

    def __init__(self, model: torch.nn.Module, units: list, predictor) -> None:
        self.model = model
        self.units = units  # the model's units, by index (what the predictor's indices name)
        self.predictor = predictor  # _predictor.NextUnitPredictor: consulted with several ranks
        self.engine = None  # the C++ ZeroEngine, once attached
        self.working_dtype = torch.float32
        self.dist_ops = None  # _dist.DistOps with several ranks
        self.saved = None  # _hooks.SavedParams: how autograd saves the model's parameters
        self.running = 0  # modules of the model running forward now (the hooks count them)
        # A forward-only engine (nothing to train): each forward of the model is a pass of the
        # engine's trace (ZeroEngine.end_forward_pass at its end), in eval and generate() too.
        self.forward_only = False
        self.gathered_params_open = 0  # zero.GatheredParameters scopes now open
        # Where the model computes (its parameters' device; initialize checked they agree). The
        # engine's gathered memory is host memory: on another device (CUDA) each gathered unit is
        # copied in, and that copy is what the parameters view. copy_in forces the copy on the CPU
        # too (the CUDA path's CPU twin in the tests).
        first = next((p for p in model.parameters()), None)
        self.compute_device = first.device if first is not None else torch.device("cpu")
        self.copy_in = False

    def phase(self) -> str:
        """The pass running now, as the engine's trace names it: "forward" while a module of the
        model runs forward in training, or in any mode on a forward-only engine (whose passes end at
        each forward of the model: ``_hooks``, ``end_forward_pass``); "outside" otherwise (eval, ``generate()``, a read between
        steps such as ``state_dict()`` or an EMA update, a loss computed from a weight after the
        model's forward): outside the step's recorded trace, which it would make diverge."""
        if in_backward():
            return "backward"
        if self.running and (self.model.training or self.forward_only):
            return "forward"
        return "outside"

    def engine_gather(self, unit: "Unit", phase: str) -> torch.Tensor:
        """The unit's working parameters from the engine (host memory); with several ranks the
        all-gather of the unit predicted next is started after it."""
        ops = self.dist_ops
        if ops is None:
            return self.engine.gather(unit.index, phase)
        ops.unit = unit.index  # the all-gather checks that every rank gathers this unit
        try:
            flat = self.engine.gather(unit.index, phase)
        finally:
            ops.unit = -1
        nxt = self.predictor.record(phase, unit.index)
        if nxt is not None:
            self.units[nxt].prefetch(phase)
        return flat

    def to_compute(self, flat: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """The gathered unit where the model computes: the engine's memory itself on the CPU, else
        a copy on the model's device (a blocking copy: the engine's scope ends when `flat` is
        dropped, so the host memory must not be read after this returns)."""
        if flat.device != self.compute_device or self.copy_in:
            return flat.to(self.compute_device, copy=True)
        return flat.clone() if copy else flat


class Unit:
    """One engine module: parameters laid out back to back in one flat vector. It gathers and
    releases them, and holds their fp32 gradient buffer during a backward."""

    __slots__ = ("index", "name", "link", "frozen", "params", "slot_of", "numel", "flat", "active", "n_trainable",
                 "grad", "received", "got", "bw_flat", "released", "shapes", "holders", "copied")

    def __init__(self, index: int, name: str, link: EngineLink, frozen: bool = False) -> None:
        self.index = index
        self.name = name
        self.link = link
        self.frozen = frozen  # every parameter has requires_grad False: no gradient, no optimizer state
        self.params: list[tuple[torch.nn.Parameter, int, int]] = []  # (param, offset, numel)
        self.shapes: list[torch.Size] = []        # each parameter's shape as registered
        self.holders: list[tuple[int, torch.nn.Module, str]] = []  # (param index, module, key) holding each
        self.slot_of: dict[int, tuple[int, int, int]] = {}  # id(param) -> (index in params, offset, numel)
        self.numel = 0
        self.flat: Optional[torch.Tensor] = None  # gathered working params while in use
        self.active = 0                           # modules (and GatheredParameters scopes) using it
        self.n_trainable = 0
        self.grad: Optional[torch.Tensor] = None  # fp32 gradient of the current backward
        self.received = 0
        self.got: set[int] = set()                # indices of params whose gradient arrived
        self.bw_flat = None                       # weakref to the last backward gather
        self.released = False                     # its parameters hold placeholders (release ran)
        self.copied = False                       # `flat` is a copy asked for (GatheredParameters, a write)

    def __reduce_ex__(self, protocol):
        raise TypeError(NOT_PICKLABLE)

    @property
    def engine(self):
        """The C++ ZeroEngine this unit is registered with (None before attach or after close)."""
        return self.link.engine

    def add(self, p: torch.nn.Parameter) -> None:
        n = p.numel()
        self.slot_of[id(p)] = (len(self.params), self.numel, n)
        self.params.append((p, self.numel, n))
        self.shapes.append(p.shape)
        self.numel += n
        if p.requires_grad:
            self.n_trainable += 1

    def flat_values(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The unit's current parameter values as one fp32 vector (for registration): from
        zero.Init's store for parameters built under it (read straight into the vector), else from
        the parameter itself. Into `out` when given (a contiguous fp32 tensor of numel elements;
        initialize gives one in a mapping of its own), else a new one; returns it."""
        if out is None:
            out = torch.empty(self.numel, dtype=torch.float32)
        for p, off, n in self.params:
            if take_stored(p, out[off:off + n]) is None:
                out[off:off + n].copy_(p.detach().reshape(-1))
        return out

    def held_values(self) -> Optional[torch.Tensor]:
        """A unit of one parameter whose values are a contiguous fp32 CPU tensor in memory already
        (the model's own, or zero.Init's host memory copy): that tensor, flattened, not a copy, for
        registration to read from where it is (flat_values' vector beside it was a second copy of
        the largest units: +0.13 GiB at the 246 M Llama's embedding, issue 57). The caller must
        not write it. Else None."""
        if len(self.params) != 1:
            return None
        t = held_in_memory(self.params[0][0])
        if t is None or t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            return None
        return t.detach().reshape(-1)

    def set_values(self, values: torch.Tensor) -> None:
        """Replaces the unit's parameters in the engine with `values` (fp32, numel elements): the
        master weights are replaced, the working copy republished, the Adam moments kept
        (``ZeroEngine.set_module_params``)."""
        self.link.engine.set_module_params(self.index, values)

    def store(self, params: list) -> None:
        """Writes the values `params` (parameters of this unit, gathered as a copy now) hold into the
        engine: their slices of the fp32 master weights (a frozen unit: of its working values)
        replaced, the unit's other parameters left as the engine has them, the working copy
        republished. With several ranks a collective, as set_module_params is."""
        engine = self.link.engine
        full = engine.export_master(self.index)
        for p in params:
            _, off, n = self.slot_of[id(p)]
            full[off:off + n].copy_(raw_data(p).reshape(-1))
        engine.set_module_params(self.index, full)

    # ------------------------------------------------------------------------------ gather / release
    def is_gathered(self) -> bool:
        """Whether its next use needs no gather from the engine (in use, or the last backward
        gather is still held)."""
        return self.flat is not None or (self.bw_flat is not None and self.bw_flat() is not None)

    def gather(self, phase: Optional[str] = None, copy: bool = False) -> torch.Tensor:
        """Points the parameters at the gathered unit (`phase` default: the pass running now;
        `copy`: a copy the engine does not pin, as zero.GatheredParameters shows); returns it."""
        if self.flat is None:
            link = self.link
            self._undo_replacements()
            flat = link.to_compute(link.engine_gather(self, phase or link.phase()), copy)
            self.flat = flat
            self.copied = copy
            for p, off, n in self.params:
                set_raw_data(p, flat[off:off + n].view(p.shape))
        return self.flat

    def prefetch(self, phase: str) -> None:
        """Starts the engine's all-gather of this unit for its coming use in `phase` (several ranks),
        unless its next use will not call the engine."""
        if self.is_gathered():
            return
        ops = self.link.dist_ops
        ops.unit = self.index
        try:
            self.link.engine.prefetch_gather(self.index, phase)
        finally:
            ops.unit = -1

    def acquire(self, phase: Optional[str] = None, copy: bool = False) -> None:
        """gather, and one more user: the unit stays gathered until each user calls drop."""
        self.gather(phase, copy)
        self.active += 1

    def drop(self) -> None:
        """One user fewer; the last one releases the unit."""
        self.active -= 1
        if self.active == 0:
            self.release()

    def _undo_replacements(self) -> None:
        """A released parameter still holds its placeholder: one whose ``.data`` was replaced since
        (``p.data = t``, ``module.half()``) would be pointed at the gathered unit again, the change
        lost without a word."""
        if not self.released:  # not given back yet since the model's own values (registration)
            return
        # A Parameter object replaced (module.weight = nn.Parameter(...)) would be computed with and
        # never trained: the registered one is put back.
        swapped = [(i, mod, key) for i, mod, key in self.holders if mod._parameters.get(key) is not self.params[i][0]]
        for i, mod, key in swapped:
            mod._parameters[key] = self.params[i][0]
        if swapped:
            i, mod, key = swapped[0]
            raise RuntimeError(f"tiermem.torch: {type(mod).__name__}.{key} (parameter {i} of {self.name!r}) was replaced "
                               "by another object after initialize, which is undone: the engine trains the registered "
                               "parameter. Change its values inside `with tiermem.torch.zero.GatheredParameters(params, "
                               "modifier_rank=0):` instead")
        link = self.link
        replaced = []
        for i, (p, _, _) in enumerate(self.params):
            held = raw_data(p)
            if held.dtype != link.working_dtype or held.shape != self.shapes[i] or not holds_placeholder(held):
                replaced.append((i, tuple(held.shape), held.dtype))
        if replaced:
            self.release()  # every parameter back on its placeholder: the engine's values stand, usable again
            i, shape, dtype = replaced[0]
            raise RuntimeError(f"tiermem.torch: parameter {i} of {self.name!r} had its .data replaced ({shape} {dtype}) "
                               "after initialize, which is undone: the engine holds its values. Change parameters "
                               "inside `with tiermem.torch.zero.GatheredParameters(params, modifier_rank=0):`, and keep "
                               "the model's dtype")

    def release(self) -> None:
        """The parameters' ``.data`` become placeholders again (the gathered memory goes when the
        last view of it does)."""
        self.flat = None
        self.copied = False
        self.released = True
        link = self.link
        for (p, _, _), shape in zip(self.params, self.shapes):
            set_raw_data(p, placeholder(shape, link.working_dtype, link.compute_device))

    def lend(self, own: bool) -> tuple[list, int]:
        """Once registered in an engine that gives its values back exactly (initialize,
        _register.py): each parameter's values are freed now, not when every unit is registered,
        so the model and the engine's homes are never both held whole: zero.Init's copy in host
        memory (lend_stored), or, with `own`, the model's own tensor (a placeholder in its place).
        Returns what give_back needs per parameter ("stored", (dtype, device), or None: kept) and
        the bytes freed."""
        kept, nbytes = [], 0
        for (p, _, n), shape in zip(self.params, self.shapes):
            if p.__dict__.get("_tm_init_store") is not None:
                kept.append("stored" if lend_stored(p) else None)
            elif own:
                kept.append((p.dtype, p.device))
                set_raw_data(p, placeholder(shape, self.link.working_dtype, self.link.compute_device))
            else:
                kept.append(None)
            nbytes += n * p.element_size() if kept[-1] is not None else 0
        return kept, nbytes

    def give_back(self, values: torch.Tensor, kept: list) -> None:
        """A failed initialize: what lend freed gets its values back (`values`: the unit's fp32
        values read back from the engine), into zero.Init's store or as the parameter's own tensor
        in the dtype and on the device it had."""
        for (p, off, n), shape, k in zip(self.params, self.shapes, kept):
            if k == "stored":
                give_back_stored(p, values[off:off + n])
            elif k is not None:
                set_raw_data(p, values[off:off + n].view(shape).to(device=k[1], dtype=k[0], copy=True))

    def backward_flat(self) -> torch.Tensor:
        """The gathered unit for a tensor autograd saved: the unit in use, else the last backward
        gather while something holds it, else a new one (phase "backward")."""
        flat = self.flat
        if flat is None:
            flat = self.bw_flat() if self.bw_flat is not None else None
            if flat is None:
                link = self.link
                flat = link.to_compute(link.engine_gather(self, "backward"))
                self.bw_flat = weakref.ref(flat)
        return flat

    # ------------------------------------------------------------------------------ gradients
    def accumulate_grad(self, p: torch.nn.Parameter, g: torch.Tensor) -> None:
        """Adds parameter `p`'s gradient `g` (which nothing else holds now) to the buffer; the last
        trainable parameter's reduces the unit."""
        if self.grad is None and self.n_trainable == 1 and g.numel() == self.numel and \
                g.dtype == torch.float32 and g.is_contiguous() and g.device.type == "cpu":
            # A unit of one parameter (GPT-2's tied wte: 154 MB) reduces autograd's own gradient,
            # which nothing else holds now: no second buffer, no copy.
            self.grad = g.detach().view(-1)
            self.got = {0}
            self.received = 1
            self.reduce_grad()
            return
        if self.grad is None:
            # Not zeroed: each parameter's slice is written by its first gradient, and the slices
            # of parameters that got none are zeroed when the unit is reduced without them.
            self.grad = torch.empty(self.numel, dtype=torch.float32)
            self.got = set()
        i, off, n = self.slot_of[id(p)]
        dst = self.grad[off:off + n]
        src = g.detach().reshape(-1)
        if i not in self.got:
            dst.copy_(src)  # converts bf16/fp16 gradients to fp32 (and copies a CUDA one out) in one pass
            self.got.add(i)
        else:
            dst.add_(src.to(device=dst.device, dtype=torch.float32))
        self.received += 1
        if self.received == self.n_trainable:
            self.reduce_grad()

    def reduce_grad(self) -> None:
        """Hands the buffer to the engine's reduce path (slices no gradient reached are zero)."""
        grad, self.grad = self.grad, None
        if len(self.got) < len(self.params):
            for i, (_, off, n) in enumerate(self.params):
                if i not in self.got:
                    grad[off:off + n].zero_()
        self.received = 0
        self.got = set()
        # Lent, not copied: the engine adds it into the partitions on its gradient thread while
        # backward goes on, and lets go of it once done (nothing here writes it again).
        self.link.engine.reduce_gradients(self.index, grad, lend=True)

    def forget_backward(self) -> None:
        """A backward that raised: its partial gradient buffer and backward gather are let go."""
        self.grad = None
        self.received = 0
        self.got = set()
        self.bw_flat = None

    def end_backward(self) -> None:
        """The end of a backward: a buffer still here (some of its parameters got no gradient: they
        add zero) is reduced, and the backward gather is let go."""
        if self.grad is not None:
            self.reduce_grad()
        self.bw_flat = None


class UnitMap:
    """The units of one model and how its modules and parameters reach them."""

    def __init__(self, link: EngineLink) -> None:
        self.link = link
        self.units: list[Unit] = link.units
        self.unit_of: dict[int, tuple[Unit, torch.nn.Parameter]] = {}  # id(param) -> (unit, param)
        self.module_units: dict[int, list[Unit]] = {}  # id(module) -> units it gathers

    def numels(self) -> list[int]:
        return [u.numel for u in self.units]

    def frozen_flags(self) -> list[bool]:
        return [u.frozen for u in self.units]

    def trainable_params(self) -> list[torch.nn.Parameter]:
        return [p for u in self.units if not u.frozen for p, _, _ in u.params]


def build_units(model: torch.nn.Module, leaf_types: tuple, link: EngineLink) -> UnitMap:
    """The units of `model` (see "Units" above); raises TypeError for a parameter that is not
    floating-point."""
    m = UnitMap(link)
    seen: set[int] = set()
    skip: set[int] = set()  # modules inside a leaf: no hooks of their own
    for name, module in model.named_modules():
        if id(module) in skip:
            continue
        is_leaf = getattr(module, "_z3_leaf", False) or (leaf_types and isinstance(module, leaf_types))
        if is_leaf:
            for sub in module.modules():
                if sub is not module:
                    skip.add(id(sub))
            held = [(sub, k, p) for sub in module.modules() for k, p in sub._parameters.items() if p is not None]
        else:
            held = [(module, k, p) for k, p in module._parameters.items() if p is not None]
        params = [p for _, _, p in held]
        unit = None   # this module's trainable parameters
        funit = None  # ... and its frozen ones
        needs: list[Unit] = []
        for p in params:
            if id(p) in seen:  # tied: gather the unit that owns it
                owner = m.unit_of.get(id(p))
                if owner is not None and owner[0] not in needs and owner[0] is not unit:
                    needs.append(owner[0])
                continue
            seen.add(id(p))
            if not p.is_floating_point():
                raise TypeError(f"tiermem.torch.initialize: parameter '{_pname(module, p, name)}' is "
                                f"{p.dtype}; ZeRO pages floating-point parameters only: register it as a buffer "
                                "(module.register_buffer) instead")
            if p.requires_grad:
                if unit is None:
                    unit = Unit(len(m.units), name or "<root>", link)
                    m.units.append(unit)
                    needs.insert(0, unit)
                target = unit
            else:
                if funit is None:
                    funit = Unit(len(m.units), (name or "<root>") + "[frozen]", link, frozen=True)
                    m.units.append(funit)
                    needs.insert(1 if unit is not None else 0, funit)
                target = funit
            target.add(p)
            m.unit_of[id(p)] = (target, p)
        for sub, key, p in held:  # every module attribute holding a parameter, tied ones too
            owner = m.unit_of.get(id(p))
            if owner is not None:
                u = owner[0]
                u.holders.append((u.slot_of[id(p)][0], sub, key))
        if needs:
            m.module_units[id(module)] = needs
    return m


def _pname(module, p, prefix: str) -> str:
    for n, q in module.named_parameters():
        if q is p:
            return f"{prefix}.{n}" if prefix else n
    return prefix
