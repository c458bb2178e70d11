"""The device table, the roofline over it and MFU as a marker bound (issue 27, parts 4 and 5), on injected
timings: MFU = the counted FLOPs of a forward / its measured time / the peak."""

from __future__ import annotations

import pytest

from pytest_attncost import devices
from pytest_attncost.markers import MarkerError, check_mfu, parse_marker_kwargs
from pytest_attncost.result import Timing

T = 1e12


@pytest.mark.parametrize(("name", "dtype", "tflops", "bandwidth"), [
    # the vendors' datasheets, dense (2:4 sparsity doubles the tensor-core figures)
    ("h100-sxm", "bf16", 989.4, 3.35e12),
    ("h100-sxm", "fp32", 67, 3.35e12),
    ("h100-pcie", "bf16", 756, 2.0e12),
    ("a100-80gb", "bf16", 312, 2.039e12),
    ("a100-40gb", "tf32", 156, 1.555e12),
    ("l4", "fp16", 121, 300e9),
])
def test_the_table_holds_the_datasheet_figures(name, dtype, tflops, bandwidth):
    device = devices.device(name)
    assert device.peak(dtype) == tflops * T and device.bandwidth == bandwidth
    assert device.source.startswith("NVIDIA")


def test_every_entry_is_consistent():
    for device in devices.DEVICES.values():
        assert device.flops["bf16"] == device.flops["fp16"] >= device.flops["tf32"] > device.flops["fp32"] > 0
        assert 1e11 < device.bandwidth < 1e13


def test_the_roofline_by_hand():
    h100 = devices.device("h100-sxm")
    # ridge: 989.4e12 / 3.35e12 = 295.3 FLOP per byte
    assert h100.ridge("bfloat16") == pytest.approx(295.34, abs=0.01)
    # 1 GFLOP moving 1 MB (1000 FLOP/B) is compute-bound: 1e9 / 989.4e12 s
    assert h100.bound(1e9, 1e6, "bf16") == "compute" and h100.seconds(1e9, 1e6, "bf16") == 1e9 / (989.4 * T)
    # 1 GFLOP moving 100 MB (10 FLOP/B) is memory-bound: 1e8 / 3.35e12 s
    assert h100.bound(1e9, 1e8, "bf16") == "memory" and h100.seconds(1e9, 1e8, "bf16") == 1e8 / 3.35e12


@pytest.mark.parametrize(("peak", "expected"), [
    ("h100-sxm-bf16", (989.4 * T, "H100 SXM bf16's 989.4 TFLOP/s")),
    ("a100-80gb-fp16", (312 * T, "A100 SXM 80GB fp16's 312 TFLOP/s")),
    (2e12, (2e12, "a peak of 2e+12 FLOP/s")),
])
def test_a_peak_by_name_or_number(peak, expected):
    assert devices.peak_flops(peak) == expected


@pytest.mark.parametrize(("peak", "message"), [
    ("h100", "names no dtype"),
    ("h200-bf16", "unknown device 'h200'; known: h100-sxm, h100-pcie, a100-80gb, a100-40gb, l4, cpu"),
    ("l4-fp64", "L4 has no peak for 'fp64' in the table"),
    (0, "positive number of FLOP/s"),
    (True, "positive number of FLOP/s"),
])
def test_a_wrong_peak_is_named(peak, message):
    with pytest.raises(ValueError, match=message):
        devices.peak_flops(peak)


def test_this_cpu_is_measured():
    cpu = devices.this_cpu()
    assert cpu.name.startswith("this CPU") and cpu.source.startswith("measured")
    # any CPU this runs on does between 1 GFLOP/s and 100 TFLOP/s and copies between 100 MB/s and 10 TB/s
    assert 1e9 < cpu.peak("fp32") < 1e14 and 1e8 < cpu.bandwidth < 1e13
    assert devices.device("cpu") is cpu  # measured once a process


# --- MFU on injected timings ---------------------------------------------------------------------------

MACS = {"attention_core": 100 * 10**9, "attention_proj": 100 * 10**9, "ffn": 300 * 10**9, "other": 0}  # 1 TFLOP


def timed(forward: list[float]) -> Timing:
    return Timing.from_samples({"ffn": forward, "forward": forward}, name="BertModel", n=512, macs=MACS)


def test_mfu_passes_and_fails_as_it_should():
    # 1e12 FLOP in a median 1.0 s against 2e12 FLOP/s: MFU 0.5; the spread (median absolute deviation) is 0.05 s,
    # so at best 1e12 / 0.95 / 2e12 = 0.526 -- a bound of 0.52 is within the noise, 0.53 beyond it
    timing = timed([1.0, 0.9, 1.1, 0.95, 1.05])
    assert check_mfu([timing], 0.45, 2e12) == []
    assert check_mfu([timing], 0.52, 2e12) == []
    [message] = check_mfu([timing], 0.53, 2e12)
    assert message == ("MFU 0.500 < mfu_min 0.53 beyond the noise at n=512 on this CPU: 1e+12 model FLOP "
                       "(the exact count of the forward, 2 FLOP per MAC, causal='full') in 1 s "
                       "(median of 5 forwards, spread ±50 ms) = 1e+12 FLOP/s against a peak of 2e+12 FLOP/s")


def test_mfu_against_a_named_peak():
    timing = timed([0.002] * 5)  # 1e12 FLOP in 2 ms: 500 TFLOP/s, MFU 0.505 of an H100's bf16
    assert check_mfu([timing], 0.5, "h100-sxm-bf16") == []
    [message] = check_mfu([timing], 0.6, "h100-sxm-bf16")
    assert message.startswith("MFU 0.505 < mfu_min 0.6") and message.endswith("against H100 SXM bf16's 989.4 TFLOP/s")


def test_mfu_needs_repeats_and_a_timing():
    assert "needs at least 5 repeats" in check_mfu([timed([1.0, 1.0])], 0.1, 2e12)[0]
    assert check_mfu([], 0.1, 2e12) == ["mfu_min: nothing was timed: call attncost.measure(model) in the test body"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mfu_min": 0.3}, "mfu_min and peak go together"),
    ({"peak": "h100-sxm-bf16"}, "mfu_min and peak go together"),
    ({"mfu_min": 1.5, "peak": 1e12}, "mfu_min must be a number in"),
    ({"mfu_min": 0.3, "peak": "b200-bf16"}, "peak: unknown device 'b200'"),
    ({"mfu_min": 0.3, "peak": "cpu-bf16"}, "measured in float32 only"),
])
def test_the_marker_names_a_wrong_mfu_bound(kwargs, message):
    with pytest.raises(MarkerError, match=message):
        parse_marker_kwargs((), kwargs)


def test_the_marker_reads_cpu_without_measuring():
    bounds = parse_marker_kwargs((), {"mfu_min": 0.01, "peak": "cpu-fp32"})
    assert (bounds.mfu_min, bounds.peak) == (0.01, "cpu-fp32")


def test_mfu_min_in_a_test_run(project):
    project.makepyfile(test_mfu="""
        import pytest
        from tiny_models import bert_like

        @pytest.mark.attncost(n=32, mfu_min=0.5, peak=1e3)  # a peak of 1 kFLOP/s: any forward beats half of it
        def test_fast_enough(attncost):
            attncost.measure(bert_like(), repeats=5, warmup=1)

        @pytest.mark.attncost(n=32, mfu_min=0.5, peak="h100-sxm-bf16")  # this CPU is no half an H100
        def test_slow(attncost):
            attncost.measure(bert_like(), repeats=5, warmup=1)
    """)
    result = project.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*attncost: MFU 0.0* < mfu_min 0.5 beyond the noise at n=32 on this CPU: * model FLOP "
                                 "(the exact count of the forward, 2 FLOP per MAC, causal='full') in * "
                                 "against H100 SXM bf16's 989.4 TFLOP/s"])


# --- bytes from the meta trace -------------------------------------------------------------------------------

@pytest.mark.parametrize(("dtype", "size"), [("float32", 4), ("float16", 2)])
def test_bytes_by_hand_on_a_hand_written_model(dtype, size):
    import torch
    from tiny_models import FFN, HAND_ROLES, HEAD_DIM, HEADS, HIDDEN, LAYERS, HandWritten

    from pytest_attncost import profile

    b, n, w, h, d, f = 1, 16, HIDDEN, HEADS, HEAD_DIM, FFN
    as_dtype = getattr(torch, dtype)
    p = profile(lambda: HandWritten().to(as_dtype), n, roles=HAND_ROLES,
                inputs=lambda n, b: (torch.zeros(b, n, w, dtype=as_dtype),))
    assert p.dtype == dtype
    # per layer: x @ Wq, Wk, Wv and out @ Wo each read a [w, w] weight and [n, w], write [n, w]
    proj = (4 * w * w, 4 * 2 * b * n * w)
    # QKᵀ reads q, kᵀ [h, n, d] and writes the scores [h, n, n]; AV reads them and v, writes [h, n, d]
    core = (0, (2 * b * h * n * d + b * h * n * n) + (b * h * n * n + 2 * b * h * n * d))
    # the MLP's two Linears read [f, w] and [w, f] weights (biases are not products), [n, w] and [n, f]
    ffn = (2 * f * w, 2 * b * n * w + 2 * b * n * f)
    assert p.moved == {"attention_core": tuple(LAYERS * size * x for x in core),
                       "attention_proj": tuple(LAYERS * size * x for x in proj),
                       "ffn": tuple(LAYERS * size * x for x in ffn)}
    assert p.moved["attention_proj"] == ((524_288, 131_072) if size == 4 else (262_144, 65_536))
    roofs = {roof.part: roof for roof in p.roofline("h100-sxm", "bf16")}
    assert roofs["ffn"].flops == 2 * p.ffn and roofs["ffn"].bytes == sum(p.moved["ffn"])
    assert roofs["total"].bytes == sum(map(sum, p.moved.values())) and roofs["other"].bound == "-"


@pytest.fixture(scope="module")
def llama_2_7b_bf16():
    def build():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                            num_hidden_layers=32, num_attention_heads=32,
                                            num_key_value_heads=32)).to(torch.bfloat16)

    return build


def test_llama_2_7b_decode_step_at_4096_is_memory_bound_on_an_h100(llama_2_7b_bf16):
    from pytest_attncost import profile

    step = profile(llama_2_7b_bf16, 4096, mode="decode")
    # every weight once, 2 bytes each: 32 layers x (4·D² + 3·D·F) + the head V·D = 6,607,077,376 parameters
    weights = 2 * (32 * (4 * 4096**2 + 3 * 4096 * 11008) + 32000 * 4096)
    assert sum(w for w, _ in step.moved.values()) == weights == 13_214_154_752
    # QKᵀ and AV read the cache: 32 layers x K and V x 32 heads x 4097 keys x 128 x 2 bytes, and more
    assert step.moved["attention_core"][1] > step.kv_cache_bytes == 32 * 2 * 32 * 4096 * 128 * 2
    total = step.roofline("h100-sxm")[-1]
    assert total.intensity < 1.01 and total.bound == "memory"  # ~1 FLOP/B against a ridge of 295
    assert total.seconds == total.bytes / 3.35e12


def test_llama_2_7b_prefill_at_4096_is_compute_bound_on_an_h100(llama_2_7b_bf16):
    from pytest_attncost import profile

    total = profile(llama_2_7b_bf16, 4096).roofline("h100-sxm")[-1]
    assert total.intensity > 1000 and total.bound == "compute"
    assert total.seconds == total.flops / (989.4 * T)


def test_norms_write_no_bytes_only_products_do():
    from tiny_models import HIDDEN, bert_like

    from pytest_attncost import profile

    p = profile(bert_like, 16)
    # other: the pooler's one product, [1, D] @ [D, D] -> [1, D] in float32; the LayerNorms' outputs are not in
    assert p.moved["other"] == (HIDDEN * HIDDEN * 4, 2 * HIDDEN * 4)
