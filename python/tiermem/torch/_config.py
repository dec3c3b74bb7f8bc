"""The ds_config of tiermem.torch: parsed by tiermem's C++ parser (the one tiermem-train uses),
with the "auto" values HF's DeepSpeed integration derives from the model derived the same way.
Used by ``initialize`` (engine.py) and ``zero.Init`` (its Init store directory).

Errors: ValueError for a file that cannot be read or a config the parser refuses (naming the key,
the value and the rule, and the file); TypeError for a config that is neither a path nor a dict.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Optional

import torch

from .. import _tiermem

__all__ = ["load_config"]

_HF_AUTO_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


def _hidden_size(model: torch.nn.Module) -> Optional[int]:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    for key in ("hidden_size", "n_embd", "d_model"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    sizes = getattr(cfg, "hidden_sizes", None)
    if isinstance(sizes, (list, tuple)) and sizes:
        return max(sizes)
    return None



def _refuse_non_finite(node, where: str) -> None:
    """ValueError naming the key of a NaN or infinite float in a config dict: JSON has no such
    numbers, so json.dumps would write a token the parser then calls a syntax error."""
    if isinstance(node, float) and not math.isfinite(node):
        raise ValueError(f"tiermem.torch.initialize: config key '{where}' = {node}: must be a finite number")
    if isinstance(node, dict):
        for k, v in node.items():
            _refuse_non_finite(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, (list, tuple)):
        for j, v in enumerate(node):
            _refuse_non_finite(v, f"{where}[{j}]")

def load_config(config: Any, model: Optional[torch.nn.Module] = None, world_size: int = 1, quiet: bool = False):
    """Parses `config` (a path to a ds_config JSON file, or a dict) with tiermem's parser.

    Where HF's DeepSpeed integration derives an "auto" from the model, the same is done here from
    ``model.config``'s hidden size H: reduce_bucket_size = H*H, stage3_prefetch_bucket_size =
    0.9*H*H, stage3_param_persistence_threshold = 10*H (one line says what each became). Every
    other "auto" takes tiermem's default (listed on one line). Returns (Config, dict of every key)."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"tiermem.torch.initialize: cannot read config file {path}: {e.strerror}") from None
        source = path
    elif isinstance(config, dict):
        _refuse_non_finite(config, "")
        try:
            text = json.dumps(config, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"tiermem.torch.initialize: config dict is not JSON-serialisable: {e}") from None
        source = "<config dict>"
    else:
        raise TypeError(f"tiermem.torch.initialize: config must be a path or a dict, got {type(config).__name__}")
    parsed = _tiermem.parse_config(text, source)  # duplicate keys, types and ranges checked here
    doc = json.loads(text)
    zero = doc.get("zero_optimization") if isinstance(doc, dict) else None
    hidden = _hidden_size(model) if model is not None else None
    if isinstance(zero, dict) and hidden:
        derived = {"reduce_bucket_size": hidden * hidden,
                   "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
                   "stage3_param_persistence_threshold": 10 * hidden}
        done = []
        for key in _HF_AUTO_KEYS:
            if zero.get(key) == "auto":
                zero[key] = derived[key]
                done.append(f"zero_optimization.{key}={derived[key]}")
        if done:
            if not quiet:
                print(f"tiermem.torch: \"auto\" from the model (hidden size {hidden}): {', '.join(done)}",
                      file=sys.stderr)
            parsed = _tiermem.parse_config(json.dumps(doc), source)
    parsed.resolve_batch_sizes(world_size)
    line = parsed.auto_resolved_line()
    if line and not quiet:
        print(f"tiermem.torch: {line}", file=sys.stderr)
    return parsed, json.loads(parsed.to_json())
