"""The article's two thresholds, measured: sweeps solve them exactly from the counts.

For BERT-base attention overtakes the FFN at n = 2hd = 1536 and the quadratic term
dominates at n = 6hd = 4608; BERT-large moves both to 2048 and 6144. A gated FFN
(LLaMA) and grouped-query attention (Mistral) push them much further out.
"""

import pytest
from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel, MistralConfig, MistralModel

LENGTHS = [512, 2048, 8192]


def bert_base():
    return BertModel(BertConfig())


def bert_large():
    return BertModel(BertConfig(hidden_size=1024, num_attention_heads=16, num_hidden_layers=24,
                                intermediate_size=4096))


def llama2_7b():
    return LlamaModel(LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                                  num_hidden_layers=32))


def mistral_7b():
    return MistralModel(MistralConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                      num_key_value_heads=8, num_hidden_layers=32))


@pytest.mark.attncost(crossover_min=1536, crossover_max=1536, crossover_rtol=0)
def test_bert_base_attention_overtakes_ffn_at_2hd(attncost):
    sweep = attncost.sweep(bert_base, LENGTHS)
    assert sweep.quadratic_crossover() == 4608


@pytest.mark.attncost(crossover_min=2048, crossover_max=2048, crossover_rtol=0)
def test_bert_large_attention_overtakes_ffn_at_2hd(attncost):
    sweep = attncost.sweep(bert_large, LENGTHS)
    assert sweep.quadratic_crossover() == 6144


@pytest.mark.attncost(n=512, linear_saving_max=0.10)
@pytest.mark.parametrize("factory", [bert_base, bert_large], ids=["bert-base", "bert-large"])
def test_linear_attention_saves_under_ten_percent_at_512(attncost, factory):
    attncost.profile(factory)


# Gated FFN, no GQA: F = 3 * 4096 * 11008, P = 4 * 4096^2 -> crossover (F - P) / 8192 = 8320.
@pytest.mark.attncost(crossover_min=8000, crossover_rtol=0)
def test_llama2_7b_gated_ffn_moves_the_crossover_out(attncost):
    sweep = attncost.sweep(llama2_7b, [4096, 32768])
    assert sweep.crossover() == 8320 and sweep.quadratic_crossover() == 24704


# GQA shrinks the projections (P = 2D² + 2D·8·128) and the wider gated FFN grows F:
# crossover (3 * 4096 * 14336 - P) / 8192 = 16384, quadratic 26624.
@pytest.mark.attncost(crossover_min=16000, crossover_rtol=0)
def test_mistral_7b_gqa_moves_it_further(attncost):
    sweep = attncost.sweep(mistral_7b, [4096, 32768])
    assert sweep.crossover() == 16384 and sweep.quadratic_crossover() == 26624
