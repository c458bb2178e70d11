"""What a profile is asked for: the vocabularies of its arguments, and the limits they are checked against.

No torch here: the markers, the settings and the command line read these names without importing a counter.
"""

from __future__ import annotations

from typing import Any

from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)

__all__ = ["BACKENDS", "CAUSAL", "COMPONENTS", "LARGEST_TOKENS", "MODES", "PARTS", "TOO_LARGE", "Inputs"]

#: The parts the formulas describe, and the four every count is split into.
COMPONENTS = ("attention_core", "attention_proj", "ffn")
PARTS = (*COMPONENTS, "other")
#: What profile() takes: the counters, what is counted, how causal attention is counted.
BACKENDS = ("fvcore", "torch")
MODES = ("forward", "train", "decode")
CAUSAL = ("full", "half", "kept")

#: batch x n past which torch cannot describe even the token ids (8 bytes each, under 2**63 bytes).
LARGEST_TOKENS = 2**59
TOO_LARGE = ("n={n}, batch={batch}: too large for torch to describe (a tensor of 2**63 bytes or more, even on the "
             "meta device); use a smaller n, or evaluate the formulas alone: pytest_attncost.model_costs(spec, n) "
             "or python -m pytest_attncost --n N")

Inputs = Any  # a tuple of positional args, a dict of keyword args, a tensor, or a callable (n, batch) -> those
