"""tiermem for PyTorch.

ZeRO-Infinity for any torch model, with DeepSpeed's call shapes (``engine.py``, ``zero.py``)::

    import tiermem.torch
    engine, optimizer, _, lr_scheduler = tiermem.torch.initialize(model=model, config="ds_config.json")

Under it is the C++ ZeroEngine tiermem-train runs: parameters, gradients and optimizer state are
paged across the tiers the config names; Python only hooks the modules.

And AdamW optimizers over tiermem's SIMD kernel for a model that stays where it is
(``optim.py``)::

    from tiermem.torch import CPUAdamW, NVMeAdamW

DeepSpeed's ZeRO-3 utility functions (``safe_get_full_fp32_param`` and friends) are in ``utils``.
"""

from .engine import TiermemEngine, ZeroOptimizer, initialize, set_z3_leaf_modules
from .optim import CPUAdamW, NVMeAdamW
from . import utils, zero

__all__ = ["zero", "utils", "initialize", "TiermemEngine", "ZeroOptimizer", "set_z3_leaf_modules", "CPUAdamW", "NVMeAdamW"]
