"""Published FLOP conventions beside the exact count (issue 27, part 1): LLaMA-2-7B's shape at n = 4096."""

from __future__ import annotations

import pytest
import transformers

from pytest_attncost import ModelSpec, profile
from pytest_attncost.conventions import conventions

TRANSFORMERS_4 = int(transformers.__version__.split(".")[0]) < 5
LLAMA_2_7B = ModelSpec(hidden=4096, heads=32, head_dim=128, layers=32, ffn_dim=11008, gated=True)
N, L, H, Q, D, F, V = 4096, 32, 32, 128, 4096, 11008, 32000
# N_layers: the layers' matrix parameters a token meets: 4·D² (Q, K, V, O) + 3·D·F (gate, up, down), 32 layers
MATRICES = L * (4 * D * D + 3 * D * F)  # 6,476,005,376
CORE = L * 2 * H * Q * N * N  # QKᵀ and AV over n² pairs: 4,398,046,511,104
HEAD = N * V * D  # 536,870,912,000
PALM = N * (MATRICES + 2 * L * H * Q * N)  # 2N + 4·L·H·Q·T FLOP per token, halved to MAC, times T


@pytest.fixture(scope="module")
def by_name() -> dict:
    return {c.name: c for c in conventions(LLAMA_2_7B, N, vocab=V, causal=True)}


def test_the_arithmetic_by_hand():
    assert MATRICES == 6_476_005_376 and PALM == 30_923_764_531_200 and HEAD == 536_870_912_000


def test_palm_is_the_exact_count_of_the_layers(by_name):
    palm = by_name["PaLM"]
    assert palm.macs == palm.exact == PALM and palm.differs == ()


def test_megatron_2024_adds_the_head(by_name):
    megatron = by_name["Megatron-LM (2024)"]
    assert megatron.macs == PALM + HEAD == 31_460_635_443_200
    assert megatron.differs == (("the output head (n·V·D)", HEAD),)


def test_the_n_squared_over_two_conventions_miss_the_diagonal_that_half_counts(by_name):
    today = by_name["Megatron-LM (today), MaxText"]
    assert today.macs == PALM - CORE // 2 + HEAD
    # causal='half' counts n(n+1)/2 pairs: b·h·d·n(n+1) per layer; n²/2 is b·h·d·n² per layer; apart by L·h·d·n
    half_core = L * H * Q * N * (N + 1)
    assert half_core - CORE // 2 == L * H * Q * N == 536_870_912


def test_kaplan_counts_the_n_squared_term_once(by_name):
    assert by_name["Kaplan et al."].macs == N * (MATRICES + L * N * H * Q)  # 2N + 2·L·n_ctx·d_attn FLOP per token


def test_hugging_face_has_no_n_squared_term(by_name):
    hf = by_name["Hugging Face floating_point_ops"]
    assert hf.macs == N * MATRICES  # 6·tokens·N FLOP for training: a third of it forward, halved to MAC
    assert round(hf.relative, 3) == -0.142  # "no n² term": 14 % below the exact count at 4096 tokens
    assert hf.differs == (("no n² term: the attention core missing", -CORE),)


def test_chinchilla_names_each_of_its_terms(by_name):
    chinchilla = by_name["Chinchilla"]
    names = [term for term, _ in chinchilla.differs]
    assert names == ["the embedding lookup as a matrix product (n·V·D)", "the output head (n·V·D)",
                     "softmax counted (3 FLOP per score)", "the FFN as two matrices (gated: three)"]
    assert dict(chinchilla.differs)["the FFN as two matrices (gated: three)"] == -L * N * D * F


def test_flash_attention_counts_the_attention_block_alone_with_the_causal_core_halved(by_name):
    flash = by_name["FlashAttention"]
    # 4nD² + 2n²D a layer forward, the core as n²/2: 4·N·D² + N²·D, times the layers
    assert flash.macs == L * (4 * N * D * D + N * N * D) == 8_796_093_022_208 + 2_199_023_255_552
    assert flash.differs == (("the FFN left out: the attention block alone", -L * 3 * N * D * F),
                             ("causal attention halved as n²/2 (L·D·n² less)", -CORE // 2))
    gqa = {c.name: c for c in conventions(ModelSpec(64, 4, 16, 2, 96, kv_heads=2, gated=True), 32)}["FlashAttention"]
    assert gqa.macs == 2 * (4 * 32 * 64 * 64 + 2 * 32 * 32 * 64)  # K and V at every head: 4nD², not 2nD² + 2nDgd
    assert dict(gqa.differs)["K and V at every query head (no grouped-query attention)"] == 2 * 32 * 2 * 64 * 32


def test_every_conventions_terms_add_up_to_its_difference():
    for spec in (LLAMA_2_7B, ModelSpec(hidden=768, heads=12, head_dim=64, layers=12, ffn_dim=3072),
                 ModelSpec(hidden=64, heads=4, head_dim=16, layers=2, ffn_dim=96, kv_heads=2, gated=True)):
        for causal in (False, True):
            for c in conventions(spec, 512, batch=2, vocab=1000, causal=causal):
                assert c.macs - c.exact == sum(macs for _, macs in c.differs), (spec, c.name)
    bert = {c.name: c for c in conventions(ModelSpec(768, 12, 64, 12, 3072), 512)}
    assert bert["Megatron-LM (today), MaxText"].macs == bert["PaLM"].macs  # bidirectional, no head: nothing moves


def test_a_profile_set_beside_the_conventions_is_palm_to_the_mac():
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    model = profile(lambda: LlamaModel(LlamaConfig()), N)  # LLaMA-2-7B's shape on the meta device
    # transformers 4 builds the rotary table with a product ([d/2, 1] @ [1, n]: n·d/2 MAC, in other); 5 does not
    assert model.other == (N * Q // 2 if TRANSFORMERS_4 else 0)
    layers = model.attention + model.ffn
    assert layers == PALM and model.conventions()[0].macs == PALM
    with_head = profile(lambda: LlamaForCausalLM(LlamaConfig()), N)
    megatron = {c.name: c for c in with_head.conventions(vocab=V)}["Megatron-LM (2024)"]
    assert with_head.total - model.other == megatron.macs
    # the head read from the model: Megatron-LM (2024) includes it without vocab=; a model without one has none
    assert with_head.head_vocab == V and model.head_vocab == 0
    assert {c.name: c for c in with_head.conventions()}["Megatron-LM (2024)"].macs == PALM + HEAD
    assert {c.name: c for c in with_head.conventions(vocab=0)}["Megatron-LM (2024)"].macs == PALM
    half = profile(lambda: LlamaModel(LlamaConfig()), N, causal="half")
    today = {c.name: c for c in model.conventions(causal=True)}["Megatron-LM (today), MaxText"]
    assert half.attention + half.ffn - today.macs == L * H * Q * N  # the diagonal


def test_conventions_need_a_spec_and_a_forward_pass():
    import torch
    from torch import nn

    unknown = profile(nn.Sequential(nn.Linear(8, 8)), 4, inputs=(torch.zeros(1, 4, 8),), roles={"ffn": ["0"]})
    with pytest.raises(ValueError, match="the conventions need a forward profile with a spec"):
        unknown.conventions()


def test_the_docs_table_is_what_the_conventions_compute(by_name):
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "conventions.md").read_text(encoding="utf-8")
    rows = {cells[0].replace("`", ""): cells[1] for line in page.splitlines() if line.startswith("| ")
            for cells in [[cell.strip() for cell in line.strip("|").split("|")]] if cells[1][:1].isdigit()}
    assert {name: int(macs.replace(",", "")) for name, macs in rows.items()} == {
        name: c.macs for name, c in by_name.items()}
    for name, c in by_name.items():
        assert f"{c.relative:+.1%}".replace("-", "−") in page, name


def test_the_command_line_prints_the_conventions(capsys):
    import json

    from pytest_attncost import cli

    assert cli.main(["--preset", "llama-2-7b", "--n", "4096", "--conventions", "--vocab", "32000", "--causal"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("published conventions (forward MACs; vs the exact count of the layers):")
    assert lines[start + 3].split()[:4] == ["4,096", "PaLM", "30,923,764,531,200", "+0.0%"]
    assert lines[start + 4].split()[:6] == ["4,096", "Megatron-LM", "(2024)", "31,460,635,443,200", "+1.7%", "the"]
    assert cli.main(["--preset", "llama-2-7b", "--n", "4096", "--conventions", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["conventions"]["4096"]
    assert [(row["name"], row["macs"]) for row in data][:2] == [("PaLM", PALM), ("Megatron-LM (2024)", PALM)]
