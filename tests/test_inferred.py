"""A model no config describes gets its spec from the trace (pytest_attncost.inferred): nanoGPT by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pytest_attncost import ModelSpec, profile

pytestmark = pytest.mark.shared_profiles  # its runs are about the spec inferred and shown (conftest.project)

N, D, HEADS, LAYERS = 32, 64, 4, 2


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one fused QKV matrix, the scores written out."""

    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(D, 3 * D)
        self.c_proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        scores = F.softmax((q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1)), dim=-1)
        return self.c_proj((scores @ v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(D), CausalSelfAttention(), nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int = 100) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, D), nn.Embedding(256, D)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.lm_head = nn.LayerNorm(D), nn.Linear(D, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class GroupedBlock(nn.Module):
    """LLaMA's shape by hand: separate Q, K, V (2 K/V heads of 4), a fused kernel, a SwiGLU FFN of width 96."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(D, D), nn.Linear(D, 32), nn.Linear(D, 32), nn.Linear(D, D)
        self.gate, self.up, self.down = nn.Linear(D, 96), nn.Linear(D, 96), nn.Linear(96, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 16).transpose(1, 2)
        k, v = (z(x).view(b, t, 2, 16).transpose(1, 2).repeat_interleave(2, dim=1) for z in (self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D))
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


def tokens(n: int, batch: int) -> tuple[torch.Tensor]:
    return (torch.zeros(batch, n, dtype=torch.long),)


def test_a_hand_written_nanogpt_gets_an_inferred_spec_and_deviation_zero() -> None:
    p = profile(NanoGPT, N, inputs=tokens)
    assert p.spec == ModelSpec(hidden=D, heads=HEADS, head_dim=D // HEADS, layers=LAYERS, ffn_dim=4 * D)
    assert p.notes[0].startswith("spec inferred from the trace (no config describes the model): ModelSpec(hidden=64, "
                                 "heads=4, head_dim=16, layers=2, ffn_dim=256)")
    # by hand, per layer: QKV and O 4nD², QKᵀ and AV 2n²D, the FFN 2·n·D·4D
    assert (p.attention_proj, p.attention_core, p.ffn) == (LAYERS * 4 * N * D * D, LAYERS * 2 * N * N * D,
                                                          LAYERS * 8 * N * D * D)
    assert p.deviation == 0 and p.warnings == ()
    assert p.crossover_n == 2 * D  # the formula's threshold, now that the shape is known


def test_grouped_heads_and_a_gated_ffn_are_read_from_separate_projections() -> None:
    p = profile(lambda: nn.Sequential(GroupedBlock(), GroupedBlock(), GroupedBlock()), N,
                inputs=lambda n, b: (torch.zeros(b, n, D),))
    assert p.spec == ModelSpec(hidden=D, heads=4, head_dim=16, layers=3, ffn_dim=96, kv_heads=2, gated=True)
    assert p.deviation == 0


def test_a_given_spec_or_a_config_is_never_replaced() -> None:
    given = ModelSpec(hidden=D, heads=2, head_dim=32, layers=LAYERS, ffn_dim=4 * D)
    p = profile(NanoGPT, N, inputs=tokens, spec=given)
    assert p.spec == given and not any("inferred" in note for note in p.notes)


def test_the_report_names_the_spec_inferred(project: pytest.Pytester) -> None:
    project.makepyfile(test_nano=f"""
        import pytest, torch
        from nano_models import NanoGPT

        @pytest.mark.attncost(formula_rtol=0, crossover_min=128, crossover_max=128, crossover_rtol=0)
        def test_nano(attncost):
            attncost.sweep(NanoGPT, [{N}, {2 * N}], inputs=lambda n, b: (torch.zeros(b, n, dtype=torch.long),))
    """)
    source = open(__file__, encoding="utf-8").read()
    project.makepyfile(nano_models=source[:source.index("def tokens")])
    result = project.runpytest("--attncost-report", "-p", "no:randomly")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*NanoGPT (inferred: hidden 64, 4 heads x 16, ffn 256, 2 layers): attention "
                                 "overtakes FFN at n=128 = 2hd*"])
