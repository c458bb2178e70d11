"""Which counted ops are attention cores, projections and FFNs, by where their data flows, and the warnings where
the data flow does not square with itself; the user's ``roles=`` replaces the detection (:func:`product_part`).
The rules, their reasons and examples: docs/split.md, "The rule" and "When the data flow does not fit".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .flow import NARROW, Flow, rows, table, width_of
from .ops import OpRecord, ancestors, is_fused, is_product, parent, within
from .request import COMPONENTS

__all__ = ["ROLE_NAMES", "Flow", "Structure", "core_scopes", "find_structure", "product_part", "role_of"]

ROLE_NAMES = ("attention", "ffn")

FFN_FEEDS_CORE_WARNING = ("{module}: {macs:,} MAC placed as {part} feed the attention core in {attention} directly, "
                          "from outside its layer (attention without its own projection?); pass roles= to place them")
SHARED_PROJECTION_WARNING = ("{module}: a projection of the attention in {attention} ({macs:,} MAC, counted as "
                             "attention_proj) also feeds {other}, which is no attention; pass roles= if it is not a "
                             "projection")
NO_PROJECTION_WARNING = ("{attention}: its attention core ({macs:,} MAC) is reached by no parameter product: its Q, K "
                         "and V projections were not found; pass roles= to name them")
CONCATENATED_WARNING = ("{module}: reads the result of the attention in {attention} concatenated with other products' "
                        "results, and its shapes do not tell their columns apart; its {macs:,} MAC are counted as "
                        "attention_proj; pass roles= to place them")
ROLES_HINT = ("pass roles={'attention': ['layers.*.attn'], 'ffn': ['layers.*.mlp']} "
              "with fnmatch globs over the module names")


def _common(scopes: Iterable[str]) -> str:
    """The innermost module enclosing every scope."""
    found: list[str] | None = None
    for scope in scopes:
        chain = ancestors(scope)
        found = chain if found is None else [a for a in chain if a in found]
    return found[0] if found else ""


def core_scopes(records: Sequence[OpRecord]) -> dict[str, None]:
    """The scopes that run an attention core, in graph order."""
    flow = Flow(records)
    return dict.fromkeys(records[i].scope for group in flow.groups for i in group)


@dataclass(frozen=True)
class Projections:
    """One attention call's projections, found by data flow (docs/split.md)."""

    entry: tuple[int, ...]  # results reach the cores' operands
    inner: tuple[int, ...]  # feed only projections (low-rank Q/KV)
    out: tuple[int, ...]  # take the cores' result (O), gates beside it
    # products that read the cores' result concatenated with other products' (Flux's proj_out over [attention,
    # MLP]): (index, the columns the cores' result fills, all its contracted columns); 0 columns: cannot tell
    shared: tuple[tuple[int, int, int], ...] = ()

    @property
    def all(self) -> tuple[int, ...]:
        return (*self.entry, *self.inner, *self.out)


def _projections(flow: Flow, group: list[int], allowed: frozenset[int] | None) -> Projections:
    """The projections of the attention call *group*, among the products *allowed* (None: any).

    Only the products around the call are looked at (what reaches its cores, what their results reach), so
    finding every call's projections costs time in proportion to the model, not to its square."""
    def ok(i: int) -> bool:
        return allowed is None or i in allowed

    records = flow.records
    cores = set(group)
    entry = [i for i in flow.params(sorted({s for c in group for s in records[c].fed_by})) if ok(i)]
    found = set(entry)
    inner: list[int] = []
    frontier = list(entry)
    tokens = query_rows(flow, group, entry)
    matrices, consumers, narrow = flow.matrices, flow.consumers, flow.narrow
    while frontier:  # products that feed only projections of this call are projections (low-rank chains), on
        # the tokens' rows (a modulation of the batch's conditioning that feeds them is conditioning, not a projection)
        user = frontier.pop()
        few = narrow.get(user, [])
        # a product with more consumers than this call can hold is none; while the call and every narrow source
        # together stay within NARROW, the products with more consumers (a residual stream's) need no look
        sources = few if len(found) + len(cores) + len(few) <= NARROW else sorted(
            s for s in records[user].fed_by if s in matrices)
        for i in sources:
            users = consumers[i]
            if i not in found and ok(i) and users and len(users) <= len(found) + len(cores) \
                    and all(u in found or u in cores for u in users) and rows(records[i]) >= tokens:
                found.add(i)
                inner.append(i)
                frontier.append(i)
    fused = _fused_entries(flow, group, entry)
    out, shared = _outputs(flow, group, found, ok, fused) if entry else ([], [])  # no projection in: no guess out
    shared += [(i, attention, width) for i, (attention, width) in fused.items()]
    return Projections(tuple(entry), tuple(sorted(inner)), tuple(dict.fromkeys(out)), tuple(shared))


def _fused_entries(flow: Flow, group: list[int], entry: list[int]) -> dict[int, tuple[int, int]]:
    """Entry projections whose result also feeds products that are no core (ViT-22B's one Linear for Q, K, V and
    the MLP's input) -> (the columns the cores' operands take, all their columns); 0 columns: cannot tell."""
    records, cores = flow.records, set(group)
    found: dict[int, tuple[int, int]] = {}
    for i in entry:
        others = [u for u in flow.consumers[i] if u not in cores]
        if not others or not all(u in flow.matrices for u in others):  # an MLP's input beside Q, K, V
            continue
        tokens, width = rows(records[i]), width_of(records[i], result=True)
        sizes = [math.prod(records[c].shapes[k]) for c in group for k, operand in enumerate(records[c].sources)
                 if i in operand and k < len(records[c].shapes)]
        taken = sum(size // tokens for size in sizes) if tokens and all(size % tokens == 0 for size in sizes) else 0
        found[i] = (taken if 0 < taken < width else 0, width)
    return found


def _outputs(flow: Flow, group: list[int], found: set[int], ok: Callable[[int], bool],
             fused: Mapping[int, tuple[int, int]]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """The products taking the call's result (O, and the gates multiplied into it), and those reading it
    concatenated with other products' results (index, the columns the result fills, all its columns)."""
    records = flow.records
    out: list[int] = []
    shared: list[tuple[int, int, int]] = []
    for i in flow.params(sorted({u for c in group for u in flow.consumers[c]})):
        if i in found or not ok(i):
            continue
        beside = sorted(s for s in records[i].fed_by if s not in flow.group_of)  # feeding only this one
        if not all(s in flow.consumers and records[s].origin == "param" and ok(s) and (
                flow.consumers[s] == [i] or s in fused and [u for u in flow.consumers[s] if u not in group] == [i])
                for s in beside):
            continue
        out.append(i)
        columns = width_of(records[i])
        widths = [fused[s][1] - fused[s][0] if s in fused else width_of(records[s], result=True) for s in beside]
        result = math.prod(records[group[-1]].out_shape) // rows(records[i]) if rows(records[i]) else 0
        if beside and 0 not in widths and result + sum(widths) == columns:
            shared.append((i, result, columns))  # concatenated: their own part, and this one split by its columns
        elif not beside or result == columns and not fused.keys() & set(beside):
            out += [s for s in beside if s not in found]  # gates multiplied into the result (per column or head)
            found.update(beside)
        else:
            shared.append((i, 0, columns))  # beside the result in a way its widths do not tell: warned
    return out, shared


def query_rows(flow: Flow, group: Sequence[int], entry: Iterable[int]) -> int:
    """The rows of an attention call's query projections (of its first core's first operand; of any of its
    projections where that one shows none): the tokens its layer runs on."""
    entry, first = list(entry), flow.records[group[0]]
    queries = [i for i in entry if first.sources and i in first.sources[0]]
    return min((rows(flow.records[i]) for i in queries or entry), default=0)


# --- the structure: layers, their attention and FFNs, and what sits outside ---------------------------


@dataclass(frozen=True)
class Structure:
    """What the data flow and the model's structure say together.

    Attributes:
        layers: the repeated modules (elements of a ModuleList / Sequential) that run attention,
            ``""`` when the whole model is one layer.
        attention: per layer, its attention modules (the modules enclosing each call's cores and projections).
        members: modules that belong to a layer without being inside it (an FFN block after an attention
            block in one list, XLM's ``ffns[i]`` beside ``attentions[i]``) -> the layer.
        outside: attention modules outside every layer (Perceiver IO's cross-attention, attention pooling).
        experts: per experts module, the number of experts.
        bare: elements beside the layers that hold products but run no core (the state-space or recurrent
            layers of a hybrid model): their products, their FFNs included, are ``other``.
        state_space: the state-space mixers (families.state_space_of); one inside an attention layer (Falcon-H1's
            Mamba beside each layer's attention) has its products counted as other, as a bare layer's are.
        parts: per record, its part: ``attention_core``, ``attention_proj``, ``ffn``, ``other``,
            ``conditioning`` (a product of a layer on the batch's conditioning, not on its tokens: counted as other),
            ``state_space`` (a product of a state-space mixer in a layer: counted as other)
            or ``unplaced`` (a product of two activations in a layer that is no core).
        groups: the attention calls (indices of their cores), and where each runs (its attention module).
        warnings: what the data flow could not square with itself (docs/split.md).
        columns: records split by their columns (a projection reading the attention's result concatenated
            with an MLP's, Flux's ``proj_out``; one computing Q, K, V and an MLP's input) -> ``(part, columns)``:
            its MACs go to the parts in proportion to the columns.
    """

    layers: tuple[str, ...] = ()
    attention: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    members: Mapping[str, str] = field(default_factory=dict)
    outside: tuple[str, ...] = ()
    experts: Mapping[str, int] = field(default_factory=dict)
    bare: tuple[str, ...] = ()
    state_space: tuple[str, ...] = ()
    parts: tuple[str, ...] = ()
    groups: tuple[tuple[str, tuple[int, ...]], ...] = ()
    warnings: tuple[str, ...] = ()
    columns: Mapping[int, tuple[tuple[str, int], ...]] = field(default_factory=dict)

    def layer_of(self, scope: str) -> str | None:
        """The layer *scope* runs in (through its members too), or None."""
        for name in ancestors(scope):
            if name in self.members:
                return self.members[name]
            if name in self._layer_set:
                return name
        return None

    @functools.cached_property
    def _layer_set(self) -> frozenset[str]:
        return frozenset(self.layers)

    def roles(self) -> dict[str, str]:
        """Module -> ``attention`` / ``ffn`` (the nearest wins): for the module table and timed ops."""
        assigned: dict[str, str] = {**dict.fromkeys(self.layers, "ffn"), **dict.fromkeys(self.members, "ffn")}
        for modules in (*self.attention.values(), self.outside):
            assigned.update(dict.fromkeys(modules, "attention"))
        return {**assigned, **dict.fromkeys(self.state_space, "other")} if assigned else assigned


def _elements(scope: str, boxes: frozenset[str]) -> list[str]:
    """The elements of containers enclosing *scope*, innermost first."""
    return [a for a in ancestors(scope) if a and parent(a) in boxes]


def _layers(homes: list[str], beside: frozenset[str], boxes: frozenset[str]) -> list[str | None]:
    """Each attention call's layer: the innermost container element enclosing it that holds products *beside* the
    projections, else (attention-only stacks) the outermost; None outside any. Without container elements, the
    innermost module with such products, else the whole model."""
    found = [next((e for e in elements if e in beside), elements[-1] if elements else None)
             for elements in (_elements(home, boxes) for home in homes)]
    if homes and all(layer is None for layer in found):
        found = [next((a for a in ancestors(home) if a != home and a in beside), "") for home in homes]
    return found


def _small_mlp(element: str, flow: Flow) -> bool:
    """An element that is an FFN block: a few parameter products and no product of two activations."""
    inside = flow.under.get(element, [])
    return 0 < len(inside) <= 3 and all(flow.records[i].origin == "param" for i in inside)


def _index(name: str) -> tuple[int, str]:
    last = name.rpartition(".")[2]
    return (int(last), "") if last.isdigit() else (0, last)


def _members(flow: Flow, layers: dict[str, None], boxes: frozenset[str], beside: frozenset[str],
             cross: dict[str, bool]) -> tuple[dict[str, str], list[str]]:
    """Blocks that belong to attention-only layers without being inside them (an FFN or cross-attention block
    joins the layer before it, x-transformers; element i of a list beside the layers' joins layer i, XLM's
    ``ffns``), and the bare elements of hybrids: beside layers with their own FFN (*beside*), three products or
    more and no core (a state-space or recurrent layer)."""
    members: dict[str, str] = {}
    bare: list[str] = []
    under = flow.under
    cores = flow.attending

    def children(module: str) -> list[str]:
        scopes = {flow.records[i].scope for i in under.get(module, [])}
        return sorted({_child(module, s) for s in scopes if s != module}, key=_index)

    for container in dict.fromkeys(parent(layer) for layer in layers if layer and parent(layer) in boxes):
        mine = sorted((layer for layer in layers if parent(layer) == container), key=_index)
        elements = children(container)
        if any(layer in beside for layer in mine):
            bare += [e for e in elements if e not in layers and e not in cores and len(under.get(e, [])) >= 3]
            continue
        owner: str | None = None
        for element in elements:
            if element in layers and not (cross.get(element) and owner is not None):
                owner = element
            elif owner is not None and (element in layers or _small_mlp(element, flow)):
                members[element] = owner
        for sibling in sorted(b for b in boxes if container and b != container and parent(b) == parent(container)):
            others = children(sibling)
            indices = [e.rpartition(".")[2] for e in others]
            if indices == [m.rpartition(".")[2] for m in mine] and sibling not in cores and all(
                    len(under.get(e, [])) >= 2 for e in others):
                members.update(zip(others, mine))
    return members, bare


def _child(module: str, scope: str) -> str:
    """The direct child of *module* on the way down to *scope*."""
    rest = scope[len(module) + 1:] if module else scope
    head = rest.split(".", 1)[0]
    return f"{module}.{head}" if module else head


def find_structure(records: Sequence[OpRecord], containers: Iterable[str], experts: Mapping[str, int] | None = None,
                   outputs: Iterable[Iterable[int]] = (), state_space: Iterable[str] = ()) -> Structure:
    """Layers, attention calls, projections and FFNs of a count, by data flow and structure (docs/split.md);
    *outputs*: per output of the model, the products whose results reach it (``RawCount.outputs``);
    *state_space*: modules whose products of two activations are no attention (Mamba-2's scan)."""
    flow = Flow(records, frozenset(state_space))
    boxes = frozenset(containers)
    homes = [_common(records[i].scope for i in group) for group in flow.groups]
    found = [_projections(flow, group, None) for group in flow.groups]
    candidates = {i for p in found for i in p.all} | set(flow.group_of)
    beside = flow.holders(i for i in flow.matrices if i not in candidates)  # modules with products beside attention
    layer_of = _layers(homes, beside, boxes)
    layers = dict.fromkeys(layer for layer in layer_of if layer is not None)
    # cross-attention layers: every call's entry projections read different inputs (queries, keys from another)
    cross = {layer: all(len({records[i].fed_by for i in p.entry}) > 1 for p, at in zip(found, layer_of) if at == layer)
             for layer in layers}
    members, bare = _members(flow, layers, boxes, beside, cross)
    layers = {layer: None for layer in layers if layer not in members}
    structure = Structure(layers=tuple(layers), members={m: members.get(o, o) for m, o in members.items()},
                          experts=dict(experts or {}), bare=tuple(bare), state_space=tuple(sorted(flow.apart)))
    layer_at = {i: structure.layer_of(records[i].scope) for i in flow.products}
    inside = {i for i, layer in layer_at.items() if layer is not None}
    regions: dict[str | None, set[int]] = {}
    for i, layer in layer_at.items():
        regions.setdefault(layer, set()).add(i)
    projections: list[Projections] = []
    attention: dict[str, dict[str, None]] = {}
    outside: dict[str, None] = {}
    groups: list[tuple[str, tuple[int, ...]]] = []
    for group, home in zip(flow.groups, homes):
        layer = structure.layer_of(home)
        mine = _projections(flow, group, frozenset(regions.get(layer, ())))
        projections.append(mine)
        module = _common(records[i].scope for i in (*group, *mine.all))
        if layer is not None and not within(module, layer):
            module = layer
        (attention.setdefault(layer, {}) if layer is not None else outside)[module] = None
        groups.append((module, tuple(group)))
    structure = dataclasses.replace(structure, attention={layer: tuple(m) for layer, m in attention.items()},
                                    outside=tuple(outside), groups=tuple(groups))
    outs = {i for p, (module, _) in zip(projections, groups) if module in outside for i in p.out}
    placed = {i for p in projections for i in p.all}
    free = [i for i in flow.params(flow.products) if i not in inside and i not in placed]
    block_ffn = _outside_ffn(flow, free, outs, [frozenset(output) for output in outputs])
    parts, columns = _parts(flow, structure, projections, inside, block_ffn)
    warnings = tuple(_flow_warnings(flow, projections, parts, groups))
    return dataclasses.replace(structure, parts=parts, columns=columns, warnings=warnings)


def _parts(flow: Flow, structure: Structure, projections: list[Projections], inside: set[int], block_ffn: set[int]
           ) -> tuple[tuple[str, ...], dict[int, tuple[tuple[str, int], ...]]]:
    """Each record's part (see :attr:`Structure.parts`), and the records split by their columns
    (:attr:`Structure.columns`); *inside*: the products in the layers, *block_ffn*: those of FFNs of attention
    blocks outside them."""
    records = flow.records
    parts = ["other"] * len(records)
    tokens: dict[str | None, int] = {}  # layer -> the fewest rows its attention's queries have
    for group, mine, (module, _) in zip(flow.groups, projections, structure.groups):
        for i in group:
            parts[i] = "attention_core"
        for i in mine.all:
            parts[i] = "attention_proj"
        layer, count = structure.layer_of(module), query_rows(flow, group, mine.entry)
        tokens[layer] = min(tokens.get(layer, count), count)
    bare = frozenset(structure.bare)
    for i in flow.products:
        record = records[i]
        if parts[i] != "other" or not bare.isdisjoint(ancestors(record.scope)):
            continue
        if i in inside and flow.apart_at(i):
            parts[i] = "state_space"
        elif i in inside:
            layer = structure.layer_of(record.scope)
            parts[i] = _leftover(flow, i, parts, tokens.get(layer, 0), _wrapper_part(flow, i, parts, structure))
        elif i in block_ffn:
            parts[i] = "ffn"
    columns: dict[int, tuple[tuple[str, int], ...]] = {}
    for mine in projections:
        fused = {i for i, _, _ in mine.shared if i in mine.entry}
        for i, attention, width in mine.shared:
            # what the rest of the columns feed (an entry's: the MLP beside the attention) or come from
            sources = [s for s in sorted(records[i].fed_by) if s not in flow.group_of]
            beside = "ffn" if i in fused or fused & set(sources) else next((parts[s] for s in sources), "other")
            if attention:  # the columns, not their MACs: one structure serves every length of a one-run sweep
                columns[i] = (("attention_proj", attention), (_plain(beside), width - attention))
    roles = structure.roles()
    for i, record in enumerate(records):
        if record.backward_of is not None and record.backward_of >= 0:
            parts[i] = parts[record.backward_of]  # a gradient is placed with the product it differentiates
            if record.backward_of in columns:  # and split as it is
                columns[i] = columns[record.backward_of]
        elif record.backward_of is not None and (is_product(record.op) or is_fused(record.op)):
            part = product_part(role_of(record.scope, roles), is_fused(record.op), record.origin, False)
            parts[i] = "other" if part == "unplaced" else part
    return tuple(parts), columns


def _adapted(flow: Flow, i: int) -> int | None:
    """The product that *i* adapts, where it is the second half of a low-rank adapter (LoRA's B): fed only by a
    narrow product A that reads what a product W reads, while *i* writes what W writes, to the same consumers."""
    records = flow.records
    if len(records[i].fed_by) != 1 or not records[i].out_shape:
        return None
    (source,) = records[i].fed_by
    down, width = records[source], records[i].out_shape[-1]
    rank = down.out_shape[-1] if down.out_shape else 0
    if down.origin != "param" or not 0 < rank < min(width_of(down), width):
        return None
    consumers = set(flow.consumers[i])
    return next((w for w in flow.readers.get(down.fed_by, ()) if w not in (i, source)
                 and records[w].out_shape[-1:] == (width,) and set(flow.consumers[w]) == consumers), None)


def _plain(part: str) -> str:
    """A part as the split sums it (conditioning and unplaced products are counted as other)."""
    return part if part in COMPONENTS else "other"


def _wrapper_part(flow: Flow, i: int, parts: Sequence[str], structure: Structure) -> str | None:
    """The part of the placed products of the nearest module around *i* below its layer that runs no core, where
    they are of one part (peft's LoRA layer beside ``base_layer``; DoRA runs them on an identity matrix)."""
    layer = structure.layer_of(flow.records[i].scope)
    if layer is None:
        return None
    attention = set(structure.attention.get(layer, ()))
    for module in ancestors(flow.records[i].scope)[1:]:
        if module == layer or module in attention or not within(module, layer) or module in flow.attending:
            return None
        placed = {parts[j] for j in flow.under.get(module, ()) if j != i and parts[j] in ("attention_proj", "ffn")}
        if placed:
            return placed.pop() if len(placed) == 1 else None
    return None


def _leftover(flow: Flow, i: int, parts: Sequence[str], tokens: int, wrapped: str | None) -> str:
    """The part of a product in a layer that is no core or projection of its attention: a parameter product is
    FFN on the tokens' rows, ``conditioning`` on fewer (adaLN modulation); an adapter's B or a product inside a
    wrapper (*wrapped*) takes the part of what it adapts (docs/split.md, "The rule", 3)."""
    record = flow.records[i]
    if record.origin != "param":
        return "other" if record.origin == "buffer" else "unplaced"
    if table(record):
        return "other"
    adapted = _adapted(flow, i)
    if adapted is not None and parts[adapted] != "other":
        return parts[adapted]
    if wrapped is not None:
        return wrapped
    return "conditioning" if rows(record) < tokens else "ffn"


def _outside_ffn(flow: Flow, free: list[int], outs: set[int], outputs: list[frozenset[int]]) -> set[int]:
    """The FFNs of attention blocks outside the layers: chains of parameter products that take an outside
    attention's result and meet it again later, in a product or in one of the model's outputs (a residual around
    them). A head that takes the result and never meets it again is no FFN."""
    records = flow.records
    found: set[int] = set()
    for start in free:
        if start in found or not records[start].fed_by & outs:
            continue
        chain, frontier = {start}, [start]
        while frontier:
            for user in flow.consumers[frontier.pop()]:
                if user in free and user not in chain and records[user].fed_by <= chain:
                    chain.add(user)
                    frontier.append(user)
        meetings = [records[user].fed_by for i in chain for user in flow.consumers[i] if user not in chain]
        if any(sources & outs for sources in [*meetings, *(output for output in outputs if output & chain)]):
            found |= chain
    return found


def _flow_warnings(flow: Flow, projections: list[Projections], parts: Sequence[str],
                   groups: Sequence[tuple[str, tuple[int, ...]]]) -> list[str]:
    """The data flow's checks on itself (docs/split.md)."""
    records = flow.records
    found: list[str] = []
    for (module, group), mine in zip(groups, projections):
        where = module or "the model"
        found += [FFN_FEEDS_CORE_WARNING.format(module=records[i].scope, macs=records[i].macs, part=parts[i],
                                                attention=where)
                  for i in flow.params({s for c in group for s in records[c].fed_by})
                  if parts[i] in ("ffn", "other", "conditioning")]
        if not mine.entry:
            found.append(NO_PROJECTION_WARNING.format(attention=where, macs=sum(records[i].macs for i in group)))
        found += [CONCATENATED_WARNING.format(module=records[i].scope, macs=records[i].macs, attention=where)
                  for i, attention, _ in mine.shared if not attention and i not in mine.entry]
        split = {i for i, attention, _ in mine.shared if attention}
        for i in mine.entry:
            users = [u for u in flow.consumers[i] if parts[u] not in ("attention_core", "attention_proj")]
            if users and i not in split:
                found.append(SHARED_PROJECTION_WARNING.format(module=records[i].scope, attention=where,
                                                              macs=records[i].macs, other=records[users[0]].scope))
    return list(dict.fromkeys(found))


# --- roles given by the user ------------------------------------------------------------------------


def role_of(scope: str, roles: Mapping[str, str]) -> str | None:
    """The role of the nearest enclosing module that has one."""
    return next((roles[name] for name in ancestors(scope) if name in roles), None)


def product_part(role: str | None, fused: bool, origin: str, explicit: bool) -> str:
    """Where a matrix product (or a fused attention op) goes, given its module's role: a part, or ``unplaced`` (a
    product of two activations in an FFN module: counted as other, warned about). With the user's ``roles=``
    (*explicit*) a fused attention op is a core wherever it runs and every product in an FFN module is FFN."""
    if fused:
        return "attention_core" if role == "attention" or explicit else "other"
    if role == "attention":
        return {"param": "attention_proj", "buffer": "other"}.get(origin, "attention_core")
    if role == "ffn":
        return "ffn" if explicit else {"param": "ffn", "buffer": "other"}.get(origin, "unplaced")
    return "other"
