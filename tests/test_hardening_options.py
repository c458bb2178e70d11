"""Marker keywords and options, every wrong value a user will try."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_attncost.markers import KEYWORDS, Bounds, MarkerError, parse_marker_kwargs

SHARES = ["attention_share_max", "attention_share_min", "quadratic_share_max", "linear_saving_max"]
COUNTS = ["total_max", "attention_max", "ffn_max"]
TOLERANCES = ["formula_rtol", "crossover_rtol", "max_increase"]
LENGTHS = ["n", "batch"]
TOKENS = ["crossover_min", "crossover_max"]
FLAGS = ["crosscheck"]
DECODE = ["mode", "new_tokens", "kv_cache_max"]
TIME = ["attention_time_share_max", "attention_time_share_min", "quadratic_time_share_max", "quadratic_time_share_min"]


def test_every_keyword_is_covered():
    assert set(SHARES + COUNTS + TOLERANCES + LENGTHS + TOKENS + FLAGS + DECODE + TIME) == KEYWORDS


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
        ({"attention_share_max": 0, "attention_share_min": 0}, Bounds(attention_share_max=0.0, attention_share_min=0.0)),
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


def test_same_option_twice_last_wins(project):
    project.makepyfile(test_suite="""
        from tiny_models import torch_encoder
        def test_x(attncost):
            attncost.profile(torch_encoder, 16)
    """)
    result = project.runpytest("--attncost-report", "--attncost-unit=mac", "--attncost-unit=flop")
    result.stdout.fnmatch_lines(["*attncost report (counts in FLOP)*"])
    result = project.runpytest("--attncost-json=a.json", "--attncost-json=b.json")
    assert (project.path / "b.json").exists() and not (project.path / "a.json").exists()


def test_bad_ini_values_are_usage_errors(project):
    project.makeini("[pytest]\nattncost_max_increase = two\n")
    result = project.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*attncost_max_increase = 'two' in the ini file: expected a percentage such as 2.5*"])


def test_prune_without_save_is_a_usage_error(project):
    result = project.runpytest("--attncost-save-prune")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--attncost-save-prune needs --attncost-save=PATH*"])
