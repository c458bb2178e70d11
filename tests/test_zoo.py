"""The architecture zoo: tiny transformers models, each split exact against a hand formula.

Every row builds one transformers architecture from a tiny config (random weights, no hub),
profiles it on the meta device and asserts ``attention_core``, ``attention_proj``, ``ffn``
and ``ffn_router`` to the MAC. The expected numbers are plain integer arithmetic written
here from each family's modeling file, independent of ``pytest_attncost.formulas``:

* inside a layer, the attention module's activation x activation products (QK^T, AV,
  DeBERTa's c2p/p2c, any fused sdpa call: b*h*n*m*(d_qk + d_v)) are ``attention_core``;
  its parameter products (Q, K, V, O, fused QKV, low-rank and position projections) are
  ``attention_proj``;
* every other parameter product inside a layer is ``ffn``: MLPs, ``fc1``/``fc2`` kept on the
  layer, gated MLPs (three matrices), and for mixtures of experts
  ``tokens * top_k * one expert`` + the router ``tokens * D * E`` (also reported alone as
  ``ffn_router``) + shared experts and their gates;
* everything outside the layers (embeddings, their projections, poolers, heads) is
  ``other`` and not asserted;
* causal and sliding-window attention count the full n x n product the dense kernel runs.

The first row of every architecture is also counted in full (``counting.full_trace()``), without
the repeated-layer shortcut, by fvcore, and must give the same profile; the torch counter's
shortcut gives the hand split on every architecture, and the records of a full trace, op for op, on
the rows whose layers are not all alike (``COPIED``).

A Linear (or GPT-2's Conv1D) costs tokens * in * out MACs; biases are free.

Rows an older stack cannot run skip with the version that stops them (:func:`unsupported`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import transformers

from pytest_attncost import clear_cache, one_run, profile
from pytest_attncost.api import sweep
from pytest_attncost.counting import full_trace

TRANSFORMERS = transformers.__version__
#: Mixtures of experts that transformers 4 routes by value (nonzero / where), which no counter follows on meta.
ROUTED_BY_VALUE = {"mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v3"}
#: Families whose transformers 4 code draws LayerDrop's random number in training even at layerdrop 0.
LAYERDROP_DRAWN = {"opt", "bart"}
ONE_RUN = one_run.POSSIBLE  # torch before 2.9 runs meta kernels in Python: no one-run sweep


def unsupported(family: Case, kwargs: dict[str, Any], train: bool = False) -> str | None:
    """Why the installed transformers cannot run this row (None: it can)."""
    major = int(TRANSFORMERS.split(".")[0])
    if kwargs.get("attn_implementation") == "sdpa" and not getattr(transformers, family.model)._supports_sdpa:
        return f"transformers {TRANSFORMERS}: {family.model} has no sdpa attention"
    if "experts_implementation" in kwargs and major < 5:
        return f"transformers {TRANSFORMERS}: experts_implementation is transformers 5's"
    if major < 5 and family.family in ROUTED_BY_VALUE:
        return (f"transformers {TRANSFORMERS} routes {family.model}'s experts by value (nonzero): a factory cannot "
                "be counted on meta, and the error says so; transformers 5 runs them as matrix products")
    if train and family.family == "long-t5" and tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13):
        return (f"torch {torch.__version__}: its fake tensors do not take LongT5's mask, made on the CPU, across to "
                "the meta scores (masked_fill) in a training step (seen on torch 2.6; 2.13 does)")
    if train and major < 5 and family.family in LAYERDROP_DRAWN:
        return f"transformers {TRANSFORMERS}: {family.model} reads a random number for LayerDrop in training"
    return None

# The shape every row shares unless it says otherwise.
V = 128  # vocabulary
D = 64  # hidden size
H = 4  # query heads
G = 2  # key/value heads where the family has grouped-query attention
F = 96  # FFN width
L = 3  # layers: three, so that the repeated-layer shortcut (two traced, the rest copied) runs
N = 16  # tokens the layers see
B = 2  # batch


def lin(tokens: int, fan_in: int, fan_out: int) -> int:
    """A Linear / Conv1D: one MAC per weight per token."""
    return tokens * fan_in * fan_out


def core(b: int, h: int, n: int, m: int, d_qk: int, d_v: int | None = None) -> int:
    """QK^T plus AV for h query heads (GQA keys/values repeated to h)."""
    return b * h * n * m * (d_qk + (d_qk if d_v is None else d_v))


def split(core_: int = 0, proj: int = 0, ffn: int = 0, router: int = 0) -> dict[str, int]:
    return {"attention_core": core_, "attention_proj": proj, "ffn": ffn, "ffn_router": router}


def add(*parts: dict[str, int]) -> dict[str, int]:
    return {key: sum(p[key] for p in parts) for key in parts[0]}


def times(k: int, part: dict[str, int]) -> dict[str, int]:
    return {key: k * value for key, value in part.items()}


# --- one layer, by kind --------------------------------------------------------------------

def self_attention(b: int, n: int, hidden: int, heads: int, head_dim: int,
                   kv_heads: int | None = None) -> dict[str, int]:
    """Separate (or fused, same cost) Q, K, V and an output projection."""
    t, g = b * n, heads if kv_heads is None else kv_heads
    proj = lin(t, hidden, heads * head_dim) + 2 * lin(t, hidden, g * head_dim) + lin(t, heads * head_dim, hidden)
    return split(core(b, heads, n, n, head_dim), proj)


def cross_attention(b: int, n: int, m: int, hidden: int, heads: int, head_dim: int) -> dict[str, int]:
    """Queries from n decoder tokens, keys/values from m memory tokens."""
    q, kv = lin(b * n, hidden, heads * head_dim), 2 * lin(b * m, hidden, heads * head_dim)
    proj = q + kv + lin(b * n, heads * head_dim, hidden)
    return split(core(b, heads, n, m, head_dim), proj)


def mlp(tokens: int, hidden: int, width: int) -> dict[str, int]:
    return split(ffn=2 * lin(tokens, hidden, width))


def gated_mlp(tokens: int, hidden: int, width: int) -> dict[str, int]:
    return split(ffn=3 * lin(tokens, hidden, width))


def moe(tokens: int, hidden: int, experts: int, top_k: int, expert_width: int) -> dict[str, int]:
    """Routed gated experts: top_k experts per token, plus the router."""
    router = lin(tokens, hidden, experts)
    return split(ffn=tokens * top_k * 3 * hidden * expert_width + router, router=router)


# --- the cases -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    family: str
    config: str  # transformers config class
    model: str  # transformers model class
    kwargs: dict[str, Any]
    expected: Callable[[int, int], dict[str, int]]  # (n, batch) -> split
    impls: tuple[str, ...] = ("sdpa", "eager")
    n: int = N
    batch: int = B
    extra: dict[str, dict[str, Any]] = field(default_factory=dict)  # id suffix -> more config kwargs

    def rows(self) -> list[tuple[str, dict[str, Any]]]:
        rows = [(f"{self.family}-{impl}", {**self.kwargs, "attn_implementation": impl}) for impl in self.impls]
        for suffix, more in self.extra.items():
            rows.append((f"{self.family}-{suffix}", {**self.kwargs, **more}))
        return rows


def build(config: str, model: str, kwargs: dict[str, Any]) -> Callable[[], Any]:
    def factory():
        import transformers

        return getattr(transformers, model)(getattr(transformers, config)(**kwargs))

    factory.__name__ = model
    return factory


def bert_like(n: int, b: int, layers: int = L, width: int = F) -> dict[str, int]:
    return times(layers, add(self_attention(b, n, D, H, D // H), mlp(b * n, D, width)))


def llama_like(n: int, b: int, head_dim: int = D // H, kv: int = G, width: int = F) -> dict[str, int]:
    return times(L, add(self_attention(b, n, D, H, head_dim, kv), gated_mlp(b * n, D, width)))


def doge(n: int, b: int) -> dict[str, int]:
    # Dynamic mask attention: dt_proj (kv_heads * head_dim -> kv_heads) turns the values into a mask on the
    # scores (added in eager, sdpa's attn_mask): a projection of the attention, beside a gated MLP.
    return add(llama_like(n, b), times(L, split(proj=lin(b * n, G * (D // H), G))))


def albert(n: int, b: int) -> dict[str, int]:
    # One shared AlbertLayer, run num_hidden_layers = 3 times; ffn/ffn_output sit on the layer.
    return bert_like(n, b, layers=3)


def deberta_v2(n: int, b: int) -> dict[str, int]:
    # share_att_key: query_proj and key_proj also run on the 2*buckets relative embeddings
    # (batch 1, repeated over the batch afterwards); c2p and p2c are two more b*h*n*(2*buckets)*d
    # activation products.
    rel, d = 2 * 8, D // H
    layer = add(
        self_attention(b, n, D, H, d),
        split(2 * b * H * n * rel * d, 2 * lin(rel, D, D)),
        mlp(b * n, D, F),
    )
    return times(L, layer)


def xlnet(n: int, b: int) -> dict[str, int]:
    # Sequence first: the tokens' rows are (n, b), and einsum('ibh,hnd->ibnd') spreads Q, K, V over heads x d.
    # Relative positions: 2n sinusoids (klen + qlen, for every sequence of the batch) projected by r, their
    # scores bd are b*h*n*2n*d; the token types (given by default) add q . seg_embed (a weight, 2 types) and
    # its n x n spread over the scores (b*h*n*n*2). ff.layer_1 / layer_2 is the MLP.
    t, d = b * n, D // H
    proj = 4 * lin(t, D, D) + lin(2 * n * b, D, D) + t * H * 2 * d
    core_ = b * H * n * n * d + b * H * n * 2 * n * d + b * H * n * n * d + b * H * n * n * 2
    return times(L, add(split(core_, proj), mlp(t, D, F)))


def bloom(n: int, b: int) -> dict[str, int]:
    return bert_like(n, b, width=4 * D)  # dense_h_to_4h is always 4 * hidden


def non_gated_gqa(n: int, b: int, kv: int = G) -> dict[str, int]:
    return times(L, add(self_attention(b, n, D, H, D // H, kv), mlp(b * n, D, F)))


def falcon_mqa(n: int, b: int) -> dict[str, int]:
    # multi_query (the default): query_key_value is hidden -> hidden + 2 * head_dim (one K/V head);
    # parallel_attn: attention and MLP read the same input, which changes nothing here.
    return non_gated_gqa(n, b, kv=1)


def falcon_gqa(n: int, b: int) -> dict[str, int]:
    # new_decoder_architecture: query_key_value is hidden -> (heads + 2 * kv_heads) * head_dim.
    return non_gated_gqa(n, b, kv=G)


def t5(n: int, b: int, gated: bool = False) -> dict[str, int]:
    # d_kv = 24 is independent of d_model; decoder layers: self + cross (memory m = n) + FFN.
    # Layer 0 of each stack holds the relative position bias, so layers 1.. are the ones alike.
    d_kv, m, t = 24, n, b * n
    ffn = gated_mlp(t, D, F) if gated else mlp(t, D, F)
    encoder = add(self_attention(b, m, D, H, d_kv), ffn)
    decoder = add(self_attention(b, n, D, H, d_kv), cross_attention(b, n, m, D, H, d_kv), ffn)
    return add(times(L, encoder), times(3, decoder))


def t5_gated(n: int, b: int) -> dict[str, int]:
    return t5(n, b, gated=True)


def long_t5(n: int, b: int) -> dict[str, int]:
    # Local attention (the encoder alone): blocks of local_radius + 1 = 5 queries, the sequence padded to a whole
    # number of them, each block's queries scoring the keys of three blocks (its own and its neighbours').
    block, d_kv = 5, 16
    blocks = -(-n // block)
    core_ = b * H * blocks * block * 3 * block * 2 * d_kv
    layer = add(split(core_, 3 * lin(b * n, D, H * d_kv) + lin(b * n, H * d_kv, D)), mlp(b * n, D, F))
    return times(L, layer)


def bart(n: int, b: int) -> dict[str, int]:
    m, t = n, b * n
    encoder = add(self_attention(b, m, D, H, D // H), mlp(t, D, F))
    decoder = add(self_attention(b, n, D, H, D // H), cross_attention(b, n, m, D, H, D // H), mlp(t, D, F))
    return add(times(L, encoder), times(L, decoder))


def mixtral(n: int, b: int) -> dict[str, int]:
    t = b * n
    return times(L, add(self_attention(b, n, D, H, D // H, G), moe(t, D, 4, 2, 32)))


def qwen2_moe(n: int, b: int) -> dict[str, int]:
    # decoder_sparse_step = 2: layers 0 and 2 are dense gated MLPs (intermediate_size), layer 1
    # sparse: 4 experts of 32, top-2, a shared expert of 48 and its shared_expert_gate (hidden -> 1).
    t = b * n
    attn = self_attention(b, n, D, H, D // H, G)
    dense = gated_mlp(t, D, F)
    sparse = add(moe(t, D, 4, 2, 32), gated_mlp(t, D, 48), split(ffn=lin(t, D, 1)))
    return add(times(3, attn), dense, sparse, dense)


def qwen3_moe(n: int, b: int) -> dict[str, int]:
    t = b * n
    return times(L, add(self_attention(b, n, D, H, 32, G), moe(t, D, 4, 2, 32)))


def deepseek_v3(n: int, b: int) -> dict[str, int]:
    # MLA: q_a (hidden -> q_lora 48), q_b (48 -> heads * (nope 16 + rope 8)),
    # kv_a_proj_with_mqa (hidden -> kv_lora 32 + rope 8), kv_b (32 -> heads * (nope 16 + v 16)),
    # o_proj (heads * v 16 -> hidden); core: d_qk = 24, d_v = 16.
    # first_k_dense_replace = 1: layer 0 dense gated MLP (F), layers 1-3 MoE: 4 routed experts of
    # 32, top-2, router, one shared expert of 32 (four layers: three alike, after one that differs).
    t, q_lora, kv_lora, nope, rope, v = b * n, 48, 32, 16, 8, 16
    proj = (
        lin(t, D, q_lora) + lin(t, q_lora, H * (nope + rope))
        + lin(t, D, kv_lora + rope) + lin(t, kv_lora, H * (nope + v))
        + lin(t, H * v, D)
    )
    attn = split(core(b, H, n, n, nope + rope, v), proj)
    return add(times(4, attn), gated_mlp(t, D, F), times(3, add(moe(t, D, 4, 2, 32), gated_mlp(t, D, 32))))


TEXT = dict(vocab_size=V)
BERT_SHAPE = dict(TEXT, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=F,
                  max_position_embeddings=64)
DECODER_SHAPE = dict(TEXT, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=F,
                     max_position_embeddings=64)
GQA_SHAPE = dict(DECODER_SHAPE, num_key_value_heads=G)
IMAGE = dict(image_size=32, patch_size=8)  # (32 / 8)^2 = 16 patches + the class token
VISION_N = (32 // 8) ** 2 + 1
# Mixtures of experts run transformers' default experts implementation (grouped_mm) in the
# sdpa/eager rows; one more row each runs batched_mm (gathered expert weights, one bmm).
BATCHED_MM = {"batched_mm": {"experts_implementation": "batched_mm"}}

FAMILIES = [
    Case("bert", "BertConfig", "BertModel", BERT_SHAPE, bert_like),
    Case("roberta", "RobertaConfig", "RobertaModel", BERT_SHAPE, bert_like),
    Case("distilbert", "DistilBertConfig", "DistilBertModel",
         dict(TEXT, dim=D, n_layers=L, n_heads=H, hidden_dim=F, max_position_embeddings=64), bert_like),
    Case("albert", "AlbertConfig", "AlbertModel", dict(BERT_SHAPE, embedding_size=32, num_hidden_layers=3), albert),
    Case("electra", "ElectraConfig", "ElectraModel", dict(BERT_SHAPE, embedding_size=32), bert_like),
    Case("deberta-v2", "DebertaV2Config", "DebertaV2Model",
         dict(BERT_SHAPE, relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8,
              max_relative_positions=64, share_att_key=True, norm_rel_ebd="layer_norm"),
         deberta_v2, impls=("eager",)),
    Case("doge", "DogeConfig", "DogeModel", GQA_SHAPE, doge),
    Case("xlnet", "XLNetConfig", "XLNetModel", dict(TEXT, d_model=D, n_layer=L, n_head=H, d_inner=F), xlnet,
         impls=("eager",)),
    Case("gpt2", "GPT2Config", "GPT2Model", dict(TEXT, n_embd=D, n_layer=L, n_head=H, n_inner=F, n_positions=64),
         bert_like),
    Case("gpt-neo", "GPTNeoConfig", "GPTNeoModel",
         dict(TEXT, hidden_size=D, num_layers=L, num_heads=H, intermediate_size=F, max_position_embeddings=64,
              attention_types=[[["global", "local"], 1], [["global"], 1]], window_size=8),
         bert_like, impls=("eager",)),
    Case("gpt-neox", "GPTNeoXConfig", "GPTNeoXModel", dict(DECODER_SHAPE, rotary_pct=0.25), bert_like),
    Case("gptj", "GPTJConfig", "GPTJModel", dict(TEXT, n_embd=D, n_layer=L, n_head=H, n_inner=F, n_positions=64,
                                                 rotary_dim=8), bert_like),
    Case("opt", "OPTConfig", "OPTModel",
         dict(TEXT, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, ffn_dim=F,
              max_position_embeddings=64, word_embed_proj_dim=32), bert_like),
    Case("bloom", "BloomConfig", "BloomModel", dict(TEXT, hidden_size=D, n_layer=L, n_head=H), bloom,
         impls=("eager",)),
    Case("falcon", "FalconConfig", "FalconModel",
         dict(TEXT, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, ffn_hidden_size=F), falcon_mqa),
    Case("falcon-gqa", "FalconConfig", "FalconModel",
         dict(TEXT, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, ffn_hidden_size=F,
              new_decoder_architecture=True, num_kv_heads=G), falcon_gqa),
    Case("llama", "LlamaConfig", "LlamaModel", GQA_SHAPE, llama_like),
    Case("mistral", "MistralConfig", "MistralModel", dict(GQA_SHAPE, head_dim=24, sliding_window=8),
         lambda n, b: llama_like(n, b, head_dim=24)),
    Case("qwen2", "Qwen2Config", "Qwen2Model", GQA_SHAPE, llama_like),
    Case("qwen3", "Qwen3Config", "Qwen3Model", dict(GQA_SHAPE, head_dim=32),
         lambda n, b: llama_like(n, b, head_dim=32)),
    Case("gemma", "GemmaConfig", "GemmaModel", dict(DECODER_SHAPE, num_key_value_heads=1, head_dim=32),
         lambda n, b: llama_like(n, b, head_dim=32, kv=1)),
    Case("gemma2", "Gemma2Config", "Gemma2Model", dict(GQA_SHAPE, head_dim=32, sliding_window=8),
         lambda n, b: llama_like(n, b, head_dim=32), impls=("eager",)),
    Case("gemma3", "Gemma3TextConfig", "Gemma3TextModel", dict(GQA_SHAPE, head_dim=32, sliding_window=8),
         lambda n, b: llama_like(n, b, head_dim=32)),
    Case("phi", "PhiConfig", "PhiModel", dict(DECODER_SHAPE, partial_rotary_factor=0.5), bert_like),
    Case("phi3", "Phi3Config", "Phi3Model", dict(GQA_SHAPE, pad_token_id=0), llama_like),
    Case("stablelm", "StableLmConfig", "StableLmModel", dict(GQA_SHAPE, partial_rotary_factor=0.25), llama_like),
    Case("stablelm-parallel", "StableLmConfig", "StableLmModel",
         dict(GQA_SHAPE, partial_rotary_factor=0.25, use_parallel_residual=True), llama_like),
    Case("starcoder2", "Starcoder2Config", "Starcoder2Model", dict(GQA_SHAPE, sliding_window=8), non_gated_gqa),
    Case("olmo", "OlmoConfig", "OlmoModel", GQA_SHAPE, llama_like),
    Case("t5", "T5Config", "T5Model",
         dict(TEXT, d_model=D, d_kv=24, d_ff=F, num_layers=L, num_decoder_layers=3, num_heads=H), t5),
    Case("long-t5", "LongT5Config", "LongT5EncoderModel",
         dict(TEXT, d_model=D, d_kv=16, d_ff=F, num_layers=L, num_heads=H, local_radius=4), long_t5, impls=("eager",)),
    Case("t5-gated", "T5Config", "T5Model",
         dict(TEXT, d_model=D, d_kv=24, d_ff=F, num_layers=L, num_decoder_layers=3, num_heads=H,
              feed_forward_proj="gated-gelu"), t5_gated),
    Case("bart", "BartConfig", "BartModel",
         dict(TEXT, d_model=D, encoder_layers=L, decoder_layers=L, encoder_attention_heads=H,
              decoder_attention_heads=H, encoder_ffn_dim=F, decoder_ffn_dim=F, max_position_embeddings=64), bart),
    Case("vit", "ViTConfig", "ViTModel",
         dict(IMAGE, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=F),
         bert_like, n=VISION_N),
    Case("clip-text", "CLIPTextConfig", "CLIPTextModel",
         dict(TEXT, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=F,
              max_position_embeddings=64), bert_like),
    Case("clip-vision", "CLIPVisionConfig", "CLIPVisionModel",
         dict(IMAGE, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=F),
         bert_like, n=VISION_N),
    Case("mixtral", "MixtralConfig", "MixtralModel",
         dict(GQA_SHAPE, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2), mixtral,
         extra=BATCHED_MM),
    Case("qwen2-moe", "Qwen2MoeConfig", "Qwen2MoeModel",
         dict(GQA_SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, decoder_sparse_step=2, mlp_only_layers=[]), qwen2_moe,
         extra=BATCHED_MM),
    Case("qwen3-moe", "Qwen3MoeConfig", "Qwen3MoeModel",
         dict(GQA_SHAPE, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              decoder_sparse_step=1, mlp_only_layers=[]), qwen3_moe, extra=BATCHED_MM),
    Case("deepseek-v3", "DeepseekV3Config", "DeepseekV3Model",
         dict(DECODER_SHAPE, num_hidden_layers=4, num_key_value_heads=H, moe_intermediate_size=32,
              first_k_dense_replace=1,
              n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
              q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
         deepseek_v3, extra=BATCHED_MM),
]

CASES = [(row_id, family, kwargs) for family in FAMILIES for row_id, kwargs in family.rows()]


def profile_checked(factory: Callable[[], Any], family: Case, **options: Any) -> Any:
    """The profile as users get it (repeated layers copied), after checking that counting every
    layer in full gives the same profile: the same split, by_module, unsupported ops and warnings."""
    clear_cache()
    short = profile(factory, family.n, batch=family.batch, **options)
    clear_cache()  # the cache does not tell the two apart
    with full_trace():
        full = profile(factory, family.n, batch=family.batch, **options)
    assert short.to_dict() == full.to_dict()
    return short


@pytest.mark.parametrize(("row", "family", "kwargs"), CASES, ids=[c[0] for c in CASES])
def test_zoo_split_is_exact(row: str, family: Case, kwargs: dict[str, Any]) -> None:
    if (why := unsupported(family, kwargs)) is not None:
        pytest.skip(why)
    factory = build(family.config, family.model, kwargs)
    # the shortcut is proven against the full trace once per architecture (its first row; the
    # attention implementation does not change which layers are alike)
    first = row == family.rows()[0][0]
    p = profile_checked(factory, family) if first else profile(factory, family.n, batch=family.batch)
    got = {
        "attention_core": p.attention_core,
        "attention_proj": p.attention_proj,
        "ffn": p.ffn,
        "ffn_router": p.ffn_router,
    }
    assert got == family.expected(family.n, family.batch)
    # Never silently wrong: the formula agrees to the MAC, or the profile says why it does not.
    if family.family in NO_FORMULA:
        assert p.spec is None and any(
            note.startswith("no formula: ") and NO_FORMULA[family.family] in note for note in p.notes), p.notes
    elif family.family in FORMULA_DIFFERS:
        assert p.deviation and any(FORMULA_DIFFERS[family.family] in w for w in p.warnings), p.warnings
    else:
        assert (p.deviation, p.warnings) == (0, ())


#: Families the cost model does not describe, and the note that says so.
NO_FORMULA = {"t5": "encoder-decoder", "t5-gated": "encoder-decoder", "bart": "encoder-decoder",
              "deepseek-v3": "multi-head latent attention"}
#: Families whose count differs from the formula, and the part the warning names.
FORMULA_DIFFERS = {"deberta-v2": "attention_core is",  # disentangled attention's c2p / p2c products
                   "xlnet": "attention_core is",  # relative positions: 2n keys of position scores
                   "doge": "attention_proj is",  # dt_proj, the dynamic mask's projection
                   "long-t5": "attention_core is"}  # blocks of local attention


def test_zoo_is_big_enough() -> None:
    assert len(CASES) >= 40
    assert len(FAMILIES) >= 33


#: One row per family (sdpa where the family has it) for the second counter.
FIRST_ROWS = [(family.rows()[0][0], family, family.rows()[0][1]) for family in FAMILIES]


@pytest.mark.parametrize(("family", "kwargs"), [c[1:] for c in FIRST_ROWS], ids=[c[0] for c in FIRST_ROWS])
def test_zoo_backends_agree_forward_and_train(family: Case, kwargs: dict[str, Any]) -> None:
    """torch's FlopCounterMode (fake tensors) splits like fvcore (both match the hand formula); a training
    step is 3x, part by part.

    A text model's forward is counted by a sweep of two lengths, which the torch backend counts in one run
    (repeated layers copied, as a profile copies them): the hand count at N and at 40. That one run gives the
    profile a count at one length gives, record for record, in test_one_run.py; here each family's run is held
    to the hand formula at both lengths, and the training step (every layer traced, forward and backward) to
    three times it (less the gradients no operand needs, :data:`NO_INPUT_GRADIENT`)."""
    if (why := unsupported(family, kwargs, train=True)) is not None:
        pytest.skip(why)
    factory = build(family.config, family.model, kwargs)
    parts = ("attention_core", "attention_proj", "ffn", "ffn_router")
    clear_cache()
    if family.n == N:  # text models (an image model's n is its image's: no lengths to sweep)
        swept = sweep(factory, [N, 40], batch=family.batch, backend="torch")
        assert swept.one_run == (ONE_RUN and family.family not in PER_LENGTH)
        th = swept[0]
        assert {p: getattr(swept[1], p) for p in parts} == family.expected(40, family.batch)
        assert len(swept[1].warnings) == len(th.warnings) and swept[1].notes == th.notes  # warnings name MACs
    else:
        th = profile(factory, family.n, batch=family.batch, backend="torch")
    train = profile(factory, family.n, batch=family.batch, mode="train", inputs=TRAIN_INPUTS.get(family.family))
    assert (th.backend, train.backend, th.fallback, train.fallback) == ("torch", "torch", None, None)
    expected = family.expected(family.n, family.batch)
    assert {p: getattr(th, p) for p in parts} == expected
    skipped = NO_INPUT_GRADIENT.get(family.family, lambda n, b: split())(family.n, family.batch)
    assert {p: getattr(train, p) for p in parts} == {p: 3 * v - skipped[p] for p, v in expected.items()}


#: Families whose one-run sweep the torch backend refuses, counting length by length: LongT5 builds its mask only
#: when not compiling, and one run of several lengths runs on fake or meta tensors as if compiling.
PER_LENGTH = {"long-t5"}

#: Inputs a training step is counted on where the default ones do not do: LongT5 builds its own mask only when not
#: compiling, and its backward then mixes devices on fake tensors; given a mask, it runs as compiled.
TRAIN_INPUTS = {"long-t5": lambda n, b: {"input_ids": torch.zeros(b, n, dtype=torch.long),
                                         "attention_mask": torch.ones(b, n, dtype=torch.long)}}

#: What a training step leaves out of three times the forward: the gradient of a product's operand that needs none
#: (XLNet's sinusoids into r, and its token-type matrix into the segment scores).
NO_INPUT_GRADIENT: dict[str, Callable[[int, int], dict[str, int]]] = {
    "xlnet": lambda n, b: times(L, split(b * H * n * n * 2, lin(2 * n * b, D, D))),
}


#: Rows whose layers are not all alike, and the layers the shortcut copies (the others traced).
COPIED = {
    "bert-sdpa": ("encoder.layer.2",),
    "t5-sdpa": (),  # block 0 of each stack holds the position bias: two alike after it, not three
    "deepseek-v3-sdpa": ("layers.3",),  # layer 0 dense, 1-3 mixtures of experts
    "qwen2-moe-sdpa": (),  # dense, sparse, dense: no three alike in a row
    # global, local, global: they differ only in their mask buffer's values, which the meta twin does
    # not hold and forward-mode counts do not read (causal="half" does: see the next test)
    "gpt-neo-eager": ("h.2",),
    "gemma2-eager": (),  # sliding and global layers alternate
    "albert-sdpa": (),  # one layer module run three times
    # alike, though each attention module holds its own function wrappers (kernels, transformers 5.25)
    "llama-sdpa": ("layers.2",),
    "qwen3-sdpa": ("layers.2",),
}


@pytest.mark.parametrize("row", COPIED)
@pytest.mark.parametrize("backend", ["fvcore", "torch"])
def test_zoo_shortcut_copies_only_layers_alike(row: str, backend: str) -> None:
    """Op for op, the records of a count with copies are those of the full trace."""
    from pytest_attncost import api, families
    from pytest_attncost.counting import count_forward, count_forward_torch, meta_twin

    _, family, kwargs = next(c for c in CASES if c[0] == row)
    if (why := unsupported(family, kwargs)) is not None:
        pytest.skip(why)
    counts = []
    for shortcut in (True, False):
        with torch_meta():
            model = build(family.config, family.model, kwargs)()
        twin = meta_twin(model)
        families.prepare_twin(twin)
        args, inputs = api.default_inputs(model, family.n, family.batch)
        count = count_forward if backend == "fvcore" else count_forward_torch
        if shortcut:
            counts.append(count(twin, args, inputs))
        else:
            with full_trace():
                counts.append(count(twin, args, inputs))
    short, full = counts
    assert short.copied_layers == COPIED[row] and full.copied_layers == ()
    assert (short.total, short.records, short.unsupported_ops, short.by_module) == (
        full.total, full.records, full.unsupported_ops, full.by_module)


def torch_meta() -> Any:
    import torch

    return torch.device("meta")


@pytest.mark.parametrize("backend", ["fvcore", "torch"])
def test_zoo_layers_with_other_mask_buffers_are_not_copied(backend: str) -> None:
    """GPT-Neo's local layers bake a sliding window into their mask buffer: for causal="half" the
    buffer's form is read from the original, and layers whose forms differ are not alike."""
    from pytest_attncost import api, families
    from pytest_attncost.counting import buffer_masks, count_forward, count_forward_torch, meta_twin

    _, family, kwargs = next(c for c in CASES if c[0] == "gpt-neo-eager")
    model = build(family.config, family.model, kwargs)()
    masks = buffer_masks(model)
    assert {key for key in masks if key.endswith(".bias")} == {"h.0.attn.attention.bias", "h.2.attn.attention.bias"}
    twin = meta_twin(model)
    families.prepare_twin(twin)
    args, inputs = api.default_inputs(model, family.n, family.batch)
    count = count_forward if backend == "fvcore" else count_forward_torch
    assert count(twin, args, inputs, buffer_masks=masks).copied_layers == ()
