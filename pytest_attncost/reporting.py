"""The attncost report: one typed :class:`Row` per profile, one table formatter, shared sections.

How rows travel and why every format renders the same sections: docs/reports.md, "How a report is built".
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import devices
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .formulas import ModelSpec
from .inferred import is_inferred
from .markers import threshold_notes
from .result import PARTS, Profile, versions
from .series import Sweep, SweepError
from .units import format_bytes, format_count, format_seconds, format_tokens, table

__all__ = ["SCHEMA", "Row", "RowKey", "Section", "SweepRow", "render_json", "render_markdown", "render_terminal",
           "row_key", "sections", "sort_rows"]

SCHEMA = 1

#: A row's identity: test id, profile name, n, batch, mode, causal accounting, backend.
RowKey = tuple[str, str, int, int, int, str, str, str]


def field_of(counted: Profile | Mapping[str, Any], name: str) -> Any:
    """A profile's field, or a JSON entry's (None where the entry leaves it out)."""
    return counted.get(name) if isinstance(counted, Mapping) else getattr(counted, name)


def row_key(test_id: str, counted: Profile | Mapping[str, Any]) -> RowKey:
    """The one identity of a row (*counted*: its profile, or its JSON entry): reports sort by it, baselines are
    keyed by it. A second sequence's length counts only where it differs from n (else 0); the backend comes last
    (compare pairs entries by the rest)."""
    name, n, batch, m, mode, causal, backend = (field_of(counted, f)
                                                for f in ("name", "n", "batch", "m", "mode", "causal", "backend"))
    return (test_id, name, n, batch, 0 if m is None or m == n else m, mode or "forward", causal or "full",
            backend or "fvcore")


def key_label(key: RowKey) -> list[str]:
    """test id, model (with mode, causal accounting and backend when not the defaults), n (and m), batch."""
    test_id, name, n, batch, m, mode, causal, backend = key
    notes = [note for note, default in ((mode, "forward"), (causal, "full"), (backend, "fvcore")) if note != default]
    return [test_id, f"{name} ({', '.join(notes)})" if notes else name, f"{n:,}" + (f" (m {m:,})" if m else ""),
            str(batch)]


#: A row's fields that only some rows have, left out of its JSON form when absent.
_OPTIONAL = ("outcome", "vs_baseline", "crosscheck", "timing")


@dataclass(frozen=True)
class Row:
    """One profile in one test, with what its checks found.

    Attributes:
        test_id: the pytest node id.
        profile: the count.
        problems: the checks it broke (bounds, baseline, strict mode, cross-check), one line each.
        verdict: ``ok`` (checked and passed), ``FAIL``, or ``-`` (nothing checked it).
        outcome: the test's outcome (``passed``, ``failed``, ``skipped``, ``error``), once known.
        vs_baseline: the baseline cell (``=``, ``+1.20%``, ``new``); None without a baseline.
        crosscheck: the second backend's parts and whether they agree; None without a cross-check.
        timing: measured time beside the MACs (``Timing.to_dict()``); None when not measured.
    """

    test_id: str
    profile: Profile
    problems: tuple[str, ...] = ()
    verdict: str = "-"
    outcome: str | None = None
    vs_baseline: str | None = None
    crosscheck: Mapping[str, Any] | None = field(default=None, compare=False)
    timing: Mapping[str, Any] | None = field(default=None, compare=False)

    @property
    def key(self) -> RowKey:
        return row_key(self.test_id, self.profile)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``Profile.to_dict()`` plus the row's own keys (absent ones left out)."""
        data = {**self.profile.to_dict(), "test_id": self.test_id, "problems": list(self.problems),
                "skipped_matmul_ops": self.profile.skipped_matmul_ops, "verdict": self.verdict}
        for name in _OPTIONAL:
            value = getattr(self, name)
            if value is not None:
                data[name] = dict(value) if isinstance(value, Mapping) else value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Row:
        """Inverse of :meth:`to_dict` (a JSON report's or baseline's entry reads as a row too)."""
        return cls(str(data["test_id"]), Profile.from_dict(data), tuple(data.get("problems") or ()),
                   str(data.get("verdict") or "-"), **{name: data.get(name) for name in _OPTIONAL})

    def replace(self, **changes: Any) -> Row:
        return dataclasses.replace(self, **changes)

    @property
    def where(self) -> str:
        """``test [model n=512]``: how sections name the row."""
        return f"{self.test_id} [{self.profile.name} n={self.profile.n}]"


def sort_rows(rows: Iterable[Row]) -> list[Row]:
    """By the row identity: serial and xdist runs print the same table."""
    return sorted(rows, key=lambda r: r.key)


@dataclass(frozen=True)
class SweepRow:
    """One sweep in one test: the :class:`Sweep`, the crossover bounds it broke, its plots once drawn."""

    test_id: str
    sweep: Sweep
    problems: tuple[str, ...] = ()
    plots: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str, tuple[int, ...]]:
        return (self.test_id, self.sweep.name, tuple(self.sweep.lengths))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``Sweep.to_dict()`` (its profiles included) plus the test id, problems and plots."""
        data = {**self.sweep.to_dict(), "test_id": self.test_id, "problems": list(self.problems)}
        if self.plots:
            data["plots"] = list(self.plots)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SweepRow:
        """Inverse of :meth:`to_dict`: the profiles are read back and the thresholds solved again, exactly."""
        return cls(test_id=str(data["test_id"]), sweep=Sweep([Profile.from_dict(p) for p in data["profiles"]]),
                   problems=tuple(data.get("problems") or ()), plots=tuple(data.get("plots") or ()))


_COLUMNS = (
    "test", "model", "n", "batch", "total", "attention", "FFN", "other",
    "attn share", "quad share", "deviation", "lin. saving", "verdict",
)


def deviation_cell(value: float | None) -> str:
    if value is None:
        return "n/a"
    return "0" if value == 0 else f"{value:.2%}"


VERDICT_LEGEND = "verdict: ok (its bounds held), FAIL (one broke), - (nothing bounded it)"
WARNINGS_HEADER = "warnings (these numbers may be wrong; --attncost-strict fails them)"
TIME_HEADER = "measured time beside the MACs (reported, never gated by a baseline)"


def _model_cell(row: Row) -> str:
    """The name, and how it was counted when that is not the default."""
    p = row.profile
    notes = []
    if p.backend != "fvcore":
        notes.append(p.backend + (" fallback" if p.fallback else ""))
    if p.mode == "decode":
        notes.append(f"decode +{p.new_tokens or 1}")  # n is then the tokens in the KV cache
    elif p.mode != "forward":
        notes.append(p.mode)
    if p.causal_applied:
        notes.append(f"causal {p.causal}")
    if p.warnings:
        notes.append(f"{len(p.warnings)} warning{'s' if len(p.warnings) > 1 else ''}")
    return f"{p.name} ({', '.join(notes)})" if notes else p.name


def _cells(row: Row, unit: str, baseline: bool, crosscheck: bool) -> list[str]:
    p, saving = row.profile, row.profile.linear_attention_saving
    extra = [row.vs_baseline or "-"] if baseline else []
    if crosscheck:
        extra.append("-" if not row.crosscheck else "yes" if row.crosscheck.get("agree") else "NO")
    return [
        row.test_id,
        _model_cell(row),
        str(p.n) if p.m is None or p.m == p.n else f"{p.n} (m {p.m})",
        str(p.batch),
        *(format_count(getattr(p, part), unit, suffix=False) for part in ("total", "attention", "ffn", "other")),
        f"{p.attention_share:.3f}",
        f"{p.quadratic_share:.3f}",
        deviation_cell(p.deviation),
        "-" if saving is None else f"{saving:.2%}",
        *extra,
        row.verdict,
    ]


def _table(rows: Sequence[Row], unit: str) -> tuple[list[str], list[list[str]]]:
    """The table's headers and cells: a 'vs baseline' and an 'agree' column where any row has one."""
    baseline, crosscheck = any(r.vs_baseline is not None for r in rows), any(r.crosscheck is not None for r in rows)
    headers = [f"{c} [{unit.upper()}]" if c in ("total", "attention", "FFN", "other") else c for c in _COLUMNS]
    headers[-1:] = [*(["vs baseline"] if baseline else []), *(["agree"] if crosscheck else []), headers[-1]]
    return headers, [_cells(r, unit, baseline, crosscheck) for r in rows]


# --- sections: what follows the table, the same in every format ---------------------------


@dataclass(frozen=True)
class Section:
    """A titled list of lines under the table; *images* (per line) are linked in Markdown only."""

    title: str
    lines: list[str]
    images: dict[int, list[str]] = field(default_factory=dict)


def _spec_text(spec: ModelSpec) -> str:
    parts = [f"hidden {spec.hidden}", f"{spec.heads} heads x {spec.head_dim}"]
    if spec.kv_heads:
        parts.append(f"{spec.kv_heads} kv heads")
    parts.append(f"ffn {spec.ffn_dim}{' gated' if spec.gated else ''}")
    if spec.cross_attention:
        parts.append("cross-attention")
    parts.append(f"{spec.layers} layers")
    return ", ".join(parts)


def threshold_lines(rows: Sequence[Row]) -> list[str]:
    """One line per distinct spec and mode: where attention overtakes the FFN and where the core dominates (a
    decode step's n being the context its new token attends to)."""
    seen: dict[tuple[ModelSpec, str], str] = {}
    for row in rows:
        spec, mode = row.profile.spec, row.profile.mode
        if spec is not None and (spec, mode) not in seen:
            first, second = threshold_notes(row.profile)
            label = ", a decode step (n: the context of its new token)" if mode == "decode" else ""
            inferred = "inferred: " if is_inferred(row.profile.notes) else ""
            seen[(spec, mode)] = f"{row.profile.name} ({inferred}{_spec_text(spec)}{label}): {first}; {second}"
    return list(seen.values())


def unsupported_lines(rows: Sequence[Row]) -> list[str]:
    """Ops fvcore skipped, one line per model and set of ops (a model skips the same ops at every length, so its
    profiles share a line that names the first three); matrix products among them are flagged."""
    groups: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        ops = row.profile.unsupported_ops
        if not ops:
            continue
        skipped = set(row.profile.skipped_matmul_ops)
        text = ", ".join(f"{op.removeprefix('aten::')} x{count}" + (" (MATMUL, not counted!)" if op in skipped else "")
                         for op, count in sorted(ops.items()))
        groups.setdefault((row.profile.name, text), []).append(f"{row.test_id} n={row.profile.n}")
    return [f"{name} [{', '.join(where[:3])}" + (f" and {len(where) - 3} more" if len(where) > 3 else "") + f"]: {text}"
            for (name, text), where in groups.items()]


def time_lines(rows: Sequence[Row]) -> list[str]:
    """Per measured profile: attention's share of the MACs and of the time, and on this CPU each part's roofline
    time beside its measured time; then, per model, where the shares disagree most."""
    measured = [(row, row.timing) for row in rows if row.timing]
    lines = []
    for row, t in measured:
        spread = t.get("spread", {}).get("attention_time_share")
        plus = f" ± {spread:.3f}" if isinstance(spread, (int, float)) else ""
        lines.append(f"{row.where}: attention {t['attention_mac_share']:.3f} of "
                     f"MACs, {t['attention_time_share']:.3f}{plus} of time; forward "
                     f"{t['seconds']['forward'] * 1000:.1f} ms on {t.get('device_name') or t.get('device')} "
                     f"({t['repeats']} repeats)")
        if t.get("device") == "cpu" and t.get("dtype") == row.profile.dtype == "float32" and row.profile.moved:
            roofs = row.profile.roofline("cpu")
            lines.append(f"{row.where}: roofline of {devices.this_cpu().name}, predicted / measured: " + ", ".join(
                f"{'forward' if r.part == 'total' else r.part} {format_seconds(r.seconds)} / "
                f"{format_seconds(t['seconds']['forward' if r.part == 'total' else r.part])}"
                for r in roofs if r.flops))

    for name in sorted({row.profile.name for row, _ in measured}):
        widest, t = max(((row, t) for row, t in measured if row.profile.name == name),
                        key=lambda pair: abs(pair[1]["attention_time_share"] - pair[1]["attention_mac_share"]))
        lines.append(f"{name}: attention: {t['attention_mac_share']:.0%} of MACs, {t['attention_time_share']:.0%} "
                     f"of time at n={widest.profile.n} on {t.get('device_name') or t.get('device')} (widest gap)")
    return lines


def crosscheck_lines(rows: Sequence[Row]) -> list[str]:
    """Both backends' verdicts; ``other`` may differ (elementwise ops count differently)."""
    lines = []
    for row in rows:
        cross = row.crosscheck
        if not cross or cross.get("agree") is None:
            continue
        head = f"{row.test_id} [{row.profile.name}]"
        if "error" in cross:
            lines.append(f"{head}: {cross['error']}")
            continue
        first, second = cross["backends"]
        lines.append(f"{head}: {'agree' if cross['agree'] else 'DISAGREE'}; "
                     f"other {first} {cross[first]['other']:,} vs {second} {cross[second]['other']:,} MAC")
    return lines


def _tokens(value: Any) -> str:
    return format_tokens(None if value is None else float(value))


def sweep_lines(sweeps: Sequence[SweepRow]) -> list[str]:
    """One line per sweep: thresholds solved from the measurements, beside the formula's."""
    lines = []
    for row in sweeps:
        sweep = row.sweep
        head = f"{row.test_id} [{sweep.name} n={sweep.lengths}]"
        try:
            crossover, quadratic = sweep.crossover(), sweep.quadratic_crossover()
        except SweepError as exc:
            lines.append(f"{head}: {exc}")
            continue
        lines.append(f"{head}: attention = FFN at n={_tokens(crossover)} (formula "
                     f"{_tokens(sweep.formula_crossover())}); quadratic term = linear terms at n={_tokens(quadratic)} "
                     f"(formula {_tokens(sweep.formula_quadratic_crossover())})")
    return lines


def skipped_line(rows: Sequence[Row]) -> list[str]:
    """The skipped ops in one line: how many kinds in how many profiles, the matrix products among them named
    (they are MACs missing from the counts); ``--attncost-report-full`` lists them per model."""
    kinds = {op for row in rows for op in row.profile.unsupported_ops}
    if not kinds:
        return []
    matmuls = sorted({op.removeprefix("aten::") for row in rows for op in row.profile.skipped_matmul_ops})
    profiles = sum(1 for row in rows if row.profile.unsupported_ops)
    products = f"; MATMUL, not counted: {', '.join(matmuls)}" if matmuls else "; none multiplies matrices"
    return [f"{len(kinds)} kinds of op in {profiles} profile{'s' if profiles > 1 else ''}{products} "
            "(--attncost-report-full lists them)"]


def sections(rows: Sequence[Row], sweeps: Sequence[SweepRow] = (), full: bool = True) -> list[Section]:
    """Everything under the table, in order; empty sections are left out. Rows must be sorted. Without *full*,
    the skipped ops are one line."""
    plots = {i: paths for i, row in enumerate(sweeps) if (paths := [p for p in row.plots if p.endswith(".png")])}
    found = [
        Section("thresholds (per layer, from the formula)", threshold_lines(rows)),
        Section("sweeps (thresholds solved exactly from the measured counts)", sweep_lines(sweeps), plots),
        Section("ops fvcore skipped (not in the counts; elementwise ops are expected here)",
                unsupported_lines(rows) if full else skipped_line(rows)),
        Section("KV cache of the decode steps (n = tokens already in the cache)",  # every layer's K and V
                [f"{row.where}: {format_bytes(int(held))} ({int(held):,} bytes) for {row.profile.n:,} cached tokens, "
                 f"batch {row.profile.batch}" for row in rows if (held := row.profile.kv_cache_bytes)]),
        Section("memory (estimated on fake tensors with CPU kernels; see docs/memory.md)",
                [f"{row.where}: {row.profile.memory.summary()}" for row in rows if row.profile.memory is not None]),
        Section(TIME_HEADER, time_lines(rows)),
        Section(WARNINGS_HEADER, [f"{row.where}: {warning}" for row in rows for warning in row.profile.warnings]),
        Section("counted by the torch backend because fvcore could not trace",
                [f"{r.test_id} [{r.profile.name}]: {r.profile.fallback}" for r in rows if r.profile.fallback]),
        Section("cross-check (attention_core, attention_proj, ffn must agree; other may differ)",
                crosscheck_lines(rows)),
        Section("checks failed", [f"{r.test_id} [{r.profile.name}]: {p}" for r in rows for p in r.problems]),
    ]
    return [section for section in found if section.lines]


def _short_ids(ids: Sequence[str]) -> list[str]:
    """Test ids without the directory they all share (``examples/``)."""
    directories = [i.split("::", 1)[0].rpartition("/")[0] for i in ids]
    common = os.path.commonpath(directories) if all(directories) else ""
    return [i[len(common) + 1 :] for i in ids] if common else list(ids)


def _end_cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def _cut_id(text: str, width: int) -> str:
    """A test id cut at the end of its name (where names of one file differ least), its parameter id
    (``[n=512]``, what tells rows apart) whole; a parameter id too long for that is cut at its end too."""
    name, bracket, param = text.partition("[")
    if len(text) <= width:
        return text
    if not bracket:
        return _end_cut(text, width)
    if len(param) + 1 > width - 5:  # keep four characters of the name and the ellipsis
        return _end_cut(name, 5) + "[" + _end_cut(param[:-1], width - 7) + "]"
    return _end_cut(name, width - len(param) - 1) + "[" + param


def _cut_name(text: str, width: int) -> str:
    """A model name cut at the end of a word (``GPTNeoX…`` of ``GPTNeoXForCausalLM``), in the middle when no word
    ends in the first half."""
    if len(text) <= width:
        return text
    ends = [i for i in range(width // 2, width) if not text[i].isalnum() or text[i].isupper() and text[i - 1].islower()]
    if ends:
        return text[: ends[-1]].rstrip(" -_.(/[") + "…"
    keep = width - 1
    return text[: keep // 2] + "…" + text[len(text) - (keep - keep // 2) :]


def _fit(headers: list[str], body: list[list[str]], width: int) -> tuple[list[str], list[list[str]]]:
    """Fit the table to *width*: shorter test ids, then fewer columns (least essential first; the cross-check's
    agreement has its own section), then ids and names cut further. The test, model, n and verdict always stay."""
    def total(h: list[str], b: list[list[str]]) -> int:
        return sum(max(len(x), *(len(r[i]) for r in b)) for i, x in enumerate(h)) + 2 * (len(h) - 1)

    def drop(columns: Sequence[str]) -> None:
        nonlocal headers, body
        for column in columns:
            if total(headers, body) <= width:
                return
            index = next((i for i, h in enumerate(headers) if h.split(" [")[0] == column), None)
            if index is not None and not (column == "batch" and any(r[index] != "1" for r in body)):
                headers = headers[:index] + headers[index + 1 :]
                body = [r[:index] + r[index + 1 :] for r in body]

    def cut(column: int, least: int) -> None:
        nonlocal body
        excess = total(headers, body) - width
        if excess > 0:
            longest = max(len(headers[column]), *(len(r[column]) for r in body))
            room = max(least, len(headers[column]), longest - excess)
            how = _cut_id if column == 0 else _cut_name
            body = [[*r[:column], how(r[column], room), *r[column + 1 :]] for r in body]

    if total(headers, body) > width:
        names = [r[0].rpartition("::")[2] for r in body]
        files = {r[0].rpartition("::")[0] for r in body}
        # one file, or test names that say which test they are on their own: drop the file part
        if len(files) == 1 or len(set(names)) == len({r[0] for r in body}):
            body = [[name, *r[1:]] for name, r in zip(names, body)]
    drop(("other", "lin. saving", "quad share", "agree", "batch"))
    cut(0, 32)
    cut(1, 20)
    drop(("deviation", "FFN", "attention"))
    cut(1, 14)
    cut(0, 16)
    drop(("attn share",))
    cut(0, 8)
    drop(("vs baseline", "total"))
    return headers, body


def _wrap(line: str, width: int | None, indent: str = "    ") -> list[str]:
    if width is None or len(line) <= width:
        return [line]
    lead = line[: len(line) - len(line.lstrip())]
    return textwrap.wrap(line, width, initial_indent="", subsequent_indent=lead + indent,
                         break_on_hyphens=False) or [line]


def render_terminal(rows: Sequence[Row], unit: str = "mac", sweeps: Sequence[SweepRow] = (),
                    width: int | None = None, full: bool = False) -> list[str]:
    """The report as terminal lines (no section header: the caller writes it).

    With a *width*, the table keeps its essential columns and shortened test ids so that every
    line fits, and long lines wrap with indentation; ``full=True`` keeps every column.
    """
    rows = sort_rows(rows)
    if not rows:
        return _wrap("no profiles were made in this session", width)
    headers, body = _table(rows, unit)
    if not full:
        for cells, short in zip(body, _short_ids([r.test_id for r in rows])):
            cells[0] = short
        if width is not None:
            headers, body = _fit(headers, body, width)
    lines = table(headers, body)
    lines.append(f"counts in {unit.upper()} (1 MAC = 2 FLOP), decimal prefixes (G = 1e9); "
                 "shares are of attention + FFN; deviation is the largest relative difference from the formula; "
                 f"{VERDICT_LEGEND}")
    for section in sections(rows, sweeps, full):
        lines += ["", section.title + ":", *(f"  {line}" for line in section.lines)]
        plotted = [path for paths in section.images.values() for path in paths]
        if plotted:
            lines.append(f"  plots: {len(plotted)} PNG (and SVG) in {Path(plotted[0]).parent}")
    return [wrapped for line in lines for wrapped in _wrap(line, width)]


def markdown_text(text: str) -> str:
    """*text* (a model name, a message) as Markdown that renders as written: no HTML tag or autolink (``<``
    escaped), no code span (backticks), no inline link (``](``), on one line; backslashes kept as such."""
    text = " ".join(text.splitlines())
    return re.sub(r"[\\`<]", lambda m: "\\" + m.group(), text).replace("](", "]\\(")


def markdown_code(text: str, *, cell: bool = False) -> str:
    """*text* (a test id) as a Markdown code span that nothing in it can end: fenced by one backtick more than
    its longest run of them (spaced when it starts or ends with one), on one line; inside a code span HTML and
    links are text. In a table *cell*, pipes are escaped (GitHub reads ``\\|`` in a code span as ``|``)."""
    text = " ".join(text.splitlines())
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    pad = " " if text[:1] == "`" or text[-1:] == "`" else ""
    span = f"{fence}{pad}{text}{pad}{fence}"
    return span.replace("|", "\\|") if cell else span


def _markdown_line(line: str, ids: Sequence[str]) -> str:
    """A section's line: every test id in it (*ids* longest first) a code span, the rest :func:`markdown_text`."""
    out, start, index = [], 0, 0
    while index < len(line):
        found = next((i for i in ids if line.startswith(i, index)), None)
        if found is None:
            index += 1
            continue
        out += [markdown_text(line[start:index]), markdown_code(found)]
        index = start = index + len(found)
    return "".join([*out, markdown_text(line[start:])])


def render_markdown(rows: Sequence[Row], unit: str = "mac", sweeps: Sequence[SweepRow] = (),
                    base: Path | None = None, link_plots: bool = True) -> str:
    """A GitHub-flavoured Markdown table, pasteable into a pull request; plots linked relative to *base*.

    ``link_plots=False`` for GitHub's step summary, which cannot show files of the runner.
    """
    rows = sort_rows(rows)
    out = ["## attncost report", ""]
    if not rows:
        return "\n".join([*out, "No profiles were made in this session.", ""])
    headers, body = _table(rows, unit)
    out.append("| " + " | ".join(headers) + " |")
    out.append("|" + "|".join("---" if i in (0, 1, len(headers) - 1) else "---:" for i in range(len(headers))) + "|")
    out += ["| " + " | ".join([markdown_code(cells[0], cell=True),
                               *(markdown_text(c).replace("|", "\\|") for c in cells[1:])]) + " |" for cells in body]
    out += ["", f"Counts in {unit.upper()} (1 MAC = 2 FLOP), decimal prefixes (G = 10⁹); shares are of attention "
                "+ FFN; deviation is the largest relative difference from the formula."]
    # test ids in code spans, as in the table: ids such as test_x[<lambda>] or a__b__c stay as written
    ids = sorted({r.test_id for r in rows} | {s.test_id for s in sweeps}, key=len, reverse=True)
    for section in sections(rows, sweeps):
        out += ["", f"**{section.title[0].upper()}{section.title[1:]}:**", ""]
        for index, line in enumerate(section.lines):
            out.append(f"- {_markdown_line(line, ids)}")
            for path in section.images.get(index, []) if link_plots else ():
                target = Path(path) if base is None else Path(os.path.relpath(path, base))
                out.append(f"  ![{target.stem}]({target.as_posix()})")
    return "\n".join(out) + "\n"


def render_json(rows: Sequence[Row], unit: str = "mac", sweeps: Sequence[SweepRow] = ()) -> str:
    """The versioned JSON document: sorted keys and rows, fixed indentation, no NaN."""
    return render_documents([row.to_dict() for row in sort_rows(rows)],
                            [row.to_dict() for row in sorted(sweeps, key=lambda s: s.key)])


def render_documents(entries: Sequence[Mapping[str, Any]], sweeps: Sequence[Mapping[str, Any]] = ()) -> str:
    """The JSON document around rows already in their JSON form (baselines write these)."""
    document: dict[str, Any] = {"schema": SCHEMA, "unit": "MAC", "versions": versions(), "profiles": list(entries)}
    if sweeps:
        document["sweeps"] = [{k: v for k, v in s.items() if k != "profiles"} for s in sweeps]
    return json.dumps(document, indent=2, sort_keys=True, allow_nan=False) + "\n"


#: The formats ``--attncost-export=FORMAT:PATH`` writes.
EXPORTS = ("github-action-benchmark", "bencher")


def render_export(kind: str, rows: Sequence[Row]) -> str:
    """The rows as a dashboard's input: one benchmark per test x profile (its n, m, batch, mode, causal and
    backend in the name), with the MACs of each part and the whole, the attention share and a decode step's KV
    cache bytes: github-action-benchmark's ``customSmallerIsBetter`` list of ``{name, unit, value, extra}``, or
    Bencher's metric format ``{benchmark: {measure: {value}}}``."""
    entries = []
    for row in sort_rows(rows):
        test_id, model, n, batch = key_label(row.key)
        name, p = f"{test_id} {model} n={n} batch={batch}", row.profile
        figures = [(f"{part}-macs", "MAC", getattr(p, part)) for part in (*PARTS, "total")]
        figures.append(("attention-share", "share", p.attention_share))
        if p.kv_cache_bytes is not None:
            figures.append(("kv-cache-bytes", "bytes", p.kv_cache_bytes))
        entries.append((name, figures, p))
    if kind == "bencher":
        document: Any = {name: {measure: {"value": value} for measure, _, value in figures}
                         for name, figures, _ in entries}
    else:
        document = [{"name": f"{name} {measure}", "unit": unit, "value": value,
                     "extra": f"{p.backend}, {p.mode}, causal={p.causal}; torch {p.versions.get('torch', '?')}"}
                    for name, figures, p in entries for measure, unit, value in figures]
    return json.dumps(document, indent=2, sort_keys=True, allow_nan=False) + "\n"
