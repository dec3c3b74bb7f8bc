"""Where parameters built under ``zero.Init`` wait for ``initialize``, and how they are reached
meanwhile.

Each parameter goes, as soon as its module's ``__init__`` returns, to a Init store file under the
config's NVMe path (host memory when the config offloads nothing to NVMe), its ``.data`` a
placeholder of the right shape and its class a subclass of its own (``store_param``).
Initialisation code that runs later on the whole model (HF's ``post_init``, ``tie_weights``)
reaches each parameter through that class's ``__torch_function__``: loaded, changed in place,
written back. A view of a stored parameter (``p[i]``, ``p.data[i]``, ``p.t()``) is a proxy
(``_StoredView``) that does the same at each call given it: transformers' ``_init_weights`` zeroes
an embedding's padding row through one. ``initialize`` then registers each engine unit from the
Init store (``take_stored``), one unit at a time, and once every unit is in the engine
``release_init_store`` drops the Init store (the file goes with its last parameter). A failed
``initialize`` leaves the Init store as it was.
The file is written so that the kernel can drop its pages as it goes: after each
``FLUSH_BYTES`` written the written range is made durable (``fdatasync``) and dropped from the page
cache (``posix_fadvise(DONTNEED)``), and a range read back is dropped once read. Buffered writes
left the whole model's bytes as dirty page cache, charged to the process's memory cgroup: a model
twice the group's limit was OOM-killed at ``initialize`` (issue 57).
A model that never reaches ``initialize`` takes its Init store with it: the file, and the directories
tiermem made for it once they hold nothing else, go when the model is garbage-collected or at
interpreter exit, in the process that built it (a forked child leaves them to its parent).

Thread-safety: single-threaded, as module construction is.
"""

from __future__ import annotations

import errno
import os
import tempfile
import weakref
from typing import Optional

import torch

from ._params import apply_chain, is_metadata, param_subclass, placeholder, view_on_meta
from ._params import holds_placeholder as _holds_placeholder
from ._params import is_data_get as _is_data_get
from ._params import is_data_set as _is_data_set
from ._params import is_view_call as _is_view_call
from ._params import raw_data as _raw_data

__all__ = ["InitStore", "FLUSH_BYTES", "store_param", "take_stored", "lend_stored", "give_back_stored", "drop_stored",
           "release_init_store", "guard_stored_module", "make_marked_dirs", "remove_if_unused", "MADE_MARKER"]


# Bytes of the Init store file written, or read, between two drops of its pages from the page
# cache: the most the file holds in the page cache (dirty or clean) at any time. Measured once on
# this machine's virtio disk, 2 GiB written then read back inside a 512 MiB memory cgroup: with
# 32 MiB pieces the group stayed at 0.1 GiB and the writes took 0.8x the time of plain buffered
# ones (which filled the group to its limit); O_DIRECT through an aligned bounce buffer wrote as
# fast but read back 4x slower.
FLUSH_BYTES = 32 << 20


# The marker of a directory tiermem made (src/nvme/made_dirs.h): the engine that last uses it
# removes it once nothing else is in it, so a closed engine leaves only what the user made.
MADE_MARKER = ".tiermem-made"


def make_marked_dirs(directory: str) -> list:
    """Makes `directory` and its missing parents (0700), each with the marker, as the engine's
    swap set-up does; a directory that exists is left as it is. Returns the directories to hand to
    remove_if_unused when done, innermost first: `directory` and the parents above it, as far as
    each carries the marker (whoever made it: tiermem's, never the user's)."""
    missing = []
    d = os.path.abspath(directory)
    while not os.path.isdir(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue
        open(os.path.join(d, MADE_MARKER), "w").close()
    marked = []
    d = os.path.abspath(directory)
    while os.path.isfile(os.path.join(d, MADE_MARKER)):
        marked.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    return marked


def remove_if_unused(directory: str) -> None:
    """Removes `directory` when it holds nothing but the marker (the marker goes too), as the
    engine's ``remove_if_unused`` does; one that holds anything else, or is gone, stays. Never
    raises (what cannot be removed stays)."""
    try:
        entries = os.listdir(directory)
        if any(e != MADE_MARKER for e in entries):
            return  # in use: an engine's swap files, another Init store, the user's files
        marked = MADE_MARKER in entries
        if marked:
            os.unlink(os.path.join(directory, MADE_MARKER))
        try:
            os.rmdir(directory)
        except FileNotFoundError:
            pass
        except OSError:  # something was put there after the check: it stays, and stays tiermem's
            if marked:
                open(os.path.join(directory, MADE_MARKER), "w").close()
    except OSError:
        pass


class InitStore:
    """Where parameters built under Init wait for initialize(): a file under the config's NVMe path
    (offload_param or offload_optimizer nvme), else host memory (the model then lives in host
    memory anyway). Values keep their dtype. The file holds at most about ``FLUSH_BYTES`` of its
    bytes in the page cache at a time (see the module's docstring). Single-threaded, as module
    construction is. I/O errors are OSError naming the file."""

    def __init__(self, directory: Optional[str]) -> None:
        self.slots: dict[int, tuple[int, int, torch.dtype, torch.Size]] = {}  # id(p) -> (offset, bytes, dtype, shape)
        self.mem: dict[int, torch.Tensor] = {}
        self.fd = -1
        self.path = None
        self.end = 0
        self._dirty = None  # (first, end, bytes) of what was written since the file's pages were last dropped
        if directory:
            dirs = make_marked_dirs(directory)
            try:
                fd, self.path = tempfile.mkstemp(prefix="tiermem-init-", suffix=".bin", dir=directory)
            except BaseException:
                for d in dirs:
                    remove_if_unused(d)
                raise
            self.fd = fd
            # No readahead: each read asks for a whole slot, and pages read ahead past it would stay
            # cached after the slot's pages are dropped.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            # The file, then the directories tiermem made for it once nothing else is in them: when
            # initialize has taken the last parameter (drop_stored), when the stored model is
            # garbage-collected, or at interpreter exit (weakref.finalize's atexit). Only in this
            # process: a forked child inherits the finalizer, and its exit removed the parent's file.
            self._finalizer = weakref.finalize(self, InitStore._remove, fd, self.path, dirs, os.getpid())

    @staticmethod
    def _remove(fd: int, path: str, dirs: list, owner_pid: int) -> None:
        """Closes `fd` (each process its own copy) and, in the process that made the Init store only,
        removes `path` and then each of `dirs` that holds nothing else. A forked child that exits
        (or collects its copy of the model, or initializes it) leaves them: they are the parent's,
        which still reads the file."""
        try:
            os.close(fd)
        except OSError:
            pass
        if os.getpid() != owner_pid:
            return
        try:
            os.unlink(path)
        except OSError:
            pass
        for d in dirs:
            remove_if_unused(d)

    def store(self, p: torch.Tensor, values: torch.Tensor, take: bool = False) -> None:
        """Keeps a copy of `values` as `p`'s (a slot of the file, reused while its size holds).
        `take`: in host memory, `values` itself is kept, not a copy (store_param: `p` gives its
        tensor up, so the build never holds a parameter twice). In host memory, the store's own
        tensor handed back (changed in place through the parameter: HF's post_init) stays as it is:
        a copy would free the old one, and glibc, freeing a mapped block, serves every later block
        up to its size from its heap, which the steps' activations then spread over (max RSS)."""
        values = values.detach().contiguous()
        if self.fd < 0:
            held = self.mem.get(id(p))
            own = (held is not None and held.data_ptr() == values.data_ptr() and held.dtype == values.dtype
                   and held.shape == values.shape)
            self.mem[id(p)] = held if own else values.clone() if values.data_ptr() == p.data_ptr() and not take else values
            self.slots[id(p)] = (0, 0, values.dtype, values.shape)
            return
        nbytes = values.numel() * values.element_size()
        slot = self.slots.get(id(p))
        if slot is None or slot[1] != nbytes:
            slot = (self.end, nbytes, values.dtype, values.shape)
            self.end += (nbytes + 4095) // 4096 * 4096
            self.slots[id(p)] = slot
        view = memoryview(values.view(torch.uint8).reshape(-1).numpy()) if nbytes else memoryview(b"")
        done = 0
        while done < nbytes:  # pieces that fill FLUSH_BYTES, each dropped once written; short writes retried
            piece = min(nbytes - done, FLUSH_BYTES - (self._dirty[2] if self._dirty else 0))
            wrote = 0
            while wrote < piece:
                wrote += os.pwrite(self.fd, view[done + wrote:done + piece], slot[0] + done + wrote)
            self._written(slot[0] + done, piece)
            done += piece

    def _written(self, offset: int, nbytes: int) -> None:
        """Notes `nbytes` written at `offset`; once FLUSH_BYTES are pending, writes them back and
        drops them from the page cache (dirty pages cannot be dropped before they are written)."""
        lo, hi, pending = (offset, offset + nbytes, 0) if self._dirty is None else self._dirty
        lo, hi, pending = min(lo, offset), max(hi, offset + nbytes), pending + nbytes
        self._dirty = (lo, hi, pending)
        if pending < FLUSH_BYTES:
            return
        try:
            os.fdatasync(self.fd)
        except OSError as e:
            raise OSError(e.errno, f"zero.Init: writing the Init store file {self.path} back to its disk failed: "
                                   f"{os.strerror(e.errno)}", self.path) from e
        self._dirty = None
        os.posix_fadvise(self.fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)

    def load(self, p: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`p`'s stored values: a new tensor of its shape and dtype, or, with `out` (a contiguous
        tensor of as many elements, any dtype), written into `out` (cast to its dtype; read straight
        into it, no copy beside it, when the dtypes match) and `out` returned. The pages read are
        dropped from the page cache once read. Raises OSError (EIO) when the file is shorter than
        the slot."""
        offset, nbytes, dtype, shape = self.slots[id(p)]
        if out is not None and (not out.is_contiguous() or out.numel() != shape.numel()):
            raise ValueError(f"InitStore.load: out must be a contiguous tensor of {shape.numel()} elements, got "
                             f"{tuple(out.shape)} (contiguous: {out.is_contiguous()})")
        if self.fd < 0:
            if id(p) not in self.mem:  # lent (InitStore.lend)
                raise RuntimeError(f"tiermem.torch: a parameter {tuple(shape)} {dtype} stored by zero.Init was read while "
                                   "initialize holds its values (registered in the engine); read it after initialize")
            if out is None:
                return self.mem[id(p)]
            return out.copy_(self.mem[id(p)].reshape(out.shape))
        direct = out is not None and out.dtype == dtype
        dst = out if direct else torch.empty(shape, dtype=dtype)
        buf = memoryview(dst.view(torch.uint8).reshape(-1).numpy()) if nbytes else memoryview(b"")
        done = 0
        while done < nbytes:  # FLUSH_BYTES at a time, each dropped from the page cache once read
            piece = min(nbytes - done, FLUSH_BYTES)
            got = 0
            while got < piece:
                n = os.preadv(self.fd, [buf[done + got:done + piece]], offset + done + got)
                if n <= 0:
                    raise OSError(errno.EIO, f"zero.Init: Init store file {self.path} ended at byte "
                                             f"{offset + done + got} (expected {nbytes} bytes at {offset})", self.path)
                got += n
            os.posix_fadvise(self.fd, offset + done, piece, os.POSIX_FADV_DONTNEED)
            done += piece
        if out is None or direct:
            return dst
        return out.copy_(dst.reshape(out.shape))

    def drop(self, p: torch.Tensor) -> None:
        self.slots.pop(id(p), None)
        self.mem.pop(id(p), None)

    def lend(self, p: torch.Tensor) -> bool:
        """initialize registered `p`'s values in an engine that gives them back exactly: a host
        memory Init store frees its copy now, not when every unit is registered (the model's
        values and the engine's homes were both held at the end, 1.5x a base that fits in RAM,
        issue 57). True when freed; give_back puts values back if initialize fails later."""
        return self.fd < 0 and self.mem.pop(id(p), None) is not None

    def give_back(self, p: torch.Tensor, values: torch.Tensor) -> None:
        """Puts back the values of a parameter lent to a failed initialize (`values`: fp32, read
        back from the engine; cast to the parameter's stored dtype, exact for what lend took)."""
        _, _, dtype, shape = self.slots[id(p)]
        self.mem[id(p)] = values.detach().reshape(shape).to(dtype).clone()


def _current_values(p: torch.nn.Parameter) -> torch.Tensor:
    """The stored parameter `p`'s values now: the tensor a ``p.data = t`` put there, else the
    Init store's (loaded)."""
    held = _raw_data(p)
    return held if not _holds_placeholder(held) else p._tm_init_store.load(p)


def _stored_values(x: torch.Tensor) -> torch.Tensor:
    """A copy of the values the stored parameter, ``.data`` proxy or view proxy `x` stands for now."""
    values = _current_values(_stored_owner(x))
    if isinstance(x, _StoredView):
        values = _resolve_view(x, values)
    with torch._C.DisableTorchFunctionSubclass():
        return values.detach().clone()


class _StoredData(torch.Tensor):
    """``p.data`` of a stored parameter: its placeholder, tied to `p` (``_tm_param``). A torch call
    given it reads and writes `p`'s stored values as a call given `p` does (``p.data.copy_(t)``,
    ``p.data.normal_()``, ``nn.init.*_(p.data)``): on the placeholder itself a write failed with
    torch's internal-overlap error and a read gave meaningless values."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _init_param_torch_function(cls, func, types, args, kwargs)


class _StoredView(torch.Tensor):
    """A view of a stored parameter (``p[i]``, ``p.data[i]``, ``p.t()``, ``p.view(-1)[:n]``, ...):
    a placeholder of the view's shape and dtype, tied to `p` (``_tm_param``) and to the calls that
    make the view from `p`'s values (``_tm_chain``). A torch call given it makes the view from `p`'s
    current stored values for the call and writes them back after it, so ``p[pad].zero_()`` and
    ``nn.init.zeros_(p.data[pad])`` (HF's ``_init_weights`` of an embedding with a padding index)
    change the Init store. A view of the values loaded for the call alone was dropped with them: the
    write was lost without a word, and the model trained from other initial weights. A call that
    gives a copy in torch (an index by a list, a tensor or a mask; a reshape no view can make) gives
    a copy here too, of the values stored at that moment, as it always did."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _init_param_torch_function(cls, func, types, args, kwargs)


def _is_stored_proxy(x) -> bool:
    return isinstance(x, (_StoredData, _StoredView))


def _stored_owner(x) -> Optional[torch.nn.Parameter]:
    """The stored parameter whose values the call argument `x` stands for (itself, the owner of a
    ``p.data`` or of a view taken while it was stored), else None."""
    if isinstance(x, torch.nn.Parameter):
        st = x.__dict__.get("_tm_init_store")
        return x if st is not None and id(x) in st.slots else None
    if _is_stored_proxy(x):
        p = x.__dict__.get("_tm_param")
        if p is None:
            return None
        st = p.__dict__.get("_tm_init_store")
        if st is None or id(p) not in st.slots:
            what = "the .data" if isinstance(x, _StoredData) else "a view (p[...], p.data[...], p.t(), ...)"
            raise RuntimeError(f"tiermem.torch: this tensor is {what} of a parameter {tuple(p.shape)} {p.dtype} "
                               "taken while zero.Init stored it; initialize has taken the parameter since, so it holds "
                               "no values: use the parameter itself (inside tiermem.torch.zero.GatheredParameters to "
                               "change it)")
        return p
    return None


def _make_view(x: torch.Tensor, owner: torch.nn.Parameter, func, rest: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The view proxy of ``func(x, *rest, **kwargs)``, `x` standing for the stored `owner`, or None
    when the call gives a copy (the caller then runs it on the values, as torch would). No values
    are loaded: the calls run on a meta tensor with the strides of the values a call would get."""
    for a in list(rest) + list(kwargs.values()):
        for y in (a if isinstance(a, (list, tuple)) else (a,)):
            if _stored_owner(y) is not None:
                return None  # an index that is itself stored: run on the values (a copy, or torch's error)
    chain = list(x.__dict__.get("_tm_chain", ())) if isinstance(x, _StoredView) else []
    chain.append((func, tuple(rest), dict(kwargs)))
    held = _raw_data(owner)
    # What a call is given: the stored values (contiguous) or the tensor a `.data = t` put there.
    stride = held.stride() if not _holds_placeholder(held) else torch.empty(held.shape, device="meta").stride()
    out = view_on_meta(held.shape, stride, held.dtype, chain)
    if out is None:
        return None  # a copy in torch (or not answerable without values): a copy here too
    proxy = placeholder(out.shape, out.dtype).as_subclass(_StoredView)
    proxy._tm_param = owner
    proxy._tm_chain = chain
    return proxy


def _data_of_proxy(x: torch.Tensor) -> torch.Tensor:
    """``x.data`` of a stored parameter's ``.data`` or view proxy: a proxy of the same values (a
    plain tensor would be the placeholder, whose writes fail and reads are meaningless)."""
    proxy = _raw_data(x).as_subclass(type(x))
    proxy._tm_param = x.__dict__.get("_tm_param")
    if isinstance(x, _StoredView):
        proxy._tm_chain = list(x.__dict__.get("_tm_chain", ()))
    return proxy


def _resolve_view(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The view the proxy `x` stands for, made from `values` (its owner's values for this call). A
    view that would be a copy now (the parameter was given `.data` of other strides since) could
    not take a write back: refused before the call."""
    levels = apply_chain(values, x.__dict__["_tm_chain"])
    base = values.untyped_storage().data_ptr()
    if levels[-1].numel() and levels[-1].untyped_storage().data_ptr() != base:
        raise RuntimeError("tiermem.torch: a view of a parameter stored by zero.Init (p[...], p.data[...], p.t(), ...) "
                           "no longer views its values (the parameter was given .data of another layout since), so a "
                           "change to it could not reach the parameter; nothing was changed: take the view again")
    return levels[-1]


def _init_param_torch_function(cls, func, types, args=(), kwargs=None):
    """A parameter stored by Init (or its ``.data``, or a view of either), used by code that runs
    after its module was built (HF's post_init weight initialisation, tie_weights, user code):
    loaded for the call, written back after it (the call may have initialised it in place),
    released again. A parameter given ``.data = t`` since holds t: the call uses t, which is then
    stored in its place. A view call (``p[i]``, ``p.data[i]``, ``p.t()``, ``p.view(...)``) returns
    a view proxy (_StoredView): the values it views are the Init store's at each later call."""
    if kwargs is None:
        kwargs = {}
    if (_is_data_set(func) and len(args) == 2 and isinstance(args[0], torch.nn.Parameter)
            and _stored_owner(args[0]) is not None and _stored_owner(args[1]) is not None):
        # `p.data = q.data` with both stored (transformers' resize_token_embeddings hands the new
        # embedding's values to the old parameter so): q's values, at their shape, are stored in
        # p's place. The placeholder alone would have left p its own old values, silently (or of
        # the old shape under the new one: initialize failed). A copy, not torch's alias of q.
        p = args[0]
        values = _stored_values(args[1])
        p._tm_init_store.store(p, values)
        with torch._C.DisableTorchFunctionSubclass():
            p.data = placeholder(values.shape, values.dtype)
        return None
    if _is_data_get(func):
        if isinstance(args[0], torch.nn.Parameter):
            p = args[0]
            held = _raw_data(p)
            if _stored_owner(p) is not None and _holds_placeholder(held):
                proxy = held.as_subclass(_StoredData)
                proxy._tm_param = p
                return proxy
            return held
        if _is_stored_proxy(args[0]) and _stored_owner(args[0]) is not None:
            return _data_of_proxy(args[0])
    if _is_view_call(func) and args and isinstance(args[0], torch.Tensor):
        owner = _stored_owner(args[0])
        if owner is not None:
            proxy = _make_view(args[0], owner, func, args[1:], kwargs)
            if proxy is not None:
                return proxy
    stored = {}  # id(owner) -> (owner, store, values, [arguments standing for it])
    try:
        for a in (list(args) + list(kwargs.values())) if not is_metadata(func) else ():
            items = a if isinstance(a, (list, tuple)) else (a,)
            for x in items:
                p = _stored_owner(x)
                if p is None:
                    continue
                entry = stored.get(id(p))
                if entry is None:
                    entry = stored[id(p)] = (p, p._tm_init_store, _current_values(p), [])
                if not any(x is y for y in entry[3]):
                    x.data = _resolve_view(x, entry[2]) if isinstance(x, _StoredView) else entry[2]
                    entry[3].append(x)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    finally:
        for p, st, values, users in stored.values():
            _, _, dtype, shape = st.slots[id(p)]
            if values.shape == shape and values.dtype == dtype:
                st.store(p, values)
                for x in users:
                    x.data = placeholder(x.shape, x.dtype)
                if not any(x is p for x in users):
                    p.data = placeholder(p.shape, p.dtype)
            else:  # `.data = t` of another shape or dtype: initialize (take_stored) names it
                for x in users:
                    if x is not p:
                        x.data = placeholder(x.shape, x.dtype)
                p.data = values


def _init_param_class(cls: type) -> type:
    return param_subclass(cls, "ZeroInit", _init_param_torch_function)


def store_param(p: torch.nn.Parameter, store: InitStore) -> None:
    """Moves `p`'s values into `store`: its class becomes the stored subclass of its own and its
    ``.data`` a placeholder of the right shape."""
    store.store(p, p.data, take=True)
    p._tm_init_store = store
    p._tm_init_class = type(p)
    p.__class__ = _init_param_class(type(p))
    p.data = placeholder(p.shape, p.dtype)


def _replaced_value(p: torch.nn.Parameter, st: InitStore) -> Optional[torch.Tensor]:
    """The tensor a ``p.data = t`` after the build put in place of the stored parameter `p`'s
    placeholder: t is the parameter's value now (the stored one would silently win); None while the
    placeholder is there. Raises ValueError for a t of another shape or dtype than the stored one,
    which cannot be the module's."""
    held = _raw_data(p)
    if _holds_placeholder(held):
        return None
    _, _, dtype, shape = st.slots[id(p)]
    if held.shape != shape or held.dtype != dtype:
        raise ValueError(f"tiermem.torch.initialize: a parameter built under zero.Init as {tuple(shape)} {dtype} "
                         f"was given .data of {tuple(held.shape)} {held.dtype}: give it values of its own shape and "
                         "dtype (or build the module with the shape it should have)")
    return held


def take_stored(p: torch.nn.Parameter, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """For initialize(): the value Init stored for `p` (None if it was not built under Init). The
    Init store keeps it until drop_stored (an initialize that fails leaves the model as it was).
    With `out` (a contiguous tensor of p.numel() elements, any floating dtype) the value is written
    into `out` (cast to its dtype) and `out` returned: a parameter of out's dtype is read straight
    from the Init store file into it, with no copy of its size beside it. Raises ValueError as
    _replaced_value does."""
    st = p.__dict__.get("_tm_init_store")
    if st is None:
        return None
    held = _replaced_value(p, st)
    if held is not None:
        return held if out is None else out.copy_(held.reshape(out.shape))
    return st.load(p, out)


def held_in_memory(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """For initialize(): `p`'s values where they are already a tensor in memory, not a copy: the
    tensor the parameter holds (built without Init, or given ``.data = t`` after), or a host memory
    Init store's copy. None where they would have to be read (an Init store file) or were lent.
    Raises ValueError as take_stored does."""
    st = p.__dict__.get("_tm_init_store")
    if st is None:
        held = _raw_data(p)
        return None if _holds_placeholder(held) else held
    held = _replaced_value(p, st)
    if held is not None:
        return held
    return st.mem.get(id(p)) if st.fd < 0 else None


def lend_stored(p: torch.nn.Parameter) -> bool:
    """For initialize(), once `p`'s unit is registered in an engine that gives its values back
    exactly: a host memory Init store frees `p`'s copy (InitStore.lend). True when it did; a
    parameter given `.data = t`, or stored in a file, keeps what it has."""
    st = p.__dict__.get("_tm_init_store")
    if st is None or not _holds_placeholder(_raw_data(p)):
        return False
    return st.lend(p)


def give_back_stored(p: torch.nn.Parameter, values: torch.Tensor) -> None:
    """For a failed initialize(): `p`'s values (fp32, read back from the engine) go back to its Init
    store, as they were before lend_stored."""
    p._tm_init_store.give_back(p, values)


def drop_stored(p: torch.nn.Parameter) -> None:
    """After a successful initialize: the parameter gets its own class back and its Init store copy
    is dropped (the Init store file goes with its last one)."""
    st = p.__dict__.get("_tm_init_store")
    if st is None:
        return
    st.drop(p)
    p.__class__ = p.__dict__.pop("_tm_init_class")
    del p.__dict__["_tm_init_store"]
    if not st.slots and st.fd >= 0:
        st._finalizer()


def release_init_store(model: torch.nn.Module) -> None:
    """After initialize: a parameter still stored by Init (every one is engine state, so only one
    that registration did not read) is dropped, and an Init store that holds nothing more is closed and
    its file removed."""
    for p in model.parameters():
        if p.__dict__.get("_tm_init_store") is not None:
            drop_stored(p)
    for m in model.modules():
        guard = m.__dict__.pop("_tm_init_guard", None)
        if guard is not None:
            guard.remove()


def guard_stored_module(module: torch.nn.Module) -> None:
    """A module with parameters stored by Init refuses to run its forward until initialize took
    them (release_init_store removes the guard): the forward would compute on what the Init store lends
    each call, not what the engine trains (it gave other outputs, silently)."""
    if "_tm_init_guard" in module.__dict__:
        return

    def refuse(mod, args):
        if any(p.__dict__.get("_tm_init_store") is not None for p in mod.parameters(recurse=False)):
            raise RuntimeError(f"tiermem.torch: {type(mod).__name__} was built under tiermem.torch.zero.Init, so its "
                               "parameters are stored until tiermem.torch.initialize(model=...) takes them: call "
                               "initialize before running the model (or build it outside zero.Init)")

    module.__dict__["_tm_init_guard"] = module.register_forward_pre_hook(refuse)
