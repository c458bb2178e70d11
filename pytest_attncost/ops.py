"""The one op table: which aten ops multiply, where their operands are, their MACs from shapes.

torch-free, so that the split and everything that only reads records run without torch; every reader of ops
(both backends' handles, the split, the timing engine) uses it. Names are the dispatcher's, ``aten::mm``."""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .request import BACKENDS

__all__ = ["CONVOLUTIONS", "FUSED_ATTENTION_OPS", "LIBRARY", "MASK_CAUSAL", "MASK_NONE", "MASK_UNKNOWN",
           "MATMUL_LIKE_UNSUPPORTED", "OURS", "OpRecord", "PRODUCTS", "Product", "RawCount", "SDPA_OPS", "TABLE",
           "UNCOUNTED", "VIEW_OPS", "ancestors", "attention_macs", "counted_by", "is_fused", "is_product", "parent",
           "short", "within"]

Shape = Sequence[int]


def _matmul(a: Shape, b: Shape, out: Shape = ()) -> int:
    """``[.., n, k] @ [.., k, m]`` with broadcast batch dimensions (1-D operands as torch.matmul takes them)."""
    if len(a) == 1 and len(b) == 1:
        return a[0]
    if len(a) == 1:
        a = (1, *a)
    if len(b) == 1:
        b = (*b, 1)
    batch = itertools.zip_longest(reversed(a[:-2]), reversed(b[:-2]), fillvalue=1)
    return math.prod(max(x, y) for x, y in batch) * a[-2] * a[-1] * b[-1]


def _linear(x: Shape, w: Shape, out: Shape = ()) -> int:
    return math.prod(x[:-1]) * w[0] * w[1]  # [.., in] @ [in, out]


def _rows(a: Shape, b: Shape, out: Shape = ()) -> int:
    return math.prod(a)  # [n, k] @ [k]: mv, dot, vdot


def _outer(u: Shape, v: Shape, out: Shape = ()) -> int:
    return math.prod(u) * math.prod(v)  # addr: [n] x [m], accumulated


def _batched(a: Shape, b: Shape, out: Shape = ()) -> int:
    return a[0] * a[1] * a[2] * b[-1]  # bmm, baddbmm, addbmm: [B, n, k] @ [B, k, m]


def _packed_int8(a: Shape, b: Shape, out: Shape = ()) -> int:
    return math.prod(a) * b[0]  # [m, k] @ [n, k]^T


def _grouped(a: Shape, b: Shape, out: Shape = ()) -> int:
    # 2D x 2D: [m, K] @ [K, n] split along K into groups (weight gradients): m * K * n; otherwise each output
    # element is one row of a against one column of a group's matrix: out * k
    if len(a) == 2 and len(b) == 2:
        return a[0] * a[1] * b[1]
    return math.prod(out) * a[-1]


def attention_macs(q: Shape, k: Shape, v: Shape) -> int:
    """QK^T plus AV of fused attention, per query head (grouped-query and cross-attention included)."""
    # scores: [b, h, n, d] @ [b, h, d, m]; output: [b, h, n, m] @ [b, h, m, d_v]
    return math.prod(q[:-1]) * k[-2] * (q[-1] + v[-1])


#: How a backend counts a product (:attr:`Product.fvcore`, :attr:`Product.torch`): its library does (fvcore's
#: default handles, torch's FLOP registry, or the products the trace or dispatcher shows it as, conv2d as
#: _convolution, linear as addmm), a handle made here from :attr:`Product.macs`, a handle of this package that
#: reads more than shapes (einsum's equation, a packed weight), or nothing: listed as unsupported and flagged.
LIBRARY, TABLE, OURS, UNCOUNTED = "library", "table", "ours", ""


@dataclass(frozen=True)
class Product:
    """One op that multiplies matrices.

    Attributes:
        operands: the argument positions of its two matrices (``()``: every tensor it is given, as einsum's list).
        macs: its MACs from the operands' shapes (and the output's); None where only a backend can tell (einsum's
            equation, a convolution's geometry, a packed weight).
        weight: its second operand is a weight by construction (Linear, convolutions), whatever the profiler's shapes
            show.
        packed: its weight is packed inside the op (quantized kernels): no operand shows it, and it is a parameter
            product wherever it runs.
        fvcore, torch: how each backend counts it (:data:`LIBRARY`, :data:`TABLE`, :data:`OURS`, :data:`UNCOUNTED`);
            each backend's handles are made from these.
    """

    operands: tuple[int, ...] = (0, 1)
    macs: Callable[[Shape, Shape, Shape], int] | None = None
    weight: bool = False
    packed: bool = False
    fvcore: str = TABLE
    torch: str = TABLE


_CONV = Product(weight=True, fvcore=LIBRARY, torch=LIBRARY)
_QUANTIZED = Product((0,), packed=True, fvcore=LIBRARY, torch=OURS)  # fvcore: the twin's stand-in Linear

#: Every op that multiplies matrices, as the jit trace, the dispatcher or the profiler name it.
PRODUCTS: Mapping[str, Product] = {
    "aten::linear": Product(macs=_linear, weight=True, fvcore=LIBRARY, torch=LIBRARY),
    "aten::matmul": Product(macs=_matmul, fvcore=LIBRARY, torch=LIBRARY),
    "aten::mm": Product(macs=_matmul, fvcore=LIBRARY, torch=LIBRARY),
    "aten::bmm": Product(macs=_batched, fvcore=LIBRARY, torch=LIBRARY),
    "aten::addmm": Product((1, 2), _matmul, fvcore=LIBRARY, torch=LIBRARY),
    "aten::baddbmm": Product((1, 2), _batched, torch=LIBRARY),
    "aten::addbmm": Product((1, 2), _batched),
    "aten::mv": Product(macs=_rows),
    "aten::addmv": Product((1, 2), _rows),
    "aten::dot": Product(macs=_rows),
    "aten::vdot": Product(macs=_rows),
    "aten::addr": Product((1, 2), _outer),
    "aten::einsum": Product((), fvcore=OURS, torch=LIBRARY),  # fvcore's handle rounds to 4 digits
    "aten::bilinear": Product((), weight=True, fvcore=UNCOUNTED, torch=UNCOUNTED),  # torch: aten::_trilinear
    "aten::tensordot": Product((), fvcore=UNCOUNTED, torch=LIBRARY),
    "aten::_grouped_mm": Product(macs=_grouped),
    "aten::_int_mm": Product(macs=_matmul),
    "aten::_weight_int8pack_mm": Product(macs=_packed_int8, packed=True),
    "aten::_scaled_mm": Product(fvcore=UNCOUNTED, torch=LIBRARY),
    **{f"aten::{name}": _CONV for name in (
        "_convolution", "convolution", "convolution_backward", "_slow_conv2d_forward", "cudnn_convolution",
        "convolution_overrideable", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d")},
    **{f"quantized::{name}": _QUANTIZED for name in (
        "linear_dynamic", "linear", "linear_relu", "linear_relu_dynamic", "linear_dynamic_fp16")},
}


#: The convolutions among :data:`PRODUCTS`: their results are (batch, channels, *positions).
CONVOLUTIONS = frozenset(op for op, product in PRODUCTS.items() if product is _CONV)


def counted_by(backend: str, how: str) -> list[str]:
    """The products *backend* (``"fvcore"`` or ``"torch"``) counts *how* (:data:`TABLE`, ...), in table order."""
    return [op for op, product in PRODUCTS.items() if getattr(product, backend) == how]


#: Fused attention as the jit trace and the dispatcher name it, forward, taking (q, k, v, ...).
SDPA_OPS = frozenset({
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_attention_math",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_fused_attention_overrideable",
})

#: Ops that are attention cores wherever they run: the forward kernels above, the backward kernels of the
#: fused ones (the composite and the math path have none) and the flash / memory-efficient kernels they call.
FUSED_ATTENTION_OPS = SDPA_OPS | frozenset(
    f"{op}_backward" for op in SDPA_OPS if op not in ("aten::scaled_dot_product_attention",
                                                      "aten::_scaled_dot_product_attention_math")
) | frozenset({"aten::_flash_attention_forward", "aten::_flash_attention_backward",
               "aten::_efficient_attention_forward", "aten::_efficient_attention_backward"})

#: Ops that multiply matrices but that no handle counts: seeing one means a count is short (the table's
#: uncounted products and ops outside the table).
MATMUL_LIKE_UNSUPPORTED = frozenset({*(op for backend in BACKENDS for op in counted_by(backend, UNCOUNTED)),
    "aten::_native_multi_head_attention", "aten::_transformer_encoder_layer_fwd",
    "aten::_transformer_decoder_only_layer_fwd", "aten::_addmm_activation", "aten::chain_matmul",
    "aten::linalg_multi_dot", "aten::inner", "aten::outer", "aten::ger", "aten::kron", "aten::conv_tbc",
    "aten::_flash_attention_forward", "aten::_efficient_attention_forward",
})

#: Ops whose output is (part of) their first input, by short name: a parameter seen through them is
#: still the parameter (views, casts, copies, experts picked per token from stacked weights).
VIEW_OPS = frozenset({
    "t", "transpose", "permute", "view", "reshape", "_unsafe_view", "contiguous", "expand", "expand_as",
    "unsqueeze", "squeeze", "to", "_to_copy", "type_as", "detach", "clone", "alias", "numpy_T", "mT", "flatten",
    "unflatten", "select", "slice", "chunk", "split", "unsafe_chunk", "unsafe_split", "split_with_sizes", "narrow",
    "unbind", "view_as", "reshape_as", "ListUnpack", "TupleUnpack", "movedim", "swapaxes", "repeat_interleave",
    "index", "index_select",
})


def short(op: str) -> str:
    """``aten::mm`` -> ``mm``."""
    return op.split("::", 1)[-1]


def within(scope: str, module: str) -> bool:
    """Whether *scope* is *module* or inside it (every scope is inside the root, ``""``)."""
    return module == "" or scope == module or scope.startswith(module + ".")


def parent(name: str) -> str:
    """``a.b.c`` -> ``a.b``; ``a`` -> ``""``."""
    return name.rpartition(".")[0]


def ancestors(scope: str) -> list[str]:
    """``a.b.c`` -> ``a.b.c``, ``a.b``, ``a``, ``""`` (the root): the modules enclosing a scope, innermost first."""
    chain = [scope]
    while scope:
        scope = scope.rpartition(".")[0]
        chain.append(scope)
    return chain


def is_product(op: str) -> bool:
    return op in PRODUCTS


def is_fused(op: str) -> bool:
    return op in FUSED_ATTENTION_OPS


MASK_NONE = ""  # no mask reaches the product: it runs on every query-key pair
MASK_CAUSAL = "causal"  # a causal mask: query i sees keys j <= i (is_causal=True, tril, triu(1))
MASK_UNKNOWN = "unknown"  # a mask (or bias) is applied whose form cannot be told


@dataclass(frozen=True)
class OpRecord:
    """One counted op of the trace.

    Attributes:
        op: the aten name, e.g. ``aten::linear``.
        scope: dotted name of the innermost module that ran it (``""``: the root).
        macs: what its handle counted.
        origin: ``"param"`` if an operand is (a view of) a parameter, ``"buffer"`` if one is a buffer and none a
            parameter, else ``"activation"``.
        shapes: the shapes of its operands (for matrix products) or of q, k, v.
        out_shape: the shape of its (first) output.
        mask: for a product of two activations (QK^T, AV, and their gradients) and for fused attention: ``"causal"`` if
            it runs under a causal mask (query i sees keys j <= i: ``is_causal=True``, or a ``tril`` /
            ``triu(diagonal=1)`` mask built inline or held in a buffer named in ``buffer_masks=``), ``"unknown"`` if
            some other mask or bias is applied to its scores (padding, sliding window, a mask built some other way),
            ``""`` if none is (and for every other op).
        sources: for a product or fused attention op, per operand, the indices (in the count's list of records) of the
            earlier products whose results reach it through ops that multiply no matrices (views, norms, activations,
            rotary, residual additions): the data flow the split follows (:mod:`~pytest_attncost.roles`); :attr:`fed_by`
            is their union.
        backward_of: in a train-mode count, the index of the forward record a backward op differentiates (-1 when none
            was counted); None for forward ops.
        weights: the elements of its operands that are parameters (the weights it reads).
        keeps: for the records of a FlexAttention core (forward and backward), ``(kept, all)``: the (batch, head, query,
            key) positions its ``mask_mod`` keeps of all it spans, evaluated while counting under ``causal="half"`` or
            ``"kept"``; None elsewhere. Its MACs over the kept pairs are ``macs * kept // all``.
    """

    op: str
    scope: str
    macs: int
    origin: str
    shapes: tuple[tuple[int, ...], ...]
    out_shape: tuple[int, ...] = ()
    mask: str = ""
    sources: tuple[tuple[int, ...], ...] = ()
    backward_of: int | None = None
    weights: int = 0
    keeps: tuple[int, int] | None = None

    @property
    def moved(self) -> tuple[int, int]:
        """(weight, activation) elements it reads and writes: its operands and its result."""
        result = math.prod(self.out_shape) if self.out_shape else 0
        return self.weights, sum(math.prod(shape) for shape in self.shapes) - self.weights + result

    @functools.cached_property
    def fed_by(self) -> frozenset[int]:
        """The products whose results reach any of its operands (made once: the split asks it often)."""
        return frozenset(i for operand in self.sources for i in operand)


@dataclass
class RawCount:
    """What one count produced, before the split into roles."""

    total: int
    records: list[OpRecord]
    unsupported_ops: Counter[str]
    by_module: dict[str, int]
    module_names: dict[str, str] = field(default_factory=dict)  # name -> class name
    copied_layers: tuple[str, ...] = ()  # repeated layers counted as copies of a traced one (counting.repeats)
    outputs: tuple[tuple[int, ...], ...] = ()  # per output of the model, the products whose results reach it
    # train mode: the forward ops activation checkpointing ran again inside the backward, not in records or total;
    # each one's backward_of is the index (in records) of the forward op it repeats, -1 where none was found
    recompute: tuple[OpRecord, ...] = ()

    @property
    def opaque(self) -> list[str]:
        """Custom ``torch.autograd.Function``s the tracer saw as one op each: products inside them are unseen."""
        return sorted(op for op in self.unsupported_ops if op.startswith("prim::PythonOp"))
