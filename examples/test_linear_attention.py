"""Linear attention at ordinary lengths: the saving is small, because the core is."""

import pytest
import torch
from models import ROLES, TinyLM

from pytest_attncost import ModelSpec

# The softmax model's shape: the formulas (and linear_attention_saving) describe softmax attention. The
# linear model gets no spec, so the plugin does not hold its n·d² core up against the n²·d formula.
SPEC = ModelSpec(hidden=768, heads=12, head_dim=64, layers=12, ffn_dim=3072)


def inputs(n, batch):
    return (torch.zeros(batch, n, 768),)


# The formula says linear attention would save 8.75% of attention + FFN at n=512 (test_thresholds.py
# bounds it with linear_saving_max; here the two models are measured side by side).
@pytest.mark.attncost(n=512)
def test_linear_attention_saves_little_at_512(attncost):
    softmax = attncost.profile(lambda: TinyLM(), inputs=inputs, roles=ROLES, spec=SPEC, name="softmax")
    linear = attncost.profile(lambda: TinyLM(linear=True), inputs=inputs, roles=ROLES, name="linear")
    saved = 1 - (linear.attention + linear.ffn) / (softmax.attention + softmax.ffn)
    # measured on the two models side by side, and predicted from the softmax model alone
    assert saved == pytest.approx(softmax.linear_attention_saving)
    assert saved < 0.10


@pytest.mark.attncost(n=8192)
def test_linear_attention_pays_off_at_8k(attncost):
    softmax = attncost.profile(lambda: TinyLM(), inputs=inputs, roles=ROLES, spec=SPEC, name="softmax")
    linear = attncost.profile(lambda: TinyLM(linear=True), inputs=inputs, roles=ROLES, name="linear")
    assert 1 - (linear.attention + linear.ffn) / (softmax.attention + softmax.ffn) > 0.6
