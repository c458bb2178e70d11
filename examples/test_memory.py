"""The article's last word, in numbers: memory, not time, is where attention's square bites first.

Everything is estimated on fake tensors from a factory built on the meta device: BERT-base training at 4096
tokens (tens of GB) costs a few seconds and no memory (see docs/memory.md).
"""

import pytest
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

from pytest_attncost import ModelSpec, memory_crossover_n


def bert_base(layers=12):
    return BertModel(BertConfig(num_hidden_layers=layers, attn_implementation="eager"))


# At n = 512, training with dropout, the n×n matrices are most of BERT-base's activation memory while the
# quadratic term is a tenth of its MACs: far below 2hd = 1536, where attention's MACs pass the FFN's.
@pytest.mark.attncost(n=512, mode="train", attention_memory_share_min=0.55, quadratic_share_max=0.11)
def test_bert_base_attention_matrices_dominate_memory_long_before_they_dominate_macs(attncost):
    result = attncost.profile(bert_base)
    memory = result.memory
    assert memory.attention_memory_share > 5 * result.attention_core / result.total
    assert abs(memory.deviation) < 0.01  # the per-layer formula sbh(16p + 2m) + a·s²·b·(2p + m)


# A sweep of the layers' saved activations finds where the n² term passes the rest: two lengths fix the
# linear and the quadratic coefficient, and they meet at d·(16p + 2m)/(2p + m) = 6d = 384 in fp32 on CPU.
def test_a_sweep_finds_the_memory_crossover(attncost):
    rows = []
    for n in (256, 512):
        memory = attncost.profile(lambda: bert_base(layers=2), n, mode="train", memory=True).memory
        rows.append((n, memory.attention_matrices, memory.saved_in_layers - memory.attention_matrices))
    (n1, square1, rest1), (n2, square2, rest2) = rows
    assert square2 * n1**2 == square1 * n2**2  # the matrices grow as n²
    quadratic, linear = square1 / n1**2, rest1 / n1  # bytes per n², per n
    crossover = linear / quadratic
    spec = ModelSpec(hidden=768, heads=12, head_dim=64, layers=2, ffn_dim=3072)
    assert crossover == pytest.approx(float(memory_crossover_n(spec)), rel=0.01)  # 384
    assert crossover < 6 * 768 / 10  # the MAC crossover 6hd = 4608 is twelve times further


# A decode step's memory beside its MACs: the weights, the KV cache it reads, and one token's activations.
@pytest.mark.attncost(n=1024, mode="decode", peak_memory_max="1 GB", kv_cache_max="80 MB")
def test_gpt2_decode_step_memory(attncost):
    result = attncost.profile(lambda: GPT2LMHeadModel(GPT2Config()))
    at_peak = result.memory.at_peak
    # 12 layers x (K, V) x 1024 tokens x 768 x 4 bytes
    assert at_peak["kv_cache"] == result.kv_cache_bytes == 12 * 2 * 1024 * 768 * 4
    assert at_peak["parameters"] == 4 * 124_439_808  # GPT-2's weights (the head tied to the embeddings)
    # the cache grows 73,728 bytes a token: it outweighs the weights past 497,759,232 / 73,728 = 6,751 tokens
    assert at_peak["parameters"] // (12 * 2 * 768 * 4) == 6751
    assert result.memory.activations == 0  # no grad: nothing kept for a backward
