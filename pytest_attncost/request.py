"""What a profile is asked for: the vocabularies of its arguments, the limits they are checked against, and the
:class:`Request` made of them once, at the API's door.

No torch here: the markers, the settings and the command line read these names without importing a counter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ProfileError
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .formulas import CAUSAL, ModelSpec

__all__ = ["BACKENDS", "CAUSAL", "COMPONENTS", "DEFAULT_REPEATS", "DEFAULT_WARMUP", "LARGEST_TOKENS", "MODES", "PARTS",
           "TOO_LARGE", "Inputs", "Request"]

#: The parts the formulas describe, and the four every count is split into.
COMPONENTS = ("attention_core", "attention_proj", "ffn")
PARTS = (*COMPONENTS, "other")
#: What profile() takes: the counters and what is counted (how causal attention is counted: formulas.CAUSAL).
BACKENDS = ("fvcore", "torch")
MODES = ("forward", "train", "decode")
#: measure()'s untimed and timed forwards.
DEFAULT_WARMUP = 2
DEFAULT_REPEATS = 5

#: batch x n past which torch cannot describe even the token ids (8 bytes each, under 2**63 bytes).
LARGEST_TOKENS = 2**59
TOO_LARGE = ("n={n}, batch={batch}: too large for torch to describe (a tensor of 2**63 bytes or more, even on the "
             "meta device); use a smaller n, or evaluate the formulas alone: pytest_attncost.model_costs(spec, n) "
             "or python -m pytest_attncost --n N")

Inputs = Any  # a tuple of positional args, a dict of keyword args, a tensor, or a callable (n, batch) -> those


def positive(name: str, value: object, hint: str = "") -> int:
    """*value*, checked to be a positive int (ProfileError naming *name* otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ProfileError(f"{name} must be a positive int, got {value!r}{hint}")
    return value


#: profile()'s keywords that make its request (and a sweep's lengths).
KEYWORDS = ("batch", "inputs", "roles", "spec", "name", "backend", "mode", "causal", "fallback", "new_tokens", "m",
            "lengths")


@dataclass(frozen=True)
class Request:
    """What one profile is asked for: profile()'s arguments, checked (:meth:`of`), as they travel down; inputs,
    roles, backend, mode, causal, fallback and m as profile() takes them."""

    n: int | None = None  # the sequence length (a decode step's cache), None where the inputs tell it
    batch: int = 1  # 1 where none was given
    batch_given: bool = False
    inputs: Inputs | None = None
    roles: Mapping[str, Any] | None = None
    spec: ModelSpec | None = None  # the spec the formulas use
    spec_read: bool = True  # read from the model (None given), which the structure may then correct
    spec_note: str | None = None  # why the model's config gives none
    name: str = ""  # the profile's name ("" until the model's class names it)
    backend: str = "fvcore"
    mode: str = "forward"
    causal: str = "full"
    fallback: bool = True
    new_tokens: int | None = None  # a decode step's, else None
    m: int | None = None
    lengths: tuple[int, ...] = ()  # a sweep's lengths counted in one run (n is None then); at() gives one

    @classmethod
    def of(cls, n: Any = None, **given: Any) -> Request:
        """The request *n* and profile()'s keywords *given* (as the user gave them) make, or a sweep's with
        ``lengths=`` (checked already) in one run; ProfileError for an argument of the wrong type or out of range."""
        if unknown := sorted(set(given) - set(KEYWORDS)):
            raise TypeError(f"profile() got unexpected keyword arguments: {', '.join(unknown)}")
        mode, m, lengths = given.get("mode", "forward"), given.get("m"), tuple(given.pop("lengths", ()))
        if n is not None:
            positive("n", n)
        if m is not None:
            positive("m", m)
            if mode == "decode":
                raise ProfileError("m= is the second sequence's length (encoder-decoders, cross-attention); a decode "
                                   "step has its cache's length n and new_tokens: drop m=")
        batch = given.pop("batch", None)
        batch_given, batch = batch is not None, 1 if batch is None else positive("batch", batch)
        for length in lengths or (n,):
            if (length or 1) * batch > LARGEST_TOKENS:
                raise ProfileError(TOO_LARGE.format(n=length, batch=batch))
        roles, spec, name = given.get("roles"), given.get("spec"), given.pop("name", None)
        if roles is not None and not isinstance(roles, Mapping):
            raise ProfileError(f"roles= must be a dict of role -> module-name globs, got {type(roles).__name__} "
                               f"{roles!r}; e.g. roles={{'attention': ['layers.*.attn'], 'ffn': ['layers.*.mlp']}}")
        if spec is not None and not isinstance(spec, ModelSpec):
            raise ProfileError(f"spec= must be a pytest_attncost.ModelSpec, got {type(spec).__name__}")
        if name is not None and not isinstance(name, str):
            raise ProfileError(f"name= must be a str, got {type(name).__name__}")
        backend = given.pop("backend", None)
        for label, value, allowed in (("backend", backend, BACKENDS), ("mode", mode, MODES),
                                      ("causal", given.get("causal", "full"), CAUSAL)):
            if value not in allowed and not (label == "backend" and value is None):
                raise ProfileError(f"{label}= must be one of {', '.join(allowed)}, got {value!r}")
        new_tokens = given.pop("new_tokens", None)
        if mode == "decode":
            new_tokens = 1 if new_tokens is None else positive("new_tokens", new_tokens)
            if n is None and not lengths:
                raise ProfileError("mode='decode' needs n=: the tokens already in the KV cache")
        elif new_tokens is not None:
            raise ProfileError(f"new_tokens= is the query length of a decode step: pass mode='decode' "
                               f"(mode is {mode!r})")
        return cls(n, batch, batch_given, spec_read=spec is None, name=name or "", backend=backend or "fvcore",
                   fallback=bool(given.pop("fallback", True)), new_tokens=new_tokens, lengths=lengths, **given)

    def at(self, n: int) -> Request:
        """The request at length *n* (one of a sweep's, checked with them)."""
        return dataclasses.replace(self, n=n, lengths=())
