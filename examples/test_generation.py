"""Generation: decode steps against a KV cache, where attention starts to dominate, and the whole cost.

A decode step projects and feeds forward only the new token, but its attention core reads the
whole cache: per new token and layer the core is 2·n·h·d against a constant FFN F. For
LLaMA-2-7B's shape (gated FFN, F = 3·D·f) they meet at a context of F / 2hd = 16,512 tokens;
an ungated FFN of width 4D meets its core at 4D (3,072 for BERT-base's shape).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import pytest_attncost
from pytest_attncost import ModelSpec, formulas


def llama2_7b():
    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_hidden_layers=32)
    return LlamaForCausalLM(config).half()  # built on the meta device: a float16 twin costs nothing


@pytest.mark.attncost(n=[4096, 32768], mode="decode", kv_cache_max="16 GiB", formula_rtol=0)
def test_llama2_7b_decode_turns_attention_bound_past_16k(attncost):
    step = attncost.profile(llama2_7b)
    crossover = formulas.decode_crossover_n(step.spec)
    assert crossover == 16_512
    # the new token attends to the n cached tokens and itself
    if step.n + 1 < crossover:
        assert step.attention_core < step.ffn
    else:
        assert step.attention_core > step.ffn
    assert step.kv_cache_bytes == 2 * 32 * 32 * 128 * step.n * 2  # 2 GiB at n = 4096 in float16


@pytest.mark.slow  # 999 profiles: about 12 seconds on 2 cores
def test_a_thousand_tokens_after_a_thousand_token_prompt():
    """The closed form equals a prefill plus 999 decode steps, each of them profiled."""
    model = CachedDecoder()
    spec = ModelSpec(hidden=16, heads=2, head_dim=8, layers=1, ffn_dim=64)
    prefill = pytest_attncost.profile(model, 1000, inputs=lambda n, b: (torch.zeros(b, n, 16),), spec=spec)
    steps = [pytest_attncost.profile(model, n, mode="decode", inputs=_step, spec=spec) for n in range(1000, 1999)]
    generation = pytest_attncost.generation_cost(spec, prompt=1000, new_tokens=1000)
    for part in ("attention_core", "attention_proj", "ffn"):
        assert getattr(generation.total, part) == getattr(prefill, part) + sum(getattr(s, part) for s in steps)
    assert 0 < generation.attention_share < 1


# A custom model that takes its KV cache as an argument: inputs= builds the step for n.


def _step(n, batch):
    return torch.zeros(batch, 1, 16), (torch.zeros(batch, 2, n, 8), torch.zeros(batch, 2, n, 8))


class Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, x, cache):
        b, q, width = x.shape
        split = lambda t: t.view(b, q, self.heads, -1).transpose(1, 2)  # noqa: E731
        keys, values = split(self.k(x)), split(self.v(x))
        if cache is not None:  # [b, h, n, d] cached, then the new tokens' keys and values
            keys, values = torch.cat([cache[0], keys], dim=2), torch.cat([cache[1], values], dim=2)
        out = F.scaled_dot_product_attention(split(self.q(x)), keys, values)
        return self.o(out.transpose(1, 2).reshape(b, q, width))


class CachedDecoder(nn.Module):
    """One layer; forward(x) is a prefill, forward(x, cache) a decode step."""

    def __init__(self, width=16, heads=2):
        super().__init__()
        self.attn = Attention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width, bias=False), nn.ReLU(),
                                 nn.Linear(4 * width, width, bias=False))

    def forward(self, x, cache=None):
        x = x + self.attn(x, cache)
        return x + self.mlp(x)
