"""Sweeps in one run (issue 15): a torch-backend sweep counts every length with one forward pass
whose length holds each length's value. Exact at every length, or counted one length at a time."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import tiny_models as tm
import torch
from test_counting import expected
from torch import nn

from pytest_attncost import clear_cache, one_run, profile
from pytest_attncost.api import sweep

D, H, F = tm.HIDDEN, tm.HEADS, tm.FFN


# --- a length holding several values --------------------------------------------------------


def test_arithmetic_is_done_length_by_length():
    values = [8, 12, 40]
    n = one_run.length_of(values)
    cases = [
        (n * 3 + 1, [25, 37, 121]),
        (n // 5, [1, 2, 8]),
        (n % 7, [1, 5, 5]),
        (-n + 10, [2, -2, -30]),
        (n * n - n, [56, 132, 1560]),
        (torch.sym_max(n, 10), [10, 12, 40]),
        (torch.sym_min(n, 10), [8, 10, 10]),
        (n / 4, [2.0, 3.0, 10.0]),
        (n > 10, [False, True, True]),
        (n == 12, [False, True, False]),
        (round(n / 16), [0, 1, 2]),  # Python's rounding: half to even
    ]
    for value, want in cases:
        assert one_run.spread(value, 3) == want
    assert one_run.spread((1, n, (n * 2, 5)), 3) == [(1, 8, (16, 5)), (1, 12, (24, 5)), (1, 40, (80, 5))]


def test_a_decision_must_be_the_same_at_every_length():
    n = one_run.length_of([8, 40])
    assert bool(n > 4) and int(n - n + 3) == 3 and (n * 0 + 2) == 2  # the same answer everywhere: taken
    for decide in (lambda: bool(n > 10), lambda: int(n), lambda: range(n), lambda: n == 8 or 0):
        with pytest.raises(one_run.Diverged):
            decide()
    # not an Exception: a model's `except Exception:` cannot swallow it and carry on down one branch
    assert not issubclass(one_run.Diverged, Exception)
    with pytest.raises(one_run.Diverged, match="cannot answer 'some_method'"):
        _ = n.node.some_method  # a part of torch's protocol the node lacks fails the run, not just the call


def test_one_run_leaves_torch_as_it_was_and_catches_a_swallowed_decision():
    from torch._subclasses import fake_impls

    before = dict(fake_impls.op_implementations_dict)
    with one_run.enabled():
        assert fake_impls.op_implementations_dict != before  # views go to the meta kernel during the run
    assert fake_impls.op_implementations_dict == before
    with pytest.raises(one_run.Diverged):
        with one_run.enabled():
            bool(one_run.length_of([1, 2]) > 1)
    assert fake_impls.op_implementations_dict == before
    with pytest.raises(one_run.Diverged):  # swallowed on the way, still refused
        with one_run.enabled():
            try:
                bool(one_run.length_of([1, 2]) > 1)
            except BaseException:  # noqa: BLE001 - what a careless model might do
                pass
    with one_run.enabled():  # the next run starts clean
        assert bool(one_run.length_of([1, 2]) > 0)


# --- sweeps -----------------------------------------------------------------------------------


def parts(p):
    return p.attention_core, p.attention_proj, p.ffn


@pytest.mark.parametrize(("build", "shape"), [
    (tm.torch_encoder, {}),
    (lambda: tm.llama_like(kv_heads=1), {"gated": True, "g": 1}),
], ids=["torch-encoder", "llama-gqa"])
def test_a_torch_sweep_is_one_run_and_every_profile_is_the_one_at_its_length(build, shape):
    model = build()
    clear_cache()
    ns = [16, 40, 100]
    swept = sweep(model, ns, backend="torch")
    assert swept.one_run == one_run.POSSIBLE and swept.lengths == ns
    clear_cache()
    for p, n in zip(swept, ns):
        assert parts(p) == expected(n, 1, **shape), n  # the hand count at each length
        alone = profile(model, n, backend="torch")
        assert p.to_dict() == alone.to_dict(), n  # and all of the profile counted at that length alone
    if shape:  # Mistral-like: (F - P) / 2hd = 576, (F + P) / 2hd = 960 (see test_sweep.py)
        assert (swept.crossover(), swept.quadratic_crossover()) == (Fraction(576), Fraction(960))


class Unprojected(nn.Module):
    """Attention of the input with itself, no projection: the structure warns, naming the core's MACs."""

    def __init__(self) -> None:
        super().__init__()
        self.ffn = nn.Linear(D, D)

    def forward(self, x):
        return self.ffn((x @ x.transpose(-1, -2)).softmax(-1) @ x)


def test_a_structure_found_once_for_every_length_still_warns_with_each_lengths_macs():
    swept = sweep(Unprojected(), [16, 40], backend="torch", inputs=lambda n, batch: torch.zeros(batch, n, D))
    assert swept.one_run == one_run.POSSIBLE
    for p, n in zip(swept, [16, 40]):
        assert p.attention_core == 2 * n * n * D  # QK^T and AV, D wide
        assert p.warnings == (f"the model: its attention core ({2 * n * n * D:,} MAC) is reached by no parameter "
                              "product: its Q, K and V projections were not found; pass roles= to name them",)


class Encoder(nn.TransformerEncoder):
    """Two of torch's encoder layers: the base of the models below, whose forward code is their own."""

    def __init__(self) -> None:
        super().__init__(nn.TransformerEncoderLayer(D, H, F, batch_first=True), 2, enable_nested_tensor=False)


class Branchy(Encoder):
    """Runs one more Linear above 20 tokens: the lengths of a sweep across 20 take two branches."""

    def __init__(self, swallow: bool = False) -> None:
        super().__init__()
        self.extra = nn.Linear(D, D)
        self.swallow = swallow

    def forward(self, src, *args, **kwargs):
        out = super().forward(src, *args, **kwargs)
        try:
            if src.shape[1] > 20:
                out = self.extra(out)
        except BaseException:  # noqa: BLE001 - a model that hides its errors
            if not self.swallow:
                raise
        return out


@pytest.mark.parametrize("swallow", [False, True], ids=["raises", "swallows"])
def test_lengths_that_take_different_branches_are_counted_one_by_one(swallow):
    clear_cache()
    swept = sweep(Branchy(swallow), [16, 32, 64], backend="torch")
    assert not swept.one_run
    assert [p.other for p in swept] == [0, 32 * D * D, 64 * D * D]  # the extra Linear where it ran
    assert [parts(p) for p in swept] == [expected(n, 1) for n in (16, 32, 64)]
    # on one side of the branch the lengths agree: one run again
    assert sweep(Branchy(swallow), [24, 32], backend="torch").one_run == one_run.POSSIBLE


def test_what_one_run_does_not_cover_is_counted_per_length():
    clear_cache()
    assert not sweep(tm.torch_encoder(), [16, 32]).one_run  # fvcore's tracer takes one length at a time
    assert not sweep(tm.torch_encoder(), [16, 32], backend="torch", mode="train").one_run
    assert not sweep(tm.torch_encoder(), [16], backend="torch").one_run  # nothing to share
    on_cpu = sweep(tm.HandWritten(), [16, 32], backend="torch", roles=tm.HAND_ROLES,
                   inputs=lambda n, b: (torch.zeros(b, n, D, device="cpu"),))  # a swept length needs meta
    assert not on_cpu.one_run and [parts(p) for p in on_cpu] == [expected(16, 1), expected(32, 1)]
    with pytest.raises(Exception, match="ns must hold distinct lengths"):
        sweep(tm.torch_encoder(), [16, 16], backend="torch")


def test_the_model_is_left_as_it_was():
    model = tm.llama_like()
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    clear_cache()
    assert sweep(model, [16, 48], backend="torch").one_run == one_run.POSSIBLE
    assert model.training and all(m.training for m in model.modules())
    after = model.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[k], v) and after[k].device == v.device
                                              for k, v in state.items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_the_fixture_sweeps_with_the_sessions_backend(project):
    project.makepyfile("""
        import pytest
        from pytest_attncost import clear_cache, one_run, profile
        from tiny_models import llama_like

        @pytest.mark.attncost(crossover_min=576, crossover_max=576, crossover_rtol=0)
        def test_sweep(attncost):
            model = llama_like(kv_heads=1)
            sweep = attncost.sweep(model, [100, 333, 1000])
            assert sweep.one_run == one_run.POSSIBLE and [p.backend for p in sweep] == ["torch"] * 3
            clear_cache()
            assert [p.to_dict() for p in sweep] == [profile(model, n, backend="torch").to_dict() for n in sweep.lengths]
    """)
    result = project.runpytest("--attncost-backend=torch", "--attncost-json=report.json", "--attncost-report")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*attention = FFN at n=576 (formula 576)*"])
    rows = json.loads((project.path / "report.json").read_text())
    assert sorted(p["n"] for p in rows["profiles"]) == [100, 333, 1000]
    assert {p["backend"] for p in rows["profiles"]} == {"torch"}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_causal_half_is_the_same_in_one_run(impl):
    model = tm.llama_like(attn_implementation=impl)
    clear_cache()
    swept = sweep(model, [16, 40], backend="torch", causal="half")
    assert swept.one_run == one_run.POSSIBLE and all(p.causal_applied for p in swept)
    # QK^T and AV over the n(n+1)/2 query-key pairs of causal attention, per layer and head
    assert [p.attention_core for p in swept] == [tm.LAYERS * H * (n * (n + 1) // 2) * 2 * tm.HEAD_DIM
                                                 for n in (16, 40)]
    clear_cache()
    assert [p.to_dict() for p in swept] == [profile(model, n, backend="torch", causal="half").to_dict()
                                            for n in (16, 40)]


# --- what the values alone do not show (found in review) -------------------------------------


class TypeBranch(Encoder):
    """Branches on the type of a size: a SymInt is not an int, so no decision on a value is taken."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(D, D)

    def forward(self, src, *args, **kwargs):
        out = super().forward(src, *args, **kwargs)
        if not isinstance(src.shape[1], int):
            out = self.extra(out)
        return out


class Passes(Encoder):
    """round(n / 16) passes of a Linear, and one pass if that cannot be computed."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(D, D)

    def forward(self, src, *args, **kwargs):
        out = super().forward(src, *args, **kwargs)
        try:
            passes = round(src.shape[1] / 16)
        except Exception:  # noqa: BLE001 - a model that hides its errors
            passes = 1
        for _ in range(passes):
            out = self.mix(out)
        return out


class LazyTable(Encoder):
    """A positional table made on the first call, as long as that call's input."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Module()

    def forward(self, src, *args, **kwargs):
        if not hasattr(self.pos, "table"):
            self.pos.table = nn.Parameter(torch.zeros(1, src.shape[1], D, device=src.device))
        return super().forward(src + self.pos.table, *args, **kwargs)


@pytest.mark.parametrize(("model", "other"), [
    (TypeBranch, lambda n: 0),  # never an int's other branch when counted alone
    (Passes, lambda n: round(n / 16) * n * D * D),  # 1 pass at 16, round(2.5) = 2 at 40
    (LazyTable, lambda n: 0),
], ids=["type-of-a-size", "swallowed-error", "state-of-the-length"])
def test_what_the_lengths_values_do_not_show_is_counted_per_length(model, other):
    clear_cache()
    swept = sweep(model(), [16, 40], backend="torch")
    assert not swept.one_run
    assert [p.other for p in swept] == [other(16), other(40)]
    assert [parts(p) for p in swept] == [expected(16, 1), expected(40, 1)]
    if model is LazyTable:
        assert [p.modules["pos"][1] for p in swept] == [16 * D, 40 * D]  # ints, each length's own table


@pytest.mark.skipif(not one_run.POSSIBLE, reason="one-run sweeps need torch >= 2.9 (meta kernels in Python before)")
def test_one_input_passed_three_times_stays_one_tensor():
    """nn.MultiheadAttention(x, x, x) projects q, k, v with one packed product when they are one tensor."""
    from pytest_attncost import api
    from pytest_attncost.counting import at_lengths, count_forward_torch, meta_twin

    mha = nn.MultiheadAttention(D, H, batch_first=True)
    ns = [16, 40]
    swept = at_lengths(count_forward_torch(meta_twin(mha), *api.default_inputs(mha, one_run.length_of(ns), 1)), 2)
    for raw, n in zip(swept, ns):
        alone = count_forward_torch(meta_twin(mha), *api.default_inputs(mha, n, 1))
        assert raw.records == alone.records
        assert raw.records[0].shapes == ((3 * D,), (n, D), (D, 3 * D))  # the packed in-projection


def test_only_torch_and_transformers_code_skips_the_check_against_one_length():
    from pytest_attncost.pipeline import _library_code

    assert _library_code(tm.torch_encoder()) and _library_code(tm.llama_like())
    assert not _library_code(TypeBranch()) and not _library_code(tm.HandWritten())
    patched = tm.torch_encoder()
    patched.layers[0].forward = lambda *a, **k: None  # an instance's own forward
    assert not _library_code(patched)
    custom = tm.llama_like()
    custom.config._attn_implementation = "my_attention"  # a function the user registered
    assert not _library_code(custom)


def test_the_memo_keeps_only_what_follows_from_sizes():
    from pytest_attncost.one_run import _functional

    aten = torch.ops.aten
    assert _functional(aten.addmm.default) and _functional(aten.native_layer_norm.default)
    for op in (aten.view.default, aten.t.default, aten.add_.Tensor, aten.nonzero.default, aten.add.out):
        assert not _functional(op), op  # views, writes, sizes read from values
    # an int tensor plus 1 stays int, plus 1.0 or True does not: equal Python values, different keys
    memo, ids = one_run.OpMemo(), torch.zeros(2, 3, dtype=torch.long, device="meta")
    keys = {memo.key(aten.add.Tensor, (ids, other), {}) for other in (1, 1.0, True)}
    n = one_run.length_of([3, 5])
    keys |= {memo.key(aten.mul.Tensor, (ids, size), {}) for size in (n, n * 1.0)}
    assert len(keys) == 5 and None not in keys


def test_the_second_layer_of_a_one_run_on_meta_tensors_is_served_from_the_memo(monkeypatch):
    """The one run counts on the twin's meta tensors (as a count at one length does); the second traced layer meets
    the first one's ops on the same sizes, and gets their outputs' sizes from the memo, not from the kernels'
    symbolic arithmetic again; a meta tensor is kept there as a fake one is (neither has values), a CPU one is not."""
    served = []

    class Watched(one_run.OpMemo):
        def key(self, func, args, kwargs):
            found = super().key(func, args, kwargs)
            if found is not None and found in self.made:
                served.append(str(func))
            return found

    monkeypatch.setattr(one_run, "OpMemo", Watched)
    clear_cache()
    swept = sweep(tm.llama_like, [16, 40], backend="torch")
    assert swept.one_run == one_run.POSSIBLE and bool(served) == one_run.POSSIBLE
    clear_cache()  # the sweep's profiles are cached at their lengths
    assert [p.to_dict() for p in swept] == [profile(tm.llama_like, n, backend="torch").to_dict() for n in (16, 40)]
    memo, aten = one_run.OpMemo(), torch.ops.aten
    for device, kept in (("meta", True), ("cpu", False)):
        x = torch.zeros(2, 3, device=device)
        key = memo.key(aten.exp.default, (x,), {})
        memo.keep(key, aten.exp.default(x), [x])
        assert (key in memo.made) == kept, device


class TwoReductions(Encoder):
    """The same op on the same sizes with other arguments: a memo keyed on sizes alone would mix them up."""

    def __init__(self) -> None:
        super().__init__()
        self.wide, self.tall = nn.Linear(D, D), nn.Linear(1, D)

    def forward(self, src, *args, **kwargs):
        out = super().forward(src, *args, **kwargs)
        return self.wide(out.sum(dim=1)) + self.tall(out.sum(dim=2, keepdim=True)).sum(dim=1)


def test_an_op_met_again_with_other_arguments_is_run_again():
    clear_cache()
    swept = sweep(TwoReductions(), [16, 40], backend="torch")
    assert swept.one_run == one_run.POSSIBLE  # checked against the first length counted alone (code of its own)
    assert [p.other for p in swept] == [D * D + n * D for n in (16, 40)]  # wide: 1 token; tall: n tokens, 1 -> D


def test_a_callable_inputs_is_given_the_swept_length():
    model = tm.HandWritten()
    ns = [16, 40]
    clear_cache()
    swept = sweep(model, ns, backend="torch", roles=tm.HAND_ROLES, inputs=lambda n, b: (torch.zeros(b, n, D),))
    assert swept.one_run == one_run.POSSIBLE and [parts(p) for p in swept] == [expected(n, 1) for n in ns]
    assert [p.to_dict() for p in swept] == [
        profile(model, n, backend="torch", roles=tm.HAND_ROLES, inputs=lambda n, b: (torch.zeros(b, n, D),)).to_dict()
        for n in ns]
