"""Decode steps: a KV cache of ``n`` tokens on the meta device, the step's inputs, and its bytes.

A decode step runs ``new_tokens`` query tokens against a cache that already holds ``n``
tokens (DECISIONS: "Decode step"). For transformers decoders the cache is the model's own
``DynamicCache``, filled with ``n`` tokens of meta tensors through its ``update`` (so a
sliding-window layer keeps what transformers keeps); custom models bring their own cache
through ``inputs=``.

The forward mutates the cache (it appends the step's keys and values), so every count runs
on a fresh copy of the inputs (:func:`fresh`).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import formulas
from .formulas import ModelSpec

__all__ = ["DecodeError", "DecodeSweep", "cache_bytes", "decode_inputs", "decode_sweep", "fresh", "local_attention",
           "plot_decode", "sliding_spec", "windowed_spec"]

#: Cache layer classes whose behaviour the decode formulas describe.
_PLAIN_LAYERS = ("DynamicLayer",)
_SLIDING_LAYERS = ("DynamicSlidingWindowLayer",)

DECODE_INPUTS_HINT = (
    "pass inputs= as a callable (n, batch) -> dict that builds the step's inputs: the new tokens and a "
    "cache holding n tokens (meta tensors cost nothing)"
)


class DecodeError(ValueError):
    """The decode inputs cannot be built; the message says what to pass."""


def _forward_params(model: nn.Module) -> Mapping[str, Any]:
    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}


def _cache_argument(model: nn.Module, params: Mapping[str, Any]) -> str:
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise DecodeError(f"{type(model).__name__}.forward takes no cache (neither cache= nor past_key_values=); "
                      f"{DECODE_INPUTS_HINT}")


def _layer_types(config: Any) -> list[str]:
    from transformers.cache_utils import get_layer_types_and_kwargs

    return list(get_layer_types_and_kwargs(config)[0])


def decode_inputs(model: nn.Module, n: int, new_tokens: int, batch: int,
                  dtype: torch.dtype | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The inputs of one decode step of a transformers decoder, on the meta device.

    A ``DynamicCache`` built from the model's config (sliding-window layers where the config
    has them), filled with ``n`` tokens of keys and values ``[batch, g, n, d]`` through its own
    ``update``; ``new_tokens`` token ids; positions ``n .. n + new_tokens - 1``.

    Raises:
        DecodeError: not a transformers decoder, or a cache kind the formulas do not describe.
    """
    from transformers import DynamicCache

    from .families import float_dtype, spec_from_config

    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise DecodeError(f"cannot build a KV cache for {name} (not a transformers model); {DECODE_INPUTS_HINT}")
    if getattr(config, "is_encoder_decoder", False):
        raise DecodeError(f"{name} is an encoder-decoder: mode='decode' builds caches for decoder-only models; "
                          f"{DECODE_INPUTS_HINT}")
    if getattr(model, "main_input_name", "input_ids") != "input_ids":
        raise DecodeError(f"{name} does not take token ids; {DECODE_INPUTS_HINT}")
    params = _forward_params(model)
    cache_name = _cache_argument(model, params)
    try:
        spec = spec_from_config(config)
        types = _layer_types(config)
        cache = DynamicCache(config=config)
    except Exception as exc:  # noqa: BLE001 - the config is the user's
        raise DecodeError(f"cannot build a KV cache for {name} ({type(exc).__name__}: {exc}); "
                          f"{DECODE_INPUTS_HINT}") from exc
    kinds = {type(layer).__name__ for layer in cache.layers}
    unknown = sorted(kinds - set(_PLAIN_LAYERS) - set(_SLIDING_LAYERS))
    if unknown or len(cache.layers) != spec.layers:
        why = f"cache layers {', '.join(unknown)}" if unknown else f"{len(cache.layers)} cache layers for {spec.layers}"
        raise DecodeError(f"{name}: {why} ({', '.join(sorted(set(types)))}): the decode formulas describe full and "
                          f"sliding-window attention caches only; {DECODE_INPUTS_HINT}")
    meta = torch.device("meta")
    dtype = dtype or float_dtype(model)
    for index in range(spec.layers):
        keys = torch.zeros((batch, spec.g, n, spec.head_dim), dtype=dtype, device=meta)
        cache.update(keys, torch.zeros_like(keys), index)
    kwargs: dict[str, Any] = {
        "input_ids": torch.zeros((batch, new_tokens), dtype=torch.long, device=meta),
        cache_name: cache,
    }
    positions = torch.arange(n, n + new_tokens, device=meta).unsqueeze(0).expand(batch, new_tokens)
    if "position_ids" in params:
        kwargs["position_ids"] = positions
    if "cache_position" in params:
        kwargs["cache_position"] = torch.arange(n, n + new_tokens, device=meta)
    if "use_cache" in params:
        kwargs["use_cache"] = True
    return (), kwargs


def sliding_spec(model: nn.Module) -> tuple[int | None, int]:
    """(window, sliding layers) of a transformers decoder's cache: what its config makes ``DynamicCache`` build."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        return None, 0
    try:
        types = _layer_types(config)
        windows = {getattr(layer_config, "sliding_window", None) for layer_config, kind
                   in zip(config.per_layer_config, types) if kind == "sliding_attention"}
    except Exception:  # noqa: BLE001 - no cache structure known: no window
        return None, 0
    known = [int(window) for window in windows if window is not None]
    if len(known) != 1:
        return None, 0
    return known[0], sum(kind == "sliding_attention" for kind in types)


def local_attention(model: nn.Module) -> list[tuple[str, int, int]]:
    """(kind, tokens, layers) of the layers that attend locally: ``"window"`` (sliding-window layers, GPT-Neo's
    local ones) and ``"chunk"`` (Llama-4's chunked attention). Empty where the config says of none."""
    config = getattr(model, "config", None)
    found = []
    window, sliding = sliding_spec(model)
    kinds, size = getattr(config, "attention_layers", None), getattr(config, "window_size", None)
    if window is None and isinstance(size, int) and isinstance(kinds, list):
        window, sliding = size, kinds.count("local")  # GPT-Neo's local layers
    if window is not None and sliding:
        found.append(("window", window, sliding))
    chunk, types = getattr(config, "attention_chunk_size", None), getattr(config, "layer_types", None)
    chunked = types.count("chunked_attention") if isinstance(types, list) else 0
    if isinstance(chunk, int) and chunked:
        found.append(("chunk", chunk, chunked))
    return found


def windowed_spec(spec: ModelSpec, model: nn.Module) -> ModelSpec:
    """*spec* with the sliding window the model's KV cache keeps (unchanged when it keeps none)."""
    window, layers = sliding_spec(model)
    if window is None or spec.sliding_window is not None:
        return spec
    return dataclasses.replace(spec, sliding_window=window, sliding_layers=None if layers == spec.layers else layers)


# --- copies and bytes --------------------------------------------------------------------------


def _tensors_in(value: Any, found: dict[int, torch.Tensor], depth: int = 0, seen: set[int] | None = None) -> None:
    """Every tensor reachable from *value* through containers and object attributes (a cache's layers)."""
    seen = set() if seen is None else seen
    if depth > 8 or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        found[id(value)] = value
    elif isinstance(value, Mapping):
        for item in value.values():
            _tensors_in(item, found, depth + 1, seen)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            _tensors_in(item, found, depth + 1, seen)
    elif isinstance(value, nn.Module) or isinstance(value, (str, bytes, int, float, bool, type(None))):
        return
    elif hasattr(value, "__dict__"):
        for item in vars(value).values():
            _tensors_in(item, found, depth + 1, seen)


def fresh(args: tuple[Any, ...], kwargs: dict[str, Any], *, meta: bool = True) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A copy of the step's inputs whose caches have not run yet: tensors on the meta device (or cloned).

    The forward appends to the cache, so a second count (the fallback, a cross-check) must
    not see the first one's keys.
    """
    found: dict[int, torch.Tensor] = {}
    _tensors_in((args, kwargs), found)
    memo: dict[int, Any] = {}
    for key, tensor in found.items():
        memo[key] = torch.empty_like(tensor, device="meta") if meta else tensor.clone()
    return copy.deepcopy((args, kwargs), memo)


def cache_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes of every tensor held by a cache object among the inputs (not the inputs' own tensors).

    Tensors passed directly (token ids, positions) are not the cache; tensors reached through
    another object (a ``Cache``'s layers, a custom cache's attributes) or a ``past_key_values``
    tuple are.
    """
    held: dict[int, torch.Tensor] = {}
    for key, value in [*enumerate(args), *kwargs.items()]:
        if isinstance(value, torch.Tensor):
            continue
        if isinstance(value, (list, tuple, Mapping)) and not (isinstance(key, str) and key in ("past_key_values", "cache")):
            continue
        layers = getattr(value, "layers", None)
        if isinstance(layers, list) and layers and all(hasattr(layer, "keys") for layer in layers):
            # a transformers Cache: its layers' keys and values (not the window-size scalars beside them)
            for layer in layers:
                _tensors_in([getattr(layer, "keys", None), getattr(layer, "values", None)], held)
        else:
            _tensors_in(value, held)
    # a view is counted as the tensor it shows: a sliding layer keeps a window-sized slice of a longer tensor
    return sum(t.numel() * t.element_size() for t in held.values() if t.dim() > 0)


# --- over the context length -----------------------------------------------------------------


@dataclass(frozen=True)
class DecodeSweep:
    """Decode steps of one model at several cache lengths, and the crossover solved from the counts.

    A step's core is ``β·(n + q)`` in the cache length n (β = ``2·q·h·d·layers``) while its
    projections and FFN do not depend on n, so two lengths fix β and the others must fit.
    """

    profiles: tuple[Any, ...]

    @property
    def lengths(self) -> list[int]:
        return [p.n for p in self.profiles]

    @property
    def slope(self) -> Fraction | None:
        """β: core MACs per cached token, when every step fits ``core = β·(n + q)`` (None otherwise:
        a sliding window filled, or projections and FFN that change with n)."""
        first, last = self.profiles[0], self.profiles[-1]
        q = first.new_tokens or 1
        beta = Fraction(last.attention_core - first.attention_core, last.n - first.n)
        for p in self.profiles:
            if (p.attention_core != beta * (p.n + q) or p.ffn != first.ffn
                    or p.attention_proj != first.attention_proj):
                return None
        return beta

    @property
    def crossover_n(self) -> Fraction | None:
        """The context (keys a new token attends to, itself included) where the measured core reaches
        the measured FFN: ``ffn / β``; compare :func:`pytest_attncost.formulas.decode_crossover_n`."""
        beta = self.slope
        if beta is None or beta <= 0:
            return None
        return Fraction(self.profiles[0].ffn) / beta

    @property
    def formula_crossover_n(self) -> Fraction | None:
        spec = self.profiles[0].spec
        return None if spec is None else formulas.decode_crossover_n(spec)

    def to_dict(self) -> dict[str, Any]:
        cross, formula = self.crossover_n, self.formula_crossover_n
        return {"name": self.profiles[0].name, "lengths": self.lengths, "mode": "decode",
                "new_tokens": self.profiles[0].new_tokens,
                "crossover_n": None if cross is None else float(cross),
                "formula_crossover_n": None if formula is None else float(formula),
                "profiles": [p.to_dict() for p in self.profiles]}


def decode_sweep(model: Any, ns: Any, new_tokens: int = 1, **profile_kwargs: Any) -> DecodeSweep:
    """Profile a decode step of *model* at every cache length in *ns* (two or more, distinct).

    Raises:
        ProfileError: bad lengths, or anything :func:`pytest_attncost.profile` raises.
    """
    from .api import ProfileError, _resolve_model, profile

    lengths = list(ns) if not isinstance(ns, (str, bytes)) and hasattr(ns, "__iter__") else None
    if not lengths or len(lengths) < 2 or len(set(lengths)) != len(lengths):
        raise ProfileError(f"ns must hold two or more distinct cache lengths such as [1024, 4096], got {ns!r}")
    target = _resolve_model(model)
    profile_kwargs.setdefault("name", type(target).__name__)
    profiles = [profile(target, n, mode="decode", new_tokens=new_tokens, **profile_kwargs) for n in sorted(lengths)]
    return DecodeSweep(tuple(profiles))


def plot_decode(spec: ModelSpec, ns: Any, path: Any, new_tokens: int = 1, batch: int = 1) -> Path:
    """Plot a decode step's core, projections and FFN per new token over the cache length, with the
    crossover marked; writes *path* (its suffix picks the format) and returns it.

    Raises:
        ImportError: matplotlib is missing (``pip install 'pytest-attncost[plot]'``).
    """
    from .plots import require_matplotlib

    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted(ns)
    steps = [formulas.decode_costs(spec, n, new_tokens, batch) for n in lengths]
    per_token = new_tokens * batch
    figure, ax = plt.subplots(figsize=(7, 4))
    for part, label in (("attention_core", "core"), ("attention_proj", "projections"), ("ffn", "FFN")):
        ax.plot(lengths, [getattr(s, part) / per_token for s in steps], marker="o", label=label)
    cross = formulas.decode_crossover_n(spec)
    if cross is not None:
        ax.axvline(float(cross), color="grey", linestyle="--", label=f"core = FFN at {float(cross):,.0f}")
    ax.set_xlabel("tokens in the KV cache (n)")
    ax.set_ylabel("MAC per new token (whole model)")
    ax.set_title("decode step against a KV cache")
    ax.legend()
    target = Path(path)
    figure.savefig(target, bbox_inches="tight", metadata={"Date": None} if target.suffix == ".svg" else None)
    plt.close(figure)
    return target
