"""Checkpoints of a tiermem.torch engine, and the consolidated fp32 export.

``save_checkpoint(engine, save_dir, tag)`` writes ``save_dir/tag/rank<r>/`` with the C++ writer
tiermem-train uses (tiermem/checkpoint.h): one state file streamed one optimizer sub-group at a
time (fp32 master weights and both Adam moments of this rank's shard: ``optimizer.master``,
``optimizer.exp_avg``, ``optimizer.exp_avg_sq``), the module's persistent buffers, the LR
scheduler's, torch's RNG and the caller's state (pickled by torch.save into a ``u8``
tensor), and a JSON manifest listing each tensor with its XXH64. The state file is written to a
temporary name, fsynced and renamed; the manifest likewise, and it is the commit point: a kill -9
at any moment leaves the previous checkpoint or the new one, never a manifest naming missing data.
``save_dir/latest`` names the tag (DeepSpeed's convention), replaced the same way. Nothing holds
the model in memory: the state streams from its tier through one sub-group at a time.

``load_checkpoint`` verifies every checksum, streams the state back into the engine one sub-group
at a time (the working parameters are republished from the restored master weights), and
restores buffers, scheduler and step counters: the run continues bit for bit. At another world
size the state is re-partitioned as it loads, by the C++ code tiermem-train uses
(tiermem/checkpoint_reshard.h, bound as ``_tiermem.OptimizerStateReshard``): each rank reads the
elements of its new shard from the old ranks' files that held them (the manifest gives the old
world size and module sizes, the layout is tiermem/shard.h's), one sub-group at a time; no
conversion step, no rank holding the model.

``save_fp32_state_dict(engine, path)`` writes a file plain ``torch.load`` reads and
``model.load_state_dict`` accepts (DeepSpeed's zero_to_fp32): every parameter's fp32 master weights
and the buffers, under the model's own names (tied parameters under each name, as
``model.state_dict()`` gives them), written unit by unit (one unit's parameters in memory at a
time) in torch's zip format.

Each function takes the engine (``TiermemEngine``) and reaches it through its public state
interface only: ``check_open``, ``global_rank``, ``world_size``, ``units``, ``working_dtype``, ``optimizer_home``, ``optimizer_shard_numel``, ``export_optimizer_state``,
``import_optimizer_state``, ``master_weights``, besides DeepSpeed's attributes (``module``,
``config``, ``optimizer``, ``lr_scheduler``, the step counters). The engine's checkpoint methods
call these functions; nothing here imports the engine.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import sys
import warnings
from collections import OrderedDict
from typing import Any, Optional

import torch

from .. import _tiermem
from ._optim_state import optimizer_family

_DTYPES = {torch.float32: "f32", torch.float64: "f64", torch.int64: "i64", torch.int32: "i32",
           torch.bfloat16: "bf16", torch.float16: "f16", torch.uint8: "u8", torch.bool: "u8"}
_FORMAT = "tiermem-torch"
_STATE = ("master", "exp_avg", "exp_avg_sq")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _extras(engine) -> "OrderedDict[str, torch.Tensor]":
    """Persistent buffers: state the engine does not hold. (Frozen parameters are engine state but
    not training state: they never change, so a checkpoint leaves them out, as DeepSpeed's
    ``exclude_frozen_parameters`` does; load it into a model built from the same base.)"""
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    model = engine.module
    for mname, m in model.named_modules():
        for bname, b in m._buffers.items():
            if b is not None and bname not in m._non_persistent_buffers_set:
                out[f"buffer.{mname + '.' if mname else ''}{bname}"] = b
    return out


def _pickled(obj) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(torch.uint8).reshape(-1) if t.dtype != torch.bool else t.to(torch.uint8).reshape(-1)


def save_checkpoint(engine, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                    save_latest: bool = True) -> str:
    engine.check_open()
    if engine.forward_only:
        raise RuntimeError("save_checkpoint: this engine is forward-only (every parameter frozen): it has no "
                           "optimizer state to checkpoint; save the weights with save_fp32_model(path)")
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    if not tag or "/" in tag or tag in (".", ".."):
        raise ValueError(f"save_checkpoint: tag {tag!r} must be a plain directory name")
    rank, world = engine.global_rank, engine.world_size
    d = os.path.join(save_dir, tag)
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise NotADirectoryError(f"save_checkpoint: save_dir '{save_dir}' is a file, not a directory")
    client_blob = None
    if client_state:  # pickled first: a value that cannot be is refused before anything is written
        try:
            client_blob = _pickled(client_state)
        except Exception as e:
            raise TypeError(f"save_checkpoint: client_state cannot be pickled ({e}); give picklable values") from None
    # The directories this call makes (outermost first: save_dir's missing parents too) go again
    # if the save fails.
    made = []
    top = os.path.abspath(save_dir)
    while not os.path.exists(top) and os.path.dirname(top) != top:
        made.insert(0, top)
        top = os.path.dirname(top)
    made += [p for p in (d, os.path.join(d, f"rank{rank}")) if not os.path.exists(p)]
    w = None
    try:
        os.makedirs(save_dir, exist_ok=True)
        _tiermem.remove_stale_checkpoint_files(d, rank) if os.path.isdir(d) else None
        w = _tiermem.CheckpointWriter(d, rank, world, engine.global_steps)
        n = engine.optimizer_shard_numel
        tier = engine.optimizer_home
        handles = [w.begin_tensor(f"optimizer.{k}", tier, 4 * n, "f32", [n]) for k in _STATE]

        def sink(offset, master, exp_avg, exp_avg_sq):
            for h, a in zip(handles, (master, exp_avg, exp_avg_sq)):
                w.write_part(h, a)

        header = engine.export_optimizer_state(sink)
        for name, t in _extras(engine).items():
            w.add_tensor(name, "host", _bytes_view(t), _DTYPES.get(t.dtype, "u8"), [t.numel() * t.element_size()]
                         if t.dtype not in _DTYPES or t.dtype == torch.bool else list(t.shape))
        sched = engine.lr_scheduler
        if sched is not None:
            w.add_tensor("lr_scheduler.pt", "host", _pickled(sched.state_dict()), "u8", [])
        if client_blob is not None:
            w.add_tensor("client_state.pt", "host", client_blob, "u8", [])
        # torch's RNG (dropout): the continuation draws what the uninterrupted run would have.
        w.add_tensor("rng_state.pt", "host", _pickled(_rng_state()), "u8", [])
        meta = {
            "format": _FORMAT,
            "engine": header,
            "units": [[u.name, u.numel] for u in engine.units],
            "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps,
            "working_dtype": engine.working_dtype,
            "lr": [float(g["lr"]) for g in engine.optimizer.param_groups],  # what the next step uses
            "optimizer_type": str(engine.config["optimizer"]["type"]),
        }
        w.commit(json.dumps(meta))
    except BaseException:
        if w is not None:
            w.abandon()
        for path in reversed(made):  # innermost first; one another rank also writes in stays
            try:
                os.rmdir(path)
            except OSError:
                pass
        raise
    dist = torch.distributed
    several = world > 1 and dist.is_available() and dist.is_initialized()
    if several:
        dist.barrier()  # every rank's manifest is committed before `latest` names the tag
    if save_latest and rank == 0:
        _write_atomic(os.path.join(save_dir, "latest"), tag)
    if several:
        dist.barrier()
    return d


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _read_latest(load_dir: str) -> str:
    path = os.path.join(load_dir, "latest")
    try:
        with open(path, encoding="utf-8") as f:
            tag = f.read().strip()
    except FileNotFoundError:
        raise FileNotFoundError(f"load_checkpoint: {path} does not exist: give tag= (the checkpoint's directory name "
                                f"under {load_dir})") from None
    if not tag:
        raise ValueError(f"load_checkpoint: {path} is empty; give tag=")
    if "/" in tag or "\0" in tag or tag in (".", ".."):
        raise ValueError(f"load_checkpoint: {path} names {tag!r}, not a checkpoint directory under {load_dir} "
                         "(a plain directory name, as save_checkpoint writes); give tag=")
    return tag


def _meta_count(meta: dict, key: str, where: str) -> int:
    """meta[key] as a step count: an integer >= 0, else ValueError naming the manifest and key."""
    v = meta.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"load_checkpoint: {where}: meta key {key!r} = {v!r} must be an integer >= 0 "
                         "(the manifest was edited or damaged)")
    return v


def _meta_lrs(meta: dict, where: str) -> list:
    """meta['lr'] (one learning rate per param group; absent: none), each a finite number >= 0."""
    lrs = meta.get("lr", [])
    if not isinstance(lrs, list) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in lrs):
        raise ValueError(f"load_checkpoint: {where}: meta key 'lr' = {lrs!r} must be a list of finite learning "
                         "rates >= 0 (the manifest was edited or damaged)")
    return [float(x) for x in lrs]


def load_checkpoint(engine, load_dir: str, tag: Optional[str] = None, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False):
    """Returns (path, client_state) as DeepSpeed's engine.load_checkpoint does."""
    engine.check_open()
    tag = str(tag) if tag is not None else _read_latest(load_dir)
    if not tag or "/" in tag or "\0" in tag or tag in (".", ".."):
        raise ValueError(f"load_checkpoint: tag {tag!r} must be a plain directory name under {load_dir}")
    d = os.path.join(load_dir, tag)
    rank, world = engine.global_rank, engine.world_size
    r0 = _tiermem.CheckpointReader(d, 0)  # parses and validates the manifest
    old_world = r0.world_size
    # This rank's own files when the checkpoint has them (same or smaller world), else rank 0's:
    # buffers, scheduler and RNG state are the same on every rank.
    r = r0 if rank == 0 or rank >= old_world else _tiermem.CheckpointReader(d, rank)
    where = r.manifest_path
    meta = json.loads(r.meta())
    if meta.get("format") != _FORMAT:
        raise ValueError(f"load_checkpoint: {where} is not a tiermem.torch checkpoint (format {meta.get('format')!r})")
    # The counters and learning rates, checked before anything is loaded.
    counts = {k: _meta_count(meta, k, where) for k in ("global_steps", "micro_steps", "skipped_steps")}
    lrs = _meta_lrs(meta, where)
    units = [[u.name, u.numel] for u in engine.units]
    if meta["units"] != units:
        for i, (a, b) in enumerate(zip(meta["units"], units)):
            if a != b:
                raise ValueError(f"load_checkpoint: {where}: engine module {i} is {a[0]!r} with {a[1]} parameters in "
                                 f"the checkpoint but {b[0]!r} with {b[1]} in this model: not the same model")
        raise ValueError(f"load_checkpoint: {where} has {len(meta['units'])} engine modules, this model {len(units)}")
    # The optimizer state is its own kind's (AdamW's two moments, Lion's one, Adagrad's sum): another
    # kind would take it for its own. (Checkpoints written before this was recorded are not checked.)
    saved_type, this_type = meta.get("optimizer_type"), str(engine.config["optimizer"]["type"])
    if load_optimizer_states and not load_module_only and isinstance(saved_type, str) and \
            optimizer_family(saved_type) != optimizer_family(this_type):
        raise ValueError(f"load_checkpoint: {where}: its optimizer state is {saved_type}'s but this engine's optimizer "
                         f"is {this_type}: the state does not carry over; load it into an engine with optimizer.type "
                         f"{saved_type!r}, or pass load_optimizer_states=False to load the weights only")
    header = meta["engine"]
    n = engine.optimizer_shard_numel
    # The optimizer state's partition: over every rank at stages 1-3, whole on each at stage 0.
    old_parts = int(header["world_size"])
    new_parts = world if int(engine.config["zero_optimization"]["stage"]) > 0 else 1
    resharded = old_parts != new_parts
    if resharded:
        # The C++ re-partitioning tiermem-train uses (src/train/checkpoint_reshard.h): it opens and
        # verifies the old ranks' files this rank reads, then fills each sub-group from them.
        new_rank = rank if new_parts > 1 else 0
        source = _tiermem.OptimizerStateReshard(d, old_parts, [f"optimizer.{k}" for k in _STATE],
                                                header["module_numels"], header["alignment_elems"], new_parts,
                                                new_rank)
        header = dict(header, world_size=new_parts, rank=new_rank)
    else:
        if old_world != world:  # stage 0 both: every rank holds the whole state; read rank 0's
            r = r0
            header = dict(header, rank=0)
        for k in _STATE:
            r.verify_tensor(f"optimizer.{k}", 4 * n)  # every byte checked before any is used

        def source(offset, master, exp_avg, exp_avg_sq):
            for k, a in zip(_STATE, (master, exp_avg, exp_avg_sq)):
                r.read_part(f"optimizer.{k}", 4 * offset, a)
    extras = _extras(engine)
    names = {t["name"] for t in r.tensors()}
    for name, t in extras.items():
        if name not in names:
            raise ValueError(f"load_checkpoint: {where} has no tensor {name!r} (a buffer of this "
                             "model)")

    if load_optimizer_states and not load_module_only:
        engine.import_optimizer_state(header, source)
    else:  # weights only: the master weights, with fresh moments and step count
        fresh = dict(header, steps=0, skipped_steps=0)

        def weights_only(offset, master, exp_avg, exp_avg_sq):
            source(offset, master, exp_avg, exp_avg_sq)
            exp_avg.fill(0)
            exp_avg_sq.fill(0)

        engine.import_optimizer_state(fresh, weights_only)
    with torch.no_grad():
        for name, t in extras.items():
            dst = torch.empty_like(t, memory_format=torch.contiguous_format)
            r.read_tensor(name, _bytes_view(dst) if t.dtype != torch.bool else dst.view(torch.uint8).reshape(-1))
            t.data.copy_(dst)
    client_state = {}
    if "client_state.pt" in names:
        client_state = _unpickle(r, "client_state.pt")
    if not load_module_only:
        engine.global_steps = counts["global_steps"]
        engine.micro_steps = counts["micro_steps"]
        engine.skipped_steps = counts["skipped_steps"]
        if load_lr_scheduler_states and engine.lr_scheduler is not None and "lr_scheduler.pt" in names:
            engine.lr_scheduler.load_state_dict(_unpickle(r, "lr_scheduler.pt"))
        for g, lr in zip(engine.optimizer.param_groups, lrs):
            g["lr"] = lr
        if "rng_state.pt" in names:
            _set_rng_state(_unpickle(r, "rng_state.pt"))
    return d, client_state


def _unpickle(r, name: str):
    size = next(t["bytes"] for t in r.tensors() if t["name"] == name)
    buf = torch.empty(size, dtype=torch.uint8)
    r.read_tensor(name, buf)
    return torch.load(io.BytesIO(buf.numpy().tobytes()), weights_only=False)


# ------------------------------------------------------------------------------ fp32 export

class _StorageRef:
    __slots__ = ("key", "numel", "dtype")

    def __init__(self, key: str, numel: int, dtype: torch.dtype) -> None:
        self.key = key
        self.numel = numel
        self.dtype = dtype


class _TensorRef:
    """Pickles as a tensor over the storage record `data/<key>` (what torch.save writes for a
    contiguous tensor), without the tensor's data in memory."""

    def __init__(self, ref: _StorageRef, shape, dtype: torch.dtype) -> None:
        self.ref = ref
        self.shape = tuple(shape)
        self.dtype = dtype

    def __reduce_ex__(self, protocol):
        stride = []
        acc = 1
        for s in reversed(self.shape):
            stride.append(acc)
            acc *= s
        return (torch._utils._rebuild_tensor_v2,
                (self.ref, 0, self.shape, tuple(reversed(stride)), False, OrderedDict()))


def _storage_type(dtype: torch.dtype):
    return {torch.float32: torch.FloatStorage, torch.float64: torch.DoubleStorage, torch.int64: torch.LongStorage,
            torch.int32: torch.IntStorage, torch.bfloat16: torch.BFloat16Storage, torch.float16: torch.HalfStorage,
            torch.uint8: torch.ByteStorage, torch.bool: torch.BoolStorage}[dtype]


def _warn_quantized_frozen(engine, what: str) -> None:
    """A frozen base stored in fewer bytes (tiermem.frozen_dtype bf16/int8) is saved as its
    dequantized values: said once per call, never passed off as the originals."""
    at_rest = engine._zero.stats()["frozen_dtype"]
    if at_rest != "working" and any(u.frozen for u in engine.units):
        warnings.warn(f"{what}: the frozen parameters are stored {at_rest} at rest (tiermem.frozen_dtype / "
                      f"zero_quantized_nontrainable_weights): the values saved are their dequantized {at_rest} values, "
                      f"not the originals the model was built with", stacklevel=3)


def save_fp32_state_dict(engine, path: str) -> int:
    """Writes the model's state dict with fp32 master weights to `path` (torch.load format), one
    engine unit at a time. Returns the number of parameter bytes written."""
    engine.check_open()
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"save_fp32_model: '{path}' is a directory: give a file path, e.g. "
                                f"{os.path.join(path, 'pytorch_model.pt')}")
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise NotADirectoryError(f"save_fp32_model: the directory of '{path}' ({parent}) is a file")
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"save_fp32_model: the directory of '{path}' ({parent}) does not exist: make it "
                                "first")
    _warn_quantized_frozen(engine, "save_fp32_model")
    tmp = path + ".tmp"
    writer = torch._C.PyTorchFileWriter(tmp)
    refs: dict[int, tuple[_StorageRef, torch.Size, torch.dtype]] = {}
    keys = iter(range(1 << 62))
    written = 0
    try:
        for u in engine.units:
            master = engine.master_weights(u.index)
            for p, off, n in u.params:
                key = str(next(keys))
                piece = master[off:off + n].clone()
                writer.write_record(f"data/{key}", piece.untyped_storage(), 4 * n)
                refs[id(p)] = (_StorageRef(key, n, torch.float32), p.shape, torch.float32)
                written += 4 * n
            del master
        state: OrderedDict[str, Any] = OrderedDict()
        model = engine.module
        for mname, m in model.named_modules():
            prefix = mname + "." if mname else ""
            for pname, p in m._parameters.items():
                if p is None:
                    continue
                if id(p) in refs:
                    ref, shape, dtype = refs[id(p)]
                    state[prefix + pname] = _TensorRef(ref, shape, dtype)
            for bname, b in m._buffers.items():
                if b is None or bname in m._non_persistent_buffers_set:
                    continue
                key = str(next(keys))
                t = b.detach().contiguous()
                writer.write_record(f"data/{key}", t.untyped_storage(), t.numel() * t.element_size())
                state[prefix + bname] = _TensorRef(_StorageRef(key, t.numel(), t.dtype), t.shape, t.dtype)

        buf = io.BytesIO()

        class Pickler(pickle.Pickler):
            def persistent_id(self, obj):
                if isinstance(obj, _StorageRef):
                    return ("storage", _storage_type(obj.dtype), obj.key, "cpu", obj.numel)
                return None

        Pickler(buf, protocol=2).dump(state)
        data = buf.getvalue()
        writer.write_record("data.pkl", data, len(data))
        writer.write_record(".format_version", "1", 1)
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        writer.write_end_of_file()
        del writer
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return written
