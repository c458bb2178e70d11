"""The marker on its own: parse_marker_kwargs, Bounds, and the checks over a hand-built Profile
(check_bounds), Sweep (check_sweep) and Timing (check_time_bounds); plain functions of plain data,
no pytest session."""

import dataclasses
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_timing import shares

from pytest_attncost.formulas import ModelSpec
from pytest_attncost.markers import (
    KEYWORDS,
    MIN_REPEATS,
    NO_TIMING,
    TIME_BOUND_MESSAGE,
    Bounds,
    MarkerError,
    check_bounds,
    check_sweep,
    check_time_bounds,
    merged_kwargs,
    parse_marker_kwargs,
    parse_time_bound,
)
from pytest_attncost.result import Profile
from pytest_attncost.series import Sweep

# --- parse_marker_kwargs: every keyword, every wrong value a user will try -----------------------------

SHARES = ["attention_share_max", "attention_share_min", "quadratic_share_max", "linear_saving_max"]
COUNTS = ["total_max", "attention_max", "ffn_max", "executed_max"]
TOLERANCES = ["formula_rtol", "crossover_rtol", "max_increase"]
LENGTHS = ["n", "batch", "m"]
TOKENS = ["crossover_min", "crossover_max"]
FLAGS = ["crosscheck"]
DECODE = ["mode", "new_tokens", "kv_cache_max"]
AUDIT = ["audit", "mfu_min", "peak"]
MEMORY = ["peak_memory_max", "peak_memory_min", "activation_memory_max", "activation_memory_min",
          "attention_memory_share_max", "attention_memory_share_min"]
TIME = ["attention_time_share_max", "attention_time_share_min", "quadratic_time_share_max", "quadratic_time_share_min"]


def test_every_keyword_is_covered():
    assert set(SHARES + COUNTS + TOLERANCES + LENGTHS + TOKENS + FLAGS + DECODE + TIME + AUDIT + MEMORY) == KEYWORDS


BAD = [float("nan"), float("inf"), -1, True, "abc", None, [0.5]]


@pytest.mark.parametrize("value", BAD, ids=repr)
@pytest.mark.parametrize("keyword", sorted(KEYWORDS))
def test_bad_values_name_the_keyword(keyword, value):
    if keyword in COUNTS and value == float("inf"):
        value = float("-inf")
    if keyword in FLAGS and value is True:
        value = 1  # an int is not a flag
    with pytest.raises(MarkerError, match=keyword if keyword != "n" else "n"):
        parse_marker_kwargs((), {keyword: value})


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"n": 2**31}, Bounds(lengths=(2**31,))),
        ({"n": [128, 512], "batch": 4}, Bounds(lengths=(128, 512), batch=4)),
        ({"attention_share_max": 0, "attention_share_min": 0},
         Bounds(attention_share_max=0.0, attention_share_min=0.0)),
        ({"total_max": "3 FLOP"}, Bounds(total_max=__import__("fractions").Fraction(3, 2))),
    ],
)
def test_edge_values_accepted(kwargs, expected):
    assert parse_marker_kwargs((), kwargs) == expected


values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.lists(st.integers(-5, 5000), max_size=4), st.binary(max_size=4),
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(KEYWORDS) + ["atention_share_max", "n_max"]), values, max_size=4))
def test_fuzz_marker_values(kwargs):
    """Whatever the values, parsing returns Bounds or raises MarkerError — never anything else."""
    try:
        bounds = parse_marker_kwargs((), kwargs)
    except MarkerError as exc:
        assert str(exc)
        return
    for name in SHARES:
        value = getattr(bounds, name)
        assert value is None or 0 <= value <= 1
    for name in TOLERANCES + TOKENS:
        value = getattr(bounds, name)
        assert value is None or (math.isfinite(value) and value >= 0)
    assert all(n > 0 for n in bounds.lengths)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((512,), {}, "takes keyword arguments only, e.g. attncost(n=512, attention_share_max=0.5)"),
        ((), {"atention_share_max": 0.5}, "unknown keyword 'atention_share_max' (did you mean 'attention_share_max'?)"),
        ((), {"n": []}, "n=[] is empty: give one length or a list of lengths, e.g. n=[128, 512]"),
        ((), {"n": [128, 128]}, "n=[128, 128] repeats a length"),
        ((), {"crossover_min": 10, "crossover_max": 5}, "crossover_min 10 > crossover_max 5: no sweep can pass"),
        ((), {"attention_share_min": 0.6, "attention_share_max": 0.5},
         "attention_share_min 0.6 > attention_share_max 0.5: no share can pass"),
    ],
)
def test_marker_misuse_messages(args, kwargs, message):
    with pytest.raises(MarkerError) as caught:
        parse_marker_kwargs(args, kwargs)
    assert str(caught.value).startswith(message)


def test_nearest_mark_wins():
    function, module = pytest.mark.attncost(n=128, total_max=5).mark, pytest.mark.attncost(n=512, ffn_max=7).mark
    assert merged_kwargs([function, module]) == ((), {"n": 128, "total_max": 5, "ffn_max": 7})


def test_has_bounds_and_has_sweep_bounds():
    assert not Bounds().has_bounds
    assert not Bounds(lengths=(128,), batch=2, mode="decode", new_tokens=1).has_bounds  # settings, not bounds
    assert Bounds(crosscheck=True).has_bounds and not Bounds(crosscheck=False).has_bounds
    assert Bounds(kv_cache_max=1).has_bounds and Bounds(attention_time_share_max=0.5).has_bounds
    assert Bounds(crossover_rtol=0.1).has_sweep_bounds and Bounds(crossover_min=1.0).has_sweep_bounds
    assert not Bounds(total_max=Fraction(1), attention_share_max=0.5).has_sweep_bounds


# --- check_bounds ------------------------------------------------------------------------------


def test_marker_kv_cache_max():
    bounds = parse_marker_kwargs((), {"n": 4096, "mode": "decode", "kv_cache_max": "1 GiB"})
    assert bounds.kv_cache_max == 2**30 and bounds.mode == "decode"
    data = Profile(name="step", n=4096, batch=1, attention_core=10, attention_proj=40, ffn=50, other=0, layers=1,
                   mode="decode", new_tokens=1, kv_cache_bytes=2**31)
    (problem,) = check_bounds(bounds, data)
    assert "kv_cache_bytes 2 GiB > kv_cache_max 1 GiB" in problem and "2,147,483,648" in problem
    assert check_bounds(parse_marker_kwargs((), {"kv_cache_max": "2 GiB"}), data) == []
    assert "mode='decode'" in check_bounds(bounds, dataclasses.replace(data, kv_cache_bytes=None))[0]
    with pytest.raises(MarkerError, match="new_tokens"):
        parse_marker_kwargs((), {"new_tokens": 2})
    with pytest.raises(MarkerError, match="mode"):
        parse_marker_kwargs((), {"mode": "generate"})


# A decode step of 1 new token against 63 cached tokens, batch 2, of one layer with D=8, h=2, d=4 and
# an FFN of 32. The formula's step, by hand: core 2·b·q·(n+q)·h·d = 2·2·1·64·2·4 = 2,048; projections
# b·q·(2·D·hd + 2·D·gd) = 2·1·(128 + 128) = 512; FFN b·q·2·D·f = 2·1·512 = 1,024. The profile's core is
# twice the formula's. Its thresholds per new token: the core reaches the FFN at a context of
# F / 2hd = 512 / 16 = 32, projections and FFN together at (P + F) / 2hd = 768 / 16 = 48 = 6hd.
SPEC = ModelSpec(hidden=8, heads=2, head_dim=4, layers=1, ffn_dim=32)
STEP = Profile(name="step", n=63, batch=2, attention_core=4096, attention_proj=512, ffn=1024, other=0, layers=1,
               spec=SPEC, mode="decode", new_tokens=1, kv_cache_bytes=4096)


def test_check_bounds_reports_every_broken_bound_in_order():
    # attention 4,608 of 5,632: share 0.818 (formula 2,560 / 3,584 = 0.714); core 4,096 of 5,632: 0.727
    # (formula 2,048 / 3,584 = 0.571); linear attention's step core 2·(b·q)·h·d² = 2·2·2·16 = 128,
    # so it would save (4,096 - 128) / 5,632 = 70.45%. The keywords are given in reverse: the order is
    # check_bounds' own (shares, counts, linear saving, KV cache, formula), not the marker's.
    bounds = parse_marker_kwargs((), {
        "formula_rtol": 0.01, "kv_cache_max": 1024, "linear_saving_max": 0.7, "ffn_max": 1000, "attention_max": 4600,
        "total_max": 5000, "quadratic_share_max": 0.7, "attention_share_max": 0.8,
    })
    assert check_bounds(bounds, STEP) == [
        "attention_share 0.818 > 0.8 at n=63, batch=2 (formula 0.714; attention overtakes FFN at n=32)",
        "quadratic_share 0.727 > 0.7 at n=63, batch=2 (formula 0.571; quadratic term dominates at n=48 = 6hd)",
        "total 5.63K MAC > total_max 5K MAC at n=63, batch=2 (5,632 > 5,000 MAC; formula attention+ffn 3.58K MAC)",
        "attention 4.61K MAC > attention_max 4.6K MAC at n=63, batch=2 (4,608 > 4,600 MAC; formula 2.56K MAC)",
        "ffn 1.02K MAC > ffn_max 1K MAC at n=63, batch=2 (1,024 > 1,000 MAC; formula 1.02K MAC)",
        ("linear_attention_saving 0.7045 > 0.7 at n=63, batch=2 (linear attention would save 70.45% of "
         "attention+ffn; attention overtakes FFN at n=32)"),
        ("kv_cache_bytes 4 KiB > kv_cache_max 1 KiB at n=63, batch=2 (4,096 > 1,024 bytes; decode step of 1 "
         "against 63 cached tokens)"),
        "attention_core 4,096 MAC deviates 100.00% from the formula's 2,048 (formula_rtol 0.01) at n=63, batch=2",
    ]


def test_check_bounds_share_min_and_bounds_that_hold():
    low = parse_marker_kwargs((), {"attention_share_min": 0.9})
    assert check_bounds(low, STEP) == [
        "attention_share 0.818 < 0.9 at n=63, batch=2 (formula 0.714; attention overtakes FFN at n=32)"]
    # every bound at its measured value holds: a bound is broken only past it
    held = parse_marker_kwargs((), {"attention_share_max": 4608 / 5632, "attention_share_min": 4608 / 5632,
                                    "total_max": 5632, "ffn_max": "1024 MAC", "kv_cache_max": 4096,
                                    "formula_rtol": 1.0})
    assert check_bounds(held, STEP) == []
    assert check_bounds(Bounds(), STEP) == []


def test_check_bounds_without_a_spec_says_what_is_missing():
    bare = dataclasses.replace(STEP, batch=1, spec=None, mode="forward", new_tokens=None, kv_cache_bytes=None)
    bounds = parse_marker_kwargs((), {"attention_share_max": 0.5, "ffn_max": 1000, "linear_saving_max": 0.5,
                                      "kv_cache_max": 1024, "formula_rtol": 0.01})
    assert check_bounds(bounds, bare) == [
        "attention_share 0.818 > 0.5 at n=63 (no formula; no spec, so no threshold)",
        "ffn 1.02K MAC > ffn_max 1K MAC at n=63 (1,024 > 1,000 MAC; no formula)",
        "linear_saving_max needs the model's shape: pass spec=ModelSpec(...) to profile() at n=63",
        "kv_cache_max bounds a decode step's KV cache: profile with mode='decode' at n=63",
        "formula_rtol needs the model's shape: pass spec=ModelSpec(...) to profile() at n=63",
    ]
    # in FLOP (2 per MAC) the readable numbers double; the exact ones stay in MAC
    (ffn,) = check_bounds(parse_marker_kwargs((), {"ffn_max": 1000}), bare, unit="flop")
    assert ffn == "ffn 2.05K FLOP > ffn_max 2K FLOP at n=63 (1,024 > 1,000 MAC; no formula)"

# --- check_time_bounds: bounds on measured shares, over injected timings --------------------------


@pytest.mark.parametrize(
    ("values", "limit", "broken"),
    [
        ([0.58, 0.59, 0.60, 0.61, 0.62], 0.5, True),  # 0.60 - 0.01 > 0.5
        ([0.58, 0.59, 0.60, 0.61, 0.62], 0.595, False),  # 0.60 - 0.01 = 0.59: within the noise
        ([0.58, 0.59, 0.60, 0.61, 0.62], 0.585, True),  # 0.59 > 0.585: beyond it
        ([0.45, 0.46, 0.60, 0.61, 0.95], 0.5, False),  # median 0.60, spread 0.14: too noisy to call
        ([0.40, 0.41, 0.42, 0.43, 0.99], 0.5, False),  # one slow repeat does not fail a holding bound
    ],
)
def test_max_bound_fails_only_beyond_the_spread(values: list[float], limit: float, broken: bool) -> None:
    problems = check_time_bounds(shares(values), {"attention_time_share_max": limit})
    assert bool(problems) is broken


@pytest.mark.parametrize(("limit", "broken"), [(0.7, True), (0.61, False), (0.5, False)])
def test_min_bound_mirrors_the_max(limit: float, broken: bool) -> None:
    problems = check_time_bounds(shares([0.58, 0.59, 0.60, 0.61, 0.62]), {"attention_time_share_min": limit})
    assert bool(problems) is broken


def test_bound_message_names_median_spread_repeats_and_mac_share() -> None:
    [message] = check_time_bounds(shares([0.58, 0.59, 0.60, 0.61, 0.62]), {"attention_time_share_max": 0.5})
    assert message == TIME_BOUND_MESSAGE.format(stat="attention_time_share", median=0.6, op=">", limit=0.5, n=512,
                                                where="this CPU", repeats=5, spread=0.01, macs=0.4)
    assert message == ("attention_time_share 0.600 > 0.5 beyond the noise at n=512 on this CPU "
                       "(median of 5 repeats, spread ±0.010; MAC share 0.400)")


def test_quadratic_bound() -> None:
    t = shares([0.6] * 5)  # core is half the attention time: 0.3
    assert check_time_bounds(t, {"quadratic_time_share_max": 0.31}) == []
    assert check_time_bounds(t, {"quadratic_time_share_max": 0.25})[0].startswith("quadratic_time_share 0.300 > 0.25")
    assert check_time_bounds(t, {"quadratic_time_share_min": 0.35})[0].startswith("quadratic_time_share 0.300 < 0.35")


def test_too_few_repeats_fail_rather_than_pass_on_noise() -> None:
    t = shares([0.1] * (MIN_REPEATS - 1))  # would hold easily
    [message] = check_time_bounds(t, {"attention_time_share_max": 0.5})
    assert f"timed {MIN_REPEATS - 1} time(s)" in message and f"repeats={MIN_REPEATS}" in message
    assert check_time_bounds(shares([0.1] * MIN_REPEATS), {"attention_time_share_max": 0.5}) == []


def test_bounds_over_several_timings_and_none() -> None:
    held, broken = shares([0.3] * 5), shares([0.7] * 5)
    assert len(check_time_bounds([held, broken, broken], {"attention_time_share_max": 0.5})) == 2
    assert check_time_bounds([held], {"attention_time_share_max": None}) == []
    assert check_time_bounds([], {"attention_time_share_max": 0.5}) == [
        NO_TIMING.format(bound="attention_time_share_max")]
    with pytest.raises(ValueError, match="unknown time bound 'attention_share_max'"):
        check_time_bounds([held], {"attention_share_max": 0.5})


@pytest.mark.parametrize("value", [-0.1, 1.5, "0.5", True, None])
def test_parse_time_bound_refuses(value: object) -> None:
    with pytest.raises(ValueError, match=r"attention_time_share_max must be a number in \[0, 1\]"):
        parse_time_bound("attention_time_share_max", value)
    assert parse_time_bound("quadratic_time_share_min", 1) == 1.0


# --- check_sweep: crossover bounds over a hand-built sweep --------------------------------------------


def _profile(n, spec, ffn_per_token=512):
    """One layer with D=8, h=2, d=4: core 2·n²·h·d = 16·n², projections 4·D·hd = 256 per token."""
    return Profile(name="tiny", n=n, batch=1, attention_core=16 * n * n, attention_proj=256 * n,
                   ffn=ffn_per_token * n, other=0, layers=1, spec=spec)


def _sweep(spec, ffn_per_token=512, lengths=(16, 32, 64)):
    return Sweep([_profile(n, spec, ffn_per_token) for n in lengths])


# measured: attention = FFN where 16·n + 256 = 512, n = 16; SPEC's formula: (F - P) / 2hd = (512 - 256) / 16 = 16;
# with an FFN of 40 instead, F = 2·8·40 = 640 and the formula's crossover is (640 - 256) / 16 = 24
WIDER = ModelSpec(hidden=8, heads=2, head_dim=4, layers=1, ffn_dim=40)
WHERE = "(sweep of tiny over n=[16, 32, 64]; formula {})"


def test_check_sweep_crossover_bounds():
    sweep = _sweep(SPEC)
    assert sweep.crossover() == 16
    assert check_sweep(parse_marker_kwargs((), {"crossover_min": 20}), sweep) == [
        "crossover n=16 < crossover_min 20 " + WHERE.format(16)]
    assert check_sweep(parse_marker_kwargs((), {"crossover_max": 10}), sweep) == [
        "crossover n=16 > crossover_max 10 " + WHERE.format(16)]
    held = parse_marker_kwargs((), {"crossover_min": 16, "crossover_max": 16, "crossover_rtol": 0})
    assert check_sweep(held, sweep) == []


def test_check_sweep_reports_min_max_and_tolerance_in_order():
    # a bound on the crossover and its tolerance against the formula: 16 is 8 / 24 = 33.33% off 24
    bounds = parse_marker_kwargs((), {"crossover_rtol": 0.1, "crossover_min": 20})
    assert check_sweep(bounds, _sweep(WIDER)) == [
        "crossover n=16 < crossover_min 20 " + WHERE.format(24),
        "crossover n=16 deviates 33.33% from the formula's 24 (crossover_rtol 0.1) " + WHERE.format(24),
    ]
    assert check_sweep(parse_marker_kwargs((), {"crossover_rtol": 0.34}), _sweep(WIDER)) == []


def test_check_sweep_without_a_crossover_a_spec_or_enough_lengths():
    assert check_sweep(parse_marker_kwargs((), {"crossover_rtol": 0.1}), _sweep(None)) == [
        ("crossover_rtol needs the model's shape: pass spec=ModelSpec(...) (sweep of tiny over n=[16, 32, 64]; "
         "no formula)")]
    # an FFN of 200 per token is smaller than the projections' 256: attention costs more at every n
    assert check_sweep(parse_marker_kwargs((), {"crossover_max": 1000}), _sweep(None, ffn_per_token=200)) == [
        "no crossover: attention never equals the FFN (sweep of tiny over n=[16, 32, 64]; no formula)"]
    one = _sweep(SPEC, lengths=(16,))
    assert check_sweep(parse_marker_kwargs((), {"crossover_min": 1}), one) == [
        "sweep of tiny: a crossover needs at least two lengths, this sweep has [16]"]
    assert check_sweep(parse_marker_kwargs((), {"total_max": 1}), one) == []  # no crossover bound: nothing to solve
