"""The op table on its own (pytest_attncost.ops): operand positions, MACs from hand-written shapes,
the fused-attention sets, the scope helpers, the op record's opaque ops; and the two backends'
extras (fvcore's handles, the torch backend's formulas) covering exactly the table ops they claim.

Every expected integer is written out by hand, never computed by the function under test."""

import warnings
from collections import Counter

import pytest
import torch

from pytest_attncost.ops import (
    FUSED_ATTENTION_OPS,
    LIBRARY,
    MATMUL_LIKE_UNSUPPORTED,
    OURS,
    PRODUCTS,
    SDPA_OPS,
    TABLE,
    UNCOUNTED,
    RawCount,
    ancestors,
    attention_macs,
    counted_by,
    is_fused,
    is_product,
    short,
)

# --- operand positions -------------------------------------------------------------------------

#: Ops whose matrices are not their first two arguments: a bias or an accumulator first, or a list.
POSITIONS = {
    "aten::addmm": (1, 2),  # addmm(bias, m1, m2)
    "aten::baddbmm": (1, 2),
    "aten::addbmm": (1, 2),
    "aten::addmv": (1, 2),
    "aten::addr": (1, 2),  # addr(self, u, v)
    "aten::einsum": (),  # einsum(equation, [operands]): every tensor it is given
    "aten::bilinear": (),
    "aten::tensordot": (),
    **{f"quantized::{name}": (0,) for name in (
        "linear_dynamic", "linear", "linear_relu", "linear_relu_dynamic", "linear_dynamic_fp16")},
}


def test_every_product_names_its_operand_positions():
    for op, product in PRODUCTS.items():
        assert isinstance(product.operands, tuple), op
        assert all(isinstance(i, int) and i >= 0 for i in product.operands), op
        assert product.operands == POSITIONS.get(op, (0, 1)), op
        assert is_product(op)
    assert not is_product("aten::add") and not is_product("mm")  # the dispatcher's names only


def test_weights_and_packed_weights():
    weights = {op for op, product in PRODUCTS.items() if product.weight}
    assert {"aten::linear", "aten::bilinear", "aten::conv2d", "aten::convolution_backward"} <= weights
    assert not weights & {"aten::mm", "aten::matmul", "aten::bmm", "aten::addmm", "aten::einsum"}
    packed = {op for op, product in PRODUCTS.items() if product.packed}
    assert packed == {"aten::_weight_int8pack_mm"} | {op for op in PRODUCTS if op.startswith("quantized::")}


# --- MACs from shapes -------------------------------------------------------------------------------

#: op -> (the shapes of its arguments in order, the output's shape, MACs by hand); every op with a MAC function.
CASES = {
    "aten::linear": ([[2, 3, 4], [5, 4]], [2, 3, 5], 2 * 3 * 4 * 5),  # x [.., in], w [out, in]
    "aten::matmul": ([[3, 4], [4, 5]], [3, 5], 3 * 4 * 5),
    "aten::mm": ([[3, 4], [4, 5]], [3, 5], 60),
    "aten::bmm": ([[2, 3, 4], [2, 4, 5]], [2, 3, 5], 120),
    "aten::addmm": ([[5], [3, 4], [4, 5]], [3, 5], 60),  # the bias is not an operand
    "aten::baddbmm": ([[2, 3, 5], [2, 3, 4], [2, 4, 5]], [2, 3, 5], 120),
    "aten::addbmm": ([[3, 5], [2, 3, 4], [2, 4, 5]], [3, 5], 120),  # summed over the batch: still 2 products
    "aten::mv": ([[3, 4], [4]], [3], 12),
    "aten::addmv": ([[3], [3, 4], [4]], [3], 12),
    "aten::dot": ([[7], [7]], [], 7),
    "aten::vdot": ([[7], [7]], [], 7),
    "aten::addr": ([[3, 5], [3], [5]], [3, 5], 15),  # outer product u v^T
    # 2D x 3D: 24 routed rows of 32, each through one of 4 experts' [32, 64]: out [24, 64] x 32
    "aten::_grouped_mm": ([[24, 32], [4, 32, 64]], [24, 64], 24 * 64 * 32),
    "aten::_int_mm": ([[3, 4], [4, 5]], [3, 5], 60),
    "aten::_weight_int8pack_mm": ([[3, 4], [5, 4]], [3, 5], 3 * 4 * 5),  # x [m, k], w [n, k]
}


def _macs(op, shapes, out):
    """The table's MACs of one call: its operands picked by position, as the backends pick them."""
    product = PRODUCTS[op]
    a, b = (shapes[i] for i in product.operands)
    return product.macs(a, b, out)


def test_cases_cover_every_product_with_a_mac_function():
    assert set(CASES) == {op for op, product in PRODUCTS.items() if product.macs is not None}
    # the rest are counted by a backend (einsum's equation, a convolution's geometry, a packed weight)
    assert {op for op, product in PRODUCTS.items() if product.macs is None} >= {
        "aten::einsum", "aten::bilinear", "aten::tensordot", "aten::_scaled_mm", "aten::conv2d",
        "quantized::linear_dynamic"}


@pytest.mark.parametrize("op", sorted(CASES))
def test_macs_from_shapes(op):
    shapes, out, expected = CASES[op]
    assert _macs(op, shapes, out) == expected
    assert isinstance(_macs(op, shapes, out), int)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([3, 4], [4, 5], 60),
        ([2, 1, 3, 4], [5, 4, 6], 2 * 5 * 3 * 4 * 6),  # batch dimensions broadcast: (2, 1) with (5,)
        ([2, 3, 4], [4, 5], 2 * 3 * 4 * 5),  # a matrix against a batch
        ([7], [7], 7),  # 1-D @ 1-D: a dot product
        ([4], [4, 5], 4 * 5),  # 1-D @ 2-D: one row
        ([3, 4], [4], 3 * 4),  # 2-D @ 1-D: one column
    ],
)
def test_matmul_shapes(a, b, expected):
    assert PRODUCTS["aten::matmul"].macs(a, b, ()) == expected


def test_grouped_mm_shapes():
    grouped = PRODUCTS["aten::_grouped_mm"].macs
    # 2D x 2D: [m, K] @ [K, n] split along K into groups (weight gradients): m * K * n, whatever the output
    assert grouped([6, 40], [40, 8], [4, 6, 8]) == 6 * 40 * 8
    # 2D x 3D (the output decides: each of its elements is one row against one column of a group)
    assert grouped([24, 32], [4, 32, 64], [24, 64]) == 49_152
    assert grouped([24, 32], [4, 32, 64], [12, 64]) == 12 * 64 * 32  # the rows the output holds, not a's
    # 3D x 3D: a batch of groups
    assert grouped([4, 6, 32], [4, 32, 64], [4, 6, 64]) == 4 * 6 * 64 * 32


def test_attention_macs():
    # QK^T [1, 2, 5, 8] @ [1, 2, 8, 7] and AV [1, 2, 5, 7] @ [1, 2, 7, 8]: 2 heads x 5 queries x 7 keys x (8 + 8)
    assert attention_macs([1, 2, 5, 8], [1, 2, 7, 8], [1, 2, 7, 8]) == 2 * 5 * 7 * 16 == 1120
    # grouped-query: per query head (4), whatever the key/value heads (2)
    assert attention_macs([1, 4, 5, 8], [1, 2, 7, 8], [1, 2, 7, 8]) == 4 * 5 * 7 * 16
    # a value head of another width: QK^T over 8, AV over 16
    assert attention_macs([3, 2, 5, 8], [3, 2, 7, 8], [3, 2, 7, 16]) == 3 * 2 * 5 * 7 * (8 + 16)


# --- the fused-attention sets, the scope helpers, opaque ops ------------------------------------------


def test_sdpa_ops_are_fused_attention():
    assert SDPA_OPS < FUSED_ATTENTION_OPS
    assert "aten::scaled_dot_product_attention" in SDPA_OPS
    backward = {op for op in FUSED_ATTENTION_OPS if op.endswith("_backward")}
    assert backward and not backward & SDPA_OPS  # backward kernels are cores, but do not take (q, k, v) first
    assert all(is_fused(op) for op in FUSED_ATTENTION_OPS) and not is_fused("aten::bmm")
    assert not FUSED_ATTENTION_OPS & set(PRODUCTS)


def test_unsupported_products_have_no_mac_function():
    for op in MATMUL_LIKE_UNSUPPORTED & set(PRODUCTS):
        assert PRODUCTS[op].macs is None, op


def test_ancestors_and_short():
    assert ancestors("a.b.c") == ["a.b.c", "a.b", "a", ""]
    assert ancestors("encoder") == ["encoder", ""]
    assert ancestors("") == [""]
    assert short("aten::mm") == "mm"
    assert short("quantized::linear_dynamic") == "linear_dynamic"
    assert short("prim::PythonOp.Scores") == "PythonOp.Scores"
    assert short("mm") == "mm"


def test_opaque_lists_the_python_ops():
    raw = RawCount(total=0, records=[], by_module={}, unsupported_ops=Counter({
        "prim::PythonOp._Scores": 2, "aten::gelu": 4, "prim::PythonOp.Cumulation": 1, "aten::_trilinear": 1}))
    assert raw.opaque == ["prim::PythonOp.Cumulation", "prim::PythonOp._Scores"]
    assert RawCount(total=0, records=[], by_module={}, unsupported_ops=Counter({"aten::gelu": 1})).opaque == []


# --- the backends' extras: exactly the table ops they claim ---------------------------------------------


class _Value:
    """What a fvcore handle reads of a traced value: its complete type's sizes."""

    def __init__(self, *sizes: int) -> None:
        self._sizes = list(sizes)

    def type(self) -> "_Value":
        return self

    def sizes(self) -> list[int]:
        return self._sizes


#: The table ops fvcore does not count itself, so the fvcore backend hands them to the table.
FVCORE_TABLE_OPS = {"aten::baddbmm", "aten::addbmm", "aten::mv", "aten::addmv", "aten::dot", "aten::vdot", "aten::addr",
                    "aten::_grouped_mm", "aten::_int_mm", "aten::_weight_int8pack_mm"}


def test_fvcore_extra_handles_cover_exactly_what_they_claim():
    from pytest_attncost.counting.jit import EXTRA_HANDLES

    assert set(EXTRA_HANDLES) == SDPA_OPS | FVCORE_TABLE_OPS | {"aten::einsum"}
    assert all(PRODUCTS[op].macs is not None for op in FVCORE_TABLE_OPS)
    # the trace's inputs, as the op takes them (scalars beta and alpha after the matrices)
    calls = {
        "aten::vdot": ([_Value(7), _Value(7)], _Value(), 7),
        "aten::addr": ([_Value(3, 5), _Value(3), _Value(5), _Value(), _Value()], _Value(3, 5), 15),
        "aten::_int_mm": ([_Value(3, 4), _Value(4, 5)], _Value(3, 5), 60),
        "aten::_weight_int8pack_mm": ([_Value(3, 4), _Value(5, 4), _Value(5)], _Value(3, 5), 60),
        "aten::_grouped_mm": ([_Value(24, 32), _Value(4, 32, 64), _Value(4), _Value(), _Value()], _Value(24, 64),
                              24 * 32 * 64),
        "aten::baddbmm": ([_Value(2, 3, 5), _Value(2, 3, 4), _Value(2, 4, 5), _Value(), _Value()],
                          _Value(2, 3, 5), 120),
        "aten::addbmm": ([_Value(3, 5), _Value(2, 3, 4), _Value(2, 4, 5), _Value(), _Value()], _Value(3, 5), 120),
        "aten::mv": ([_Value(3, 4), _Value(4)], _Value(3), 12),
        "aten::addmv": ([_Value(3), _Value(3, 4), _Value(4), _Value(), _Value()], _Value(3), 12),
        "aten::dot": ([_Value(7), _Value(7)], _Value(), 7),
    }
    assert set(calls) == FVCORE_TABLE_OPS
    for op, (inputs, output, expected) in calls.items():
        assert EXTRA_HANDLES[op](inputs, [output]) == expected, op
    qkv = [_Value(1, 2, 5, 8), _Value(1, 2, 7, 8), _Value(1, 2, 7, 8)]
    for op in SDPA_OPS:  # (q, k, v, mask, dropout, causal, ...): only the first three are read
        assert EXTRA_HANDLES[op]([*qkv, _Value(), _Value()], [_Value(1, 2, 5, 8)]) == 2 * 5 * 7 * 16, op


#: The table ops torch's FLOP registry lacks, which the torch backend takes from the table.
TORCH_TABLE_OPS = {"_grouped_mm", "mv", "addmv", "dot", "vdot", "addbmm", "addr", "_int_mm", "_weight_int8pack_mm"}
TORCH_SDPA = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable"}
QUANTIZED = {"linear_dynamic", "linear", "linear_relu", "linear_relu_dynamic", "linear_dynamic_fp16"}


def test_torch_backend_extra_formulas_cover_exactly_what_they_claim():
    from pytest_attncost.counting.dispatch import _extra_formulas

    formulas = _extra_formulas()
    present = {name for name in TORCH_TABLE_OPS if hasattr(torch.ops.aten, name)}
    sdpa = {name + suffix for name in TORCH_SDPA for suffix in ("", "_backward")
            if hasattr(torch.ops.aten, name + suffix)}
    quantized = {name for name in QUANTIZED if hasattr(torch.ops.quantized, name)}
    assert {str(packet) for packet in formulas} == (
        {f"aten.{name}" for name in present | sdpa} | {f"quantized.{name}" for name in quantized})
    # every optional op this torch has (_grouped_mm is torch >= 2.8's)
    assert present == TORCH_TABLE_OPS - ({"_grouped_mm"} if not hasattr(torch.ops.aten, "_grouped_mm") else set())
    assert all(PRODUCTS[f"aten::{name}"].macs is not None for name in TORCH_TABLE_OPS)

    def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(shape, device="meta", dtype=dtype)

    # FLOPs, 2 per MAC, from the op's own arguments
    calls = {
        "mv": ((meta(3, 4), meta(4)), meta(3), 2 * 12),
        "addmv": ((meta(3), meta(3, 4), meta(4)), meta(3), 2 * 12),
        "dot": ((meta(7), meta(7)), meta(), 2 * 7),
        "vdot": ((meta(7), meta(7)), meta(), 2 * 7),
        "addbmm": ((meta(3, 5), meta(2, 3, 4), meta(2, 4, 5)), meta(3, 5), 2 * 120),
        "addr": ((meta(3, 5), meta(3), meta(5)), meta(3, 5), 2 * 15),
        "_int_mm": ((meta(3, 4, dtype=torch.int8), meta(4, 5, dtype=torch.int8)),
                    meta(3, 5, dtype=torch.int32), 2 * 60),
        "_weight_int8pack_mm": ((meta(3, 4), meta(5, 4, dtype=torch.int8), meta(5)), meta(3, 5), 2 * 60),
        "_grouped_mm": ((meta(24, 32), meta(4, 32, 64)), meta(24, 64), 2 * 49_152),
    }
    assert set(calls) == TORCH_TABLE_OPS
    for name, (args, out, expected) in ((name, call) for name, call in calls.items() if name in present):
        assert formulas[getattr(torch.ops.aten, name)](*args, out_val=out) == expected, name
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    assert formulas[forward](meta(1, 2, 5, 8), meta(1, 2, 7, 8), meta(1, 2, 7, 8), out_val=None) == 2 * 1120


# --- how each backend counts each product: one field of the table, a reason for every op ----------------

#: How the jit trace shows a product fvcore's own handles count under another name.
TRACED_AS = {**{f"aten::{name}": "aten::_convolution" for name in (
    "convolution", "convolution_backward", "_slow_conv2d_forward", "cudnn_convolution", "convolution_overrideable",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")},
    # the twin stands a meta nn.Linear in for a dynamically quantized Linear (counting.twin)
    **{op: "aten::linear" for op in PRODUCTS if op.startswith("quantized::")}}
#: Products torch never dispatches: FakeTensorMode sees what they decompose into (mm, bmm, convolution).
DECOMPOSED = {"aten::linear", "aten::matmul", "aten::einsum", "aten::tensordot", "aten::conv1d", "aten::conv2d",
              "aten::conv3d", "aten::conv_transpose1d", "aten::conv_transpose2d", "aten::conv_transpose3d"}


def test_every_product_says_how_each_backend_counts_it():
    from torch.utils.flop_counter import FlopCounterMode

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fvcore scripts a function at import time
        from fvcore.nn.flop_count import _DEFAULT_SUPPORTED_OPS

    registry = {str(packet).replace(".", "::", 1) for packet in FlopCounterMode(display=False).flop_registry}
    for op, product in PRODUCTS.items():
        assert {product.fvcore, product.torch} <= {LIBRARY, TABLE, OURS, UNCOUNTED}, op
        if TABLE in (product.fvcore, product.torch):
            assert product.macs is not None, op
        if product.fvcore == LIBRARY:
            assert TRACED_AS.get(op, op) in _DEFAULT_SUPPORTED_OPS, op
        if product.torch == LIBRARY:
            assert op in registry or op in DECOMPOSED, op
    assert counted_by("fvcore", OURS) == ["aten::einsum"]  # exact: fvcore's own rounds to 4 digits
    assert set(counted_by("torch", OURS)) == set(TRACED_AS) - {op for op in TRACED_AS if op.startswith("aten::")}
    # what neither backend counts is flagged as a skipped product, never missed in silence
    uncounted = {*counted_by("fvcore", UNCOUNTED), *counted_by("torch", UNCOUNTED)}
    assert uncounted == {"aten::bilinear", "aten::tensordot", "aten::_scaled_mm"}
    assert uncounted <= MATMUL_LIKE_UNSUPPORTED


class _Weighted(torch.nn.Module):
    """One product of an input with a parameter (and another tensor the op takes)."""

    def __init__(self, run, weight, extra=None):
        super().__init__()
        self.run = run
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.extra = torch.nn.Parameter(extra, requires_grad=False) if extra is not None else None

    def forward(self, *inputs):
        return self.run(self, *inputs)


def _int8(*shape):
    return torch.zeros(shape, dtype=torch.int8)


#: The five products neither library counts, each in a tiny model: (model, inputs, MACs by hand).
FIVE = {
    "aten::vdot": (lambda: _Weighted(lambda m, x: torch.vdot(x, m.weight), torch.zeros(7)), (torch.zeros(7),), 7),
    # the outer product u v^T [3, 5], accumulated into the parameter
    "aten::addr": (lambda: _Weighted(lambda m, u: torch.addr(m.extra, u, m.weight), torch.zeros(5), torch.zeros(3, 5)),
                   (torch.zeros(3),), 3 * 5),
    "aten::_int_mm": (lambda: _Weighted(lambda m, x: torch._int_mm(x, m.weight), _int8(32, 16)), (_int8(17, 32),),
                      17 * 32 * 16),
    # x [3, 4] against the int8 weight [5, 4] (rows are outputs), scaled per output
    "aten::_weight_int8pack_mm": (
        lambda: _Weighted(lambda m, x: torch._weight_int8pack_mm(x, m.weight, m.extra), _int8(5, 4), torch.zeros(5)),
        (torch.zeros(3, 4),), 3 * 4 * 5),
    # 24 routed rows of 32, 6 to each of 4 experts' [32, 64]
    "aten::_grouped_mm": (
        lambda: _Weighted(lambda m, x, offs: torch._grouped_mm(x, m.weight, offs=offs),
                          torch.zeros(4, 32, 64, dtype=torch.bfloat16)),
        (torch.zeros(24, 32, dtype=torch.bfloat16), torch.tensor([6, 12, 18, 24], dtype=torch.int32)), 24 * 32 * 64),
}


@pytest.mark.parametrize("backend", ["fvcore", "torch"])
@pytest.mark.parametrize("op", sorted(FIVE))
def test_products_no_library_counts_are_counted_on_both_backends(op, backend):
    from pytest_attncost.counting import count_forward, count_forward_torch, meta_twin
    from pytest_attncost.inputs import to_meta

    if not hasattr(torch.ops.aten, short(op)):
        pytest.skip(f"torch {torch.__version__} has no {op}")
    assert (PRODUCTS[op].fvcore, PRODUCTS[op].torch) == (TABLE, TABLE)
    make, inputs, expected = FIVE[op]
    raw = (count_forward if backend == "fvcore" else count_forward_torch)(meta_twin(make()), to_meta(inputs), {})
    assert raw.total == expected
    assert [(r.op, r.macs) for r in raw.records] == [(op, expected)]
    assert not raw.unsupported_ops
