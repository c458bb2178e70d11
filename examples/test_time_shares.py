"""Measured time beside counted MACs: BERT-base at 128 and 512 tokens on this CPU.

The counts are the article's: attention is 35.1% of BERT-base's attention + FFN MACs at 128
tokens and 40% at 512. The time is this machine's: how much of it attention takes depends on
the kernels (softmax, masking and head reshapes cost time but almost no MACs; a fused attention
kernel is faster per MAC than the projections, or slower). ``attncost.measure()`` runs the real
model (random weights from the factory) under torch.profiler and splits the time with the same
roles as the count. Both shares go to the report, with one line per model where they disagree
most; time is reported, never gated by a baseline (it is noisy).

    pytest examples/test_time_shares.py --attncost-report
"""

import json

import pytest
from transformers import BertConfig, BertModel


def bert_base():
    return BertModel(BertConfig())


# The article's MAC shares, attention / (attention + FFN): 4n(hd)² + 2n²hd over 12n(hd)² + 2n²hd.
MAC_SHARE = {128: 0.3514, 512: 0.4}


@pytest.mark.slow  # real BERT-base forwards, timed: most of a minute on 2 cores
@pytest.mark.attncost(n=[128, 512])
def test_bert_base_time_beside_macs(attncost, record_property):
    timing = attncost.measure(bert_base, repeats=5)
    assert timing.attention_mac_share == pytest.approx(MAC_SHARE[attncost.n], abs=1e-4)
    # Every op is placed; what is left (Python between ops) is its own figure, not hidden.
    assert 0 <= timing.unattributed < timing.traced
    assert 0 < timing.attention_time_share < 1
    record_property("attncost_shares", json.dumps({
        "n": timing.n,
        "attention_mac_share": round(timing.attention_mac_share, 4),
        "attention_time_share": round(timing.attention_time_share, 4),
        "forward_seconds": round(timing.forward, 4),
        "device": timing.device_name,
    }))
