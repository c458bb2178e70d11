"""A model made a :class:`~pytest_attncost.result.Profile`: setup, count, place, assemble.

docs/architecture.md, "The pipeline's four steps". A one-run sweep shares one setup between its lengths.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import cache, counting, families, inferred, inputs, one_run
from . import parts as parts_mod
from . import roles as roles_mod
from .counting import Counted
from .errors import ProfileError, named
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .formulas import ModelSpec
from .ops import RawCount, ancestors
from .request import Request
from .result import COMPONENTS, PARTS, Profile, versions

__all__ = ["Placement", "Setup", "assemble", "for_model", "place", "quiet_counting", "run", "sweep_in_one_run"]

#: torch loggers that report, at ERROR level, what the counters try and then handle themselves.
_TORCH_LOGGERS = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes", "torch._dynamo")


@contextlib.contextmanager
def quiet_counting() -> Iterator[None]:
    """While a count runs: torch's logs out of the user's output (a failed meta kernel under fake tensors is
    logged with its traceback, hundreds of lines, then raised, and the plugin reports it in its own words),
    and the cyclic garbage collector paused (a count makes many objects and no garbage worth a pass, and each
    full pass walks the whole heap: a third of a 256-layer profile, which then grew faster than its depth)."""
    loggers = [logging.getLogger(name) for name in _TORCH_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


FORMULA_WARNING = ("{part} is {measured:,} MAC but the formula gives {expected:,} ({deviation:+.2%}): the model does "
                   "something the cost model does not describe, or a part was misplaced; compare Profile.by_module, "
                   "pass roles= or spec=")
SPEC_NOTE = "no formula: {why}"
FOLDED_NOTE = ("the attention ran {sequences} sequences of {n} tokens for a batch of {batch} (frames or windows folded "
               "into its batch), which the formulas, one sequence per input, do not describe; pass spec= to compare")
DECODE_HALF_NOTE = ("causal='{causal}' does not apply to a decode step: its queries attend to every cached key, and "
                    "the core is counted as the kernel runs it")
CHUNK_HALF_WARNING = ("causal='{causal}': {layers} layer(s) attend within chunks of {chunk} tokens, which keep fewer "
                      "query-key pairs than the n(n+1)/2 counted; {fix}")
WINDOW_HALF_WARNING = ("causal='{causal}': {layers} layer(s) attend within a sliding window of {window} tokens, which "
                       "keeps fewer query-key pairs than the n(n+1)/2 counted; {fix}")
KEPT_FIXES = {"half": "causal='kept' counts the pairs they keep",
              "kept": "no module carries their layer's index (layer_idx), so they could not be told apart"}
HYBRID_NOTE = ("{bare} layer(s) run no attention beside {layers} that do (a hybrid of attention and state-space or "
               "recurrent layers), and the cost model puts attention in every layer; pass spec= for the attention "
               "layers")
REAL_NOTE = ("counted on real tensors (the torch backend's last resort): the inputs' values chose the "
             "data-dependent branches, so this profile holds for these inputs only and is not cached")
NOTHING_RAN = ("the forward counted 0 MAC: nothing ran on these inputs (trimmed to 0 tokens?); a profile of "
               "nothing cannot stand for the model: check the inputs")
CACHE_BYTES_WARNING = ("kv_cache_bytes is 0: the step attended to n={n} cached tokens, but no cache object was found "
                       "among its inputs (a cache in a plain tuple or list argument is not read as one); pass it as "
                       "past_key_values= or cache=, or as an object holding its tensors")
NOT_A_DECODER = ("{name} is not a decoder: its attention is bidirectional (is_causal=False, config.is_decoder is "
                 "False), so a step against a KV cache describes no generation; decode steps are for decoders (GPT-2, "
                 "LLaMA, ...), or an encoder built with is_decoder=True")
RECOMPUTE_NOTE = ("activation checkpointing ran {macs:,} MAC of the forward again in the backward ({parts}): kept "
                  "apart in Profile.recompute, out of the parts; hardware_flops include them, model_flops (3 x the "
                  "forward's {forward:,} MAC, as PaLM's MFU counts) do not")
UNMATCHED_RECOMPUTE_WARNING = ("{macs:,} MAC that activation checkpointing ran again in the backward ({scopes}) "
                               "match no forward op (none of that op and shapes ran in the forward, or it was "
                               "recomputed twice): counted in recompute as other (or the part roles= names)")


def _says_causal(setup: Setup, name: str) -> bool | None:
    """What module *name* says of its attention: is_causal, or transformers 4's is_decoder; None if silent."""
    if name in setup.declared:
        return setup.declared[name]
    said = getattr(setup.twin.get_submodule(name), "is_decoder", None)
    return said if isinstance(said, bool) else None


@dataclass
class Setup:
    """The twin of one model and what is read from it before a count (shared by a sweep's lengths)."""

    target: nn.Module
    request: Request  # a sweep's in one run: what its lengths share
    spec: ModelSpec | None  # the request's, for causal="kept" the one its windows keep
    twin: nn.Module
    notes: list[str]
    masks: Mapping[str, Any] | None
    declared: dict[str, bool]
    causal_modules: frozenset[str] | None
    bidirectional: frozenset[str]
    local: dict[str, tuple[str, int]] | None  # causal="kept": module -> its layer's window or chunks
    containers: list[str]
    experts: Any
    state_space: frozenset[str]  # state-space mixers (families.state_space_of): no attention in them
    rows: dict[Any, dict[str, tuple[str, int, str]]] = dataclasses.field(default_factory=dict)
    spec_note: str | None = None  # why the model's config gives no spec (None: it has no config to say)

    @property
    def causal(self) -> parts_mod.Causal | None:
        """How the split counts causal cores (None: in full)."""
        if self.causal_modules is None:
            return None
        return parts_mod.Causal(self.causal_modules, self.bidirectional, self.local)

    @functools.cached_property
    def sizes(self) -> dict[str, tuple[str, int]]:
        """Every module's class and parameter count (tied parameters once)."""
        return {name: (type(module).__name__, sum(p.numel() for p in module.parameters()))
                for name, module in self.twin.named_modules()}

    @classmethod
    def of(cls, target: nn.Module, request: Request) -> Setup:
        twin = counting.meta_twin(target)  # a scripted module, an uncopyable model: no counter can help
        notes = families.prepare_twin(twin)
        spec, spec_note = request.spec, request.spec_note
        # triangular mask buffers of the original (the twin's are empty): causal accounting reads them
        causal = request.causal != "full"
        masks = counting.buffer_masks(target) if causal else None
        local = families.local_layers(twin) if request.causal == "kept" else None
        if local and spec is not None:
            spec, spec_note = _kept_spec(spec, families.local_attention(twin))
        if spec is None and spec_note:
            notes.append(SPEC_NOTE.format(why=spec_note))
        # what modules say of themselves: is_causal True (decoders) or False (encoders, cross-attention)
        declared = {name: module.is_causal for name, module in twin.named_modules()
                    if isinstance(getattr(module, "is_causal", None), bool)}
        return cls(
            target=target, request=request, spec=spec, twin=twin, notes=notes, masks=masks,
            declared=declared, local=local,
            causal_modules=frozenset(name for name, said in declared.items() if said) if causal else None,
            bidirectional=frozenset(name for name, said in declared.items() if not said) if causal else frozenset(),
            containers=[name for name, module in twin.named_modules()
                        if isinstance(module, (nn.ModuleList, nn.Sequential))] + counting.shell_containers(twin),
            experts=families.experts_of(twin), state_space=families.state_space_of(twin), spec_note=spec_note,
        )


def _kept_spec(spec: ModelSpec, local: list[tuple[str, int, int]]) -> tuple[ModelSpec | None, str | None]:
    """The spec whose formulas keep the pairs the layers' windows keep (``causal="kept"``), or why there is none."""
    if len(local) != 1 or local[0][0] != "window":
        return None, "the formulas describe one sliding window, not chunked attention or several windows"
    _, window, layers = local[0]
    return families.with_window(spec, window, layers), None


def for_model(target: nn.Module, request: Request) -> Request:
    """*request* with what *target* says where the user said nothing: its name (the model's class), and the spec
    read from its config (a decode step's: what its cache keeps), or why there is none."""
    spec, note = request.spec, None
    if request.spec_read:
        spec, note = families.spec_of(target)
        if spec is not None and request.mode == "decode":
            spec = families.windowed_spec(spec, target)
    return dataclasses.replace(request, name=request.name or counting.model_class(target), spec=spec, spec_note=note)


def run(target: nn.Module, request: Request, built: inputs.Built) -> Profile:
    """Setup, count, place and assemble: *target* counted on *built* inputs, as *request* asks.

    Raises:
        ProfileError: naming the model, when it cannot be counted or placed.
    """
    try:
        with quiet_counting():
            setup = Setup.of(target, request)
            counted = counting.count(target, setup.twin, built, setup.masks, request)
            return assemble(setup, counted, place(setup, counted.raw), built, request)
    except ProfileError as exc:
        raise named(request.name, exc) from exc.__cause__


@dataclass(frozen=True)
class Placement:
    """The split of one count, and what the structure said of the spec."""

    assigned: Mapping[str, str]
    structure: roles_mod.Structure | None
    parts: parts_mod.Split
    spec: ModelSpec | None
    notes: tuple[str, ...]
    recompute: Mapping[str, int] = dataclasses.field(default_factory=dict)  # train mode: see Profile.recompute
    forward_macs: int | None = None  # train mode: the forward alone


def place(setup: Setup, raw: RawCount, found: roles_mod.Structure | None = None) -> Placement:
    """The split of *raw* by the user's roles= or the structure (*found*: already found for these records),
    and the spec as the structure corrects it (a spec read from the config; a given one is kept as it is)."""
    spec, twin, notes, request = setup.spec, setup.twin, list(setup.notes), setup.request
    roles, spec_read, decoding = request.roles, request.spec_read, request.mode == "decode"
    structure = None
    if roles is not None:
        assigned = parts_mod.explicit_roles(roles, raw.module_names)
    else:
        structure = found or roles_mod.find_structure(raw.records, setup.containers, setup.experts, raw.outputs,
                                                      setup.state_space)
        assigned = structure.roles()
    if raw.total == 0:
        raise ProfileError(NOTHING_RAN)
    if decoding and not getattr(getattr(setup.target, "config", None), "is_decoder", False):
        # what the modules that ran the step's attention say of themselves (the nearest that says anything)
        said = [next((said for a in ancestors(scope) if (said := _says_causal(setup, a)) is not None), None)
                for scope in roles_mod.core_scopes(raw.records)]
        said = [causal for causal in said if causal is not None]
        if said and not any(said):
            raise ProfileError(NOT_A_DECODER.format(name=request.name))
    if not assigned:
        raise ProfileError("found neither attention nor an FFN (no fused attention op and no product of two "
                           f"activations chained like QK^T and AV); {roles_mod.ROLES_HINT}")
    if structure is not None and structure.layers and spec is not None and spec_read:
        # gated or not, as the first layer's weights say; the family list decides where they do not tell
        layer = structure.layers[0]
        gated = families.gated_by_structure(
            twin.get_submodule(layer) if layer else twin,
            [twin.get_submodule(a) if a else twin for a in structure.attention.get(layer, ()) if a != layer], spec)
        if gated is not None and gated != spec.gated:
            spec = dataclasses.replace(spec, gated=gated)
    if (spec is None and spec_read and structure is not None and setup.spec_note is None
            and request.mode == "forward" and setup.local is None):
        read = inferred.infer_spec(raw.records, structure)  # a model of one's own: the trace shows its shape
        spec = None if isinstance(read, str) else read
        notes.append(SPEC_NOTE.format(why=inferred.NOT_INFERRED.format(why=read)) if spec is None
                     else inferred.INFERRED_NOTE.format(spec=inferred.spec_keywords(spec)))
    if structure is not None and structure.bare and spec is not None and spec_read:
        # a hybrid stack: the formulas put attention in every one of the config's layers
        notes.append(SPEC_NOTE.format(why=HYBRID_NOTE.format(bare=len(structure.bare), layers=len(structure.layers))))
        spec = None
    parts = parts_mod.split(raw.records, assigned, structure, setup.causal)
    if request.causal != "full" and decoding:
        notes.append(DECODE_HALF_NOTE.format(causal=request.causal))
    notes += parts_mod.split_notes(parts, structure)
    if not parts.halved:
        assert parts.attention_core + parts.attention_proj + parts.ffn + parts.other == raw.total, "split lost MACs"
    train = _train_split(setup, raw, assigned, structure, parts) if request.mode == "train" else ({}, None)
    return Placement(assigned, structure, parts, spec, tuple(notes), *train)


def _train_split(setup: Setup, raw: RawCount, assigned: Mapping[str, str], structure: roles_mod.Structure | None,
                 parts: parts_mod.Split) -> tuple[dict[str, int], int]:
    """A train count's recompute by part (each op placed with the forward op it repeats, as a gradient is)
    and its forward alone: the records before the first backward op."""
    records = list(raw.records)
    forward = next((i for i, r in enumerate(records) if r.backward_of is not None), len(records))

    def split(chosen: list[Any], placed: tuple[str, ...]) -> parts_mod.Split:
        shaped = None if structure is None else dataclasses.replace(structure, parts=placed)
        return parts_mod.split(chosen, assigned, shaped, setup.causal)

    placed = structure.parts if structure is not None else ()
    alone = split(records[:forward], placed[:forward])
    recompute: dict[str, int] = {}
    if raw.recompute:
        repeated = tuple(
            "other" if r.backward_of is None or r.backward_of < 0 else placed[r.backward_of] for r in raw.recompute
        )
        both = split([*records, *raw.recompute], (*placed, *repeated) if structure is not None else ())
        recompute = {part: getattr(both, part) - getattr(parts, part) for part in PARTS
                     if getattr(both, part) != getattr(parts, part)}
    return recompute, sum(getattr(alone, part) for part in PARTS)


def assemble(setup: Setup, counted: Counted, placement: Placement, built: inputs.Built, request: Request) -> Profile:
    """The profile: n and batch read back from the inputs, the counts, the notes and the warnings."""
    target, raw, parts = setup.target, counted.raw, placement.parts
    spec, notes, structure = placement.spec, list(placement.notes), placement.structure
    decoding = request.mode == "decode"
    if counted.real:
        notes.append(REAL_NOTE)
    notes += counted.notes  # how FlexAttention was counted
    if placement.recompute:
        notes.append(RECOMPUTE_NOTE.format(macs=sum(placement.recompute.values()), parts=", ".join(
            f"{part} {macs:,}" for part, macs in placement.recompute.items()), forward=placement.forward_macs))
    ran = inputs.Ran(target, built, spec, parts)
    n, batch = (inputs.decode_lengths if decoding else inputs.read_lengths)(ran, request)
    if not decoding:
        folded = inputs.folded_sequences(ran, batch)
        if folded is not None and request.spec_read:
            notes.append(SPEC_NOTE.format(why=FOLDED_NOTE.format(sequences=folded, n=n, batch=batch)))
            spec = None
    memory = None if decoding else inputs.second_length(dataclasses.replace(ran, spec=spec), n, request.m)
    attention_layers = structure.layers if structure else parts.attention_modules
    layers = spec.layers if spec is not None else max(1, len(attention_layers))
    dtype = families.float_dtype(target)
    result = Profile(
        name=request.name, n=n, batch=batch, attention_core=parts.attention_core,
        attention_proj=parts.attention_proj, ffn=parts.ffn, other=parts.other, layers=layers, spec=spec, m=memory,
        unsupported_ops=dict(sorted(raw.unsupported_ops.items())), by_module=raw.by_module, backend=counted.backend,
        mode=request.mode, causal=request.causal, causal_applied=parts.halved, fallback=counted.fallback,
        versions=versions(), ffn_router=parts.ffn_router, notes=tuple(notes),
        modules=_module_rows(setup, placement.assigned, structure),
        new_tokens=request.new_tokens,
        kv_cache_bytes=inputs.cache_bytes(built.args, built.kwargs) if decoding else None,
        roles=dict(placement.assigned), roles_given=structure is None, outside=dict(sorted(parts.outside.items())),
        dtype=str(dtype).removeprefix("torch."),
        moved={part: (weights * dtype.itemsize, activations * dtype.itemsize)
               for part, (weights, activations) in sorted(parts.moved.items())},
        recompute=dict(placement.recompute), forward_macs=placement.forward_macs,
    )
    warnings = parts_mod.structure_warnings(parts, structure, raw.records, spec, request.name)
    warnings += _formula_warnings(result)
    if counted.unchecked:
        warnings.append(counted.unchecked)
    warnings += [warning for scope, warning in counted.unread if scope in parts.unknown_masks]
    if (flat := counting.unscoped(target)) is not None:
        warnings.append(flat)
    if unmatched := [r for r in raw.recompute if r.backward_of is not None and r.backward_of < 0]:
        scopes = ", ".join(dict.fromkeys(r.scope or "the model" for r in unmatched))
        warnings.append(UNMATCHED_RECOMPUTE_WARNING.format(macs=sum(r.macs for r in unmatched), scopes=scopes))
    if result.kv_cache_bytes == 0:
        warnings.append(CACHE_BYTES_WARNING.format(n=n))
    if parts.halved and not decoding and not setup.local:  # local attention keeps fewer pairs than n(n+1)/2
        for kind, tokens, count in families.local_attention(target):
            if n > tokens:
                template = WINDOW_HALF_WARNING if kind == "window" else CHUNK_HALF_WARNING
                warnings.append(template.format(layers=count, window=tokens, chunk=tokens, causal=request.causal,
                                                fix=KEPT_FIXES[request.causal]))
    return dataclasses.replace(result, warnings=tuple(warnings)) if warnings else result


def _formula_warnings(result: Profile) -> list[str]:
    """Each part that differs from the formula."""
    expected = result.formula
    if expected is None:
        return []
    pairs = [(part, result.in_layers(part), getattr(expected, part)) for part in COMPONENTS]
    return [FORMULA_WARNING.format(part=part, measured=measured, expected=want,
                                   deviation=(measured - want) / want if want else 1.0)
            for part, measured, want in pairs if measured != want]


def _module_rows(setup: Setup, assigned: Mapping[str, str], structure: roles_mod.Structure | None
                 ) -> dict[str, tuple[str, int, str]]:
    """Every module's class, parameters and role, for Profile.table()."""
    layers = tuple(structure.layers) if structure is not None else ()
    key = (tuple(assigned.items()), layers)  # a sweep's lengths mostly find the same roles
    if (rows := setup.rows.get(key)) is None:
        rows = setup.rows[key] = {
            name: (kind, size, "layer" if name in layers else roles_mod.role_of(name, assigned) or "other")
            for name, (kind, size) in setup.sizes.items()}
    return dict(rows)  # each profile its own


# --- a sweep in one run ---------------------------------------------------------------------------

#: Attention and expert implementations that are transformers' own code (others are registered by users).
_BUILT_IN_IMPLEMENTATIONS = (None, "eager", "sdpa", "batched_mm", "grouped_mm")


def _library_code(twin: nn.Module) -> bool:
    """Whether every module runs torch's or transformers' own forward, attention and experts: code written for
    symbolic sizes, which decides on sizes' values (a one-run sweep checks them), never on their type."""
    for module in twin.modules():
        if type(module).__module__.split(".")[0] not in ("torch", "transformers") or "forward" in vars(module):
            return False
        config = vars(module).get("config")
        if config is not None and any(getattr(config, key, None) not in _BUILT_IN_IMPLEMENTATIONS
                                      for key in ("_attn_implementation", "_experts_implementation")):
            return False
    return True


def _one_run_takes(request: Request) -> bool:
    """Whether a sweep's request is of the few forms a one-run sweep takes: torch's forward counts, of default
    inputs or of a callable ``inputs=`` (fixed inputs hold one length), causal "full" or "half", no m."""
    given = request.inputs
    if given is not None and (not callable(given) or isinstance(given, (nn.Module, torch.Tensor))):
        return False
    return (request.backend == "torch" and request.mode == "forward" and request.causal != "kept"
            and request.m is None and len(request.lengths) >= 2)


def _unit_sizes(raw: RawCount) -> tuple[bool, ...]:
    """Which sizes of the records' operands and results are 1: all roles.find_structure reads of a size (their
    number, and whether one is 1); one run's counts differ only in sizes and MACs (counting.at_lengths)."""
    return tuple(size == 1 for record in raw.records for shape in (*record.shapes, record.out_shape)
                 for size in shape)


def _structures(setup: Setup, raws: list[RawCount]) -> list[roles_mod.Structure]:
    """The structure of each of one run's counts: found once for all lengths whose sizes it reads alike,
    and again at each length where it has warnings (they name MACs)."""
    found: dict[tuple[bool, ...], roles_mod.Structure] = {}
    structures = []
    for raw in raws:
        structure = found.get(key := _unit_sizes(raw))
        if structure is None or structure.warnings:
            structure = found[key] = roles_mod.find_structure(raw.records, setup.containers, setup.experts,
                                                              raw.outputs, setup.state_space)
        structures.append(structure)
    return structures


def sweep_in_one_run(target: nn.Module, request: Request) -> list[Profile] | None:
    """The torch backend's sweep: every length of *request* counted in one run (see one_run.py), then placed and
    assembled as :func:`run` does; None where that cannot be, and the lengths are counted one at a time."""
    if not one_run.POSSIBLE or not _one_run_takes(request):
        return None
    keys = cache.cache_keys(target, request)
    cached = [cache.lookup(key) for key in keys]
    if all(found is not None for found in cached):
        return cached  # type: ignore[return-value]
    given, lengths = request.inputs, list(request.lengths)

    def inputs_at(n: Any) -> inputs.Built:
        if given is None or isinstance(n, int):
            return inputs.build(target, request.at(n))  # as profile() builds them
        with torch.device("meta"):  # the user's callable, given the swept length: tensors made on meta
            made = inputs.user_inputs(given, n, request.batch)
        if not all(t.is_meta for t in pytree.tree_leaves(made) if isinstance(t, torch.Tensor)):
            raise ProfileError("inputs= made tensors off the meta device for a swept length")
        return inputs.Built(*made)

    try:
        built = inputs_at(one_run.length_of(lengths))
        if not one_run.swept((built.args, built.kwargs)):
            return None  # inputs that do not depend on n (an image model): nothing to sweep in one run
        with quiet_counting():
            setup = Setup.of(target, request)
            raw = counting.count_forward_torch(setup.twin, built.args, built.kwargs, buffer_masks=setup.masks)
            state = [t.shape for t in (*setup.twin.parameters(), *setup.twin.buffers())]
            if one_run.swept(state):
                return None  # the forward made state of the lengths' sizes (a lazily sized table): one at a time
            raws = counting.at_lengths(raw, len(lengths))
            if not _library_code(setup.twin):
                # code of the user's own: a branch on the *type* of a size (isinstance(n, int)) would go one way
                # at every length without a decision on a value; the first length counted alone must agree
                alone = counting.fresh_count(target, *inputs_at(lengths[0]).call(), setup.masks)
                first = raws[0]
                if (alone.total, alone.records, alone.by_module, alone.unsupported_ops) != (
                        first.total, first.records, first.by_module, first.unsupported_ops):
                    return None
            structures = _structures(setup, raws) if request.roles is None else [None] * len(raws)
            profiles = [assemble(setup, Counted(raw_n, "torch"), place(setup, raw_n, found), inputs_at(n),
                                 request.at(n)) for n, raw_n, found in zip(lengths, raws, structures)]
    except (Exception, one_run.Diverged):  # noqa: BLE001 - the lengths one at a time say what is wrong, if anything
        return None
    for key, result in zip(keys, profiles):
        cache.store(key, result)
    return profiles
