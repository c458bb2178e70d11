"""What the plugin knows about model families and cannot read from structure: a config's :class:`ModelSpec`,
default and decode inputs, local attention, what the meta twin must change, mixture-of-experts weights.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from unittest import mock

import torch
from torch import nn

from .errors import ProfileError
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .formulas import ModelSpec

__all__ = [
    "GATED_FAMILIES",
    "batch_first",
    "decode_inputs",
    "default_inputs",
    "experts_of",
    "local_attention",
    "local_layers",
    "patchify_conv",
    "prepare_twin",
    "sliding_spec",
    "spec_from_config",
    "spec_of",
    "windowed_spec",
    "with_window",
]

# transformers families whose MLP is gated (gate, up and down projections).
GATED_FAMILIES = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma", "gemma2", "gemma3",
     "gemma3_text", "phi3", "olmo", "olmo2", "olmo3", "olmoe", "granite", "granitemoe", "granitemoeshared",
     "cohere", "cohere2", "stablelm", "smollm3", "deepseek_v3", "deepseek_v2", "helium", "glm", "ministral",
     "modernbert", "phimoe", "ernie4_5", "ernie4_5_moe", "exaone4", "jetmoe", "dbrx", "jamba", "recurrent_gemma",
     "doge", "seed_oss", "hunyuan_v1_dense", "gemma3n_text"}
)

INPUTS_HINT = ("pass inputs= as a tuple of positional arguments, a dict of keyword arguments, "
               "or a callable (n, batch) -> tuple | dict")


def _get(config: Any, *names: str) -> Any:
    return next((value for name in names if (value := getattr(config, name, None)) is not None), None)


def _moe_fields(config: Any, layers: int, heads_hidden: int) -> dict[str, Any]:
    """experts, top_k, expert and shared widths, dense layers of a mixture-of-experts config."""
    experts = _get(config, "num_local_experts", "num_experts", "n_routed_experts")
    if not experts or getattr(config, "is_moe", True) is False:  # Doge's experts are for is_moe=True only
        return {}
    top_k = _get(config, "num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")
    if not top_k:
        raise ValueError(f"{type(config).__name__} has {experts} experts but no num_experts_per_tok")
    width = _get(config, "moe_intermediate_size") or _get(config, "intermediate_size") or 4 * heads_hidden
    fields: dict[str, Any] = {"experts": int(experts), "top_k": int(top_k), "expert_ffn_dim": int(width)}
    shared = _get(config, "shared_expert_intermediate_size", "shared_intermediate_size")
    if shared:  # Qwen2-MoE: one shared expert behind a sigmoid gate [D, 1]
        fields["shared_ffn_dim"] = int(shared)
        fields["shared_gate"] = bool(getattr(config, "shared_expert_intermediate_size", None))
    n_shared = _get(config, "n_shared_experts")
    if n_shared:  # DeepSeek: n shared experts fused into one MLP of n x the expert width
        fields["shared_ffn_dim"] = int(n_shared) * int(width)
    dense = min(layers, int(_get(config, "first_k_dense_replace", "num_dense_layers") or 0))
    only_mlp = getattr(config, "mlp_only_layers", None)
    step = getattr(config, "decoder_sparse_step", None)
    if only_mlp is not None or step is not None:
        sparse = [i for i in range(layers)
                  if i not in set(only_mlp or ()) and (not step or (i + 1) % int(step) == 0)]
        dense = layers - len(sparse)
    if dense:
        fields["dense_layers"] = dense
    return fields


def spec_from_config(config: Any) -> ModelSpec:
    """Read the cost-model shape from a transformers config (or any object with such fields, as each family names them).

    Raises:
        ValueError: the config describes something the cost model does not cover (two towers, per-stage widths,
            latent attention), or lacks a field; the message says why.
    """
    name = type(config).__name__
    if getattr(config, "text_config", None) is not None and getattr(config, "vision_config", None) is not None:
        raise ValueError(f"{name} describes two towers (text and vision) of different shapes; "
                         "profile one tower, or pass spec=ModelSpec(...)")
    if _get(config, "q_lora_rank", "kv_lora_rank") is not None:
        raise ValueError(f"{name} uses multi-head latent attention (low-rank Q/KV projections), "
                         "which the cost model does not describe; pass spec= for a formula")
    model_type = str(getattr(config, "model_type", "") or "")
    hidden = _get(config, "hidden_size", "d_model", "n_embd", "dim", "embed_dim")
    heads = _get(config, "num_attention_heads", "num_heads", "n_head", "n_heads", "encoder_attention_heads")
    layers = _get(config, "num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers")
    if hidden is None or heads is None or layers is None:
        raise ValueError(
            f"cannot read hidden size, heads and layers from {name}; "
            "pass spec=ModelSpec(hidden=..., heads=..., head_dim=..., layers=..., ffn_dim=...)"
        )
    for field, value in (("heads", heads), ("layers", layers), ("hidden size", hidden)):
        if isinstance(value, (list, tuple)):
            raise ValueError(f"{name} gives per-stage {field} ({list(value)}): its stages differ in shape "
                             "(a hierarchical model such as Swin); pass spec= for one stage")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: {field} is {value!r}, not an int; pass spec=ModelSpec(...)")
    head_dim = _get(config, "head_dim", "d_kv", "head_size") or hidden // heads
    ffn_dim = _get(config, "intermediate_size", "d_ff", "n_inner", "hidden_dim", "ffn_dim", "ffn_hidden_size",
                   "encoder_ffn_dim", "dff", "d_inner")
    ratio = getattr(config, "mlp_ratio", None)
    swiglu = bool(getattr(config, "use_swiglu_ffn", False))
    if ffn_dim is None and isinstance(ratio, (int, float)) and not isinstance(ratio, bool):
        ffn_dim = int(hidden * ratio)  # DINOv2 and kin size the MLP by a ratio
        if swiglu:  # SwiGLU keeps two thirds of that width, rounded up to a multiple of 8
            ffn_dim = (int(ffn_dim * 2 / 3) + 7) // 8 * 8
    if isinstance(ffn_dim, (list, tuple)):  # Gemma 3n: a width per layer
        if len(set(ffn_dim)) != 1:
            raise ValueError(f"{name} gives per-layer FFN widths ({list(ffn_dim)}): its layers differ in shape; "
                             "pass spec= for one of them")
        ffn_dim = ffn_dim[0]
    ffn_dim = ffn_dim or 4 * hidden
    # grouped-query heads as each library names them (litgpt: n_query_groups, torchtune: num_kv_heads)
    kv_heads = _get(config, "num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num",
                    "n_query_groups")
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        kv_heads = 1  # Falcon's multi-query attention
    gated = bool(getattr(config, "is_gated_act", False)) or swiglu or model_type in GATED_FAMILIES
    return ModelSpec(int(hidden), int(heads), int(head_dim), int(layers), int(ffn_dim),
                     kv_heads=None if kv_heads is None or kv_heads == heads else int(kv_heads), gated=gated,
                     **_moe_fields(config, int(layers), int(hidden)))


def gated_by_structure(layer: nn.Module, attention: Sequence[nn.Module], spec: ModelSpec) -> bool | None:
    """Whether the layer's FFN is gated, read from its weights' shapes (None: they do not tell): one module outside
    the attention holding three ``D x f`` matrices (or stacked expert weights), or a fused ``D x 2f`` beside a
    ``D x f``, is gated; two ``D x f`` and no fused one is not (``f``: the spec's FFN or expert width)."""
    inside = {id(m) for a in attention for m in a.modules()}
    widths = [w for w in (spec.ffn_dim, spec.expert_ffn_dim) if w]
    for module in layer.modules():
        if id(module) in inside:
            continue
        pairs = [tuple(sorted(p.shape[-2:])) for p in module.parameters(recurse=False) if p.dim() == 3]
        pairs += [tuple(sorted(weight.shape)) for child in module.children() if id(child) not in inside
                  and isinstance(weight := getattr(child, "weight", None), torch.Tensor) and weight.dim() == 2]
        for width in widths:
            single = pairs.count(tuple(sorted((spec.hidden, width))))
            fused = pairs.count(tuple(sorted((spec.hidden, 2 * width))))
            if single == 3 or (single == 1 and fused == 1):
                return True
            if single == 2 and fused == 0:
                return False
    return None


def spec_of(model: nn.Module) -> tuple[ModelSpec | None, str | None]:
    """The cost-model shape of *model*, or None and a note saying why there is none."""
    config = getattr(model, "config", None)
    if config is not None and not isinstance(config, Mapping):
        if hasattr(model, "encoder") and hasattr(model, "decoder") and isinstance(model.decoder, nn.Module):
            return None, (f"{type(model).__name__} is an encoder-decoder: the formulas describe one stack; "
                          "profile the encoder or the decoder alone, or pass spec=")
        try:
            return spec_from_config(config), None
        except ValueError as exc:
            return None, str(exc)
        except TypeError as exc:  # a field of a type no family of ours gives it
            return None, f"{type(config).__name__}'s fields do not read as one shape ({exc}); pass spec=ModelSpec(...)"
    if isinstance(model, nn.MultiheadAttention):
        return ModelSpec(model.embed_dim, model.num_heads, model.head_dim, layers=1, ffn_dim=0), None
    if isinstance(model, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        attn = model.self_attn
        return ModelSpec(
            attn.embed_dim, attn.num_heads, attn.head_dim, layers=1, ffn_dim=model.linear1.out_features,
            cross_attention=isinstance(model, nn.TransformerDecoderLayer),
        ), None
    if isinstance(model, (nn.TransformerEncoder, nn.TransformerDecoder)):
        first, why = spec_of(model.layers[0])
        return (None, why) if first is None else (dataclasses.replace(first, layers=len(model.layers)), None)
    return None, None


# --- inputs ----------------------------------------------------------------------------------


def float_dtype(model: nn.Module) -> torch.dtype:
    """The first floating-point parameter's dtype (float32 for a model without one)."""
    return next((tensor.dtype for tensor in model.parameters() if tensor.is_floating_point()), torch.float32)


def batch_first(model: nn.Module) -> bool:
    """Whether torch's Transformer module takes ``(batch, n, D)`` (else ``(n, batch, D)``)."""
    if isinstance(model, (nn.MultiheadAttention, nn.Transformer)):
        return bool(model.batch_first)
    if isinstance(model, (nn.TransformerEncoder, nn.TransformerDecoder)):
        return batch_first(model.layers[0])
    return bool(getattr(model.self_attn, "batch_first", False))


TORCH_KINDS = (nn.MultiheadAttention, nn.TransformerEncoder, nn.TransformerEncoderLayer,
                nn.TransformerDecoder, nn.TransformerDecoderLayer, nn.Transformer)
#: torch's modules that read a second sequence, in their second argument: a decoder's memory, the target
#: (nn.MultiheadAttention's keys and values too)
TWO_SEQUENCES = (nn.TransformerDecoder, nn.TransformerDecoderLayer, nn.Transformer, nn.MultiheadAttention)
ONE_SEQUENCE = ("m= is the length of a second sequence, and {model} reads one (an encoder-decoder's target, a "
                "decoder's memory): drop m=")


def default_inputs(model: nn.Module, n: int | None, batch: int, m: int | None = None
                   ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Inputs for known model kinds, on the meta device: vision models an image of the config's size (video: a clip
    of its frames), every other kind needs *n*; a second sequence (a target, a memory) at *m*, default *n*.

    Raises:
        ProfileError: *n* is missing, or the model's inputs cannot be guessed.
    """
    def need_n() -> int:
        if n is None:
            raise ProfileError(f"profile({type(model).__name__}) needs n= (or inputs=): "
                               "the sequence length to count at")
        return n

    meta = torch.device("meta")
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "model_type"):
        params = forward_params(model)
        main = getattr(model, "main_input_name", "input_ids")
        kwargs: dict[str, Any] = {}
        if main == "input_ids":
            length = need_n()
            kwargs["input_ids"] = torch.zeros((batch, length), dtype=torch.long, device=meta)
            # Explicit positions and token types: counting past max_position_embeddings is
            # the article's what-if, and slicing the model's own buffers would stop at it.
            for extra in ("position_ids", "token_type_ids", "decoder_input_ids"):
                if extra in params:
                    width = m if extra == "decoder_input_ids" and m is not None else length
                    kwargs[extra] = torch.zeros((batch, width), dtype=torch.long, device=meta)
        elif main == "pixel_values":
            kwargs["pixel_values"] = _image(model, config, batch)
        else:
            raise ProfileError(f"cannot build default inputs for {type(model).__name__} ({main!r}); {INPUTS_HINT}")
        if m is not None and "decoder_input_ids" not in kwargs:
            raise ProfileError(ONE_SEQUENCE.format(model=type(model).__name__))
        if "use_cache" in params:
            kwargs["use_cache"] = False  # a DynamicCache cannot cross the tracer
        return (), kwargs
    if isinstance(model, TORCH_KINDS):
        return _torch_inputs(model, need_n(), batch, m)
    raise ProfileError(f"cannot guess the inputs of {type(model).__name__}; {INPUTS_HINT}")


def _torch_inputs(model: nn.Module, length: int, batch: int, m: int | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """torch's Transformer modules: ``(batch, n, D)`` floats (``batch_first`` respected), a second sequence at m."""
    meta = torch.device("meta")
    spec, _ = spec_of(model)
    width = (model.embed_dim if isinstance(model, nn.MultiheadAttention) else
             model.d_model if isinstance(model, nn.Transformer) else spec.hidden)  # type: ignore[union-attr]

    def sequence(length: int, width: int) -> torch.Tensor:
        shape = (batch, length, width) if batch_first(model) else (length, batch, width)
        return torch.zeros(shape, dtype=float_dtype(model), device=meta)

    x = sequence(length, width)
    if isinstance(model, nn.MultiheadAttention):  # keys and values: the memory at m, else x itself
        if m is None and model._qkv_same_embed_dim:
            return (x, x, x), {}
        return (x, sequence(m or length, model.kdim), sequence(m or length, model.vdim)), {}
    if isinstance(model, TWO_SEQUENCES):
        return (x, sequence(m or length, width)), {}
    if m is not None:
        raise ProfileError(ONE_SEQUENCE.format(model=type(model).__name__))
    return (x,), {}


def _image(model: nn.Module, config: Any, batch: int) -> torch.Tensor:
    """An image (or a clip) of the config's size, on the meta device."""
    size = getattr(config, "image_size", None)
    if size is None:  # SegFormer and other resolution-free models: any size would be a guess
        raise ProfileError(
            f"{type(config).__name__} has no image_size, so the resolution to count at is yours to choose: "
            f"pass inputs={{'pixel_values': torch.zeros(batch, channels, height, width)}}")
    channels = getattr(config, "num_channels", 3)
    size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
    frames = getattr(config, "num_frames", None)
    # video models take (batch, frames, channels, height, width): those that embed tubelets (a Conv3d:
    # VideoMAE, ViViT) and TimeSformer; X-CLIP's vision tower takes frames folded into the batch
    video = getattr(config, "model_type", "") == "timesformer" or any(isinstance(m, nn.Conv3d) for m in model.modules())
    clip = (frames,) if video and _size(frames) else ()
    return torch.zeros((batch, *clip, channels, *size), dtype=float_dtype(model), device="meta")


# --- the twin --------------------------------------------------------------------------------

EXPERTS_NOTE = ("experts ran as batched_mm on the meta twin (the model uses {impl}): the same tokens x top_k rows "
                "through one expert's matrices, the same MACs")
LAYERDROP_NOTE = "{what} switched off on the twin so that chance does not decide the count"


def _dispatches_experts(module: nn.Module) -> bool:
    """An experts module whose forward picks an implementation by ``config._experts_implementation``."""
    return all(hasattr(module, attr) for attr in ("has_gate", "is_concatenated", "_is_expert_parallel"))


def prepare_twin(twin: nn.Module) -> list[str]:
    """Make the twin countable and deterministic; returns notes on what was changed: experts run ``batched_mm``
    (``grouped_mm``'s meta kernel refuses float32, ``eager`` reads routing values), LayerDrop and stochastic
    depth are off (they skip layers at random in training mode)."""
    notes: list[str] = []
    configs: dict[int, Any] = {}
    for module in twin.modules() if experts_of(twin) else ():
        config = getattr(module, "config", None)
        # only experts that dispatch on the setting (transformers' @use_experts_implementation marks them);
        # a family with its own routing code (JetMoE) runs as it is, and no note claims otherwise
        if config is not None and hasattr(config, "_experts_implementation") and _dispatches_experts(module):
            configs.setdefault(id(config), config)
    for config in configs.values():
        impl = config._experts_implementation
        if impl not in (None, "batched_mm"):
            config._experts_implementation = "batched_mm"
            note = EXPERTS_NOTE.format(impl=impl)
            if note not in notes:
                notes.append(note)
    dropped: list[str] = []
    seen: set[int] = set()

    def no_layerdrop(owner: Any, where: str) -> None:
        for attr in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop"):
            value = getattr(owner, attr, None)
            if isinstance(value, float) and value > 0:
                setattr(owner, attr, 0.0)
                dropped.append(f"LayerDrop ({where}.{attr}={value})")

    for name, module in twin.named_modules():
        if not module.training:
            continue
        no_layerdrop(module, name or "model")
        # wav2vec2, HuBERT, WavLM, SEW, UniSpeech read self.config.layerdrop in forward (the twin's config is a copy)
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen and not isinstance(config, Mapping):
            seen.add(id(config))
            no_layerdrop(config, f"{name or 'model'}.config")
        drop_prob = getattr(module, "drop_prob", None)
        if "DropPath" in type(module).__name__ and isinstance(drop_prob, float) and drop_prob > 0:
            module.drop_prob = 0.0
            dropped.append(f"stochastic depth ({name})")
    if dropped:
        shown = ", ".join(dropped[:3]) + (f" and {len(dropped) - 3} more" if len(dropped) > 3 else "")
        notes.append(LAYERDROP_NOTE.format(what=shown))
    return notes


@contextlib.contextmanager
def _stubbed(module: str, owner: str | None, name: str) -> Iterator[None]:
    """transformers' *name* (on class *owner* of *module*, or the module's own function) does nothing and returns
    None for the duration; nothing is stubbed where transformers has not loaded that module or has no *name*."""
    where = sys.modules.get(f"transformers.{module}")
    where = getattr(where, owner, None) if owner is not None else where
    if where is None or not hasattr(where, name):
        yield
        return
    with mock.patch.object(where, name, new=lambda *args, **kwargs: None):
        yield


def no_packed_sequences() -> contextlib.AbstractContextManager[None]:
    """transformers' search for packed sequences in the position ids finds none (see inputs.one_sequence_per_row)."""
    return _stubbed("masking_utils", None, "find_packed_sequence_indices")


def traceable() -> contextlib.AbstractContextManager[None]:
    """transformers 4 looks for packed sequences in the position ids and, under a trace, builds their mask with
    vmap indexing that torch's jit tracer cannot follow (``_Map_base::at``). On the meta device positions have
    no values to pack, so while fvcore traces the search finds none (transformers 5 traces it as it is)."""
    version = getattr(sys.modules.get("transformers"), "__version__", "5")
    return no_packed_sequences() if int(version.split(".")[0]) < 5 else contextlib.nullcontext()


def no_padding_check() -> contextlib.AbstractContextManager[None]:
    """transformers 4 reads two token ids of every forward to warn of padding without an attention mask (not while
    tracing or compiling); fake tensors have no values to read, so the memory estimate leaves the check out (the
    estimate runs as a real forward does otherwise: under a compile flag transformers would build masks a real
    run skips)."""
    return _stubbed("modeling_utils", "PreTrainedModel", "warn_if_padding_and_no_attention_mask")


def state_space_of(model: nn.Module) -> frozenset[str]:
    """Modules that hold a state-space model's own parameters, ``A_log`` and ``D`` (Mamba's and Mamba-2's mixers):
    their products of two activations (Mamba-2's chunked scan) are no attention."""
    return frozenset(name for name, module in model.named_modules()
                     if all(isinstance(getattr(module, p, None), nn.Parameter) for p in ("A_log", "D")))


def experts_of(model: nn.Module) -> dict[str, int]:
    """Modules holding mixture-of-experts weights -> number of experts: a module with ``num_experts`` and stacked
    expert weights (a 3-D parameter ``[E, ., .]``, transformers 5), or a ``ModuleList`` / ``ModuleDict`` ``experts``."""
    found: dict[str, int] = {}
    for name, module in model.named_modules():
        count = getattr(module, "num_experts", None)
        if isinstance(count, int) and count > 1 and any(
            p.dim() == 3 and p.shape[0] == count for p in module.parameters(recurse=False)
        ):
            found[name] = count
        elif (isinstance(module, (nn.ModuleList, nn.ModuleDict)) and name.rsplit(".", 1)[-1] == "experts"
              and len(module) > 1):  # a ModuleDict: SwitchTransformers' and NLLB-MoE's expert_0, expert_1, ...
            found[name] = len(module)
    return found


# --- decode steps (docs/decode.md, "A decode step") ---------------------------------------------------

#: The sliding-window cache layer class; it and ``DynamicLayer`` are what the decode formulas describe.
_SLIDING_LAYER = "DynamicSlidingWindowLayer"
DECODE_INPUTS_HINT = ("pass inputs= as a callable (n, batch) -> dict that builds the step's inputs: the new tokens "
                      "and a cache holding n tokens (meta tensors cost nothing)")


def forward_params(model: nn.Module) -> Mapping[str, Any]:
    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}


def decode_inputs(model: nn.Module, n: int, new_tokens: int, batch: int,
                  dtype: torch.dtype | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The inputs of one decode step of a transformers decoder, on the meta device: its config's ``DynamicCache``
    filled with ``n`` tokens ``[batch, g, n, d]`` through its own ``update``, positions ``n .. n + new_tokens - 1``.

    Raises:
        ProfileError: not a transformers decoder, or a cache kind the formulas do not describe.
    """
    from transformers import DynamicCache

    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise ProfileError(f"cannot build a KV cache for {name} (not a transformers model); {DECODE_INPUTS_HINT}")
    if getattr(config, "is_encoder_decoder", False):
        raise ProfileError(f"{name} is an encoder-decoder: mode='decode' builds caches for decoder-only models; "
                          f"{DECODE_INPUTS_HINT}")
    if getattr(model, "main_input_name", "input_ids") != "input_ids":
        raise ProfileError(f"{name} does not take token ids; {DECODE_INPUTS_HINT}")
    params = forward_params(model)
    cache_name = next((arg for arg in ("cache", "past_key_values") if arg in params), None)
    if cache_name is None:
        raise ProfileError(f"{name}.forward takes no cache (neither cache= nor past_key_values=); {DECODE_INPUTS_HINT}")
    try:
        spec = spec_from_config(config)
        cache = DynamicCache(config=config)
    except Exception as exc:  # noqa: BLE001 - the config is the user's
        raise ProfileError(f"cannot build a KV cache for {name} ({type(exc).__name__}: {exc}); "
                          f"{DECODE_INPUTS_HINT}") from exc
    kinds = {type(layer).__name__ for layer in cache.layers}
    unknown = sorted(kinds - {"DynamicLayer", _SLIDING_LAYER})
    if unknown or len(cache.layers) != spec.layers:
        why = f"cache layers {', '.join(unknown)}" if unknown else f"{len(cache.layers)} cache layers for {spec.layers}"
        raise ProfileError(f"{name}: {why} ({', '.join(sorted(kinds))}): the decode formulas describe full and "
                          f"sliding-window attention caches only; {DECODE_INPUTS_HINT}")
    meta = torch.device("meta")
    dtype = dtype or float_dtype(model)
    for index in range(spec.layers):
        keys = torch.zeros((batch, spec.g, n, spec.head_dim), dtype=dtype, device=meta)
        cache.update(keys, torch.zeros_like(keys), index)
    positions = torch.arange(n, n + new_tokens, device=meta).unsqueeze(0).expand(batch, new_tokens)
    extras = {"position_ids": positions, "cache_position": torch.arange(n, n + new_tokens, device=meta),
              "use_cache": True}
    return (), {"input_ids": torch.zeros((batch, new_tokens), dtype=torch.long, device=meta), cache_name: cache,
                **{key: value for key, value in extras.items() if key in params}}


def sliding_spec(model: nn.Module) -> tuple[int | None, int]:
    """(window, sliding layers) of a transformers decoder's cache: what its config makes ``DynamicCache`` build."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        return None, 0
    try:
        from transformers import DynamicCache

        layers = DynamicCache(config=config).layers
    except Exception:  # noqa: BLE001 - no cache structure known: no window
        return None, 0
    sliding = [layer for layer in layers if type(layer).__name__ == _SLIDING_LAYER]
    windows = [getattr(layer, "sliding_window", None) for layer in sliding]
    if not windows or None in windows or len(set(windows)) != 1:
        return None, 0
    return int(windows[0] or 0), len(sliding)


def _text_config(model: nn.Module) -> Any:
    """The config of the model's text decoder (a multimodal wrapper's own config holds no layers)."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", None)
    try:
        return text(decoder=True) if callable(text) else config
    except Exception:  # noqa: BLE001 - a config of the user's: its own config, then
        return config


def _size(value: Any) -> int | None:
    """A window or chunk size: a positive int (transformers takes 0 or None for none)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _local_per_layer(config: Any) -> list[tuple[str, int] | None]:
    """Each layer's local attention from the config, as the library builds its masks: ``("window", W)`` (a
    sliding window, GPT-Neo's local layers), ``("chunk", c)`` (Llama-4's chunks) or None (full causal)."""
    types, window = getattr(config, "layer_types", None), _size(getattr(config, "sliding_window", None))
    chunk = _size(getattr(config, "attention_chunk_size", None))
    if not isinstance(types, list):
        kinds, size = getattr(config, "attention_layers", None), _size(getattr(config, "window_size", None))
        if isinstance(kinds, list) and size is not None:  # GPT-Neo
            return [("window", size) if kind == "local" else None for kind in kinds]
        layers = getattr(config, "num_hidden_layers", None)
        # no layer types: a window applies to every layer (Mistral), as transformers' own caches read it
        return [("window", window)] * layers if window is not None and isinstance(layers, int) else []
    sizes = {"sliding_attention": ("window", window), "chunked_attention": ("chunk", chunk)}
    return [(kind, size) if isinstance(size, int) else None for kind, size in (sizes.get(t, ("", None)) for t in types)]


def local_layers(model: nn.Module) -> dict[str, tuple[str, int]]:
    """Module name -> ``(kind, tokens)`` for the modules of the layers that attend locally (those that carry their
    layer's index, ``layer_idx`` or GPT-Neo's ``layer_id``): what ``causal="kept"`` counts them with."""
    per_layer = _local_per_layer(_text_config(model))
    found = {}
    for name, module in model.named_modules():
        index = getattr(module, "layer_idx", getattr(module, "layer_id", None))
        local = per_layer[index] if isinstance(index, int) and 0 <= index < len(per_layer) else None
        if local is not None and not isinstance(index, bool):
            found[name] = local
    return found


def local_attention(model: nn.Module) -> list[tuple[str, int, int]]:
    """(kind, tokens, layers) of the layers that attend locally: ``"window"`` (sliding-window layers, GPT-Neo's
    local ones) and ``"chunk"`` (Llama-4's chunked attention). Empty where the config says of none."""
    layers = collections.Counter(local for local in _local_per_layer(_text_config(model)) if local)
    return [(kind, tokens, count) for (kind, tokens), count in layers.items()]


def windowed_spec(spec: ModelSpec, model: nn.Module) -> ModelSpec:
    """*spec* with the sliding window the model's KV cache keeps (unchanged when it keeps none)."""
    return with_window(spec, *sliding_spec(model))


def with_window(spec: ModelSpec, window: int | None, layers: int) -> ModelSpec:
    """*spec* with a sliding window of *window* tokens in *layers* of its layers (unchanged without a window, or
    when it has one already)."""
    if window is None or spec.sliding_window is not None:
        return spec
    return dataclasses.replace(spec, sliding_window=window, sliding_layers=None if layers == spec.layers else layers)


def _patchify_forward(self: nn.Conv2d, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                      ) -> torch.Tensor:
    # torch 2.13's meta convolution fails under the jit tracer; a patchifying conv is a linear map of the
    # flattened patches, with the same MACs: [N, C, H, W] -> [N, (H/p)(W/q), C*p*q] @ [C*p*q, C_out]
    n, c, h, w = x.shape
    p, q = self.kernel_size
    patches = x.reshape(n, c, h // p, p, w // q, q).permute(0, 2, 4, 1, 3, 5)
    patches = patches.reshape(n, (h // p) * (w // q), c * p * q)
    out = nn.functional.linear(patches, weight.reshape(weight.shape[0], -1), bias)
    return out.transpose(1, 2).reshape(n, weight.shape[0], h // p, w // q)


def patchify_conv(module: nn.Module) -> None:
    """A Conv2d whose stride is its kernel (a ViT patch embedding) runs as the linear map it is."""
    if (type(module) is nn.Conv2d and module.stride == module.kernel_size and module.padding in ((0, 0), "valid")
            and module.dilation == (1, 1) and module.groups == 1):
        module._conv_forward = types.MethodType(_patchify_forward, module)  # type: ignore[method-assign]
