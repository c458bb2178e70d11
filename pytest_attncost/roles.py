"""Split counted ops into attention_core, attention_proj, ffn and other — from structure.

The layers are found from the model's structure, not from class names
(:func:`find_structure`): the repeated modules (elements of a ``ModuleList`` /
``Sequential``) that run an attention core — a fused attention op, or two chained
products of activations (QK^T then AV). Inside a layer:

* the children that run a core are its attention modules: there a product of two
  activations is ``attention_core``, a product with a parameter ``attention_proj``, a
  product with a buffer (rotary tables) ``other``;
* every other parameter product in the layer is ``ffn``, whatever the classes are
  called (fc1/fc2 on the layer, ``nn.Sequential``, 1x1 convolutions, experts, routers);
  a router of a mixture of experts is also counted in ``ffn_router``;
* a product of two activations outside the attention modules cannot be placed: it is
  ``other`` and listed in :attr:`Split.unplaced`.

Everything outside the layers (embeddings, poolers, heads, attention-pooling heads) is
``other``. ``roles={"attention": [globs], "ffn": [globs]}`` (fnmatch over dotted module
names) replaces the detection.
"""

from __future__ import annotations

import fnmatch
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .errors import ProfileError
from .formulas import ModelSpec
from .ops import SDPA_OPS, OpRecord, ancestors, is_fused, is_product

__all__ = ["ROLE_NAMES", "Split", "Structure", "core_scopes", "explicit_roles", "find_structure",
           "product_part", "split", "structure_warnings"]

ROLE_NAMES = ("attention", "ffn")

#: Warnings on a profile: the cause, the module and the MACs concerned (see DECISIONS: plain strings).
UNPLACED_WARNING = ("{module}: {macs:,} MAC of products of two activations outside the layer's attention "
                    "module(s) could not be placed (counted as other); pass roles= to place them")


INLINE_WARNING = ("{module}: attention runs in the layer's own forward (no attention submodule), so its "
                  "projections and FFN cannot be told apart; all {macs:,} parameter MAC counted as attention_proj; "
                  "pass roles= to name the FFN")


NO_FFN_WARNING = ("{module}: the layer has attention but no FFN product, while the spec says ffn_dim={ffn_dim}; "
                  "its FFN was not found (counted as other?); pass roles=")


NO_CORE_WARNING = ("no attention core was counted ({modules}): the attention ran no product the counter knows; "
                   "see unsupported_ops")


UNKNOWN_MASK_WARNING = ("{module}: causal='half' asked for, but the mask of {macs:,} core MAC has a form the plugin "
                        "cannot tell; counted in full")


BARE_WARNING = ("{modules}: {count} layer(s) beside the attention layers ran no attention core; their {macs:,} MAC "
                "(their FFNs included) are counted as other; pass roles= to place them")

ROLES_HINT = (
    "pass roles={'attention': ['layers.*.attn'], 'ffn': ['layers.*.mlp']} "
    "with fnmatch globs over the module names"
)



@dataclass
class Split:
    """Counted MACs by role, plus what the attention saw and what could not be placed."""

    attention_core: int = 0
    attention_proj: int = 0
    ffn: int = 0
    ffn_router: int = 0  # part of ffn: the routers of mixture-of-experts layers
    other: int = 0
    attention_modules: list[str] = field(default_factory=list)
    # (queries, keys, batch x heads) per core op group of the layers, in graph order
    lengths: list[tuple[int, int, int]] = field(default_factory=list)
    halved: bool = False  # causal self-attention was counted as a half triangle
    layer_ffn: dict[str, int] = field(default_factory=dict)  # layer -> its ffn MACs
    unplaced: dict[str, int] = field(default_factory=dict)  # module -> MACs the split could not place
    unknown_masks: dict[str, int] = field(default_factory=dict)  # module -> core MACs under a mask of unknown form


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _within(scope: str, module: str) -> bool:
    return module == "" or scope == module or scope.startswith(module + ".")


def _child_towards(module: str, scope: str) -> str:
    """The direct child of *module* on the way down to *scope* (*module* itself if they are equal)."""
    if scope == module:
        return module
    rest = scope[len(module) + 1 :] if module else scope
    head = rest.split(".", 1)[0]
    return f"{module}.{head}" if module else head


def _is_product(record: OpRecord) -> bool:
    return is_product(record.op)


def _is_fused(record: OpRecord) -> bool:
    return is_fused(record.op)


def _common(first: str, second: str) -> str:
    """The innermost module enclosing both scopes."""
    enclosing = set(ancestors(first))
    return next(a for a in ancestors(second) if a in enclosing)


def core_scopes(records: Sequence[OpRecord]) -> dict[str, None]:
    """Scopes that run an attention core: a fused attention op, or two chained products of activations.

    Chained: a later activation x activation product takes the earlier one's output shape as an
    operand (QK^T [.., n, m] then probabilities [.., n, m] @ V; linear attention's K^T V [.., d, d]
    then Q @ (K^T V)), in the same module or in two sibling modules without parameters of one
    attention module (SqueezeBERT's ``matmul_qk`` / ``matmul_qkv``), which is then the scope; or two products of
    activation matrices in a module with at least three parameter products of its own (banded
    attention). A product of activations yielding vectors (a state-space scan step) is not attention.
    """
    found: dict[str, None] = {}
    outputs: dict[str, set[tuple[int, ...]]] = {}
    matrices: dict[str, int] = {}
    previous: OpRecord | None = None
    param_scopes = [r.scope for r in records if _is_product(r) and r.origin == "param"]
    for record in records:
        if _is_fused(record):
            found.setdefault(record.scope, None)
            continue
        if not (_is_product(record) and record.origin == "activation"):
            continue
        if any(shape in outputs.get(record.scope, ()) for shape in record.shapes):
            found.setdefault(record.scope, None)
        elif previous is not None and previous.out_shape and previous.out_shape in record.shapes:
            common = _common(previous.scope, record.scope)
            wrappers = not any(_within(p, previous.scope) or _within(p, record.scope) for p in param_scopes)
            if common and wrappers and common in (_parent(previous.scope), _parent(record.scope)):
                found.setdefault(common, None)
        if record.out_shape:
            outputs.setdefault(record.scope, set()).add(record.out_shape)
        if len(record.out_shape) >= 2 and min(record.out_shape[-2:]) > 1:
            matrices[record.scope] = matrices.get(record.scope, 0) + 1
        previous = record
    # Banded and chunked attention (Longformer) reshapes its scores between QK^T and AV: two
    # products of activation matrices in one module that has its own Q, K and V projections.
    for scope, count in matrices.items():
        if count >= 2 and scope not in found and sum(_within(p, scope) for p in param_scopes) >= 3:
            found[scope] = None
    return found


@dataclass(frozen=True)
class Structure:
    """What the model's structure says: its layers, their attention modules, and what sits outside.

    Attributes:
        layers: the repeated modules (elements of a ModuleList / Sequential) that run attention,
            ``""`` when the whole model is one layer.
        attention: per layer, its children that run an attention core (the layer itself when
            the attention runs in the layer's own forward).
        inline: layers whose attention runs in their own forward: their projections and FFN
            cannot be told apart.
        outside: modules outside every layer that run attention (attention-pooling heads).
        routers: per experts module, the number of experts.
        bare: elements of the layers' containers that hold parameter products but run no attention
            core (the state-space or recurrent layers of a hybrid model): their products count as
            ``other``, their FFNs included.
        parallel: elements of a list beside the attention layers' list, one per layer, that hold
            parameter products and no attention (XLM's ``ffns`` beside its ``attentions``): the FFNs.
    """

    layers: tuple[str, ...] = ()
    attention: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    inline: tuple[str, ...] = ()
    outside: tuple[str, ...] = ()
    experts: Mapping[str, int] = field(default_factory=dict)
    bare: tuple[str, ...] = ()
    parallel: tuple[str, ...] = ()
    paired: tuple[str, ...] = ()  # layers whose FFN is a parallel element

    def roles(self) -> dict[str, str]:
        """Module -> role: every layer is ``ffn`` except its attention children (nearest role wins)."""
        assigned: dict[str, str] = dict.fromkeys(self.parallel, "ffn")
        for layer in self.layers:
            assigned[layer] = "attention" if layer in self.inline else "ffn"
            for module in self.attention.get(layer, ()):
                assigned[module] = "attention"
        return assigned


def find_structure(
    records: Sequence[OpRecord], containers: Iterable[str], experts: Mapping[str, int] | None = None
) -> Structure:
    """Layers and attention modules from the module tree and the counted ops (no class names).

    A layer is the innermost element of a ``ModuleList`` / ``Sequential`` above an attention core
    that also holds parameter products beside the child running the core (its FFN: a Swin stage
    holds blocks, a T5 block holds a list of sublayers, a GPT block holds a list of heads);
    failing that (attention-only stacks), the outermost such element. Without any such element, the innermost module with
    parameter products beside its attention child; failing that, the whole model.
    """
    # long: the layer, attention, hybrid and parallel-list rules read one another's findings in one place
    boxes = frozenset(containers)

    def child_of(module: str, scope: str) -> str:
        # through containers: T5's block.0.layer (a ModuleList) holds layer.0 (attention) and layer.1 (FFN)
        child = _child_towards(module, scope)
        while child in boxes and child != scope:
            child = _child_towards(child, scope)
        return child

    cores = core_scopes(records)
    param_scopes = [r.scope for r in records if _is_product(r) and r.origin == "param"]
    beneath: dict[str, list[str]] = {}  # module -> the parameter products' scopes within it (repeats kept)
    for p in param_scopes:
        for a in ancestors(p):
            beneath.setdefault(a, []).append(p)
    layer_of: dict[str, str | None] = {}
    for scope in cores:
        elements = [a for a in ancestors(scope) if a and _parent(a) in boxes]  # innermost first
        chosen: str | None = None
        for element in elements:
            child = child_of(element, scope)
            if child != element and any(not _within(p, child) for p in beneath.get(element, ())):
                chosen = element
                break
        if chosen is None and elements:
            chosen = elements[-1]  # an attention-only stack: the outermost element
        layer_of[scope] = chosen
    if not any(layer is not None for layer in layer_of.values()):
        # no stack of layers: the innermost module with an FFN beside its attention, else the model
        for scope in cores:
            layer_of[scope] = next(
                (a for a in ancestors(scope) if (child := child_of(a, scope)) != a
                 and any(not _within(p, child) for p in beneath.get(a, ()))),
                "",
            )
    layers: dict[str, None] = {}
    attention: dict[str, dict[str, None]] = {}
    inline: dict[str, None] = {}
    outside: dict[str, None] = {}
    for scope, layer in layer_of.items():
        if layer is None:
            outside.setdefault(scope, None)
            continue
        layers.setdefault(layer, None)
        child = child_of(layer, scope)
        if child == layer:
            inline.setdefault(layer, None)
        attention.setdefault(layer, {}).setdefault(child, None)
    bare: dict[str, None] = {}
    parallel: dict[str, None] = {}
    paired: dict[str, None] = {}
    for container in dict.fromkeys(_parent(layer) for layer in layers if layer and _parent(layer) in boxes):
        mine = [layer for layer in layers if _parent(layer) == container]
        indices = sorted(layer[len(container) + 1 if container else 0:] for layer in mine)
        for sibling in sorted(boxes) if container else ():  # the root's list has no sibling lists
            if sibling == container or _parent(sibling) != _parent(container):
                continue
            found = Counter(_child_towards(sibling, p) for p in beneath.get(sibling, ()) if p != sibling)
            names = sorted(e[len(sibling) + 1 if sibling else 0:] for e in found)
            # XLM's ffns[i] beside attentions[i]: one MLP (two products or more) per layer, no attention; and
            # layers whose own parameter products are no more than an attention's projections (Q, K, V, O)
            if (names == indices and min(found.values()) >= 2 and not any(_within(c, sibling) for c in cores)
                    and all(len(beneath.get(layer, ())) <= 4 for layer in mine)):
                parallel.update(dict.fromkeys(sorted(found)))
                inline = {layer: None for layer in inline if _parent(layer) != container}
                paired.update(dict.fromkeys(mine))
        # elements beside the layers that run no attention but hold a layer's worth of products (a mixer
        # and an MLP: three or more); a head or a norm kept in the same list is not a layer
        others = Counter(_child_towards(container, p) for p in beneath.get(container, ()) if p != container)
        for element, products in others.items():
            if element not in layers and products >= 3 and not any(_within(c, element) for c in cores):
                bare.setdefault(element, None)
    return Structure(
        layers=tuple(layers),
        attention={layer: tuple(children) for layer, children in attention.items()},
        inline=tuple(inline),
        outside=tuple(outside),
        experts=dict(experts or {}),
        bare=tuple(bare),
        parallel=tuple(parallel),
        paired=tuple(paired),
    )


def explicit_roles(roles: Mapping[str, Iterable[str]], names: Sequence[str]) -> dict[str, str]:
    """Roles from the user's globs. Every glob must match at least one module."""
    if not isinstance(roles, Mapping):
        raise ProfileError(f"roles must be a dict such as {{'attention': [...], 'ffn': [...]}}, got {roles!r}")
    unknown = sorted(set(roles) - set(ROLE_NAMES))
    if unknown:
        raise ProfileError(f"unknown role {unknown[0]!r} in roles=; valid roles: {', '.join(ROLE_NAMES)}")
    assigned: dict[str, str] = {}
    for role in ROLE_NAMES:
        globs = roles.get(role, [])
        if isinstance(globs, str):
            globs = [globs]
        for glob in globs:
            if not isinstance(glob, str):
                raise ProfileError(f"roles[{role!r}] must hold strings (module-name globs), got {glob!r}")
            matched = [name for name in names if fnmatch.fnmatchcase(name, glob)]
            if not matched:
                shown = ", ".join(repr(n) for n in names if n)[:400] or "(none)"
                raise ProfileError(f"roles[{role!r}] glob {glob!r} matches no module; module names are: {shown}")
            for name in matched:
                assigned.setdefault(name, role)
    return assigned


def role_of(scope: str, roles: Mapping[str, str]) -> str | None:
    """The role of the nearest enclosing module that has one."""
    name = scope
    while True:
        role = roles.get(name)
        if role is not None:
            return role
        if name == "":
            return None
        name = _parent(name)


def _lengths(group: list[OpRecord]) -> tuple[int, int, int] | None:
    """(queries, keys, batch x heads) seen by one attention module's core ops.

    Softmax attention's scores ``[.., n, m]`` feed AV as its first operand; otherwise the last
    core product's output is ``[.., n, d]`` (linear attention's Q (K^T V), fused attention); the keys are sdpa's
    ``k`` length, or the columns of the first product's output (QK^T: ``[.., n, m]``).
    """
    first, last = group[0], group[-1]
    if len(last.out_shape) < 2:
        return None
    queries, leading = last.out_shape[-2], math.prod(last.out_shape[:-2])
    if not _is_fused(first) and len(group) > 1 and len(first.out_shape) >= 2 and last.shapes[:1] == (first.out_shape,):
        # scores [.., n, m] @ V: the scores know n whatever layout the output takes (einsum "bqhd")
        queries, leading = first.out_shape[-2], math.prod(first.out_shape[:-2])
    if first.op in SDPA_OPS and len(first.shapes) >= 2 and len(first.shapes[1]) >= 2:
        keys = first.shapes[1][-2]
    elif len(first.out_shape) >= 2:
        keys = first.out_shape[-1]
    else:
        keys = queries
    return queries, keys, leading


def _causal(scope: str, causal_modules: frozenset[str]) -> bool:
    name = scope
    while True:
        if name in causal_modules:
            return True
        if name == "":
            return False
        name = _parent(name)


def _half(record: OpRecord) -> int:
    """The MACs of the n(n+1)/2 query-key pairs a causal mask keeps, for a self-attention core op."""
    if len(record.shapes) < 2 or any(len(s) < 2 for s in record.shapes[:2]):
        return record.macs
    first, second = record.shapes[0], record.shapes[1]
    n = first[-2]
    if record.op in SDPA_OPS:
        self_attention = second[-2] == n
    else:  # QK^T: [n, d] @ [d, n]; AV and the backward products: [n, n] @ [n, d]
        self_attention = second[-1] == n or first[-1] == n
    if not self_attention or record.macs % (n * n):
        return record.macs
    # every product over the n x n pairs is MACs = B * n * n * k; keep B * k * n(n+1)/2
    return record.macs // n * (n + 1) // 2


def _router(record: OpRecord, experts: Mapping[str, int]) -> bool:
    """A parameter product beside an experts module, in its mixture block, with one output per expert."""
    if not record.out_shape:
        return False
    for module, count in experts.items():
        block = _parent(module)
        if _within(record.scope, block) and not _within(record.scope, module) and record.out_shape[-1] == count:
            return True
    return False


def product_part(role: str | None, fused: bool, origin: str, explicit: bool) -> str:
    """Where a matrix product (or a fused attention op) goes, given its module's role.

    ``attention_core``, ``attention_proj``, ``ffn``, ``other``, or ``unplaced``: a product of two
    activations in an FFN found by structure, which no rule can place (counted as ``other`` and
    warned about). With the user's ``roles=`` (*explicit*) a fused attention op is a core wherever
    it runs and every product in an FFN module is FFN. Shared by the split and by measured time.
    """
    if fused:
        return "attention_core" if role == "attention" or explicit else "other"
    if role == "attention":
        return {"param": "attention_proj", "buffer": "other"}.get(origin, "attention_core")
    if role == "ffn":
        return "ffn" if explicit else {"param": "ffn", "buffer": "other"}.get(origin, "unplaced")
    return "other"


def split(
    records: Iterable[OpRecord],
    roles: Mapping[str, str],
    causal_modules: frozenset[str] | None = None,
    structure: Structure | None = None,
    bidirectional: frozenset[str] = frozenset(),
) -> Split:
    """Sum the records by role; with *causal_modules* (``causal="half"``), core ops of causal
    self-attention count the half triangle: those of these modules, and those whose record
    says they ran under a causal mask.

    *roles* maps modules to ``attention`` / ``ffn`` (nearest enclosing module wins). With a
    *structure* (automatic detection) the rules are strict: a fused attention op outside the
    attention modules is ``other`` (an attention-pooling head), and a product of two
    activations outside them cannot be placed (``other``, listed in ``Split.unplaced``). With
    the user's ``roles=`` a fused attention op is a core wherever it runs. Cores of *bidirectional*
    modules (``is_causal=False``: an encoder's padding mask or position bias) stay in full without a word.
    """
    # long: one pass over the records; routers, roots, layers and groups are looked up once per scope in it
    result = Split()
    seen_modules: dict[str, None] = {}
    groups: list[tuple[str, list[OpRecord]]] = []
    layers = structure.layers if structure is not None else ()
    experts = structure.experts if structure is not None else {}
    records = list(records)
    # a router's module: its backward products (train mode) belong to it too
    routers = {r.scope for r in records if experts and _is_product(r) and r.origin == "param" and _router(r, experts)}
    role_at: dict[str, str | None] = {}  # per scope: records share scopes, roles are per module
    layer_at: dict[str, str | None] = {}
    root_at: dict[str, str] = {}
    for record in records:
        role = role_at.get(record.scope, "")
        if role == "":
            role = role_at[record.scope] = role_of(record.scope, roles)
        macs = record.macs
        router = False
        if _is_fused(record) or _is_product(record):
            bucket = product_part(role, _is_fused(record), record.origin, explicit=structure is None)
            router = bucket == "ffn" and record.scope in routers  # routers: only with a structure
        else:
            bucket = "other"
        if bucket == "unplaced":
            result.unplaced[record.scope] = result.unplaced.get(record.scope, 0) + macs
            bucket = "other"
        if bucket == "attention_core" and causal_modules is not None:
            mask = getattr(record, "mask", "")
            if mask == "causal" or _causal(record.scope, causal_modules):
                halved = _half(record)
                result.halved |= halved != macs
                macs = halved
            elif mask == "unknown" and not _causal(record.scope, bidirectional):  # bidirectional: full is right
                result.unknown_masks[record.scope] = result.unknown_masks.get(record.scope, 0) + macs
        setattr(result, bucket, getattr(result, bucket) + macs)
        if router:
            result.ffn_router += macs
        if bucket == "ffn" and layers:
            if record.scope not in layer_at:
                layer_at[record.scope] = next((name for name in layers if _within(record.scope, name)), None)
            layer = layer_at[record.scope]
            if layer is not None:
                result.layer_ffn[layer] = result.layer_ffn.get(layer, 0) + macs
        if role == "attention":
            if record.scope not in root_at:
                root_at[record.scope] = _attention_root(record.scope, roles)
            root = root_at[record.scope]
            seen_modules.setdefault(root, None)
        else:
            root = record.scope
        if bucket == "attention_core":
            # consecutive core ops of one module call form a group (QK^T then AV)
            if groups and groups[-1][0] == root and not _is_fused(record):
                groups[-1][1].append(record)
            else:
                groups.append((root, [record]))
    result.attention_modules = list(seen_modules)
    for _, group in groups:
        lengths = _lengths(group)
        if lengths is not None:
            result.lengths.append(lengths)
    return result


def _attention_root(scope: str, roles: Mapping[str, str]) -> str:
    """The outermost attention module enclosing *scope*."""
    found = scope
    name = scope
    while True:
        if roles.get(name) == "attention":
            found = name
        if name == "":
            return found
        name = _parent(name)


def structure_warnings(parts: Split, structure: Structure | None, records: Sequence[OpRecord], spec: ModelSpec | None,
                       name: str) -> list[str]:
    """What makes a split doubtful, each naming the module, the MACs and the cause."""
    found = [UNPLACED_WARNING.format(module=module, macs=macs) for module, macs in parts.unplaced.items()]
    found += [UNKNOWN_MASK_WARNING.format(module=module, macs=macs) for module, macs in parts.unknown_masks.items()]
    if structure is not None:
        for layer in structure.inline:
            if spec is None or spec.ffn_dim > 0:
                macs = sum(r.macs for r in records if r.origin == "param" and _within(r.scope, layer))
                found.append(INLINE_WARNING.format(module=layer or name, macs=macs))
        if spec is not None and (spec.ffn_dim > 0 or spec.moe):
            found += [NO_FFN_WARNING.format(module=layer or name, ffn_dim=spec.ffn_dim)
                      for layer in structure.layers if layer not in structure.inline and layer not in structure.paired
                      and not parts.layer_ffn.get(layer)]
        if structure.bare:
            macs = sum(r.macs for r in records if any(_within(r.scope, b) for b in structure.bare))
            shown = ", ".join(structure.bare[:3]) + (", ..." if len(structure.bare) > 3 else "")
            found.append(BARE_WARNING.format(modules=shown, count=len(structure.bare), macs=macs))
    if parts.attention_modules and parts.attention_core == 0 and (spec is None or spec.heads):
        found.append(NO_CORE_WARNING.format(modules=", ".join(parts.attention_modules[:3])))
    return found
