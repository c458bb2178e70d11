"""Which aten ops multiply matrices, which are attention, and the record of one counted op.

torch-free tables, so that :mod:`pytest_attncost.roles` (and anything that only reads
records) runs without importing torch. The counters in :mod:`pytest_attncost.counting`
fill :class:`OpRecord` records; the handles that count each op live there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "ATTENTION_OPS",
    "CONTRACTING_OPS",
    "MASK_CAUSAL",
    "MASK_NONE",
    "MASK_UNKNOWN",
    "MATMUL_LIKE_UNSUPPORTED",
    "OpRecord",
    "SDPA_OPS",
    "TORCH_ATTENTION_OPS",
]

SDPA_OPS = (
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_attention_math",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_fused_attention_overrideable",
)

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
