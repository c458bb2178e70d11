"""The torch backend: torch's ``FlopCounterMode`` at the dispatcher, on meta tensors (fake ones where bare meta
tensors cannot run the model), with a recorder that gives every op the scope, origin and mask label fvcore's records
have. Train mode and checkpointing: docs/split.md; several lengths at once (:mod:`~pytest_attncost.one_run`, split
per length by :func:`at_lengths`): docs/sweeps.md."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .. import one_run, ops
from ..errors import CountError, hint, site
from ..errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from ..ops import FUSED_ATTENTION_OPS, PRODUCTS, VIEW_OPS, OpRecord, RawCount, ancestors, attention_macs, short
from . import flex, masks
from .masks import SCORE_MASKING, SCORE_PASS, Pattern, Patterns, combine, masking_label, score_op, sdpa_label
from .repeats import SHORTCUT, Copy, NotRepeating, Repeats, Run, alike, copied, passes_through, switched
from .twin import all_meta, as_if_compiling, meta_autocast, no_global_hooks, refuse_scripted, tensor_leaves

__all__ = ["STAGES", "Refused", "at_lengths", "at_stage", "count_forward_torch", "module_totals"]


#: Products torch dispatches that have no formula here: seeing one means a count is short.
#: Any other dispatched op whose name says it multiplies matrices is reported as well.
_TORCH_MULTIPLYING = re.compile(
    r"(^|_)(mm|bmm|addmm|baddbmm|addbmm|mv|addmv|dot|vdot|addr|matmul|einsum|linear|bilinear|trilinear|"
    r"addmm_activation|conv(\dd|_tbc|_depthwise\dd|olution|_transpose\dd)(_\w+)?|\w*attention\w*|\w*_mm|"
    r"\w*_mm_\w*|linear_\w*|\w*gemm\w*)$"
)


_NOT_MULTIPLYING = re.compile(r"(prepack|unpack|_backward_data$|^linear_backward$)")


@functools.cache
def _named(packet: Any) -> tuple[str, bool]:
    """An op's name as fvcore's records have it (aten.mm -> aten::mm), and whether the name says it multiplies
    matrices (an op torch has no formula for then makes a count short). Once per op: a count meets each many times."""
    op = str(packet).replace(".", "::", 1)
    return op, not _NOT_MULTIPLYING.search(short(op)) and bool(_TORCH_MULTIPLYING.search(short(op)))


# Formulas in FLOPs (2 per MAC), as torch's registry returns them; they take the op's arguments.
def _from_table(op: str) -> Callable[..., int]:
    """A formula for *op* from the op table's MACs of its operands' shapes."""
    product = PRODUCTS[op]
    assert product.macs is not None

    def formula(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        a, b = (args[i].shape for i in product.operands)
        return 2 * product.macs(a, b, out_val.shape if isinstance(out_val, torch.Tensor) else ())  # type: ignore[misc]

    return formula


def _sdpa_flops(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return 2 * attention_macs(query.shape, key.shape, value.shape)


def _sdpa_backward_flops(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_val: Any = None,
                         **kwargs: Any) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count
    return int(sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape))


def _quantized_linear_flops(x: Any, packed: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return 2 * x.numel() * packed.unpack()[0].shape[0]  # the weight: [out, in]


def _extra_formulas() -> dict[Any, Callable[..., int]]:
    """What torch's registry lacks: sdpa kernels it does not know, and the products the op table says the torch
    backend counts from the table or by a formula of ours."""
    sdpa = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable")
    kernels: tuple[tuple[str, Callable[..., int]], ...] = (("", _sdpa_flops), ("_backward", _sdpa_backward_flops))
    wanted = {f"aten::{name}{suffix}": formula for name in sdpa for suffix, formula in kernels}
    wanted |= {op: _from_table(op) for op in ops.counted_by("torch", ops.TABLE)}
    ours = {"quantized": _quantized_linear_flops}  # the op table's products counted by a formula of ours, by namespace
    wanted |= {op: ours[op.partition("::")[0]] for op in ops.counted_by("torch", ops.OURS)}
    packets = {op: getattr(getattr(torch.ops, op.partition("::")[0]), op.partition("::")[2], None) for op in wanted}
    return {packets[op]: formula for op, formula in wanted.items() if packets[op] is not None}  # _grouped_mm: >= 2.8


#: Products whose records the mask rule reads: those whose two matrix operands the op table knows.
_MASKED_PRODUCTS = {op: product.operands for op, product in PRODUCTS.items() if product.macs is not None}


_NOTHING: frozenset[int] = frozenset()


class _TorchRecorder:
    """Scopes, origins, masks and records for :func:`count_forward_torch`. A backward op takes those of the forward
    op whose autograd node it runs under, else the innermost module whose call made that node (by sequence numbers);
    a recomputed op (:func:`_recomputing`) is kept apart as the forward op it repeats (:meth:`_replayed`). Nothing
    depends on set order or hash seeds."""

    def __init__(self, model: nn.Module, how: _How) -> None:
        from torch._C._autograd import _get_sequence_nr
        from torch.utils.weak import WeakTensorKeyDictionary
        self.sequence_nr = _get_sequence_nr
        self.records: list[OpRecord] = []
        self.unsupported: Counter[str] = Counter()
        # Held for the recorder's lifetime: a forward that reassigns a buffer (I-BERT's QuantAct) frees
        # the old tensor, and an activation could then reuse its id and pass for model state.
        self.state = [*model.parameters(), *model.buffers()]
        self.params = {id(p) for p in model.parameters()}
        self.buffers = {id(b) for b in model.buffers()}
        given = how.buffer_masks or {}
        self.masks = Patterns({id(b): given[name] for name, b in model.named_buffers() if name in given})
        self.calls: list[list[Any]] = []  # [first sequence nr, end sequence nr or None, name, parent call]
        self.starts: list[int] = []
        self.stack: list[int] = []
        self.node_records: dict[int, int] = {}  # autograd sequence nr -> forward record index
        self.backward_of: dict[int, int] = {}  # backward record index -> forward record index
        self.reach: Any = WeakTensorKeyDictionary()  # tensor -> the products whose results reach it
        self.flows: Any = WeakTensorKeyDictionary()  # scores -> (forward record indices, labels)
        self.labels: dict[int, list[str]] = {}
        # tensors made from a parameter by indexing or reshaping (experts picked per token)
        self.derived: Any = WeakTensorKeyDictionary()
        self.handles: list[Any] = []
        self.repeats: Repeats | None = None
        self.copies: list[tuple[Run, str, int, int]] = []  # (run, layer, first record, end) of each copy
        self.train = how.train  # a backward follows: forward records are kept by key, for a recompute to find
        self.recompute: list[OpRecord] = []  # forward ops run again in the backward (activation checkpointing)
        self.forward_keys: dict[tuple[Any, ...], list[int]] = {}  # (op, shapes, output) -> forward records
        self.key_of: dict[int, tuple[Any, ...]] = {}
        self.replayed: set[int] = set()  # forward records a recompute has repeated
        self.replay_next: int | None = None  # the forward record a recompute in progress repeats next
        self.replay_base: int | None = None  # the depth of the module stack when a recompute entered a module
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._enter(name)))
            self.handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self.replay_base is None and torch._C._current_autograd_node() is not None:
                self.replay_base = len(self.stack)  # a recompute calls the module again, inside the backward
            start = self.sequence_nr()
            self.calls.append([start, None, name, self.stack[-1] if self.stack else -1])
            self.starts.append(start)
            self.stack.append(len(self.calls) - 1)

        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.calls[self.stack.pop()][1] = self.sequence_nr()

    def copy_layer(self, run: Run, name: str) -> Any:
        """A repeated layer's call: the second layer's records, renamed, here; its output returned, reached by
        the copy's records as the second layer's output was by its own (see repeats.Copy)."""
        second, begin = run.names[1], len(self.records)
        first_layer, second_layer = _layer(run, 0), _layer(run, 1)
        if run.passes is None:
            run.passes = passes_through(self.records, first_layer, second_layer)
        layers = [first_layer, second_layer, *(list(range(s, e)) for r, _, s, e in self.copies if r is run)]
        copy = Copy(first_layer, second_layer, layers, list(range(begin, begin + len(second_layer))), bool(run.passes))

        def moved_to(sources: Sequence[int]) -> tuple[int, ...]:
            return copy.transported(sources, lambda s: (s,))

        for index in second_layer:
            if index in self.labels:
                self.labels[len(self.records)] = list(self.labels[index])
            record = self.records[index]
            self.records.append(copied(record, second, name, tuple(moved_to(operand) for operand in record.sources)))
        (_, before), (_, after) = run.calls[1][5:7]
        self.unsupported.update(after - before)
        self.copies.append((run, name, begin, len(self.records)))

        def output(tensor: torch.Tensor) -> torch.Tensor:
            alias = torch.ops.aten.alias(tensor)
            self.reach[alias] = frozenset(moved_to(sorted(self.reach.get(tensor, _NOTHING))))
            return alias

        return pytree.tree_map_only(torch.Tensor, output, run.calls[1][2])

    def check_copies(self, records: list[OpRecord]) -> None:
        """The first two layers alike, and every copy equal to the second layer as it finally stands."""
        assert self.repeats is not None
        self.repeats.check()
        for run in {id(run): run for run, *_ in self.copies}.values():
            if not alike(records, _layer(run, 0), _layer(run, 1), *run.names[:2]):
                raise NotRepeating
        for run, name, start, end in self.copies:
            if not alike(records, _layer(run, 1), list(range(start, end)), run.names[1], name):
                raise NotRepeating

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

    def observe(self, packet: Any, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any], formula: Any) -> None:
        op, multiplying = _named(packet)
        node = torch._C._current_autograd_node()
        if formula is None:
            if multiplying:
                self.unsupported[op] += 1
            if node is None:
                self._track(op, out, args, kwargs, self._reached(args, kwargs))
            return
        flops = formula(*args, **kwargs, out_val=out)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        out_shape = tuple(first.shape) if isinstance(first, torch.Tensor) else ()
        shapes = tuple(tuple(t.shape) for t in tensors[:3])
        index = len(self.records)
        if node is not None and torch.is_grad_enabled() and _recomputing(node):
            self._recomputed((op, shapes, out_shape), _macs(flops), tensors, node)
            return
        if node is not None:  # backward: the forward op that created this node decides
            self._end_replay()
            source = self.node_records.get(node._sequence_nr())
            if source is not None:
                scope, origin = self.records[source].scope, self.records[source].origin
                self.backward_of[index] = source
            else:
                scope, origin = self.scope_of_node(node._sequence_nr()), self.origin(tensors)
            self.records.append(OpRecord(op, scope, _macs(flops), origin, shapes, out_shape,
                                         backward_of=-1 if source is None else source))
            return
        origin = "param" if op in PRODUCTS and PRODUCTS[op].packed else self.origin(tensors)
        weights = sum(t.numel() for t in tensors[:3] if self.origin([t]) == "param")
        self.records.append(OpRecord(op, self.scope(), _macs(flops), origin, shapes, out_shape,
                                     sources=self._operand_sources(args), weights=weights))
        if self.train:  # (one-run sizes, unhashable, are never swept in train mode)
            self.key_of[index] = key = (op, shapes, out_shape)
            self.forward_keys.setdefault(key, []).append(index)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            # autograd created this op's node just before dispatching it: the latest sequence number
            self.node_records.setdefault(self.sequence_nr() - 1, index)
        if op in FUSED_ATTENTION_OPS:
            named = {**dict(zip(masks.argument_names(op), args)), **kwargs}
            mask = named.get("attn_mask", named.get("attn_bias"))
            given = isinstance(mask, torch.Tensor)  # (an argument not given is read as none)
            self.labels[index] = [sdpa_label(named.get("is_causal", False), given, self.masks.abstract(mask),
                                             given and mask.dtype == torch.bool)]
        elif origin == "activation" and op in _MASKED_PRODUCTS:
            operands = [args[i] for i in _MASKED_PRODUCTS[op] if i < len(args)]
            upstream = [self.flows[t] for t in operands if isinstance(t, torch.Tensor) and t in self.flows]
            if upstream:  # AV (or Q (K^T V)): the scores' masks apply here too
                self.labels[index] = [label for _, labels in upstream for label in labels]
            elif isinstance(first, torch.Tensor):
                self.flows[first] = ((index,), ())
        self._track(op, out, args, kwargs, frozenset((index,)))

    def _recomputed(self, key: tuple[Any, ...], macs: Any, tensors: list[torch.Tensor], node: Any) -> None:
        """Keep a recomputed op (*key*: op, shapes, output shape) apart, as the forward op it repeats (its scope,
        origin, mask and part)."""
        inside = self.replay_base is not None and len(self.stack) > self.replay_base
        source = self._replayed(key, self.scope() if inside else None)
        if source is None:  # no forward op like it: where the recompute runs
            op, shapes, out_shape = key
            scope = self.scope() if inside else self.scope_of_node(node._sequence_nr())
            self.recompute.append(OpRecord(op, scope, macs, self.origin(tensors), shapes, out_shape, backward_of=-1))
            return
        self.recompute.append(dataclasses.replace(self.records[source], macs=macs, sources=(), backward_of=source))
        if any(t.requires_grad for t in tensors):  # the reentrant kind's backward runs on the recompute's nodes
            self.node_records.setdefault(self.sequence_nr() - 1, source)

    def _replayed(self, key: tuple[Any, ...], scope: str | None) -> int | None:
        """The forward record a recomputed op repeats: the next one of the recompute in progress, else the
        latest alike not yet repeated (the backward recomputes the last checkpointed segment first), in the
        module the recompute is calling when it calls one."""
        def fits(index: int) -> bool:
            return index not in self.replayed and (scope is None or self.records[index].scope == scope)

        found = self.replay_next
        if found is None or self.key_of.get(found) != key or not fits(found):
            found = next((i for i in reversed(self.forward_keys.get(key, ())) if fits(i)), None)
        if found is not None:
            self.replayed.add(found)
            self.replay_next = found + 1
        return found

    def _end_replay(self) -> None:
        """The backward proper goes on: calls a recompute left open (an early stop raises out of them, and
        their forward hooks do not run) are closed."""
        self.replay_next = None
        if self.replay_base is not None:
            for call in self.stack[self.replay_base:]:
                self.calls[call][1] = self.sequence_nr()
            del self.stack[self.replay_base:]
            self.replay_base = None

    def _operand_sources(self, args: tuple[Any, ...]) -> tuple[tuple[int, ...], ...]:
        """Per tensor argument, the products whose results reach it."""
        return tuple(tuple(sorted(self.reach.get(t, _NOTHING))) for value in args
                     for t in (value if isinstance(value, (tuple, list)) else (value,)) if isinstance(t, torch.Tensor))

    def _reached(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> frozenset[int]:
        """The products whose results reach these arguments (through ops that are no products)."""
        found: frozenset[int] = _NOTHING
        for value in (*args, *kwargs.values()):
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(tensor, torch.Tensor):
                    reached = self.reach.get(tensor)
                    if reached and not reached <= found:
                        found = reached if not found else found | reached
        return found

    def _track(self, op: str, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               reached: frozenset[int]) -> None:
        """Follow the data (which products reach each tensor), mask patterns, attention scores and parameters
        through the forward ops."""
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        for tensor in outs:
            if reached or tensor in self.reach:  # values only: a mask or an index carries no product's result
                self.reach[tensor] = reached if tensor.is_floating_point() or tensor.is_complex() else _NOTHING
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if not isinstance(first, torch.Tensor):
            return
        name = short(op)
        if name in VIEW_OPS and self.origin([a for a in args if isinstance(a, torch.Tensor)][:1]) == "param":
            for tensor in outs:
                self.derived[tensor] = True
        flow_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a in self.flows]
        name = score_op(name)
        if flow_positions:
            indices, labels = self.flows[args[flow_positions[0]]]
            if name in SCORE_MASKING and name != "masked_fill" or name == "masked_fill" and flow_positions[0] == 0:
                label = masking_label(name, [self.masks.abstract(a) for a in args], flow_positions[0])
                for index in indices:
                    self.labels.setdefault(index, []).append(label)
                self.flows[first] = (indices, (*labels, label))
            elif name in SCORE_PASS:
                self.flows[first] = (indices, labels)
            return
        self.masks.track(name, out, args)

    def finish(self) -> list[OpRecord]:
        records = list(self.records)
        for index, labels in self.labels.items():
            records[index] = dataclasses.replace(records[index], mask=combine(labels))
        for index, source in self.backward_of.items():
            records[index] = dataclasses.replace(records[index], mask=records[source].mask, keeps=records[source].keeps)
        self.recompute = [r if r.backward_of is None or r.backward_of < 0 else dataclasses.replace(
            r, mask=records[r.backward_of].mask, keeps=records[r.backward_of].keeps) for r in self.recompute]
        return records


def _layer(run: Run, index: int) -> list[int]:
    """The records traced layer *index* (0, 1) of *run* made, from the recorder's snapshots around its call."""
    (start, _), (end, _) = run.calls[index][5:7]
    return list(range(start, end))


def _recomputing(node: Any) -> bool:
    """Whether an op dispatched under autograd *node* with grad enabled is a forward op that activation checkpointing
    runs again: under ``CheckpointFunctionBackward`` (the reentrant kind), or with the non-reentrant kind's
    recomputation hooks on top (a double backward with ``create_graph=True`` is neither)."""
    if type(node).__name__ == "CheckpointFunctionBackward":
        return True
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, TypeError):  # a torch without it: grad enabled under a node is taken as recompute
        return True
    return bool(hooks) and getattr(hooks[0], "__qualname__", "").startswith("_recomputation_hook")


def _macs(flops: Any) -> Any:
    """FLOPs to MACs: an int, or a size of swept lengths (one value per length, see one_run.py)."""
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
    # The recorder knows each op's module; FlopCounterMode's own tracker would hook every module call, and it
    # asserts on a module input that requires grad without a grad_fn (a parameter passed in under no_grad).
    counter.mod_tracker = contextlib.nullcontext()  # type: ignore[assignment]
    return counter


def count_forward_torch(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, train: bool = False, fake: bool = True,
    buffer_masks: Mapping[str, Pattern] | None = None,
) -> RawCount:
    """Count with torch's ``FlopCounterMode`` at the dispatcher: on the twin's meta tensors as they are where every
    tensor is a meta one (at the first of :data:`STAGES`), else on fake tensors; neither has memory or arithmetic.

    *model* must be a twin. With ``train=True`` a real backward runs too (of the sum of the outputs), so backward
    products are counted as executed, each in the scope (and with the origin and mask) of the forward op it
    differentiates. FLOPs are halved into MACs. Products torch has no formula for are listed in ``unsupported_ops``.

    Args:
        buffer_masks: triangular mask buffers of the original model (see :func:`buffer_masks`).

    Raises:
        Refused: the model could not run at this stage; the next one may run it (count it again there).
        CountError: the model could not run at the last stage; the message carries the reason.
    """
    refuse_scripted(model)
    stage = STAGE.get()
    bare = fake and stage == STAGES[0] and all_meta(model, (args, kwargs))
    how = _How(train, fake, buffer_masks, bare, fake and stage != STAGES[2])
    swept = one_run.swept((args, kwargs))  # one run for several lengths: meta tensors of swept sizes
    if swept and train:
        raise CountError("train mode counts one length at a time")
    with one_run.enabled() if swept else contextlib.nullcontext():
        return _count_torch(model, args, kwargs, how, shortcut=swept or (fake and not train))


#: Where the torch backend runs a twin whose tensors are all meta ones, tried in this order: its meta tensors as
#: they are; fake tensors (their own kernels and fallbacks run more), as if compiling, where library code reads no
#: values; fake tensors as they are, where library code builds what a compiler would be given (LongT5's mask).
STAGES = ("meta", "fake", "fake, as they are")
STAGE: ContextVar[str] = ContextVar("attncost_stage", default=STAGES[0])


def at_stage(stage: str) -> contextlib.AbstractContextManager[None]:
    """Count at *stage* (one of :data:`STAGES`; a context variable, as repeats.SHORTCUT is)."""
    return switched(STAGE, stage)


class Refused(CountError):
    """The model could not run at one of :data:`STAGES`; the next (:attr:`next`) may run it: count again there, on
    a fresh twin with fresh inputs (the failed run may have changed both: a lazily built table, a cache it
    appended to)."""

    def __init__(self, message: str, next: str) -> None:
        super().__init__(message)
        self.next = next


@dataclasses.dataclass(frozen=True)
class _How:
    """How :func:`count_forward_torch` counts (its keyword arguments; *bare*: on the meta tensors as they are)."""

    train: bool
    fake: bool
    buffer_masks: Mapping[str, Pattern] | None
    bare: bool
    compiling: bool  # on fake or meta tensors, with torch.compiler.is_compiling() true


def _count_torch(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], how: _How,
                 shortcut: bool) -> RawCount:
    if SHORTCUT.get() and shortcut:  # (never in train mode)
        recorder = _TorchRecorder(model, how)
        repeats = Repeats(model, recorder.copy_layer, lambda: (len(recorder.records), Counter(recorder.unsupported)),
                          how.buffer_masks)
        if repeats:
            recorder.repeats = repeats
            try:
                return _run_torch(model, args, kwargs, how, recorder)
            except NotRepeating:
                pass
            finally:
                repeats.undo()
        else:
            recorder.remove_hooks()
    return _run_torch(model, args, kwargs, how, _TorchRecorder(model, how))


@functools.cache
def _memo_mode() -> type:
    """FakeTensorMode that hands back, for a functional op met again on the same sizes, new fake tensors of
    the sizes it made the first time (see one_run.OpMemo): the one run's cost is in those sizes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class _MemoFakeTensorMode(FakeTensorMode):  # type: ignore[misc]
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.memo = one_run.OpMemo()

        def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return self.memo.run(func, args, kwargs, lambda: super(_MemoFakeTensorMode, self).dispatch(
                func, types, args, kwargs), making=lambda: self)

    return _MemoFakeTensorMode


def _bare_memo_mode() -> Any:
    """Below the counter in a one run on meta tensors: a functional op met again on the same sizes gets new meta
    tensors of the sizes it made the first time (one_run.OpMemo), not the meta kernel's symbolic arithmetic again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _BareMemo(TorchDispatchMode):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.memo = one_run.OpMemo()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return self.memo.run(func, args, kwargs, lambda: func(*args, **(kwargs or {})))

    return _BareMemo()


def _fake(mode: Any, leaf: torch.Tensor, made: dict[int, Any]) -> Any:
    if one_run.swept(leaf):  # sizes of swept lengths: a fake tensor made anew (from_tensor wants a ShapeEnv),
        if id(leaf) not in made:  # once per tensor, as from_tensor does: MHA's (x, x, x) stays one tensor
            with mode:
                made[id(leaf)] = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device=leaf.device,
                                                     requires_grad=leaf.requires_grad)
        return made[id(leaf)]
    return mode.from_tensor(leaf)


def _run_torch(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], how: _How,
               recorder: _TorchRecorder) -> RawCount:
    counter = _torch_counter(recorder)
    swept = how.fake and one_run.swept((args, kwargs))
    mode = (_bare_memo_mode() if swept else contextlib.nullcontext()) if how.bare else _mode(how.fake, swept)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        compiling = as_if_compiling() if how.compiling else contextlib.nullcontext()
        with no_global_hooks(), torch.random.fork_rng(devices=[]), meta_autocast(), compiling, mode:
            if how.fake and not how.bare:
                made: dict[int, Any] = {}
                args, kwargs = pytree.tree_map_only(torch.Tensor, lambda leaf: _fake(mode, leaf, made), (args, kwargs))
            with counter, torch.set_grad_enabled(how.train), _Einsums(recorder), flex.into_records(recorder.records):
                output = model(*args, **kwargs)
                if how.train:
                    grads = [t for t in tensor_leaves(output) if t.requires_grad and t.is_floating_point()]
                    if not grads:
                        raise CountError("train mode needs an output that requires grad; none did")
                    torch.stack([t.sum() for t in grads]).sum().backward()
    except RecursionError:  # the user's forward recursing without end: their error, no other counter tried
        raise
    except Exception as exc:  # noqa: BLE001 - the model's reason is the user's best clue
        if recorder.repeats is not None and recorder.repeats.stub_of():
            raise NotRepeating from (None if isinstance(exc, CountError) else exc)
        if isinstance(exc, CountError):
            raise
        reason = f"{type(exc).__name__}: {exc}".strip()[:600]
        where = "on meta tensors" if how.bare else "on fake tensors" if how.fake else "on real tensors"
        message = (f"torch's FlopCounterMode could not run {type(model).__name__} {where}{site(exc, model)}: "
                   f"{reason}\nFix: {hint(reason)}.")
        if how.bare or how.compiling:
            raise Refused(message, STAGES[1] if how.bare else STAGES[2]) from exc
        raise CountError(message) from exc
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        recorder.remove_hooks()
    return _raw(model, recorder, output)


class _Einsums(TorchFunctionMode):
    """An einsum is one product to the reader of records, as fvcore records it: torch runs it as a bmm of its
    operands folded (a multi-query einsum folds heads into the rows), so the record of that one product takes
    the einsum's operand and output shapes, which say how many queries the attention saw, and each operand's
    sources (a third operand multiplied in, Performer's normalizer, reaches the product, not only its result)."""

    def __init__(self, recorder: _TorchRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is not torch.functional.einsum:
            return func(*args, **(kwargs or {}))
        start = len(self.recorder.records)
        out = func(*args, **(kwargs or {}))
        made = [i for i in range(start, len(self.recorder.records)) if self.recorder.records[i].backward_of is None]
        operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        if len(made) == 1 and isinstance(out, torch.Tensor) and all(isinstance(t, torch.Tensor) for t in operands):
            record = self.recorder.records[made[0]]
            self.recorder.records[made[0]] = dataclasses.replace(
                record, shapes=tuple(tuple(t.shape) for t in operands), out_shape=tuple(out.shape),
                sources=self.recorder._operand_sources(tuple(operands)))
        return out


def _mode(fake: bool, swept: bool) -> Any:
    """Fake tensors (where bare meta ones do not run the model): transformers skips its value checks for them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    if not fake:
        return contextlib.nullcontext()
    if not swept:
        return FakeTensorMode(allow_non_fake_inputs=True)
    mode = _memo_mode()(allow_non_fake_inputs=True)
    mode.cache_enabled = False  # its keys want sympy expressions; a swept length has values instead
    # torch's C++ meta kernels compute with a swept length's values as with any size; fake tensors would
    # otherwise take the Python decompositions made for sympy sizes (the same shapes, several times slower)
    mode.cpp_meta_supports_symint = lambda func: True
    return mode


def _raw(model: nn.Module, recorder: _TorchRecorder, output: Any) -> RawCount:
    """The count a run made: its records (copies checked), totals, and what reaches the outputs."""
    records = recorder.finish()
    if recorder.repeats is not None:
        recorder.check_copies(records)
    outputs = tuple(tuple(sorted(recorder.reach.get(t, _NOTHING))) for t in tensor_leaves(output))
    classes = {name: type(module).__name__ for name, module in model.named_modules()}
    copied = tuple(name for _, name, _, _ in recorder.copies)
    swept = any(isinstance(r.macs, torch.SymInt) for r in records)  # several lengths: summed per length by at_lengths
    return RawCount(total=0 if swept else sum(r.macs for r in records), records=records, module_names=classes,
                    by_module={} if swept else module_totals(records, list(classes)), outputs=outputs,
                    unsupported_ops=recorder.unsupported, copied_layers=copied, recompute=tuple(recorder.recompute))


def module_totals(records: list[OpRecord], names: list[str],
                   enclosing: dict[str, list[str]] | None = None) -> dict[str, int]:
    """Each module's MACs, its descendants' included. *enclosing* (scope -> the modules of *names*
    enclosing it) is filled as scopes come and may be shared by counts of the same records' scopes."""
    enclosing = {} if enclosing is None else enclosing
    by_module = dict.fromkeys(names, 0)
    for record in records:
        found = enclosing.get(record.scope)
        if found is None:
            found = enclosing[record.scope] = [name for name in ancestors(record.scope) if name in by_module]
        for name in found:
            by_module[name] += record.macs
    return by_module


def at_lengths(raw: RawCount, k: int) -> list[RawCount]:
    """A count made for k lengths at once (see one_run.py), as k counts, one per length."""
    spread = one_run.spread
    records: list[list[OpRecord]] = [[] for _ in range(k)]
    new = object.__new__
    for record in raw.records:
        fields = vars(record)
        for out, macs, shapes, out_shape, weights in zip(records, spread(record.macs, k), spread(record.shapes, k),
                                                         spread(record.out_shape, k), spread(record.weights, k)):
            copy = new(OpRecord)  # a frozen dataclass: its fields set directly, k times per record
            vars(copy).update(fields, macs=macs, shapes=shapes, out_shape=out_shape, weights=weights)
            out.append(copy)
    names = list(raw.module_names)
    enclosing: dict[str, list[str]] = {}  # each scope's enclosing modules, once for all lengths
    return [dataclasses.replace(raw, total=sum(r.macs for r in mine), records=mine,
                                by_module=module_totals(mine, names, enclosing)) for mine in records]
