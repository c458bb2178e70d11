"""measure(): real forwards timed with torch.profiler and split with profile()'s roles (issue 17).

Lines are tested on injected timings (deterministic; the time bounds over them are in test_markers);
real timing is asserted only where it must be (op times add up to the forward; a slowed FFN shifts
the share), with margins wide enough for a busy 2-core machine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pytest_attncost import api, families, profile
from pytest_attncost import roles as roles_mod
from pytest_attncost.api import measure, measure_sweep
from pytest_attncost.counting import count_forward_torch, meta_twin
from pytest_attncost.errors import TimingError
from pytest_attncost.formulas import ModelSpec
from pytest_attncost.plots import plot_time_shares
from pytest_attncost.result import PARTS, Timing
from pytest_attncost.series import TimingSweep
from pytest_attncost.timing import _event_tree, _op_macs, _Placement, _split_repeat

# --- injected timings: bounds, lines, JSON ---------------------------------------------------

BERT_512_MACS = {"attention_core": 2, "attention_proj": 2, "ffn": 6, "other": 0}  # MAC share 0.4


def timing(attention: list[float], ffn: list[float], *, n: int = 512, name: str = "BertModel",
           macs: dict[str, int] | None = None, device: str = "cpu") -> Timing:
    """Attention time split evenly between core and projections; other = 0."""
    return Timing.from_samples(
        {"attention_core": [a / 2 for a in attention], "attention_proj": [a / 2 for a in attention], "ffn": ffn},
        name=name, n=n, macs=macs or BERT_512_MACS, device=device,
        device_name="NVIDIA H200" if device != "cpu" else "x",
    )


def shares(values: list[float]) -> Timing:
    """A timing whose per-repeat attention time shares are *values* (attention + ffn = 1 s)."""
    return timing(values, [1 - v for v in values])


def test_from_samples_totals() -> None:
    t = Timing.from_samples(
        {"attention_core": [1, 2], "attention_proj": [1, 1], "ffn": [2, 3], "other": [0, 1], "traced": [5, 8]})
    assert t.repeats == 2
    assert t.values("attributed") == (4, 7)
    assert t.values("unattributed") == (1, 1)
    assert t.values("forward") == (5, 8)  # defaults to the traced time
    assert t.values("attention") == (2, 3)
    assert t.attention == 2.5 and t.traced == 6.5


def test_shares_are_medians_of_per_repeat_shares() -> None:
    t = shares([0.5, 0.6, 0.58, 0.9, 0.59])
    assert t.attention_time_share == pytest.approx(0.59)
    # spread: the median absolute deviation, so the 0.9 outlier does not widen it
    assert t.spread("attention_time_share") == pytest.approx(0.01)
    assert t.attention_mac_share == pytest.approx(0.4)
    assert t.quadratic_time_share == pytest.approx(0.295)


def test_json_is_plain_and_round_trips() -> None:
    t = timing([0.4, 0.5, 0.45, 0.47, 0.46], [0.6] * 5)
    data = json.loads(json.dumps(t.to_dict(), allow_nan=False))
    assert data["attention_time_share"] == pytest.approx(t.attention_time_share)
    assert data["attention_mac_share"] == pytest.approx(0.4)
    assert data["seconds"]["attention"] == pytest.approx(0.46)
    assert data["macs_per_second"]["ffn"] == pytest.approx(6 / 0.6)
    assert data["macs_per_second"]["other"] is None  # no time: no rate (never infinity)
    assert Timing.from_dict(data) == t


def test_sweep_crossover_interpolates_the_time_share() -> None:
    spec = ModelSpec(hidden=768, heads=12, head_dim=64, layers=12, ffn_dim=3072)
    sweep = TimingSweep([timing([0.45] * 5, [0.55] * 5, n=512), timing([0.3] * 5, [0.7] * 5, n=128),
                         timing([0.65] * 5, [0.35] * 5, n=1024)], spec)
    assert sweep.lengths == [128, 512, 1024]
    # 0.45 at 512, 0.65 at 1024: 0.5 is a quarter of the way
    assert sweep.crossover() == pytest.approx(640)
    assert sweep.formula_crossover() == 1536  # 2hd
    assert sweep.mac_crossover() is None  # the injected MAC share is 0.4 throughout
    assert json.dumps(sweep.to_dict(), allow_nan=False)
    assert TimingSweep([timing([0.3] * 5, [0.7] * 5)]).crossover() is None


# --- placing one op --------------------------------------------------------------------------

ROLES = {"layers.0": "ffn", "layers.0.attn": "attention"}
PLACEMENT = _Placement(ROLES, False, {"layers.0.attn.q": frozenset({(8, 8)}), "layers.0.attn": frozenset({(8, 8)}),
                                      "layers.0.mlp": frozenset({(32, 8), (8, 32)})},
                       {"layers.0.attn": frozenset({(4, 4)})})


@pytest.mark.parametrize(
    ("op", "scope", "shapes", "part"),
    [
        ("aten::linear", "layers.0.attn.q", [[1, 4, 8], [8, 8], [8]], "attention_proj"),
        ("aten::matmul", "layers.0.attn", [[1, 4, 8], [8, 8]], "attention_proj"),  # a parameter used inline
        ("aten::matmul", "layers.0.attn", [[1, 2, 4, 4], [1, 2, 4, 4]], "attention_core"),  # QK^T
        ("aten::matmul", "layers.0.attn", [[1, 4, 4], [4, 4]], "other"),  # a buffer (rotary table)
        ("aten::scaled_dot_product_attention", "layers.0.attn", [[1, 2, 4, 4]] * 3, "attention_core"),
        ("aten::softmax", "layers.0.attn", [[1, 2, 4, 4]], "attention_core"),  # the non-projection part
        ("aten::linear", "layers.0.mlp", [[1, 4, 8], [32, 8], [32]], "ffn"),
        ("aten::gelu", "layers.0.mlp", [[1, 4, 32]], "ffn"),
        ("aten::layer_norm", "layers.0", [[1, 4, 8]], "ffn"),
        ("aten::bmm", "layers.0.mlp", [[2, 4, 4], [2, 4, 4]], "other"),  # unplaced, as in the count
        ("aten::scaled_dot_product_attention", "pool", [[1, 2, 4, 4]] * 3, "other"),  # attention-pooling head
        ("aten::embedding", "embed", [[100, 8], [1, 4]], "other"),
    ],
)
def test_placement_follows_the_split(op: str, scope: str, shapes: list, part: str) -> None:
    assert PLACEMENT.part(op, scope, shapes) == part


class FakeEvent:
    """A kineto event as the profiler's raw results give it (times in ns)."""

    def __init__(self, name: str, start: int, end: int, *, device: str = "CPU", corr: int = 0, linked: int = 0,
                 shapes: list | None = None, thread: int = 7) -> None:
        from torch._C._autograd import DeviceType

        self._name, self._start, self._end, self._corr, self._linked = name, start, end, corr, linked
        self._device, self._shapes, self._thread = getattr(DeviceType, device), shapes or [], thread

    def name(self) -> str: return self._name
    def start_ns(self) -> int: return self._start
    def end_ns(self) -> int: return self._end
    def duration_ns(self) -> int: return self._end - self._start
    def start_thread_id(self) -> int: return self._thread
    def end_thread_id(self) -> int: return self._thread
    def device_type(self): return self._device  # noqa: ANN201
    def correlation_id(self) -> int: return self._corr
    def linked_correlation_id(self) -> int: return self._linked
    def is_async(self) -> bool: return False
    def shapes(self) -> list: return self._shapes


class FakeProfiler:
    def __init__(self, events: list[FakeEvent]) -> None:
        self.profiler = type("P", (), {"kineto_results": type("R", (), {"events": lambda self: events})()})()


def test_event_tree_places_kernels_on_the_ops_that_launched_them() -> None:
    q = [[1, 2, 4, 4]]
    events = [
        FakeEvent("attncost.repeat:0", 0, 100),
        FakeEvent("attncost.module:", 1, 99),
        FakeEvent("attncost.module:layers.0.attn", 5, 60),
        FakeEvent("attncost.module:layers.0.attn.q", 8, 22),
        FakeEvent("aten::linear", 10, 20, corr=5, shapes=[[1, 4, 8], [8, 8], [8]]),
        FakeEvent("aten::addmm", 12, 18, corr=6),
        FakeEvent("cudaLaunchKernel", 13, 14, corr=60, linked=6),  # the runtime call: not an op
        FakeEvent("gemm_kernel", 50, 57, device="CUDA", linked=6),  # 7 ns on the device
        FakeEvent("aten::scaled_dot_product_attention", 30, 40, corr=7, shapes=q * 3),
        FakeEvent("aten::_flash_attention", 31, 39, corr=8),
        FakeEvent("flash_kernel", 60, 71, device="CUDA", linked=8),  # 11 ns
        FakeEvent("aten::softmax", 41, 45, corr=9),  # no kernel: 0 device time
        FakeEvent("aten::gelu", 70, 75, corr=10),  # outside the layers: other
        FakeEvent("aten::mm", 200, 300, corr=11, thread=8),  # another thread: not the model's
    ]
    [repeat] = _event_tree(FakeProfiler(events))
    on_gpu = _split_repeat(repeat, PLACEMENT, device_time=True)
    assert on_gpu[0] == {"attention_core": 11e-9, "attention_proj": 7e-9, "ffn": 0.0, "other": 0.0}
    on_cpu = _split_repeat(repeat, PLACEMENT, device_time=False)
    assert on_cpu[0] == pytest.approx({"attention_core": 14e-9, "attention_proj": 10e-9, "ffn": 0.0, "other": 5e-9})
    assert on_cpu[1] == pytest.approx({"layers.0.attn.q": 10e-9, "layers.0.attn": 14e-9, "": 5e-9})
    # timed MACs from the shapes: q [1, 4, 8] @ [8, 8]; sdpa 2 heads x 4 x 4 x (4 + 4)
    assert on_cpu[2] == {"attention_core": 2 * 4 * 4 * 8, "attention_proj": 4 * 8 * 8, "ffn": 0, "other": 0}


def test_op_macs_from_shapes() -> None:
    assert _op_macs("aten::linear", [[2, 5, 8], [32, 8], [32]]) == 2 * 5 * 8 * 32
    assert _op_macs("aten::matmul", [[2, 3, 5, 8], [2, 3, 8, 5]]) == 2 * 3 * 5 * 8 * 5
    assert _op_macs("aten::matmul", [[2, 5, 8], [8, 16]]) == 2 * 5 * 8 * 16  # broadcast weight
    assert _op_macs("aten::addmm", [[16], [5, 8], [8, 16]]) == 5 * 8 * 16
    # q [1, 2, 5, 8], k [1, 2, 7, 8], v [1, 2, 7, 8]: per query head 5 * 7 * (8 + 8)
    assert _op_macs("aten::scaled_dot_product_attention", [[1, 2, 5, 8], [1, 2, 7, 8], [1, 2, 7, 8]]) == (
        2 * 5 * 7 * 16)
    assert _op_macs("aten::einsum", [[], [[2, 3], [3, 4]]]) is None


# --- real forwards on the CPU ----------------------------------------------------------------

# BERT-base-shaped and LLaMA-shaped, small enough for a test, large enough that the ops (not
# Python) take the forward's time: 2 layers, hidden 256, 4 heads of 64, at n=1024 (at 512, Python
# between the ops of a 2-core machine took up to 11% of the traced forward; at 1024 about 5%).
N = 1024


def bert_small() -> nn.Module:
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(hidden_size=256, num_attention_heads=4, num_hidden_layers=2, intermediate_size=1024,
                                max_position_embeddings=N, vocab_size=1000))


def llama_small() -> nn.Module:
    from transformers import LlamaConfig, LlamaModel

    return LlamaModel(LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                  intermediate_size=688, vocab_size=1000))


def _expected_roles(model: nn.Module, n: int) -> dict[str, str]:
    """Roles recomputed independently: the torch backend's count of a meta twin, then find_structure."""
    twin = meta_twin(model)
    args, kwargs = api.default_inputs(model, n, 1)
    raw = count_forward_torch(twin, args, kwargs)
    containers = [name for name, m in twin.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    return roles_mod.find_structure(raw.records, containers, families.experts_of(twin)).roles()


@pytest.fixture(scope="module")
def timed() -> dict[str, tuple[nn.Module, Timing]]:
    out = {}
    for factory in (bert_small, llama_small):
        torch.manual_seed(0)
        model = factory()
        out[factory.__name__] = (model, measure(model, N, threads=1, warmup=1, repeats=5))
    return out


@pytest.mark.parametrize("which", ["bert_small", "llama_small"])
def test_parts_add_up_to_the_forward(timed: dict[str, tuple[nn.Module, Timing]], which: str) -> None:
    _, t = timed[which]
    # the remainder is reported, not hidden: per repeat, parts + unattributed = the traced forward
    for i in range(t.repeats):
        assert sum(t.samples[p][i] for p in PARTS) == pytest.approx(t.samples["attributed"][i])
        assert t.samples["attributed"][i] + t.samples["unattributed"][i] == pytest.approx(t.samples["traced"][i])
    # The ops cover at least 90% of the forward. Judged on the least disturbed repeat: a busy
    # machine only adds time between ops (a preempted Python gap), it never takes op time away.
    coverage = [a / b for a, b in zip(t.samples["attributed"], t.samples["traced"])]
    assert max(coverage) >= 0.9, (coverage, t.to_dict()["seconds"])
    assert all(0 < c <= 1.001 for c in coverage) and t.unattributed >= 0
    assert all(t.median(p) > 0 for p in ("attention_core", "attention_proj", "ffn"))
    assert t.forward > 0 and t.clock == "wall" and t.device == "cpu" and t.dtype == "float32"
    assert "CPU, 1 thread" in t.device_name
    assert 0 < t.attention_time_share < 1 and t.macs_per_second("ffn") > 0
    json.dumps(t.to_dict(), allow_nan=False)


@pytest.mark.parametrize("which", ["bert_small", "llama_small"])
def test_roles_are_the_ones_profile_uses(timed: dict[str, tuple[nn.Module, Timing]], which: str) -> None:
    model, t = timed[which]
    counted = profile(model, N)
    expected = _expected_roles(model, N)
    for name, _ in model.named_modules():  # module by module
        assert roles_mod.role_of(name, t.roles) == roles_mod.role_of(name, expected), name
    # the timed products landed in the parts where profile() put their MACs
    assert t.timed_macs["attention_core"] == counted.attention_core
    assert t.timed_macs["attention_proj"] == counted.attention_proj
    assert t.timed_macs["ffn"] == counted.ffn
    assert t.macs == {p: getattr(counted, p) for p in PARTS}
    assert t.profile is not None and t.profile.to_dict() == counted.to_dict()  # for the fixture to record
    assert not [note for note in t.notes if "the timed run multiplied" in note or "could not be read" in note]
    assert t.by_module and set(t.by_module) <= {name for name, _ in model.named_modules()}


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(out.transpose(1, 2).reshape(b, n, w))


class MLP(nn.Module):
    """An FFN that can repeat its work: the deliberately slowed FFN."""

    def __init__(self, width: int, repeat: int) -> None:
        super().__init__()
        self.up, self.down, self.repeat = nn.Linear(width, 4 * width), nn.Linear(4 * width, width), repeat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.repeat):
            out = self.down(nn.functional.gelu(self.up(x)))
        return out


class Block(nn.Module):
    def __init__(self, width: int, heads: int, repeat: int) -> None:
        super().__init__()
        self.attn, self.mlp = Attention(width, heads), MLP(width, repeat)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Stack(nn.Module):
    def __init__(self, width: int = 128, heads: int = 2, layers: int = 2, repeat: int = 1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, heads, repeat) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_slowed_ffn_shifts_the_time_share() -> None:
    inputs = lambda n, batch: (torch.randn(batch, n, 256),)  # noqa: E731
    normal = measure(lambda: Stack(width=256, heads=4, repeat=1), 128, inputs=inputs, threads=1, repeats=9)
    slowed = measure(lambda: Stack(width=256, heads=4, repeat=10), 128, inputs=inputs, threads=1, repeats=5)
    # 10x the FFN's work, the attention unchanged. Compared on each part's fastest repeat (a busy
    # machine only adds time), with margins: the FFN's time grows, the attention's share shrinks.
    fastest = lambda t, part: min(t.values(part))  # noqa: E731
    share = lambda t: fastest(t, "attention") / (fastest(t, "attention") + fastest(t, "ffn"))  # noqa: E731
    assert fastest(slowed, "ffn") > 4 * fastest(normal, "ffn"), (normal, slowed)
    assert share(slowed) < share(normal) / 2, (normal, slowed)
    assert slowed.attention_time_share < 0.25 < normal.attention_mac_share  # the median's share moved too
    # the roles come from the structure: attn is attention, the rest of each block FFN
    assert slowed.roles == {"blocks.0": "ffn", "blocks.0.attn": "attention", "blocks.1": "ffn",
                            "blocks.1.attn": "attention"}
    assert slowed.timed_macs["ffn"] == 10 * normal.timed_macs["ffn"] == slowed.macs["ffn"]


def test_the_model_is_untouched() -> None:
    torch.manual_seed(1)
    model = Stack(width=64, heads=2, layers=1).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls: list[int] = []
    model.blocks[0].register_forward_hook(lambda *a: calls.append(1))
    hooks = [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in model.modules()]
    x = torch.randn(1, 16, 64)
    rng = torch.random.get_rng_state()
    threads = torch.get_num_threads()
    t = measure(model, 16, inputs=(x,), repeats=1, warmup=0, threads=1)
    assert t.repeats == 1 and calls == []  # the user's hooks are not copied into the timed run
    assert all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in model.modules()] == hooks
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert torch.get_num_threads() == threads
    assert next(model.parameters()).device.type == "cpu"


def test_measure_counts_once_and_builds_its_inputs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile carries the role map it was split with: timing places time with it, no second count."""
    import tiny_models

    from pytest_attncost import cache, counting

    calls: dict[str, int] = {"count": 0, "backend": 0, "inputs": 0}

    def counted(name: str, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(counting, "count", counted("count", counting.count))
    monkeypatch.setattr(counting, "count_forward", counted("backend", counting.count_forward))
    monkeypatch.setattr(counting, "count_forward_torch", counted("backend", counting.count_forward_torch))
    monkeypatch.setattr(families, "default_inputs", counted("inputs", families.default_inputs))
    model = tiny_models.bert_like()
    cache.clear_cache()
    t = measure(model, 16, repeats=1, warmup=0, threads=1)
    assert calls == {"count": 1, "backend": 1, "inputs": 1}
    assert t.roles == t.profile.roles and t.macs["ffn"] == t.profile.ffn
    measure(model, 16, repeats=1, warmup=0, threads=1)  # the profile from the cache: no count, inputs built once
    assert calls == {"count": 1, "backend": 1, "inputs": 2}


def test_measure_with_user_roles_and_dtype() -> None:
    model = Stack(width=64, heads=2, layers=1)
    roles = {"attention": ["blocks.*.attn"], "ffn": ["blocks.*.mlp"]}
    t = measure(model, 16, inputs=lambda n, b: (torch.randn(b, n, 64),), roles=roles, repeats=1, warmup=0,
                dtype=torch.float64, threads=1)
    assert t.roles == {"blocks.0.attn": "attention", "blocks.0.mlp": "ffn"}
    assert t.dtype == "float64" and t.n == 16
    assert t.timed_macs["ffn"] == t.macs["ffn"] and t.timed_macs["attention_core"] == t.macs["attention_core"]


def test_measure_sweep_records_both_shares() -> None:
    sweep = measure_sweep(lambda: Stack(width=64, heads=2, layers=1), [16, 64],
                          inputs=lambda n, b: (torch.randn(b, n, 64),), repeats=1, warmup=0, threads=1)
    data = json.loads(json.dumps(sweep.to_dict(), allow_nan=False))
    assert data["lengths"] == [16, 64]
    assert [row["n"] for row in data["timings"]] == [16, 64]
    assert all(0 <= row["attention_time_share"] <= 1 for row in data["timings"])
    assert data["formula_crossover_n"] == 2 * 64  # a hand-written model: its spec inferred from the trace, 2hd
    # MACs: solved exactly from the profiles, (8 - 4) * 64² / (2 * 64) = 128, beyond the lengths timed
    assert data["mac_crossover_n"] == 128


def test_plot_time_shares(tmp_path: Path) -> None:
    spec = ModelSpec(hidden=768, heads=12, head_dim=64, layers=12, ffn_dim=3072)
    sweep = TimingSweep([timing([0.3] * 5, [0.7] * 5, n=128), timing([0.6] * 5, [0.4] * 5, n=2048)], spec)
    paths = plot_time_shares(sweep.to_dict(), tmp_path, "bert")
    assert [p.name for p in paths] == ["bert-time-shares.png", "bert-time-shares.svg"]
    assert "n=1,536" in (tmp_path / "bert-time-shares.svg").read_text()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"repeats": 0}, "repeats must be an int >= 1"),
        ({"warmup": -1}, "warmup must be an int >= 0"),
        ({"threads": 0}, "threads must be a positive int"),
        ({"dtype": "half"}, "dtype= must be a torch.dtype"),
        ({"device": "tpu"}, "not a torch device|runs on 'cpu' or 'cuda'"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(TimingError, match=message):
        measure(lambda: Stack(width=64, layers=1), 16, inputs=lambda n, b: (torch.randn(b, n, 64),), **kwargs)


def test_a_meta_model_has_no_weights_to_run() -> None:
    with torch.device("meta"):
        model = Stack(width=64, layers=1)
    with pytest.raises(TimingError, match="lives on the meta device"):
        measure(model, 16, inputs=(torch.randn(1, 16, 64),))


def test_cuda_without_a_gpu_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TimingError, match="no CUDA device is available"):
        measure(lambda: Stack(width=64, layers=1), 16, inputs=lambda n, b: (torch.randn(b, n, 64),), device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_times() -> None:
    t = measure(bert_small, N, device="cuda", repeats=5)
    counted = profile(bert_small, N)
    assert t.device.startswith("cuda:") and t.clock == "device" and t.device_name
    assert all(t.median(p) > 0 for p in ("attention_core", "attention_proj", "ffn"))
    # kernel time cannot exceed the device time of the forward that launched it
    assert t.attributed <= t.traced * 1.05
    assert t.timed_macs["attention_core"] == counted.attention_core
    assert t.timed_macs["ffn"] == counted.ffn
    assert math.isfinite(t.attention_time_share)
    half = measure(bert_small, N, device="cuda", dtype=torch.float16, repeats=5)
    assert half.dtype == "float16"
