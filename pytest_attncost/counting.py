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
import math
import re
import types
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from numbers import Number
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

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

SDPA_OPS = (
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_attention_math",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_fused_attention_overrideable",
)

EXTRA_HANDLES: dict[str, Handle] = {
    **{op: _sdpa_macs for op in SDPA_OPS},
    "aten::baddbmm": _batched_mm_macs(1),
    "aten::addbmm": _batched_mm_macs(1),
    "aten::mv": _mv_macs(0),
    "aten::addmv": _mv_macs(1),
    "aten::dot": _dot_macs,
    "aten::einsum": _einsum_macs,
}

#: Ops that are attention cores wherever they run.
ATTENTION_OPS = frozenset(SDPA_OPS)

#: Matrix products, with the input positions of their two operands (einsum: a list).
CONTRACTING_OPS: Mapping[str, tuple[int, ...]] = {
    "aten::linear": (0, 1),
    "aten::addmm": (1, 2),
    "aten::mm": (0, 1),
    "aten::matmul": (0, 1),
    "aten::bmm": (0, 1),
    "aten::baddbmm": (1, 2),
    "aten::addbmm": (1, 2),
    "aten::mv": (0, 1),
    "aten::addmv": (1, 2),
    "aten::dot": (0, 1),
    "aten::einsum": (1,),
    "aten::_convolution": (0, 1),
    # dispatcher-level products the torch backend records (no fvcore handle needed)
    "aten::vdot": (0, 1),
    "aten::addr": (1, 2),
    "aten::_grouped_mm": (0, 1),
    "aten::_int_mm": (0, 1),
    "aten::_weight_int8pack_mm": (0, 1),
    "quantized::linear_dynamic": (0,),
    "quantized::linear": (0,),
    "quantized::linear_relu": (0,),
    "quantized::linear_relu_dynamic": (0,),
    "quantized::linear_dynamic_fp16": (0,),
}

#: Ops that multiply matrices but that no handle counts: seeing one means a count is short.
MATMUL_LIKE_UNSUPPORTED = frozenset(
    {
        "aten::_native_multi_head_attention",
        "aten::_transformer_encoder_layer_fwd",
        "aten::_transformer_decoder_only_layer_fwd",
        "aten::tensordot",
        "aten::bilinear",
        "aten::_scaled_mm",
        "aten::_addmm_activation",
        "aten::chain_matmul",
        "aten::linalg_multi_dot",
        "aten::inner",
        "aten::outer",
        "aten::ger",
        "aten::kron",
        "aten::conv_tbc",
        "aten::_flash_attention_forward",
        "aten::_efficient_attention_forward",
    }
)

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


@dataclass(frozen=True)
class OpRecord:
    """One counted op of the trace.

    Attributes:
        op: the aten name, e.g. ``aten::linear``.
        scope: dotted name of the innermost module that ran it (``""``: the root).
        macs: what its handle counted.
        origin: ``"param"`` if an operand is (a view of) a parameter, ``"buffer"``
            if one is a buffer and none a parameter, else ``"activation"``.
        shapes: the shapes of its operands (for matrix products) or of q, k, v.
        out_shape: the shape of its (first) output.
        mask: for a product of two activations (QK^T, AV, and their gradients) and for fused
            attention: ``"causal"`` if it runs under a causal mask (query i sees keys j <= i:
            ``is_causal=True``, or a ``tril`` / ``triu(diagonal=1)`` mask built inline or held
            in a buffer named in ``buffer_masks=``), ``"unknown"`` if some other mask or bias
            is applied to its scores (padding, sliding window, a mask built some other way),
            ``""`` if none is (and for every other op).
    """

    op: str
    scope: str
    macs: int
    origin: str
    shapes: tuple[tuple[int, ...], ...]
    out_shape: tuple[int, ...] = ()
    mask: str = ""


@dataclass
class RawCount:
    """What one trace produced, before the split into roles."""

    total: int
    records: list[OpRecord]
    unsupported_ops: Counter[str]
    by_module: dict[str, int]
    module_names: dict[str, str] = field(default_factory=dict)  # name -> class name


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
MASK_NONE = ""  # no mask reaches the product: it runs on every query-key pair
MASK_CAUSAL = "causal"  # a causal mask: query i sees keys j <= i (is_causal=True, tril, triu(1))
MASK_UNKNOWN = "unknown"  # a mask (or bias) is applied whose form cannot be told

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
        return _label(positions) if isinstance(fill, Number) and fill < 0 else MASK_UNKNOWN
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
    return _label(positions) if isinstance(fill, Number) and fill < 0 else MASK_UNKNOWN


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
        twin = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            twin = nn.Parameter(twin, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = twin
    try:
        clone = copy.deepcopy(model, memo)
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
        from fvcore.nn import FlopCountAnalysis
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
    from fvcore.nn.flop_count import _DEFAULT_SUPPORTED_OPS

    _refuse_scripted(model)
    with _no_global_hooks():
        return _count_forward(model, args, kwargs, flop_count_analysis, _DEFAULT_SUPPORTED_OPS, buffer_masks)


def _count_forward(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], flop_count_analysis: Any,
    default_ops: Mapping[str, Handle], buffer_masks: Mapping[str, Pattern] | None,
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
    with _counting_environment():
        try:
            total = analysis.total()
        except CountError:
            raise
        except Exception as exc:  # noqa: BLE001 - the tracer's reason is the user's best clue
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
    by_module: dict[str, int] = {}
    for name, value in by_module_raw.items():
        if name == "":
            continue  # the harness; "model" below is the same total
        key = "" if name == "model" else name[len("model.") :]
        by_module[key] = int(value)
    classes = {name: type(module).__name__ for name, module in model.named_modules()}
    return RawCount(
        total=int(total), records=ctx.records, unsupported_ops=unsupported, by_module=by_module, module_names=classes
    )


# --- the second counter: torch's FlopCounterMode -------------------------------------------

#: Attention ops as torch dispatches them, forward and backward (fused kernels; on meta and
#: fake tensors sdpa decomposes into bmm, which the core rule already covers).
TORCH_ATTENTION_OPS = frozenset(
    {
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_flash_attention_backward",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_efficient_attention_backward",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_cudnn_attention_backward",
        "aten::_scaled_dot_product_fused_attention_overrideable",
        "aten::_scaled_dot_product_fused_attention_overrideable_backward",
        "aten::_flash_attention_forward",
        "aten::_flash_attention_backward",
        "aten::_efficient_attention_forward",
        "aten::_efficient_attention_backward",
    }
)

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
            self.records.append(OpRecord(op, scope, int(flops) // 2, origin, shapes, out_shape))
            return
        origin = "param" if op in _PACKED_WEIGHT_OPS else self.origin(tensors)
        self.records.append(OpRecord(op, self.scope(), int(flops) // 2, origin, shapes, out_shape))
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
    from torch._subclasses.fake_tensor import FakeTensorMode

    _refuse_scripted(model)
    recorder = _TorchRecorder(model, buffer_masks or {})
    counter = _torch_counter(recorder)
    # Fake tensors, not bare meta ones: transformers skips its value checks for them (as under a tracer).
    mode: Any = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with _no_global_hooks(), torch.random.fork_rng(devices=[]), mode:
            if fake:
                args, kwargs = pytree.tree_map(
                    lambda leaf: mode.from_tensor(leaf) if isinstance(leaf, torch.Tensor) else leaf, (args, kwargs)
                )
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
        raise
    except Exception as exc:  # noqa: BLE001 - the model's reason is the user's best clue
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
    names = [name for name, _ in model.named_modules()]
    by_module = dict.fromkeys(names, 0)
    for record in records:
        for name in _enclosing(record.scope):
            if name in by_module:
                by_module[name] += record.macs
    classes = {name: type(module).__name__ for name, module in model.named_modules()}
    return RawCount(total=sum(r.macs for r in records), records=records, unsupported_ops=recorder.unsupported,
                    by_module=by_module, module_names=classes)


def _enclosing(scope: str) -> Iterator[str]:
    """``a.b.c`` -> ``a.b.c``, ``a.b``, ``a``, ``""``: by_module counts a module's descendants."""
    name = scope
    while True:
        yield name
        if not name:
            return
        name = name.rpartition(".")[0]
