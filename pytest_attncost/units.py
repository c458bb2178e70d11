"""Every parser and formatter: counts such as ``"45 GMAC"`` or ``"90 GFLOP"`` into MACs and back, sizes in
bytes, lengths in tokens, seconds, and the one plain-text table formatter of the report and the CLI.

Prefixes are decimal (SI): ``G`` is 10**9, as FLOP counts are quoted everywhere.
One MAC is two FLOP, so a FLOP threshold may be a half-MAC; parsing returns an
exact :class:`fractions.Fraction` and comparisons never round.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from fractions import Fraction

from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)

__all__ = ["UnitError", "format_bytes", "format_count", "format_seconds", "format_tokens", "parse_bytes", "parse_count",
           "table", "UNITS"]

PREFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
UNITS = ("mac", "flop")
FLOP_PER_MAC = 2

_NUMBER = r"(?P<number>[0-9][0-9_]*(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)"  # of a count and of a size
_COUNT = re.compile(rf"^\s*{_NUMBER}\s*(?P<prefix>[kmgtp]?)\s*(?P<unit>macs?|flops?)?\s*$", re.IGNORECASE)

UNIT_HELP = "an int of MACs or a string such as '45G', '45 GMAC' or '90 GFLOP' (K/M/G/T/P are powers of 1000)"


class UnitError(ValueError):
    """A count that cannot be read; the message says what was expected."""


def _matched(value: object, pattern: re.Pattern[str], what: str, expected: str) -> int | re.Match[str]:
    """*value*, an int (checked to be >= 0) or a string *pattern* reads (a *what*), else a UnitError."""
    if isinstance(value, bool):
        raise UnitError(f"expected {expected}, got the bool {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise UnitError(f"a {what} cannot be negative, got {value!r}")
        return value
    if not isinstance(value, str):
        raise UnitError(f"expected {expected}, got {type(value).__name__} {value!r}")
    match = pattern.match(value)
    if match is None:
        raise UnitError(f"cannot read {value!r} as a {what}: expected {expected}")
    return match


def parse_count(value: object) -> Fraction:
    """Read a count into MACs, exactly.

    Args:
        value: an int (MACs) or a string: a number, an optional decimal prefix
            (K, M, G, T, P) and an optional unit (MAC or FLOP, plural allowed),
            case-insensitive. ``"45G"`` and ``"45 GMAC"`` are 45e9 MACs;
            ``"90 GFLOP"`` is 45e9 MACs too.

    Returns:
        The count in MACs (``"3 FLOP"`` is 3/2 MAC).

    Raises:
        UnitError: the value is not a non-negative finite count.
    """
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise UnitError(f"a count must be finite and non-negative, got {value!r}")
        return Fraction(value)
    match = _matched(value, _COUNT, "count", UNIT_HELP)
    if isinstance(match, int):
        return Fraction(match)
    number = Fraction(match["number"].replace("_", ""))
    macs = number * PREFIXES[match["prefix"].lower()]
    unit = (match["unit"] or "mac").lower().rstrip("s")
    return macs / FLOP_PER_MAC if unit == "flop" else macs


def format_tokens(value: float | None) -> str:
    """A length in tokens: ``1,536``, ``8,320.5``, or ``none``."""
    return "none" if value is None else f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


def format_count(macs: int | Fraction, unit: str = "mac", *, suffix: bool = True) -> str:
    """Format a MAC count with a decimal prefix and three significant digits.

    ``format_count(4_026_531_840)`` is ``"4.03G MAC"`` (the prefix belongs to the number:
    a budget of ``"17M MAC"`` reads as 17 million MACs, and parses back); with ``unit="flop"``
    the value is doubled and labelled ``FLOP``. ``suffix=False`` leaves the unit out (for
    table cells under a header that names it): ``"4.03G"``.
    """
    if unit not in UNITS:
        raise UnitError(f"unit must be one of {', '.join(UNITS)}, got {unit!r}")
    value = Fraction(macs) * (FLOP_PER_MAC if unit == "flop" else 1)
    prefix = ""
    for name, scale in reversed(PREFIXES.items()):
        if abs(value) >= scale:
            value, prefix = value / scale, name.upper()
            break
    if prefix == "" and value.denominator == 1:
        text = str(value.numerator)
    else:
        text = f"{float(value):.3g}"
        if "e" in text:  # 999.7 rounds to "1e+03"
            text = f"{float(value):.0f}"
    return f"{text}{prefix} {unit.upper() if suffix else ''}".rstrip()


# --- bytes (KV-cache memory) -----------------------------------------------------------------
# Memory is quoted both ways: "2 GB" is 10**9 bytes (SI, like the counts), "2 GiB" is 2**30.

BYTE_PREFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                 "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}

_BYTES = re.compile(rf"^\s*{_NUMBER}\s*(?P<prefix>(?:[kmgt]i?)?)\s*(?:b|bytes?)?\s*$", re.IGNORECASE)

BYTES_HELP = ("an int of bytes or a string such as '2 GiB', '512 MiB' or '2 GB' (KB/MB/GB are powers of 1000, "
              "KiB/MiB/GiB of 1024)")


def parse_bytes(value: object) -> int:
    """Read a memory size into bytes: an int, or ``"2 GiB"``, ``"512MiB"``, ``"2 GB"``, ``"100 kB"``; a size
    that is no whole number of bytes (``"0.001 GiB"``) is rounded to the nearest byte.

    Raises:
        UnitError: not a non-negative size.
    """
    match = _matched(value, _BYTES, "size", BYTES_HELP)
    if isinstance(match, int):
        return match
    return round(Fraction(match["number"].replace("_", "")) * BYTE_PREFIXES[match["prefix"].lower()])


def format_bytes(size: int) -> str:
    """A size for people, in binary units (memory is allocated in them): ``2 GiB``, ``1.5 MiB``, ``512 B``."""
    value = Fraction(size)
    for name, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            value /= scale
            text = str(value.numerator) if value.denominator == 1 else f"{float(value):.3g}"
            return f"{text} {name}"
    return f"{size} B"


def format_seconds(seconds: float) -> str:
    """``0.0123`` -> ``'12.3 ms'``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def table(headers: Sequence[str], body: Sequence[Sequence[str]], *, right: Iterable[int] | None = None,
          rule: bool = True) -> list[str]:
    """Lines of a plain-text table (the report's and the CLI's): *right* are the right-aligned columns' indices,
    by default all but the first two and the last (test and model on the left, verdict last); *rule* dashes
    under the headers."""
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    numeric = set(range(2, len(headers) - 1) if right is None else right)

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    return [line(headers), *([line(["-" * w for w in widths])] if rule else []), *(line(r) for r in body)]
