"""Count one forward pass with fvcore, on a meta-device twin, keeping a record of every op.

fvcore's ``FlopCountAnalysis`` does the counting; this module adds what it lacks:

* handles for fused attention (``aten::scaled_dot_product_attention`` and the
  kernels it dispatches to), which fvcore logs as unsupported and counts as zero;
* handles for a few more matrix products (``baddbmm``, ``addbmm``, ``mv``, ...);
* a record per op (module scope, MACs, shapes, whether an operand is a
  parameter), so that :mod:`pytest_attncost.roles` can split the count;
* a twin of the model whose parameters and buffers live on the meta device:
  the user's model is never run, moved or hooked, and no arithmetic is done;
* an exact einsum handle (fvcore's rounds to 4 significant digits);
* a mask label on every attention product (``OpRecord.mask``: causal or not);
* neither counter fires the user's global module hooks.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import dataclasses
import functools
import math
import re
import types
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from numbers import Number
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import lengths as lengths_mod
from .ops import (  # the torch-free tables; re-exported here, where they were first defined
    ATTENTION_OPS,
    CONTRACTING_OPS,
    MASK_CAUSAL,
    MASK_NONE,
    MASK_UNKNOWN,
    MATMUL_LIKE_UNSUPPORTED,
    SDPA_OPS,
    TORCH_ATTENTION_OPS,
    OpRecord,
)

__all__ = [
    "ATTENTION_OPS",
    "CONTRACTING_OPS",
    "CountError",
    "OpRecord",
    "RawCount",
    "buffer_masks",
    "count_forward",
    "count_forward_torch",
    "meta_twin",
]


class CountError(ValueError):
    """Counting failed; the message names the problem and the fix."""


SCRIPTED_MESSAGE = (
    "{what} is a TorchScript module (made by torch.jit.script or torch.jit.trace): its code is compiled, "
    "so it can be neither copied to the meta device nor hooked per module, and its MACs cannot be split.\n"
    "Fix: count the eager nn.Module you scripted, e.g. profile(MyModel(cfg)), or pass a zero-argument "
    "factory that builds it, e.g. profile(lambda: MyModel(cfg))."
)


def _refuse_scripted(model: nn.Module) -> None:
    """A clear CountError for TorchScript modules (they refuse forward hooks with a raw RuntimeError)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.jit.ScriptModule):
            what = type(model).__name__ if not name else f"{type(model).__name__}.{name}"
            raise CountError(SCRIPTED_MESSAGE.format(what=what))


#: Global module hooks (torch.nn.modules.module.register_module_*_hook) a count must not fire.
_GLOBAL_HOOK_DICTS = (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_with_kwargs",
    "_global_forward_hooks_always_called", "_global_backward_pre_hooks", "_global_backward_hooks",
    "_global_module_registration_hooks", "_global_parameter_registration_hooks",
    "_global_buffer_registration_hooks",
)


@contextlib.contextmanager
def _no_global_hooks() -> Iterator[None]:
    """Set the user's global module hooks aside while counting, and put them back, even on error.

    The dictionaries are emptied and refilled in place (their handles hold them by reference),
    so a hook removed later by its handle is still removed.
    """
    from torch.nn.modules import module as module_mod

    saved = []
    for name in _GLOBAL_HOOK_DICTS:
        hooks = getattr(module_mod, name, None)
        if hooks is not None:
            saved.append((hooks, dict(hooks)))
            hooks.clear()
    full_backward = getattr(module_mod, "_global_is_full_backward_hook", None)
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.clear()
            hooks.update(items)
        if hasattr(module_mod, "_global_is_full_backward_hook"):
            module_mod._global_is_full_backward_hook = full_backward


def _shape(value: Any) -> list[int]:
    """Static shape of a traced tensor value (the trace records complete types)."""
    sizes = value.type().sizes()
    return [int(s) for s in sizes]


# --- extra handles ---------------------------------------------------------------------


def _sdpa_macs(inputs: list[Any], outputs: list[Any]) -> int:
    """QK^T plus AV, per query head: covers grouped-query and cross-attention."""
    q, k, v = (_shape(value) for value in inputs[:3])
    *batch_and_heads, q_len, head_dim = q
    # scores: [b, h, n, d] @ [b, h, d, m]; output: [b, h, n, m] @ [b, h, m, d_v]
    return math.prod(batch_and_heads) * q_len * k[-2] * (head_dim + v[-1])


def _batched_mm_macs(first: int) -> Callable[[list[Any], list[Any]], int]:
    """``baddbmm``/``addbmm``: the two matrices are inputs ``first`` and ``first + 1``."""

    def handle(inputs: list[Any], outputs: list[Any]) -> int:
        a, b = _shape(inputs[first]), _shape(inputs[first + 1])
        # [B, n, k] @ [B, k, m]
        return a[0] * a[1] * a[2] * b[-1]

    return handle


def _mv_macs(first: int) -> Callable[[list[Any], list[Any]], int]:
    """``mv``/``addmv``: [n, k] @ [k]."""

    def handle(inputs: list[Any], outputs: list[Any]) -> int:
        return math.prod(_shape(inputs[first]))

    return handle


def _dot_macs(inputs: list[Any], outputs: list[Any]) -> int:
    return math.prod(_shape(inputs[0]))


def _einsum_macs(inputs: list[Any], outputs: list[Any]) -> int:
    """Exactly what torch runs: its own einsum on empty meta operands, under its FLOP counter.

    fvcore's handle rounds to 4 significant digits (16,778,000 for 16,777,216).
    """
    from torch.utils.flop_counter import FlopCounterMode

    equation = inputs[0].toIValue()
    listed = inputs[1].node()
    if listed.kind() != "prim::ListConstruct" or not isinstance(equation, str):
        raise CountError("einsum with operands the trace does not list; cannot count it")
    operands = [torch.empty(_shape(v), device="meta") for v in listed.inputs()]
    with _no_global_hooks(), FlopCounterMode(display=False) as counter:
        torch.einsum(equation, *operands)
    return int(counter.get_total_flops()) // 2


Handle = Callable[[list[Any], list[Any]], Any]

EXTRA_HANDLES: dict[str, Handle] = {
    **{op: _sdpa_macs for op in SDPA_OPS},
    "aten::baddbmm": _batched_mm_macs(1),
    "aten::addbmm": _batched_mm_macs(1),
    "aten::mv": _mv_macs(0),
    "aten::addmv": _mv_macs(1),
    "aten::dot": _dot_macs,
    "aten::einsum": _einsum_macs,
}

# Ops that only reshape, slice or cast: a parameter seen through them is still a parameter.
_PASS_THROUGH = frozenset(
    {
        "aten::t", "aten::transpose", "aten::permute", "aten::view", "aten::reshape",
        "aten::contiguous", "aten::expand", "aten::expand_as", "aten::unsqueeze",
        "aten::squeeze", "aten::to", "aten::type_as", "aten::detach", "aten::clone",
        "aten::alias", "aten::numpy_T", "aten::mT", "aten::flatten", "aten::unflatten",
        "aten::select", "aten::slice", "aten::chunk", "aten::split", "aten::unsafe_chunk",
        "aten::unsafe_split", "aten::split_with_sizes", "aten::narrow", "aten::unbind",
        "aten::view_as", "aten::reshape_as", "prim::ListUnpack", "prim::TupleUnpack",
        "aten::_unsafe_view", "aten::movedim", "aten::swapaxes", "aten::repeat_interleave",
        # experts picked per token from stacked weights (mixture of experts): still the parameter
        "aten::index", "aten::index_select",
    }
)


# --- records -----------------------------------------------------------------------------




@dataclass
class RawCount:
    """What one trace produced, before the split into roles."""

    total: int
    records: list[OpRecord]
    unsupported_ops: Counter[str]
    by_module: dict[str, int]
    module_names: dict[str, str] = field(default_factory=dict)  # name -> class name
    copied_layers: tuple[str, ...] = ()  # repeated layers counted as copies of a traced one (see _Repeats)

    @property
    def opaque(self) -> list[str]:
        """Custom ``torch.autograd.Function``s the tracer saw as one op each: products inside them are unseen."""
        return sorted(op for op in self.unsupported_ops if op.startswith("prim::PythonOp"))


class _TraceContext:
    def __init__(self, buffer_masks: Mapping[str, Pattern] | None = None) -> None:
        self.records: list[OpRecord] = []
        self.n_user_inputs = 0
        self.state_is_param: list[bool] = []
        self.state_names: list[str] = []
        self.buffer_masks: Mapping[str, Pattern] = buffer_masks or {}
        self.masks = _GraphMasks(self)

    def state_name(self, value: Any) -> str | None:
        """The dotted name (relative to the user's model) of a graph input that is state."""
        index = value.offset() - self.n_user_inputs
        if 0 <= index < len(self.state_names):
            name = self.state_names[index]
            return name[len("model.") :] if name.startswith("model.") else name
        return None

    def origin_of(self, value: Any) -> str:
        """Follow views back to a graph input: a parameter, a buffer, or an activation."""
        for _ in range(64):
            node = value.node()
            kind = node.kind()
            if kind == "prim::Param":
                index = value.offset() - self.n_user_inputs
                if 0 <= index < len(self.state_is_param):
                    return "param" if self.state_is_param[index] else "buffer"
                return "activation"
            if kind not in _PASS_THROUGH:
                return "activation"
            value = next(iter(node.inputs()))
        return "activation"


def _scope_of(node: Any) -> str:
    """The harness names the model ``model``; report names relative to the user's model."""
    name = node.scopeName().split("/")[-1]
    if name == "model":
        return ""
    if name.startswith("model."):
        return name[len("model.") :]
    return name


def _operands(op: str, inputs: list[Any]) -> list[Any]:
    positions = CONTRACTING_OPS.get(op)
    if positions is None:
        return list(inputs[:3]) if op in ATTENTION_OPS else []
    if op == "aten::einsum":
        listed = inputs[1].node()
        return list(listed.inputs()) if listed.kind() == "prim::ListConstruct" else []
    return [inputs[i] for i in positions if i < len(inputs)]


def _recording(op: str, handle: Handle, ctx: _TraceContext) -> Handle:
    def wrapped(inputs: list[Any], outputs: list[Any]) -> Any:
        value = handle(inputs, outputs)
        macs = sum(value.values()) if isinstance(value, Mapping) else value
        if not isinstance(macs, Number):
            raise CountError(f"the handle for {op} returned {value!r}, not a number")
        operands = _operands(op, inputs)
        origins = {ctx.origin_of(v) for v in operands if v.type().kind() == "TensorType"}
        origin = "param" if "param" in origins else "buffer" if "buffer" in origins else "activation"
        shapes = tuple(
            tuple(_shape(v)) for v in operands if v.type().kind() == "TensorType" and v.isCompleteTensor()
        )
        out = outputs[0]
        out_shape = tuple(_shape(out)) if out.type().kind() == "TensorType" and out.isCompleteTensor() else ()
        count = int(round(float(macs)))  # type: ignore[arg-type]  # fvcore handles return int or float
        mask = ""
        if op in ATTENTION_OPS or (origin == "activation" and op in CONTRACTING_OPS):
            mask = ctx.masks.label(op, inputs, outputs, operands)
        ctx.records.append(OpRecord(
            op=op, scope=_scope_of(out.node()), macs=count, origin=origin, shapes=shapes, out_shape=out_shape,
            mask=mask,
        ))
        return value

    return wrapped


# --- masks: is an attention core causal? ---------------------------------------------------
#
# A mask is described by the set of (query i, key j) positions where it is non-zero / True:
# ("all",), ("none",), ("lower", d): j - i <= d, ("upper", d): j - i >= d; plus the value it
# holds there when known (``fill``). Both counters evaluate the few ops that build masks
# (ones, full, tril, triu, == 0, ~, where, masked_fill, slices from 0, casts and views) over
# these patterns; whatever else builds a mask leaves it unknown.

Pattern = tuple[tuple[Any, ...], Any]  # (position set, fill value or None)

#: OpRecord.mask values.

_CAUSAL_MASKED = ("upper", 1)  # the positions a causal mask removes: j > i

_MASK_PASS = frozenset({
    "view", "reshape", "_unsafe_view", "expand", "expand_as", "unsqueeze", "squeeze", "contiguous", "clone",
    "to", "_to_copy", "type_as", "detach", "alias", "lift_fresh", "lift_fresh_copy", "float", "bool", "half",
    "bfloat16", "view_as", "reshape_as",
})
#: Ops that carry attention scores or probabilities unchanged in form (from QK^T to AV).
_SCORE_PASS = frozenset({
    "view", "reshape", "_unsafe_view", "expand", "expand_as", "unsqueeze", "squeeze", "contiguous", "clone",
    "to", "_to_copy", "type_as", "detach", "alias", "mul", "div", "softmax", "_softmax", "_safe_softmax",
    "dropout", "native_dropout", "feature_dropout", "float", "half", "bfloat16", "view_as", "reshape_as",
})
_SCORE_MASKING = frozenset({"masked_fill", "add", "where"})


def _complement(positions: tuple[Any, ...]) -> tuple[Any, ...]:
    kind = positions[0]
    if kind == "all":
        return ("none",)
    if kind == "none":
        return ("all",)
    if kind == "lower":
        return ("upper", positions[1] + 1)
    return ("lower", positions[1] - 1)


def _constant_fill(value: Any) -> Any:
    """A Python number, or the fill of an ("all",) pattern; None if neither."""
    if isinstance(value, bool):
        return value
    if isinstance(value, Number):
        return value
    if isinstance(value, tuple) and len(value) == 2 and value[0] == ("all",):
        return value[1]
    return None


def _mask_transfer(op: str, ins: list[Any]) -> Pattern | None:
    """The pattern of ``op(*ins)``, where each input is a Pattern, a constant, or None (unknown)."""
    first = ins[0] if ins else None
    if op in ("ones", "ones_like", "new_ones"):
        return (("all",), 1)
    if op in ("zeros", "zeros_like", "new_zeros"):
        return (("all",), 0)
    if op in ("full", "full_like", "new_full"):
        fill = _constant_fill(ins[1]) if len(ins) > 1 else None
        return None if fill is None else (("all",), fill)
    if op == "scalar_tensor":
        fill = _constant_fill(first)
        return None if fill is None else (("all",), fill)
    if not isinstance(first, tuple):
        return None
    positions, fill = first
    if op in ("tril", "triu"):
        diagonal = ins[1] if len(ins) > 1 and isinstance(ins[1], int) else 0
        if positions != ("all",) or fill in (0, False, None):
            return None
        return (("lower" if op == "tril" else "upper", diagonal), fill)
    if op == "eq":
        other = _constant_fill(ins[1]) if len(ins) > 1 else None
        if other in (0, False):
            return (_complement(positions), True)
        if other is not None and other == fill:
            return (positions, True)
        return None
    if op in ("logical_not", "bitwise_not"):
        return (_complement(positions), True)
    if op == "slice":
        # a crop [start:end] of the query or key axis keeps the triangle only from the origin
        start = ins[2] if len(ins) > 2 else None
        step = ins[4] if len(ins) > 4 else 1
        return first if start in (None, 0) and step in (None, 1) else None
    if op in ("ne",):
        other = _constant_fill(ins[1]) if len(ins) > 1 else None
        return (positions, True) if other in (0, False) else None
    if op in _MASK_PASS:
        return first
    if op == "where":  # where(C, a, b) with constant a, b: an additive mask built from C
        a, b = (_constant_fill(v) for v in ins[1:3]) if len(ins) >= 3 else (None, None)
        if a is None or b is None:
            return None
        if a == 0 and b != 0:
            return (_complement(positions), b)
        if b == 0 and a != 0:
            return (positions, a)
        return None
    if op == "masked_fill":  # zeros(...).masked_fill(M, -inf): an additive mask built from M
        if positions == ("all",) and fill == 0 and len(ins) > 2 and isinstance(ins[1], tuple):
            value = _constant_fill(ins[2])
            return (ins[1][0], value) if value not in (None, 0) else None
        return None
    return None


def _label(masked: tuple[Any, ...] | None) -> str:
    if masked is None:
        return MASK_UNKNOWN
    if masked == ("none",):
        return MASK_NONE
    return MASK_CAUSAL if masked == _CAUSAL_MASKED else MASK_UNKNOWN


def _masking_label(op: str, ins: list[Any], flow: int) -> str:
    """The label a masking op puts on the scores at input position *flow*."""
    if op == "masked_fill" and flow == 0 and len(ins) > 1:
        mask = ins[1]
        return _label(mask[0] if isinstance(mask, tuple) else None)
    if op == "add":
        mask = ins[1 - flow] if flow in (0, 1) and len(ins) > 1 else None
        if isinstance(mask, Number):
            return MASK_NONE  # a constant shift changes nothing
        if not isinstance(mask, tuple):
            return MASK_UNKNOWN
        positions, fill = mask
        if positions == ("none",) or fill == 0:
            return MASK_NONE
        return _label(positions) if isinstance(fill, (int, float)) and fill < 0 else MASK_UNKNOWN
    if op == "where" and len(ins) >= 3 and flow in (1, 2):
        cond = ins[0]
        if not isinstance(cond, tuple):
            return MASK_UNKNOWN
        return _label(_complement(cond[0]) if flow == 1 else cond[0])
    return MASK_UNKNOWN


def _sdpa_label(is_causal: Any, has_mask: bool, attn_mask: Any, mask_is_bool: bool | None) -> str:
    """``is_causal=True`` or a causal ``attn_mask`` (bool: True = attend; float: added to the scores).

    *attn_mask* is the mask's Pattern, None when its form is unknown; *has_mask* says whether
    one is passed at all.
    """
    if not has_mask:
        if is_causal is True:
            return MASK_CAUSAL
        return MASK_NONE if is_causal in (False, None) else MASK_UNKNOWN
    if not isinstance(attn_mask, tuple):
        return MASK_UNKNOWN
    positions, fill = attn_mask
    if mask_is_bool:
        return _label(_complement(positions))
    if positions == ("none",) or fill == 0:
        return MASK_NONE
    return _label(positions) if isinstance(fill, (int, float)) and fill < 0 else MASK_UNKNOWN


def _combine(labels: Iterator[str] | list[str] | set[str]) -> str:
    found = {label for label in labels if label}
    if not found:
        return MASK_NONE
    return MASK_CAUSAL if found == {MASK_CAUSAL} else MASK_UNKNOWN


def buffer_masks(model: nn.Module) -> dict[str, Pattern]:
    """Buffers of *model* (the original, with values) that hold a triangular mask, by dotted name.

    A twin's buffers are empty meta tensors, so the form of a registered mask
    (``register_buffer("tril", torch.tril(torch.ones(n, n)))``) is read here, from
    the user's model, and handed to :func:`count_forward` / :func:`count_forward_torch`
    as ``buffer_masks=``. Only square masks (leading dimensions of size 1) whose
    non-zero entries form ``tril`` or ``triu(diagonal=1)`` are kept.
    """
    found: dict[str, Pattern] = {}
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



# --- masks in the traced graph ----------------------------------------------------------------


def _short(kind: str) -> str:
    return kind.split("::", 1)[-1]


def _is_tensor(value: Any) -> bool:
    return value.type().kind() == "TensorType"


def _argument_positions(op: str) -> dict[str, int]:
    """Argument name -> position in the op's schema (first overload); {} if unknown."""
    namespace, _, name = op.partition("::")
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        schema = getattr(packet, packet.overloads()[0])._schema
    except Exception:  # noqa: BLE001 - an op torch does not know by that name
        return {}
    return {argument.name: i for i, argument in enumerate(schema.arguments)}


class _GraphMasks:
    """Evaluates mask patterns over the traced graph (jit Values), memoised per value."""

    def __init__(self, ctx: _TraceContext) -> None:
        self.ctx = ctx
        self.memo: dict[Any, Any] = {}

    def abstract(self, value: Any) -> Any:
        """A constant, a Pattern, or None."""
        node = value.node()
        if node.kind() == "prim::Constant":
            try:
                return value.toIValue()
            except Exception:  # noqa: BLE001 - a constant the binding cannot convert
                return None
        if not _is_tensor(value):
            return None
        return self.pattern(value)

    def pattern(self, value: Any, depth: int = 0) -> Pattern | None:
        key = value.debugName()
        if key in self.memo:
            return self.memo[key]  # type: ignore[no-any-return]
        result: Pattern | None = None
        node = value.node()
        if node.kind() == "prim::Param":
            name = self.ctx.state_name(value)
            result = self.ctx.buffer_masks.get(name) if name is not None else None
        elif depth < 32:
            ins = []
            for item in node.inputs():
                if item.node().kind() == "prim::Constant" or not _is_tensor(item):
                    ins.append(self.abstract(item))
                else:
                    ins.append(self.pattern(item, depth + 1))
            result = _mask_transfer(_short(node.kind()), ins)
        self.memo[key] = result
        return result

    def masking(self, node: Any, flow: int) -> str:
        ins = [self.abstract(v) for v in node.inputs()]
        return _masking_label(_short(node.kind()), ins, flow)

    def after(self, value: Any, depth: int = 0) -> list[str]:
        """Labels of the masks applied to scores *value* on their way forward (QK^T -> softmax)."""
        labels: list[str] = []
        if depth > 16:
            return labels
        for use in value.uses():
            user = use.user
            op = _short(user.kind())
            if op in _SCORE_MASKING:
                labels.append(self.masking(user, use.offset))
            elif op not in _SCORE_PASS or use.offset != 0 and op not in ("mul", "div"):
                continue
            labels += self.after(user.outputsAt(0), depth + 1)
        return labels

    def before(self, value: Any, depth: int = 0) -> tuple[list[str], bool]:
        """Labels of the masks applied to an operand on its way back (AV <- softmax <- mask <- QK^T),
        and whether it comes from scores (a product of two activations) at all."""
        node = value.node()
        kind = node.kind()
        op = _short(kind)
        if depth > 16:
            return [], False
        if kind in CONTRACTING_OPS:
            operands = [v for v in _operands(kind, list(node.inputs())) if _is_tensor(v)]
            return [], bool(operands) and all(self.ctx.origin_of(v) == "activation" for v in operands)
        if op in _SCORE_MASKING:
            inputs = list(node.inputs())
            candidates = [0] if op == "masked_fill" else [0, 1] if op == "add" else [1, 2] if op == "where" else []
            for flow in candidates:
                if flow < len(inputs) and _is_tensor(inputs[flow]) and inputs[flow].node().kind() != "prim::Constant":
                    labels, scores = self.before(inputs[flow], depth + 1)
                    if scores:
                        return [self.masking(node, flow), *labels], True
            return [], False
        if op in _SCORE_PASS:
            inputs = [v for v in node.inputs() if _is_tensor(v) and v.node().kind() != "prim::Constant"]
            if not inputs:
                return [], False
            main = max(inputs, key=lambda v: len(_shape(v)) if v.isCompleteTensor() else 0)
            return self.before(main, depth + 1)
        return [], False

    def label(self, op: str, inputs: list[Any], outputs: list[Any], operands: list[Any]) -> str:
        if op in ATTENTION_OPS:
            positions = _argument_positions(op)
            causal_at = positions.get("is_causal", len(inputs))
            mask_at = positions.get("attn_mask", positions.get("attn_bias", len(inputs)))
            is_causal: Any = False
            if causal_at < len(inputs):
                flag = inputs[causal_at]
                # a flag computed in the trace (not a constant) cannot be told
                is_causal = self.abstract(flag) if flag.node().kind() == "prim::Constant" else MASK_UNKNOWN
            mask_value = inputs[mask_at] if mask_at < len(inputs) else None
            if mask_value is None or mask_value.node().kind() == "prim::Constant" or not _is_tensor(mask_value):
                return _sdpa_label(is_causal, False, None, None)
            scalar = mask_value.type().scalarType()
            return _sdpa_label(is_causal, True, self.pattern(mask_value), scalar == "Bool")
        labels: list[str] = []
        from_scores = False  # an operand holds scores or probabilities: this is AV, not QK^T
        for operand in operands:
            found, scores = self.before(operand)
            labels += found
            from_scores = from_scores or scores
        if not from_scores and outputs:
            labels += self.after(outputs[0])
        return _combine(labels)


# --- the twin ----------------------------------------------------------------------------


def meta_twin(model: nn.Module) -> nn.Module:
    """A deep copy of *model* whose parameters and buffers are empty meta tensors.

    The copy shares nothing with the original: tied weights stay tied to each
    other, the ``training`` flags are kept, and every hook is dropped (the user's
    hooks must neither fire during counting nor be copied into the count).
    """
    _refuse_scripted(model)
    memo: dict[int, Any] = {}
    for module in model.modules():
        stand_in = _quantized_stand_in(module)
        if stand_in is not None:
            memo[id(module)] = stand_in
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in memo:
            continue
        if tensor.layout == torch.strided:  # same sizes and strides; empty_like runs Python prims (100x slower)
            twin = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="meta")
        else:
            twin = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            twin = nn.Parameter(twin, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = twin
    try:
        clone = _copy_module(model, memo)
    except Exception as exc:  # noqa: BLE001 - any failure here is the model's, reported whole
        raise CountError(
            f"cannot copy {type(model).__name__} to count it ({type(exc).__name__}: {exc}); "
            "pass a zero-argument factory instead of the module, e.g. profile(lambda: MyModel(cfg))"
        ) from exc
    _drop_hooks(clone)
    for module in clone.modules():
        _patchify_conv(module)
    return clone


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


def _plain_state(cls: type) -> bool:
    """Whether copy.deepcopy would copy an instance as nn.Module's __getstate__ dict, then __setstate__."""
    return (getattr(cls, "__deepcopy__", None) is None and cls.__reduce_ex__ is object.__reduce_ex__
            and cls.__reduce__ is object.__reduce__ and cls.__getstate__ is nn.Module.__getstate__
            and all("__slots__" not in vars(base) for base in cls.__mro__[:-1]))


def _copy_module(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``copy.deepcopy(module, memo)``, a module at a time: a third of the time on a BERT-base.

    The same steps as deepcopy's (new instance, memo entry, each attribute deep-copied with the
    shared memo, ``__setstate__``), except that the hook dictionaries ``_drop_hooks`` clears
    anyway start empty. A module whose class copies itself some other way goes to deepcopy.
    """
    found = memo.get(id(module))
    if found is not None:
        return found  # type: ignore[no-any-return]
    cls = type(module)
    if not _plain_state(cls):
        return copy.deepcopy(module, memo)  # type: ignore[no-any-return]
    clone = cls.__new__(cls)
    memo[id(module)] = clone
    state: dict[str, Any] = {}
    for key, value in module.__dict__.items():
        if key == "_compiled_call_impl":
            continue  # nn.Module.__getstate__ drops it
        if key == "_modules":
            state[key] = type(value)((name, None if child is None else _copy_module(child, memo))
                                     for name, child in value.items())
        elif key in ("_parameters", "_buffers"):
            state[key] = type(value)((name, None if t is None else memo[id(t)] if id(t) in memo
                                      else copy.deepcopy(t, memo)) for name, t in value.items())
        elif key in _HOOK_DICTS and type(value) in (dict, OrderedDict):
            state[key] = type(value)()
        else:
            state[key] = copy.deepcopy(value, memo)
    clone.__setstate__(state)
    return clone


def _quantized_stand_in(module: nn.Module) -> nn.Module | None:
    """A meta ``nn.Linear`` of the same shape for a dynamically quantized Linear.

    Its packed int8 weight cannot live on the meta device, and neither tracer can run the
    quantized kernel there; the product it computes is the same ``[.., in] @ [in, out]``,
    so the twin counts that (an ``aten::linear`` with a parameter operand, like any Linear).
    """
    from torch.ao.nn.quantized import dynamic as qdynamic

    if not isinstance(module, qdynamic.Linear):
        return None
    bias = module.bias() is not None
    stand_in = nn.Linear(module.in_features, module.out_features, bias=bias, device="meta")
    stand_in.requires_grad_(False)
    return stand_in


def _drop_hooks(clone: nn.Module) -> None:
    """A copy's hooks are the user's: they must neither fire during counting nor be counted."""
    for module in clone.modules():
        for name in _HOOK_DICTS:
            hooks = getattr(module, name, None)
            if hooks is not None:
                hooks.clear()


def real_twin(model: nn.Module) -> nn.Module:
    """A full copy, weights included, without hooks: for the real-tensor fallback at small n."""
    clone = copy.deepcopy(model)
    _drop_hooks(clone)
    return clone


def to_real(value: Any) -> Any:
    """Zero-filled CPU tensors of the same shapes and dtypes (meta tensors have no values to run on)."""
    return pytree.tree_map(
        lambda leaf: torch.zeros(leaf.shape, dtype=leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf, value
    )


def _patchify_forward(self: nn.Conv2d, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # torch 2.13's meta kernel for convolution fails under the jit tracer (its shape
    # checks receive traced tensors). A patchifying conv (stride == kernel) is a linear
    # map of the flattened patches, with exactly the same MACs:
    # [N, C, H, W] -> [N, (H/p)(W/q), C*p*q] @ [C*p*q, C_out]
    n, c, h, w = x.shape
    p, q = self.kernel_size
    patches = x.reshape(n, c, h // p, p, w // q, q).permute(0, 2, 4, 1, 3, 5)
    patches = patches.reshape(n, (h // p) * (w // q), c * p * q)
    out = nn.functional.linear(patches, weight.reshape(weight.shape[0], -1), bias)
    return out.transpose(1, 2).reshape(n, weight.shape[0], h // p, w // q)


def _patchify_conv(module: nn.Module) -> None:
    if (
        type(module) is nn.Conv2d
        and module.stride == module.kernel_size
        and module.padding in ((0, 0), "valid")
        and module.dilation == (1, 1)
        and module.groups == 1
    ):
        module._conv_forward = types.MethodType(_patchify_forward, module)  # type: ignore[method-assign]


# --- repeated layers: trace two, count the rest --------------------------------------------------
#
# Transformer layers repeat. In a run of three or more consecutive elements of a ModuleList /
# Sequential that are built alike (classes, parameter and buffer shapes, settings), the first
# two are traced in full and every later one, called with inputs equivalent to the second's,
# returns the second's output and is counted as a copy of the second's records. The copy is
# exact because, with the same code, settings and inputs, a layer runs the same ops on the same
# shapes; every assumption is checked, and anything unchecked runs in full:
#
# * settings that differ between the layers (``layer_idx``, ``attention_type``, ...) are
#   watched: if the two traced layers read one, the whole count is redone in full;
# * inputs: the non-tensor ones equal, the tensors the same objects the second layer got,
#   except the one tensor that changes from layer to layer (the hidden states), which must
#   match in shape, dtype, strides and device; a layer called otherwise runs in full;
# * the first two layers must produce the same records (scopes renamed), so that where a
#   layer's input comes from (embeddings or another layer) changes nothing;
# * each layer of the run is called at most once, the first two exactly once, in order.
#
# Only on meta / fake tensors (no values, so nothing can depend on them) and forward passes.

_SHORTCUT = {"enabled": True}


@contextlib.contextmanager
def full_trace() -> Iterator[None]:
    """Count every layer in full (no repeated-layer shortcut): what the tests compare against."""
    previous = _SHORTCUT["enabled"]
    _SHORTCUT["enabled"] = False
    try:
        yield
    finally:
        _SHORTCUT["enabled"] = previous


class _NotRepeating(Exception):
    """The shortcut's checks failed after the fact: count again in full."""


_PRIMITIVES = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device, torch.layout)


def _same(a: Any, b: Any) -> bool:
    """Equal settings: the same object, or equal plain values (containers compared item by item)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, _PRIMITIVES):
        return bool(a == b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (set, frozenset)):
        return all(isinstance(x, _PRIMITIVES) for x in a) and a == b
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, functools.partial):  # transformers' activations hold one per instance
        return _same(a.func, b.func) and _same(a.args, b.args) and _same(a.keywords, b.keywords)
    return False  # other objects (tensors, functions, configs) only when they are the same one


def _settings(module: nn.Module) -> tuple[Any, dict[tuple[str, str], Any]]:
    """(structure, settings) of a module tree: classes, parameter/buffer shapes, plain attributes."""
    structure: list[Any] = []
    settings: dict[tuple[str, str], Any] = {}
    for name, sub in module.named_modules():
        params = tuple((k, None if p is None else (type(p), tuple(p.shape), p.dtype, p.requires_grad, p.device.type))
                       for k, p in sub._parameters.items())
        buffers = tuple((k, None if b is None else (type(b), tuple(b.shape), b.dtype, b.device.type))
                        for k, b in sub._buffers.items())
        structure.append((name, type(sub), params, buffers))
        for key, value in vars(sub).items():
            if key in ("_parameters", "_buffers", "_modules") or "hook" in key:
                continue
            settings[(name, key)] = value
    return tuple(structure), settings


def _watcher(cls: type) -> type:
    """A subclass of *cls* that notes reads of the attributes in ``_WATCHED[id(self)]``."""
    found = _WATCHERS.get(cls)
    if found is None:
        def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807
            watch = _WATCHED.get(id(self))
            if watch is not None and name in watch[0]:
                watch[1].read.add(name)
            return cls.__getattribute__(self, name)  # type: ignore[call-arg]

        found = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__,
                                            "__qualname__": cls.__qualname__})
        _WATCHERS[cls] = found
    return found


_WATCHERS: dict[type, type] = {}
_WATCHED: dict[int, tuple[frozenset[str], _Repeats]] = {}


@dataclass
class _Run:
    names: list[str]  # dotted names (relative to the model) of the layers, in order
    modules: list[nn.Module]
    calls: list[Any] = field(default_factory=list)  # per traced layer (0, 1): (leaves, spec, output, start, end)
    replicated: list[str] = field(default_factory=list)  # stubbed layers counted as copies, in call order
    called: set[str] = field(default_factory=set)
    chained: int | None = None  # the input position that changes from layer to layer


class _Repeats:
    """The repeated-layer shortcut for one count: which layers are traced, watched and copied."""

    def __init__(self, model: nn.Module, on_stub: Callable[[_Run, str], Any],
                 snapshot: Callable[[], Any] = lambda: None, masks: Mapping[str, Pattern] | None = None) -> None:
        self.runs: list[_Run] = []
        self.snapshot = snapshot  # backend state before and after each traced layer's call
        self.read: set[str] = set()
        self.broken = False  # a check failed: the copies made cannot stand
        self.on_stub = on_stub  # backend hook: replicate the second layer's records here, return its output
        self.counter = 0  # calls begun (orders the traced layers' calls)
        self._undo: list[Callable[[], None]] = []
        try:
            self._plan(model, masks)
        except Exception:  # noqa: BLE001 - settings that cannot be compared, a class that cannot be watched
            self.undo()
            self.runs.clear()  # count in full

    def _plan(self, model: nn.Module, masks: Mapping[str, Pattern] | None) -> None:
        planned: list[str] = []
        for name, container in model.named_modules():
            if not isinstance(container, (nn.ModuleList, nn.Sequential)):
                continue
            if any(name == p or name.startswith(p + ".") for p in planned):
                continue
            children = list(container.named_children())
            if len(children) < 3 or len({id(m) for _, m in children}) != len(children):
                continue
            start = 0
            prefix = f"{name}." if name else ""
            # A mask buffer's form (read from the original's values, for causal="half") is part of
            # what a layer is: GPT-Neo's global and local layers differ only there.
            forms = [sorted((key[len(f"{prefix}{child}."):], value) for key, value in (masks or {}).items()
                            if key.startswith(f"{prefix}{child}.")) for child, _ in children]
            while start < len(children):
                first = _settings(children[start][1])
                end = start + 1
                differing: set[tuple[str, str]] = set()
                while end < len(children) and type(children[end][1]) is type(children[start][1]):
                    other = _settings(children[end][1])
                    if other[0] != first[0] or other[1].keys() != first[1].keys() or forms[end] != forms[start]:
                        break
                    differing |= {k for k, v in first[1].items() if not _same(v, other[1][k])}
                    end += 1
                if end - start >= 3:
                    run = _Run([prefix + child for child, _ in children[start:end]],
                               [m for _, m in children[start:end]])
                    self.runs.append(run)
                    planned += run.names
                    self._install(run, differing)
                start = end

    def __bool__(self) -> bool:
        return bool(self.runs)

    def stub_of(self) -> dict[str, _Run]:
        """Replicated layer -> its run."""
        return {name: run for run in self.runs for name in run.replicated}

    def _install(self, run: _Run, differing: set[tuple[str, str]]) -> None:
        by_module: dict[str, set[str]] = {}
        for sub_name, key in differing:
            by_module.setdefault(sub_name, set()).add(key)
        for layer in run.modules[:2]:
            for sub_name, keys in by_module.items():
                self._watch(layer.get_submodule(sub_name) if sub_name else layer, frozenset(keys))
        for index, (name, layer) in enumerate(zip(run.names, run.modules)):
            forward = layer.forward
            wrapper = self._traced(run, index, forward) if index < 2 else self._stub(run, name, forward)
            layer.forward = wrapper  # type: ignore[method-assign]
            self._undo.append(functools.partial(layer.__dict__.pop, "forward", None))

    def _watch(self, module: nn.Module, keys: frozenset[str]) -> None:
        original = type(module)
        module.__class__ = _watcher(original)
        _WATCHED[id(module)] = (keys, self)

        def restore() -> None:
            module.__class__ = original
            _WATCHED.pop(id(module), None)

        self._undo.append(restore)

    def undo(self) -> None:
        for step in reversed(self._undo):
            step()
        self._undo.clear()

    def _traced(self, run: _Run, index: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        def traced(*args: Any, **kwargs: Any) -> Any:
            if run.names[index] in run.called or len(run.calls) != index:
                self.broken = True  # called twice, or out of order
            run.called.add(run.names[index])
            self.counter += 1
            start, before = self.counter, self.snapshot()
            output = forward(*args, **kwargs)
            leaves, spec = pytree.tree_flatten((args, kwargs))
            if len(run.calls) == index:
                run.calls.append((leaves, spec, output, start, self.counter, before, self.snapshot()))
            return output

        return traced

    def _stub(self, run: _Run, name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        def stub(*args: Any, **kwargs: Any) -> Any:
            self.counter += 1
            if name in run.called:
                self.broken = True
            run.called.add(name)
            if self.read or self.broken or not self._matches(run, args, kwargs):
                return forward(*args, **kwargs)
            run.replicated.append(name)
            return self.on_stub(run, name)

        return stub

    def _matches(self, run: _Run, args: Any, kwargs: Any) -> bool:
        try:
            return self._alike(run, args, kwargs)
        except Exception:  # noqa: BLE001 - inputs that cannot be compared: this layer runs in full
            return False

    def _alike(self, run: _Run, args: Any, kwargs: Any) -> bool:
        if len(run.calls) != 2:
            return False
        (leaves0, spec0, _, _, end0, *_), (leaves1, spec1, _, start1, *_) = run.calls
        if end0 >= start1 or spec0 != spec1:
            return False  # nested calls, or the second layer called another way
        if run.chained is None:
            moving = [i for i, (a, b) in enumerate(zip(leaves0, leaves1)) if a is not b]
            if len(moving) != 1 or not isinstance(leaves1[moving[0]], torch.Tensor):
                return False
            if any(leaves1[moving[0]] is leaf for leaf in leaves0):
                return False
            if not all(_same(a, b) for a, b in zip(leaves0, leaves1)
                       if not isinstance(a, torch.Tensor) and a is not b):
                return False
            run.chained = moving[0]
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != spec1:
            return False
        for position, (mine, theirs) in enumerate(zip(leaves, leaves1)):
            if position != run.chained:
                if not (mine is theirs or not isinstance(theirs, torch.Tensor) and _same(mine, theirs)):
                    return False
                continue
            if not (type(mine) is type(theirs) and mine.shape == theirs.shape and mine.dtype == theirs.dtype
                    and mine.device == theirs.device and mine.stride() == theirs.stride()
                    and mine.requires_grad == theirs.requires_grad and mine.layout == theirs.layout):
                return False
        return True

    def check(self) -> None:
        """After the count: raise _NotRepeating if a copy made cannot stand."""
        if not any(run.replicated for run in self.runs):
            return
        if self.read or self.broken:
            raise _NotRepeating
        for run in self.runs:
            if run.replicated and len(run.calls) != 2:
                raise _NotRepeating


def _rename(scope: str, old: str, new: str) -> str | None:
    """*scope* moved from module *old* to module *new*; None if it is not inside *old*."""
    if scope == old:
        return new
    if old == "":
        return f"{new}.{scope}" if new else scope
    if scope.startswith(old + "."):
        return new + scope[len(old):]
    return None


def _block(records: list[OpRecord], layer: str) -> list[OpRecord]:
    return [r for r in records if _rename(r.scope, layer, layer) is not None]


def _moved(records: list[OpRecord], old: str, new: str) -> list[OpRecord]:
    return [dataclasses.replace(r, scope=_rename(r.scope, old, new) or r.scope) for r in records]


# --- the harness -------------------------------------------------------------------------


def _tensor_leaves(value: Any, out: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, Mapping):
        for item in value.values():
            _tensor_leaves(item, out)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _tensor_leaves(item, out)
    # anything else (DynamicCache, None, strings) carries no count and is dropped


class _Harness(nn.Module):
    """Calls the twin with the user's args and kwargs; returns flat tensors the tracer accepts.

    Every submodule's tensor outputs are returned as well, so that the tracer's
    dead-code elimination keeps work whose result the model itself drops.
    """

    def __init__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.model = model
        leaves, self._spec = pytree.tree_flatten((args, kwargs))
        self._leaves = leaves
        self._positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self._seen: list[torch.Tensor] = []
        for module in model.modules():
            module.register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, inputs: Any, output: Any) -> None:
        _tensor_leaves(output, self._seen)

    def trace_inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(self._leaves[i] for i in self._positions)

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(self._leaves)
        for position, tensor in zip(self._positions, tensors):
            leaves[position] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        self._seen = []
        outputs: list[torch.Tensor] = []
        _tensor_leaves(self.model(*args, **kwargs), outputs)
        return tuple(outputs + self._seen)


def to_meta(value: Any) -> Any:
    """Inputs as meta tensors of the same shape and dtype (nothing is computed on them)."""
    return pytree.tree_map(
        lambda leaf: torch.empty_like(leaf, device="meta") if isinstance(leaf, torch.Tensor) else leaf, value
    )


@contextlib.contextmanager
def _counting_environment() -> Iterator[None]:
    """Plain kernels, no autograd, no RNG drift, no tracer noise; all restored afterwards."""
    fastpath = torch.backends.mha.get_fastpath_enabled()
    # The fused MultiheadAttention / TransformerEncoderLayer kernels hide whole attention
    # blocks in one op; the plain path runs linear + sdpa, which the handles count exactly.
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)


def _flop_count_analysis() -> type:
    with warnings.catch_warnings():
        # fvcore scripts a function at import time, which torch 2.13 deprecates.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        from fvcore.nn import FlopCountAnalysis  # type: ignore[import-untyped]
    return FlopCountAnalysis


def count_forward(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
    buffer_masks: Mapping[str, Pattern] | None = None,
) -> RawCount:
    """Trace ``model(*args, **kwargs)`` with fvcore and return every op's record.

    *model* must already be a twin (see :func:`meta_twin`): it is hooked and traced.
    The user's global module hooks are set aside meanwhile (they must not fire).

    Args:
        buffer_masks: triangular mask buffers of the original model (see :func:`buffer_masks`),
            so that ``masked_fill(self.tril[:T, :T] == 0, -inf)`` is recognised as causal.

    Raises:
        CountError: the tracer could not run the model; the message carries its reason.
    """
    flop_count_analysis = _flop_count_analysis()
    from fvcore.nn.flop_count import _DEFAULT_SUPPORTED_OPS  # type: ignore[import-untyped]

    _refuse_scripted(model)
    with _no_global_hooks():
        return _count_forward(model, args, kwargs, flop_count_analysis, _DEFAULT_SUPPORTED_OPS, buffer_masks)


def _all_meta(model: nn.Module, values: Any) -> bool:
    """No values anywhere: nothing a layer does can depend on data."""
    tensors = [*model.parameters(), *model.buffers(),
               *(leaf for leaf in pytree.tree_leaves(values) if isinstance(leaf, torch.Tensor))]
    return all(t.is_meta for t in tensors)


def _count_forward(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], flop_count_analysis: Any,
    default_ops: Mapping[str, Handle], buffer_masks: Mapping[str, Pattern] | None,
) -> RawCount:
    if _SHORTCUT["enabled"] and _all_meta(model, (args, kwargs)):
        repeats = _Repeats(model, on_stub=_aliased_output, masks=buffer_masks)
        if repeats:
            try:
                return _trace(model, args, kwargs, flop_count_analysis, default_ops, buffer_masks, repeats)
            except _NotRepeating:
                _drop_hooks(model)  # the harness's (and, after a failed trace, fvcore's) hooks
            finally:
                repeats.undo()
    return _trace(model, args, kwargs, flop_count_analysis, default_ops, buffer_masks, None)


_MARKER = "<repeat>"  # where a copied layer was called, in graph order


def _aliased_output(run: _Run, name: str) -> Any:
    # aten::alias leaves a node in the graph at this call, in this layer's scope: the marker
    # where the copied records go (and a view, so origins and masks pass through it).
    return pytree.tree_map(lambda leaf: torch.ops.aten.alias(leaf) if isinstance(leaf, torch.Tensor) else leaf,
                           run.calls[1][2])


def _trace(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], flop_count_analysis: Any,
    default_ops: Mapping[str, Handle], buffer_masks: Mapping[str, Pattern] | None, repeats: _Repeats | None,
) -> RawCount:
    harness = _Harness(model, args, kwargs)
    ctx = _TraceContext(buffer_masks)
    inputs = harness.trace_inputs()
    ctx.n_user_inputs = len(inputs)
    state = torch.jit._unique_state_dict(harness, keep_vars=True)  # the order the tracer uses
    ctx.state_is_param = [isinstance(t, nn.Parameter) for t in state.values()]
    ctx.state_names = list(state)

    analysis = flop_count_analysis(harness, inputs)
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False).tracer_warnings("none")
    handles = {**default_ops, **EXTRA_HANDLES}
    analysis.set_op_handle(**{op: _recording(op, handle, ctx) for op, handle in handles.items()})
    aliases: Counter[str] = Counter()
    if repeats is not None:
        def marker(inputs: list[Any], outputs: list[Any]) -> int:
            scope = _scope_of(outputs[0].node())
            if scope in repeats.stub_of():
                ctx.records.append(OpRecord(_MARKER, scope, 0, "activation", ()))
            else:
                aliases["aten::alias"] += 1  # the model's own: unsupported, as fvcore reports it
            return 0

        analysis.set_op_handle(**{"aten::alias": marker})
    with _counting_environment():
        try:
            total = analysis.total()
        except CountError:
            if repeats is not None and repeats.stub_of():
                raise _NotRepeating from None
            raise
        except Exception as exc:  # noqa: BLE001 - the tracer's reason is the user's best clue
            if repeats is not None and repeats.stub_of():
                raise _NotRepeating from exc
            reason = f"{type(exc).__name__}: {exc}".strip()
            if len(reason) > 600:
                reason = reason[:600] + " ..."
            if "Storage size calculation overflowed" in reason:
                raise CountError(
                    f"the length is too large to trace {type(model).__name__}: {reason} (torch cannot "
                    "describe a tensor of 2**63 bytes or more, even on the meta device)\n"
                    "Fix: use a smaller n, or evaluate the formulas alone: pytest_attncost.model_costs(spec, n) "
                    "or python -m pytest_attncost"
                ) from exc
            raise CountError(
                f"fvcore could not trace {type(model).__name__} on the meta device: {reason}\n"
                "Fix: make forward() traceable (no data-dependent Python control flow, no .item() or "
                "printing of tensor values), or pass inputs= that forward() accepts."
            ) from exc
        unsupported = Counter({op: int(c) for op, c in analysis.unsupported_ops().items()})
        by_module_raw = analysis.by_module()
        if repeats is not None:
            repeats.check()
            for name in repeats.stub_of():
                second = repeats.stub_of()[name].names[1]
                unsupported.update(analysis.unsupported_ops(f"model.{second}"))
    unsupported.update(aliases)
    by_module: dict[str, int] = {}
    for name, value in by_module_raw.items():
        if name == "":
            continue  # the harness; "model" below is the same total
        key = "" if name == "model" else name[len("model.") :]
        by_module[key] = int(value)
    records = ctx.records
    if repeats is not None and repeats.stub_of():
        records, extra = _expand_markers(records, repeats, by_module)
        total += extra
    classes = {name: type(module).__name__ for name, module in model.named_modules()}
    copied = tuple(repeats.stub_of()) if repeats is not None else ()
    return RawCount(
        total=int(total), records=records, unsupported_ops=unsupported, by_module=by_module, module_names=classes,
        copied_layers=copied,
    )


def _expand_markers(records: list[OpRecord], repeats: _Repeats, by_module: dict[str, int]) -> tuple[list[OpRecord], int]:
    """Put the second layer's records (renamed) at each copied layer's marker; add its MACs to by_module.

    Raises _NotRepeating if the first two layers' records differ, or a copied layer left no marker.
    """
    stubs = repeats.stub_of()
    blocks: dict[str, list[OpRecord]] = {}
    for run in repeats.runs:
        if run.replicated:
            first, second = run.names[:2]
            blocks[second] = _block(records, second)
            if _moved(_block(records, first), first, second) != blocks[second]:
                raise _NotRepeating
    out: list[OpRecord] = []
    placed: set[str] = set()
    for record in records:
        if record.op != _MARKER:
            out.append(record)
        elif record.scope not in placed:
            placed.add(record.scope)
            out += _moved(blocks[stubs[record.scope].names[1]], stubs[record.scope].names[1], record.scope)
    if placed != set(stubs):
        raise _NotRepeating
    extra = 0
    for name, run in stubs.items():
        second = run.names[1]
        for key in [k for k in by_module if _rename(k, second, second) is not None]:
            by_module[_rename(key, second, name)] = by_module[key]  # type: ignore[index]
        for key in _enclosing(name.rpartition(".")[0]):
            by_module[key] = by_module.get(key, 0) + by_module[second]
        extra += by_module[second]
    return out, extra


# --- the second counter: torch's FlopCounterMode -------------------------------------------


#: Products torch dispatches that have no formula here: seeing one means a count is short.
#: Any other dispatched op whose name says it multiplies matrices is reported as well.
_TORCH_MULTIPLYING = re.compile(
    r"(^|_)(mm|bmm|addmm|baddbmm|addbmm|mv|addmv|dot|vdot|addr|matmul|einsum|linear|bilinear|trilinear|"
    r"addmm_activation|conv(\dd|_tbc|_depthwise\dd|olution|_transpose\dd)(_\w+)?|\w*attention\w*|\w*_mm|"
    r"\w*_mm_\w*|linear_\w*|\w*gemm\w*)$"
)
_NOT_MULTIPLYING = re.compile(r"(prepack|unpack|_backward_data$|^linear_backward$)")


def _torch_op(packet: Any) -> str:
    """``aten.mm`` -> ``aten::mm`` (the names fvcore's records use)."""
    return str(packet).replace(".", "::", 1)


def _multiplies(op: str) -> bool:
    name = op.split("::", 1)[-1]
    return not _NOT_MULTIPLYING.search(name) and bool(_TORCH_MULTIPLYING.search(name))


# Formulas in FLOPs (2 per MAC), as torch's registry returns them; they take the op's arguments.
def _sdpa_flops(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return int(sdpa_flop_count(query.shape, key.shape, value.shape))


def _sdpa_backward_flops(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_val: Any = None,
                         **kwargs: Any) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return int(sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape))


def _grouped_mm_flops(a: Any, b: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    # 2D x 3D: rows [T, k] routed over G matrices [G, k, n] (each row meets one): T * k * n
    # 3D x 3D: [G, m, k] @ [G, k, n]; 3D x 2D: [G, m, k] @ [k, N] split by columns: out * k
    # 2D x 2D: [m, K] @ [K, n] split along K into G groups (weight gradients): m * K * n
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out_val.numel() * a.shape[-1]


def _mv_flops(first: int) -> Callable[..., int]:
    def formula(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return 2 * args[first].numel()  # [n, k] @ [k]

    return formula


def _addbmm_flops(bias: Any, a: Any, b: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]  # sum over B of [n, k] @ [k, m]


def _addr_flops(bias: Any, u: Any, v: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return 2 * u.numel() * v.numel()  # outer product [n] x [m], accumulated


def _int_mm_flops(a: Any, b: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]  # [m, k] @ [k, n]


def _int8pack_mm_flops(a: Any, b: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return 2 * a.numel() * b.shape[0]  # [m, k] @ [n, k]^T


def _quantized_linear_flops(x: Any, packed: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    weight = packed.unpack()[0]  # [out, in]
    return 2 * x.numel() * weight.shape[0]


def _extra_formulas() -> dict[Any, Callable[..., int]]:
    aten = torch.ops.aten
    table: dict[Any, Callable[..., int]] = {
        aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_flops,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward_flops,
        aten._scaled_dot_product_fused_attention_overrideable: _sdpa_flops,
        aten._scaled_dot_product_fused_attention_overrideable_backward: _sdpa_backward_flops,
        aten._grouped_mm: _grouped_mm_flops,
        aten.mv: _mv_flops(0),
        aten.addmv: _mv_flops(1),
        aten.dot: _mv_flops(0),
        aten.vdot: _mv_flops(0),
        aten.addbmm: _addbmm_flops,
        aten.addr: _addr_flops,
        aten._int_mm: _int_mm_flops,
        aten._weight_int8pack_mm: _int8pack_mm_flops,
    }
    for name in ("linear_dynamic", "linear", "linear_relu", "linear_relu_dynamic", "linear_dynamic_fp16"):
        packet = getattr(torch.ops.quantized, name, None)
        if packet is not None:
            table[packet] = _quantized_linear_flops
    return table


#: Products whose weight is packed inside the op (no parameter operand to see): always "param".
_PACKED_WEIGHT_OPS = frozenset({
    "quantized::linear_dynamic", "quantized::linear", "quantized::linear_relu", "quantized::linear_relu_dynamic",
    "quantized::linear_dynamic_fp16", "aten::_weight_int8pack_mm",
})
# The two matrix operands of the products whose records the mask rule reads.
_TORCH_OPERANDS = {"aten::mm": (0, 1), "aten::bmm": (0, 1), "aten::addmm": (1, 2), "aten::baddbmm": (1, 2),
                   "aten::addbmm": (1, 2), "aten::mv": (0, 1), "aten::addmv": (1, 2), "aten::dot": (0, 1),
                   "aten::vdot": (0, 1), "aten::_grouped_mm": (0, 1), "aten::addr": (1, 2)}
#: Ops whose output is still (part of) their first input: a parameter seen through them is a parameter.
_PARAM_PASS = frozenset({"index", "index_select", "slice", "select", "t", "transpose", "permute", "view", "reshape",
                         "_unsafe_view", "expand", "unsqueeze", "squeeze", "alias", "detach", "split", "chunk",
                         "narrow", "unbind", "_to_copy", "clone", "contiguous", "repeat_interleave"})
_TORCH_VIEW_OPS = frozenset({"slice", "select", "t", "transpose", "permute", "view", "reshape", "_unsafe_view",
                             "expand", "unsqueeze", "squeeze", "alias", "detach", "split", "chunk", "narrow",
                             "unbind", "as_strided", "_to_copy", "clone", "contiguous"})


def _named_args(packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by their schema names (first overload)."""
    try:
        overload = getattr(packet, packet.overloads()[0])
        names = [argument.name for argument in overload._schema.arguments]
    except Exception:  # noqa: BLE001 - no schema: positional only
        return dict(kwargs)
    return {**dict(zip(names, args)), **kwargs}


class _TorchRecorder:
    """Scopes, origins, masks and records for :func:`count_forward_torch`.

    Forward ops take the scope of the innermost module being called. Every backward op runs
    under an autograd node created by a forward op: it takes that forward record's scope,
    origin and mask (the weight gradient of a Linear is a product of that Linear's parameter;
    the gradients of QK^T and AV are products of activations, under the same mask). Nodes
    without a counted forward op take the innermost module whose call created them, found by
    autograd sequence numbers. Nothing depends on set order or hash seeds.
    """

    def __init__(self, model: nn.Module, masks: Mapping[str, Pattern]) -> None:
        from torch.utils.weak import WeakTensorKeyDictionary

        from torch._C._autograd import _get_sequence_nr

        self.sequence_nr = _get_sequence_nr
        self.records: list[OpRecord] = []
        self.unsupported: Counter[str] = Counter()
        # Held for the recorder's lifetime: a forward that reassigns a buffer (I-BERT's QuantAct) frees
        # the old tensor, and an activation could then reuse its id and pass for model state.
        self.state = [*model.parameters(), *model.buffers()]
        self.params = {id(p) for p in model.parameters()}
        self.buffers = {id(b) for b in model.buffers()}
        by_id = {id(b): name for name, b in model.named_buffers()}
        self.buffer_patterns = {key: masks[name] for key, name in by_id.items() if name in masks}
        self.calls: list[list[Any]] = []  # [first sequence nr, end sequence nr or None, name, parent call]
        self.starts: list[int] = []
        self.stack: list[int] = []
        self.node_records: dict[int, int] = {}  # autograd sequence nr -> forward record index
        self.backward_of: dict[int, int] = {}  # backward record index -> forward record index
        self.patterns: Any = WeakTensorKeyDictionary()
        self.flows: Any = WeakTensorKeyDictionary()  # scores -> (forward record indices, labels)
        self.labels: dict[int, list[str]] = {}
        # tensors made from a parameter by indexing or reshaping (experts picked per token)
        self.derived: Any = WeakTensorKeyDictionary()
        self.handles: list[Any] = []
        self.repeats: _Repeats | None = None
        self.copies: list[tuple[_Run, str, int, int]] = []  # (run, layer, first record, end) of each copy
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._enter(name)))
            self.handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            start = self.sequence_nr()
            self.calls.append([start, None, name, self.stack[-1] if self.stack else -1])
            self.starts.append(start)
            self.stack.append(len(self.calls) - 1)

        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.calls[self.stack.pop()][1] = self.sequence_nr()

    def copy_layer(self, run: _Run, name: str) -> Any:
        """A repeated layer's call: the second layer's records, renamed, here; its output returned."""
        second = run.names[1]
        (start, before), (end, after) = run.calls[1][5:7]
        first = len(self.records)
        for index in range(start, end):
            if index in self.labels:
                self.labels[len(self.records)] = list(self.labels[index])
            record = self.records[index]
            self.records.append(dataclasses.replace(record, scope=_rename(record.scope, second, name) or record.scope))
        self.unsupported.update(after - before)
        self.copies.append((run, name, first, len(self.records)))
        return run.calls[1][2]

    def check_copies(self, records: list[OpRecord]) -> None:
        """The first two layers alike, and every copy equal to the second layer as it finally stands."""
        assert self.repeats is not None
        self.repeats.check()
        for run in {id(run): run for run, *_ in self.copies}.values():
            first, second = run.names[:2]
            (start0, _), (end0, _) = run.calls[0][5:7]
            (start1, _), (end1, _) = run.calls[1][5:7]
            block = records[start1:end1]
            if _moved(records[start0:end0], first, second) != block:
                raise _NotRepeating
        for run, name, start, end in self.copies:
            (start1, _), (end1, _) = run.calls[1][5:7]
            if records[start:end] != _moved(records[start1:end1], run.names[1], name):
                raise _NotRepeating

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()

    def scope(self) -> str:
        return str(self.calls[self.stack[-1]][2]) if self.stack else ""

    def scope_of_node(self, sequence_nr: int) -> str:
        """The innermost module call whose forward created the node (calls nest in time)."""
        index = bisect.bisect_right(self.starts, sequence_nr) - 1
        while index >= 0:
            start, end, name, parent = self.calls[index]
            if start <= sequence_nr and (end is None or sequence_nr < end):
                return str(name)
            index = parent
        return ""

    def origin(self, tensors: list[torch.Tensor]) -> str:
        found = set()
        for tensor in tensors:
            base = tensor._base if tensor._base is not None else tensor
            if (id(tensor) in self.params or id(base) in self.params or isinstance(base, nn.Parameter)
                    or tensor in self.derived or base in self.derived):
                found.add("param")
            elif id(tensor) in self.buffers or id(base) in self.buffers:
                found.add("buffer")
        return "param" if "param" in found else "buffer" if "buffer" in found else "activation"

    def _abstract(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            pattern = self.patterns.get(value)
            if pattern is None and id(value) in self.buffer_patterns:
                pattern = self.buffer_patterns[id(value)]
            return pattern
        return value

    def observe(self, packet: Any, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any], formula: Any) -> None:
        op = _torch_op(packet)
        node = torch._C._current_autograd_node()
        if formula is None:
            if _multiplies(op):
                self.unsupported[op] += 1
            if node is None:
                self._track(op, out, args, kwargs)
            return
        flops = formula(*args, **kwargs, out_val=out)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        out_shape = tuple(first.shape) if isinstance(first, torch.Tensor) else ()
        shapes = tuple(tuple(t.shape) for t in tensors[:3])
        index = len(self.records)
        if node is not None:  # backward: the forward op that created this node decides
            source = self.node_records.get(node._sequence_nr())
            if source is not None:
                scope, origin = self.records[source].scope, self.records[source].origin
                self.backward_of[index] = source
            else:
                scope, origin = self.scope_of_node(node._sequence_nr()), self.origin(tensors)
            self.records.append(OpRecord(op, scope, _macs(flops), origin, shapes, out_shape))
            return
        origin = "param" if op in _PACKED_WEIGHT_OPS else self.origin(tensors)
        self.records.append(OpRecord(op, self.scope(), _macs(flops), origin, shapes, out_shape))
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            # autograd created this op's node just before dispatching it: the latest sequence number
            self.node_records.setdefault(self.sequence_nr() - 1, index)
        if op in TORCH_ATTENTION_OPS:
            named = _named_args(packet, args, kwargs)
            mask = named.get("attn_mask", named.get("attn_bias"))
            self.labels[index] = [_sdpa_label(
                named.get("is_causal", False), isinstance(mask, torch.Tensor),
                self._abstract(mask) if isinstance(mask, torch.Tensor) else None,
                isinstance(mask, torch.Tensor) and mask.dtype == torch.bool)]
        elif origin == "activation" and op in _TORCH_OPERANDS:
            operands = [args[i] for i in _TORCH_OPERANDS[op] if i < len(args)]
            upstream = [self.flows[t] for t in operands if isinstance(t, torch.Tensor) and t in self.flows]
            if upstream:  # AV (or Q (K^T V)): the scores' masks apply here too
                self.labels[index] = [label for _, labels in upstream for label in labels]
            elif isinstance(first, torch.Tensor):
                self.flows[first] = ((index,), ())
        self._track(op, out, args, kwargs)

    def _track(self, op: str, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Follow mask patterns, attention scores and parameters through the forward ops."""
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if not isinstance(first, torch.Tensor):
            return
        short = op.split("::", 1)[-1]
        if short in _PARAM_PASS and self.origin([a for a in args if isinstance(a, torch.Tensor)][:1]) == "param":
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self.derived[tensor] = True
        flow_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a in self.flows]
        if flow_positions:
            indices, labels = self.flows[args[flow_positions[0]]]
            if short in _SCORE_MASKING and short != "masked_fill" or short == "masked_fill" and flow_positions[0] == 0:
                label = _masking_label(short, [self._abstract(a) for a in args], flow_positions[0])
                for index in indices:
                    self.labels.setdefault(index, []).append(label)
                self.flows[first] = (indices, (*labels, label))
            elif short in _SCORE_PASS:
                self.flows[first] = (indices, labels)
            return
        if short in _TORCH_VIEW_OPS or short in _MASK_PASS or short in ("tril", "triu", "eq", "ne", "where",
                                                                          "masked_fill", "logical_not",
                                                                          "bitwise_not"):
            ins = [self._abstract(a) for a in args]
            if short in ("full", "new_full") and "fill_value" in kwargs:
                ins = [*ins[:1], kwargs["fill_value"]]
            pattern = _mask_transfer(short, ins)
            if pattern is not None:
                self.patterns[first] = pattern
        elif short in ("ones", "zeros", "full", "scalar_tensor", "ones_like", "zeros_like", "full_like", "new_ones",
                       "new_zeros"):
            pattern = _mask_transfer(short, [self._abstract(a) for a in args])
            if pattern is not None:
                self.patterns[first] = pattern

    def finish(self) -> list[OpRecord]:
        records = list(self.records)
        for index, labels in self.labels.items():
            records[index] = dataclasses.replace(records[index], mask=_combine(labels))
        for index, source in self.backward_of.items():
            records[index] = dataclasses.replace(records[index], mask=records[source].mask)
        return records


def _macs(flops: Any) -> Any:
    """FLOPs to MACs: an int, or a size of swept lengths (one value per length, see lengths.py)."""
    return flops // 2 if isinstance(flops, torch.SymInt) else int(flops) // 2


def _torch_counter(recorder: _TorchRecorder) -> Any:
    from torch.utils.flop_counter import FlopCounterMode

    class _Counter(FlopCounterMode):  # type: ignore[misc]
        """FlopCounterMode that hands every executed op to the recorder (formula or not)."""

        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            recorder.observe(func_packet, out, args, kwargs, self.flop_registry.get(func_packet))
            return out

    counter = _Counter(display=False)
    counter.flop_registry = {**counter.flop_registry, **_extra_formulas()}
    return counter


def count_forward_torch(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, train: bool = False, fake: bool = True,
    buffer_masks: Mapping[str, Pattern] | None = None,
) -> RawCount:
    """Count with torch's ``FlopCounterMode`` at the dispatcher, on fake tensors (no memory, no arithmetic).

    *model* must be a twin. With ``train=True`` a real backward runs too (of the sum of the
    outputs), so backward products are counted as executed, each in the scope (and with the
    origin and mask) of the forward op it differentiates. FLOPs are halved into MACs.
    Products torch has no formula for are listed in ``unsupported_ops``.

    Args:
        buffer_masks: triangular mask buffers of the original model (see :func:`buffer_masks`).

    Raises:
        CountError: the model could not run on fake tensors; the message carries the reason.
    """
    _refuse_scripted(model)
    if lengths_mod.swept((args, kwargs)):  # one run for several lengths: meta tensors of swept sizes
        if train:
            raise CountError("train mode counts one length at a time")
        with lengths_mod.one_run():
            return _count_torch(model, args, kwargs, train, fake, buffer_masks, shortcut=True)
    return _count_torch(model, args, kwargs, train, fake, buffer_masks, shortcut=fake and not train)


def _count_torch(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], train: bool, fake: bool,
                 buffer_masks: Mapping[str, Pattern] | None, shortcut: bool) -> RawCount:
    if _SHORTCUT["enabled"] and shortcut:
        recorder = _TorchRecorder(model, buffer_masks or {})
        repeats = _Repeats(model, on_stub=recorder.copy_layer,
                           snapshot=lambda: (len(recorder.records), Counter(recorder.unsupported)),
                           masks=buffer_masks)
        if repeats:
            recorder.repeats = repeats
            try:
                return _run_torch(model, args, kwargs, train, fake, recorder)
            except _NotRepeating:
                pass
            finally:
                repeats.undo()
        else:
            recorder.remove_hooks()
    return _run_torch(model, args, kwargs, train, fake, _TorchRecorder(model, buffer_masks or {}))


_MEMO_MODE: list[type] = []


def _memo_mode() -> type:
    """FakeTensorMode that hands back, for a functional op met again on the same sizes, new fake tensors of
    the sizes it made the first time (see lengths.OpMemo): the one run's cost is in those sizes."""
    if not _MEMO_MODE:
        from torch._subclasses.fake_tensor import FakeTensorMode

        class _MemoFakeTensorMode(FakeTensorMode):  # type: ignore[misc]
            def __init__(self, **kwargs: Any) -> None:
                super().__init__(**kwargs)
                self.memo = lengths_mod.OpMemo()

            def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                key = self.memo.key(func, args, kwargs)
                if key is not None:
                    found = self.memo.made.get(key)
                    if found is not None:
                        many, outs = found
                        with self:
                            made = tuple(torch.empty_strided(shape, stride, dtype=dtype, device=device)
                                         for shape, stride, dtype, device in outs)
                        return made if many else made[0]
                out = super().dispatch(func, types, args, kwargs)
                if key is not None:
                    self.memo.keep(key, out, pytree.tree_leaves((args, kwargs)))
                return out

        _MEMO_MODE.append(_MemoFakeTensorMode)
    return _MEMO_MODE[0]


def _fake(mode: Any, leaf: Any, made: dict[int, Any]) -> Any:
    if not isinstance(leaf, torch.Tensor):
        return leaf
    if lengths_mod.swept(leaf):  # sizes of swept lengths: a fake tensor made anew (from_tensor wants a ShapeEnv),
        if id(leaf) not in made:  # once per tensor, as from_tensor does: MHA's (x, x, x) stays one tensor
            with mode:
                made[id(leaf)] = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device=leaf.device,
                                                     requires_grad=leaf.requires_grad)
        return made[id(leaf)]
    return mode.from_tensor(leaf)


def _run_torch(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], train: bool, fake: bool,
               recorder: _TorchRecorder) -> RawCount:
    from torch._subclasses.fake_tensor import FakeTensorMode

    counter = _torch_counter(recorder)
    # Fake tensors, not bare meta ones: transformers skips its value checks for them (as under a tracer).
    swept = fake and lengths_mod.swept((args, kwargs))
    mode: Any = (_memo_mode()(allow_non_fake_inputs=True) if swept else FakeTensorMode(allow_non_fake_inputs=True)
                 if fake else contextlib.nullcontext())
    if swept:
        mode.cache_enabled = False  # its keys want sympy expressions; a swept length has values instead
        # torch's C++ meta kernels compute with a swept length's values as with any size; fake tensors would
        # otherwise take the Python decompositions made for sympy sizes (the same shapes, several times slower)
        mode.cpp_meta_supports_symint = lambda func: True
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with _no_global_hooks(), torch.random.fork_rng(devices=[]), mode:
            if fake:
                made: dict[int, Any] = {}
                args, kwargs = pytree.tree_map(lambda leaf: _fake(mode, leaf, made), (args, kwargs))
            with counter, torch.set_grad_enabled(train):
                output = model(*args, **kwargs)
                if train:
                    leaves: list[torch.Tensor] = []
                    _tensor_leaves(output, leaves)
                    grads = [t for t in leaves if t.requires_grad and t.is_floating_point()]
                    if not grads:
                        raise CountError("train mode needs an output that requires grad; none did")
                    loss = torch.stack([t.sum() for t in grads]).sum()
                    loss.backward()
    except CountError:
        if recorder.repeats is not None and recorder.repeats.stub_of():
            raise _NotRepeating from None
        raise
    except Exception as exc:  # noqa: BLE001 - the model's reason is the user's best clue
        if recorder.repeats is not None and recorder.repeats.stub_of():
            raise _NotRepeating from exc
        reason = f"{type(exc).__name__}: {exc}".strip()[:600]
        where = "on fake tensors" if fake else "on real tensors"
        raise CountError(
            f"torch's FlopCounterMode could not run {type(model).__name__} {where}: {reason}\n"
            "Fix: avoid reading tensor values in forward() (.item(), bool(tensor), printing), or pass "
            "inputs= that forward() accepts."
        ) from exc
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        recorder.remove_hooks()
    records = recorder.finish()
    if recorder.repeats is not None:
        recorder.check_copies(records)
    classes = {name: type(module).__name__ for name, module in model.named_modules()}
    copied = tuple(name for _, name, _, _ in recorder.copies)
    if any(isinstance(r.macs, torch.SymInt) for r in records):  # several lengths: summed per length by at_lengths
        return RawCount(total=0, records=records, unsupported_ops=recorder.unsupported, by_module={},
                        module_names=classes, copied_layers=copied)
    return RawCount(total=sum(r.macs for r in records), records=records, unsupported_ops=recorder.unsupported,
                    by_module=_module_totals(records, list(classes)), module_names=classes, copied_layers=copied)


def _module_totals(records: list[OpRecord], names: list[str],
                   enclosing: dict[str, list[str]] | None = None) -> dict[str, int]:
    """Each module's MACs, its descendants' included. *enclosing* (scope -> the modules of *names*
    enclosing it) is filled as scopes come and may be shared by counts of the same records' scopes."""
    enclosing = {} if enclosing is None else enclosing
    by_module = dict.fromkeys(names, 0)
    for record in records:
        found = enclosing.get(record.scope)
        if found is None:
            found = enclosing[record.scope] = [name for name in _enclosing(record.scope) if name in by_module]
        for name in found:
            by_module[name] += record.macs
    return by_module


def at_lengths(raw: RawCount, k: int) -> list[RawCount]:
    """A count made for k lengths at once (see lengths.py), as k counts, one per length."""
    spread = lengths_mod.spread
    records: list[list[OpRecord]] = [[] for _ in range(k)]
    new = object.__new__
    for record in raw.records:
        fields = vars(record)
        for out, macs, shapes, out_shape in zip(records, spread(record.macs, k), spread(record.shapes, k),
                                                spread(record.out_shape, k)):
            copy = new(OpRecord)  # a frozen dataclass: its fields set directly, k times per record
            vars(copy).update(fields, macs=macs, shapes=shapes, out_shape=out_shape)
            out.append(copy)
    names = list(raw.module_names)
    enclosing: dict[str, list[str]] = {}  # each scope's enclosing modules, once for all lengths
    return [dataclasses.replace(raw, total=sum(r.macs for r in mine), records=mine,
                                by_module=_module_totals(mine, names, enclosing)) for mine in records]


def _enclosing(scope: str) -> Iterator[str]:
    """``a.b.c`` -> ``a.b.c``, ``a.b``, ``a``, ``""``: by_module counts a module's descendants."""
    name = scope
    while True:
        yield name
        if not name:
            return
        name = name.rpartition(".")[0]
