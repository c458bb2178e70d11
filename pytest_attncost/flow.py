"""The data flow of one count: which product's result reaches which other product's operands, and the
attention calls it shows (chained cores). :mod:`pytest_attncost.roles` reads the structure from it."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .ops import CONVOLUTIONS, PRODUCTS, OpRecord, ancestors, is_fused, is_product

__all__ = ["NARROW", "Flow", "first_matrix", "rows", "table", "width_of"]

#: The most consumers a product of :attr:`Flow.narrow`'s lists has.
NARROW = 64


class Flow:
    """The products of one count, who consumes whose result, and the attention calls (chained cores).

    Attributes:
        products: indices of the forward products and fused attention ops.
        consumers: index -> the products whose operands its result reaches.
        groups: the attention calls: each the indices of its cores, in graph order.
        group_of: core index -> its group's position in *groups*.
    """

    def __init__(self, records: Sequence[OpRecord], apart: frozenset[str] = frozenset()) -> None:
        """*apart*: modules whose products of two activations are no attention call (state-space mixers)."""
        self.records, self.apart = records, apart
        self.products = [i for i, r in enumerate(records)
                         if r.backward_of is None and (is_product(r.op) or is_fused(r.op))]
        self.consumers: dict[int, list[int]] = {i: [] for i in self.products}
        for i in self.products:  # each list in graph order, as i comes
            for source in records[i].fed_by:
                if source in self.consumers:
                    self.consumers[source].append(i)
        parent: dict[int, int] = {}

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for i in self.products:
            record = records[i]
            if is_fused(record.op):
                parent.setdefault(i, i)
            elif record.origin == "activation" and not self.apart_at(i):
                for k, operand in enumerate(record.sources):  # scores (or K^T V) reaching the next product
                    others = {s for j, o in enumerate(record.sources) if j != k for s in o}
                    # scores reach one operand (probabilities @ V), not both (x @ x^T of a residual stream)
                    for path in (self._score_path(s) for s in operand if s not in others):
                        for source in path:
                            parent.setdefault(source, source)
                            parent.setdefault(i, i)
                            parent[root(i)] = root(source)
        groups: dict[int, list[int]] = {}
        for i in sorted(parent):
            groups.setdefault(root(i), []).append(i)
        self.groups = list(groups.values())
        self.group_of = {i: g for g, members in enumerate(self.groups) for i in members}

    def _score_path(self, i: int) -> list[int]:
        """The products that made the scores reaching a later product through *i*: *i* itself where it is scores,
        or parameter products that mix the scores without changing their size (talking heads: a square h x h
        matrix, or a 1x1 convolution, over the heads between QK^T and AV) with the QK^T they mix; else nothing."""
        if self._scores(i):
            return [i]
        record = self.records[i]
        if record.origin != "param" or not is_product(record.op) or not record.fed_by or not record.out_shape:
            return []
        size = math.prod(record.out_shape)
        square = any(len(shape) >= 2 and shape[0] == shape[1] and all(d == 1 for d in shape[2:])
                     and shape[0] ** 2 < size for shape in record.shapes)  # h x h, or a 1x1 convolution's (h, h, 1, 1)
        found = [i]
        for source in sorted(record.fed_by):  # every input a mix of the same scores (sim + mix(sim) included)
            if not square or source not in self.consumers or math.prod(self.records[source].out_shape or (0,)) != size:
                return []
            if self._scores(source):  # the first product of a call (QK^T), not one that takes scores (AV: then O)
                below = [] if any(self._scores(s) for s in self.records[source].fed_by) else [source]
            else:
                below = self._score_path(source)
            if not below:
                return []
            found += below
        return list(dict.fromkeys(found))

    def _scores(self, i: int) -> bool:
        """A forward product of two activations whose result has rows (scores, K^T V; one column when a step
        attends to a single key)."""
        record = self.records[i]
        return (i in self.consumers and record.origin == "activation" and is_product(record.op)
                and len(record.out_shape) >= 2 and not self.apart_at(i))

    def apart_at(self, i: int) -> bool:
        """Whether product *i* runs in a module whose products are no attention (:class:`Flow`'s *apart*)."""
        return bool(self.apart) and not self.apart.isdisjoint(ancestors(self.records[i].scope))

    def params(self, indices: Iterable[int]) -> list[int]:
        """The parameter products among *indices* that multiply a matrix (a product of vectors with a parameter
        vector makes a table, rotary's positions x frequencies, not a projection)."""
        return [i for i in indices if i in self.matrices]

    @functools.cached_property
    def matrices(self) -> dict[int, None]:
        """The parameter products that multiply a matrix, in graph order (see :meth:`params`)."""
        records = self.records
        return dict.fromkeys(i for i in self.products if records[i].origin == "param" and i not in self.group_of
                             and not table(records[i]))

    @functools.cached_property
    def narrow(self) -> dict[int, list[int]]:
        """Product -> the matrix products among its sources that have at most :data:`NARROW` consumers, in graph
        order. A residual stream's products feed every later layer, so each product's sources grow with the depth;
        these lists do not, and they are made from the consumers' side in time linear in the model."""
        found: dict[int, list[int]] = {}
        for s in self.matrices:  # in graph order, so each list is too
            users = self.consumers[s]
            if len(users) <= NARROW:
                for u in users:
                    found.setdefault(u, []).append(s)
        return found

    @functools.cached_property
    def attending(self) -> frozenset[str]:
        """The modules that run an attention core (the cores' scopes and every module enclosing them)."""
        return self.holders(i for group in self.groups for i in group)

    @functools.cached_property
    def readers(self) -> dict[frozenset[int], list[int]]:
        """The products that read the same results -> the parameter products among them that multiply a matrix."""
        found: dict[frozenset[int], list[int]] = {}
        for i in self.matrices:
            found.setdefault(self.records[i].fed_by, []).append(i)
        return found

    @functools.cached_property
    def under(self) -> dict[str, list[int]]:
        """Module -> the products that run inside it (the root ``""`` holds them all), in graph order."""
        found: dict[str, list[int]] = {}
        for i in self.products:
            for module in ancestors(self.records[i].scope):
                found.setdefault(module, []).append(i)
        return found

    def holders(self, indices: Iterable[int]) -> frozenset[str]:
        """The modules that hold any of the products *indices* (their scopes and every module enclosing them)."""
        return frozenset(module for i in indices for module in ancestors(self.records[i].scope))


def table(record: OpRecord) -> bool:
    """A product of vectors only (rotary's positions x frequencies): it makes a table, it projects nothing.
    Vectors as such, or columns times rows (an outer product: the contracted dimension is 1)."""
    shapes = record.shapes
    if not shapes:
        return False
    return (all(len(shape) < 2 for shape in shapes)
            or (record.op in _OUTER and len(shapes) == 2 and len(shapes[0]) >= 2 and shapes[0][-1] == 1))


_OUTER = ("aten::matmul", "aten::mm", "aten::bmm")  # a @ b, contracting a's last dimension


def rows(record: OpRecord) -> int:
    """The rows a product's result has: tokens, for a projection or an FFN of a batch of sequences. Every dimension
    of its output but the last; but where the output begins with its first matrix's rows and spreads the contracted
    columns over more than one dimension (XLNet's ``einsum('ibh,hnd->ibnd')``: heads x head_dim), those rows; and
    a convolution's, whose channels come before its positions, batch x positions."""
    out = record.out_shape
    if record.op in CONVOLUTIONS and len(out) >= 3:
        return out[0] * math.prod(out[2:])
    first = first_matrix(record) or (record.shapes[0] if record.op == "aten::einsum" and record.shapes else ())
    if 2 <= len(first) < len(out) and tuple(out[:len(first) - 1]) == tuple(first[:-1]):
        return math.prod(first[:-1])
    return math.prod(out[:-1]) if out else 0


def first_matrix(record: OpRecord) -> tuple[int, ...]:
    """The shape of a product's first matrix (x in x @ W): the backends record addmm's bias before it, or leave
    it out; ``()`` where the shapes do not say."""
    operands = PRODUCTS[record.op].operands if record.op in PRODUCTS else ()
    first = operands[0] if operands and len(record.shapes) > len(operands) else 0
    return tuple(record.shapes[first]) if operands and len(record.shapes) > first else ()


def width_of(record: OpRecord, result: bool = False) -> int:
    """The columns a product contracts (the last dimension of :func:`first_matrix`), or those of its *result*;
    0 where its shapes do not say."""
    shape = record.out_shape if result else first_matrix(record)
    return shape[-1] if len(shape) >= 2 else 0
