"""A count's records summed into attention_core, attention_proj, ffn and other, by the structure
:mod:`pytest_attncost.roles` finds or by the user's ``roles=``, causal cores as ``causal=`` says; and the
split's warnings and notes.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ProfileError
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .flow import Flow
from .formulas import ModelSpec, kept_pairs
from .ops import SDPA_OPS, OpRecord, ancestors, is_fused, is_product, parent, within
from .roles import ROLE_NAMES, Structure, product_part, role_of

__all__ = ["Causal", "Split", "explicit_roles", "outside_note", "split", "split_notes", "structure_warnings"]


UNKNOWN_MASK_WARNING = ("{module}: causal='{causal}' asked for, but the mask of {macs:,} core MAC has a form the "
                        "plugin cannot tell; counted in full")

OUTSIDE_NOTE = ("attention outside the repeated layers, counted as attention and left out of the formula's layers: "
                "{modules}: core {core:,}, projections {proj:,}, FFN {ffn:,} MAC")

CONDITIONING_NOTE = ("conditioning: products in the layers that run on the batch's conditioning (a timestep MLP, "
                     "adaLN modulation), fewer rows than the tokens, counted as other: {modules}: {macs:,} MAC")

STATE_SPACE_NOTE = ("state-space mixers in the layers, beside their attention (no attention and no FFN), counted as "
                    "other: {modules}: {macs:,} MAC")

#: Warnings on a profile: the cause, the module and the MACs concerned (see DECISIONS: plain strings).
UNPLACED_WARNING = ("{module}: {macs:,} MAC of products of two activations outside the layer's attention "
                    "module(s) could not be placed (counted as other); pass roles= to place them")

NO_FFN_WARNING = ("{module}: the layer has attention but no FFN product, while the spec says ffn_dim={ffn_dim}; "
                  "its FFN was not found (counted as other?); pass roles=")

LAYER_NO_FFN_WARNING = ("{module}: the layer has attention but no FFN product, while {others} layer(s) beside it "
                        "have one; its FFN was not found (counted as other?); pass roles=")

NO_CORE_WARNING = ("no attention core was counted ({modules}): the attention ran no product the counter knows; "
                   "see unsupported_ops")

FEWER_CALLS_WARNING = ("the attention ran {calls} time(s) in the layers ({layers}), while the spec has {expected} "
                       "attention layer(s): a layer that ran nothing (skipped for an input it was not given, as a "
                       "cross-attention layer without its states) is in the formula but not in the count; give the "
                       "inputs it needs, or pass spec= for the layers that ran")

BARE_WARNING = ("{modules}: {count} layer(s) beside the attention layers ran no attention core; their {macs:,} MAC "
                "(their FFNs included) are counted as other; pass roles= to place them")


@dataclass
class Split:
    """Counted MACs by part, plus what the attention saw and what could not be placed."""

    attention_core: int = 0
    attention_proj: int = 0
    ffn: int = 0
    ffn_router: int = 0  # part of ffn: the routers of mixture-of-experts layers
    other: int = 0
    attention_modules: list[str] = field(default_factory=list)
    # (queries, keys, batch x heads) per attention call of the layers, in graph order; and outside them
    lengths: list[tuple[int, int, int]] = field(default_factory=list)
    outside_lengths: list[tuple[int, int, int]] = field(default_factory=list)
    halved: bool = False  # causal self-attention was counted with fewer pairs than the kernel runs
    causal: str = "full"  # the accounting asked for
    layer_ffn: dict[str, int] = field(default_factory=dict)  # layer -> its ffn MACs
    unplaced: dict[str, int] = field(default_factory=dict)  # module -> MACs the split could not place
    conditioning: dict[str, int] = field(default_factory=dict)  # module -> MACs on the batch's conditioning (other)
    state_space: dict[str, int] = field(default_factory=dict)  # state-space mixer in a layer -> its MACs (other)
    unknown_masks: dict[str, int] = field(default_factory=dict)  # module -> core MACs under a mask of unknown form
    outside: dict[str, int] = field(default_factory=dict)  # part -> MACs of attention blocks outside the layers
    moved: dict[str, tuple[int, int]] = field(default_factory=dict)  # part -> (weight, activation) elements


@dataclass(frozen=True)
class Causal:
    """How :func:`split` counts causal cores (``causal="half"`` or ``"kept"``).

    Attributes:
        modules: the modules that declare themselves causal (``is_causal=True``): their cores, and those whose
            record says they ran under a causal mask, count the half triangle.
        bidirectional: the modules that declare ``is_causal=False`` (an encoder's padding mask or position bias):
            their cores stay in full without a word.
        local: ``causal="kept"``: module -> ``("window", W)`` or ``("chunk", c)``; the cores in those modules count
            the pairs their window or chunks keep (None: ``causal="half"``).
    """

    modules: frozenset[str]
    bidirectional: frozenset[str] = frozenset()
    local: Mapping[str, tuple[str, int]] | None = None


def split(records: Sequence[OpRecord], roles: Mapping[str, str], structure: Structure | None = None,
          causal: Causal | None = None) -> Split:
    """Sum the records by part: the *structure*'s (data flow), or by the user's *roles* (module -> role); the
    cores counted in full, or as *causal* says."""
    if structure is not None:
        parts, groups = list(structure.parts), list(structure.groups)
    else:
        parts, groups = _explicit_parts(records, roles)
    result = Split(causal="full" if causal is None else "half" if causal.local is None else "kept")
    experts = structure.experts if structure is not None else {}
    routers = {r.scope for i, r in enumerate(records) if experts and parts[i] == "ffn" and _router(r, experts)}
    layer_at: dict[str, str | None] = {}  # per scope: records share scopes, layers are per module
    columns = structure.columns if structure is not None else {}
    for index, record in enumerate(records):
        part, macs = parts[index], record.macs
        if part == "unplaced":
            result.unplaced[record.scope] = result.unplaced.get(record.scope, 0) + macs
            part = "other"
        elif part == "conditioning":
            result.conditioning[record.scope] = result.conditioning.get(record.scope, 0) + macs
            part = "other"
        elif part == "state_space" and structure is not None:
            mixer = next(m for m in structure.state_space if within(record.scope, m))
            result.state_space[mixer] = result.state_space.get(mixer, 0) + macs
            part = "other"
        if index in columns and structure is not None:  # split by its columns: the first share placed below
            (part, macs), *rest = _shares(record.macs, columns[index])
            _add_shares(result, structure, record, rest)
        if part == "attention_core" and causal is not None:
            macs = _counted_core(record, causal, result)
        setattr(result, part, getattr(result, part) + macs)
        _move(result, part, record, macs if index in columns else record.macs)
        if part == "ffn" and record.scope in routers:
            result.ffn_router += macs
        if structure is None or part == "other":
            continue
        if record.scope not in layer_at:
            layer_at[record.scope] = structure.layer_of(record.scope)
        layer = layer_at[record.scope]
        if layer is None:
            result.outside[part] = result.outside.get(part, 0) + macs
        elif part == "ffn":
            result.layer_ffn[layer] = result.layer_ffn.get(layer, 0) + macs
    result.attention_modules = list(dict.fromkeys(module for module, _ in groups))
    for module, group in groups:
        lengths = _lengths([records[i] for i in group])
        if lengths is not None:
            inside = structure is None or module not in structure.outside
            (result.lengths if inside else result.outside_lengths).append(lengths)
    return result


def _shares(macs: int, columns: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """*macs* split in proportion to the parts' *columns* (the last part takes what rounding leaves)."""
    total = sum(count for _, count in columns)
    found = [(part, macs * count // total) for part, count in columns[:-1]]
    return [*found, (columns[-1][0], macs - sum(share for _, share in found))]


def _add_shares(result: Split, structure: Structure, record: OpRecord, shares: list[tuple[str, int]]) -> None:
    """Add the *shares* of a record split by its columns to their parts (and an FFN share to its layer's FFN)."""
    for part, macs in shares:
        setattr(result, part, getattr(result, part) + macs)
        _move(result, part, record, macs)
        layer = structure.layer_of(record.scope)
        if part == "ffn" and layer is not None:
            result.layer_ffn[layer] = result.layer_ffn.get(layer, 0) + macs


def _move(result: Split, part: str, record: OpRecord, macs: int) -> None:
    """Add what *record* reads and writes to *part*'s bytes, in proportion to the *macs* of it placed there (a
    record split by its columns moves its bytes in the same shares); a norm's record holds only its output."""
    if not (is_product(record.op) or is_fused(record.op)):
        return
    weights, activations = result.moved.get(part, (0, 0))
    read, written = record.moved
    if macs != record.macs and record.macs:
        read, written = read * macs // record.macs, written * macs // record.macs
    result.moved[part] = (weights + read, activations + written)


def _explicit_parts(records: Sequence[OpRecord], roles: Mapping[str, str]
                    ) -> tuple[list[str], list[tuple[str, tuple[int, ...]]]]:
    """Each record's part by the user's roles, and the attention calls: chained cores, or a core alone."""
    parts = [product_part(role_of(r.scope, roles), is_fused(r.op), r.origin, True) if is_product(r.op) or is_fused(r.op)
             else "other" for r in records]
    cores = [i for i, part in enumerate(parts) if part == "attention_core" and records[i].backward_of is None]
    chained = {i: group for group in Flow(records).groups for i in group
               if all(parts[j] == "attention_core" for j in group)}
    groups: dict[tuple[int, ...], None] = {tuple(chained.get(i, [i])): None for i in cores}
    return parts, [(_root(records[g[0]].scope, roles), g) for g in groups]


def _counted_core(record: OpRecord, causal: Causal, result: Split) -> int:
    """A core's MACs under ``causal="half"`` or ``"kept"``: the pairs kept where it is causal self-attention (a
    FlexAttention core under ``"kept"``: those its mask_mod kept while counting)."""
    if record.keeps is not None and result.causal == "kept":
        kept, every = record.keeps
        macs = record.macs * kept // every
        result.halved |= macs != record.macs
        return macs
    mask, scopes, local = record.mask, ancestors(record.scope), causal.local or {}
    if mask == "causal" or any(name in causal.modules for name in scopes):
        kept = _kept(record, next((local[name] for name in scopes if name in local), None))
        result.halved |= kept != record.macs
        return kept
    if mask == "unknown" and not any(name in causal.bidirectional for name in scopes):
        result.unknown_masks[record.scope] = result.unknown_masks.get(record.scope, 0) + record.macs
    return record.macs


def _kept(record: OpRecord, local: tuple[str, int] | None) -> int:
    """The MACs of the query-key pairs a causal mask keeps (within *local*'s window or chunks), for a
    self-attention core op."""
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
    kind, tokens = local or ("window", None)
    # every product over the n x n pairs is MACs = B * n * n * k; keep B * k * pairs
    window, chunk = (tokens, None) if kind == "window" else (None, tokens)
    return record.macs // (n * n) * kept_pairs(n, window, chunk)


def _lengths(group: list[OpRecord]) -> tuple[int, int, int] | None:
    """(queries, keys, batch x heads) seen by one attention call's cores: from the scores ``[.., n, m]`` feeding
    AV, else the last core's output ``[.., n, d]``; the keys are sdpa's ``k`` length or the scores' columns."""
    first, last = group[0], group[-1]
    if len(last.out_shape) < 2:
        return None
    queries, leading = last.out_shape[-2], math.prod(last.out_shape[:-2])
    chained = len(group) > 1 and len(first.out_shape) >= 2 and last.shapes[:1] == (first.out_shape,)
    if chained and not is_fused(first.op) and first.out_shape[-2] in last.out_shape[:-1]:
        # scores [.., n, m] @ V: the scores know n whatever layout the output takes (einsum "bqhd"); a linear
        # attention's context [.., features, d] (K'^T V, Performer's) has rows no dimension of its output has
        queries, leading = first.out_shape[-2], math.prod(first.out_shape[:-2])
    if first.op in SDPA_OPS and len(first.shapes) >= 2 and len(first.shapes[1]) >= 2:
        keys = first.shapes[1][-2]
    elif len(first.out_shape) >= 2:
        keys = first.out_shape[-1]
    else:
        keys = queries
    return queries, keys, leading


def _router(record: OpRecord, experts: Mapping[str, int]) -> bool:
    """A parameter product beside an experts module, in its mixture block, with one output per expert."""
    return bool(record.out_shape) and any(
        within(record.scope, parent(module)) and not within(record.scope, module) and record.out_shape[-1] == count
        for module, count in experts.items())


def structure_warnings(parts: Split, structure: Structure | None, records: Sequence[OpRecord], spec: ModelSpec | None,
                       name: str) -> list[str]:
    """What makes a split doubtful, each naming the module, the MACs and the cause."""
    found = [UNPLACED_WARNING.format(module=module, macs=macs) for module, macs in parts.unplaced.items()]
    found += [UNKNOWN_MASK_WARNING.format(module=module, macs=macs, causal=parts.causal)
              for module, macs in parts.unknown_masks.items()]
    if structure is not None:
        found += structure.warnings
        without = [layer for layer in structure.layers if not parts.layer_ffn.get(layer)]
        if spec is not None and (spec.ffn_dim > 0 or spec.moe):
            found += [NO_FFN_WARNING.format(module=layer or name, ffn_dim=spec.ffn_dim) for layer in without]
        elif without and len(without) < len(structure.layers):
            found += [LAYER_NO_FFN_WARNING.format(module=layer or name, others=len(structure.layers) - len(without))
                      for layer in without]
        calls = sum(structure.layer_of(module) is not None for module, _ in structure.groups)
        expected = 0 if spec is None else spec.layers * (2 if spec.cross_attention else 1)
        if structure.layers and 0 < calls < expected:
            found.append(FEWER_CALLS_WARNING.format(calls=calls, layers=_first(structure.layers), expected=expected))
        if structure.bare:
            macs = sum(r.macs for r in records if any(within(r.scope, b) for b in structure.bare))
            found.append(BARE_WARNING.format(modules=_first(structure.bare), count=len(structure.bare), macs=macs))
    if parts.attention_modules and parts.attention_core == 0 and (spec is None or spec.heads):
        found.append(NO_CORE_WARNING.format(modules=", ".join(parts.attention_modules[:3])))
    return found


def split_notes(parts: Split, structure: Structure | None) -> list[str]:
    """What the split placed outside the article's parts, with its MACs: attention outside the layers and the
    products on the batch's conditioning."""
    found = [note for note in (outside_note(parts, structure),) if note is not None]
    if parts.conditioning:
        found.append(CONDITIONING_NOTE.format(modules=_first(sorted(parts.conditioning)),
                                              macs=sum(parts.conditioning.values())))
    if parts.state_space:
        found.append(STATE_SPACE_NOTE.format(modules=_first(sorted(parts.state_space)),
                                             macs=sum(parts.state_space.values())))
    return found


def _first(names: Sequence[str]) -> str:
    """The first three *names*, and ``...`` for the rest."""
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def outside_note(parts: Split, structure: Structure | None) -> str | None:
    """The note naming attention outside the repeated layers, with its MACs (None where there is none)."""
    if structure is None or not structure.outside or not parts.outside:
        return None
    return OUTSIDE_NOTE.format(modules=_first(structure.outside), core=parts.outside.get("attention_core", 0),
                               proj=parts.outside.get("attention_proj", 0), ffn=parts.outside.get("ffn", 0))


def explicit_roles(roles: Mapping[str, Any], classes: Mapping[str, str]) -> dict[str, str]:
    """Roles from the user's patterns over the modules (dotted name -> class name). Each pattern is a glob
    over the names (``"blocks.*.attn"``), ``"re:REGEX"`` or a compiled pattern (a full match of a name), or
    ``"class:GLOB"`` (the class's name: ``"class:FeedForward"``); each must match at least one module."""
    if not isinstance(roles, Mapping):
        raise ProfileError(f"roles must be a dict such as {{'attention': [...], 'ffn': [...]}}, got {roles!r}")
    unknown = sorted(set(roles) - set(ROLE_NAMES))
    if unknown:
        raise ProfileError(f"unknown role {unknown[0]!r} in roles=; valid roles: {', '.join(ROLE_NAMES)}")
    assigned: dict[str, str] = {}
    for role in ROLE_NAMES:
        patterns = roles.get(role, [])
        for pattern in [patterns] if isinstance(patterns, (str, re.Pattern)) else patterns:
            matched = [name for name, cls in classes.items() if _matches(pattern, role, name, cls)]
            if not matched:
                shown = ", ".join(f"{n!r} ({c})" for n, c in classes.items() if n)[:400] or "(none)"
                raise ProfileError(f"roles[{role!r}] pattern {pattern!r} matches no module; the modules are: {shown}")
            for name in matched:
                assigned.setdefault(name, role)
    return assigned


def _matches(pattern: Any, role: str, name: str, cls: str) -> bool:
    """Whether one of the user's role patterns (see :func:`explicit_roles`) matches a module."""
    if isinstance(pattern, str) and pattern.startswith("re:"):
        try:
            pattern = re.compile(pattern[3:])
        except re.error as exc:
            raise ProfileError(f"roles[{role!r}]: {pattern!r} is no regular expression ({exc})") from None
    if isinstance(pattern, re.Pattern):
        return pattern.fullmatch(name) is not None
    if not isinstance(pattern, str):
        raise ProfileError(f"roles[{role!r}] must hold module-name globs, 're:REGEX' or 'class:NAME' strings, "
                           f"got {pattern!r}")
    if pattern.startswith("class:"):
        return fnmatch.fnmatchcase(cls, pattern[6:])
    return fnmatch.fnmatchcase(name, pattern)


def _root(scope: str, roles: Mapping[str, str]) -> str:
    """The outermost attention module enclosing *scope* (the scope itself if none)."""
    return next((name for name in reversed(ancestors(scope)) if roles.get(name) == "attention"), scope)
