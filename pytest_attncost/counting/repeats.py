"""Repeated layers: trace two, count the rest as copies of the second; every assumption checked, anything
unchecked runs in full (docs/performance.md, "What the repeated-layer shortcut checks"). The backends
(:mod:`.jit`, :mod:`.dispatch`) say what a copy is: :class:`Repeats` calls their ``on_stub`` per copied layer."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from ..ops import OpRecord
from .masks import Pattern

__all__ = ["SHORTCUT", "Copy", "NotRepeating", "Repeats", "Run", "alike", "copied", "full_trace", "layer_records",
           "passes_through", "rename", "switched"]


#: The switch: False inside :func:`full_trace` (a context variable: threads and tasks keep their own).
SHORTCUT: ContextVar[bool] = ContextVar("attncost_shortcut", default=True)
V = TypeVar("V")


@contextlib.contextmanager
def switched(switch: ContextVar[V], value: V) -> Iterator[None]:
    """*switch* set to *value* for the duration (this thread's or task's, as context variables are)."""
    token = switch.set(value)
    try:
        yield
    finally:
        switch.reset(token)


def full_trace() -> contextlib.AbstractContextManager[None]:
    """Count every layer in full (no repeated-layer shortcut): what the tests compare against."""
    return switched(SHORTCUT, False)


class NotRepeating(Exception):
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
    if isinstance(a, nn.Module):  # one kept aside per instance, without weights or children (the kernels package's
        # function wrappers, which transformers 5.25 keeps in every attention module): the same when its settings are
        return not any(m._parameters or m._buffers or m._modules for m in (a, b)) and _same(vars(a), vars(b))
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
        settings.update({(name, key): value for key, value in vars(sub).items()
                         if key not in ("_parameters", "_buffers", "_modules") and "hook" not in key})
    return tuple(structure), settings


@dataclass
class Run:
    names: list[str]  # dotted names (relative to the model) of the layers, in order
    modules: list[nn.Module]
    # per traced layer (0, 1): leaves, spec, output, start, end, and the snapshots before and after it
    calls: list[Any] = field(default_factory=list)
    replicated: list[str] = field(default_factory=list)  # stubbed layers counted as copies, in call order
    called: set[str] = field(default_factory=set)
    chained: int | None = None  # the input position that changes from layer to layer
    passes: bool | None = None  # the layers hand their input on beside their results (see passes_through)


class Repeats:
    """The repeated-layer shortcut for one count: which layers are traced, watched and copied."""

    def __init__(self, model: nn.Module, on_stub: Callable[[Run, str], Any],
                 snapshot: Callable[[], Any] = lambda: None, masks: Mapping[str, Pattern] | None = None) -> None:
        self.runs: list[Run] = []
        self.snapshot = snapshot  # backend state before and after each traced layer's call
        self.read: set[str] = set()
        self._watchers: dict[type, type] = {}  # class -> its watching subclass, for this count
        self._watched: dict[int, frozenset[str]] = {}  # id(module) -> the settings whose reads are noted
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
            if not isinstance(container, (nn.ModuleList, nn.Sequential)) or any(
                    name == p or name.startswith(p + ".") for p in planned):
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
                    run = Run([prefix + child for child, _ in children[start:end]],
                               [m for _, m in children[start:end]])
                    self.runs.append(run)
                    planned += run.names
                    self._install(run, differing)
                start = end

    def __bool__(self) -> bool:
        return bool(self.runs)

    def stub_of(self) -> dict[str, Run]:
        """Replicated layer -> its run."""
        return {name: run for run in self.runs for name in run.replicated}

    def _install(self, run: Run, differing: set[tuple[str, str]]) -> None:
        by_module: dict[str, set[str]] = {}
        for sub_name, key in differing:
            by_module.setdefault(sub_name, set()).add(key)
        for layer in run.modules[:2]:
            for sub_name, keys in by_module.items():
                self._watch(layer.get_submodule(sub_name), frozenset(keys))  # "": the layer itself
        for index, (name, layer) in enumerate(zip(run.names, run.modules)):
            forward = layer.forward
            layer.forward = (  # type: ignore[method-assign]
                self._traced(run, index, forward) if index < 2 else self._stub(run, name, forward))
            self._undo.append(functools.partial(layer.__dict__.pop, "forward", None))

    def _watch(self, module: nn.Module, keys: frozenset[str]) -> None:
        """Note reads of *keys* on *module*: its class becomes a subclass that tells this instance."""
        original = type(module)
        watcher = self._watchers.get(original)
        if watcher is None:
            watched, read = self._watched, self.read

            def __getattribute__(this: Any, name: str) -> Any:  # noqa: N807
                keys = watched.get(id(this))
                if keys is not None and name in keys:
                    read.add(name)
                return original.__getattribute__(this, name)  # type: ignore[call-arg]

            watcher = self._watchers[original] = type(original.__name__, (original,), {
                "__getattribute__": __getattribute__, "__module__": original.__module__,
                "__qualname__": original.__qualname__})
        module.__class__ = watcher
        self._watched[id(module)] = keys

        def restore() -> None:
            module.__class__ = original
            self._watched.pop(id(module), None)

        self._undo.append(restore)

    def undo(self) -> None:
        for step in reversed(self._undo):
            step()
        self._undo.clear()

    def _traced(self, run: Run, index: int, forward: Callable[..., Any]) -> Callable[..., Any]:
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

    def _stub(self, run: Run, name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
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

    def _matches(self, run: Run, args: Any, kwargs: Any) -> bool:
        try:
            if len(run.calls) != 2:
                return False
            (leaves0, spec0, _, _, end0, *_), (leaves1, spec1, _, start1, *_) = run.calls
            if end0 >= start1 or spec0 != spec1:
                return False  # nested calls, or the second layer called another way
            if run.chained is None:
                moving = [i for i, (a, b) in enumerate(zip(leaves0, leaves1)) if a is not b]
                if (len(moving) != 1 or not isinstance(leaves1[moving[0]], torch.Tensor)
                        or any(leaves1[moving[0]] is leaf for leaf in leaves0)
                        or not all(_same(a, b) for a, b in zip(leaves0, leaves1)
                                   if not isinstance(a, torch.Tensor) and a is not b)):
                    return False
                run.chained = moving[0]
            leaves, spec = pytree.tree_flatten((args, kwargs))
            if spec != spec1:
                return False
            mine, theirs = leaves[run.chained], leaves1[run.chained]
            return (all(a is b or not isinstance(b, torch.Tensor) and _same(a, b)
                        for position, (a, b) in enumerate(zip(leaves, leaves1)) if position != run.chained)
                    and type(mine) is type(theirs) and mine.shape == theirs.shape and mine.dtype == theirs.dtype
                    and mine.device == theirs.device and mine.stride() == theirs.stride()
                    and mine.requires_grad == theirs.requires_grad and mine.layout == theirs.layout)
        except Exception:  # noqa: BLE001 - inputs that cannot be compared: this layer runs in full
            return False

    def check(self) -> None:
        """After the count: raise NotRepeating if a copy made cannot stand."""
        replicated = [run for run in self.runs if run.replicated]
        if replicated and (self.read or self.broken or any(len(run.calls) != 2 for run in replicated)):
            raise NotRepeating


def rename(scope: str, old: str, new: str) -> str | None:
    """*scope* moved from module *old* to module *new*; None if it is not inside *old*."""
    if scope == old:
        return new
    if old == "":
        return f"{new}.{scope}" if new else scope
    if scope.startswith(old + "."):
        return new + scope[len(old):]
    return None


def layer_records(records: list[OpRecord], layer: str) -> list[int]:
    """The indices of the records *layer* made."""
    return [i for i, r in enumerate(records) if rename(r.scope, layer, layer) is not None]


def alike(records: list[OpRecord], first: list[int], second: list[int], old: str, new: str) -> bool:
    """Whether layer *old*'s records (*first*), moved to *new*, are layer *new*'s (*second*): the same ops on the
    same shapes, fed the same way inside the layer (where a layer's input comes from is not compared)."""
    if len(first) != len(second):
        return False
    where_first, where_second = {i: k for k, i in enumerate(first)}, {i: k for k, i in enumerate(second)}
    for a, b in zip(first, second):
        ra, rb = records[a], records[b]
        if dataclasses.replace(ra, scope=rename(ra.scope, old, new) or ra.scope, sources=()) != \
                dataclasses.replace(rb, sources=()):
            return False
        if [[where_first[s] for s in operand if s in where_first] for operand in ra.sources] != \
                [[where_second[s] for s in operand if s in where_second] for operand in rb.sources]:
            return False
    return True


def copied(record: OpRecord, old: str, new: str, sources: tuple[tuple[int, ...], ...]) -> OpRecord:
    """*record* of layer *old* as the copy made for layer *new*, fed by *sources*."""
    return dataclasses.replace(record, scope=rename(record.scope, old, new) or record.scope, sources=sources)


def passes_through(records: list[OpRecord], first: list[int], second: list[int]) -> bool:
    """Whether the layers hand their input on beside their own results (a residual stream): then what reached
    the first layer's input reaches the second's too, and every later layer's."""
    before_first, before_second = set(first), set(second)
    return all(records[a].fed_by - before_first <= records[b].fed_by - before_second for a, b in zip(first, second))


@dataclass(frozen=True)
class Copy:
    """Where a copy made of a run's second layer stands, in record indices: the first layer's, the second's, the
    run's layers up to the copy (*before*), the copy's own (*at*); whether the layers pass their input on."""

    first: list[int]
    second: list[int]
    before: list[list[int]]
    at: list[int]
    passes: bool

    def transported(self, sources: Sequence[int], elsewhere: Callable[[int], Sequence[int]]) -> tuple[int, ...]:
        """What the second layer took from *sources*, as the copy takes it: from inside the second layer, from the
        copy, position for position; from the first, from the layer before the copy, or, where the layers pass their
        input on, from every layer before it (as the full trace finds them); anything else through *elsewhere*."""
        in_second, in_first = {i: k for k, i in enumerate(self.second)}, {i: k for k, i in enumerate(self.first)}
        found: set[int] = set()
        for s in sources:
            if s in in_second:
                found.add(self.at[in_second[s]])
            elif s in in_first:
                found.update(layer[in_first[s]] for layer in (self.before if self.passes else self.before[-1:]))
            else:
                found.update(elsewhere(s))
        return tuple(sorted(found))
