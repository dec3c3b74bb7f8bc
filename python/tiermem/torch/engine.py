"""``tiermem.torch.initialize``: ZeRO-Infinity for any torch model, with DeepSpeed's call shapes.

    engine, optimizer, _, lr_scheduler = tiermem.torch.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")
    for batch in data:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()

Under it is the C++ ``tiermem::ZeroEngine`` (the engine tiermem-train runs): parameters, fp32
gradient partitions, master weights and Adam moments are tensors of its TensorStore, homed on the
tiers the config's ``zero_optimization`` names, paged by its reuse-distance Prefetcher under its
budgets, and stepped by its sub-group AdamW. Python only hooks the modules (see ``_hooks.py``).

The model also trains torch-natively after ``initialize``: ``loss.backward()``,
``optimizer.step()``, ``optimizer.zero_grad()``, with any torch LR scheduler driving
``optimizer.param_groups[0]["lr"]`` (the HF Trainer given ``optimizers=(optimizer, scheduler)``).

Errors: ValueError for a config the parser or the engine refuses (naming the key, the value and
the rule, and the file); TypeError/ValueError for a model it cannot take (naming the parameter);
RuntimeError for calls out of order; MemoryError for a budget that cannot hold what is asked;
tiermem.IoError for I/O. A refused start writes nothing.

Thread-safety: one thread drives an engine.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import traceback
import warnings
import weakref
from typing import Iterable, Optional

import torch

from .. import _tiermem
from . import _optim_state, checkpoint
from ._config import load_config
from ._dist import DistOps, ensure_process_group, keep_frozen_out_of_ddp, launched_world_size
from ._hooks import CLOSED, ParamHooks
from ._register import register_units
from ._malloc import fix_malloc_threshold, return_freed_memory
from ._init_store import release_init_store

__all__ = ["initialize", "TiermemEngine", "ZeroOptimizer", "set_z3_leaf_modules"]

# Engines not closed yet. A script that never calls close() (DeepSpeed's users never do) still
# leaves no swap files behind: at interpreter exit each is closed here, while the modules it needs
# are still alive (objects alive at shutdown are not reliably destroyed, so the C++ engine, which
# removes its swap files and directories, would otherwise never run its destructor).
_open_engines: "weakref.WeakSet[TiermemEngine]" = weakref.WeakSet()


@atexit.register
def _close_open_engines() -> None:
    tb = getattr(sys, "last_traceback", None)
    if tb is not None and len(_open_engines):
        # The script ended with an uncaught exception: its traceback (kept for post-mortem
        # debugging) holds its frames' locals through exit, a unit's gathered memory among them when
        # it was raised inside a torch call on a parameter. The engine, and so its swap files, would
        # outlive close(); at exit nothing reads those locals again.
        traceback.clear_frames(tb)
    for engine in list(_open_engines):
        try:
            engine.close()
        except Exception as e:  # noqa: BLE001 - at exit: report, and close the others
            print(f"tiermem.torch: closing an engine at exit failed: {e}", file=sys.stderr)


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Iterable[type]) -> list:
    """Marks every module of `model` that is an instance of one of `leaf_module_classes` as one
    engine unit: its whole subtree is gathered and released together (DeepSpeed's function of the
    same name and its ``_z3_leaf`` attribute). Returns the modules marked."""
    classes = tuple(leaf_module_classes)
    marked = []
    for m in model.modules():
        if isinstance(m, classes):
            m._z3_leaf = True
            marked.append(m)
    return marked


# ---------------------------------------------------------------------------------------- model checks

def _check_model(model: torch.nn.Module) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tiermem.torch.initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, "_tiermem_engine", None) is not None:
        raise RuntimeError("tiermem.torch.initialize: this model is already managed by a tiermem engine "
                           "(initialize was called on it before); build a new model, or keep using the first engine")
    devices = {}
    for name, p in model.named_parameters():
        devices.setdefault(p.device, name)
    if len(devices) > 1:
        listed = ", ".join(f"{d} (e.g. '{n}')" for d, n in devices.items())
        raise ValueError(f"tiermem.torch.initialize: the model's parameters are on several devices: {listed}; "
                         "move the whole model to one device first (model.to(device))")
    for d, n in devices.items():
        if d.type not in ("cpu", "cuda"):
            raise NotImplementedError(
                f"tiermem.torch.initialize: parameter '{n}' is on {d}; tiermem.torch computes on CPU or CUDA tensors; "
                "move the model to one of them (model.to('cpu') or model.to('cuda'))")


# ---------------------------------------------------------------------------------------- optimizer

class ZeroOptimizer(torch.optim.Optimizer):
    """The engine's AdamW as a ``torch.optim.Optimizer`` (so torch LR schedulers, the HF Trainer
    and accelerate can drive it). It holds no state of its own: master weights and moments are in
    the engine, on their tier (state_dict() reads them out, load_state_dict() writes them back).
    ``param_groups[0]["lr"]`` is the learning rate the next ``step()`` uses (a scheduler may change
    it); betas, eps and weight_decay come from the config and are shown for reference only."""

    def __init__(self, params: list, engine: "TiermemEngine", hparams: dict) -> None:
        if not params:
            params = [torch.nn.Parameter(torch.zeros(0))]  # torch refuses an empty list
        super().__init__(params, dict(hparams))
        self._tm = engine

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._tm._optimizer_step(float(self.param_groups[0]["lr"]))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._tm._zero_grad()

    def state_dict(self) -> dict:
        """torch's layout with the engine's whole optimizer state: for each trainable parameter
        (numbered as torch numbers them) its fp32 ``master`` weights, the optimizer's moments under
        torch's names (AdamW ``exp_avg``/``exp_avg_sq``, Lion ``exp_avg``, Adagrad ``sum``) and
        ``step``; the param groups' hyper-parameters; a ``tiermem`` entry (optimizer type, skipped
        steps, fp16 loss scaler). Materialises every trainable parameter's fp32 state in host
        memory (12 bytes a parameter with AdamW), one unit at a time into the dict; for a model
        whose state does not fit, engine.save_checkpoint(dir) streams it instead. A collective with
        several ranks. See _optim_state.py."""
        return _optim_state.optimizer_state_dict(self._tm, self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores a state_dict() of this optimizer: master weights (and the working copy the
        model computes with), moments, step count and hyper-parameters, so training continues bit
        for bit. ValueError naming the parameter and key for a dict that does not fit, before
        anything changes. A dict with hyper-parameters only restores those, with a warning. A
        collective with several ranks (the same dict on every rank)."""
        _optim_state.load_optimizer_state_dict(self._tm, self, state_dict)


# ---------------------------------------------------------------------------------------- LR schedule

class DeepSpeedLR(torch.optim.lr_scheduler.LRScheduler):
    """The config's ``scheduler`` section (WarmupLR, WarmupDecayLR, WarmupCosineLR) as a torch LR
    scheduler over ``ZeroOptimizer``: optimizer step t (1-based) runs at the lr DeepSpeed's engine
    gives it (iteration t - 2, clamped at 0), computed by tiermem's schedule functions (the ones
    tiermem-train uses: lr_schedule.h's lr_at_optimizer_step)."""

    def __init__(self, optimizer: ZeroOptimizer, config, peak_lr: float) -> None:
        self._config = config
        self._peak = peak_lr
        super().__init__(optimizer)

    def get_lr(self):
        t = self.last_epoch + 1  # last_epoch: optimizer steps taken so far
        return [_tiermem.lr_at(self._config, self._peak, t) for _ in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "_config")}


# ---------------------------------------------------------------------------------------- engine

def _frozen_at_rest(st: dict, n_frozen: int) -> str:
    """The summary's words for how the frozen base is stored (tiermem.frozen_dtype): never silent
    when there is one. '' without frozen parameters."""
    if n_frozen == 0:
        return ""
    words = {"working": "the working dtype", "bf16": "bf16",
             "int8": "int8 (per-128 absmax, dequantized at gather)"}[st["frozen_dtype"]]
    b = st["frozen_param_bytes"]
    size = "" if not b else f", {b / 1e9:.2f} GB" if b >= 1e9 else f", {b / 1e6:.1f} MB"
    return f"; frozen base at rest: {words}{size}"


class TiermemEngine:
    """What ``initialize`` returns first: the model with DeepSpeed's engine calls.

    ``engine(*args, **kwargs)`` runs the model; ``backward(loss)`` scales the loss (fp16 loss
    scale, 1 / gradient_accumulation_steps) and runs backward; ``step()`` counts the micro-batch
    and, at the accumulation boundary, clips, steps AdamW (the engine's, on its tier) and the LR
    scheduler. ``module`` is the user's model."""

    def __init__(self, model: torch.nn.Module, config_obj, config: dict, leaf_types: tuple = (),
                 lr_scheduler=None, quiet: bool = False,
                 has_optimizer: bool = True) -> None:
        self.module = model
        self.config = config
        self._config_obj = config_obj
        self.gradient_accumulation_steps = int(config["gradient_accumulation_steps"])
        self.train_micro_batch_size_per_gpu = int(config["train_micro_batch_size_per_gpu"])
        self.gradient_clipping = float(config["gradient_clipping"])
        self._update_in_backward = bool(config.get("tiermem", {}).get("update_in_backward", False))
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._backwards_since_step = 0
        self._backwards = 0  # backward passes of this engine, and their count at the last step() call
        self._backwards_at_step = 0
        self._closed = False
        self.bf16 = bool(config["bf16"]["enabled"])
        self.fp16 = bool(config["fp16"]["enabled"])
        dtype = torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32
        if dtype == torch.float32:  # (with bf16/fp16 enabled, casting the model is what the user asked)
            others = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()
                             if p.is_floating_point() and p.dtype != torch.float32})
            if others:
                halves = [o for o in others if o in ("bfloat16", "float16")]
                advice = ("enable 'bf16' or 'fp16' in the config to train in " + " or ".join(halves) if halves else
                          "tiermem trains in float32, bfloat16 or float16 only")
                warnings.warn(f"tiermem.torch.initialize: the config trains in float32 (neither 'bf16' nor 'fp16' is "
                              f"enabled), so the model's {' and '.join(others)} parameters become float32 and its "
                              f"inputs must be float32 (cast them with .float()); {advice}", stacklevel=3)

        self._hooks = ParamHooks(model, leaf_types)
        units = self._hooks.units
        numels = units.numels()
        frozen = units.frozen_flags()
        if not numels:
            raise ValueError("tiermem.torch.initialize: the model has no floating-point parameters")
        # A model with nothing to train (an RL reference model, a teacher) gets a forward-only
        # engine; asking to optimize it is a contradiction, said before anything is written.
        self.forward_only = all(frozen)
        if self.forward_only and has_optimizer:
            raise ValueError("tiermem.torch.initialize: every parameter of the model has requires_grad=False, but the "
                             "config has an 'optimizer' section: remove it for a forward-only engine (a reference "
                             "model), or unfreeze the parameters to train")
        # Construction plans for the modules' sizes and checks budgets and directories: a refused
        # start raises here, before anything is written.
        ops = None
        if torch.distributed.is_available() and torch.distributed.is_initialized() and \
                torch.distributed.get_world_size() > 1:
            ops = DistOps()
        self._zero = _tiermem.ZeroEngine(config_obj, numels, mean_over_micro_batches=False,
                                         comm="torch" if ops is not None else "single", dist_ops=ops,
                                         frozen=frozen)
        _open_engines.add(self)
        if ops is not None:
            ops.unit_names = [u.name for u in units.units]
        # One unit at a time, each unit's values freed once it is in the engine where that is exact;
        # a failed registration gives them back (_register.py).
        register_units(self._zero, units.units, config)
        # Only now, with every unit in the engine, does the model give up its own copies: an
        # initialize that fails above leaves the model as it was.
        for u in units.units:
            u.release()
        release_init_store(model)
        # The model's own copies (or zero.Init's store in host memory) are free now: glibc would keep
        # them in its heap, a second model's worth of RSS beside the engine's.
        return_freed_memory()
        # Buffers keep the dtype they have: a bf16 or fp16 config casts the parameters, never the
        # buffers, as DeepSpeed 0.19.8's engine does without a buffer_dtype. A model's fp32 buffer
        # (Llama's rotary inv_freq) rounded to bf16 moved the loss and changed generated tokens.
        self._hooks.attach(self._zero, dtype, ops, forward_only=self.forward_only)
        fix_malloc_threshold(int(self._zero.stats()["host_budget_bytes"]))
        self._hooks.on_backward = self._note_backward
        model._tiermem_engine = self

        opt = config["optimizer"]["params"]
        hparams = dict(lr=float(opt["lr"]), betas=tuple(opt["betas"]), eps=float(opt["eps"]),
                       weight_decay=float(opt["weight_decay"]))
        self.optimizer = None if self.forward_only else ZeroOptimizer(units.trainable_params(), self, hparams)
        if self.forward_only:
            lr_scheduler = None
        elif lr_scheduler is None and config.get("scheduler", {}).get("type"):
            lr_scheduler = DeepSpeedLR(self.optimizer, config_obj, hparams["lr"])
        elif callable(lr_scheduler) and not isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
            lr_scheduler = lr_scheduler(self.optimizer)
        self.lr_scheduler = lr_scheduler
        if not quiet:
            st = self._zero.stats()
            n_frozen = sum(n for n, f in zip(numels, frozen) if f)
            if self.forward_only:  # no optimizer state, gradients or master weights to place
                # tiermem.prefetch_eviction as written, and what the engine resolved it to (stats()).
                eviction = str(config.get("tiermem", {}).get("prefetch_eviction", "auto")).lower()
                resolved = st["prefetch_eviction"]
                homes = (f"params -> {st['param_home']} ({self._zero.working_dtype()}, forward only: no optimizer; "
                         f"prefetch_eviction {eviction}" + (f" = {resolved}" if eviction == "auto" else "") + ")")
            else:
                # Below stage 3 the parameters are not partitioned: they stay the model's own tensors.
                params = (st['param_home'] if config['zero_optimization']['stage'] >= 3
                          else "the model's own (not partitioned below stage 3)")
                homes = (f"params -> {params}, optimizer -> {st['optimizer_home']}, gradients -> "
                         f"{st['gradient_home']} ({self._zero.working_dtype()} working params, fp32 master weights)")
                if not has_optimizer:  # trained with hyper-parameters the user never wrote: say which
                    homes += (f"; AdamW lr {hparams['lr']:g}, betas {hparams['betas']}, eps {hparams['eps']:g}, "
                              f"weight_decay {hparams['weight_decay']:g}: the defaults, the config has no "
                              f"'optimizer' section")
            print(f"tiermem.torch: {len(numels)} engine modules, {sum(numels)} parameters ({n_frozen} frozen), stage "
                  f"{config['zero_optimization']['stage']}: {homes}{_frozen_at_rest(st, n_frozen)}", file=sys.stderr)

    # -------------------------------------------------------------------- DeepSpeed's calls
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        self.check_open()
        self._require_trainable("backward")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("TiermemEngine.backward: loss must be a scalar tensor")
        if not loss.requires_grad:
            raise RuntimeError(f"TiermemEngine.backward: {_UNREACHED} (it does not require grad: computed under "
                               "torch.no_grad(), detached, or a constant); nothing was run")
        if loss.grad_fn is None and not self._hooks.is_param(loss):
            raise RuntimeError(f"TiermemEngine.backward: {_UNREACHED} (it is a leaf tensor, made by no computation); "
                               "nothing was run")
        scale = self._zero.loss_scale() / self.gradient_accumulation_steps
        self._hooks.forget_failed_backward()
        if self.is_gradient_accumulation_boundary() and self.optimizer is not None and self._update_in_backward:
            if self._armed_lr is not None and self._zero.updated_in_backward() > 0:
                raise RuntimeError("TiermemEngine.backward: a second backward() at the accumulation boundary before "
                                   "the optimizer step: the first one already updated modules whose gradients were "
                                   "complete (tiermem.update_in_backward); call step() after each micro-batch's "
                                   "backward(), or set tiermem.update_in_backward to false to run several backward "
                                   "passes per step")
            self._boundary_backward = True
            # The step's learning rate is known now: each module's update may run during this
            # backward, once its gradient is complete (ZeroEngine::step_in_backward).
            lr = float(self.optimizer.param_groups[0]["lr"])
            if self._zero.step_in_backward(lr):
                self._armed_lr = lr
        counted = self._backwards
        try:
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        except BaseException:
            self._hooks.forget_failed_backward()  # its end-of-backward never runs
            raise
        if self._backwards == counted:  # no gradient of a trainable parameter arrived (cheap: a counter)
            raise RuntimeError(f"TiermemEngine.backward: {_UNREACHED}; this backward added no gradient and is not "
                               "counted")
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def step(self) -> None:
        self.check_open()
        self._require_trainable("step")
        # Each micro-batch's step() follows its backward(): a step() with none since the last one
        # would count a micro-batch that added no gradient (at the boundary, step on part of them).
        if self._backwards == self._backwards_at_step:
            if self._backwards == 0:
                raise RuntimeError("TiermemEngine.step: called before any backward() that reached the model's "
                                   "trainable parameters; run engine.backward(loss) first, with the loss computed from "
                                   "the model's output")
            raise RuntimeError("TiermemEngine.step: no backward() since the last step() reached the model's trainable "
                               "parameters; call step() once after each micro-batch's engine.backward(loss)")
        if self.is_gradient_accumulation_boundary():
            self.optimizer.step()
            if self.lr_scheduler is not None and not self._last_skipped:
                self.lr_scheduler.step()
        self._backwards_at_step = self._backwards  # after the step: one that raised can be called again
        self.micro_steps += 1

    def zero_grad(self) -> None:
        self._zero_grad()

    def train(self, mode: bool = True) -> "TiermemEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "TiermemEngine":
        self.module.eval()
        return self

    def to(self, *args, **kwargs) -> "TiermemEngine":
        """``module.to(...)`` (DeepSpeed's engine is a Module); returns the engine. A move to
        another device than the model's is a RuntimeError and moves nothing."""
        self.module.to(*args, **kwargs)
        return self

    def get_lr(self) -> list[float]:
        self.check_open()
        self._require_trainable("get_lr")
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def offload_states(self, include=None, device=None, pin_memory: bool = True, non_blocking: bool = False) -> int:
        """DeepSpeed's ``engine.offload_states`` (RL colocation: memory for an inference engine
        between training phases): every dirty tensor is written to its home tier and the copies
        cached above it are dropped; the host pool's free pages, the device's cache and the heap's
        free memory go back to the OS. State homed on NVMe leaves memory entirely; what is homed in
        host memory (offload "cpu", stages 0-2) stays. ``include``, ``device``, ``pin_memory`` and
        ``non_blocking`` are accepted for DeepSpeed's signature: tiermem always offloads everything
        the engine may, to each tensor's own home. Returns the bytes dropped. Call between steps."""
        self.check_open()
        if self._hooks.gathered_scopes_open():
            raise RuntimeError("TiermemEngine.offload_states: inside zero.GatheredParameters; leave the with-block first")
        return int(self._zero.offload_states())

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's ``engine.reload_states``: after ``offload_states`` training goes on where it
        was, bit for bit. Nothing is copied here: the next forward and step read what they need
        back from each tensor's home, ahead of use by the engine's recorded trace."""
        self.check_open()

    def gradients_ready(self) -> bool:
        """A backward has finished since the last optimizer step: the engine holds gradients the
        next step will use (tiermem.torch.utils.safe_get_full_grad reads them)."""
        return self._backwards_since_step > 0 and not self._hooks.backward_pending

    def get_global_grad_norm(self) -> Optional[float]:
        return self._last_grad_norm

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True) -> str:
        """Writes save_dir/tag (default "global_step<N>"): this rank's optimizer state streamed from
        its tier, checksummed, crash-safe; returns the directory (see checkpoint.py)."""
        return checkpoint.save_checkpoint(self, save_dir, tag, client_state, save_latest)

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False):
        """Restores a checkpoint of this model (tag default: save_dir/latest); returns
        (path, client_state). The run then continues bit for bit."""
        return checkpoint.load_checkpoint(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                                          load_module_only)

    def save_fp32_model(self, path: str) -> int:
        """The consolidated fp32 state dict (DeepSpeed's zero_to_fp32) written to `path`, unit by
        unit: ``model.load_state_dict(torch.load(path))`` restores the trained weights."""
        return checkpoint.save_fp32_state_dict(self, path)

    def stats(self) -> dict:
        """The engine's counters (bytes per tier, peaks, traffic, prefetches): ZeroStats. With
        several ranks also comm_blocked_s (seconds the training thread waited in collectives, the
        communication compute did not hide) and comm_calls. RuntimeError after close()."""
        self.check_open()
        st = self._zero.stats()
        ops = self._hooks.dist_ops()
        if ops is not None:
            st.update(ops.stats())
        return st

    def close(self) -> None:
        """Ends the engine: its swap files go once the last gathered tensor is freed. The model
        cannot run afterwards."""
        if not self._closed:
            self._hooks.release_all()  # units an interrupted forward left gathered
            self._hooks.detach()
            self._hooks.mark_closed()
            self._zero.close()
            self._closed = True
            self.module._tiermem_engine = None
            self.module.register_forward_pre_hook(_closed_model)

    def __reduce_ex__(self, protocol):
        return self._hooks.__reduce_ex__(protocol)  # the same TypeError

    # -------------------------------------------------------------------- state (checkpoint.py's interface)
    # What a checkpoint reads and restores, besides the public attributes above (module, config,
    # optimizer, lr_scheduler, global_steps, micro_steps, skipped_steps). One thread, as every call.

    def check_open(self) -> None:
        """Raises RuntimeError when the engine was closed."""
        if self._closed:
            raise RuntimeError("TiermemEngine: the engine was closed")

    def _require_trainable(self, call: str) -> None:
        if self.forward_only:
            raise RuntimeError(f"TiermemEngine.{call}: this engine runs forward only (every parameter of the model is "
                               "frozen and the config has no 'optimizer' section): it has nothing to train")

    @property
    def global_rank(self) -> int:
        """This process's rank among the engine's ranks (0 with one)."""
        return self._zero.rank()

    @property
    def world_size(self) -> int:
        """How many ranks the engine runs on."""
        return self._zero.world_size()

    @property
    def units(self) -> list:
        """The engine modules in engine order (``_unit.Unit``: ``index``, ``name``, ``numel``, and
        ``params``: (parameter, offset, numel) in the unit's flat vector). Read only."""
        return self._hooks.unit_list()

    @property
    def working_dtype(self) -> str:
        """The engine's name for the working parameters' dtype ("f32", "bf16", "f16")."""
        return self._zero.working_dtype()

    @property
    def optimizer_home(self) -> str:
        """The tier this rank's optimizer state lives on ("device", "host", "nvme")."""
        return self._zero.stats()["optimizer_home"]

    @property
    def optimizer_shard_numel(self) -> int:
        """Elements of this rank's shard of the optimizer state (each of master weights, exp_avg,
        exp_avg_sq is that many fp32 values)."""
        return self._zero.shard_numel()

    def export_optimizer_state(self, sink) -> dict:
        """Streams this rank's optimizer state out, one sub-group at a time: ``sink(offset, master,
        exp_avg, exp_avg_sq)`` gets fp32 arrays valid during the call only, `offset` in elements of
        the shard. Returns the header (world size, rank, module sizes, alignment, step counts, loss
        scaler) that import_optimizer_state needs back."""
        return self._zero.export_state(sink)

    def import_optimizer_state(self, header: dict, source) -> None:
        """Restores this rank's optimizer state from a header of export_optimizer_state (its rank
        and world size this engine's): ``source(offset, master, exp_avg, exp_avg_sq)`` fills the
        fp32 arrays of one sub-group. The working parameters are republished from the master
        weights."""
        self._zero.import_state(header, source)

    def master_weights(self, unit: int) -> torch.Tensor:
        """Engine module `unit`'s full fp32 master weights, as a new tensor (all-gathered with several
        ranks: a collective, every rank calls it). A frozen unit has no master: its working values
        as fp32."""
        return self._zero.export_master(unit)

    # -------------------------------------------------------------------- internals
    _last_skipped = False
    _last_grad_norm: Optional[float] = None
    _armed_lr: Optional[float] = None  # a boundary backward declared the step at this lr (update_in_backward)
    _boundary_backward = False  # engine.backward ran at the boundary since the last optimizer step
    _warned_native_backward = False

    def _optimizer_step(self, lr: float) -> None:
        self.check_open()
        if self._hooks.gathered_scopes_open():
            raise RuntimeError("tiermem.torch: optimizer step inside zero.GatheredParameters: the parameters shown there "
                               "are a copy the step would not update; leave the with-block first")
        if self._backwards_since_step == 0:
            raise RuntimeError("tiermem.torch: optimizer step before any backward(); the gradients of this step are "
                               "all missing (call loss.backward() or engine.backward(loss) first, with the loss "
                               "computed from the model's output: a backward that reaches none of its trainable "
                               "parameters adds nothing)")
        self._hooks.unwind_interrupted()  # a forward a KeyboardInterrupt ended holds units gathered
        if self._armed_lr is not None and lr != self._armed_lr:
            warnings.warn(f"tiermem.update_in_backward: the learning rate changed from {self._armed_lr} to {lr} between "
                          f"the boundary's backward and the optimizer step; modules were updated in backward with "
                          f"{self._armed_lr}, so this whole step uses it", stacklevel=_caller_level())
        if self._update_in_backward and not self._boundary_backward and not self._warned_native_backward:
            self._warned_native_backward = True
            warnings.warn("tiermem.update_in_backward is on, but this step's backward did not run through "
                          "engine.backward(loss) at the accumulation boundary (loss.backward() directly): its updates "
                          "ran in the optimizer step. Call engine.backward(loss) to update in backward",
                          stacklevel=_caller_level())
        self._zero.set_learning_rate(lr)
        r = self._zero.step()
        self._armed_lr = None
        self._boundary_backward = False
        self._backwards_since_step = 0
        self._last_skipped = bool(r["skipped"])
        self._last_grad_norm = float(r["grad_norm"])
        if r["skipped"]:
            self.skipped_steps += 1
        else:
            self.global_steps += 1

    def _zero_grad(self) -> None:
        self.check_open()
        self._zero.zero_grad()

    def _note_backward(self) -> None:
        self._backwards_since_step += 1
        self._backwards += 1


# The torch and tiermem packages' directories (warnings name the first frame outside them).
_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
                 os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


def _caller_level() -> int:
    """warnings.warn's stacklevel, called from a tiermem.torch function, that names the user's line:
    the first frame outside the tiermem and torch packages (the optimizer step passes through
    torch's wrappers)."""
    f, level = sys._getframe(1), 1  # the caller of this function is stacklevel 1
    while f is not None and f.f_code.co_filename.startswith(_LIBRARY_DIRS):
        f, level = f.f_back, level + 1
    return level


def _declares_optimizer(config) -> bool:
    """Whether the user's config (a dict or a JSON path, already parsed once by load_config) has an
    'optimizer' section: a frozen-only model without one gets a forward-only engine."""
    if isinstance(config, dict):
        return "optimizer" in config
    with open(os.fspath(config), encoding="utf-8") as f:
        doc = json.load(f)
    return isinstance(doc, dict) and "optimizer" in doc


_UNREACHED = ("the loss reached none of the model's trainable parameters: compute it from the output of "
              "engine(...) (or the model), not from tensors detached from it or from frozen parameters only")


def _closed_model(module, args):
    raise RuntimeError(CLOSED)


def initialize(args=None, model: Optional[torch.nn.Module] = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None,
               config=None, config_params=None, leaf_modules: Iterable[type] = ()):
    """DeepSpeed's ``deepspeed.initialize``: returns ``(engine, optimizer, training_dataloader,
    lr_scheduler)``.

    - ``config`` (or ``config_params``, or ``args.deepspeed_config``): a ds_config path or dict.
    - ``optimizer`` must be None: the optimizer is the engine's AdamW from the config's
      ``optimizer`` section (Adam/AdamW; lr, betas, eps, weight_decay).
    - ``lr_scheduler``: None (the config's ``scheduler`` section, if any), a torch LR scheduler
      built over the returned optimizer, or a callable taking the optimizer.
    - ``training_data``: a torch Dataset, returned as a DataLoader of
      ``train_micro_batch_size_per_gpu`` (with ``collate_fn``).
    - ``model_parameters`` is accepted for compatibility: every trainable parameter of ``model``
      is trained; the frozen ones are paged as frozen units (no optimizer state).
    - ``leaf_modules``: classes whose instances are gathered as one unit (set_z3_leaf_modules).
    """
    if model is None:
        raise ValueError("tiermem.torch.initialize: model is required")
    if optimizer is not None:
        raise ValueError("tiermem.torch.initialize: pass optimizer=None; tiermem's optimizer is the engine's AdamW on its "
                         "tier, configured by the config's 'optimizer' section (type, params.lr, betas, eps, weight_decay)")
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    if config is None:
        raise ValueError("tiermem.torch.initialize: no config given (config=ds_config.json or a dict)")
    _check_model(model)
    world = launched_world_size()
    if world > 1:
        ensure_process_group()
    if leaf_modules:
        set_z3_leaf_modules(model, leaf_modules)
    config_obj, cfg = load_config(config, model, world)
    engine = TiermemEngine(model, config_obj, cfg, lr_scheduler=lr_scheduler,
                           has_optimizer=_declares_optimizer(config))
    keep_frozen_out_of_ddp(model)
    loader = None
    if training_data is not None:
        loader = torch.utils.data.DataLoader(training_data, batch_size=engine.train_micro_batch_size_per_gpu,
                                             collate_fn=collate_fn, shuffle=False)
    return engine, engine.optimizer, loader, engine.lr_scheduler
