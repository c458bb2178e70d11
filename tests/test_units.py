from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_attncost.units import UnitError, format_count, parse_count


@pytest.mark.parametrize(
    ("text", "macs"),
    [
        ("45G", 45 * 10**9),
        ("45 GMAC", 45 * 10**9),
        ("45 gmacs", 45 * 10**9),
        ("90 GFLOP", 45 * 10**9),
        ("90 GFLOPs", 45 * 10**9),
        ("3 FLOP", Fraction(3, 2)),
        ("1.5k", 1500),
        ("2 MAC", 2),
        ("2 MMAC", 2 * 10**6),
        ("1T", 10**12),
        ("1p", 10**15),
        ("12_000", 12_000),
        (7, 7),
    ],
)
def test_parse(text, macs):
    assert parse_count(text) == macs


@pytest.mark.parametrize("bad", ["", "G", "45 GB", "-1G", "45 GiB", "4 5G", True, None, -3,
                                 float("nan"), float("inf"), [1]])
def test_parse_rejects(bad):
    with pytest.raises(UnitError):
        parse_count(bad)


def test_parse_error_names_the_format():
    with pytest.raises(UnitError, match="'45 GB'.*'45 GMAC'.*'90 GFLOP'"):
        parse_count("45 GB")


@pytest.mark.parametrize(
    ("macs", "unit", "text"),
    [(4_026_531_840, "mac", "4.03G MAC"), (4_026_531_840, "flop", "8.05G FLOP"), (512, "mac", "512 MAC"),
     (48_318_382_080, "mac", "48.3G MAC"), (0, "mac", "0 MAC"), (17_000_000, "mac", "17M MAC")],
)
def test_format(macs, unit, text):
    assert format_count(macs, unit) == text


@given(st.integers(0, 10**18), st.sampled_from(["", "K", "M", "G", "T", "P"]),
       st.sampled_from(["", "MAC", "FLOP", "macs"]))
def test_parse_roundtrip(number, prefix, unit):
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}[prefix]
    expected = Fraction(number * scale, 2 if unit == "FLOP" else 1)
    assert parse_count(f"{number} {prefix}{unit}") == expected


@given(st.integers(0, 10**18))
def test_format_is_within_half_a_percent(macs):
    text = format_count(macs, "mac")
    assert text.endswith("MAC")
    assert parse_count(text) == pytest.approx(macs, rel=5e-3, abs=0)
