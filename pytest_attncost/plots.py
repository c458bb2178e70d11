"""All the plots: a sweep's shares vs n with the thresholds marked and its cost parts stacked vs n, a decode
step's parts over the cache length, and measured time beside MACs.

matplotlib is an optional extra (``pip install 'pytest-attncost[plot]'``) and is
imported only here, only when a plot is asked for.
"""

from __future__ import annotations

import hashlib
import io
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

from . import files, formulas
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .formulas import ModelSpec
from .request import PARTS
from .units import format_count

__all__ = ["MISSING_MATPLOTLIB", "plot_decode", "plot_sweep", "plot_time_shares", "require_matplotlib", "shares_plot",
           "stem_for", "stems_for"]

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


def stem_for(test_id: str, name: str, position: int = 0, twin: bool = False) -> str:
    """A file-name stem from a test id and a model name, readable and never shared with another sweep's."""
    readable = f"{test_id}-{name}".replace("::", "_")
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", readable).strip("_")
    if stem == readable and len(stem) <= MAX_STEM and not twin:
        return stem
    # replaced ("sp ace", "a/b"), cut, or a twin in this run: + hash of id, name, position among the test's sweeps of it
    digest = hashlib.sha1(f"{test_id}\0{name}\0{position}".encode()).hexdigest()[:10]
    return f"{stem[: MAX_STEM - 11]}-{digest}"


def stems_for(sweeps: Sequence[tuple[str, str]]) -> list[str]:
    """The stems of a run's sweeps, given as (test id, model name) in the report's order; no two alike."""
    positions = [sweeps[:index].count(key) for index, key in enumerate(sweeps)]
    plain = Counter(stem_for(test_id, name) for test_id, name in sweeps)
    return [stem_for(test_id, name, position, plain[stem_for(test_id, name)] > 1)
            for (test_id, name), position in zip(sweeps, positions)]


def _write_figure(figure: Any, path: Path, fmt: str) -> None:
    buffer = io.BytesIO()
    # No dates in the files: the same sweep gives the same bytes.
    metadata = {"svg": {"Date": None}, "png": {"Software": None}}.get(fmt)
    figure.savefig(buffer, format=fmt, metadata=metadata, bbox_inches="tight")
    files.write(path, buffer.getvalue())


def count_ticks(ax: Any) -> None:
    """Counts on the y axis with the report's decimal prefixes (``40G``, ``1.5T``): no ``1e8`` offset; the values
    are already in the report's unit, so they are prefixed as they are."""
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _position: format_count(
        Fraction(value).limit_denominator(1000), "mac", suffix=False)))


def _over_n(ns: list[int], title: str, directory: Path, stem: str, draw: Callable[[Any], None]) -> list[Path]:
    """A figure vs n (log axis, the measured lengths ticked) that *draw* fills and labels, saved as
    ``<stem>.png`` and ``.svg``."""
    import matplotlib
    from matplotlib.figure import Figure

    with matplotlib.rc_context(_RC):
        figure = Figure(figsize=(7, 4.2))
        ax = figure.add_subplot()
        draw(ax)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length n (tokens)")
        ax.set_title(title)
        ax.set_xticks(ns, [f"{n:,}" for n in ns])  # the measured lengths themselves, written out (512, not 2^9)
        ax.minorticks_off()
        paths = [directory / f"{stem}.{fmt}" for fmt in FORMATS]
        for path, fmt in zip(paths, FORMATS):
            _write_figure(figure, path, fmt)
        return paths


def shares_plot(ns: list[int], title: str, directory: Path, stem: str, draw: Callable[[Any], None]) -> list[Path]:
    """A figure of shares of attention + FFN vs n (log axis, the measured lengths ticked, 0.5 marked);
    *draw* adds the lines. Written as ``<stem>.png`` and ``.svg``; returns the paths."""
    def shares(ax: Any) -> None:
        ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
        draw(ax)
        ax.set_ylabel("share of attention + FFN")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8, loc="best")

    return _over_n(ns, title, directory, stem, shares)


def plot_sweep(data: Mapping[str, Any], directory: Path, stem: str, unit: str = "mac") -> list[Path]:
    """Write ``<stem>-shares`` and ``<stem>-parts`` as PNG and SVG; return the paths."""
    rows = sorted(data["profiles"], key=lambda r: r["n"])
    ns = [r["n"] for r in rows]
    scale = 2 if unit == "flop" else 1

    def shares(ax: Any) -> None:
        ax.plot(ns, [r["attention_share"] for r in rows], marker="o", label="attention share")
        ax.plot(ns, [r["quadratic_share"] for r in rows], marker="s", label="quadratic share")
        for key, label, style in (("formula_crossover_n", "attention = FFN (formula)", "--"),
                                  ("formula_quadratic_n", "quadratic = linear terms (formula)", "-.")):
            if value := data.get(key):
                ax.axvline(value, color="black", linestyle=style, linewidth=1, label=f"{label}: n={value:,.0f}")
        if data.get("crossover_n"):
            ax.plot([data["crossover_n"]], [0.5], marker="x", color="red", linestyle="none",
                    label=f"measured crossover: n={data['crossover_n']:,.0f}")

    def parts(ax: Any) -> None:
        ax.stackplot(ns, *[[r[p] * scale for r in rows] for p in PARTS], labels=PARTS)
        ax.set_yscale("linear")
        ax.set_ylabel(f"{unit.upper()} (whole model, batch {rows[0]['batch']}; K/M/G/T = 10^3/6/9/12)")
        count_ticks(ax)
        ax.legend(fontsize=8, loc="upper left")

    return (shares_plot(ns, f"{data['name']}: where attention takes over", directory, f"{stem}-shares", shares)
            + _over_n(ns, f"{data['name']}: cost by part", directory, f"{stem}-parts", parts))


def plot_time_shares(data: Mapping[str, Any], directory: Path, stem: str) -> list[Path]:
    """Write ``<stem>-time-shares`` (PNG and SVG): attention's share of MACs and of time vs n,
    with the formula's crossover and the measured ones; *data* is :meth:`TimingSweep.to_dict`."""
    rows = sorted(data["timings"], key=lambda r: r["n"])
    ns = [r["n"] for r in rows]

    def draw(ax: Any) -> None:
        ax.plot(ns, [r["attention_mac_share"] for r in rows], marker="o", label="attention share of MACs")
        ax.plot(ns, [r["attention_time_share"] for r in rows], marker="s", label="attention share of time")
        if formula := data.get("formula_crossover_n"):
            ax.axvline(formula, color="black", linestyle="--", linewidth=1,
                       label=f"attention = FFN in MACs (formula): n={formula:,.0f}")
        if measured := data.get("time_crossover_n"):
            ax.axvline(measured, color="red", linestyle="-.", linewidth=1,
                       label=f"attention = FFN in time (measured): n={measured:,.0f}")

    where = rows[0]["device_name"] if rows else ""
    return shares_plot(ns, f"{data['name']}: MACs vs time ({where})", directory, f"{stem}-time-shares", draw)


def plot_decode(spec: ModelSpec, ns: Any, path: Any, new_tokens: int = 1, batch: int = 1) -> Path:
    """Plot a decode step's core, projections and FFN per new token over the cache length, with the
    crossover marked; writes *path* (its suffix picks the format) and returns it.

    Raises:
        ImportError: matplotlib is missing (``pip install 'pytest-attncost[plot]'``).
    """
    require_matplotlib()
    from matplotlib.figure import Figure

    lengths = sorted(ns)
    steps = [formulas.decode_costs(spec, n, new_tokens, batch) for n in lengths]
    figure = Figure(figsize=(7, 4))
    ax = figure.add_subplot()
    for part, label in (("attention_core", "core"), ("attention_proj", "projections"), ("ffn", "FFN")):
        ax.plot(lengths, [getattr(s, part) / (new_tokens * batch) for s in steps], marker="o", label=label)
    cross = formulas.decode_crossover_n(spec)
    if cross is not None:
        ax.axvline(float(cross), color="grey", linestyle="--", label=f"core = FFN at {float(cross):,.0f}")
    ax.set_xlabel("tokens in the KV cache (n)")
    ax.set_ylabel("MAC per new token (whole model)")
    ax.set_title("decode step against a KV cache")
    ax.legend()
    target = Path(path) if Path(path).suffix else Path(path).with_suffix(".png")  # savefig's default format
    _write_figure(figure, target, target.suffix[1:])
    return target
