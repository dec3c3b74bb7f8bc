"""zero.Init's Init store and initialize hold the memory their design says, not the model's.

The Init store writes each built parameter to a file under the NVMe path. Buffered writes left
the whole model in the page cache, dirty, charged to the process's memory cgroup: a 1.1 B Llama in
a cgroup of half its fp32 bytes was OOM-killed at initialize one run in two (issue 57). The file's
pages are now written back and dropped every ``FLUSH_BYTES``, and dropped once read back: the
file's page-cache residency (mincore) stays within that bound.

initialize registered each unit from a new fp32 vector beside a loaded copy of the same values,
and glibc kept the freed vectors of mid-size units in its heap: the 1.1 B Llama's VmHWM grew by
1.2 GiB across initialize. Each unit's vector is now a mapping of its own (``mapped_empty``),
filled straight from the Init store file and unmapped once registered: the growth is one unit
beyond the engine's budgets.
"""

import ctypes
import json
import mmap
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from tiermem.torch import _init_store  # noqa: E402


def _fs_type(path: str) -> str:
    """The filesystem type of the mount that holds `path` (/proc/self/mounts)."""
    best, kind = "", ""
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            mnt = fields[1].replace("\\040", " ")
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, fields[2]
    return kind


def _resident_bytes(path: str) -> int:
    """Bytes of the file `path` in the page cache now (mincore over a private mapping that faults
    nothing in)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        try:
            if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            del addr
    return sum(v & 1 for v in vec) * page


@pytest.fixture
def disk_dir(tmp_path):
    kind = _fs_type(str(tmp_path))
    if kind in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {kind}: its pages are memory, the page cache cannot drop them")
    return str(tmp_path)


def test_init_store_keeps_at_most_flush_bytes_in_the_page_cache(disk_dir, monkeypatch):
    """24 parameters of 1, 1.5 and 2 MiB (36 MiB), 2 MiB between drops: after the writes, after a
    rewrite of every parameter (HF's post_init does one) and after reading them back, at most 2 MiB
    of the file is in the page cache; the values read back are the values written, read straight
    into a destination of their dtype or cast into one of another."""
    flush = 2 << 20
    monkeypatch.setattr(_init_store, "FLUSH_BYTES", flush)
    st = _init_store.InitStore(disk_dir)
    g = torch.Generator().manual_seed(0)
    shapes = [(256 + 128 * (i % 3), 1024) for i in range(24)]
    params = [torch.nn.Parameter(torch.empty(shape)) for shape in shapes]
    values = [torch.randn(shape, generator=g) for shape in shapes]
    for p, v in zip(params, values):
        st.store(p, v)
    assert os.path.getsize(st.path) == 36 << 20
    after_store = _resident_bytes(st.path)
    for p, v in zip(params, values):  # a rewrite in place, as an initialisation after the build does
        v.mul_(0.5)
        st.store(p, v)
    after_rewrite = _resident_bytes(st.path)
    for i, (p, v) in enumerate(zip(params, values)):
        if i % 2:
            assert torch.equal(st.load(p, torch.empty(v.numel())).view(v.shape), v)
        else:  # another dtype: read through a temporary, cast into the destination
            assert torch.equal(st.load(p, torch.empty(v.numel(), dtype=torch.float64)).view(v.shape), v.double())
    after_load = _resident_bytes(st.path)
    assert max(after_store, after_rewrite, after_load) <= flush, (
        f"Init store file in the page cache: {after_store >> 10} KiB after the writes, {after_rewrite >> 10} KiB after "
        f"the rewrite, {after_load >> 10} KiB after the reads; bound {flush >> 10} KiB")
    st._finalizer()
    assert not os.path.exists(st.path)


def test_init_store_load_into_rejects_a_wrong_destination(disk_dir):
    st = _init_store.InitStore(disk_dir)
    p = torch.nn.Parameter(torch.empty(4, 4))
    st.store(p, torch.ones(4, 4))
    with pytest.raises(ValueError, match="16 elements"):
        st.load(p, torch.empty(15))
    with pytest.raises(ValueError, match="contiguous"):
        st.load(p, torch.empty(4, 8)[:, :4])
    st._finalizer()


WORKER = r'''
import json, sys, torch
import tiermem.torch as tt
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
nvme = sys.argv[1]
cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                             "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
       "tiermem": {"host_budget_bytes": "48MiB", "device_budget_bytes": "48MiB"}}
torch.manual_seed(0)
with tt.zero.Init(config=cfg):  # a frozen base of 24 units of 16 MiB (384 MiB fp32), a small head trained
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(24)],
                                torch.nn.Linear(2048, 8, bias=False))
for p in list(model.parameters())[:-1]:  # frozen, as PEFT leaves a base
    p.requires_grad_(False)
unit = 2048 * 2048 * 4
torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)  # torch.optim's first use imports ~150 MiB
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
engine, *_ = tt.initialize(model=model, config=cfg)
st = engine.stats()
print(json.dumps({"growth": status("VmHWM") - before, "unit": unit,
                  "model": sum(p.numel() * 4 for p in model.parameters()),
                  "budgets": st["host_budget_bytes"] + st["device_budget_bytes"] + st["host_bounce_bytes"]}))
engine.close()
'''


def _initialize_growth(nvme: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TIERMEM_MMAP_THRESHOLD", "RANK", "WORLD_SIZE")}
    env["TIERMEM_LOG_LEVEL"] = "warn"
    p = subprocess.run([sys.executable, "-c", WORKER, nvme], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_initialize_peak_is_one_unit_beyond_the_budgets(tmp_path):
    """VmHWM growth across initialize at world size 1 (peak reset just before it; torch.optim's
    first import done before), a frozen base of 24 units of 16 MiB built under zero.Init: at most
    one unit, the engine's host and device budgets and bounce buffer, and 16 MiB of fixed costs
    (threads, rings): a third of the 384 MiB base, so an initialize that held a copy of it fails.
    Registering as before (a new vector from torch.empty beside a loaded copy, per unit) grew by
    433 MiB when this was written, as glibc kept the freed 16 MiB vectors in its heap; how much it
    keeps varies from run to run (52-337 MiB in four runs on 6 December 2026), so that run is not
    part of the test."""
    new = _initialize_growth(str(tmp_path / "new"))
    bound = new["unit"] + new["budgets"] + (16 << 20)
    assert bound * 3 <= new["model"], f"the bound would not catch a copy of the base: {new}"
    assert new["growth"] <= bound, f"initialize grew VmHWM by {new['growth'] >> 20} MiB, bound {bound >> 20} MiB: {new}"


HOST_WORKER = r'''
import json, sys, torch
import tiermem.torch as tt
import tiermem.torch._register as R
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
if sys.argv[1] == "old":  # every value kept until the last unit is registered
    R.exact_dtypes = lambda config, zero: (set(), set(), False)
cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
       "tiermem": {"host_budget_bytes": "512MiB", "device_budget_bytes": "48MiB"}}
torch.manual_seed(0)
build = lambda: torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(24)],
                                    torch.nn.Linear(2048, 8, bias=False))
if sys.argv[2] == "init":
    with tt.zero.Init(config=cfg):  # in host memory (nothing on NVMe): 24 frozen units of 16 MiB, a head trained
        model = build()
else:  # the model's own tensors
    model = build()
for p in list(model.parameters())[:-1]:
    p.requires_grad_(False)
torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)  # torch.optim's first use imports ~150 MiB
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
engine, *_ = tt.initialize(model=model, config=cfg)
growth = status("VmHWM") - before
x = torch.ones(1, 2048)
print(json.dumps({"growth": growth, "unit": 2048 * 2048 * 4, "trim": R.TRIM_BYTES,
                  "bounce": engine.stats()["host_bounce_bytes"], "out": engine(x).double().sum().item()}))
engine.close()
'''


@pytest.mark.parametrize("built", ["init", "own"])
def test_initialize_frees_the_models_values_unit_by_unit(built):
    """With nothing on NVMe, zero.Init keeps the built values in host memory, and a model built
    without it holds its own tensors. initialize held either until the last unit was registered,
    beside the engine's homes filled meanwhile: the model twice (a 246 M LoRA base at offload cpu:
    max RSS 1.5x the plain loop's, issue 57). Each unit's values are now freed once it is
    registered (the engine gives them back if a later one fails): VmHWM grows across initialize by
    at most one unit, the bytes freed between two returns of glibc's heap to the system, no bounce
    chunk (nothing moves to NVMe) and 16 MiB of fixed costs; keeping every value to the end (as
    before) grows by the whole 384 MiB base."""
    env = {k: v for k, v in os.environ.items() if k not in ("TIERMEM_MMAP_THRESHOLD", "RANK", "WORLD_SIZE")}
    env["TIERMEM_LOG_LEVEL"] = "warn"
    runs = {}
    for how in ("new", "old"):
        p = subprocess.run([sys.executable, "-c", HOST_WORKER, how, built], capture_output=True, text=True,
                           timeout=300, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[how] = json.loads(p.stdout.strip().splitlines()[-1])
    new, old = runs["new"], runs["old"]
    assert new["bounce"] == 0, f"a bounce chunk was committed with nothing on NVMe: {new}"
    assert new["out"] == old["out"], runs
    bound = new["unit"] + new["trim"] + (16 << 20)
    assert new["growth"] <= bound, f"initialize grew VmHWM by {new['growth'] >> 20} MiB, bound {bound >> 20} MiB: {new}"
    assert old["growth"] > bound + (128 << 20), f"keeping every value to the end stays within the bound: {old}"


@pytest.mark.parametrize("built", ["init", "own", "init_nvme"])
def test_a_unit_of_one_tensor_in_memory_is_registered_where_it_is(built, tmp_path, monkeypatch):
    """A unit of one fp32 tensor already in host memory (the model's own, or zero.Init's host
    memory copy) is registered from that tensor: the vector of its own mapping beside it was a
    second copy of the unit at initialize's peak (the 246 M Llama's 125 MiB embedding and head at
    offload cpu: VmHWM 0.29 GiB above what initialize left, then 0.13, issue 57). A unit of
    several tensors, or one whose values are in an Init store file, still goes through a vector.
    The engine then computes what the model built without tiermem computes."""
    import tiermem.torch as tt
    from tiermem.torch import _register
    made = []
    mapped_empty = _register.mapped_empty
    monkeypatch.setattr(_register, "mapped_empty", lambda n, *a: made.append(n) or mapped_empty(n, *a))
    swap = str(tmp_path / "swap")
    device = "nvme" if built == "init_nvme" else "cpu"
    off = {"device": device, "nvme_path": swap} if device == "nvme" else {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "offload_param": off, "offload_optimizer": dict(off)},
           "tiermem": {"log_level": "warn"}}

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(3)], torch.nn.Linear(64, 4))
    ref = build()
    if built == "own":
        model = build()
    else:
        with tt.zero.Init(config=cfg):
            model = build()
    for p in list(model.parameters())[:3]:  # a frozen base of three one-tensor units, a head of two trained
        p.requires_grad_(False)
    engine, *_ = tt.initialize(model=model, config=cfg)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    got = engine(x).detach()
    engine.close()
    assert torch.equal(got, ref(x).detach())
    assert made == ([64 * 64] * 3 + [64 * 4 + 4] if built == "init_nvme" else [64 * 4 + 4]), made


def test_held_values_is_the_tensor_itself_or_none():
    """Unit.held_values: the one parameter's own fp32 contiguous storage (no copy); None for a
    unit of two tensors, another dtype, or a non-contiguous tensor."""
    from tiermem.torch._predictor import NextUnitPredictor
    from tiermem.torch._unit import EngineLink, build_units
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4),
                                torch.nn.Linear(4, 4, bias=False).double(), torch.nn.Linear(6, 4, bias=False))
    model[3].weight = torch.nn.Parameter(torch.randn(6, 4).t())  # a transposed view: not contiguous
    units = build_units(model, (), EngineLink(model, [], NextUnitPredictor())).units
    held = [u.held_values() for u in units]
    assert held[0] is not None and held[0].data_ptr() == model[0].weight.data_ptr() and held[0].shape == (16,)
    assert held[1:] == [None, None, None], held
