"""The article's Transformer cost model (docs/article.md, "The cost model") as pure integer functions, in MACs,
generalised to grouped-query attention, gated FFNs, experts, cross-attention and decoding. Symbols: ``n`` tokens,
``h`` query heads, ``g`` key/value heads, ``d`` head size, ``D`` hidden size, ``f`` FFN width, ``m`` memory tokens.
No torch here: these functions are the independent side that measured counts are compared with.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)

__all__ = [
    "Costs",
    "Generation",
    "cached_tokens",
    "ModelSpec",
    "attention",
    "attention_core",
    "attention_proj",
    "crossover_n",
    "decode_attention_core",
    "decode_attention_n",
    "decode_attention_proj",
    "decode_costs",
    "decode_crossover_n",
    "decode_ffn",
    "decode_quadratic_n",
    "ffn",
    "generation_cost",
    "kept_pairs",
    "kv_cache_bytes",
    "layer_costs",
    "linear_attention_core",
    "linear_attention_saving",
    "model_costs",
    "parse_spec",
    "quadratic_n",
]

#: How causal attention's core is counted: the n x n a dense kernel runs, the n(n+1)/2 pairs a causal mask keeps,
#: or the pairs each layer's mask keeps (request.py, which imports this module, hands it on).
CAUSAL = ("full", "half", "kept")

_MOE_FIELDS = ("experts", "top_k", "expert_ffn_dim", "shared_ffn_dim", "shared_gate", "dense_layers")
_WINDOW_FIELDS = ("sliding_window", "sliding_layers")


def _not_int(value: object, least: int = 1) -> bool:
    """*value* is no int (a bool is none) of at least *least*."""
    return isinstance(value, bool) or not isinstance(value, int) or value < least


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
        sliding_window: the attention window ``W`` of sliding-window layers (Mistral); it only
            changes a decode step (the KV cache keeps the last ``W - 1`` tokens); a prefill runs
            the full ``n x n`` product under a mask (DECISIONS), so the prefill formulas ignore it.
        sliding_layers: how many layers use the window (None: all of them).
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
    sliding_window: int | None = None
    sliding_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden", "heads", "head_dim", "layers"):
            if _not_int(getattr(self, name)):
                raise ValueError(f"ModelSpec.{name} must be a positive int, got {getattr(self, name)!r}")
        if _not_int(self.ffn_dim, 0):
            raise ValueError(f"ModelSpec.ffn_dim must be an int >= 0, got {self.ffn_dim!r}")
        if self.kv_heads is not None and _not_int(self.kv_heads):
            raise ValueError(f"ModelSpec.kv_heads must be a positive int or None, got {self.kv_heads!r}")
        for name in ("experts", "top_k", "expert_ffn_dim", "shared_ffn_dim", "dense_layers"):
            if _not_int(getattr(self, name), 0):
                raise ValueError(f"ModelSpec.{name} must be an int >= 0, got {getattr(self, name)!r}")
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
        if self.sliding_window is not None and _not_int(self.sliding_window):
            raise ValueError(f"ModelSpec.sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if self.sliding_layers is not None:
            if self.sliding_window is None:
                raise ValueError("ModelSpec.sliding_layers counts sliding-window layers: set sliding_window= too")
            if _not_int(self.sliding_layers, 0) or self.sliding_layers > self.layers:
                raise ValueError(f"ModelSpec.sliding_layers must be an int in 0..layers ({self.layers}), "
                                 f"got {self.sliding_layers!r}")

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

    @property
    def window_layers(self) -> int:
        """Layers whose KV cache keeps a sliding window (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return self.layers if self.sliding_layers is None else self.sliding_layers

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe builtins (the mixture-of-experts fields only when there are experts, the window only when set)."""
        return {name: value for name, value in dataclasses.asdict(self).items()  # old specs keep their form
                if not (name in _MOE_FIELDS and not self.experts or name in _WINDOW_FIELDS and value is None)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)


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


def _check_lengths(**lengths: int | None) -> None:
    for name, value in lengths.items():
        if _not_int(value):
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def kept_pairs(n: int, window: int | None = None, chunk: int | None = None) -> int:
    """The query-key pairs a causal mask keeps among ``n`` tokens: ``n(n+1)/2``; within a sliding window of ``W``
    tokens (query i sees keys ``i-W < j <= i``: Mistral, Gemma-2's local layers, GPT-Neo's) ``Σ min(i+1, W)``;
    within chunks of ``c`` tokens (Llama-4) each chunk's own triangle."""
    for name, size in (("window", window), ("chunk", chunk)):
        if size is not None and _not_int(size):
            raise ValueError(f"kept_pairs: {name} must be a positive int or None, got {size!r}")
    if chunk is not None:
        whole, rest = divmod(n, chunk)
        return whole * chunk * (chunk + 1) // 2 + rest * (rest + 1) // 2
    if window is None or n <= window:
        return n * (n + 1) // 2
    # the first W queries see 1..W keys, every later one W
    return window * (window + 1) // 2 + (n - window) * window


def attention_core(spec: ModelSpec, n: int, batch: int = 1, m: int | None = None, *, causal: str = "full",
                   window: int | None = None) -> int:
    """MACs of QK^T and AV in one layer: ``2bn²hd`` (plus ``2bnmhd`` with cross-attention).

    ``causal="half"`` counts the self-attention's ``n(n+1)/2`` query-key pairs a causal mask keeps, diagonal
    included: ``bhdn(n+1)`` (FlashAttention's benchmarks, Megatron-LM and MaxText count ``n²/2``, ``bhdn``
    less); ``causal="kept"`` counts the pairs the layer's mask keeps (:func:`kept_pairs`, with its sliding
    *window*). Cross-attention is never halved.
    """
    _check_lengths(n=n, batch=batch)
    if causal not in CAUSAL:
        raise ValueError(f"causal must be 'full', 'half' or 'kept', got {causal!r}")
    # scores: [b, h, n, d] @ [b, h, d, n]; output: [b, h, n, n] @ [b, h, n, d]
    pairs = n * n if causal == "full" else kept_pairs(n, window if causal == "kept" else None)
    core = 2 * batch * spec.heads * pairs * spec.head_dim
    if spec.cross_attention:
        m = n if m is None else m
        _check_lengths(m=m)
        # scores: [b, h, n, d] @ [b, h, d, m]; output: [b, h, n, m] @ [b, h, m, d]
        core += 2 * batch * spec.heads * n * m * spec.head_dim
    return core


def attention_proj(spec: ModelSpec, n: int, batch: int = 1, m: int | None = None) -> int:
    """MACs of the Q, K, V and O projections in one layer: ``4bn(hd)²`` in the article."""
    _check_lengths(n=n, batch=batch)
    proj = batch * n * spec.proj_per_token
    if spec.cross_attention:
        m = n if m is None else m
        _check_lengths(m=m)
        # Q and O run on the n query tokens, K and V on the m memory tokens.
        hd, gd = spec.heads * spec.head_dim, spec.g * spec.head_dim
        proj += batch * (2 * n * spec.hidden * hd + 2 * m * spec.hidden * gd)
    return proj


def attention(spec: ModelSpec, n: int, batch: int = 1, m: int | None = None) -> int:
    """Self-attention (and cross-attention) MACs of one layer: projections plus core."""
    return attention_proj(spec, n, batch, m) + attention_core(spec, n, batch, m)


def ffn(spec: ModelSpec, n: int, batch: int = 1) -> int:
    """FFN MACs of one layer: ``8bn(hd)²`` in the article (``2bnDf``; ``3bnDf`` gated)."""
    _check_lengths(n=n, batch=batch)
    # [n, D] @ [D, f] then [n, f] @ [f, D]; a gated FFN adds a second [n, D] @ [D, f]
    return batch * n * spec.ffn_per_token


def layer_costs(spec: ModelSpec, n: int, batch: int = 1, m: int | None = None, *, causal: str = "full") -> Costs:
    """One layer's attention_core, attention_proj and ffn (a layer without a sliding window)."""
    return Costs(attention_core(spec, n, batch, m, causal=causal), attention_proj(spec, n, batch, m),
                 ffn(spec, n, batch))


def model_costs(spec: ModelSpec, n: int, batch: int = 1, m: int | None = None, *, causal: str = "full",
                train: bool = False) -> Costs:
    """The whole model: ``spec.layers`` identical layers (under ``causal="kept"``, ``spec.window_layers`` of them
    keep a sliding window of pairs).

    ``train`` counts forward and backward with the standard accounting: each matrix product's
    backward costs twice its forward (the gradients of both operands), so 3x in all.
    """
    passes = 3 if train else 1
    layer = layer_costs(spec, n, batch, m, causal=causal)
    windowed = spec.window_layers if causal == "kept" else 0
    core = layer.attention_core * (spec.layers - windowed)
    if windowed:
        core += windowed * attention_core(spec, n, batch, m, causal=causal, window=spec.sliding_window)
    # dense and mixture-of-experts layers may mix (DeepSeek's first dense layers, Qwen-MoE's mlp_only_layers)
    return Costs(core * passes, layer.attention_proj * spec.layers * passes,
                 batch * n * spec.model_ffn_per_token * passes)


def linear_attention_core(spec: ModelSpec, n: int, batch: int = 1, m: int | None = None) -> int:
    """One layer's core computed right to left, ``φ(Q)(φ(K)ᵀV)``: ``2bnhd²`` (per query head)."""
    _check_lengths(n=n, batch=batch)
    # K^T V: [d, n] @ [n, d]; Q (K^T V): [n, d] @ [d, d]
    core = 2 * batch * n * spec.heads * spec.head_dim**2
    if spec.cross_attention:
        m = n if m is None else m
        _check_lengths(m=m)
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


# --- decode: one step against a KV cache (docs/decode.md, "A decode step") -------------------------
# q new keys join the cache first: each query meets n + q keys (the whole q x q corner, as the kernel runs it)


def _no_cross(spec: ModelSpec) -> None:
    if spec.cross_attention:
        raise ValueError("the decode formulas describe decoder-only models; cross-attention reads a memory "
                         "whose keys and values were cached at the prefill (pass a spec without cross_attention)")


def cached_tokens(spec: ModelSpec, n: int, *, sliding: bool = False) -> int:
    """Tokens a layer's KV cache holds after n tokens went through it: n, or ``min(n, W - 1)`` with a window."""
    if _not_int(n, 0):
        raise ValueError(f"n (tokens in the KV cache) must be an int >= 0, got {n!r}")
    if sliding and spec.sliding_window is not None:
        return min(n, spec.sliding_window - 1)
    return n


def decode_attention_core(spec: ModelSpec, n: int, new_tokens: int = 1, batch: int = 1, *,
                          sliding: bool = False) -> int:
    """One layer's QK^T and AV in a decode step: ``2·b·h·q·(n + q)·d``.

    With ``sliding`` (a layer of a windowed spec) the keys are ``min(n, W - 1) + q``.
    """
    _no_cross(spec)
    _check_lengths(new_tokens=new_tokens, batch=batch)
    keys = cached_tokens(spec, n, sliding=sliding) + new_tokens
    # scores: [b, h, q, d] @ [b, h, d, n + q]; output: [b, h, q, n + q] @ [b, h, n + q, d]
    return 2 * batch * spec.heads * new_tokens * keys * spec.head_dim


def decode_attention_proj(spec: ModelSpec, new_tokens: int = 1, batch: int = 1) -> int:
    """One layer's Q, K, V and O projections in a decode step: ``b·q·P`` (only the new tokens are projected)."""
    _no_cross(spec)
    _check_lengths(new_tokens=new_tokens, batch=batch)
    return batch * new_tokens * spec.proj_per_token


def decode_ffn(spec: ModelSpec, new_tokens: int = 1, batch: int = 1) -> int:
    """One layer's FFN in a decode step: ``b·q·F``."""
    _check_lengths(new_tokens=new_tokens, batch=batch)
    return batch * new_tokens * spec.ffn_per_token


def decode_costs(spec: ModelSpec, n: int, new_tokens: int = 1, batch: int = 1) -> Costs:
    """The whole model's decode step: ``new_tokens`` queries against a cache of ``n`` tokens.

    Per layer ``2bq(n + q)hd`` for the core (``min(n, W - 1) + q`` keys in sliding-window
    layers), ``bqP`` for the projections and ``bqF`` for the FFN (dense and mixture-of-experts
    layers may mix, as in :func:`model_costs`).
    """
    windowed = spec.window_layers
    core = ((spec.layers - windowed) * decode_attention_core(spec, n, new_tokens, batch)
            + windowed * decode_attention_core(spec, n, new_tokens, batch, sliding=True))
    return Costs(core, spec.layers * decode_attention_proj(spec, new_tokens, batch),
                 batch * new_tokens * spec.model_ffn_per_token)


def _decode_threshold(spec: ModelSpec, linear: int) -> Fraction | None:
    """The context T (keys a new token attends to) where the model's core per token, ``2hd·T`` per
    layer (``2hd·min(T, W)`` in windowed layers), reaches *linear* MACs per token."""
    _no_cross(spec)
    if linear <= 0:
        return None
    per_key = 2 * spec.heads * spec.head_dim
    windowed = spec.window_layers
    first = Fraction(linear, per_key * spec.layers)
    if not windowed or first <= spec.sliding_window:  # type: ignore[operator]
        return first
    full = spec.layers - windowed
    if full == 0:
        return None  # every layer attends to at most W keys: the core stops growing below the threshold
    return (Fraction(linear, per_key) - windowed * spec.sliding_window) / full  # type: ignore[operator]


def decode_crossover_n(spec: ModelSpec) -> Fraction | None:
    """The context where a decode step's attention core costs as much as its FFN: ``F / 2hd``.

    Per new token and layer the core over a context of T keys is ``2·T·h·d`` and the FFN is
    ``F``, so they meet at ``T = F / 2hd``: ``3Df / 2hd`` gated (16,512 for LLaMA-2-7B's shape),
    ``4D`` for an ungated FFN of width ``4D`` (3,072 for BERT-base's shape). The projections
    are left out: per token they do not grow with the context, and with them attention
    (core + projections) meets the FFN at the prefill's :func:`crossover_n`.

    T counts the keys the new token attends to, itself included: a step with ``n`` tokens in the
    cache attends to ``n + 1``, so the first one-token step whose core reaches the FFN has
    ``ceil(T) - 1`` cached tokens. Sliding-window layers attend to at most ``W`` keys; None when
    the core can never reach the FFN (no FFN, or every layer windowed below the threshold).
    """
    return _decode_threshold(spec, spec.model_ffn_per_token)


def decode_attention_n(spec: ModelSpec) -> Fraction | None:
    """The context where a decode step's attention (core + projections) costs as much as its FFN: ``(F - P) / 2hd``.

    Without a window this is the prefill's :func:`crossover_n` (per token, prefill and decode
    spend the same on each part at the same context); same conventions as :func:`decode_crossover_n`.
    """
    return _decode_threshold(spec, spec.model_ffn_per_token - spec.layers * spec.proj_per_token)


def decode_quadratic_n(spec: ModelSpec) -> Fraction | None:
    """The context where a decode step's core equals its projections and FFN together: ``(P + F) / 2hd``.

    From there on the step's cost is mostly the context: the step grows linearly in n, and most of it
    is the core. Same conventions as :func:`decode_crossover_n`.
    """
    return _decode_threshold(spec, spec.layers * spec.proj_per_token + spec.model_ffn_per_token)


def kv_cache_bytes(spec: ModelSpec, n: int, batch: int = 1, bytes_per_element: int = 2) -> int:
    """Bytes of the KV cache holding n tokens: ``2 · layers · g · d · n · batch · bytes per element``.

    Keys and values (the 2) for each of the ``g`` key/value heads of size ``d`` in every layer;
    a sliding-window layer holds ``min(n, W - 1)`` tokens. LLaMA-2-7B's shape at n = 4096 in
    float16: ``2·32·32·128·4096·2`` = 2,147,483,648 bytes (2 GiB).
    """
    _check_lengths(batch=batch, bytes_per_element=bytes_per_element)
    windowed = spec.window_layers
    tokens = (spec.layers - windowed) * cached_tokens(spec, n) + windowed * cached_tokens(spec, n, sliding=True)
    return 2 * spec.g * spec.head_dim * tokens * batch * bytes_per_element


# --- a whole generation ----------------------------------------------------------------------------


def _sum_min(first: int, last: int, cap: int | None) -> int:
    """``sum(min(k, cap) for k in range(first, last + 1))`` in closed form (no cap: plain k)."""
    if last < first:
        return 0
    if cap is None or last <= cap:
        return (first + last) * (last - first + 1) // 2
    if first > cap:
        return cap * (last - first + 1)
    return (first + cap) * (cap - first + 1) // 2 + cap * (last - cap)


@dataclass(frozen=True)
class Generation:
    """The cost of generating ``new_tokens`` tokens after a prompt: one prefill and the decode steps.

    The prefill's forward yields the first new token; each of the others is one decode step of
    one token, with the cache holding ``prompt, prompt + 1, ..., prompt + new_tokens - 2`` tokens.
    """

    prompt: int
    new_tokens: int
    batch: int
    prefill: Costs
    decode: Costs

    @property
    def steps(self) -> int:
        """Decode steps: one per new token after the first."""
        return self.new_tokens - 1

    @property
    def total(self) -> Costs:
        """Prefill plus every decode step."""
        return Costs(self.prefill.attention_core + self.decode.attention_core,
                     self.prefill.attention_proj + self.decode.attention_proj,
                     self.prefill.ffn + self.decode.ffn)

    @property
    def attention_share(self) -> float:
        """attention / (attention + ffn) over the whole generation; 0.0 when both are zero."""
        total = self.total
        return total.attention / total.total if total.total else 0.0

    @property
    def decode_share(self) -> float:
        """The decode steps' part of attention + ffn (the rest is the prefill)."""
        total = self.total.total
        return self.decode.total / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "new_tokens": self.new_tokens, "batch": self.batch, "steps": self.steps,
                "prefill": self.prefill.to_dict(), "decode": self.decode.to_dict(), "total": self.total.to_dict(),
                "attention_share": self.attention_share, "decode_share": self.decode_share}


def generation_cost(spec: ModelSpec, prompt: int, new_tokens: int, batch: int = 1, *,
                     causal: str = "full") -> Generation:
    """Prefill of ``prompt`` tokens plus ``new_tokens - 1`` one-token decode steps, in closed form.

    Exactly ``model_costs(spec, prompt) + sum(decode_costs(spec, n) for n in range(prompt, prompt +
    new_tokens - 1))``: the core of step n is ``2bhd·(n + 1)`` per layer (``2bhd·min(n + 1, W)`` in a
    windowed layer), an arithmetic series; projections and FFN are the same every step.
    ``causal`` applies to the prefill only (a decode step's core is not a triangle).
    """
    _no_cross(spec)
    _check_lengths(prompt=prompt, new_tokens=new_tokens, batch=batch)
    prefill = model_costs(spec, prompt, batch, causal=causal)
    steps = new_tokens - 1
    if steps == 0:
        return Generation(prompt, new_tokens, batch, prefill, Costs(0, 0, 0))
    # step n attends to n + 1 keys, n = prompt .. prompt + steps - 1
    first, last = prompt + 1, prompt + steps
    windowed = spec.window_layers
    keys = ((spec.layers - windowed) * _sum_min(first, last, None)
            + windowed * _sum_min(first, last, spec.sliding_window))
    core = 2 * batch * spec.heads * spec.head_dim * keys
    one = decode_costs(spec, prompt, 1, batch)
    return Generation(prompt, new_tokens, batch, prefill,
                      Costs(core, one.attention_proj * steps, one.ffn * steps))


def parse_spec(text: str) -> ModelSpec:
    """``hidden=64,heads=4,...``: a ModelSpec from its keywords, checked as ModelSpec checks them.

    Raises:
        ValueError: an item that is no ``KEY=VALUE`` of a ModelSpec keyword, or a value ModelSpec refuses.
    """
    fields = [field.name for field in dataclasses.fields(ModelSpec)]
    words: dict[str, Any] = {"true": True, "false": False, "none": None}
    values: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, word = key.strip().replace("-", "_"), value.strip().lower()
        if not sep or key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; the keywords are {', '.join(fields)}"
            raise ValueError(f"{item!r} is not KEY=VALUE of a ModelSpec keyword{hint}")
        if word not in words and not word.isdigit():
            raise ValueError(f"{key}={value!r}: not an integer, true/false or none")
        values[key] = words[word] if word in words else int(word)
    try:
        return ModelSpec(**values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{text!r}: {exc}") from None
