"""tiermem for PyTorch: AdamW optimizers over tiermem's SIMD kernel, with optional NVMe offload.

    from tiermem.torch import CPUAdamW, NVMeAdamW
    opt = CPUAdamW(model.parameters(), lr=3e-4)                          # torch.optim.AdamW, faster
    opt = NVMeAdamW(model.parameters(), lr=3e-4, nvme_path="/mnt/nvme0")  # state on NVMe

Both are ``torch.optim.Optimizer`` subclasses that update CPU parameters in place with tiermem's
AdamW kernel (tiermem/adam.h: AVX-512/AVX2/scalar chosen at run time, OpenMP threads; the same
formula as torch.optim.AdamW, all arithmetic fp32). Hyper-parameters are DeepSpeedCPUAdam's: lr,
betas, eps, weight_decay, bias_correction, adamw_mode (True: decoupled weight decay as AdamW;
False: L2, weight_decay * param added to the gradient as in Adam). amsgrad and maximize are not
supported (ValueError). Defaults are torch.optim.AdamW's (weight_decay=1e-2; DeepSpeedCPUAdam's is
0, pass it explicitly when porting).

Parameters must be CPU tensors; CPUAdamW steps float32 parameters, NVMeAdamW also bfloat16/float16
ones (it keeps their fp32 master on NVMe). Gradients may be any float dtype (converted to fp32).

Thread-safety: an optimizer is used from one thread at a time, as any torch optimizer; the kernel
and the I/O run with the GIL released.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Iterable

import torch

from .. import _tiermem, locked_array

__all__ = ["CPUAdamW", "NVMeAdamW"]

# bias_correction=False: a step so large that beta**step is 0.0 in double for every beta < 1, so
# both corrections are exactly 1 (tiermem's kernel always applies them).
_NO_BIAS_CORRECTION_STEP = 1 << 62


def _check_hparams(lr: float, betas: tuple[float, float], eps: float, weight_decay: float, amsgrad: bool) -> None:
    if not lr >= 0.0:
        raise ValueError(f"invalid learning rate (lr): {lr}")
    if not eps >= 0.0:
        raise ValueError(f"invalid epsilon (eps): {eps}")
    if len(betas) != 2 or not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"invalid betas: {betas} (each must be in [0, 1))")
    if not weight_decay >= 0.0:
        raise ValueError(f"invalid weight_decay: {weight_decay}")
    if amsgrad:
        raise ValueError("amsgrad=True is not supported by tiermem's AdamW kernel")


def _kernel_step(group: dict, step: int) -> int:
    return step if group["bias_correction"] else _NO_BIAS_CORRECTION_STEP


def _prepare_grad(p: torch.Tensor, grad: torch.Tensor, group: dict, where: str) -> tuple[torch.Tensor, float]:
    """fp32, contiguous gradient (a copy only when needed) and the kernel's decoupled decay."""
    if grad.is_sparse:
        raise ValueError(f"{where}: sparse gradients are not supported")
    if grad.device.type != "cpu":
        raise ValueError(f"{where}: gradient is on {grad.device}; tiermem optimizers step CPU tensors")
    grad = grad.detach()
    if grad.dtype != torch.float32:
        grad = grad.float()
    if not grad.is_contiguous():
        grad = grad.contiguous()
    wd = float(group["weight_decay"])
    if not group["adamw_mode"] and wd != 0.0:
        grad = grad.add(p.detach().float(), alpha=wd)  # Adam's L2: the decay goes through m and v
        wd = 0.0
    return grad, wd


def _check_param(p: torch.Tensor, where: str, dtypes: tuple) -> None:
    if p.device.type != "cpu":
        raise ValueError(f"{where}: parameter is on {p.device}; tiermem optimizers step CPU parameters")
    if p.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{where}: parameter dtype {p.dtype} is not supported ({names})")
    if not p.is_contiguous():
        raise ValueError(f"{where}: parameter is not contiguous")


def _complete_groups(opt: torch.optim.Optimizer) -> None:
    """After loading a state dict (possibly torch.optim.AdamW's, whose groups lack our keys): fill
    missing hyper-parameters from the defaults and refuse the options the kernel lacks."""
    for gi, group in enumerate(opt.param_groups):
        for key, value in opt.defaults.items():
            group.setdefault(key, value)
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(f"load_state_dict: param_groups[{gi}] has {flag}=True, which tiermem's AdamW "
                                 "kernel does not support")


class CPUAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW on tiermem's SIMD AdamW kernel (DeepSpeedCPUAdam's interface).

    State per parameter as torch.optim.AdamW: ``step`` (float32 scalar tensor), ``exp_avg`` and
    ``exp_avg_sq`` (float32, the parameter's shape), so state dicts move between the two.
    On float32 parameters the results equal torch.optim.AdamW's within 1e-6 relative (FMA
    rounding only).

    ``step(closure=None, fp16_param_groups=None)``: fp16_param_groups, when given, is a list (one
    per param group) of lists of bfloat16/float16 CPU tensors, one per parameter with the same
    element count; each receives the rounded new parameter in the same pass over memory (the fused
    copy DeepSpeed uses to feed the half-precision model).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        bias_correction: bool = True,
        adamw_mode: bool = True,
        amsgrad: bool = False,
    ) -> None:
        _check_hparams(lr, betas, eps, weight_decay, amsgrad)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, adamw_mode=adamw_mode)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """torch.optim.Optimizer's; a parameter the kernel cannot step (not float32, not on the CPU,
        not contiguous) is refused here, when it is given, rather than at the first step()."""
        gi = len(self.param_groups)
        super().add_param_group(param_group)
        for pi, p in enumerate(self.param_groups[-1]["params"]):
            try:
                _check_param(p, f"CPUAdamW: param_groups[{gi}]['params'][{pi}]", (torch.float32,))
            except ValueError:
                self.param_groups.pop()
                raise

    @torch.no_grad()
    def step(self, closure=None, fp16_param_groups=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if fp16_param_groups is not None and len(fp16_param_groups) != len(self.param_groups):
            raise ValueError(f"CPUAdamW.step: argument 'fp16_param_groups' has {len(fp16_param_groups)} groups, "
                             f"the optimizer has {len(self.param_groups)}")
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            halves = None if fp16_param_groups is None else fp16_param_groups[gi]
            if halves is not None and len(halves) != len(group["params"]):
                raise ValueError(f"CPUAdamW.step: fp16_param_groups[{gi}] has {len(halves)} tensors, "
                                 f"param group {gi} has {len(group['params'])} parameters")
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                where = f"CPUAdamW: param_groups[{gi}]['params'][{pi}]"
                _check_param(p, where, (torch.float32,))
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                grad, wd = _prepare_grad(p, p.grad, group, where)
                state["step"] += 1
                half = None if halves is None else halves[pi].detach()
                _tiermem.adam_step(p.detach(), grad, state["exp_avg"], state["exp_avg_sq"],
                                   float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                                   wd, _kernel_step(group, int(state["step"].item())), 1.0, half)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim.Optimizer's, accepting torch.optim.AdamW's state dicts too."""
        super().load_state_dict(state_dict)
        _complete_groups(self)


class _Chunk:
    """A contiguous run of one parameter's flattened elements inside a sub-group."""

    __slots__ = ("param", "start", "length", "offset")

    def __init__(self, param: torch.Tensor, start: int, length: int, offset: int) -> None:
        self.param, self.start, self.length, self.offset = param, start, length, offset


class _SubGroup:
    __slots__ = ("chunks", "elems", "extent", "initialized", "group")

    def __init__(self, group: int) -> None:
        self.chunks: list[_Chunk] = []
        self.elems = 0
        self.extent = 0
        self.initialized = False
        self.group = group


_ALIGN = 4096


def _pad(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


class NVMeAdamW(torch.optim.Optimizer):
    """AdamW whose optimizer state lives in tiermem's NVMe swap space (ZeRO-Infinity's optimizer
    offload, for any PyTorch model in one process).

    What goes to NVMe: Adam's exp_avg and exp_avg_sq (fp32) of every parameter, and for bfloat16 /
    float16 parameters also their fp32 master weights (the parameter then receives the rounded
    master after each step, fused into the kernel's pass). float32 parameters are their own master
    and are updated in place. Host memory holds only ``buffer_count`` page-locked staging buffers of
    one sub-group each (``staging_bytes``) plus the per-parameter step counts.

    Sub-groups: parameters (in param-group order) are packed into sub-groups of at most
    ``sub_group_size`` elements, a larger parameter split over several. Each sub-group is one
    extent of the swap space. ``step()`` pipelines them through the staging buffers: it reads
    sub-group i+1 from NVMe while it steps sub-group i while it writes sub-group i-1 back. A
    parameter without a gradient is skipped (its state and step count are left as they were), as
    torch.optim.AdamW does.

    Arguments beyond CPUAdamW's:
      nvme_path: a directory, or a list of them (striped); created when missing (and removed
        again with the swap files when nothing else is left in it). Each is locked (file
        ``tiermem.lock``) while the optimizer lives, so two optimizers need two directories.
        Swap files are deleted by close() or when the optimizer is garbage-collected.
      sub_group_size: elements per sub-group (default 2**24: 64 MiB of moments).
      buffer_count: staging buffers (>= 3: read, step and write in flight at once).
      block_size, queue_depth, intra_op_parallelism: the I/O engine's (as aio_handle's).
      o_direct: None (default) tries O_DIRECT and falls back to buffered I/O with a warning on
        filesystems that refuse it (tmpfs); True requires it; False never uses it.
      checksum: verify every read against an xxHash64 of what was written.

    ``state_dict()`` reads the state back from NVMe into ordinary tensors, in torch.optim.AdamW's
    format (plus ``master`` for half-precision parameters); ``load_state_dict()`` writes it to
    NVMe. A save/load round trip resumes bit for bit, and torch.optim.AdamW's state dicts load too.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        bias_correction: bool = True,
        adamw_mode: bool = True,
        amsgrad: bool = False,
        *,
        nvme_path: str | os.PathLike | list,
        sub_group_size: int = 1 << 24,
        buffer_count: int = 3,
        block_size: int = 1 << 20,
        queue_depth: int = 32,
        intra_op_parallelism: int = 1,
        o_direct: bool | None = None,
        checksum: bool = False,
    ) -> None:
        _check_hparams(lr, betas, eps, weight_decay, amsgrad)
        if not isinstance(sub_group_size, int) or sub_group_size <= 0:
            raise ValueError(f"NVMeAdamW: argument 'sub_group_size' must be a positive int (elements), got {sub_group_size!r}")
        if not isinstance(buffer_count, int) or buffer_count < 3:
            raise ValueError(f"NVMeAdamW: argument 'buffer_count' must be an int >= 3, got {buffer_count!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, adamw_mode=adamw_mode)
        super().__init__(params, defaults)
        if nvme_path is None or (isinstance(nvme_path, (list, tuple)) and not nvme_path):
            raise ValueError("NVMeAdamW: argument 'nvme_path' must name a directory (or a list of them)")
        dirs = [os.fspath(d) for d in (nvme_path if isinstance(nvme_path, (list, tuple)) else [nvme_path])]
        for d in dirs:
            if os.path.exists(d) and not os.path.isdir(d):
                raise NotADirectoryError(f"NVMeAdamW: nvme_path '{d}' is a file, not a directory")
        seen = {}
        for d in dirs:
            real = os.path.realpath(d)
            if real in seen:
                raise ValueError(f"NVMeAdamW: nvme_path lists one directory twice ('{seen[real]}' and '{d}'); "
                                 "give each directory once")
            seen[real] = d

        self._sub_groups: list[_SubGroup] = []
        self._chunks_of: dict[int, list[tuple[_SubGroup, _Chunk]]] = {}
        self._dtype_of = {id(p): p.dtype for g in self.param_groups for p in g["params"]}
        for gi, group in enumerate(self.param_groups):
            sg = None
            for pi, p in enumerate(group["params"]):
                _check_param(p, f"NVMeAdamW: param_groups[{gi}]['params'][{pi}]",
                             (torch.float32, torch.bfloat16, torch.float16))
                start, n = 0, p.numel()
                while start < n:
                    if sg is None or sg.elems == sub_group_size:
                        sg = _SubGroup(gi)
                        self._sub_groups.append(sg)
                    take = min(n - start, sub_group_size - sg.elems)
                    c = _Chunk(p, start, take, sg.elems)
                    sg.chunks.append(c)
                    self._chunks_of.setdefault(id(p), []).append((sg, c))
                    sg.elems += take
                    start += take
        # Fields of a sub-group's extent: [master (half params only)] exp_avg, exp_avg_sq — each
        # padded to 4096 bytes so every field starts aligned.
        self._has_master = any(p.dtype != torch.float32 for g in self.param_groups for p in g["params"])
        self._fields = 3 if self._has_master else 2
        self._field_bytes = [_pad(sg.elems * 4) for sg in self._sub_groups]
        need = self._fields * max(self._field_bytes, default=0)
        initial = max(sum(self._field_bytes) * self._fields // max(len(dirs), 1) + (8 << 20), 16 << 20)

        def make_swap(direct: bool):
            # make_dirs: what is missing is made, and removed again with the swap space.
            return _tiermem.SwapSpace(dirs, block_size, queue_depth, intra_op_parallelism, direct, initial, checksum,
                                      make_dirs=True)

        if o_direct is None:
            try:
                self._swap = make_swap(True)
            except OSError as e:
                if e.errno != 22:  # EINVAL: the filesystem refuses O_DIRECT
                    raise
                warnings.warn(f"NVMeAdamW: O_DIRECT refused under {dirs} ({e.strerror}); using buffered I/O",
                              RuntimeWarning, stacklevel=2)
                self._swap = make_swap(False)
        else:
            self._swap = make_swap(bool(o_direct))
        for sg, fb in zip(self._sub_groups, self._field_bytes):
            sg.extent = self._swap.allocate(self._fields * fb)
        self._staging = [locked_array(max(need, _ALIGN)) for _ in range(buffer_count)]
        self._registered = [self._swap.register_buffer(b) for b in self._staging]

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def nvme_bytes(self) -> int:
        """Bytes of optimizer state in the swap space (padded extents)."""
        return sum(self._fields * fb for fb in self._field_bytes)

    @property
    def staging_bytes(self) -> int:
        """Bytes of page-locked host memory held for staging (all buffers)."""
        return sum(b.nbytes for b in self._staging)

    def swap_stats(self) -> dict:
        """The swap space's and its I/O engine's counters (bytes, extents, files, engine)."""
        return self._swap.stats()

    def close(self) -> None:
        """Releases the swap space (deletes its files and locks). The optimizer is unusable after."""
        self._swap = None
        self._staging = []

    # ---- staging views -----------------------------------------------------------------------
    def _views(self, buf, sg_index: int):
        """(master or None, exp_avg, exp_avg_sq) float32 tensors over a staging buffer, and the
        bytes of the extent they cover."""
        fb = self._field_bytes[sg_index]
        n = self._sub_groups[sg_index].elems
        t = torch.from_numpy(buf[: self._fields * fb])
        fields = [t[k * fb: k * fb + n * 4].view(torch.float32) for k in range(self._fields)]
        if self._has_master:
            return fields[0], fields[1], fields[2], self._fields * fb
        return None, fields[0], fields[1], self._fields * fb

    def _fill_fresh(self, buf, sg_index: int) -> None:
        """A sub-group never written: zero moments, master = the parameters in fp32."""
        master, m, v, _ = self._views(buf, sg_index)
        m.zero_()
        v.zero_()
        if master is not None:
            for c in self._sub_groups[sg_index].chunks:
                master[c.offset: c.offset + c.length].copy_(c.param.detach().view(-1)[c.start: c.start + c.length])

    def _require_open(self) -> None:
        if self._swap is None:
            raise RuntimeError("NVMeAdamW: the optimizer was closed")

    def add_param_group(self, param_group: dict) -> None:
        # torch.optim.Optimizer.__init__ adds the groups given; after that the sub-groups on NVMe
        # are laid out, and a group added later would never be stepped.
        if hasattr(self, "_sub_groups"):
            raise NotImplementedError("NVMeAdamW.add_param_group: the optimizer state on NVMe is laid out when the "
                                      "optimizer is built; give every param group to NVMeAdamW(...) instead")
        super().add_param_group(param_group)

    # ---- step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._require_open()
        # A parameter resized since the layout (p.data = ..., resize_token_embeddings) would be
        # stepped over its old length only: refused before anything changes.
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                laid = sum(c.length for _, c in self._chunks_of.get(id(p), []))
                if p.grad is not None and p.numel() != laid:
                    raise ValueError(f"NVMeAdamW: param_groups[{gi}]['params'][{pi}] has {p.numel()} elements (shape "
                                     f"{tuple(p.shape)}) but had {laid} when the optimizer was built: its state on "
                                     "NVMe is laid out for that size; build a new optimizer after resizing a parameter")
                if p.grad is not None and p.dtype != self._dtype_of[id(p)]:  # (a half one has a master field)
                    raise ValueError(f"NVMeAdamW: param_groups[{gi}]['params'][{pi}] is {p.dtype} but was "
                                     f"{self._dtype_of[id(p)]} when the optimizer was built: its state on NVMe is laid "
                                     "out for that dtype; build a new optimizer after changing a parameter's dtype")
        # Step counts first (host memory), so a sub-group's chunks know theirs.
        stepped = set()
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["step"] += 1
                stepped.add(id(p))
        order = [i for i, sg in enumerate(self._sub_groups) if any(id(c.param) in stepped for c in sg.chunks)]
        self._pipeline(order, self._step_sub_group)
        return loss

    def _step_sub_group(self, buf, i: int) -> None:
        sg = self._sub_groups[i]
        group = self.param_groups[sg.group]
        beta1, beta2 = group["betas"]
        master, m, v, _ = self._views(buf, i)
        for c in sg.chunks:
            p = c.param
            if p.grad is None:
                continue
            where = f"NVMeAdamW: parameter of shape {tuple(p.shape)}"
            grad, wd = _prepare_grad(p, p.grad, group, where)
            g = grad.view(-1)[c.start: c.start + c.length]
            pv = p.detach().view(-1)[c.start: c.start + c.length]
            sl = slice(c.offset, c.offset + c.length)
            step = _kernel_step(group, int(self.state[p]["step"].item()))
            if p.dtype == torch.float32:
                _tiermem.adam_step(pv, g, m[sl], v[sl], float(group["lr"]), float(beta1), float(beta2),
                                   float(group["eps"]), wd, step)
            else:
                _tiermem.adam_step(master[sl], g, m[sl], v[sl], float(group["lr"]), float(beta1),
                                   float(beta2), float(group["eps"]), wd, step, 1.0, pv)
        sg.initialized = True

    def _pipeline(self, order: list[int], work) -> None:
        """Runs work(buffer, sub_group_index) over `order`: read i+1 (up to buffer_count - 2 ahead)
        / work i / write i-1, each sub-group's state read from NVMe (or made fresh) before and
        written back after. A staging buffer is reused only once its previous write completed."""
        nbuf = len(self._staging)
        reads: dict[int, Any] = {}
        writes: dict[int, Any] = {}

        def start_read(j: int) -> None:
            k = j - nbuf  # the previous user of this staging buffer: its write must be done
            if k >= 0 and k in writes:
                writes.pop(k).wait()
            buf = self._staging[j % nbuf]
            i = order[j]
            if self._sub_groups[i].initialized:
                _, _, _, nbytes = self._views(buf, i)
                reads[j] = self._swap.read(self._sub_groups[i].extent, buf[:nbytes])
            else:
                self._fill_fresh(buf, i)

        ahead = nbuf - 2  # sub-groups read ahead of the one being stepped (one buffer is written)
        started = 0
        try:
            for j, i in enumerate(order):
                while started < len(order) and started <= j + ahead:
                    start_read(started)
                    started += 1
                if j in reads:
                    reads.pop(j).wait()
                buf = self._staging[j % nbuf]
                work(buf, i)
                _, _, _, nbytes = self._views(buf, i)
                writes[j] = self._swap.write(self._sub_groups[i].extent, buf[:nbytes])
            for j in sorted(writes):
                writes.pop(j).wait()
        finally:
            # On an error, let every transfer finish before the buffers can be reused; the first
            # error is the one already propagating.
            for r in list(reads.values()) + list(writes.values()):
                try:
                    r.wait()
                except Exception:
                    pass

    # ---- state dicts -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch.optim.AdamW's format: per parameter step, exp_avg, exp_avg_sq (float32, the
        parameter's shape) and, for half-precision parameters, master (float32). Reads every
        sub-group back from NVMe (the result is in host memory)."""
        self._require_open()
        sd = super().state_dict()
        index = {}
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                index[id(p)] = i
                i += 1
        # torch packs the live per-parameter dicts: copy them (and the step counters) first.
        out = {k: {key: (val.clone() if torch.is_tensor(val) else val) for key, val in st.items()}
               for k, st in sd["state"].items()}
        sd["state"] = out
        buf = self._staging[0]
        for si, sg in enumerate(self._sub_groups):
            if not sg.initialized:
                continue
            master, m, v, nbytes = self._views(buf, si)
            self._swap.read(sg.extent, buf[:nbytes]).wait()
            for c in sg.chunks:
                st = out.get(index[id(c.param)])
                if st is None:  # never stepped: no state, as torch
                    continue
                p = c.param
                for key, src in (("exp_avg", m), ("exp_avg_sq", v), ("master", master)):
                    if src is None or (key == "master" and p.dtype == torch.float32):
                        continue
                    if key not in st:
                        st[key] = torch.empty(p.shape, dtype=torch.float32)
                    st[key].view(-1)[c.start: c.start + c.length].copy_(src[c.offset: c.offset + c.length])
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state dict of NVMeAdamW or torch.optim.AdamW (same parameter order): hyper-
        parameters and step counts into the optimizer, moments (and masters) onto NVMe."""
        self._require_open()
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list) or \
                not isinstance(state_dict.get("state"), dict):
            raise TypeError("NVMeAdamW.load_state_dict: expected a dict with 'state' (a dict) and 'param_groups' "
                            f"(a list), as state_dict() returns; got {type(state_dict).__name__}")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"NVMeAdamW.load_state_dict: {len(groups)} param groups given, the optimizer has "
                             f"{len(self.param_groups)}")
        params = [p for g in self.param_groups for p in g["params"]]
        by_param = {}
        for g_saved, g_own in zip(groups, self.param_groups):
            if len(g_saved["params"]) != len(g_own["params"]):
                raise ValueError("NVMeAdamW.load_state_dict: a param group's size differs from the optimizer's")
        flat_ids = [i for g in groups for i in g["params"]]
        for saved_id, p in zip(flat_ids, params):
            st = state_dict["state"].get(saved_id)
            if st is not None:
                for key in ("exp_avg", "exp_avg_sq"):
                    if key not in st or st[key].numel() != p.numel():
                        raise ValueError(f"NVMeAdamW.load_state_dict: state of a parameter of shape "
                                         f"{tuple(p.shape)} lacks a matching '{key}'")
                by_param[id(p)] = st
        # Hyper-parameters and step counts through torch (keeps its checks), moments separately.
        slim = {"param_groups": groups,
                "state": {k: {"step": v["step"]} for k, v in state_dict["state"].items() if "step" in v}}
        super().load_state_dict(slim)
        _complete_groups(self)
        for p in params:
            st = self.state.get(p)
            if st is not None and "step" in st:
                st["step"] = st["step"].detach().to(dtype=torch.float32, device="cpu").clone()
        buf = self._staging[0]
        for si, sg in enumerate(self._sub_groups):
            if not any(id(c.param) in by_param for c in sg.chunks):
                sg.initialized = False
                continue
            self._fill_fresh(buf, si)
            master, m, v, nbytes = self._views(buf, si)
            for c in sg.chunks:
                st = by_param.get(id(c.param))
                if st is None:
                    continue
                sl = slice(c.offset, c.offset + c.length)
                src = slice(c.start, c.start + c.length)
                m[sl].copy_(st["exp_avg"].detach().reshape(-1)[src])
                v[sl].copy_(st["exp_avg_sq"].detach().reshape(-1)[src])
                if master is not None and c.param.dtype != torch.float32 and "master" in st:
                    master[sl].copy_(st["master"].detach().reshape(-1)[src])
            self._swap.write(sg.extent, buf[:nbytes]).wait()
            sg.initialized = True
