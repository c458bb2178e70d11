"""``profile()``: count a model's forward pass, split it, and compare it with the formulas.

Usable outside pytest (a notebook, a script); the ``attncost`` fixture is a thin
wrapper that adds the marker's defaults and records the result for the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Union, cast

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import decode as decode_mod
from . import families
from . import roles as roles_mod
from .cache import cache_key, cache_keys, clear_cache, lookup, store  # api.cache_key and api.clear_cache stay importable
from . import lengths as lengths_mod
from .counting import (
    CountError,
    RawCount,
    at_lengths,
    buffer_masks,
    count_forward,
    count_forward_torch,
    meta_twin,
    real_twin,
    to_meta,
    to_real,
)
from .reporting import versions
from .formulas import ModelSpec
from .result import COMPONENTS, Profile
from .sweep import Sweep

__all__ = ["ProfileError", "profile", "spec_of", "sweep"]

Inputs = Union[tuple[Any, ...], list[Any], dict[str, Any], torch.Tensor, Callable[[int, int], Any]]

INPUTS_HINT = families.INPUTS_HINT


BACKENDS = ("fvcore", "torch")
MODES = ("forward", "train", "decode")
CAUSAL = ("full", "half")


@dataclass(frozen=True)
class Options:
    """How to count: part of the cache key."""

    backend: str = "fvcore"
    mode: str = "forward"
    causal: str = "full"
    fallback: bool = True
    new_tokens: int = 0  # decode mode: the step's query tokens


#: torch loggers that report, at ERROR level, what the counters try and then handle themselves.
_TORCH_LOGGERS = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes", "torch._dynamo")


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """A failed meta kernel under fake tensors is logged with its traceback (hundreds of lines), then
    raised, and the plugin reports it in its own words: keep the log out of the user's output."""
    loggers = [logging.getLogger(name) for name in _TORCH_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


#: batch x n past which torch cannot describe even the token ids (8 bytes each, under 2**63 bytes).
LARGEST_TOKENS = 2**59
TOO_LARGE = ("n={n}, batch={batch}: too large for torch to describe (a tensor of 2**63 bytes or more, even on the "
             "meta device); use a smaller n, or evaluate the formulas alone: pytest_attncost.model_costs(spec, n) "
             "or python -m pytest_attncost --n N")


class ProfileError(ValueError):
    """profile() was called with something it cannot count; the message names the fix."""


def _positive(name: str, value: object, hint: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ProfileError(f"{name} must be a positive int, got {value!r}{hint}")
    return value


def _unwrap(model: nn.Module) -> nn.Module:
    """Count what a wrapper runs: DataParallel/DDP's module, torch.compile's original."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod  # type: ignore[assignment]
        else:
            return model


def _resolve_model(model: object) -> nn.Module:
    if isinstance(model, nn.Module):
        return _unwrap(model)
    if callable(model):
        try:
            with torch.device("meta"):
                built = model()
        except Exception as exc:  # noqa: BLE001 - the factory is the user's code
            raise ProfileError(
                f"the model factory {getattr(model, '__name__', model)!r} failed on the meta device "
                f"({type(exc).__name__}: {exc}); if it builds on the CPU, pass the built nn.Module instead; "
                "otherwise the error is the factory's own (its config or its code)"
            ) from exc
        if not isinstance(built, nn.Module):
            raise ProfileError(
                f"the model factory returned {type(built).__name__}, not an nn.Module; "
                "a factory takes no arguments and returns the model"
            )
        return _unwrap(built)
    raise ProfileError(
        f"profile() takes an nn.Module or a zero-argument factory returning one, got {type(model).__name__}"
    )


def spec_of(model: nn.Module) -> ModelSpec | None:
    """The cost-model shape of a transformers model or a torch Transformer module, if known.

    The config's view: a profile corrects it by the structure it counted (a gated FFN the weights
    show, no formula for a hybrid stack); ``Profile.spec`` is the spec a profile compared with.
    """
    return families.spec_of(model)[0]


def default_inputs(model: nn.Module, n: int | None, batch: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Inputs for known model kinds on the meta device (see :func:`families.default_inputs`)."""
    try:
        return families.default_inputs(model, n, batch)
    except families.InputsError as exc:
        raise ProfileError(str(exc)) from exc


def _user_inputs(inputs: Any, n: int | None, batch: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if callable(inputs) and not isinstance(inputs, (nn.Module, torch.Tensor)):
        if n is None:
            raise ProfileError("inputs= is a callable (n, batch) -> ..., so n is needed: pass n= (or mark the test)")
        try:
            inputs = inputs(n, batch)
        except Exception as exc:  # noqa: BLE001 - the callable is the user's code
            raise ProfileError(f"inputs(n={n}, batch={batch}) raised {type(exc).__name__}: {exc}") from exc
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    if isinstance(inputs, Mapping):
        if not all(isinstance(k, str) for k in inputs):
            raise ProfileError("an inputs= dict maps keyword-argument names (str) to values")
        return (), dict(inputs)
    raise ProfileError(f"inputs= got {type(inputs).__name__}; {INPUTS_HINT}")


def profile(
    model: nn.Module | Callable[[], nn.Module],
    n: int | None = None,
    *,
    batch: int | None = None,
    inputs: Inputs | None = None,
    roles: Mapping[str, Any] | None = None,
    spec: ModelSpec | None = None,
    name: str | None = None,
    backend: str | None = None,
    mode: str = "forward",
    causal: str = "full",
    fallback: bool = True,
    new_tokens: int | None = None,
) -> Profile:
    """Count one forward pass of *model* and split it into attention_core, attention_proj, ffn, other.

    The count comes from fvcore, traced on a meta-device twin: no weights or
    activations are allocated, no arithmetic is done, and *model* is left exactly
    as it was (parameters, device, dtype, ``training`` flags, hooks).

    Args:
        model: an ``nn.Module``, or a zero-argument factory (built on the meta device).
        n: sequence length. Needed unless *inputs* are given, in which case it is
            the length the attention saw (ViT: patches + 1) and must agree if given.
        batch: batch size for default inputs (1).
        inputs: a tuple of positional args, a dict of keyword args, a tensor, or a
            callable ``(n, batch) -> tuple | dict``. Default: token ids ``(batch, n)``
            for transformers text models, ``(batch, n, d_model)`` floats for torch's
            Transformer modules (``batch_first`` respected).
        roles: ``{"attention": [globs], "ffn": [globs]}`` naming the modules by
            fnmatch globs over their dotted names, for models the automatic
            detection does not know.
        spec: the shape for the formulas; read from the model when omitted.
        name: the profile's name (default: the model's class name).
        backend: ``"fvcore"`` (default: jit trace) or ``"torch"`` (FlopCounterMode at the
            dispatcher, on fake tensors).
        mode: ``"forward"``, ``"train"``: forward plus a real backward (torch backend), or
            ``"decode"``: one step of ``new_tokens`` query tokens against a KV cache holding ``n``
            tokens (a transformers decoder's own cache on the meta device; custom models take
            ``inputs=`` that build their cache for n). The profile's ``n`` is the cache's length.
        causal: ``"full"`` counts the n x n product a dense kernel executes; ``"half"`` counts
            the n(n+1)/2 pairs of causal self-attention (never cross-attention or
            bidirectional models).
        fallback: when fvcore cannot trace the model, count with the torch backend (on fake
            tensors, else on real ones at small n) and say so in ``Profile.fallback``.
        new_tokens: decode mode: the query tokens of the step (default 1).

    Returns:
        The :class:`Profile`.

    Raises:
        ProfileError: bad arguments, or a model that cannot be counted (the message
            says why and what to do).
    """
    if n is not None:
        _positive("n", n)
    batch_given = batch is not None
    batch = 1 if batch is None else _positive("batch", batch)
    if (n or 1) * batch > LARGEST_TOKENS:
        raise ProfileError(TOO_LARGE.format(n=n, batch=batch))
    if roles is not None and not isinstance(roles, Mapping):
        raise ProfileError(f"roles= must be a dict of role -> module-name globs, got {type(roles).__name__} "
                           f"{roles!r}; e.g. roles={{'attention': ['layers.*.attn'], 'ffn': ['layers.*.mlp']}}")
    if spec is not None and not isinstance(spec, ModelSpec):
        raise ProfileError(f"spec= must be a pytest_attncost.ModelSpec, got {type(spec).__name__}")
    if name is not None and not isinstance(name, str):
        raise ProfileError(f"name= must be a str, got {type(name).__name__}")
    if backend is not None and backend not in BACKENDS:
        raise ProfileError(f"backend= must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if mode not in MODES:
        raise ProfileError(f"mode= must be one of {', '.join(MODES)}, got {mode!r}")
    if causal not in CAUSAL:
        raise ProfileError(f"causal= must be one of {', '.join(CAUSAL)}, got {causal!r}")
    if mode == "decode":
        new_tokens = 1 if new_tokens is None else _positive("new_tokens", new_tokens)
        if n is None:
            raise ProfileError("mode='decode' needs n=: the tokens already in the KV cache")
    elif new_tokens is not None:
        raise ProfileError(f"new_tokens= is the query length of a decode step: pass mode='decode' (mode is {mode!r})")
    options = Options(backend or "fvcore", mode, causal, bool(fallback), new_tokens or 0)
    target = _resolve_model(model)
    model_name = name or type(target).__name__
    spec_note = None
    spec_read = spec is None
    if spec is None:
        spec, spec_note = families.spec_of(target)
        if spec is not None and mode == "decode":
            spec = decode_mod.windowed_spec(spec, target)  # what the model's cache keeps
    # a spec read from the config may be corrected by the structure (gating, hybrid stacks); a given one is kept
    key = cache_key(target, n, batch, batch_given, inputs, roles, ("read" if spec_read else "given", spec), model_name,
                    options)
    cached = lookup(key)  # None: not counted yet, uncacheable (key None), or the cache is off
    if cached is not None:
        return cached
    with _quiet_torch_logs():
        result = _count(target, model_name, spec, spec_note, n, batch, batch_given, inputs, roles, options,
                        spec_read)
    if REAL_NOTE not in result.notes:  # a count on real values holds for those values only
        store(key, result)
    return result


#: Warnings on a profile: the cause, the module and the MACs concerned (see DECISIONS: plain strings).
UNPLACED_WARNING = ("{module}: {macs:,} MAC of products of two activations outside the layer's attention "
                    "module(s) could not be placed (counted as other); pass roles= to place them")
INLINE_WARNING = ("{module}: attention runs in the layer's own forward (no attention submodule), so its "
                  "projections and FFN cannot be told apart; all {macs:,} parameter MAC counted as attention_proj; "
                  "pass roles= to name the FFN")
NO_FFN_WARNING = ("{module}: the layer has attention but no FFN product, while the spec says ffn_dim={ffn_dim}; "
                  "its FFN was not found (counted as other?); pass roles=")
FORMULA_WARNING = ("{part} is {measured:,} MAC but the formula gives {expected:,} ({deviation:+.2%}): the model does "
                   "something the cost model does not describe, or a part was misplaced; compare Profile.by_module, "
                   "pass roles= or spec=")
NO_CORE_WARNING = ("no attention core was counted ({modules}): the attention ran no product the counter knows; "
                   "see unsupported_ops")
UNKNOWN_MASK_WARNING = ("{module}: causal='half' asked for, but the mask of {macs:,} core MAC has a form the plugin "
                        "cannot tell; counted in full")
SPEC_NOTE = "no formula: {why}"
FOLDED_NOTE = ("the attention ran {sequences} sequences of {n} tokens for a batch of {batch} (frames or windows folded "
               "into its batch), which the formulas, one sequence per input, do not describe; pass spec= to compare")
DECODE_HALF_NOTE = ("causal='half' does not apply to a decode step: its queries attend to every cached key, and the "
                    "core is counted as the kernel runs it")
CHUNK_HALF_WARNING = ("causal='half': {layers} layer(s) attend within chunks of {chunk} tokens, which keep fewer "
                      "query-key pairs than the n(n+1)/2 counted (chunk-aware accounting is not done)")
WINDOW_HALF_WARNING = ("causal='half': {layers} layer(s) attend within a sliding window of {window} tokens, which keeps "
                       "fewer query-key pairs than the n(n+1)/2 counted (window-aware accounting is not done)")
HYBRID_NOTE = ("{bare} layer(s) run no attention beside {layers} that do (a hybrid of attention and state-space or "
               "recurrent layers), and the cost model puts attention in every layer; pass spec= for the attention layers")
BARE_WARNING = ("{modules}: {count} layer(s) beside the attention layers ran no attention core; their {macs:,} MAC "
                "(their FFNs included) are counted as other; pass roles= to place them")
REAL_NOTE = ("counted on real tensors (the torch backend's last resort): the inputs' values chose the "
             "data-dependent branches, so this profile holds for these inputs only and is not cached")
NOTHING_RAN = ("the forward counted 0 MAC: nothing ran on these inputs (trimmed to 0 tokens?); a profile of "
               "nothing cannot stand for the model: check the inputs")


def _count(
    target: nn.Module,
    model_name: str,
    spec: ModelSpec | None,
    spec_note: str | None,
    n: int | None,
    batch: int,
    batch_given: bool,
    inputs: Any,
    roles: Mapping[str, Any] | None,
    options: Options,
    spec_read: bool = False,
) -> Profile:
    real_args: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    decoding = options.mode == "decode"
    if decoding:
        try:
            if inputs is None:
                args, kwargs = decode_mod.decode_inputs(target, n, options.new_tokens, batch)  # type: ignore[arg-type]
            else:
                real_args = _user_inputs(inputs, n, batch)
                args, kwargs = decode_mod.fresh(*real_args)  # the cache's tensors too, not only pytree leaves
        except decode_mod.DecodeError as exc:
            raise ProfileError(str(exc)) from exc
    elif inputs is None:
        args, kwargs = default_inputs(target, n, batch)
    else:
        real_args = _user_inputs(inputs, n, batch)
        args, kwargs = to_meta(real_args)

    def call() -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The inputs for one count: a decode step appends to its cache, so each count gets a fresh one."""
        return decode_mod.fresh(args, kwargs) if decoding else (args, kwargs)

    setup = _Setup.of(target, model_name, spec, spec_note, options)
    twin, notes, masks = setup.twin, setup.notes, setup.masks
    train = options.mode == "train"
    backend = "torch" if train else options.backend  # a backward needs the dispatcher's counter
    fallback_reason = None
    try:
        raw = count_forward(twin, *call(), buffer_masks=masks) if backend == "fvcore" else count_forward_torch(
            twin, *call(), train=train, buffer_masks=masks)
    except CountError as exc:
        if backend != "fvcore" or not options.fallback:
            raise ProfileError(f"{model_name}: {exc}") from exc
        fallback_reason = str(exc).splitlines()[0]
        backend = "torch"
        if decoding and real_args is not None:
            real_args = decode_mod.fresh(*real_args, meta=False)  # the user's cache stays as it was
        raw, real = _fallback(target, model_name, *call(), real_args, n, exc, masks)
        if real:
            notes.append(REAL_NOTE)

    unchecked = None
    if backend == "fvcore" and raw.opaque:
        raw, backend, fallback_reason, unchecked = _look_inside(target, model_name, raw, call, masks, options)
    return _finish(setup, raw, backend, fallback_reason, unchecked, args, kwargs, inputs, n, batch, batch_given, roles,
                   spec_read)


@dataclass
class _Setup:
    """The twin of one model and what is read from it before a count (shared by a sweep's lengths)."""

    target: nn.Module
    model_name: str
    spec: ModelSpec | None
    options: Options
    twin: nn.Module
    notes: list[str]
    masks: Mapping[str, Any] | None
    declared: dict[str, bool]
    causal_modules: frozenset[str] | None
    bidirectional: frozenset[str]
    containers: list[str]
    experts: Any
    rows: dict[Any, dict[str, tuple[str, int, str]]] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def sizes(self) -> dict[str, tuple[str, int]]:
        """Every module's class and parameter count (tied parameters once)."""
        return {name: (type(module).__name__, sum(p.numel() for p in module.parameters()))
                for name, module in self.twin.named_modules()}

    @classmethod
    def of(cls, target: nn.Module, model_name: str, spec: ModelSpec | None, spec_note: str | None,
           options: Options) -> _Setup:
        try:
            twin = meta_twin(target)
        except CountError as exc:  # a scripted module, an uncopyable model: no counter can help
            raise ProfileError(f"{model_name}: {exc}") from exc
        notes = families.prepare_twin(twin)
        # triangular mask buffers of the original (the twin's are empty): causal accounting reads them
        masks = buffer_masks(target) if options.causal == "half" else None
        if spec is None and spec_note:
            notes.append(SPEC_NOTE.format(why=spec_note))
        # what modules say of themselves: is_causal True (decoders) or False (encoders, cross-attention)
        declared = {name: module.is_causal for name, module in twin.named_modules()
                    if isinstance(getattr(module, "is_causal", None), bool)}
        half = options.causal == "half"
        return cls(
            target=target, model_name=model_name, spec=spec, options=options, twin=twin, notes=notes, masks=masks,
            declared=declared,
            causal_modules=frozenset(name for name, causal in declared.items() if causal) if half else None,
            bidirectional=frozenset(name for name, causal in declared.items() if not causal) if half else frozenset(),
            containers=[name for name, module in twin.named_modules()
                        if isinstance(module, (nn.ModuleList, nn.Sequential))],
            experts=families.experts_of(twin),
        )


def _finish(
    setup: _Setup, raw: RawCount, backend: str, fallback_reason: str | None, unchecked: str | None,
    args: tuple[Any, ...], kwargs: dict[str, Any], inputs: Any, n: int | None, batch: int, batch_given: bool,
    roles: Mapping[str, Any] | None, spec_read: bool,
) -> Profile:
    """The split, the lengths read back, the formulas and the warnings: a count made a Profile."""
    target, model_name, spec, options, twin = setup.target, setup.model_name, setup.spec, setup.options, setup.twin
    notes, declared, containers, experts = list(setup.notes), setup.declared, setup.containers, setup.experts
    causal_modules, bidirectional = setup.causal_modules, setup.bidirectional
    decoding = options.mode == "decode"
    structure = None
    try:
        if roles is not None:
            assigned = roles_mod.explicit_roles(roles, list(raw.module_names))
        else:
            structure = roles_mod.find_structure(raw.records, containers, experts)
            assigned = structure.roles()
    except roles_mod.RoleError as exc:
        raise ProfileError(f"{model_name}: {exc}") from exc
    if raw.total == 0:
        raise ProfileError(f"{model_name}: {NOTHING_RAN}")
    if decoding and not getattr(getattr(target, "config", None), "is_decoder", False):
        # what the modules that ran the step's attention say of themselves (the nearest that says anything)
        said = [next((declared[a] for a in roles_mod._ancestors(scope) if a in declared), None)
                for scope in roles_mod.core_scopes(raw.records)]
        said = [causal for causal in said if causal is not None]
        if said and not any(said):
            raise ProfileError(f"{model_name} is not a decoder: its attention is bidirectional (is_causal=False, "
                               "config.is_decoder is False), so a step against a KV cache describes no generation; "
                               "decode steps are for decoders (GPT-2, LLaMA, ...), or an encoder built with "
                               "is_decoder=True")
    if not assigned:
        raise ProfileError(
            f"{model_name}: found neither attention nor an FFN (no fused attention op and no product of two "
            f"activations chained like QK^T and AV); {roles_mod.ROLES_HINT}"
        )
    if structure is not None and structure.layers and spec is not None and spec_read:
        # gated or not, as the first layer's weights say; the family list decides where they do not tell
        layer = structure.layers[0]
        gated = families.gated_by_structure(
            twin.get_submodule(layer) if layer else twin,
            [twin.get_submodule(a) if a else twin for a in structure.attention.get(layer, ()) if a != layer], spec)
        if gated is not None and gated != spec.gated:
            spec = dataclasses.replace(spec, gated=gated)
    if structure is not None and structure.bare and spec is not None and spec_read:
        # a hybrid stack: the formulas put attention in every one of the config's layers
        notes.append(SPEC_NOTE.format(why=HYBRID_NOTE.format(bare=len(structure.bare), layers=len(structure.layers))))
        spec = None
    parts = roles_mod.split(raw.records, assigned, causal_modules, structure, bidirectional)
    if options.causal == "half" and decoding:
        notes.append(DECODE_HALF_NOTE)
    if not parts.halved:
        assert parts.attention_core + parts.attention_proj + parts.ffn + parts.other == raw.total, "split lost MACs"

    if decoding:
        n, batch = _decode_lengths(model_name, target, args, kwargs, inputs, n, batch, batch_given, spec, parts,
                                   options.new_tokens)
    else:
        n, batch = _read_lengths(model_name, target, args, kwargs, inputs, n, batch, batch_given, spec, parts)
        folded = _folded_sequences(target, args, kwargs, spec, parts, batch)
        if folded is not None and spec_read:
            notes.append(SPEC_NOTE.format(why=FOLDED_NOTE.format(sequences=folded, n=n, batch=batch)))
            spec = None
    memory = None
    if spec is not None and spec.cross_attention:
        memory = next((keys for queries, keys, _ in parts.lengths if keys != n), n)
    layers = spec.layers if spec is not None else max(1, len(structure.layers if structure else parts.attention_modules))
    result = Profile(
        name=model_name,
        n=n,
        batch=batch,
        attention_core=parts.attention_core,
        attention_proj=parts.attention_proj,
        ffn=parts.ffn,
        other=parts.other,
        layers=layers,
        spec=spec,
        m=memory,
        unsupported_ops=dict(sorted(raw.unsupported_ops.items())),
        by_module=raw.by_module,
        backend=backend,
        mode=options.mode,
        causal=options.causal,
        causal_applied=parts.halved,
        fallback=fallback_reason,
        versions=versions(),
        ffn_router=parts.ffn_router,
        notes=tuple(notes),
        modules=_module_rows(setup, assigned, structure),
        new_tokens=options.new_tokens if decoding else None,
        kv_cache_bytes=decode_mod.cache_bytes(args, kwargs) if decoding else None,
    )
    warnings = _warnings(result, parts, structure, raw)
    if unchecked:
        warnings.append(unchecked)
    if parts.halved and not decoding:  # local attention keeps fewer pairs than n(n+1)/2
        for kind, tokens, count in decode_mod.local_attention(target):
            if n > tokens:
                template = WINDOW_HALF_WARNING if kind == "window" else CHUNK_HALF_WARNING
                warnings.append(template.format(layers=count, window=tokens, chunk=tokens))
    return dataclasses.replace(result, warnings=tuple(warnings)) if warnings else result


OPAQUE = ("fvcore sees {ops} (custom torch.autograd.Function) as one opaque op each: the products inside them "
          "({hidden:,} MAC by the torch backend's count) are invisible to it")
OPAQUE_FIX = "\nFix: count with backend='torch' (its counter sees inside at the dispatcher), or leave fallback on"
OPAQUE_UNCHECKED = ("{ops}: custom torch.autograd.Function(s) fvcore sees as one opaque op each, and the torch backend "
                    "could not look inside ({why}); products inside them, if any, are not counted")


def _count_fresh_twin(target: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      masks: Mapping[str, Any] | None) -> RawCount:
    """A second opinion on *target*: the torch backend on a twin of its own (raises CountError)."""
    twin = meta_twin(target)
    families.prepare_twin(twin)
    return count_forward_torch(twin, args, kwargs, buffer_masks=masks)


def _look_inside(target: nn.Module, model_name: str, raw: RawCount, call: Callable[[], Any],
                 masks: Mapping[str, Any] | None, options: Options
                 ) -> tuple[RawCount, str, str | None, str | None]:
    """fvcore traced custom autograd Functions as opaque ops: the torch backend, which sees inside them,
    tells whether they hide products. None hidden (Bloom's GELU, a masked softmax): fvcore's count stands.
    Some hidden (YOSO's attention): the torch backend's count, as a fallback that says why. Returns the
    count, its backend, the fallback's reason and a warning (the Functions could not be looked into)."""
    def products(count: RawCount) -> int:
        return sum(r.macs for r in count.records if roles_mod._is_product(r) or roles_mod._is_fused(r))

    ops = ", ".join(raw.opaque)
    try:
        args, kwargs = call()
        seen = _count_fresh_twin(target, args, kwargs, masks)
    except CountError as exc:
        return raw, "fvcore", None, OPAQUE_UNCHECKED.format(ops=ops, why=str(exc).splitlines()[0])
    hidden = products(seen) - products(raw)
    if hidden <= 0:
        return raw, "fvcore", None, None
    reason = OPAQUE.format(ops=ops, hidden=hidden)
    if not options.fallback:
        raise ProfileError(f"{model_name}: {reason}{OPAQUE_FIX}")
    return seen, "torch", reason, None


def _module_rows(setup: _Setup, assigned: Mapping[str, str], structure: roles_mod.Structure | None
                 ) -> dict[str, tuple[str, int, str]]:
    """Every module's class, parameters and role, for Profile.table()."""
    layers = tuple(structure.layers) if structure is not None else ()
    key = (tuple(assigned.items()), layers)  # a sweep's lengths mostly find the same roles
    rows = setup.rows.get(key)
    if rows is None:
        rows = setup.rows[key] = {
            name: (kind, size, "layer" if name in layers else roles_mod.role_of(name, assigned) or "other")
            for name, (kind, size) in setup.sizes.items()}
    return dict(rows)  # each profile its own


def _warnings(result: Profile, parts: roles_mod.Split, structure: roles_mod.Structure | None, raw: RawCount) -> list[str]:
    """What makes this profile's numbers doubtful, each naming the module, the MACs and the cause."""
    found = [UNPLACED_WARNING.format(module=module, macs=macs) for module, macs in parts.unplaced.items()]
    found += [UNKNOWN_MASK_WARNING.format(module=module, macs=macs) for module, macs in parts.unknown_masks.items()]
    spec = result.spec
    if structure is not None:
        for layer in structure.inline:
            if spec is None or spec.ffn_dim > 0:
                macs = sum(r.macs for r in raw.records if r.origin == "param" and roles_mod._within(r.scope, layer))
                found.append(INLINE_WARNING.format(module=layer or type(result).__name__, macs=macs))
        if spec is not None and (spec.ffn_dim > 0 or spec.moe):
            found += [NO_FFN_WARNING.format(module=layer or result.name, ffn_dim=spec.ffn_dim)
                      for layer in structure.layers if layer not in structure.inline and layer not in structure.paired
                      and not parts.layer_ffn.get(layer)]
    if structure is not None and structure.bare:
        macs = sum(r.macs for r in raw.records if any(roles_mod._within(r.scope, b) for b in structure.bare))
        shown = ", ".join(structure.bare[:3]) + (", ..." if len(structure.bare) > 3 else "")
        found.append(BARE_WARNING.format(modules=shown, count=len(structure.bare), macs=macs))
    if parts.attention_modules and parts.attention_core == 0 and (spec is None or spec.heads):
        found.append(NO_CORE_WARNING.format(modules=", ".join(parts.attention_modules[:3])))
    expected = result.formula
    if expected is not None:
        for part in COMPONENTS:
            measured, want = getattr(result, part), getattr(expected, part)
            if measured != want:
                found.append(FORMULA_WARNING.format(part=part, measured=measured, expected=want,
                                                    deviation=(measured - want) / want if want else 1.0))
    return found


def _read_lengths(
    model_name: str, target: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: Any,
    n: int | None, batch: int, batch_given: bool, spec: ModelSpec | None, parts: roles_mod.Split,
) -> tuple[int, int]:
    """n and batch from the inputs: default inputs were built for n; the user's hold their own.

    The token dimension of the main input decides where it can be told (token ids, torch's
    Transformer modules); otherwise the queries the layers' attention saw (patch models).
    Block-sparse, chunked or pooled attention may run its products on fewer rows: that is
    not a different n.
    """
    shape = families.token_shape(target, args, kwargs)
    tokens = None if shape is None else shape[1]
    seen = _common_queries(parts)
    if inputs is None and tokens is not None and n is not None:
        return n, batch  # built for n
    measured = tokens if tokens is not None else seen
    if measured is None:
        if n is None:
            raise ProfileError(f"{model_name}: no attention ran, so n cannot be read from the inputs; pass n=")
        measured = n
    if measured == 0:
        raise ProfileError(f"{model_name}: the attention ran on 0 tokens (inputs trimmed to nothing?); "
                           "a profile of nothing cannot stand for the model: check the inputs")
    if n is not None and measured != n:
        raise ProfileError(
            f"{model_name}: n={n} was asked for, but the attention saw {measured} tokens; "
            "drop n= to use the inputs' length, or make the inputs match"
        )
    if seen == 0:
        raise ProfileError(f"{model_name}: n={measured} was asked for, but the attention ran on 0 tokens "
                           "(the model trims its inputs?); check the inputs")
    if inputs is not None:
        batch = _held_batch(model_name, target, args, kwargs, shape, spec, parts, batch, batch_given, measured)
    return measured, batch


def _folded_sequences(target: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], spec: ModelSpec | None,
                      parts: roles_mod.Split, batch: int) -> int | None:
    """The sequences the first attention ran, where they are a multiple of the batch (TimeSformer and other
    video models fold frames into their attention's batch); None for token-id models and one sequence
    per input."""
    if spec is None or not spec.heads or not parts.lengths or families.token_shape(target, args, kwargs) is not None:
        return None
    leading = parts.lengths[0][2]
    if leading % spec.heads:
        return None
    sequences = leading // spec.heads
    return sequences if sequences != batch and sequences % batch == 0 else None


def _held_batch(model_name: str, target: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                shape: tuple[int, int] | None, spec: ModelSpec | None, parts: roles_mod.Split,
                batch: int, batch_given: bool, n: int | None = None) -> int:
    """With the user's inputs the batch is what they hold: the main input's first dimension, else the
    attention's leading dimensions [b, h, n, d] or [b*h, n, d] over the spec's heads, else the first
    dimension of the float inputs ``(b, n, ...)`` whose second is the n the attention saw."""
    held = shape[0] if shape is not None else None
    if held is None:
        held = families.main_batch(target, args, kwargs)
    if held is None and spec is not None and parts.lengths and parts.lengths[0][2] % spec.heads == 0:
        held = parts.lengths[0][2] // spec.heads
    if held is None and n is not None:
        firsts = {int(t.shape[0]) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                  and t.is_floating_point() and t.dim() >= 3 and t.shape[1] == n}
        if len(firsts) == 1 and (not parts.lengths or parts.lengths[0][2] % next(iter(firsts)) == 0):
            held = firsts.pop()
    if held is None:
        return batch
    if batch_given and held != batch:
        raise ProfileError(f"{model_name}: batch={batch} was asked for, but the inputs hold a batch of {held}")
    return held


def _decode_lengths(
    model_name: str, target: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: Any,
    n: int | None, batch: int, batch_given: bool, spec: ModelSpec | None, parts: roles_mod.Split, new_tokens: int,
) -> tuple[int, int]:
    """A decode step's n and batch, after checking that the step ran ``new_tokens`` queries.

    n is the cache's length, given (the inputs were built for it); the queries are the main
    input's token dimension where it can be told, else the query length the layers' attention saw.
    """
    shape = families.token_shape(target, args, kwargs)
    queries = shape[1] if shape is not None else _common_queries(parts)
    if queries is not None and queries != new_tokens:
        raise ProfileError(f"{model_name}: a decode step of new_tokens={new_tokens} was asked for, but the step ran "
                           f"{queries} query tokens; make the inputs' new tokens match, or pass new_tokens={queries}")
    if inputs is not None:
        batch = _held_batch(model_name, target, args, kwargs, shape, spec, parts, batch, batch_given)
    if n is None:  # pragma: no cover - profile() refuses a decode step without n
        raise ProfileError(f"{model_name}: mode='decode' needs n=")
    return n, batch


def _common_queries(parts: roles_mod.Split) -> int | None:
    """The query length most core groups of the layers saw (the first such on a tie)."""
    if not parts.lengths:
        return None
    counts: dict[int, int] = {}
    for queries, _, _ in parts.lengths:
        counts[queries] = counts.get(queries, 0) + 1
    return max(counts, key=lambda q: counts[q])


#: Lengths up to which the fallback may run real tensors (weights and activations in memory).
REAL_TENSOR_MAX_N = 4096


def _fallback(
    target: nn.Module, model_name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
    real_args: tuple[tuple[Any, ...], dict[str, Any]] | None, n: int | None, first: CountError,
    masks: Mapping[str, Any] | None = None,
) -> tuple[RawCount, bool]:
    """fvcore could not trace: count with FlopCounterMode on fake tensors, else on real ones at small n.

    Real tensors are the user's own inputs as given (so data-dependent branches take the path
    those inputs take); default inputs become zero-filled tensors of their shapes.
    """
    try:
        return _count_fresh_twin(target, args, kwargs, masks), False
    except CountError as fake_error:
        on_meta = any(t.is_meta for t in [*target.parameters(), *target.buffers()])
        lengths = [d for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) for d in t.shape[1:2]]
        too_long = (n or max(lengths, default=0)) > REAL_TENSOR_MAX_N
        user_meta = real_args is not None and any(
            isinstance(t, torch.Tensor) and t.is_meta for t in pytree.tree_leaves(real_args))
        if on_meta or too_long or user_meta:
            why = ("the model lives on the meta device" if on_meta else f"n > {REAL_TENSOR_MAX_N}" if too_long
                   else "the inputs are meta tensors")
            fix = ("" if too_long or user_meta else
                   f"\nFix: pass the model built on the CPU (not a factory, not on meta): the torch backend then runs "
                   f"it on real tensors (n <= {REAL_TENSOR_MAX_N}), and the values it reads choose its branches.")
            raise ProfileError(
                f"{model_name}: {first}\nThe torch backend could not count it either ({fake_error}); real tensors "
                f"were not tried: {why}.{fix}"
            ) from first
        if real_args is not None:
            real_call = real_args
        else:
            real_call = (to_real(args), to_real(kwargs))
        twin = real_twin(target)
        families.prepare_twin(twin)
        try:
            return count_forward_torch(twin, real_call[0], real_call[1], fake=False, buffer_masks=masks), True
        except CountError as real_error:
            raise ProfileError(f"{model_name}: {first}\nThe fallback failed too: {real_error}") from first


def sweep(
    model: nn.Module | Callable[[], nn.Module],
    ns: Any,
    **profile_kwargs: Any,
) -> Sweep:
    """Profile *model* at every length in *ns*; the :class:`Sweep` solves the thresholds exactly.

    A factory is built once (on the meta device) and counted at each length.

    Raises:
        ProfileError: bad lengths, or any error :func:`profile` raises.
    """
    if isinstance(ns, (str, bytes)) or not hasattr(ns, "__iter__"):
        raise ProfileError(f"ns must be a list of lengths such as [512, 1024, 4096], got {ns!r}")
    lengths = [_positive("every n", n) for n in ns]
    if len(set(lengths)) != len(lengths) or not lengths:
        raise ProfileError(f"ns must hold distinct lengths, got {list(ns)!r}")
    if "n" in profile_kwargs:
        raise ProfileError("sweep() takes the lengths as ns=[...], not n=")
    target = _resolve_model(model)
    if profile_kwargs.get("name") is None:
        profile_kwargs["name"] = type(target).__name__
    swept = _one_run(target, lengths, profile_kwargs)
    if swept is not None:
        return Sweep(swept, one_run=True)
    return Sweep([profile(target, n, **profile_kwargs) for n in lengths])


#: Attention and expert implementations that are transformers' own code (others are registered by users).
_BUILT_IN_IMPLEMENTATIONS = (None, "eager", "sdpa", "batched_mm", "grouped_mm")


def _library_code(twin: nn.Module) -> bool:
    """Whether every module runs torch's or transformers' own forward, with their own attention and experts.

    That code is written to run with symbolic sizes (torch.compile, torch.export with dynamic lengths):
    it decides on sizes' values, which a one-run sweep checks, never on their type.
    """
    for module in twin.modules():
        if type(module).__module__.split(".")[0] not in ("torch", "transformers") or "forward" in vars(module):
            return False
        config = vars(module).get("config")
        if config is not None and any(getattr(config, key, None) not in _BUILT_IN_IMPLEMENTATIONS
                                      for key in ("_attn_implementation", "_experts_implementation")):
            return False
    return True


def _one_run(target: nn.Module, lengths: list[int], kwargs: dict[str, Any]) -> list[Profile] | None:
    """The torch backend's sweep: every length counted in one run (see lengths.py); None where that cannot be.

    Only forward counts of default inputs or of a callable ``inputs=`` (called with the swept length on the
    meta device), with arguments profile() would take as they are; anything
    else (and any length the run cannot stand for) is counted one length at a time, which also gives
    bad arguments their usual message.
    """
    allowed = {"batch", "inputs", "roles", "spec", "name", "backend", "mode", "causal", "fallback"}
    inputs = kwargs.get("inputs")
    if inputs is not None and (not callable(inputs) or isinstance(inputs, (nn.Module, torch.Tensor))):
        return None  # fixed inputs hold one length
    if (kwargs.get("backend") != "torch" or kwargs.get("mode", "forward") != "forward" or not set(kwargs) <= allowed
            or kwargs.get("causal", "full") not in CAUSAL or not isinstance(kwargs.get("name"), str)
            or not isinstance(kwargs.get("roles") or {}, Mapping) or not isinstance(kwargs.get("spec"), (ModelSpec, type(None)))):
        return None
    batch_given = kwargs.get("batch") is not None
    batch = kwargs.get("batch") or 1
    if type(batch) is not int or batch < 1 or max(lengths) * batch > LARGEST_TOKENS or len(lengths) < 2:
        return None
    roles, spec, model_name = kwargs.get("roles"), kwargs.get("spec"), kwargs["name"]
    options = Options("torch", "forward", kwargs.get("causal", "full"), bool(kwargs.get("fallback", True)), 0)
    spec_note, spec_read = None, spec is None
    if spec is None:
        spec, spec_note = families.spec_of(target)
    keys = cache_keys(target, lengths, batch, batch_given, inputs, roles, ("read" if spec_read else "given", spec),
                      model_name, options)
    cached = [lookup(key) for key in keys]
    if all(found is not None for found in cached):
        return cached  # type: ignore[return-value]
    def inputs_at(n: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if inputs is None:
            return default_inputs(target, n, batch)
        if isinstance(n, int):
            return to_meta(_user_inputs(inputs, n, batch))  # as profile() builds them
        with torch.device("meta"):  # the user's callable, given the swept length: tensors made on meta
            made = _user_inputs(inputs, n, batch)
        if not all(t.is_meta for t in pytree.tree_leaves(made) if isinstance(t, torch.Tensor)):
            raise ProfileError("inputs= made tensors off the meta device for a swept length")
        return made

    try:
        args, kwargs_in = inputs_at(cast(int, lengths_mod.length_of(lengths)))
        if not lengths_mod.swept((args, kwargs_in)):
            return None  # inputs that do not depend on n (an image model): nothing to sweep in one run
        with _quiet_torch_logs():
            setup = _Setup.of(target, model_name, spec, spec_note, options)
            library = _library_code(setup.twin)
            raw = count_forward_torch(setup.twin, args, kwargs_in, buffer_masks=setup.masks)
            state = [t.shape for t in (*setup.twin.parameters(), *setup.twin.buffers())]
            if lengths_mod.swept(state):
                return None  # the forward made state of the lengths' sizes (a lazily sized table): one at a time
            raws = at_lengths(raw, len(lengths))
            if not library:
                # code of the user's own: a branch on the *type* of a size (isinstance(n, int)) would go one way
                # at every length without a decision on a value; the first length counted alone must agree
                alone = _count_fresh_twin(target, *inputs_at(lengths[0]), masks=setup.masks)
                first = raws[0]
                if (alone.total, alone.records, alone.by_module, alone.unsupported_ops) != (
                        first.total, first.records, first.by_module, first.unsupported_ops):
                    return None
            profiles = []
            for n, raw_n in zip(lengths, raws):
                at_n, kwargs_n = inputs_at(n)
                profiles.append(_finish(setup, raw_n, "torch", None, None, at_n, kwargs_n, inputs, n, batch,
                                        batch_given, roles, spec_read))
    except (Exception, lengths_mod.Diverged):  # noqa: BLE001 - the lengths one at a time say what is wrong, if anything
        return None
    for key, result in zip(keys, profiles):
        store(key, result)
    return profiles
