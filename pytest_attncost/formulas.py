"""The Transformer cost model of ARTICLE.md as pure integer functions.

Counts are multiply-accumulates (MACs): a product of an ``a x b`` and a ``b x c``
matrix costs ``a*b*c``. Symbols follow the article: ``n`` tokens, ``h`` query
heads, ``g`` key/value heads, ``d`` head size, ``D`` hidden size (``D = h*d`` in
the article's own models), ``f`` FFN width, ``m`` memory tokens for
cross-attention.

Nothing here imports torch: these functions are the independent side that
measured counts are compared with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

__all__ = [
    "Costs",
    "ModelSpec",
    "attention",
    "attention_core",
    "attention_proj",
    "crossover_n",
    "ffn",
    "layer_costs",
    "linear_attention_core",
    "linear_attention_saving",
    "model_costs",
    "quadratic_n",
]

# transformers families whose MLP is gated (gate, up and down projections).
GATED_FAMILIES = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
     "phi3", "olmo", "olmo2", "granite", "cohere", "stablelm", "smollm3"}
)


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Transformer, as far as its cost is concerned.

    Args:
        hidden: model width ``D`` (the residual stream).
        heads: query heads ``h``.
        head_dim: size of one head ``d`` (``D / h`` unless the model says otherwise).
        layers: number of Transformer layers ``L``.
        ffn_dim: FFN width ``f`` (0 for attention-only models).
        kv_heads: key/value heads ``g`` (grouped-query attention); None means ``h``.
        gated: the FFN has three matrices (SwiGLU/GeGLU) instead of two.
        cross_attention: every layer also attends to ``m`` memory tokens (decoders).
    """

    hidden: int
    heads: int
    head_dim: int
    layers: int
    ffn_dim: int
    kv_heads: int | None = None
    gated: bool = False
    cross_attention: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden", "heads", "head_dim", "layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelSpec.{name} must be a positive int, got {value!r}")
        if isinstance(self.ffn_dim, bool) or not isinstance(self.ffn_dim, int) or self.ffn_dim < 0:
            raise ValueError(f"ModelSpec.ffn_dim must be an int >= 0, got {self.ffn_dim!r}")
        if self.kv_heads is not None and (
            isinstance(self.kv_heads, bool) or not isinstance(self.kv_heads, int) or self.kv_heads <= 0
        ):
            raise ValueError(f"ModelSpec.kv_heads must be a positive int or None, got {self.kv_heads!r}")

    @property
    def g(self) -> int:
        """Key/value heads (``h`` when the model has no grouped-query attention)."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def proj_per_token(self) -> int:
        """``P``: Q, K, V and O projection MACs per token of one self-attention layer."""
        # Q and O: [n, D] @ [D, h*d] and back; K and V: [n, D] @ [D, g*d]
        return 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.g * self.head_dim

    @property
    def ffn_per_token(self) -> int:
        """``F``: FFN MACs per token of one layer (``2Df``, or ``3Df`` when gated)."""
        return (3 if self.gated else 2) * self.hidden * self.ffn_dim

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe builtins."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)

    @classmethod
    def from_config(cls, config: Any) -> ModelSpec:
        """Read the shape from a transformers ``PretrainedConfig``.

        Covers the BERT/RoBERTa/DistilBERT, GPT-2, LLaMA/Mistral/Qwen2, T5 and
        ViT families (through transformers' own ``attribute_map`` aliases).

        Raises:
            ValueError: the config lacks a field the cost model needs.
        """

        def get(*names: str) -> Any:
            for name in names:
                value = getattr(config, name, None)
                if value is not None:
                    return value
            return None

        model_type = str(getattr(config, "model_type", "") or "")
        hidden = get("hidden_size", "d_model", "n_embd", "dim")
        heads = get("num_attention_heads", "num_heads", "n_head", "n_heads")
        layers = get("num_hidden_layers", "num_layers", "n_layer", "n_layers")
        if hidden is None or heads is None or layers is None:
            raise ValueError(
                f"cannot read hidden size, heads and layers from {type(config).__name__}; "
                "pass spec=ModelSpec(hidden=..., heads=..., head_dim=..., layers=..., ffn_dim=...)"
            )
        head_dim = get("head_dim", "d_kv") or hidden // heads
        ffn_dim = get("intermediate_size", "d_ff", "n_inner", "hidden_dim", "ffn_dim") or 4 * hidden
        kv_heads = get("num_key_value_heads", "n_kv_heads")
        gated = bool(getattr(config, "is_gated_act", False)) or model_type in GATED_FAMILIES
        return cls(
            hidden=int(hidden),
            heads=int(heads),
            head_dim=int(head_dim),
            layers=int(layers),
            ffn_dim=int(ffn_dim),
            kv_heads=None if kv_heads is None or kv_heads == heads else int(kv_heads),
            gated=gated,
        )


@dataclass(frozen=True)
class Costs:
    """The three matrix-product parts of a Transformer, in MACs."""

    attention_core: int
    attention_proj: int
    ffn: int

    @property
    def attention(self) -> int:
        return self.attention_core + self.attention_proj

    @property
    def total(self) -> int:
        """attention + ffn (what the article calls the layer's cost)."""
        return self.attention + self.ffn

    def scaled(self, factor: int) -> Costs:
        return Costs(self.attention_core * factor, self.attention_proj * factor, self.ffn * factor)

    def to_dict(self) -> dict[str, int]:
        return {"attention_core": self.attention_core, "attention_proj": self.attention_proj,
                "ffn": self.ffn, "attention": self.attention}


def relative_deviation(measured: int, expected: int) -> float:
    """|measured - expected| / expected; 0 when both are 0, 1.0 when only the formula is 0."""
    if expected == 0:
        return 0.0 if measured == 0 else 1.0
    return abs(measured - expected) / expected


def _check_length(name: str, value: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def attention_core(spec: ModelSpec, n: int, batch: int = 1, m: int | None = None, *, causal_half: bool = False) -> int:
    """MACs of QK^T and AV in one layer: ``2bn²hd`` (plus ``2bnmhd`` with cross-attention).

    With ``causal_half`` the self-attention counts the ``n(n+1)/2`` query-key pairs a causal
    mask keeps (FlashAttention's convention): ``bhdn(n+1)``. Cross-attention is never halved.
    """
    _check_length("n", n)
    _check_length("batch", batch)
    # scores: [b, h, n, d] @ [b, h, d, n]; output: [b, h, n, n] @ [b, h, n, d]
    pairs = n * (n + 1) // 2 if causal_half else n * n
    core = 2 * batch * spec.heads * pairs * spec.head_dim
    if spec.cross_attention:
        m = n if m is None else m
        _check_length("m", m)
        # scores: [b, h, n, d] @ [b, h, d, m]; output: [b, h, n, m] @ [b, h, m, d]
        core += 2 * batch * spec.heads * n * m * spec.head_dim
    return core


def attention_proj(spec: ModelSpec, n: int, batch: int = 1, m: int | None = None) -> int:
    """MACs of the Q, K, V and O projections in one layer: ``4bn(hd)²`` in the article."""
    _check_length("n", n)
    _check_length("batch", batch)
    proj = batch * n * spec.proj_per_token
    if spec.cross_attention:
        m = n if m is None else m
        _check_length("m", m)
        # Q and O run on the n query tokens, K and V on the m memory tokens.
        hd, gd = spec.heads * spec.head_dim, spec.g * spec.head_dim
        proj += batch * (2 * n * spec.hidden * hd + 2 * m * spec.hidden * gd)
    return proj


def attention(spec: ModelSpec, n: int, batch: int = 1, m: int | None = None) -> int:
    """Self-attention (and cross-attention) MACs of one layer: projections plus core."""
    return attention_proj(spec, n, batch, m) + attention_core(spec, n, batch, m)


def ffn(spec: ModelSpec, n: int, batch: int = 1) -> int:
    """FFN MACs of one layer: ``8bn(hd)²`` in the article (``2bnDf``; ``3bnDf`` gated)."""
    _check_length("n", n)
    _check_length("batch", batch)
    # [n, D] @ [D, f] then [n, f] @ [f, D]; a gated FFN adds a second [n, D] @ [D, f]
    return batch * n * spec.ffn_per_token


def layer_costs(spec: ModelSpec, n: int, batch: int = 1, m: int | None = None, *, causal_half: bool = False) -> Costs:
    """One layer's attention_core, attention_proj and ffn."""
    return Costs(attention_core(spec, n, batch, m, causal_half=causal_half), attention_proj(spec, n, batch, m),
                 ffn(spec, n, batch))


def model_costs(
    spec: ModelSpec, n: int, batch: int = 1, m: int | None = None, *, causal_half: bool = False, train: bool = False
) -> Costs:
    """The whole model: ``spec.layers`` identical layers.

    ``train`` counts forward and backward with the standard accounting: each matrix product's
    backward costs twice its forward (the gradients of both operands), so 3x in all.
    """
    return layer_costs(spec, n, batch, m, causal_half=causal_half).scaled(spec.layers * (3 if train else 1))


def linear_attention_core(spec: ModelSpec, n: int, batch: int = 1, m: int | None = None) -> int:
    """One layer's core computed right to left, ``φ(Q)(φ(K)ᵀV)``: ``2bnhd²`` (per query head)."""
    _check_length("n", n)
    _check_length("batch", batch)
    # K^T V: [d, n] @ [n, d]; Q (K^T V): [n, d] @ [d, d]
    core = 2 * batch * n * spec.heads * spec.head_dim**2
    if spec.cross_attention:
        m = n if m is None else m
        _check_length("m", m)
        core += batch * (n + m) * spec.heads * spec.head_dim**2
    return core


def linear_attention_saving(spec: ModelSpec, n: int, batch: int = 1, m: int | None = None) -> float:
    """Fraction of attention + FFN saved by linear attention, in [0, 1].

    ``(2n²hd - 2nhd²) / (attention + ffn)``; 0 where linear attention would cost more (n < d).
    """
    costs = layer_costs(spec, n, batch, m)
    if costs.total == 0:
        return 0.0
    saving = costs.attention_core - linear_attention_core(spec, n, batch, m)
    return min(1.0, max(0.0, saving / costs.total))


def crossover_n(spec: ModelSpec) -> Fraction | None:
    """The length where self-attention costs as much as the FFN: ``(F - P) / 2hd``.

    ``2hd`` (1536 for BERT-base) in the article's models; None when the FFN is no
    larger than the projections, so attention costs more at every length.
    """
    gap = spec.ffn_per_token - spec.proj_per_token
    if gap <= 0:
        return None
    return Fraction(gap, 2 * spec.heads * spec.head_dim)


def quadratic_n(spec: ModelSpec) -> Fraction | None:
    """The length where the quadratic core equals the linear terms: ``(P + F) / 2hd``.

    ``6hd`` (4608 for BERT-base) in the article's models.
    """
    linear = spec.proj_per_token + spec.ffn_per_token
    if linear <= 0:
        return None
    return Fraction(linear, 2 * spec.heads * spec.head_dim)
