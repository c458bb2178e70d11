"""Two counters: fvcore (jit trace) and torch's FlopCounterMode (dispatcher; meta tensors, else fake ones)."""

import json

import pytest
import tiny_models as tm
import torch
from test_counting import expected
from torch import nn

from pytest_attncost import ProfileError, profile

D, H, DH, F, L = tm.HIDDEN, tm.HEADS, tm.HEAD_DIM, tm.FFN, tm.LAYERS


def parts(result):
    return result.attention_core, result.attention_proj, result.ffn


def test_backends_agree_on_vit_and_torch_modules():
    from transformers import ViTConfig, ViTModel

    vit = ViTModel(ViTConfig(hidden_size=D, num_attention_heads=H, num_hidden_layers=L, intermediate_size=F,
                             image_size=128, patch_size=16))
    assert parts(profile(vit)) == parts(profile(vit, backend="torch")) == expected(65, 1)
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(D, H, F, batch_first=True), L)
    for model, shape in ((tm.torch_encoder(), {}), (decoder, {"cross_m": None}),
                         (nn.MultiheadAttention(D, H), {"layers": 1, "ffn": 0})):
        for n in (128, 2048):
            want = expected(n, 1, **{**shape, "cross_m": n} if "cross_m" in shape else shape)
            assert parts(profile(model, n)) == parts(profile(model, n, backend="torch")) == want


class _CopiesToTheCpu(nn.Module):
    """Runs on fake tensors (a fake copy on the CPU) but not on bare meta ones (a meta tensor cannot be copied),
    after building a table on its first call: the failed run on meta tensors builds it on the twin it ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.table = None

    def forward(self, x):
        if self.table is None:
            self.table = torch.ones(4, 8, device=x.device) @ torch.ones(8, 8, device=x.device)
        return self.lin(x.cpu().to(x.device)) + self.table


def test_the_torch_backend_counts_on_meta_tensors_and_on_fake_ones_where_those_cannot_run(monkeypatch):
    """Fake tensors dispatch every op in Python (twice the time of the meta kernels alone): the torch backend makes
    none where the twin's meta tensors run the model, in forward, train and one-run sweeps alike."""
    from torch._subclasses import fake_tensor

    from pytest_attncost import one_run
    from pytest_attncost.api import sweep

    made = []
    init = fake_tensor.FakeTensorMode.__init__
    monkeypatch.setattr(fake_tensor.FakeTensorMode, "__init__",
                        lambda self, *args, **kwargs: made.append(1) or init(self, *args, **kwargs))
    forward = profile(tm.bert_like, 16, backend="torch")
    train = profile(tm.bert_like, 16, mode="train")
    swept = sweep(tm.llama_like, [16, 40], backend="torch")
    assert made == [] and swept.one_run == one_run.POSSIBLE  # torch before 2.9: a sweep counts length by length
    assert parts(forward) == expected(16, 1) and parts(train) == tuple(3 * x for x in expected(16, 1))
    assert parts(swept[1]) == parts(profile(tm.llama_like, 40, backend="torch"))
    # the same count on fake tensors, from a fresh twin, where the meta ones fail: 2 x 4 tokens through one 8 x 8
    # Linear, and the table (4 x 8 @ 8 x 8) built again, as a count that never tried meta tensors builds it
    counted = profile(_CopiesToTheCpu(), 4, inputs=(torch.zeros(2, 4, 8),), roles={"ffn": ["lin"]}, backend="torch")
    assert (counted.ffn, counted.other, counted.fallback) == (2 * 4 * 8 * 8, 4 * 8 * 8, None) and made


def test_hand_written_attention_agrees():
    model, x = tm.HandWritten(), torch.zeros(1, 96, D)
    fv = profile(model, inputs=(x,), roles=tm.HAND_ROLES)
    th = profile(model, inputs=(x,), roles=tm.HAND_ROLES, backend="torch")
    assert parts(fv) == parts(th) == expected(96, 1)


def test_train_mode_is_three_forwards_on_bert_base():
    from transformers import BertConfig, BertModel

    def bert_base():
        return BertModel(BertConfig())

    forward = profile(bert_base, 128, backend="torch")
    train = profile(bert_base, 128, mode="train")
    assert (train.backend, train.mode) == ("torch", "train")  # asking for train switches backends
    assert parts(train) == tuple(3 * p for p in parts(forward))
    # the encoder's matrix products, to the MAC: 12 layers * (SA 327,155,712 + FFN 603,979,776) * 3
    assert 3 * (327_155_712 + 603_979_776) * 12 == train.attention + train.ffn
    assert train.by_module["encoder"] == 3 * forward.by_module["encoder"]
    assert train.deviation == 0 and train.formula.attention_core == 3 * forward.formula.attention_core


def test_causal_half_on_gpt2():
    for impl in ("sdpa", "eager"):
        model = tm.gpt2_like(attn_implementation=impl)
        for backend in ("fvcore", "torch"):
            n = 128
            full = profile(model, n, backend=backend)
            half = profile(model, n, backend=backend, causal="half")
            # L layers * (QK^T + AV) over n(n+1)/2 pairs: 2 * 2 * h * d * n(n+1)/2
            assert half.attention_core == L * 2 * H * DH * n * (n + 1) // 2 * 2 // 2 * 1 == 4_227_072
            assert full.attention_core == L * 2 * H * DH * n * n
            assert half.attention_proj == full.attention_proj and half.ffn == full.ffn
            assert (half.causal, half.causal_applied, half.deviation) == ("half", True, 0)


def test_causal_half_leaves_bidirectional_and_cross_attention_alone():
    bert = profile(tm.bert_like(), 64, causal="half")
    assert not bert.causal_applied and bert.attention_core == expected(64, 1)[0]
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(D, H, F, batch_first=True), L)
    assert profile(decoder, 64, causal="half").attention_core == expected(64, 1, cross_m=64)[0]


def test_fallback_for_untraceable_models():
    class Checked(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(D, H, F, batch_first=True)

        def forward(self, x):
            if not torch.isfinite(x).all():  # reads values: neither the tracer nor fake tensors can
                raise ValueError("non-finite input")
            return self.layer(x)

    result = profile(Checked(), inputs=(torch.zeros(1, 32, D),))
    assert result.backend == "torch" and result.fallback.startswith("fvcore could not trace Checked")
    assert parts(result) == expected(32, 1, layers=1)
    with pytest.raises(ProfileError, match="could not trace Checked"):
        profile(Checked(), inputs=(torch.zeros(1, 32, D),), fallback=False)
    with torch.device("meta"):
        on_meta = Checked()
    with pytest.raises(ProfileError, match=r"(?s)real tensors were not tried: the model lives on the meta device\."
                                           r"\nFix: pass the model built on the CPU \(not a factory, not on meta\)"):
        profile(on_meta, inputs=(torch.zeros(1, 32, D),))
    # the same model, built on the CPU as the message says: counted on real tensors
    assert parts(profile(Checked(), inputs=(torch.zeros(1, 32, D),))) == expected(32, 1, layers=1)


def test_bad_backend_options():
    with pytest.raises(ProfileError, match="backend= must be one of fvcore, torch, got 'tf'"):
        profile(tm.torch_encoder(), 16, backend="tf")
    with pytest.raises(ProfileError, match="mode= must be one of forward, train"):
        profile(tm.torch_encoder(), 16, mode="inference")
    with pytest.raises(ProfileError, match="causal= must be one of full, half"):
        profile(tm.torch_encoder(), 16, causal="quarter")


CROSS_SUITE = """
import pytest
from tiny_models import bert_like, gpt2_like

@pytest.mark.attncost(n=128, crosscheck=True)
def test_bert(attncost):
    attncost.profile(bert_like)

def test_gpt2(attncost):
    attncost.profile(gpt2_like, 128, causal="half")
"""


def test_crosscheck_agrees_and_reports(project):
    project.makepyfile(test_suite=CROSS_SUITE)
    result = project.runpytest("--attncost-report", "--attncost-json=out.json")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([
        "*verdict",
        "test_suite.py::test_bert * BertModel * yes * ok",
        "test_suite.py::test_gpt2 * GPT2Model (causal half) * - * -",
        "cross-check (attention_core, attention_proj, ffn must agree; other may differ):",
        "  test_suite.py::test_bert [[]BertModel[]]: agree; other fvcore 425,984 vs torch 16,384 MAC",
    ])
    rows = json.loads((project.path / "out.json").read_text())["profiles"]
    assert rows[0]["crosscheck"]["agree"] is True and rows[0]["backend"] == "fvcore"
    assert (rows[1]["causal"], rows[1]["causal_applied"], rows[1]["mode"]) == ("half", True, "forward")
    assert {"torch", "fvcore", "pytest-attncost"} <= set(rows[0]["versions"])
    everything = project.runpytest("--attncost-crosscheck", "--attncost-report")
    everything.stdout.fnmatch_lines(["test_suite.py::test_gpt2 * GPT2Model (causal half) * yes * -"])


def test_crosscheck_disagreement_fails_with_both_numbers(project):
    project.makeconftest("""
        import pytest
        import pytest_attncost.counting as counting
        from pytest_attncost import clear_cache

        @pytest.fixture(autouse=True)
        def doubled_sdpa(monkeypatch):
            # a broken handle: fvcore now counts fused attention twice
            original = counting.jit.EXTRA_HANDLES["aten::scaled_dot_product_attention"]
            monkeypatch.setitem(counting.jit.EXTRA_HANDLES, "aten::scaled_dot_product_attention",
                                lambda i, o: 2 * original(i, o))
            clear_cache()
            yield
            clear_cache()
    """)
    project.makepyfile(test_suite=CROSS_SUITE)
    result = project.runpytest("--attncost-report")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*backends disagree on attention_core: fvcore 16,777,216 vs torch 8,388,608 MAC (formula 8,388,608)*",
        "test_suite.py::test_bert * NO * FAIL",
    ])


def test_ini_backend_and_strict_fallback(project):
    project.makeini("[pytest]\nattncost_backend = torch\n")
    project.makepyfile(test_suite="""
        import torch
        from torch import nn
        from tiny_models import bert_like

        class Checked(nn.Module):
            def __init__(self):
                super().__init__()
                self.attn = nn.MultiheadAttention(128, 2, batch_first=True)

            def forward(self, x):
                assert torch.isfinite(x).all()
                return self.attn(x, x, x)[0]

        def test_ini(attncost):
            assert attncost.profile(bert_like, 64).backend == "torch"

        def test_fallback(attncost):
            result = attncost.profile(Checked(), inputs=(torch.zeros(1, 8, 128),), backend="fvcore")
            assert result.fallback
    """)
    project.runpytest().assert_outcomes(passed=2)
    result = project.runpytest("--attncost-strict", "--attncost-report")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*counted by the torch backend because fvcore could not trace the model (fvcore could not trace Checked*",
        "*Checked (torch fallback)*",
    ])
    bad = project.runpytest("--attncost-backend=tf")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
