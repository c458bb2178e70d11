"""One forward pass for several lengths at once: the length is one ``torch.SymInt`` whose node holds every
length's value, and each decision on a size must agree at all of them, else :class:`Diverged`.

How and why: docs/sweeps.md ("One run for all lengths").
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from itertools import repeat
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)

__all__ = ["POSSIBLE", "TORCH_VERSION", "Diverged", "OpMemo", "at", "enabled", "length_of", "spread", "swept"]

#: (major, minor) of the installed torch: the one reading of its version that version checks compare with.
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])
#: torch before 2.9 runs meta kernels in Python that branch on a length (``meta_zeros``): a symbolic length
#: diverges there at once, so a sweep counts each length alone.
POSSIBLE = TORCH_VERSION >= (2, 9)


class Diverged(BaseException):
    """The lengths took different branches; a BaseException, so that no ``except Exception`` in a model's code
    (or torch's) can swallow it and carry on down one branch for all lengths."""


_STATE = {"diverged": False}


def _values(value: Any, k: int) -> tuple[Any, ...]:
    return value.values if isinstance(value, _Node) else (value,) * k


def _kind(value: Any) -> type:
    """A value's kind of SymNode: int, bool, else float."""
    return type(value) if type(value) in (int, bool) else float


def _dense_in_order(order: Sequence[int]) -> Callable[[Sequence[int], Sequence[int]], bool]:
    # c10's compute_channels_last_contiguous_{2,3}d; in reverse order, its _compute_contiguous (less the empty case)
    def check(sizes: Sequence[int], strides: Sequence[int]) -> bool:
        if len(sizes) != len(order):
            return False
        expected = 1
        for dim in order:
            if sizes[dim] != 1:
                if strides[dim] != expected:
                    return False
                expected *= sizes[dim]
        return True

    return check


def _is_contiguous(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    # c10's _compute_contiguous (asked of every swept tensor's layout: no checker built per call)
    if math.prod(sizes) == 0:
        return True
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def _non_overlapping_and_dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    # c10's _compute_non_overlapping_and_dense: dims of size 0 or 1 sorted last, where the check ends
    if len(sizes) == 1:
        return sizes[0] < 2 or strides[0] == 1
    order = sorted(range(len(sizes)), key=lambda d: (sizes[d] < 2, strides[d] if sizes[d] >= 2 else 0))
    expected = 1
    for dim in order:
        if sizes[dim] < 2:
            return True
        if strides[dim] != expected:
            return False
        expected *= sizes[dim]
    return True


def _channels_last_strides(rank: int) -> Callable[[Sequence[int], Sequence[int]], bool]:
    # c10's is_channels_last_strides_{2,3}d_s{4,5}: strides decreasing in the order C, W, H(, D), N
    def check(sizes: Sequence[int], strides: Sequence[int]) -> bool:
        if len(sizes) != rank or strides[1] == 0:
            return False
        order = [1, *range(rank - 1, 1, -1), 0]
        minimum = 0
        for dim in order:
            if sizes[dim] == 0 or strides[dim] < minimum or (dim == 0 and minimum == strides[1]):
                return False
            minimum = strides[dim]
            if sizes[dim] > 1:
                minimum *= sizes[dim]
        return True

    return check


# The methods of _Node, made by kind: torch calls them by name (vulture cannot see it).


def _binary(fn: Callable[[Any, Any], Any], kind: type | None = None) -> Callable[[_Node, Any], _Node]:
    """*fn* length by length; the result's kind is *kind*, else its values' own."""
    def method(self: _Node, other: Any) -> _Node:
        values = tuple(map(fn, self.values, other.values if type(other) is _Node else repeat(other, len(self.values))))
        return _Node(values, kind or _kind(values[0]))

    return method


def _unary(fn: Callable[[Any], Any], kind: type | None = None) -> Callable[[_Node], _Node]:
    def method(self: _Node) -> _Node:
        values = tuple(map(fn, self.values))
        return _Node(values, kind or _kind(values[0]))

    return method


def _answer(value: Any) -> Callable[[_Node], Any]:
    """The same answer from every node."""
    return lambda self: value


def _is(kind: type) -> Callable[[_Node], bool]:
    return lambda self: self.pytype is kind


def _maybe_as(kind: type) -> Callable[[_Node], Any]:
    """The one value of every length as *kind*, None where they differ."""
    return lambda self: kind(self.values[0]) if self.values.count(self.values[0]) == len(self.values) else None


def _wrap(kind: type) -> Callable[[_Node, Any], _Node]:
    return lambda self, num: _Node((num,) * len(self.values), kind)


def _guard(kind: type) -> Callable[..., Any]:
    """A decision: every length must take the same one."""
    return lambda self, file=None, line=None: kind(self._one())


def _layout(check: Callable[[Sequence[int], Sequence[int]], bool]) -> Callable[[_Node, Any, Any], _Node]:
    """A layout test, length by length."""
    def method(self: _Node, sizes: Sequence[Any], strides: Sequence[Any]) -> _Node:
        k = len(self.values)
        columns = [_values(s, k) for s in sizes], [_values(s, k) for s in strides]
        return _Node(tuple(check([s[i] for s in columns[0]], [s[i] for s in columns[1]]) for i in range(k)), bool)

    return method


class _Node:
    """A SymNode with one value per length (what torch.SymInt/SymFloat/SymBool wrap)."""

    __slots__ = ("values", "pytype")
    _hint = None  # no cached hint: torch's helpers then ask the ShapeEnv, which asks the node

    free_symbols: frozenset[Any] = frozenset()  # no sympy symbols, none unbacked (data-dependent)

    @property
    def expr(self) -> _Node:
        return self  # torch's helpers hand a node's expression to its ShapeEnv: _Env takes the node itself

    def __init__(self, values: Sequence[Any], pytype: type) -> None:
        self.values = tuple(values)
        self.pytype = pytype

    @property
    def shape_env(self) -> _Env:
        return _ENV

    # --- what the node is
    is_int, is_bool, is_float = _is(int), _is(bool), _is(float)
    is_nested_int = is_constant = _answer(False)
    is_symbolic = has_hint = _answer(True)
    nested_int = nested_int_coeff = constant_int = constant_bool = _answer(None)
    maybe_as_int, maybe_as_bool, maybe_as_float = _maybe_as(int), _maybe_as(bool), _maybe_as(float)
    wrap_int, wrap_float, wrap_bool = _wrap(int), _wrap(float), _wrap(bool)

    def clone(self) -> _Node:
        return self

    def str(self) -> str:
        return f"lengths{self.values}"

    __str__ = __repr__ = _graph_repr = str

    # --- decisions: every length must take the same one
    def _one(self) -> Any:
        first = self.values[0]
        if self.values.count(first) != len(self.values):
            _STATE["diverged"] = True
            raise Diverged(f"a decision on the length differs between the lengths: {self.values}")
        return first

    guard_int = int_ = _guard(int)
    guard_float = _guard(float)
    guard_bool = bool_ = guard_size_oblivious = guard_or_false = guard_or_true = statically_known_true = \
        expect_true = expect_size = _guard(bool)

    # --- arithmetic, length by length
    add, sub, mul, mod = map(_binary, (operator.add, operator.sub, operator.mul, operator.mod))
    truediv = float_truediv = int_truediv = _binary(operator.truediv, float)
    pow = float_pow = pow_by_natural = _binary(operator.pow)
    floordiv = int_floordiv = _binary(operator.floordiv)
    eq, ne, gt, lt, le, ge = (_binary(fn, bool) for fn in (operator.eq, operator.ne, operator.gt, operator.lt,
                                                            operator.le, operator.ge))
    sym_min, sym_max = _binary(min), _binary(max)
    sym_or, sym_and = _binary(lambda a, b: bool(a or b), bool), _binary(lambda a, b: bool(a and b), bool)
    bitwise_and, bitwise_xor, bitwise_or, lshift, rshift = map(_binary, (operator.and_, operator.xor, operator.or_,
                                                                        operator.lshift, operator.rshift))
    sym_not = _unary(operator.not_, bool)
    neg, pos, abs = (_unary(fn) for fn in (operator.neg, operator.pos, builtins.abs))
    ceil, floor, trunc = (_unary(fn, int) for fn in (math.ceil, math.floor, math.trunc))
    sym_float, sym_int = _unary(float, float), _unary(int, int)
    sym_sqrt = _unary(math.sqrt, float)
    is_integer = _unary(lambda v: float(v).is_integer(), bool)

    def round(self, ndigits: Any = None) -> _Node:
        return _unary(builtins.round if ndigits is None else lambda v: builtins.round(v, ndigits))(self)

    def sym_sum(self, others: Sequence[Any]) -> _Node:
        return functools.reduce(_Node.add, others, self)

    def sym_ite(self, then: Any, other: Any) -> _Node:
        k = len(self.values)
        values = tuple(a if c else b for c, a, b in zip(self.values, _values(then, k), _values(other, k)))
        return _Node(values, _kind(values[0]))

    def __getattr__(self, name: builtins.str) -> Any:  # `str` is a method of the node here
        # a part of torch's SymNode protocol this node lacks: the run cannot stand for every length (an
        # AttributeError a model swallows would otherwise send every length down one branch)
        if name.startswith("__"):
            raise AttributeError(name)
        _STATE["diverged"] = True
        raise Diverged(f"a swept length cannot answer {name!r}")

    # --- layouts, length by length
    is_contiguous = _layout(_is_contiguous)
    is_non_overlapping_and_dense = _layout(_non_overlapping_and_dense)
    is_channels_last_contiguous_2d = _layout(_dense_in_order((1, 3, 2, 0)))
    is_channels_last_contiguous_3d = _layout(_dense_in_order((1, 4, 3, 2, 0)))
    is_channels_last_strides_2d = _layout(_channels_last_strides(4))
    is_channels_last_strides_3d = _layout(_channels_last_strides(5))


class _Env:
    """What torch's helpers ask a node's ShapeEnv: a value known for all lengths, or a decision."""

    def _maybe_evaluate_static(self, expr: Any, *args: Any, **kwargs: Any) -> Any:
        return expr._one() if isinstance(expr, _Node) else None  # differing answers: a decision the run cannot take

    def evaluate_sym_node(self, node: _Node, *args: Any, **kwargs: Any) -> Any:
        return node._one()


_ENV = _Env()


def length_of(lengths: Sequence[int]) -> torch.SymInt:
    """One length holding every length of *lengths* (for inputs built from it)."""
    return torch.SymInt(_Node(tuple(int(n) for n in lengths), int))


def swept(value: Any) -> bool:
    """Whether *value* (a size, a shape, nested containers) depends on a swept length."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return isinstance(value.node, _Node)
    if isinstance(value, (torch.Tensor, dict)):
        value = value.shape if isinstance(value, torch.Tensor) else list(value.values())
    return isinstance(value, (tuple, list)) and any(swept(item) for item in value)


def spread(value: Any, k: int) -> list[Any]:
    """*value* at each of the k lengths: sizes become ints, tuples are rebuilt, the rest is repeated."""
    kind = type(value)
    if kind is tuple:
        return [tuple(column) for column in zip(*(spread(item, k) for item in value))] if value else [()] * k
    if kind in (torch.SymInt, torch.SymFloat, torch.SymBool) and type(value.node) is _Node:
        return list(value.node.values)
    return [value] * k


def at(value: Any, index: int) -> Any:
    """*value* at the index-th length: sizes become ints, containers are rebuilt, the rest is kept."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) and isinstance(value.node, _Node):
        return value.node.values[index]
    if isinstance(value, tuple):
        return tuple(at(item, index) for item in value)
    if isinstance(value, list):
        return [at(item, index) for item in value]
    return value


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """Run a model on inputs of swept lengths: raises Diverged if any decision differed between them."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses import fake_impls

    _STATE["diverged"] = False
    # Fake tensors compute a view's (and a layer norm's) sizes with torch's reference implementation, each inner op
    # dispatched to the fake mode again: ~0.8 ms a view with a swept length. The meta kernel (the same reference, on
    # meta tensors) takes half that. Put back when the run ends.
    table = fake_impls.op_implementations_dict
    aten = torch.ops.aten
    saved = {op: table.pop(op) for op in (aten.view.default, aten._unsafe_view.default, aten.native_layer_norm.default)
             if op in table}
    try:
        with enable_python_dispatcher():
            yield
    finally:
        table.update(saved)
        diverged, _STATE["diverged"] = _STATE["diverged"], False
    if diverged:  # raised, then swallowed by something on the way: the run still cannot stand
        raise Diverged("a decision on the length differed between the lengths")


# --- a memo of what ops make, for the one run -------------------------------------------------


def _describe(value: Any) -> Any:
    """A hashable description of an op's argument, or raise _NotMemoizable."""
    if isinstance(value, torch.Tensor):
        if getattr(value, "constant", None) is not None:
            raise _NotMemoizable  # a fake tensor that knows its values: what an op makes of it may depend on them
        return ("T", type(value), _describe(tuple(value.shape)), _describe(value.stride()),
                _describe(value.storage_offset()), value.dtype, value.device, value.layout, value.requires_grad)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        if type(value.node) is not _Node:
            raise _NotMemoizable
        return ("S", type(value), value.node.values)  # an int and a float of equal value promote differently
    if isinstance(value, (bool, int, float)):
        return (type(value), value)  # 1 == 1.0 == True, but not as a tensor's other operand
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_describe(item) for item in value))
    if isinstance(value, dict):
        return ("D", *((key, _describe(item)) for key, item in value.items()))
    if value is None or isinstance(value, (str, torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return value
    raise _NotMemoizable


class _NotMemoizable(Exception):
    pass


def _functional(func: Any) -> bool:
    """No output aliases an input, no input is written, and the output sizes follow from the inputs' sizes."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    tags = getattr(func, "tags", ())
    if torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags:
        return False
    return bool(schema.returns) and not any(x.alias_info is not None for x in (*schema.returns, *schema.arguments))


class OpMemo:
    """What functional ops made, by what they were given: the one run's second traced layer (and the
    repeated projections of a layer) meet the same op on the same sizes again.

    An op's output sizes, strides and dtype depend on its inputs' metadata (tensor types included), its other
    arguments (Python scalars by type too: an int tensor plus 1 stays int, plus 1.0 does not) and the default
    dtype only (on fake tensors there are no values); an output that shares storage with an input is never kept.
    """

    def __init__(self) -> None:
        self.made: dict[Any, Any] = {}
        self.functional: dict[Any, bool] = {}

    def key(self, func: Any, args: Any, kwargs: Any) -> Any:
        if func not in self.functional:
            self.functional[func] = _functional(func)
        if not self.functional[func] or not any(isinstance(a, torch.Tensor) for a in args):
            return None  # constructors (the memo's own empty_strided among them) are cheap and kept out
        try:
            key = (func, _describe(args), _describe(kwargs or {}), torch.get_default_dtype())
            hash(key)
        except (_NotMemoizable, TypeError):
            return None
        return key

    def run(self, func: Any, args: Any, kwargs: Any, dispatch: Callable[[], Any],
            making: Any = contextlib.nullcontext) -> Any:
        """*func*'s outputs: new tensors of the sizes it made the first time on these arguments (made inside
        *making()*: a fake mode makes fake ones), else *dispatch*'s (kept for the next time)."""
        key = self.key(func, args, kwargs)
        found = None if key is None else self.made.get(key)
        if found is not None:
            many, outs = found
            with making():
                made = tuple(torch.empty_strided(shape, stride, dtype=dtype, device=device)
                             for shape, stride, dtype, device in outs)
            return made if many else made[0]
        out = dispatch()
        if key is not None:
            self.keep(key, out, pytree.tree_leaves((args, kwargs)))
        return out

    def keep(self, key: Any, out: Any, inputs: Any) -> None:
        outs = out if isinstance(out, tuple) else (out,)
        if not outs or not all(isinstance(o, torch.Tensor) and (o.is_meta or type(o) is not torch.Tensor)
                               for o in outs):
            return  # fake or meta tensors only: no values
        given = {t.untyped_storage()._cdata for t in inputs if isinstance(t, torch.Tensor)}
        if any(o.untyped_storage()._cdata in given for o in outs):
            return
        self.made[key] = (isinstance(out, tuple), [(tuple(o.shape), o.stride(), o.dtype, o.device) for o in outs])
