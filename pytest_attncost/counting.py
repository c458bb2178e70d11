"""Count one forward pass with fvcore, on a meta-device twin, keeping a record of every op.

fvcore's ``FlopCountAnalysis`` does the counting; this module adds what it lacks:

* handles for fused attention (``aten::scaled_dot_product_attention`` and the
  kernels it dispatches to), which fvcore logs as unsupported and counts as zero;
* handles for a few more matrix products (``baddbmm``, ``addbmm``, ``mv``, ...);
* a record per op (module scope, MACs, shapes, whether an operand is a
  parameter), so that :mod:`pytest_attncost.roles` can split the count;
* a twin of the model whose parameters and buffers live on the meta device:
  the user's model is never run, moved or hooked, and no arithmetic is done.
"""

from __future__ import annotations

import contextlib
import copy
import math
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
    "count_forward",
    "meta_twin",
]


class CountError(ValueError):
    """Counting failed; the message names the problem and the fix."""


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
    """

    op: str
    scope: str
    macs: int
    origin: str
    shapes: tuple[tuple[int, ...], ...]
    out_shape: tuple[int, ...] = ()


@dataclass
class RawCount:
    """What one trace produced, before the split into roles."""

    total: int
    records: list[OpRecord]
    unsupported_ops: Counter[str]
    by_module: dict[str, int]
    module_names: dict[str, str] = field(default_factory=dict)  # name -> class name


class _TraceContext:
    def __init__(self) -> None:
        self.records: list[OpRecord] = []
        self.n_user_inputs = 0
        self.state_is_param: list[bool] = []

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
        ctx.records.append(
            OpRecord(op=op, scope=_scope_of(out.node()), macs=count, origin=origin, shapes=shapes, out_shape=out_shape)
        )
        return value

    return wrapped


# --- the twin ----------------------------------------------------------------------------


def meta_twin(model: nn.Module) -> nn.Module:
    """A deep copy of *model* whose parameters and buffers are empty meta tensors.

    The copy shares nothing with the original: tied weights stay tied to each
    other, the ``training`` flags are kept, and every hook is dropped (the user's
    hooks must neither fire during counting nor be copied into the count).
    """
    memo: dict[int, Any] = {}
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


def count_forward(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> RawCount:
    """Trace ``model(*args, **kwargs)`` with fvcore and return every op's record.

    *model* must already be a twin (see :func:`meta_twin`): it is hooked and traced.

    Raises:
        CountError: the tracer could not run the model; the message carries its reason.
    """
    flop_count_analysis = _flop_count_analysis()
    from fvcore.nn.flop_count import _DEFAULT_SUPPORTED_OPS

    harness = _Harness(model, args, kwargs)
    ctx = _TraceContext()
    inputs = harness.trace_inputs()
    ctx.n_user_inputs = len(inputs)
    state = torch.jit._unique_state_dict(harness, keep_vars=True)  # the order the tracer uses
    ctx.state_is_param = [isinstance(t, nn.Parameter) for t in state.values()]

    analysis = flop_count_analysis(harness, inputs)
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False).tracer_warnings("none")
    handles = {**_DEFAULT_SUPPORTED_OPS, **EXTRA_HANDLES}
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
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_efficient_attention_backward",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_cudnn_attention_backward",
        "aten::_flash_attention_forward",
        "aten::_flash_attention_backward",
        "aten::_efficient_attention_forward",
        "aten::_efficient_attention_backward",
    }
)
# Products with a weight operand, as torch dispatches a linear layer (forward: addmm/mm with
# W^T; backward: mm for the input's and the weight's gradients).
_WEIGHT_PRODUCTS = frozenset({"aten::mm", "aten::addmm", "aten::convolution", "aten::_convolution",
                              "aten::convolution_backward", "aten::_slow_conv2d_forward", "aten::cudnn_convolution",
                              "aten::convolution_overrideable", "aten::_scaled_mm"})


def _innermost(parents: Any, root: str) -> str:
    names = [p for p in parents if p == root or p.startswith(root + ".")]
    if not names:
        return ""
    name = max(names, key=lambda p: p.count("."))
    return "" if name == root else name[len(root) + 1 :]


def _torch_recording(op: str, formula: Any, counter: Any, root: str, records: list[OpRecord]) -> Any:
    def wrapped(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        flops = formula(*args, out_val=out_val, **kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        out = out_val[0] if isinstance(out_val, (tuple, list)) else out_val
        origin = "param" if op in _WEIGHT_PRODUCTS else "activation"
        records.append(OpRecord(
            op=op, scope=_innermost(counter.mod_tracker.parents, root), macs=int(flops) // 2, origin=origin,
            shapes=tuple(tuple(t.shape) for t in tensors[:3]),
            out_shape=tuple(out.shape) if isinstance(out, torch.Tensor) else (),
        ))
        return flops

    return wrapped


def count_forward_torch(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, train: bool = False, fake: bool = True
) -> RawCount:
    """Count with torch's ``FlopCounterMode`` at the dispatcher, on fake tensors (no memory, no arithmetic).

    *model* must be a twin. With ``train=True`` a real backward runs too (of the sum of the
    outputs), so backward products are counted as executed. FLOPs are halved into MACs.

    Raises:
        CountError: the model could not run on fake tensors; the message carries the reason.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    root = type(model).__name__
    records: list[OpRecord] = []
    counter = FlopCounterMode(display=False)
    custom = {}
    for packet, formula in flop_registry.items():
        op = str(packet).replace(".", "::", 1)
        # registry formulas take raw arguments (torch wraps them to read shapes)
        custom[packet] = _torch_recording(op, formula, counter, root, records)
    counter.flop_registry = {**counter.flop_registry, **custom}
    # Fake tensors, not bare meta ones: transformers skips its value checks for them (as under a tracer).
    mode: Any = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.random.fork_rng(devices=[]), mode:
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
                    torch.stack([t.sum() for t in grads]).sum().backward()
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
    by_module: dict[str, int] = {}
    for name, ops in counter.get_flop_counts().items():
        if name == root or name.startswith(root + "."):
            by_module["" if name == root else name[len(root) + 1 :]] = sum(ops.values()) // 2
    classes = {name: type(module).__name__ for name, module in model.named_modules()}
    return RawCount(total=sum(r.macs for r in records), records=records, unsupported_ops=Counter(),
                    by_module=by_module, module_names=classes)

