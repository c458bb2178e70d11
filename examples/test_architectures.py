"""The same questions asked of other architectures."""

import pytest
import torch
from models import ROLES, TinyLM
from torch import nn
from transformers import GPT2Config, GPT2Model, LlamaConfig, LlamaModel


def gpt2_small():
    return GPT2Model(GPT2Config())


def llama2_7b():
    # LLaMA-2-7B's shape, built on the meta device: 6.7B parameters, no memory.
    return LlamaModel(LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                                  num_hidden_layers=32, max_position_embeddings=4096))


@pytest.mark.attncost(n=1024, attention_share_max=0.5, formula_rtol=0)
def test_gpt2_at_its_context_length(attncost):
    attncost.profile(gpt2_small)


# A gated FFN (3 matrices of 4096 x 11008) pushes the crossover out to n = (3Df - 4D²) / 2D = 8320.
@pytest.mark.attncost(n=4096, attention_share_max=0.5, quadratic_share_max=0.25, formula_rtol=0)
def test_llama2_7b_at_4k_is_still_ffn_bound(attncost):
    result = attncost.profile(llama2_7b)
    assert result.crossover_n == 8320


@pytest.mark.attncost(n=512, batch=4, attention_share_max=0.5, formula_rtol=0)
def test_torch_transformer_encoder(attncost):
    layer = nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False).eval()
    with torch.no_grad():
        result = attncost.profile(encoder)
    assert result.batch == 4


# A hand-written model: name its attention and FFN modules with roles=.
@pytest.mark.attncost(n=512, attention_share_max=0.45)
def test_hand_written_model(attncost):
    result = attncost.profile(lambda: TinyLM(), inputs=lambda n, b: (torch.zeros(b, n, 768),), roles=ROLES)
    assert result.attention_share == pytest.approx(0.4)
