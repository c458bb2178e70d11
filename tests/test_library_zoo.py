"""Transformers built with third-party libraries, each split exact against a hand formula.

The transformers zoo (``test_zoo.py``) holds Hugging Face's families; these are the libraries people build
their own models with, where containers do not say what a module is: x-transformers keeps attention and
FFN blocks apart in one list, Perceiver IO runs cross-attention outside its latent layers, litgpt names
grouped-query attention its own way, Linformer projects keys along the sequence. Every row is counted by
both backends and must give the integers written here, from each library's code:

* a Linear costs tokens x in x out MACs;
* a core costs QK^T + AV: batch x heads x queries x keys x head size, twice;
* x-transformers' ``Attention`` has ``to_q``, ``to_k``, ``to_v`` (D -> heads x head size, or kv heads x head
  size) and ``to_out``; its ``FeedForward`` is D -> 4D -> D (with ``ff_glu``: D -> 2 x 4D, then 4D -> D).

A library that is not installed skips its rows with the reason (``pip install -e '.[test]'`` installs them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pytest_attncost import profile

D, H, DH, V, L, B = 64, 4, 16, 128, 2, 2  # width, heads, head size, vocabulary, layers, batch
FF = 4 * D


def lin(tokens: int, fan_in: int, fan_out: int) -> int:
    return tokens * fan_in * fan_out


def core(queries: int, keys: int, heads: int = H, head_dim: int = DH, batch: int = B) -> int:
    return 2 * batch * heads * queries * keys * head_dim


def ids(n: int, batch: int) -> tuple[torch.Tensor, ...]:
    return (torch.zeros(batch, n, dtype=torch.long),)


@dataclass(frozen=True)
class Row:
    library: str  # the module to import: its absence skips the row
    name: str
    factory: Callable[[], nn.Module]
    inputs: Callable[[int, int], Any]
    n: int
    split: tuple[int, int, int]  # attention_core, attention_proj, ffn, by hand
    outside: dict[str, int] = field(default_factory=dict)  # attention outside the repeated layers
    layers: int = L


# --- x-transformers ----------------------------------------------------------------------------------

N, M = 16, 24  # tokens, and memory tokens for cross-attention
T = B * N


def _wrapper(layers: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def factory() -> nn.Module:
        import x_transformers as xt

        stack = getattr(xt, layers)(dim=D, depth=L, heads=H, attn_dim_head=DH, **kwargs)
        return xt.TransformerWrapper(num_tokens=V, max_seq_len=64, attn_layers=stack)

    return factory


def _x_transformer() -> nn.Module:
    from x_transformers import XTransformer

    return XTransformer(dim=D, enc_num_tokens=V, enc_depth=L, enc_heads=H, enc_max_seq_len=64, enc_attn_dim_head=DH,
                        dec_num_tokens=V, dec_depth=L, dec_heads=H, dec_max_seq_len=64, dec_attn_dim_head=DH)


def _vit() -> nn.Module:
    from x_transformers import Encoder, ViTransformerWrapper

    return ViTransformerWrapper(image_size=32, patch_size=8, num_classes=10,
                                attn_layers=Encoder(dim=D, depth=L, heads=H, attn_dim_head=DH))


SELF = 4 * lin(T, D, H * DH)  # q, k, v and out of one layer
X_ROWS = [
    Row("x_transformers", "encoder", _wrapper("Encoder"), ids, N, (L * core(N, N), L * SELF, L * 2 * lin(T, D, FF))),
    Row("x_transformers", "decoder-rotary", _wrapper("Decoder", rotary_pos_emb=True), ids, N,
        (L * core(N, N), L * SELF, L * 2 * lin(T, D, FF))),
    Row("x_transformers", "gqa", _wrapper("Decoder", attn_kv_heads=2), ids, N,
        (L * core(N, N), L * (2 * lin(T, D, H * DH) + 2 * lin(T, D, 2 * DH)), L * 2 * lin(T, D, FF))),
    Row("x_transformers", "glu", _wrapper("Encoder", ff_glu=True), ids, N,
        (L * core(N, N), L * SELF, L * (lin(T, D, 2 * FF) + lin(T, FF, D)))),
    # a decoder attending to M memory tokens: its cross-attention blocks join the layers before them
    Row("x_transformers", "cross-attend", _wrapper("Decoder", cross_attend=True),
        lambda n, b: {"x": torch.zeros(b, n, dtype=torch.long), "context": torch.zeros(b, M, D)}, N,
        (L * (core(N, N) + core(N, M)), L * (SELF + 2 * lin(T, D, H * DH) + 2 * lin(B * M, D, H * DH)),
         L * 2 * lin(T, D, FF))),
    # encoder over M source tokens; the decoder (its wrapper runs every target token) over N + 1 with
    # cross-attention to the encoder's output
    Row("x_transformers", "xtransformer", _x_transformer,
        lambda n, b: {"src": torch.zeros(b, n, dtype=torch.long), "tgt": torch.zeros(b, N + 1, dtype=torch.long)},
        M, (L * core(M, M) + L * (core(N + 1, N + 1) + core(N + 1, M)),
            L * 4 * lin(B * M, D, H * DH) + L * (6 * lin(B * (N + 1), D, H * DH) + 2 * lin(B * M, D, H * DH)),
            L * 2 * lin(B * M, D, FF) + L * 2 * lin(B * (N + 1), D, FF)), layers=2 * L),
    # 32 x 32 images in 8 x 8 patches: 16 tokens
    Row("x_transformers", "vit", _vit, lambda n, b: (torch.zeros(b, 3, 32, 32),), 16,
        (L * core(16, 16), L * 4 * lin(B * 16, D, H * DH), L * 2 * lin(B * 16, D, FF))),
]


# --- Perceiver IO: cross-attention blocks outside the latent layers -------------------------------------

LATENTS, LATENT_D, DATA, DATA_D, QUERIES, QUERY_D = 8, 64, 40, 32, 12, 48


def _perceiver_io() -> nn.Module:
    from perceiver_pytorch import PerceiverIO

    return PerceiverIO(depth=L, dim=DATA_D, queries_dim=QUERY_D, logits_dim=10, num_latents=LATENTS,
                       latent_dim=LATENT_D, cross_heads=1, latent_heads=H, cross_dim_head=DH, latent_dim_head=DH)


# the encoder's cross-attention: one head, latents query the data; its FeedForward (GEGLU: D -> 2 x 4D, 4D -> D)
ENCODE = (core(LATENTS, DATA, heads=1),
          lin(B * LATENTS, LATENT_D, DH) + lin(B * DATA, DATA_D, 2 * DH) + lin(B * LATENTS, DH, LATENT_D),
          lin(B * LATENTS, LATENT_D, 8 * LATENT_D) + lin(B * LATENTS, 4 * LATENT_D, LATENT_D))
# the decoder's cross-attention: the queries attend to the latents; no FeedForward (decoder_ff is off)
DECODE = (core(QUERIES, LATENTS, heads=1),
          lin(B * QUERIES, QUERY_D, DH) + lin(B * LATENTS, LATENT_D, 2 * DH) + lin(B * QUERIES, DH, QUERY_D), 0)
# a latent layer: self-attention of the latents, and the same FeedForward
LATENT = (core(LATENTS, LATENTS), lin(B * LATENTS, LATENT_D, H * DH) + lin(B * LATENTS, LATENT_D, 2 * H * DH)
          + lin(B * LATENTS, H * DH, LATENT_D), ENCODE[2])
PERCEIVER_ROWS = [
    Row("perceiver_pytorch", "perceiver-io", _perceiver_io,
        lambda n, b: {"data": torch.zeros(b, DATA, DATA_D), "queries": torch.zeros(b, QUERIES, QUERY_D)}, LATENTS,
        tuple(L * latent + encode + decode for latent, encode, decode in zip(LATENT, ENCODE, DECODE)),  # type: ignore[arg-type]
        outside={"attention_core": ENCODE[0] + DECODE[0], "attention_proj": ENCODE[1] + DECODE[1],
                 "ffn": ENCODE[2]}),
]


# --- litgpt: grouped-query attention named n_query_groups, a gated MLP ---------------------------------


def _litgpt() -> nn.Module:
    from litgpt import Config
    from litgpt.model import GPT

    return GPT(Config(name="tiny", block_size=64, vocab_size=V, padded_vocab_size=V, n_layer=L, n_head=H, n_embd=D,
                      n_query_groups=2, head_size=DH, intermediate_size=96, mlp_class_name="LLaMAMLP",
                      norm_class_name="RMSNorm", bias=False, parallel_residual=False))


def _litgpt_neox() -> nn.Module:
    from litgpt import Config
    from litgpt.model import GPT

    return GPT(Config(name="tiny-neox", block_size=64, vocab_size=V, padded_vocab_size=V, n_layer=L, n_head=H,
                      n_embd=D, head_size=DH, intermediate_size=FF, mlp_class_name="GptNeoxMLP",
                      parallel_residual=True))


LIT_ROWS = [
    Row("litgpt", "gqa-llama", _litgpt, ids, N,
        (L * core(N, N), L * (2 * lin(T, D, H * DH) + 2 * lin(T, D, 2 * DH)), L * 3 * lin(T, D, 96))),
    Row("litgpt", "parallel-residual-neox", _litgpt_neox, ids, N, (L * core(N, N), L * SELF, L * 2 * lin(T, D, FF))),
]


# --- local-attention, rotary-embedding-torch, linformer: attention modules in a model of one's own -------

W = 8  # local attention window


class _Stack(nn.Module):
    """Token ids -> embedding -> L pre-norm blocks of attention and an MLP."""

    def __init__(self, attention: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(_Block(attention()) for _ in range(L))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return x


class _Block(nn.Module):
    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(D), attention
        self.mlp = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, FF), nn.GELU(), nn.Linear(FF, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class _RotaryAttention(nn.Module):
    def __init__(self) -> None:
        from rotary_embedding_torch import RotaryEmbedding

        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
        self.rotary = RotaryEmbedding(dim=DH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, H, DH).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        q, k = self.rotary.rotate_queries_or_keys(q), self.rotary.rotate_queries_or_keys(k)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, D))


def _local() -> nn.Module:
    from local_attention import LocalMHA

    return _Stack(lambda: LocalMHA(dim=D, window_size=W, dim_head=DH, heads=H, causal=True))


def _linformer() -> nn.Module:
    from linformer import Linformer

    return Linformer(dim=D, seq_len=32, depth=L, k=8, heads=H, dim_head=DH, one_kv_head=False, share_kv=False)


OWN_ROWS = [
    # windows of W queries attend to their own and the previous window: 2W keys each
    Row("local_attention", "local-mha", _local, ids, 32,
        (L * core(32, 2 * W), L * (lin(B * 32, D, 3 * H * DH) + lin(B * 32, H * DH, D)), L * 2 * lin(B * 32, D, FF))),
    Row("rotary_embedding_torch", "rotary", lambda: _Stack(_RotaryAttention), ids, N,
        (L * core(N, N), L * 4 * lin(T, D, D), L * 2 * lin(T, D, FF))),
    # keys and values projected along the sequence to k = 8 (einsum with a [n, k] parameter): projections too
    Row("linformer", "linformer", _linformer, lambda n, b: (torch.zeros(b, n, D),), 32,
        (L * core(32, 8), L * (3 * lin(B * 32, D, H * DH) + 2 * B * 32 * 8 * H * DH + lin(B * 32, H * DH, D)),
         L * 2 * lin(B * 32, D, FF))),
]

ROWS = [*X_ROWS, *PERCEIVER_ROWS, *LIT_ROWS, *OWN_ROWS]


@pytest.mark.parametrize("backend", ["fvcore", "torch"])
@pytest.mark.parametrize("row", ROWS, ids=[f"{row.library}-{row.name}" for row in ROWS])
def test_library_model_is_exact(row: Row, backend: str) -> None:
    pytest.importorskip(row.library, reason=f"{row.library} is not installed (pip install -e '.[test]')")
    p = profile(row.factory, row.n, batch=B, inputs=row.inputs, backend=backend)
    assert (p.attention_core, p.attention_proj, p.ffn) == row.split
    assert (p.layers, p.warnings, dict(p.outside)) == (row.layers, (), row.outside)
    if row.outside:  # named in a note with its MACs, and left out of what the formula describes
        note = next(note for note in p.notes if note.startswith("attention outside the repeated layers"))
        assert f"core {row.outside['attention_core']:,}, projections {row.outside['attention_proj']:,}" in note
    else:
        assert not any("outside the repeated layers" in note for note in p.notes)


def test_litgpt_gqa_gets_its_formula_without_a_warning() -> None:
    pytest.importorskip("litgpt", reason="litgpt is not installed (pip install -e '.[test]')")
    p = profile(_litgpt, N, batch=B, inputs=ids)
    assert p.spec is not None and (p.spec.kv_heads, p.spec.head_dim, p.spec.gated) == (2, DH, True)
    assert (p.deviation, p.warnings) == (0, ())


def test_x_transformers_roles_by_class_name_and_regex_give_the_same_split() -> None:
    # attention and FFN blocks alternate in one list (layers.0, layers.1, ...): a glob would list indexes
    pytest.importorskip("x_transformers", reason="x_transformers is not installed (pip install -e '.[test]')")
    expected = X_ROWS[0].split
    for given in ({"attention": "class:Attention", "ffn": "class:FeedForward"},
                  {"attention": r"re:attn_layers\.layers\.\d*[02468]\.1",
                   "ffn": r"re:attn_layers\.layers\.\d*[13579]\.1"}):
        p = profile(X_ROWS[0].factory, N, batch=B, inputs=ids, roles=given)
        assert (p.attention_core, p.attention_proj, p.ffn) == expected, given
