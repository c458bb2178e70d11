"""Two hand-written models for the examples: softmax attention and linear attention.

Both keep the article's shape (hidden = heads x head_dim, FFN 4 x hidden), so the
only difference in cost is the attention core: 2n²hd against 2nhd².
"""

import torch
from torch import nn


class SoftmaxAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        return x.reshape(b, n, self.heads, w // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.split(t) for t in self.qkv(x).chunk(3, dim=-1))
        scores = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)  # [b, h, n, n]
        return self.out((scores @ v).transpose(1, 2).flatten(2))


class LinearAttention(SoftmaxAttention):
    """phi(Q) (phi(K)^T V), computed right to left: no n x n matrix."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.split(t) for t in self.qkv(x).chunk(3, dim=-1))
        q, k = nn.functional.elu(q) + 1, nn.functional.elu(k) + 1
        context = k.transpose(-1, -2) @ v  # [b, h, d, d]
        return self.out((q @ context).transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, linear: bool) -> None:
        super().__init__()
        self.mixer = (LinearAttention if linear else SoftmaxAttention)(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """A small language model body, BERT-base-shaped by default."""

    def __init__(self, width: int = 768, heads: int = 12, layers: int = 12, linear: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, heads, linear) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


# Module-name globs: which modules are attention and which are the FFN.
ROLES = {"attention": ["blocks.*.mixer"], "ffn": ["blocks.*.mlp"]}
