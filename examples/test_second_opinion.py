"""Two independent counters, training cost, and causal accounting."""

import pytest
from transformers import BertConfig, BertModel, GPT2Config, GPT2Model


def bert_base():
    return BertModel(BertConfig())


def gpt2_small():
    return GPT2Model(GPT2Config())


# fvcore (jit trace) and torch's FlopCounterMode (dispatcher) must agree on every part.
@pytest.mark.attncost(n=512, crosscheck=True, formula_rtol=0)
def test_bert_base_two_counters_agree(attncost):
    attncost.profile(bert_base)


# A training step: forward plus a real backward, 3x the forward's matrix products.
@pytest.mark.attncost(n=512, formula_rtol=0)
def test_bert_base_training_step(attncost):
    step = attncost.profile(bert_base, mode="train")
    forward = attncost.profile(bert_base, backend="torch")
    assert step.attention + step.ffn == 3 * (forward.attention + forward.ffn)


# FlashAttention-style accounting: a causal mask keeps n(n+1)/2 of the n^2 query-key pairs.
@pytest.mark.attncost(n=1024, formula_rtol=0)
def test_gpt2_causal_half(attncost):
    dense = attncost.profile(gpt2_small)
    half = attncost.profile(gpt2_small, causal="half")  # the report says "(causal half)"
    assert half.attention_core * 2 * 1024 == dense.attention_core * 1025
