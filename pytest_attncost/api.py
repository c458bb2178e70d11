"""``profile()``: count a model's forward pass, split it, and compare it with the formulas.

Usable outside pytest (a notebook, a script); the ``attncost`` fixture is a thin
wrapper that adds the marker's defaults and records the result for the report.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from dataclasses import dataclass
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Union

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import roles as roles_mod
from .counting import (
    ATTENTION_OPS,
    CountError,
    RawCount,
    count_forward,
    count_forward_torch,
    meta_twin,
    real_twin,
    to_meta,
    to_real,
)
from .reporting import versions
from .formulas import ModelSpec
from .result import Profile
from .sweep import Sweep

__all__ = ["ProfileError", "profile", "spec_of", "sweep"]

Inputs = Union[tuple[Any, ...], list[Any], dict[str, Any], torch.Tensor, Callable[[int, int], Any]]

INPUTS_HINT = (
    "pass inputs= as a tuple of positional arguments, a dict of keyword arguments, "
    "or a callable (n, batch) -> tuple | dict"
)


BACKENDS = ("fvcore", "torch")
MODES = ("forward", "train")
CAUSAL = ("full", "half")


@dataclass(frozen=True)
class Options:
    """How to count: part of the cache key."""

    backend: str = "fvcore"
    mode: str = "forward"
    causal: str = "full"
    fallback: bool = True


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
                f"({type(exc).__name__}: {exc}); pass the built nn.Module instead"
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
    """The cost-model shape of a transformers model or a torch Transformer module, if known."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "model_type"):
        try:
            return ModelSpec.from_config(config)
        except ValueError:
            return None
    if isinstance(model, nn.MultiheadAttention):
        return ModelSpec(model.embed_dim, model.num_heads, model.head_dim, layers=1, ffn_dim=0)
    if isinstance(model, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        attn = model.self_attn
        return ModelSpec(
            attn.embed_dim, attn.num_heads, attn.head_dim, layers=1, ffn_dim=model.linear1.out_features,
            cross_attention=isinstance(model, nn.TransformerDecoderLayer),
        )
    if isinstance(model, (nn.TransformerEncoder, nn.TransformerDecoder)):
        first = spec_of(model.layers[0])
        if first is None:
            return None
        return ModelSpec(**{**first.to_dict(), "layers": len(model.layers)})
    return None


def _float_dtype(model: nn.Module) -> torch.dtype:
    for tensor in model.parameters():
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def _batch_first(model: nn.Module) -> bool:
    if isinstance(model, nn.MultiheadAttention):
        return bool(model.batch_first)
    if isinstance(model, (nn.TransformerEncoder, nn.TransformerDecoder)):
        return _batch_first(model.layers[0])
    return bool(getattr(model.self_attn, "batch_first", False))


def default_inputs(model: nn.Module, n: int | None, batch: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Inputs for known model kinds, built on the meta device (no memory, no values).

    Vision models take an image of the config's size (n is then patches + 1); every
    other kind needs *n*.
    """
    def need_n() -> int:
        if n is None:
            raise ProfileError(f"profile({type(model).__name__}) needs n= (or inputs=): the sequence length to count at")
        return n

    meta = torch.device("meta")
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "model_type"):
        params: Mapping[str, Any]
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        main = getattr(model, "main_input_name", "input_ids")
        kwargs: dict[str, Any] = {}
        if main == "input_ids":
            n = need_n()
            ids = torch.zeros((batch, n), dtype=torch.long, device=meta)
            kwargs["input_ids"] = ids
            # Explicit positions and token types: counting past max_position_embeddings is
            # the article's what-if, and slicing the model's own buffers would stop at it.
            if "position_ids" in params:
                kwargs["position_ids"] = torch.zeros((batch, n), dtype=torch.long, device=meta)
            if "token_type_ids" in params:
                kwargs["token_type_ids"] = torch.zeros((batch, n), dtype=torch.long, device=meta)
            if "decoder_input_ids" in params:
                kwargs["decoder_input_ids"] = torch.zeros((batch, n), dtype=torch.long, device=meta)
        elif main == "pixel_values":
            size = getattr(config, "image_size", 224)
            channels = getattr(config, "num_channels", 3)
            kwargs["pixel_values"] = torch.zeros((batch, channels, size, size), dtype=_float_dtype(model), device=meta)
        else:
            raise ProfileError(f"cannot build default inputs for {type(model).__name__} ({main!r}); {INPUTS_HINT}")
        if "use_cache" in params:
            kwargs["use_cache"] = False  # a DynamicCache cannot cross the tracer
        return (), kwargs
    torch_kinds = (nn.MultiheadAttention, nn.TransformerEncoder, nn.TransformerEncoderLayer,
                   nn.TransformerDecoder, nn.TransformerDecoderLayer)
    if isinstance(model, torch_kinds):
        n = need_n()
        width = model.embed_dim if isinstance(model, nn.MultiheadAttention) else spec_of(model).hidden  # type: ignore[union-attr]
        shape = (batch, n, width) if _batch_first(model) else (n, batch, width)
        x = torch.zeros(shape, dtype=_float_dtype(model), device=meta)
        if isinstance(model, nn.MultiheadAttention):
            return (x, x, x), {}
        if isinstance(model, (nn.TransformerDecoder, nn.TransformerDecoderLayer)):
            return (x, torch.zeros(shape, dtype=x.dtype, device=meta)), {}
        return (x,), {}
    raise ProfileError(f"cannot guess the inputs of {type(model).__name__}; {INPUTS_HINT}")


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


# --- cache: the key and the LRU live in cache.py (api.cache_key and api.clear_cache stay importable)

from .cache import cache_key, clear_cache, lookup, store  # noqa: E402


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
        mode: ``"forward"``, or ``"train"``: forward plus a real backward (torch backend).
        causal: ``"full"`` counts the n x n product a dense kernel executes; ``"half"`` counts
            the n(n+1)/2 pairs of causal self-attention (never cross-attention or
            bidirectional models).
        fallback: when fvcore cannot trace the model, count with the torch backend (on fake
            tensors, else on real ones at small n) and say so in ``Profile.fallback``.

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
    options = Options(backend or "fvcore", mode, causal, bool(fallback))
    target = _resolve_model(model)
    model_name = name or type(target).__name__
    spec = spec if spec is not None else spec_of(target)
    key = cache_key(target, n, batch, batch_given, inputs, roles, spec, model_name, options)
    cached = lookup(key)  # None: not counted yet, uncacheable (key None), or the cache is off
    if cached is not None:
        return cached
    result = _count(target, model_name, spec, n, batch, batch_given, inputs, roles, options)
    store(key, result)
    return result


def _count(
    target: nn.Module,
    model_name: str,
    spec: ModelSpec | None,
    n: int | None,
    batch: int,
    batch_given: bool,
    inputs: Any,
    roles: Mapping[str, Any] | None,
    options: Options,
) -> Profile:

    if inputs is None:
        args, kwargs = default_inputs(target, n, batch)
    else:
        args, kwargs = _user_inputs(inputs, n, batch)
        args, kwargs = to_meta((args, kwargs))

    twin = meta_twin(target)
    causal_modules = frozenset(
        name for name, module in twin.named_modules() if getattr(module, "is_causal", None) is True
    ) if options.causal == "half" else frozenset()
    train = options.mode == "train"
    backend = "torch" if train else options.backend  # a backward needs the dispatcher's counter
    fallback_reason = None
    try:
        raw = count_forward(twin, args, kwargs) if backend == "fvcore" else count_forward_torch(
            twin, args, kwargs, train=train)
    except CountError as exc:
        if backend != "fvcore" or not options.fallback:
            raise ProfileError(f"{model_name}: {exc}") from exc
        fallback_reason = str(exc).splitlines()[0]
        backend = "torch"
        raw = _fallback(target, model_name, args, kwargs, n, exc)

    try:
        assigned = (
            roles_mod.explicit_roles(roles, list(raw.module_names))
            if roles is not None
            else roles_mod.auto_roles(raw.module_names)
        )
    except roles_mod.RoleError as exc:
        raise ProfileError(f"{model_name}: {exc}") from exc
    if not assigned and not any(r.op in ATTENTION_OPS for r in raw.records):
        raise ProfileError(
            f"{model_name}: found neither attention nor an FFN (no module class the plugin knows, "
            f"no fused attention op); {roles_mod.ROLES_HINT}"
        )
    parts = roles_mod.split(raw.records, assigned, causal_modules)
    if not parts.halved:
        assert parts.attention_core + parts.attention_proj + parts.ffn + parts.other == raw.total, "split lost MACs"

    seen = parts.lengths[0] if parts.lengths else None
    if n is None:
        if seen is None:
            raise ProfileError(f"{model_name}: no attention ran, so n cannot be read from the inputs; pass n=")
        n = seen[0]
    elif seen is not None and seen[0] != n:
        raise ProfileError(
            f"{model_name}: n={n} was asked for, but the attention saw {seen[0]} tokens; "
            "drop n= to use the inputs' length, or make the inputs match"
        )
    if inputs is not None and seen is not None and spec is not None and seen[2] % spec.heads == 0:
        # With the user's inputs the batch is what they hold: [b, h, n, d] or [b*h, n, d].
        held = seen[2] // spec.heads
        if batch_given and held != batch:
            raise ProfileError(f"{model_name}: batch={batch} was asked for, but the inputs hold a batch of {held}")
        batch = held
    memory = None
    if spec is not None and spec.cross_attention:
        memory = next((keys for queries, keys, _ in parts.lengths if keys != n), n)
    layers = spec.layers if spec is not None else max(1, len(parts.attention_modules))
    return Profile(
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
    )


#: Lengths up to which the fallback may run real tensors (weights and activations in memory).
REAL_TENSOR_MAX_N = 4096


def _fallback(
    target: nn.Module, model_name: str, args: tuple[Any, ...], kwargs: dict[str, Any], n: int | None,
    first: CountError,
) -> RawCount:
    """fvcore could not trace: count with FlopCounterMode on fake tensors, else on real ones at small n."""
    try:
        return count_forward_torch(meta_twin(target), args, kwargs)
    except CountError as fake_error:
        on_meta = any(t.is_meta for t in [*target.parameters(), *target.buffers()])
        lengths = [d for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) for d in t.shape[1:2]]
        too_long = (n or max(lengths, default=0)) > REAL_TENSOR_MAX_N
        if on_meta or too_long:
            why = "the model lives on the meta device" if on_meta else f"n > {REAL_TENSOR_MAX_N}"
            raise ProfileError(
                f"{model_name}: {first}\nThe torch backend could not count it either ({fake_error}); real tensors "
                f"were not tried: {why}."
            ) from first
        try:
            return count_forward_torch(real_twin(target), to_real(args), to_real(kwargs), fake=False)
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
    return Sweep([profile(target, n, **profile_kwargs) for n in lengths])
