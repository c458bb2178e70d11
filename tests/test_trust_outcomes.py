"""A profile the plugin cannot stand behind is marked in every report and fails under --attncost-strict."""

import json

import pytest

ODD_MODEL = '''
import pytest
import torch
from torch import nn
from torch.nn import functional as F

D, H = 32, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, H, D // H).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, D))


class Block(nn.Module):
    """Beside attention and FFN, a product of two activations nothing explains."""

    def __init__(self):
        super().__init__()
        self.attn, self.up, self.down = Attention(), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.down(torch.relu(self.up(x))) * (x @ x.transpose(-1, -2)).mean()


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.attncost(n=16)
def test_odd(attncost):
    result = attncost.profile(Odd(), inputs=(torch.zeros(1, 16, D),))
    assert len(result.warnings) == 2
'''


@pytest.fixture
def odd(project: pytest.Pytester) -> pytest.Pytester:
    project.makepyfile(test_odd=ODD_MODEL)
    return project


def test_warnings_are_reported_and_pass_by_default(odd: pytest.Pytester) -> None:
    report = odd.path / "report.json"
    result = odd.runpytest("--attncost-report", f"--attncost-json={report}", f"--attncost-markdown={odd.path / 'r.md'}")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "*Odd (2 warnings)*",
        "warnings (these numbers may be wrong; --attncost-strict fails them):",
        "  test_odd.py::test_odd ?Odd n=16?: layers.0: 8,192 MAC of products of two activations outside the layer's "
        "attention module(s) could not be placed*",
    ])
    (row,) = json.loads(report.read_text())["profiles"]
    assert [w.split(":")[0] for w in row["warnings"]] == ["layers.0", "layers.1"]
    markdown = (odd.path / "r.md").read_text()
    assert "**Warnings (these numbers may be wrong; --attncost-strict fails them):**" in markdown
    assert "layers.1: 8,192 MAC of products of two activations" in markdown


def test_strict_fails_a_profile_with_warnings(odd: pytest.Pytester) -> None:
    result = odd.runpytest("--attncost-strict")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "attncost: the split cannot be trusted: layers.0: *",
        "attncost checks failed (2):",
        "*the split cannot be trusted: layers.0: 8,192 MAC of products of two activations*(--attncost-strict)*",
    ])
