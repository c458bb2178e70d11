"""pytest-attncost: attention-cost budgets for Transformer models, as pytest tests.

Counts multiply-accumulates (MACs) with fvcore and splits them the way the
Transformer cost analysis of Su Jianlin, "Linear attention is probably not the
model you are waiting for" (PaperWeekly / kexue.fm, 2021) does: attention core
(``2n²hd``), attention projections (``4n(hd)²``) and FFN (``8n(hd)²``).
"""

from __future__ import annotations

import importlib

from .conventions import Formula
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .footprint import Memory, activation_bytes, memory_crossover_n, model_state_bytes
from .formulas import (
    Costs,
    Generation,
    ModelSpec,
    attention,
    attention_core,
    attention_proj,
    crossover_n,
    decode_costs,
    decode_crossover_n,
    decode_quadratic_n,
    ffn,
    generation_cost,
    kept_pairs,
    kv_cache_bytes,
    layer_costs,
    linear_attention_saving,
    model_costs,
    quadratic_n,
)
from .units import format_count, parse_count

__version__ = "0.1.0"

__all__ = ["Costs", "Formula", "Generation", "Memory", "ModelSpec", "Profile", "ProfileError", "Sweep", "Timing",
           "TimingSweep", "__version__", "activation_bytes", "attention", "attention_core", "attention_proj",
           "clear_cache", "crossover_n", "decode_costs", "decode_crossover_n", "decode_quadratic_n", "decode_sweep",
           "ffn", "format_count", "generation_cost", "kept_pairs", "kv_cache_bytes", "layer_costs",
           "linear_attention_saving", "measure", "measure_memory", "measure_sweep", "memory_crossover_n", "model_costs",
           "model_state_bytes", "parse_count", "profile", "quadratic_n", "sweep"]

#: What loads only when asked for, and the module that holds it: torch and fvcore are imported when counting is
#: asked for, so `pytest --help` and suites that never profile do not pay for them.
_LAZY = {**dict.fromkeys(("profile", "ProfileError", "sweep", "clear_cache", "decode_sweep", "measure", "measure_sweep",
                          "measure_memory"), "api"),
         "Profile": "result", "Timing": "result", "Sweep": "series", "TimingSweep": "series"}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
