"""The article's claims about BERT-base, as tests.

Models are built by a factory on the meta device: no weights are allocated, so
BERT-base at 2048 tokens costs about what it costs at 128.
"""

import pytest
from transformers import BertConfig, BertModel

from pytest_attncost import ModelSpec


def bert_base():
    return BertModel(BertConfig())


# Below n = 2hd = 1536 the FFN is the larger half of every layer.
@pytest.mark.attncost(n=[128, 512], attention_share_max=0.5, quadratic_share_max=0.5, formula_rtol=0)
def test_bert_base_short_inputs_are_ffn_bound(attncost):
    result = attncost.profile(bert_base)
    assert result.crossover_n == 1536 and result.quadratic_n == 4608


# Past 1536 attention takes over, but the quadratic term still is not the larger part (4608 = 6hd).
@pytest.mark.attncost(n=2048, attention_share_min=0.5, quadratic_share_max=0.5, formula_rtol=0)
def test_bert_base_long_inputs_are_attention_bound(attncost):
    attncost.profile(bert_base)


# "BERT is slow because it is big": 12 layers at 512 tokens are 48.3 GMAC (96.6 GFLOP).
@pytest.mark.attncost(n=512, total_max="48.4 GMAC", attention_max="19.4 G", ffn_max="29 GMAC")
def test_bert_base_budget(attncost):
    result = attncost.profile(bert_base)
    assert result.attention + result.ffn == 48_318_382_080


# The article's table, per layer, to the MAC.
@pytest.mark.parametrize(
    ("n", "sa", "ffn"),
    [(128, 327_155_712, 603_979_776), (512, 1_610_612_736, 2_415_919_104),
     (1536, 7_247_757_312, 7_247_757_312), (4608, 43_486_543_872, 21_743_271_936)],
)
def test_article_table(attncost, n, sa, ffn):
    result = attncost.profile(bert_base, n)
    assert (result.attention // 12, result.ffn // 12) == (sa, ffn)


def test_spec_matches_the_article(attncost):
    result = attncost.profile(bert_base, 128)
    assert result.spec == ModelSpec(hidden=768, heads=12, head_dim=64, layers=12, ffn_dim=3072)
