"""engine.offload_states() / reload_states() (DeepSpeed's names; RL colocation): after offloading,
the process's current RSS (/proc/self/statm) is back within 64 MiB of what it was before
initialize, and after reloading the next 3 losses equal an uninterrupted run's bit for bit.
In its own process, so that other tests' memory does not blur the RSS. Also: directories the
engine made under nvme_path are gone after close(); the user's own directory stays."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker(swap: str) -> dict:
    import torch
    import tiermem.torch as tt
    from torch_models import batches, build, ds_config
    torch.set_num_threads(1)
    data = batches(6)
    out = {}
    for run in ("straight", "offloaded"):
        os.makedirs(os.path.join(swap, run))  # the user's: stays
        d = os.path.join(swap, run, "p")  # the engine's to make and remove
        cfg = ds_config(d, "nvme", tiermem={"host_budget_bytes": "64MiB", "device_budget_bytes": "16MiB"})
        with tt.zero.Init(config=cfg):
            model = build("llama", layers=4, hidden=256)
        before = _rss()
        engine, *_ = tt.initialize(model=model, config=cfg)
        losses = []
        for i, b in enumerate(data):
            if run == "offloaded" and i == 3:
                peak = _rss()
                dropped = engine.offload_states()
                out["rss_before_init"], out["rss_peak"], out["rss_offloaded"] = before, peak, _rss()
                out["dropped"] = dropped
                engine.reload_states()
            loss = engine(input_ids=b, labels=b).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[run] = losses
        engine.close()
        del engine, model
        out[run + "_left"] = sorted(os.listdir(os.path.join(swap, run))) if os.path.isdir(os.path.join(swap, run)) \
            else None
    return out


def test_offload_states_returns_memory_and_training_goes_on(torch_or_skip, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path)], capture_output=True, text=True,
                       timeout=600, cwd=HERE, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"RSS before initialize {r['rss_before_init'] / MIB:.0f} MiB, training {r['rss_peak'] / MIB:.0f} MiB, "
          f"after offload_states {r['rss_offloaded'] / MIB:.0f} MiB ({r['dropped'] / MIB:.0f} MiB of copies dropped)")
    assert r["offloaded"] == r["straight"]  # bit for bit
    assert r["dropped"] >= 16 * MIB  # there was memory to give back ...
    assert r["rss_peak"] - r["rss_offloaded"] >= r["dropped"] // 2  # ... and the process's RSS fell with it
    assert r["rss_offloaded"] <= r["rss_before_init"] + 64 * MIB
    # What the engine made under the user's directory went with it; the user's directory stayed.
    assert r["straight_left"] == [] and r["offloaded_left"] == []


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1])))
