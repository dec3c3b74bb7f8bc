"""initialize's registration of the model's engine units, one at a time.

Each unit's values go in through a vector of their own mapping (zero.Init's values read straight
into it), unmapped once registered: registration holds one unit's values at a time. Vectors from
torch.empty stayed in glibc's heap (+0.8 GiB of a 1.1 B Llama's 16 MiB units at initialize,
issue 57). A unit of one fp32 tensor already in memory (``Unit.held_values``) is read where it
is, with no vector beside it.

The model's values of a unit (zero.Init's copy in host memory, or the model's own tensors where
every home is in memory) are freed as soon as the unit is registered, where the engine gives them
back exactly (``exact_dtypes``): held until the last unit, they and the engine's homes were the
model twice (a 246 M LoRA base at offload cpu: max RSS 1.5x the plain loop's, issue 57). A
registration that fails, or is interrupted, gives every freed value back from the engine first
(``ZeroEngine.export_master`` reads while registration is open), so a failed initialize leaves the
model as it was.

Thread-safety: the calling thread, inside initialize.
"""

from __future__ import annotations

import torch

from ._malloc import mapped_empty, return_freed_memory

__all__ = ["register_units", "exact_dtypes", "TRIM_BYTES"]

# Bytes of the model's values freed during registration between two returns of glibc's free heap to
# the system (return_freed_memory): the most the freed values add to RSS meanwhile.
TRIM_BYTES = 64 << 20


def exact_dtypes(config: dict, zero) -> tuple:
    """What the engine gives back exactly (export_master) once registered, so that a unit's values
    may be freed as soon as it is registered: the parameter dtypes (for a trained unit, for a frozen
    one), and whether the model's own tensors may go too (every home in memory: reading back is a
    copy, not NVMe I/O that could fail as registration did). A trained unit's fp32 master weights
    hold any fp32, bf16 or fp16 value; a frozen unit's working values, at rest in the working dtype,
    hold that dtype or a narrower one. Nothing below stage 3 (the parameters stay the model's own)
    or with several ranks (reading back is a collective)."""
    halves = {torch.bfloat16, torch.float16}
    if config["zero_optimization"]["stage"] < 3 or zero.world_size() > 1:
        return set(), set(), False
    st = zero.stats()
    working = zero.working_dtype()
    frozen = (set() if st["frozen_dtype"] != "working" else {torch.float32, *halves} if working == "f32"
              else {torch.bfloat16} if working == "bf16" else {torch.float16})
    return {torch.float32, *halves}, frozen, "nvme" not in (st["param_home"], st["optimizer_home"])


def register_units(zero, units, config: dict) -> None:
    """Registers every unit of `units` with the ZeroEngine `zero`, freeing each unit's values once it
    is in the engine where that is exact (module docstring). On any exception (a refused
    registration, KeyboardInterrupt) the freed values are given back before it propagates; if the
    engine cannot give them, a RuntimeError says so."""
    exact = exact_dtypes(config, zero)
    lent, freed = [], 0
    try:
        for u in units:
            values = u.held_values()  # one tensor in memory: read where it is
            if values is None:
                values = u.flat_values(mapped_empty(u.numel))
            zero.register_module(u.name, values, u.numel)
            values = None  # lend below frees the model's copy: nothing here may hold it
            if {p.dtype for p, _, _ in u.params} <= exact[u.frozen]:
                kept, nbytes = u.lend(own=exact[2])
                if nbytes:
                    lent.append((u, kept))
                    freed += nbytes
            if freed >= TRIM_BYTES:  # glibc keeps freed mid-size blocks in its heap until trimmed
                return_freed_memory()
                freed = 0
    except BaseException as e:
        _give_back(lent, zero, e)
        raise


def _give_back(lent: list, zero, error: BaseException) -> None:
    """A failed registration: each lent unit's values, read back from the engine, go back where
    Unit.lend took them from (`lent`: (unit, what lend kept))."""
    for u, kept in lent:
        try:
            values = zero.export_master(u.index)
        except Exception as e:
            raise RuntimeError(f"tiermem.torch.initialize failed ({error}), and reading unit {u.name}'s values back "
                               f"from the engine failed too ({e}): its parameters hold no values now; build the "
                               "model again") from error
        u.give_back(values, kept)
