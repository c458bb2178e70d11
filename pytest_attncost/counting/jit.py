"""The fvcore backend: ``FlopCountAnalysis`` traces the twin with ``torch.jit``, and a record is kept of every op
it counts. Added here: handles for fused attention (fvcore counts 0) and the op table's products fvcore lacks, an
exact einsum (docs/conventions.md), and a mask label on every attention product, read from the traced graph."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from numbers import Number
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .. import ops
from ..errors import CountError, hint, site
from ..errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from ..families import traceable
from ..ops import PRODUCTS, SDPA_OPS, OpRecord, RawCount, is_product, short
from . import masks, repeats
from .flex import new_trace, traced_keeps
from .masks import SCORE_MASKING, SCORE_PASS, Pattern, combine, mask_transfer, masking_label, score_op, sdpa_label
from .repeats import NotRepeating, Repeats, Run, copied
from .twin import all_meta, drop_hooks, meta_autocast, no_global_hooks, refuse_scripted, tensor_leaves

__all__ = ["EXTRA_HANDLES", "count_forward"]


def _shape(value: Any) -> list[int]:
    """Static shape of a traced tensor value (the trace records complete types)."""
    return [int(s) for s in value.type().sizes()]


def _from_table(op: str) -> Callable[[list[Any], list[Any]], int]:
    """A handle for *op* from the op table's MACs of its operands' shapes."""
    product = PRODUCTS[op]
    assert product.macs is not None

    def handle(inputs: list[Any], outputs: list[Any]) -> int:
        a, b = (_shape(inputs[i]) for i in product.operands)
        return product.macs(a, b, _shape(outputs[0]))  # type: ignore[misc]

    return handle


def _sdpa_macs(inputs: list[Any], outputs: list[Any]) -> int:
    q, k, v = (_shape(value) for value in inputs[:3])
    return ops.attention_macs(q, k, v)


def _einsum_macs(inputs: list[Any], outputs: list[Any]) -> int:
    """Exactly what torch runs: its own einsum on empty meta operands, under its FLOP counter (fvcore's handle
    rounds to 4 significant digits: 16,778,000 for 16,777,216)."""
    from torch.utils.flop_counter import FlopCounterMode
    equation = inputs[0].toIValue()
    listed = inputs[1].node()
    if listed.kind() != "prim::ListConstruct" or not isinstance(equation, str):
        raise CountError("einsum with operands the trace does not list; cannot count it")
    operands = [torch.empty(_shape(v), device="meta") for v in listed.inputs()]
    with no_global_hooks(), FlopCounterMode(display=False) as counter:
        torch.einsum(equation, *operands)
    return int(counter.get_total_flops()) // 2


Handle = Callable[[list[Any], list[Any]], Any]


#: What fvcore does not count itself (or counts inexactly: its einsum rounds), by op: fused attention, and the
#: products the op table says fvcore counts from the table or by a handle of ours.
EXTRA_HANDLES: dict[str, Handle] = {
    **{op: _sdpa_macs for op in SDPA_OPS},
    **{op: _from_table(op) for op in ops.counted_by("fvcore", ops.TABLE)},
    **{op: {"aten::einsum": _einsum_macs}[op] for op in ops.counted_by("fvcore", ops.OURS)},
}


class _TraceContext:
    """What the handles of one trace share: the records, and which graph inputs are the model's state."""

    def __init__(self, harness: nn.Module, n_user_inputs: int, buffer_masks: Mapping[str, Pattern] | None) -> None:
        self.records: list[OpRecord] = []
        self.n_user_inputs = n_user_inputs
        state = torch.jit._unique_state_dict(harness, keep_vars=True)  # the order the tracer uses
        self.state_is_param = [isinstance(t, nn.Parameter) for t in state.values()]
        self.state_names = list(state)
        self.buffer_masks: Mapping[str, Pattern] = buffer_masks or {}
        self.masks = _GraphMasks(self)
        self.produced: dict[str, int] = {}  # value name -> the index of the product record that made it
        self.reach: dict[str, frozenset[int]] = {}  # value name -> the products whose results reach it
        self.derived: dict[str, bool] = {}  # value name -> computed from parameters alone (from_parameters)

    def sources(self, values: list[Any]) -> tuple[int, ...]:
        """The products whose results reach *values* through ops that are no products (memoised per value)."""
        return tuple(sorted(frozenset[int]().union(*map(self._reach, values))))

    def _reach(self, start: Any) -> frozenset[int]:
        memo, stack = self.reach, [start]
        while stack:  # iterative: a residual stream is a long chain of additions
            value = stack[-1]
            key = value.debugName()
            if key in self.produced and key not in memo:
                memo[key] = frozenset((self.produced[key],))
            if key in memo:
                stack.pop()
                continue
            node = value.node()
            # values only: a size read off a tensor (aten::size feeding a view), a mask or an index carries no
            # product's result
            data = node.kind() not in ("prim::Param", "prim::Constant") and _floating(value)
            inputs = [item for item in node.inputs() if _holds_tensors(item.type())] if data else []
            names = [item.debugName() for item in inputs]
            pending = [item for item, name in zip(inputs, names) if name not in memo]
            if pending:
                stack.extend(pending)
                continue
            reached = [memo[name] for name in names]
            memo[key] = reached[0] if len(reached) == 1 else frozenset().union(*reached)
            stack.pop()
        return memo[start.debugName()]

    def made(self, index: int, outputs: list[Any]) -> None:
        """The outputs of a product (record *index*): where the walk back from a later operand stops."""
        self.produced.update((value.debugName(), index) for value in outputs)

    def _state(self, value: Any) -> int | None:
        """The index in the state of a graph input that is state (None: one of the user's inputs)."""
        index = value.offset() - self.n_user_inputs
        return index if 0 <= index < len(self.state_names) else None

    def state_name(self, value: Any) -> str | None:
        """The dotted name (relative to the user's model) of a graph input that is state."""
        index = self._state(value)
        return None if index is None else self.state_names[index].removeprefix("model.")

    def origin_of(self, value: Any) -> str:
        """Follow views back to a graph input: a parameter, a buffer, or an activation."""
        for _ in range(64):
            node = value.node()
            if node.kind() == "prim::Param":
                index = self._state(value)
                return "activation" if index is None else "param" if self.state_is_param[index] else "buffer"
            if short(node.kind()) not in ops.VIEW_OPS:
                return "activation"
            value = next(iter(node.inputs()))
        return "activation"

    def from_parameters(self, start: Any) -> bool:
        """Whether *start* is computed from parameters alone, by ops that multiply no matrices (a parametrized
        weight: weight_norm's g and v), no input of the model's reaching it (memoised; a walk of over 256 values
        is no weight)."""
        key = start.debugName()
        if key in self.produced:  # a product's result (XLNet's positions x its weight r): no weight
            return False
        if key not in self.derived:
            seen, stack, found, alone = {key}, [start], False, True
            while stack and alone:
                node = stack.pop().node()
                if node.kind() in _LOOKUPS:  # rows looked up in a table (SpeechT5's relative positions): as the
                    alone = False  # torch backend sees them, an activation, not a weight
                    break
                for item in node.inputs():
                    name = item.debugName()
                    if "Tensor" not in str(item.type()) or name in seen:
                        continue
                    seen.add(name)
                    if item.node().kind() == "prim::Param":
                        index = self._state(item)
                        param = index is not None and self.state_is_param[index]
                        found, alone = found or param, alone and param
                    elif self.derived.get(name) is False or len(seen) > 256 or name in self.produced:
                        alone = False  # a product's result reaches it: an activation
                    else:
                        stack.append(item)
            self.derived[key] = found and alone
        return self.derived[key]


#: Ops that look rows up in a table: what they make from a parameter is no weight of a product.
_LOOKUPS = frozenset({"aten::embedding", "aten::embedding_bag", "aten::index_select", "aten::index", "aten::gather",
                      "aten::take", "aten::take_along_dim"})
_NOT_VALUES = frozenset({"Bool", "Byte", "Char", "Short", "Int", "Long"})
#: Kinds of jit type that never hold a tensor (what ``str`` of them never names): no need to print them.
_SCALAR_KINDS = frozenset({"IntType", "FloatType", "BoolType", "StringType", "NoneType", "DeviceObjType",
                           "NumberType", "ComplexType", "SymIntType", "SymFloatType", "SymBoolType"})


def _holds_tensors(kind: Any) -> bool:
    """A tensor, or a list, tuple or optional of tensors (its printed type names one)."""
    name = kind.kind()
    return name == "TensorType" or (name not in _SCALAR_KINDS and "Tensor" in str(kind))


def _floating(value: Any) -> bool:
    """Not a tensor of booleans or integers (masks, indices), as far as the trace tells."""
    kind = value.type()
    return kind.kind() != "TensorType" or kind.scalarType() not in _NOT_VALUES


def _scope_of(node: Any) -> str:
    """The harness names the model ``model``; report names relative to the user's model."""
    name = node.scopeName().split("/")[-1]
    return "" if name == "model" else name.removeprefix("model.")


def _operands(op: str, inputs: list[Any]) -> list[Any]:
    product = PRODUCTS.get(op)
    if product is None:
        return list(inputs[:3]) if op in SDPA_OPS else []
    if op == "aten::einsum":
        listed = inputs[1].node()
        return list(listed.inputs()) if listed.kind() == "prim::ListConstruct" else []
    return [inputs[i] for i in product.operands if i < len(inputs)]


def _sourced(op: str, inputs: list[Any], tensors: list[Any]) -> list[Any]:
    """The operands whose sources a record keeps: a fused attention's mask too (Doge's is made by a product of
    the attention from its values), as the torch backend keeps every tensor argument's."""
    return [*tensors, *(v for v in inputs[3:4] if _is_tensor(v))] if op in SDPA_OPS else tensors


def _recording(op: str, handle: Handle, ctx: _TraceContext) -> Handle:
    def wrapped(inputs: list[Any], outputs: list[Any]) -> Any:
        value = handle(inputs, outputs)
        macs = sum(value.values()) if isinstance(value, Mapping) else value
        if not isinstance(macs, Number):
            raise CountError(f"the handle for {op} returned {value!r}, not a number")
        operands = _operands(op, inputs)
        tensors = [v for v in operands if _is_tensor(v)]
        origins = [ctx.origin_of(v) for v in tensors]
        if is_product(op) and all(found == "activation" for found in origins):  # a weight computed (weight_norm)?
            origins = ["param" if ctx.from_parameters(v) else found for v, found in zip(tensors, origins)]
        origin = "param" if "param" in origins else "buffer" if "buffer" in origins else "activation"
        masked = op in SDPA_OPS or (origin == "activation" and is_product(op))
        product, out = is_product(op) or op in SDPA_OPS, outputs[0]
        ctx.records.append(OpRecord(
            op=op, scope=_scope_of(out.node()), macs=int(round(float(macs))),  # type: ignore[arg-type]  # int or float
            origin=origin, shapes=tuple(tuple(_shape(v)) for v in tensors if v.isCompleteTensor()),
            out_shape=tuple(_shape(out)) if _is_tensor(out) and out.isCompleteTensor() else (),
            mask=ctx.masks.label(op, inputs, outputs, operands) if masked else "",
            sources=tuple(ctx.sources([v]) for v in _sourced(op, inputs, tensors)) if product else (),
            weights=sum(math.prod(_shape(v)) for v, found in zip(tensors, origins) if found == "param"
                        and v.isCompleteTensor()),
            keeps=traced_keeps(out.node().sourceRange()) if op in SDPA_OPS else None,  # a FlexAttention core's
        ))
        if product:
            ctx.made(len(ctx.records) - 1, outputs)
        return value

    return wrapped


def _is_tensor(value: Any) -> bool:
    return value.type().kind() == "TensorType"


class _GraphMasks:
    """Evaluates mask patterns over the traced graph (jit Values), memoised per value."""

    def __init__(self, ctx: _TraceContext) -> None:
        self.ctx = ctx
        self.memo: dict[Any, Any] = {}

    def abstract(self, value: Any) -> Any:
        """A constant, a Pattern, or None."""
        if value.node().kind() == "prim::Constant":
            try:
                return value.toIValue()
            except Exception:  # noqa: BLE001 - a constant the binding cannot convert
                return None
        return self.pattern(value) if _is_tensor(value) else None

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
            result = mask_transfer(short(node.kind()), [
                self.abstract(item) if item.node().kind() == "prim::Constant" or not _is_tensor(item)
                else self.pattern(item, depth + 1) for item in node.inputs()])
        self.memo[key] = result
        return result

    def masking(self, node: Any, flow: int) -> str:
        return masking_label(score_op(short(node.kind())), [self.abstract(v) for v in node.inputs()], flow)

    def after(self, value: Any, depth: int = 0) -> list[str]:
        """Labels of the masks applied to scores *value* on their way forward (QK^T -> softmax)."""
        labels: list[str] = []
        if depth > 16:
            return labels
        for use in value.uses():
            user = use.user
            op = score_op(short(user.kind()))
            if op in SCORE_MASKING:
                labels.append(self.masking(user, use.offset))
            elif op not in SCORE_PASS or use.offset != 0 and op not in ("mul", "div"):
                continue
            labels += self.after(user.outputsAt(0), depth + 1)
        return labels

    def before(self, value: Any, depth: int = 0) -> tuple[list[str], bool]:
        """Labels of the masks applied to an operand on its way back (AV <- softmax <- mask <- QK^T),
        and whether it comes from scores (a product of two activations) at all."""
        node = value.node()
        kind = node.kind()
        op = score_op(short(kind))
        if depth > 16:
            return [], False
        if is_product(kind):
            operands = [v for v in _operands(kind, list(node.inputs())) if _is_tensor(v)]
            return [], bool(operands) and all(self.ctx.origin_of(v) == "activation" for v in operands)
        if op in SCORE_MASKING:
            inputs = list(node.inputs())
            for flow in {"masked_fill": [0], "add": [0, 1], "where": [1, 2]}[op]:
                if flow < len(inputs) and _is_tensor(inputs[flow]) and inputs[flow].node().kind() != "prim::Constant":
                    labels, scores = self.before(inputs[flow], depth + 1)
                    if scores:
                        return [self.masking(node, flow), *labels], True
            return [], False
        if op not in SCORE_PASS:
            return [], False
        inputs = [v for v in node.inputs() if _is_tensor(v) and v.node().kind() != "prim::Constant"]
        if not inputs:
            return [], False
        return self.before(max(inputs, key=lambda v: len(_shape(v)) if v.isCompleteTensor() else 0), depth + 1)

    def label(self, op: str, inputs: list[Any], outputs: list[Any], operands: list[Any]) -> str:
        if op in SDPA_OPS:
            named = dict(zip(masks.argument_names(op), inputs))
            flag, mask = named.get("is_causal"), named.get("attn_mask", named.get("attn_bias"))
            is_causal = (False if flag is None else self.abstract(flag) if flag.node().kind() == "prim::Constant"
                         else ops.MASK_UNKNOWN)  # a flag computed in the trace (not a constant) cannot be told
            if mask is None or mask.node().kind() == "prim::Constant" or not _is_tensor(mask):
                return sdpa_label(is_causal, False, None, None)
            return sdpa_label(is_causal, True, self.pattern(mask), mask.type().scalarType() == "Bool")
        found = [self.before(operand) for operand in operands]
        labels = [label for applied, _ in found for label in applied]
        if not any(scores for _, scores in found) and outputs:  # no operand holds scores or probabilities: QK^T
            labels += self.after(outputs[0])
        return combine(labels)


class _Harness(nn.Module):
    """Calls the twin with the user's args and kwargs; returns flat tensors the tracer accepts: every submodule's
    tensor outputs too, so that the tracer's dead-code elimination keeps work whose result the model drops."""

    def __init__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.model = model
        self._leaves, self._spec = pytree.tree_flatten((args, kwargs))
        self._positions = [i for i, leaf in enumerate(self._leaves) if isinstance(leaf, torch.Tensor)]
        self._seen: list[torch.Tensor] = []
        self.n_outputs = 0
        for module in model.modules():
            module.register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self._seen += tensor_leaves(output)

    def trace_inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(self._leaves[i] for i in self._positions)

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(self._leaves)
        for position, tensor in zip(self._positions, tensors):
            leaves[position] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        self._seen = []
        outputs = tensor_leaves(self.model(*args, **kwargs))
        self.n_outputs = len(outputs)  # the model's own; the submodules' follow
        return tuple(outputs + self._seen)


@contextlib.contextmanager
def _counting_environment() -> Iterator[None]:
    """Plain kernels, no autograd, no RNG drift, no tracer noise; all restored afterwards."""
    fastpath = torch.backends.mha.get_fastpath_enabled()
    # The fused MultiheadAttention / TransformerEncoderLayer kernels hide whole attention
    # blocks in one op; the plain path runs linear + sdpa, which the handles count exactly.
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), warnings.catch_warnings(), meta_autocast(), \
                traceable():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)


def _fvcore() -> tuple[type, Mapping[str, Handle]]:
    """fvcore's FlopCountAnalysis and its own handles, imported when a count runs."""
    with warnings.catch_warnings():
        # fvcore scripts a function at import time, which torch 2.13 deprecates.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        from fvcore.nn import FlopCountAnalysis  # type: ignore[import-untyped]
        from fvcore.nn.flop_count import _DEFAULT_SUPPORTED_OPS  # type: ignore[import-untyped]
    return FlopCountAnalysis, _DEFAULT_SUPPORTED_OPS


def count_forward(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
    buffer_masks: Mapping[str, Pattern] | None = None,
) -> RawCount:
    """Trace ``model(*args, **kwargs)`` with fvcore and return every op's record.

    *model* must already be a twin (see :func:`meta_twin`): it is hooked and traced. The user's global module hooks are
    set aside meanwhile (they must not fire).

    Args:
        buffer_masks: triangular mask buffers of the original model (see :func:`buffer_masks`), so that
            ``masked_fill(self.tril[:T, :T] == 0, -inf)`` is recognised as causal.

    Raises:
        CountError: the tracer could not run the model; the message carries its reason.
    """
    refuse_scripted(model)
    with no_global_hooks():
        if repeats.SHORTCUT.get() and all_meta(model, (args, kwargs)):
            layers = Repeats(model, on_stub=_aliased_output, masks=buffer_masks)
            if layers:
                try:
                    return _trace(model, args, kwargs, buffer_masks, layers)
                except NotRepeating:
                    drop_hooks(model)  # the harness's (and, after a failed trace, fvcore's) hooks
                finally:
                    layers.undo()
        return _trace(model, args, kwargs, buffer_masks, None)


_MARKER = "<repeat>"  # where a copied layer was called, in graph order
_OUTPUTS = "<outputs>"  # the model's outputs, last: what reaches them (sources move with the copies like any)


def _aliased_output(run: Run, name: str) -> Any:
    """aten::alias leaves a node in the graph at this call, in this layer's scope: the marker where the copied
    records go (and a view, so origins and masks pass through it)."""
    return pytree.tree_map_only(torch.Tensor, torch.ops.aten.alias, run.calls[1][2])


# Where torch implements an op's meta kernel in Python (torch < 2.9: convolutions), the jit trace on the
# meta device records the kernel's shape arithmetic and its empty output in place of the op: its MACs vanish.
_PYTHON_KERNELS = ("torch/_meta_registrations.py", "torch/_refs/", "torch/_prims", "torch/_decomp/")
_KERNEL_OUTPUTS = ("aten::empty", "aten::new_empty", "aten::new_zeros", "aten::zeros")  # ignored by fvcore else
PYTHON_KERNEL = ("torch {version} runs an op in {scope} through a meta kernel written in Python ({where}), which "
                 "the jit trace records in place of the op: fvcore would count it as 0 MAC on the meta device")


def _not_in_a_python_kernel(inputs: list[Any], outputs: list[Any]) -> int:
    """0 MAC, as fvcore ignores the op; an error where it is the output of a meta kernel written in Python."""
    node = outputs[0].node()
    innermost = node.sourceRange().replace("\\", "/").split("\n")[0]  # "path(line): function"
    if any(path in innermost for path in _PYTHON_KERNELS):
        raise CountError(PYTHON_KERNEL.format(version=torch.__version__.split("+")[0],
                                              scope=_scope_of(node) or "the model",
                                              where=innermost.rsplit("/torch/", 1)[-1]))
    return 0


def _handles(analysis: Any, ctx: _TraceContext, harness: _Harness, default_ops: Mapping[str, Handle],
             repeats: Repeats | None) -> tuple[list[tuple[int, ...]], Counter[str]]:
    """Install the handles on *analysis*: every counted op recorded, what reaches the model's outputs kept
    (returned), and with *repeats* the marker of each copied layer (aliases: the model's own)."""
    analysis.set_op_handle(**{op: _recording(op, h, ctx) for op, h in {**default_ops, **EXTRA_HANDLES}.items()})
    returned: list[tuple[int, ...]] = []  # per output of the model

    def outputs_of(inputs: list[Any], outputs: list[Any]) -> int:
        if any(use.user.kind() == "prim::Return" for use in outputs[0].uses()):  # the harness's result
            returned[:] = [ctx.sources([value]) for value in inputs[:harness.n_outputs]]
        return 0

    analysis.set_op_handle(**{"prim::TupleConstruct": outputs_of})
    analysis.set_op_handle(**{op: _not_in_a_python_kernel for op in _KERNEL_OUTPUTS})
    aliases: Counter[str] = Counter()
    if repeats is not None:
        def marker(inputs: list[Any], outputs: list[Any]) -> int:
            scope = _scope_of(outputs[0].node())
            if scope in repeats.stub_of():
                # what the copied layer returns stands for its output: later ops reach the marker, the marker
                # reaches what the second layer's output reached
                ctx.records.append(OpRecord(_MARKER, scope, 0, "activation", (), sources=(ctx.sources(inputs[:1]),)))
                ctx.made(len(ctx.records) - 1, outputs)
            else:
                aliases["aten::alias"] += 1  # the model's own: unsupported, as fvcore reports it
            return 0

        analysis.set_op_handle(**{"aten::alias": marker})
    return returned, aliases


def _trace(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], buffer_masks: Mapping[str, Pattern] | None,
           repeats: Repeats | None) -> RawCount:
    flop_count_analysis, default_ops = _fvcore()
    harness = _Harness(model, args, kwargs)
    inputs = harness.trace_inputs()
    ctx = _TraceContext(harness, len(inputs), buffer_masks)
    analysis = flop_count_analysis(harness, inputs)
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False).tracer_warnings("none")
    returned, aliases = _handles(analysis, ctx, harness, default_ops, repeats)
    with _counting_environment():
        new_trace()
        try:
            total = analysis.total()
        except RecursionError:  # the user's forward recursing without end: their error, no other counter tried
            raise
        except Exception as exc:  # noqa: BLE001 - the tracer's reason is the user's best clue
            if repeats is not None and repeats.stub_of():
                raise NotRepeating from (None if isinstance(exc, CountError) else exc)
            if isinstance(exc, CountError):
                raise
            raise _untraceable(model, exc) from exc
        unsupported = Counter({op: int(c) for op, c in analysis.unsupported_ops().items()})
        by_module_raw = analysis.by_module()
        if repeats is not None:
            repeats.check()
            for run in repeats.stub_of().values():
                unsupported.update(analysis.unsupported_ops(f"model.{run.names[1]}"))
    unsupported.update(aliases)
    # "" is the harness; "model" is the same total, the user's model
    by_module = {"" if name == "model" else name[len("model."):]: int(value)
                 for name, value in by_module_raw.items() if name}
    records = [*ctx.records, OpRecord(_OUTPUTS, "", 0, "activation", (), sources=tuple(returned))]
    if repeats is not None and repeats.stub_of():
        records, extra = _expand_markers(records, repeats, by_module)
        total += extra
    *records, returns = records
    classes = {name: type(module).__name__ for name, module in model.named_modules()}
    copied = tuple(repeats.stub_of()) if repeats is not None else ()
    return RawCount(total=int(total), records=records, unsupported_ops=unsupported, by_module=by_module,
                    module_names=classes, copied_layers=copied, outputs=returns.sources)


def _untraceable(model: nn.Module, exc: Exception) -> CountError:
    """The tracer's failure in the user's words: its reason, and the fix."""
    reason = f"{type(exc).__name__}: {exc}".strip()
    reason = reason[:600] + " ..." if len(reason) > 600 else reason
    if "Storage size calculation overflowed" in reason:
        return CountError(
            f"the length is too large to trace {type(model).__name__}: {reason} (torch cannot "
            "describe a tensor of 2**63 bytes or more, even on the meta device)\n"
            "Fix: use a smaller n, or evaluate the formulas alone: pytest_attncost.model_costs(spec, n) "
            "or python -m pytest_attncost"
        )
    return CountError(f"fvcore could not trace {type(model).__name__} on the meta device{site(exc, model)}: {reason}\n"
                      f"Fix: {hint(reason)}.")


def _placement(records: list[OpRecord], stubs: Mapping[str, Run], second_of: Mapping[str, list[int]]
               ) -> tuple[list[tuple[int, str | None]], dict[int, int], dict[str, list[int]], dict[str, list[str]],
                          dict[int, str]]:
    """Where each record goes once the markers are expanded: the new list as (old index, the copy it is made for
    or None), the kept records' new indices, each copy's new indices, the copies of its run before each copy,
    and each marker's copied layer."""
    placement: list[tuple[int, str | None]] = []
    new_of: dict[int, int] = {}  # old index of a kept record -> its new index
    copy_at: dict[str, list[int]] = {}  # copied layer -> the new indices of its records
    earlier: dict[str, list[str]] = {}  # copied layer -> the copies of its run placed before it
    made: dict[str, list[str]] = {}  # second layer -> the copies of its run so far
    marker_of: dict[int, str] = {}  # old index of a marker -> its copied layer
    for old, record in enumerate(records):
        if record.op != _MARKER:
            new_of[old] = len(placement)
            placement.append((old, None))
            continue
        marker_of[old] = record.scope
        if record.scope in copy_at:
            continue
        second = stubs[record.scope].names[1]
        earlier[record.scope] = list(made.setdefault(second, []))
        made[second].append(record.scope)
        copy_at[record.scope] = list(range(len(placement), len(placement) + len(second_of[second])))
        placement += [(i, record.scope) for i in second_of[second]]
    if set(copy_at) != set(stubs):
        raise NotRepeating
    return placement, new_of, copy_at, earlier, marker_of


def _expand_markers(records: list[OpRecord], layers: Repeats, by_module: dict[str, int]) -> tuple[list[OpRecord], int]:
    """Put the second layer's records (renamed) at each copied layer's marker; add its MACs to by_module. Sources
    move with the records (:meth:`.repeats.Copy.transported`). Raises NotRepeating if the first two layers' records
    differ, or a copied layer left no marker."""
    stubs = layers.stub_of()
    first_of: dict[str, list[int]] = {}  # second layer -> the first layer's records
    second_of: dict[str, list[int]] = {}  # second layer -> its own records
    passes: dict[str, bool] = {}
    for run in layers.runs:
        if run.replicated:
            one, two = run.names[:2]
            first_of[two], second_of[two] = repeats.layer_records(records, one), repeats.layer_records(records, two)
            if not repeats.alike(records, first_of[two], second_of[two], one, two):
                raise NotRepeating
            passes[two] = repeats.passes_through(records, first_of[two], second_of[two])
    placement, new_of, copy_at, earlier, marker_of = _placement(records, stubs, second_of)

    copies: dict[str, repeats.Copy] = {}  # made once per copied layer, asked of each of its records' operands

    def moved_to(copy: str, sources: Sequence[int]) -> tuple[int, ...]:
        if copy not in copies:
            second = stubs[copy].names[1]
            before = [[new_of[i] for i in first_of[second]], [new_of[i] for i in second_of[second]],
                      *(copy_at[c] for c in earlier[copy])]
            copies[copy] = repeats.Copy(first_of[second], second_of[second], before, copy_at[copy], passes[second])
        return copies[copy].transported(sources, mapped)

    def mapped(source: int) -> tuple[int, ...]:
        # a copied layer's output: what the second layer's output came from, as the copy has it
        return moved_to(marker_of[source], records[source].sources[0]) if source in marker_of else (new_of[source],)

    out = []
    for old, copy in placement:
        record = records[old]
        if copy is None:
            out.append(dataclasses.replace(record, sources=tuple(tuple(sorted({n for s in operand for n in mapped(s)}))
                                                                 for operand in record.sources)))
        else:
            out.append(copied(record, stubs[copy].names[1], copy,
                              tuple(moved_to(copy, operand) for operand in record.sources)))
    extra = 0
    for name, run in stubs.items():
        traced = run.names[1]
        for key in [k for k in by_module if repeats.rename(k, traced, traced) is not None]:
            by_module[repeats.rename(key, traced, name)] = by_module[key]  # type: ignore[index]
        for key in ops.ancestors(name.rpartition(".")[0]):
            by_module[key] = by_module.get(key, 0) + by_module[traced]
        extra += by_module[traced]
    return out, extra
