"""Plots of sweeps: shares vs n with the thresholds marked, and the cost parts stacked vs n.

matplotlib is an optional extra (``pip install 'pytest-attncost[plot]'``) and is
imported only here, only when a plot is asked for.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

__all__ = ["MISSING_MATPLOTLIB", "plot_sweep", "require_matplotlib", "shares_plot", "stem_for"]

MISSING_MATPLOTLIB = "plots need matplotlib: pip install 'pytest-attncost[plot]'"
FORMATS = ("png", "svg")
_RC: Any = {"svg.fonttype": "none", "svg.hashsalt": "attncost"}  # text stays text; no random ids in the SVG


def require_matplotlib() -> None:
    """Raise ImportError with the install hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(MISSING_MATPLOTLIB) from exc


MAX_STEM = 120  # file systems allow 255 bytes a name; leave room for the suffix


def stem_for(test_id: str, name: str) -> str:
    """A file-name stem from a test id and a model name; a long one is cut and keeps a hash of the whole."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{test_id}-{name}").strip("_")
    if len(stem) <= MAX_STEM:
        return stem
    digest = hashlib.sha1(stem.encode("utf-8")).hexdigest()[:10]
    return f"{stem[: MAX_STEM - 11]}-{digest}"


def _save(figure: Any, directory: Path, stem: str) -> list[Path]:
    paths = []
    for fmt in FORMATS:
        path = directory / f"{stem}.{fmt}"
        # No dates in the files: the same sweep gives the same bytes.
        metadata = {"Date": None} if fmt == "svg" else {"Software": None}
        figure.savefig(path, format=fmt, metadata=metadata, bbox_inches="tight")
        paths.append(path)
    return paths


def _length_ticks(ax: Any, ns: list[int]) -> None:
    """Tick the measured lengths themselves, written out (512, not 2^9)."""
    ax.set_xticks(ns, [f"{n:,}" for n in ns])
    ax.minorticks_off()


def count_ticks(ax: Any) -> None:
    """Counts on the y axis with the report's decimal prefixes (``40G``, ``1.5T``): no ``1e8`` offset.

    The values plotted are already in the report's unit (the axis label names it), so they are
    prefixed as they are.
    """
    from matplotlib.ticker import FuncFormatter

    from .units import format_count

    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _position: format_count(
        Fraction(value).limit_denominator(1000), "mac", suffix=False)))


def shares_plot(ns: list[int], title: str, directory: Path, stem: str, draw: Callable[[Any], None]) -> list[Path]:
    """A figure of shares of attention + FFN vs n (log axis, the measured lengths ticked, 0.5 marked);
    *draw* adds the lines. Written as ``<stem>.png`` and ``.svg``; returns the paths."""
    import matplotlib
    from matplotlib.figure import Figure

    with matplotlib.rc_context(_RC):
        figure = Figure(figsize=(7, 4.2))
        ax = figure.add_subplot()
        ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
        draw(ax)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length n (tokens)")
        ax.set_ylabel("share of attention + FFN")
        ax.set_ylim(0, 1)
        ax.set_title(title)
        _length_ticks(ax, ns)
        ax.legend(fontsize=8, loc="best")
        return _save(figure, directory, stem)


def plot_sweep(data: Mapping[str, Any], directory: Path, stem: str, unit: str = "mac") -> list[Path]:
    """Write ``<stem>-shares`` and ``<stem>-parts`` as PNG and SVG; return the paths."""
    import matplotlib
    from matplotlib.figure import Figure

    rows = sorted(data["profiles"], key=lambda r: r["n"])
    ns = [r["n"] for r in rows]
    scale = 2 if unit == "flop" else 1

    def shares(ax: Any) -> None:
        ax.plot(ns, [r["attention_share"] for r in rows], marker="o", label="attention share")
        ax.plot(ns, [r["quadratic_share"] for r in rows], marker="s", label="quadratic share")
        for key, label, style in (
            ("formula_crossover_n", "attention = FFN (formula)", "--"),
            ("formula_quadratic_n", "quadratic = linear terms (formula)", "-."),
        ):
            value = data.get(key)
            if value:
                ax.axvline(value, color="black", linestyle=style, linewidth=1,
                           label=f"{label}: n={value:,.0f}")
        if data.get("crossover_n"):
            ax.plot([data["crossover_n"]], [0.5], marker="x", color="red", linestyle="none",
                    label=f"measured crossover: n={data['crossover_n']:,.0f}")

    paths = shares_plot(ns, f"{data['name']}: where attention takes over", directory, f"{stem}-shares", shares)
    with matplotlib.rc_context(_RC):
        figure = Figure(figsize=(7, 4.2))
        ax = figure.add_subplot()
        parts = ("attention_core", "attention_proj", "ffn", "other")
        ax.stackplot(ns, *[[r[p] * scale for r in rows] for p in parts], labels=parts)
        ax.set_xscale("log", base=2)
        ax.set_yscale("linear")
        ax.set_xlabel("sequence length n (tokens)")
        ax.set_ylabel(f"{unit.upper()} (whole model, batch {rows[0]['batch']}; K/M/G/T = 10^3/6/9/12)")
        count_ticks(ax)
        ax.set_title(f"{data['name']}: cost by part")
        _length_ticks(ax, ns)
        ax.legend(fontsize=8, loc="upper left")
        paths += _save(figure, directory, f"{stem}-parts")
    return paths
