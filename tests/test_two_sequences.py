"""Models that read two sequences: n is the main (first) input's length, m the second's (issue 28)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from pytest_attncost import ProfileError, profile

D, H, F, L = 64, 4, 128, 2


def transformer() -> nn.Transformer:
    return nn.Transformer(d_model=D, nhead=H, num_encoder_layers=L, num_decoder_layers=L, dim_feedforward=F,
                          batch_first=True)


def transformer_split(n: int, m: int) -> tuple[int, int, int]:
    """nn.Transformer, source n and target m, by hand (h * d_head = D)."""
    core = L * 2 * n * n * D + L * 2 * m * m * D + L * 2 * m * n * D  # encoder, decoder self, cross (m queries, n keys)
    proj = L * 4 * n * D * D + L * 4 * m * D * D + L * (2 * m * D * D + 2 * n * D * D)  # cross: Q, O on m; K, V on n
    ffn = L * 2 * n * D * F + L * 2 * m * D * F
    return core, proj, ffn


def split(p):
    return p.attention_core, p.attention_proj, p.ffn


def test_nn_transformer_has_default_inputs_and_both_lengths():
    p = profile(transformer(), 64, m=32)
    assert (p.n, p.m) == (64, 32)
    assert split(p) == transformer_split(64, 32) == (1_835_008, 4_718_592, 3_145_728)
    assert "n=64, m=32" in repr(p) and p.to_dict()["m"] == 32
    same = profile(transformer(), 16)  # the target defaults to the source's length
    assert (same.n, same.m) == (16, 16) and split(same) == transformer_split(16, 16)


def test_the_lengths_are_read_from_the_users_inputs_and_checked():
    src, tgt = torch.zeros(1, 64, D), torch.zeros(1, 32, D)
    p = profile(transformer(), inputs=(src, tgt))
    assert (p.n, p.m) == (64, 32) and split(p) == transformer_split(64, 32)
    assert profile(transformer(), 64, m=32, inputs=(src, tgt)).m == 32  # asked and held agree
    with pytest.raises(ProfileError, match=r"m=16 was asked for, but the inputs' second sequence is 32 tokens long"):
        profile(transformer(), m=16, inputs=(src, tgt))


def test_an_encoder_decoder_from_transformers_gets_its_target_at_m():
    from transformers import BartConfig, BartModel

    config = BartConfig(vocab_size=128, d_model=D, encoder_layers=L, decoder_layers=L, encoder_attention_heads=H,
                        decoder_attention_heads=H, encoder_ffn_dim=F, decoder_ffn_dim=F, max_position_embeddings=256)
    p = profile(lambda: BartModel(config), 64, m=32)
    assert (p.n, p.m) == (64, 32)
    assert split(p) == transformer_split(64, 32)  # BART's layers are the Transformer's, shape for shape


def test_multihead_attention_with_its_own_key_widths_takes_keys_at_m():
    mha = nn.MultiheadAttention(D, H, kdim=32, vdim=48, batch_first=True)
    p = profile(mha, 16, m=40)
    assert (p.n, p.m) == (16, 40)
    assert p.attention_core == 2 * 16 * 40 * D  # scores and weighted values, h * d_head = D
    assert p.attention_proj == 16 * D * D + 40 * 32 * D + 40 * 48 * D + 16 * D * D  # Q, K (kdim), V (vdim), O


def test_a_decoder_stack_reads_its_memory_as_m_and_the_formula_agrees():
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(D, H, F, batch_first=True), L)
    p = profile(decoder, 32, m=64)
    assert (p.n, p.m) == (32, 64) and p.deviation == 0  # the formula's cross-attention reads m memory tokens


@pytest.mark.parametrize("inputs", [None, (torch.zeros(16, 1, D),)], ids=["default", "given"])
def test_m_on_a_model_that_reads_one_sequence_is_an_error(inputs):
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, H, F), L, enable_nested_tensor=False)
    with pytest.raises(ProfileError, match=r"TransformerEncoder.* (reads one|no second sequence)"):
        profile(encoder, 16, m=8, inputs=inputs)


def test_m_on_a_decode_step_is_an_error():
    with pytest.raises(ProfileError, match=r"a decode step has its cache's length n and new_tokens: drop m="):
        profile(transformer(), 16, m=8, mode="decode")


MODEL = f"""
import pytest
from torch import nn


def transformer():
    return nn.Transformer(d_model={D}, nhead={H}, num_encoder_layers={L}, num_decoder_layers={L},
                          dim_feedforward={F}, batch_first=True)


@pytest.mark.attncost(n=64, m=32)
def test_translation(attncost):
    p = attncost.profile(transformer())
    assert (p.n, p.m) == (64, 32)


@pytest.mark.attncost(n=64, m=32, mode="decode")
def test_bad(attncost):
    pass
"""


def test_the_marker_names_both_lengths_and_the_report_shows_them(pytester):
    pytester.makepyfile(test_models=MODEL)
    result = pytester.runpytest("--attncost-report", "--attncost-json=out.json", "-p", "no:randomly")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_bad*m is the second sequence's length*drop m*",
                                 "*test_translation*Transformer*64 (m 32)*"])
    rows = json.loads((pytester.path / "out.json").read_text())["profiles"]
    assert [(r["n"], r["m"]) for r in rows] == [(64, 32)]


def test_a_perceiver_runs_its_layers_on_n_latents_and_reads_m_inputs():
    perceiver_pytorch = pytest.importorskip("perceiver_pytorch", reason="the [zoo] extra's perceiver-pytorch")
    model = perceiver_pytorch.PerceiverIO(depth=2, dim=32, queries_dim=48, logits_dim=10, num_latents=8, latent_dim=64,
                                          cross_heads=1, latent_heads=4, cross_dim_head=16, latent_dim_head=16)
    p = profile(model, inputs={"data": torch.zeros(1, 40, 32), "queries": torch.zeros(1, 12, 48)})
    assert (p.n, p.m) == (8, 40)  # the latents, and the inputs their cross-attention reads
    with pytest.raises(ProfileError, match=r"m=41 was asked for, but the inputs' second sequence is 40 tokens long"):
        profile(model, m=41, inputs={"data": torch.zeros(1, 40, 32), "queries": torch.zeros(1, 12, 48)})
