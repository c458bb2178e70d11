"""Is an attention core causal? The mask algebra both counters share.

A mask is described by the set of (query i, key j) positions where it is non-zero / True:
("all",), ("none",), ("lower", d): j - i <= d, ("upper", d): j - i >= d; plus the value it
holds there when known (``fill``). Both counters evaluate the few ops that build masks (ones,
full, tril, triu, == 0, ~, where, masked_fill, slices from 0, casts and views) over these
patterns (:func:`mask_transfer`); whatever else builds a mask leaves it unknown. The label an
attention product gets (:data:`~pytest_attncost.ops.MASK_CAUSAL`, ...) comes from the masks
applied to its scores (:func:`masking_label`) or passed to fused attention (:func:`sdpa_label`).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Mapping
from numbers import Number
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from ..ops import MASK_CAUSAL, MASK_NONE, MASK_UNKNOWN

__all__ = ["MASK_PASS", "Pattern", "Patterns", "SCORE_MASKING", "SCORE_PASS", "argument_names", "buffer_masks",
           "combine", "mask_transfer", "masking_label", "recording", "score_op", "sdpa_label"]

Pattern = tuple[tuple[Any, ...], Any]  # (position set, fill value or None)


_VIEWS = {"view", "reshape", "_unsafe_view", "expand", "expand_as", "unsqueeze", "squeeze", "contiguous", "clone", "to",
          "_to_copy", "type_as", "detach", "alias", "float", "half", "bfloat16", "view_as", "reshape_as"}
MASK_PASS = frozenset(_VIEWS | {"lift_fresh", "lift_fresh_copy", "bool"})
#: Ops that carry attention scores or probabilities unchanged in form (from QK^T to AV).
SCORE_PASS = frozenset(_VIEWS | {"mul", "div", "softmax", "_softmax", "_safe_softmax", "dropout", "native_dropout",
                                 "feature_dropout"})


SCORE_MASKING = frozenset({"masked_fill", "add", "where"})


def score_op(name: str) -> str:
    """*name* as the mask reader knows it: an in-place op (``add_``, ``masked_fill_``: T5 adds its bias and mask to
    the scores in place) is its out-of-place form."""
    return name[:-1] if name.endswith("_") and name[:-1] in SCORE_MASKING | SCORE_PASS else name


def argument_names(op: str) -> tuple[str, ...]:
    """The arguments of *op* (``aten::name``: fused attention's mask and flag) in its schema's order (first overload);
    () where torch does not know it by that name."""
    namespace, _, name = op.partition("::")
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        return tuple(argument.name for argument in getattr(packet, packet.overloads()[0])._schema.arguments)
    except Exception:  # noqa: BLE001 - an op torch does not know by that name, or one without a schema
        return ()


def _complement(positions: tuple[Any, ...]) -> tuple[Any, ...]:
    kind = positions[0]
    if kind in ("all", "none"):
        return ("none",) if kind == "all" else ("all",)
    return ("upper", positions[1] + 1) if kind == "lower" else ("lower", positions[1] - 1)


def _constant_fill(value: Any) -> Any:
    """A Python number, or the fill of an ("all",) pattern; None if neither."""
    if isinstance(value, Number):
        return value
    if isinstance(value, tuple) and len(value) == 2 and value[0] == ("all",):
        return value[1]
    return None


def mask_transfer(op: str, ins: list[Any]) -> Pattern | None:
    """The pattern of ``op(*ins)``, where each input is a Pattern, a constant, or None (unknown)."""
    first, second = [*ins, None, None][:2]
    if op in ("ones", "ones_like", "new_ones"):
        return (("all",), 1)
    if op in ("zeros", "zeros_like", "new_zeros"):
        return (("all",), 0)
    if op in ("full", "full_like", "new_full", "scalar_tensor"):
        fill = _constant_fill(first if op == "scalar_tensor" else second)
        return None if fill is None else (("all",), fill)
    if not isinstance(first, tuple):
        return None
    positions, fill = first
    if op in ("tril", "triu"):
        if positions != ("all",) or fill in (0, False, None):
            return None
        return (("lower" if op == "tril" else "upper", second if isinstance(second, int) else 0), fill)
    if op in ("eq", "ne"):
        other = _constant_fill(second)
        if other in (0, False):
            return (_complement(positions) if op == "eq" else positions, True)
        return (positions, True) if op == "eq" and other is not None and other == fill else None
    if op in ("logical_not", "bitwise_not"):
        return (_complement(positions), True)
    if op == "slice":
        # a crop [start:end] of the query or key axis keeps the triangle only from the origin
        start = ins[2] if len(ins) > 2 else None
        step = ins[4] if len(ins) > 4 else 1
        return first if start in (None, 0) and step in (None, 1) else None
    if op in MASK_PASS:
        return first
    if op == "where" and len(ins) >= 3:  # where(C, a, b) with constant a, b: an additive mask built from C
        a, b = (_constant_fill(v) for v in ins[1:3])
        if a is None or b is None or (a == 0) == (b == 0):
            return None
        return (_complement(positions), b) if a == 0 else (positions, a)
    if op == "masked_fill" and positions == ("all",) and fill == 0 and len(ins) > 2 and isinstance(ins[1], tuple):
        value = _constant_fill(ins[2])  # zeros(...).masked_fill(M, -inf): an additive mask built from M
        return (ins[1][0], value) if value not in (None, 0) else None
    return None


def _label(masked: tuple[Any, ...] | None) -> str:
    # ("upper", 1): the positions a causal mask removes, j > i
    return MASK_NONE if masked == ("none",) else MASK_CAUSAL if masked == ("upper", 1) else MASK_UNKNOWN


def _additive(mask: Any) -> str:
    """The label of a mask added to the scores (a Pattern, or None: unknown)."""
    if not isinstance(mask, tuple):
        return MASK_UNKNOWN
    positions, fill = mask
    if positions == ("none",) or fill == 0:
        return MASK_NONE
    return _label(positions) if isinstance(fill, (int, float)) and fill < 0 else MASK_UNKNOWN


def masking_label(op: str, ins: list[Any], flow: int) -> str:
    """The label a masking op puts on the scores at input position *flow*."""
    if op == "masked_fill" and flow == 0 and len(ins) > 1:
        mask = ins[1]
        return _label(mask[0] if isinstance(mask, tuple) else None)
    if op == "add":
        mask = ins[1 - flow] if flow in (0, 1) and len(ins) > 1 else None
        return MASK_NONE if isinstance(mask, Number) else _additive(mask)  # a constant shift changes nothing
    if op == "where" and len(ins) >= 3 and flow in (1, 2) and isinstance(ins[0], tuple):
        return _label(_complement(ins[0][0]) if flow == 1 else ins[0][0])
    return MASK_UNKNOWN


def sdpa_label(is_causal: Any, has_mask: bool, attn_mask: Any, mask_is_bool: bool | None) -> str:
    """``is_causal=True`` or a causal ``attn_mask`` (bool: True = attend; float: added to the scores). *attn_mask* is
    the mask's Pattern, None when its form is unknown; *has_mask* says whether one is passed at all."""
    if not has_mask:
        return MASK_CAUSAL if is_causal is True else MASK_NONE if is_causal in (False, None) else MASK_UNKNOWN
    if mask_is_bool and isinstance(attn_mask, tuple):
        return _label(_complement(attn_mask[0]))
    return _additive(attn_mask)


def combine(labels: Iterator[str] | list[str] | set[str]) -> str:
    found = {label for label in labels if label}
    return MASK_NONE if not found else MASK_CAUSAL if found == {MASK_CAUSAL} else MASK_UNKNOWN


#: Ops whose result's pattern mask_transfer computes: the passes, the mask builders, the constructors.
_TRACKED = MASK_PASS | {"slice", "tril", "triu", "eq", "ne", "where", "masked_fill", "logical_not", "bitwise_not",
                        "ones", "zeros", "full", "scalar_tensor", "ones_like", "zeros_like", "full_like", "new_ones",
                        "new_zeros"}


class Patterns:
    """The patterns of the tensors dispatched ops make, op by op (*known*: tensors known beforehand)."""

    def __init__(self, known: Mapping[int, Pattern] | None = None) -> None:
        from torch.utils.weak import WeakTensorKeyDictionary
        self.found: Any = WeakTensorKeyDictionary()
        self.known = dict(known or {})  # id(tensor) -> pattern (a model's mask buffers, held by the model)

    def abstract(self, value: Any) -> Any:
        """A tensor's pattern (None: unknown), or the value itself."""
        if isinstance(value, torch.Tensor):
            pattern = self.found.get(value)
            return self.known.get(id(value)) if pattern is None else pattern
        return value

    def track(self, name: str, out: Any, args: tuple[Any, ...]) -> None:
        """The pattern of *out*, made by op *name* (short) of *args*, where the algebra can tell it."""
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if name in _TRACKED and isinstance(first, torch.Tensor):
            pattern = mask_transfer(name, [self.abstract(a) for a in args])
            if pattern is not None:
                self.found[first] = pattern


class _Recorder(TorchDispatchMode):
    def __init__(self, patterns: Patterns) -> None:
        super().__init__()
        self.patterns = patterns

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.patterns.track(str(func._overloadpacket).rsplit(".", 1)[-1], out, tuple(args))
        return out


#: Models built by a factory on the meta device -> the patterns of their mask buffers, read while built.
_BUILT: weakref.WeakKeyDictionary[nn.Module, dict[str, Pattern]] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def recording() -> Iterator[Patterns]:
    """Follow the mask patterns of what is built meanwhile (a factory's model on the meta device has no values to
    read its ``register_buffer("tril", torch.tril(torch.ones(n, n)))`` from afterwards)."""
    patterns = Patterns()
    with _Recorder(patterns):
        yield patterns


def remember(model: nn.Module, patterns: Patterns) -> None:
    """Keep the patterns of *model*'s buffers, as they were built (see :func:`recording`)."""
    found = {name: patterns.found[buffer] for name, buffer in model.named_buffers() if buffer in patterns.found}
    if found:
        _BUILT[model] = found


def buffer_masks(model: nn.Module) -> dict[str, Pattern]:
    """Buffers of *model* (the original, with values) that hold a triangular mask, by dotted name.

    A twin's buffers are empty meta tensors, so the form of a registered mask is read here, from the user's model
    (square masks whose non-zero entries form ``tril`` or ``triu(diagonal=1)``). A model a factory built on the
    meta device has no values: its buffers' patterns were followed while it was built (:func:`recording`).
    """
    found: dict[str, Pattern] = dict(_BUILT.get(model, {}))  # built on the meta device: read while built
    for name, buffer in model.named_buffers():
        if buffer.is_meta or buffer.dim() < 2 or buffer.is_quantized or buffer.is_sparse:
            continue
        n = buffer.shape[-1]
        if n < 2 or buffer.shape[-2] != n or math.prod(buffer.shape[:-2]) != 1 or n > 16384:
            continue
        square = buffer.detach().reshape(n, n)
        nonzero = square != 0
        ones = torch.ones(n, n, dtype=torch.bool, device=square.device)
        if torch.equal(nonzero, torch.tril(ones)):
            positions: tuple[Any, ...] = ("lower", 0)
        elif torch.equal(nonzero, torch.triu(ones, diagonal=1)):
            positions = ("upper", 1)
        else:
            continue
        values = square[nonzero]
        fill = values[0].item() if bool((values == values[0]).all()) else None
        found[name] = (positions, fill)
    return found
