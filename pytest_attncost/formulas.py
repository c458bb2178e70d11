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


_MOE_FIELDS = ("experts", "top_k", "expert_ffn_dim", "shared_ffn_dim", "shared_gate", "dense_layers")


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
        experts: routed experts ``E`` of a mixture-of-experts FFN (0: a dense FFN).
        top_k: experts each token runs through.
        expert_ffn_dim: one expert's FFN width ``f_e``.
        shared_ffn_dim: width of the shared experts every token runs through (all of them together).
        shared_gate: the shared experts sit behind a ``[D, 1]`` gate (Qwen2-MoE).
        dense_layers: layers whose FFN is dense (width ``ffn_dim``) rather than a mixture.
    """

    hidden: int
    heads: int
    head_dim: int
    layers: int
    ffn_dim: int
    kv_heads: int | None = None
    gated: bool = False
    cross_attention: bool = False
    experts: int = 0
    top_k: int = 0
    expert_ffn_dim: int = 0
    shared_ffn_dim: int = 0
    shared_gate: bool = False
    dense_layers: int = 0

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
        for name in ("experts", "top_k", "expert_ffn_dim", "shared_ffn_dim", "dense_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ModelSpec.{name} must be an int >= 0, got {value!r}")
        if self.experts:
            if not 0 < self.top_k <= self.experts:
                raise ValueError(f"ModelSpec.top_k must be in 1..experts ({self.experts}), got {self.top_k!r}")
            if self.expert_ffn_dim <= 0:
                raise ValueError("ModelSpec.expert_ffn_dim must be a positive int when experts > 0")
            if self.dense_layers > self.layers:
                raise ValueError(f"ModelSpec.dense_layers ({self.dense_layers}) exceeds layers ({self.layers})")
        elif self.top_k or self.expert_ffn_dim or self.shared_ffn_dim or self.shared_gate or self.dense_layers:
            raise ValueError("ModelSpec: top_k, expert_ffn_dim, shared_ffn_dim, shared_gate and dense_layers "
                             "describe a mixture of experts; set experts= too")

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
    def moe(self) -> bool:
        """The FFN of (some) layers is a mixture of experts."""
        return self.experts > 0

    @property
    def dense_ffn_per_token(self) -> int:
        """FFN MACs per token of a dense layer (``2Df``, or ``3Df`` when gated)."""
        return (3 if self.gated else 2) * self.hidden * self.ffn_dim

    @property
    def router_per_token(self) -> int:
        """The router of a mixture-of-experts layer: ``[n, D] @ [D, E]``."""
        return self.hidden * self.experts

    @property
    def moe_ffn_per_token(self) -> int:
        """Active FFN MACs per token of a mixture-of-experts layer.

        Each token runs through ``top_k`` experts (whatever the routing), plus the router,
        the shared experts and their gate: ``k·(2|3)·D·f_e + D·E + (2|3)·D·f_s + D``.
        """
        matrices = 3 if self.gated else 2
        shared = matrices * self.hidden * self.shared_ffn_dim + (self.hidden if self.shared_gate else 0)
        return self.top_k * matrices * self.hidden * self.expert_ffn_dim + self.router_per_token + shared

    @property
    def ffn_per_token(self) -> int:
        """``F``: FFN MACs per token of one layer (``2Df``, ``3Df`` gated; the active FFN of a MoE layer)."""
        return self.moe_ffn_per_token if self.moe else self.dense_ffn_per_token

    @property
    def moe_layers(self) -> int:
        """Layers whose FFN is a mixture of experts."""
        return self.layers - self.dense_layers if self.moe else 0

    @property
    def model_ffn_per_token(self) -> int:
        """FFN MACs per token summed over all layers (dense and mixture-of-experts ones)."""
        if not self.moe:
            return self.layers * self.dense_ffn_per_token
        return self.dense_layers * self.dense_ffn_per_token + self.moe_layers * self.moe_ffn_per_token

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe builtins (the mixture-of-experts fields only when there are experts)."""
        data = dataclasses.asdict(self)
        if not self.experts:
            for name in _MOE_FIELDS:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)

    @classmethod
    def from_config(cls, config: Any) -> ModelSpec:
        """Read the shape from a transformers ``PretrainedConfig`` (see :mod:`pytest_attncost.families`).

        Raises:
            ValueError: the config does not describe a shape the cost model covers; the
                message says why.
        """
        from .families import spec_from_config

        return spec_from_config(config)


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
    passes = 3 if train else 1
    layer = layer_costs(spec, n, batch, m, causal_half=causal_half)
    _check_length("n", n)
    # dense and mixture-of-experts layers may mix (DeepSeek's first dense layers, Qwen-MoE's mlp_only_layers)
    return Costs(layer.attention_core * spec.layers * passes, layer.attention_proj * spec.layers * passes,
                 batch * n * spec.model_ffn_per_token * passes)


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
    # over the whole model, so that dense and mixture-of-experts layers may mix
    gap = spec.model_ffn_per_token - spec.layers * spec.proj_per_token
    if gap <= 0:
        return None
    return Fraction(gap, 2 * spec.heads * spec.head_dim * spec.layers)


def quadratic_n(spec: ModelSpec) -> Fraction | None:
    """The length where the quadratic core equals the linear terms: ``(P + F) / 2hd``.

    ``6hd`` (4608 for BERT-base) in the article's models.
    """
    linear = spec.layers * spec.proj_per_token + spec.model_ffn_per_token
    if linear <= 0:
        return None
    return Fraction(linear, 2 * spec.heads * spec.head_dim * spec.layers)
