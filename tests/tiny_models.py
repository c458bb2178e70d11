"""Small models for the plugin's own tests: 2 layers, hidden 128, 2 heads of 64, FFN 512."""

import importlib.metadata

import pytest
import torch
from torch import nn

TRANSFORMERS = importlib.metadata.version("transformers")


def transformers_5(why: str) -> pytest.MarkDecorator:
    """Skip on transformers 4, saying what its code does that a count on the meta device cannot follow."""
    return pytest.mark.skipif(int(TRANSFORMERS.split(".")[0]) < 5, reason=f"transformers {TRANSFORMERS}: {why}")

HIDDEN, HEADS, HEAD_DIM, FFN, LAYERS = 128, 2, 64, 512, 2


def bert_like(layers=LAYERS, attn_implementation="sdpa"):
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=layers,
                                intermediate_size=FFN, attn_implementation=attn_implementation))


def gpt2_like(attn_implementation="sdpa"):
    from transformers import GPT2Config, GPT2Model

    return GPT2Model(GPT2Config(n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, n_inner=FFN,
                                attn_implementation=attn_implementation))


def llama_like(kv_heads=HEADS, attn_implementation="sdpa"):
    from transformers import LlamaConfig, LlamaModel

    return LlamaModel(LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=kv_heads,
                                  num_hidden_layers=LAYERS, intermediate_size=FFN,
                                  attn_implementation=attn_implementation))


def torch_encoder(batch_first=True, layers=LAYERS):
    layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, batch_first=batch_first)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


class HandWrittenAttention(nn.Module):
    """Attention with `@` and parameters used directly, plus an MLP: needs roles=."""

    def __init__(self, width=HIDDEN, heads=HEADS):
        super().__init__()
        self.heads = heads
        self.wq = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.wk = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.wv = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.wo = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x):
        b, n, w = x.shape
        d = w // self.heads
        q, k, v = ((x @ p).reshape(b, n, self.heads, d).transpose(1, 2) for p in (self.wq, self.wk, self.wv))
        scores = torch.softmax(q @ k.transpose(-1, -2) / d**0.5, dim=-1)
        out = (scores @ v).transpose(1, 2).reshape(b, n, w)
        return out @ self.wo


class HandWrittenBlock(nn.Module):
    def __init__(self, width=HIDDEN, ffn=FFN):
        super().__init__()
        self.mixer = HandWrittenAttention(width)
        self.mlp = nn.Sequential(nn.Linear(width, ffn), nn.GELU(), nn.Linear(ffn, width))

    def forward(self, x):
        x = x + self.mixer(x)
        return x + self.mlp(x)


class HandWritten(nn.Module):
    def __init__(self, layers=LAYERS):
        super().__init__()
        self.blocks = nn.ModuleList(HandWrittenBlock() for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


HAND_ROLES = {"attention": ["blocks.*.mixer"], "ffn": ["blocks.*.mlp"]}


class PlainMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))
