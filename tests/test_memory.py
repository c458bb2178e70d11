"""Memory beside MACs: the fake-tensor estimate against the real CPU step, the per-layer formula, the marker's
memory bounds (pytester) and the formulas' hand-computed figures."""

import dataclasses
import json

import pytest
import tiny_models
import torch
from torch import nn

from pytest_attncost import (
    ModelSpec,
    ProfileError,
    activation_bytes,
    measure_memory,
    memory_crossover_n,
    model_state_bytes,
    profile,
)
from pytest_attncost.footprint import Memory, attention_matrix_bytes, memory_problems
from pytest_attncost.markers import MarkerError, parse_marker_kwargs

BERT_BASE = ModelSpec(hidden=768, heads=12, head_dim=64, layers=12, ffn_dim=3072)
N, BATCH = 48, 2  # n differs from the head size (64): an n×n matrix and a head's n×d never share a shape


def bert_base(layers=12):
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(num_hidden_layers=layers, attn_implementation="eager"))


# --- the formulas, against numbers written by hand ------------------------------------------------------


def test_per_layer_activation_bytes_by_hand():
    # s=512, b=1, H=768, a=12, fp32 (p=4) with CPU's float dropout masks (m=4)
    assert activation_bytes(BERT_BASE, 512, 1) == 512 * 768 * 72 + 12 * 512 * 512 * 12 == 66_060_288
    # Korthikanti et al.: sbh(34 + 5as/h) at p=2, m=1
    assert activation_bytes(BERT_BASE, 512, 1, p=2, mask=1) == 512 * 768 * 34 + 5 * 12 * 512 * 512
    assert activation_bytes(BERT_BASE, 512, 1, dropout=False) == 16 * 512 * 768 * 4 + 12 * 512 * 512 * 4
    assert activation_bytes(BERT_BASE, 512, 1, dropout=False, fused=True) == 16 * 512 * 768 * 4 + 12 * 512 * 4
    assert attention_matrix_bytes(BERT_BASE, 512, 1, 2 * 2 + 1) == 12 * 512 * 512 * 5  # scores, probs, mask


def test_memory_crossover_is_far_below_the_mac_crossover():
    assert memory_crossover_n(BERT_BASE) == 384  # 64 · 72 / 12: fp32 with float masks
    assert float(memory_crossover_n(BERT_BASE, p=2, mask=1)) == pytest.approx(64 * 34 / 5)  # 6.8 d
    assert memory_crossover_n(BERT_BASE, dropout=False) == 1024  # 16 d
    assert 6 * 12 * 64 == 4608  # the MAC crossover 6hd, twelve times further


def test_model_state_bytes_per_optimizer():
    assert model_state_bytes(1000, "adamw", "foreach") == 5000
    assert model_state_bytes(1000, "adamw", "fused") == 4000
    assert model_state_bytes(1000, "adamw", "single-tensor", largest=300) == 4600
    assert model_state_bytes(1000, "sgd", "foreach") == 2000
    assert model_state_bytes(1000, None) == 1000
    with pytest.raises(ValueError, match="no model-state formula"):
        model_state_bytes(1000, "lion", "foreach")


# --- the estimate against the real step -----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["forward", "train"])
@pytest.mark.parametrize("factory", [lambda: tiny_models.bert_like(attn_implementation="eager"),
                                     lambda: tiny_models.llama_like(attn_implementation="sdpa")],
                         ids=["bert-eager", "llama-sdpa"])
def test_estimate_equals_the_real_cpu_peak(factory, mode):
    measured = measure_memory(factory, N, batch=BATCH, mode=mode)
    assert abs(measured.difference) <= 4096, measured
    assert measured.source == "torch.profiler memory records"
    estimate = measured.estimate
    assert estimate.mask_bytes == 0  # no [2, 1, 48, 48] mask (4,608 B) on either side: see the positions' test below
    assert sum(estimate.at_peak.values()) == estimate.peak
    if mode == "train":
        assert estimate.phase == "optimizer"  # tiny models: AdamW's foreach temporaries top the saved activations
        assert estimate.at_peak["gradients"] == estimate.at_peak["parameters"]


def test_a_parameter_used_twice_sums_its_gradients_in_place_as_on_real_tensors():
    # GPT-2 reads token types through wte as well: autograd adds the second wte gradient into the first in place
    # on real tensors, out of place on fake ones unless the estimate does what the engine does
    measured = measure_memory(tiny_models.gpt2_like, N, batch=BATCH, mode="train", optimizer=None)
    assert measured.difference == 0, measured
    assert measured.estimate.phase == "backward"


def test_the_fast_path_of_torch_transformer_modules_is_a_warning():
    measured = measure_memory(lambda: tiny_models.torch_encoder().eval(), N, batch=BATCH)
    assert measured.difference < 0  # its kernel's own buffers: the estimate is low, and says so
    assert any("_transformer_encoder_layer_fwd ran" in w for w in measured.estimate.warnings)
    result = profile(lambda: tiny_models.torch_encoder().eval(), N, batch=BATCH, memory=True)
    assert any("_transformer_encoder_layer_fwd ran" in w for w in result.warnings)  # --attncost-strict fails it


@pytest.mark.parametrize("factory", [tiny_models.llama_like, tiny_models.gpt2_like], ids=["llama", "gpt2"])
def test_a_decode_step_is_weights_cache_and_activations_to_the_byte(factory):
    measured = measure_memory(factory, 64, mode="decode")
    assert measured.difference == 0, measured
    at_peak = measured.estimate.at_peak
    # the cache: 2 layers x (K, V) x 64 tokens x 2 heads x 64 x 4 bytes
    assert at_peak["kv_cache"] == 2 * 2 * 64 * 128 * 4 == profile(factory, 64, mode="decode").kv_cache_bytes
    assert at_peak["parameters"] == 4 * sum(p.numel() for p in factory().parameters())
    assert measured.estimate.activations == 0


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(256, 256, bias=False)
        self.b = nn.Linear(256, 64, bias=False)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize(("optimizer", "expected"), [
    ("adamw", 5 * 327_680),  # foreach: a temporary of every parameter at once
    (lambda params: torch.optim.AdamW(params, foreach=False), 4 * 327_680 + 2 * 262_144),  # the largest, twice
])
def test_optimizer_peaks_match_the_state_factors(optimizer, expected):
    # parameters 4 · (256·256 + 256·64) = 327,680 B, the largest 262,144 B; two 4-byte step counters
    memory = profile(TwoLinears(), 4, inputs=torch.randn(1, 4, 256), roles={"ffn": ["a", "b"]}, mode="train",
                     memory=True, optimizer=optimizer).memory
    at = memory.at_peak
    assert memory.phase == "optimizer"
    assert at["parameters"] + at["gradients"] + at["optimizer_state"] + at["temporaries"] == expected + 8
    kernel = "foreach" if optimizer == "adamw" else "single-tensor"
    assert model_state_bytes(327_680, "adamw", kernel, largest=262_144) == expected


def test_bert_base_saved_activations_equal_the_per_layer_formula():
    # BERT-base's layers (two of them: the formula is per layer), training with dropout at n=512
    result = profile(lambda: bert_base(layers=2), 512, mode="train", backend="torch", memory=True)
    memory = result.memory
    assert memory.formula["activations"] == 2 * 66_060_288  # the hand figure above, two layers
    assert memory.formula["kind"] == "eager, dropout"
    assert abs(memory.saved_in_layers / memory.formula["activations"] - 1) < 0.01
    assert memory.attention_matrices == memory.formula["attention_matrices"] == 2 * 12 * 512 * 512 * 12
    # the article's claim: the n×n matrices are most of the activation memory, a tenth of the layers' MACs
    assert memory.attention_memory_share > 0.55
    assert result.attention_core / (result.attention + result.ffn) == pytest.approx(0.1, abs=1e-6)
    assert not memory.warnings


def test_a_fused_model_keeps_no_attention_matrix_and_says_so():
    memory = profile(tiny_models.llama_like, N, batch=BATCH, mode="train", memory=True).memory
    assert memory.attention_matrices == 0
    assert memory.attention_memory_share == 0.0
    assert any("keeps no n×n tensor" in note for note in memory.notes)
    problems = memory_problems({"attention_memory_share_min": 0.1}, memory, "at n=48")
    assert len(problems) == 1 and "keeps no n×n tensor" in problems[0]


def test_an_activation_bound_on_a_forward_says_it_bounds_nothing():
    memory = profile(tiny_models.bert_like, N, memory=True).memory
    problems = memory_problems({"attention_memory_share_max": 0.5, "peak_memory_max": 10**9}, memory, "at n=48")
    assert problems == ["attention_memory_share_max: a forward keeps nothing for a backward, so its saved activations "
                        "are 0 and bound nothing; bound a training step (mode='train'), or bound peak_memory"]


def test_memory_round_trips_through_json():
    result = profile(tiny_models.bert_like, N, mode="train", memory=True)
    data = json.loads(json.dumps(result.to_dict()))
    assert Memory.from_dict(data["memory"]) == result.memory
    assert type(result).from_dict(data).memory == result.memory
    assert "memory" not in profile(tiny_models.bert_like, N).to_dict()  # only where it was asked for


def test_a_custom_op_without_a_fake_kernel_fails_clearly():
    @torch.library.custom_op("attncost_test::opaque_gelu", mutates_args=())
    def opaque_gelu(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(16, 16)

        def forward(self, x):
            return opaque_gelu(self.up(x))

    with pytest.raises(ProfileError, match="fake"):
        profile(Block(), 8, inputs=torch.randn(1, 8, 16), roles={"ffn": ["up"]}, memory=True)


def test_measure_memory_refuses_cuda_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: this test is of the message where there is none")
    with pytest.raises(ProfileError, match="no CUDA device"):
        measure_memory(tiny_models.bert_like, N, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: max_memory_allocated needs one")
def test_measure_memory_on_cuda_reads_max_memory_allocated():
    measured = measure_memory(tiny_models.llama_like, N, batch=BATCH, mode="train", device="cuda")
    assert measured.source == "torch.cuda.max_memory_allocated"
    assert measured.peak > 0


# --- the marker -------------------------------------------------------------------------------------------


def test_memory_bounds_parse_sizes_as_the_plugin_does():
    bounds = parse_marker_kwargs((), {"peak_memory_max": "80 GB", "activation_memory_max": "2 GiB",
                                      "attention_memory_share_max": 0.5})
    assert bounds.peak_memory_max == 80 * 10**9 and bounds.activation_memory_max == 2 * 2**30
    assert bounds.has_memory_bounds
    with pytest.raises(MarkerError, match="peak_memory_max"):
        parse_marker_kwargs((), {"peak_memory_max": "80 GBB"})
    with pytest.raises(MarkerError, match="attention_memory_share_min"):
        parse_marker_kwargs((), {"attention_memory_share_min": 1.5})


def test_peak_memory_bound_passes_and_fails_on_bert_base_training_at_4096(project):
    project.makepyfile(test_fit="""
        import pytest
        from transformers import BertConfig, BertModel

        def bert_base():
            return BertModel(BertConfig(attn_implementation="eager"))

        @pytest.mark.attncost(n=4096, mode="train", peak_memory_max="40 GB")
        def test_fits(attncost):
            attncost.profile(bert_base)

        @pytest.mark.attncost(n=4096, mode="train", peak_memory_max="20 GB")
        def test_does_not_fit(attncost):
            attncost.profile(bert_base)
    """)
    result = project.runpytest("-p", "no:randomly", "--attncost-json", "out.json", "--attncost-report")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["memory (estimated on fake tensors with CPU kernels; see docs/memory.md):",
                                 "*test_fits*training step (adamw): peak * GiB (* B) in backward; saved activations*"])
    # 20 GB is 20,000 MB of 10^6 B but 19,073.5 of pytest-memray's 2^20 B; BERT-base has 109,482,240 fp32
    # parameters, so AdamW foreach's model state is 5 · 4 · 109,482,240 B
    result.stdout.fnmatch_lines([
        "attncost: peak_memory was limited to 18.6 GiB (20,000.0 MB of 10^6 B = 19,073.5 pytest-memray MB of 2^20 B) "
        "but the estimate is * GiB (* MB of 10^6 B = * pytest-memray MB of 2^20 B) at n=4096 "
        "(peak in backward: parameters 437,928,960, *saved_activations *the formulas give model state "
        "2,189,644,800 B + saved activations 31,708,938,240 B in the layers)",
    ])
    profiles = json.loads((project.path / "out.json").read_text())["profiles"]
    # per layer 4096·768·72 + 12·4096²·12 = 2,642,411,520 B, twelve layers
    assert [p["memory"]["formula"]["activations"] for p in profiles] == [12 * 2_642_411_520] * 2
    assert all(31_708_938_240 < p["memory"]["peak"] < 40 * 10**9 for p in profiles)


def test_the_cli_prints_the_memory_crossover(capsys):
    from pytest_attncost.cli import main

    assert main(["--preset", "bert-base"]) == 0
    out = capsys.readouterr().out
    # 64 · 72 / 12 = 384 = 6d; fp16 with bool masks 64 · 34 / 5 = 435.2; 16 · 64 without dropout
    assert "n×n activations pass the rest of a layer's at n = 384 = 6d" in out
    assert "435.2 (fp16, bool masks), 1,024 = 16d without dropout" in out
    assert "n=512: 63 MiB" in out  # 66,060,288 B = 63 · 2^20


def test_a_baseline_compares_the_memory_peak():
    from pytest_attncost.baseline import compare

    before = profile(tiny_models.bert_like, N, mode="train", memory=True)
    after = profile(tiny_models.bert_like, 2 * N, mode="train", memory=True, name="BertModel")
    entry = before.to_dict()
    regressions, _ = compare(entry, dataclasses.replace(before, memory=after.memory), 0.0)
    assert [r.part for r in regressions] == ["peak_memory"]
    assert str(regressions[0]).startswith(f"peak_memory {before.memory.peak:,} → {after.memory.peak:,} B (+")
    assert compare(entry, before, 0.0)[0] == []
    assert compare(profile(tiny_models.bert_like, N, mode="train").to_dict(), before, 0.0)[0] == []  # none before


def test_a_mask_transformers_builds_only_on_fake_tensors_is_named():
    def with_mask(n, batch):
        return {"input_ids": torch.zeros(batch, n, dtype=torch.long),
                "attention_mask": torch.ones(batch, n, dtype=torch.long)}

    measured = measure_memory(tiny_models.llama_like, N, batch=BATCH, inputs=with_mask)
    # fake tensors read as tracing: a [2, 1, 48, 48] bool mask the real run (an all-ones mask, sdpa) skips
    assert measured.estimate.mask_bytes == BATCH * N * N == measured.difference
    assert any("[2, 1, 48, 48] bool mask (4,608 B)" in note for note in measured.estimate.notes)
    # without an attention_mask neither run builds one (the next test)
    default = profile(tiny_models.llama_like, N, batch=BATCH, memory=True)
    assert not any("bool mask" in note for note in default.memory.notes)


def test_positions_the_user_gives_are_transformers_to_read():
    # Without an attention_mask transformers looks for packed sequences in the position ids. On fake tensors it
    # cannot read them and took them as packed, building a [2, 1, 48, 48] mask (LLaMA's family since 5.0, BERT's
    # since 5.25) that `model(input_ids)` skips, and the plugin's zero positions read as packed in the real run too:
    # positions the user did not give hold one sequence a row (the test above). Two sequences a row, given: the
    # mask in both runs.
    packed = {"input_ids": torch.zeros(BATCH, N, dtype=torch.long), "use_cache": False,
              "position_ids": torch.arange(N).remainder(N // 2).expand(BATCH, N)}
    measured = measure_memory(tiny_models.llama_like, inputs=packed)
    assert measured.estimate.mask_bytes == BATCH * N * N and measured.difference == 0, measured


class _Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 8)

    def forward(self, x):
        return self.up(x) if bool(x.sum() > 0) else x  # a value read: fake tensors have no value to give


def test_a_forward_that_reads_values_is_refused_with_the_cause_and_where():
    with pytest.raises(ProfileError) as raised:
        profile(_Gated(), 4, inputs=(torch.ones(1, 4, 8),), roles={"ffn": ["up"]}, memory=True)
    message = str(raised.value)
    assert "the memory estimate could not run _Gated on fake tensors" in message
    assert "forward() reads tensor values" in message and "custom op" not in message
    assert "test_memory.py" in message and "bool(x.sum() > 0)" in message  # the user's line
    assert message.endswith("or profile without memory=True")


def test_an_optimizer_of_your_own_runs_in_both_steps():
    def adam_single_tensor(params):
        return torch.optim.Adam(params, foreach=False)

    measured = measure_memory(tiny_models.llama_like, N, batch=BATCH, mode="train", optimizer=adam_single_tensor)
    assert abs(measured.difference) <= 4096, measured
    assert measured.estimate.optimizer == "adam_single_tensor"
    with pytest.raises(ProfileError, match="optimizer= must be"):
        profile(tiny_models.llama_like, N, mode="train", memory=True, optimizer="lion")


def test_an_estimate_is_cached_beside_its_count_for_a_named_optimizer(monkeypatch):
    """The same step asked for again is served, as its count is; another optimizer is another step, and one of your
    own (a callable, which no key can describe) is estimated each time."""
    from pytest_attncost import clear_cache
    from pytest_attncost import memory as memory_mod

    estimated = []
    real = memory_mod.of_profile
    monkeypatch.setattr(memory_mod, "of_profile",
                        lambda *args, **kwargs: estimated.append(kwargs["optimizer"]) or real(*args, **kwargs))

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1)

    def bert():  # eager: transformers 4's sdpa mask asks whether it is all ones, which fake tensors cannot answer
        return tiny_models.bert_like(attn_implementation="eager")

    clear_cache()
    steps = [profile(bert, 24, mode="train", memory=True, optimizer=optimizer)
             for optimizer in ("adamw", "adamw", "sgd", None, None, sgd, sgd)]
    assert estimated == ["adamw", "sgd", None, sgd, sgd]
    adamw, again, *_ = steps
    assert again.memory == adamw.memory and again == adamw
    assert steps[2].memory.peak < adamw.memory.peak  # SGD without momentum keeps no state; AdamW keeps two moments
    forward = profile(bert, 24, memory=True)
    assert forward.memory.mode == "forward" and estimated[-1] is None
