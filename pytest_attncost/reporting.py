"""Renderers for the attncost report: terminal table, Markdown and JSON, from plain row dicts.

A row is ``Profile.to_dict()`` plus ``test_id``, ``outcome``, ``verdict`` and
``problems``. Renderers never see the pytest config, so each is a plain function.
"""

from __future__ import annotations

import json
import os
import textwrap
import sys
from collections.abc import Iterable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from .markers import threshold_notes
from .units import format_bytes, format_count, format_tokens

__all__ = ["SCHEMA", "render_json", "render_markdown", "render_terminal", "sort_rows", "table", "write_atomic"]

SCHEMA = 1

Row = Mapping[str, Any]

_COLUMNS = (
    "test", "model", "n", "batch", "total", "attention", "FFN", "other",
    "attn share", "quad share", "deviation", "lin. saving", "verdict",
)


def sort_rows(rows: Iterable[Row]) -> list[Row]:
    """By test id, then model name, n and batch: serial and xdist runs print the same table."""
    return sorted(rows, key=lambda r: (r["test_id"], r["name"], r["n"], r["batch"], r.get("mode", "forward"),
                                       r.get("causal", "full"), r.get("backend", "fvcore")))


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.2%}"


def _deviation(value: float | None) -> str:
    if value is None:
        return "n/a"
    return "0" if value == 0 else f"{value:.2%}"


def _has_baseline(rows: Sequence[Row]) -> bool:
    return any("vs_baseline" in row for row in rows)


WARNINGS_HEADER = "warnings (these numbers may be wrong; --attncost-strict fails them)"


def _has_crosscheck(rows: Sequence[Row]) -> bool:
    return any("crosscheck" in row for row in rows)


def _model_cell(row: Row) -> str:
    """The name, and how it was counted when that is not the default."""
    notes = []
    if row.get("backend", "fvcore") != "fvcore":
        notes.append(row["backend"] + (" fallback" if row.get("fallback") else ""))
    if row.get("mode") == "decode":
        notes.append(f"decode +{row.get('new_tokens') or 1}")  # n is then the tokens in the KV cache
    elif row.get("mode", "forward") != "forward":
        notes.append(row["mode"])
    if row.get("causal_applied"):
        notes.append("causal half")
    if row.get("warnings"):
        notes.append(f"{len(row['warnings'])} warning{'s' if len(row['warnings']) > 1 else ''}")
    return f"{row['name']} ({', '.join(notes)})" if notes else row["name"]


TIME_HEADER = "measured time beside the MACs (reported, never gated by a baseline)"


def time_lines(rows: Sequence[Row]) -> list[str]:
    """Per measured profile: attention's share of the MACs and of the time; then, per model, where they
    disagree most."""
    measured = [row for row in rows if row.get("timing")]
    if not measured:
        return []
    lines = []
    for row in measured:
        t = row["timing"]
        spread = t.get("spread", {}).get("attention_time_share")
        plus = f" ± {spread:.3f}" if isinstance(spread, (int, float)) else ""
        lines.append(f"{row['test_id']} [{row['name']} n={row['n']}]: attention {t['attention_mac_share']:.3f} of "
                     f"MACs, {t['attention_time_share']:.3f}{plus} of time; forward "
                     f"{t['seconds']['forward'] * 1000:.1f} ms on {t.get('device_name') or t.get('device')} "
                     f"({t['repeats']} repeats)")
    worst: dict[str, Row] = {}
    for row in measured:
        t = row["timing"]
        gap = abs(t["attention_time_share"] - t["attention_mac_share"])
        best = worst.get(row["name"])
        if best is None or gap > abs(best["timing"]["attention_time_share"] - best["timing"]["attention_mac_share"]):
            worst[row["name"]] = row
    for name in sorted(worst):
        t = worst[name]["timing"]
        lines.append(f"{name}: attention: {t['attention_mac_share']:.0%} of MACs, {t['attention_time_share']:.0%} "
                     f"of time at n={worst[name]['n']} on {t.get('device_name') or t.get('device')} (widest gap)")
    return lines


def kv_cache_lines(rows: Sequence[Row]) -> list[str]:
    """The KV cache each decode step read: its n tokens, every layer, K and V."""
    return [f"{row['test_id']} [{row['name']} n={row['n']}]: {format_bytes(int(row['kv_cache_bytes']))} "
            f"({int(row['kv_cache_bytes']):,} bytes) for {row['n']:,} cached tokens, batch {row['batch']}"
            for row in rows if row.get("kv_cache_bytes")]


def warning_lines(rows: Sequence[Row]) -> list[str]:
    """Every profile's warnings: numbers the plugin cannot stand behind, and why."""
    return [f"{row['test_id']} [{row['name']} n={row['n']}]: {warning}"
            for row in rows for warning in row.get("warnings") or ()]


def _agree(row: Row) -> str:
    check = row.get("crosscheck")
    if not check:
        return "-"
    return "yes" if check.get("agree") else "NO"


def _cells(row: Row, unit: str, baseline: bool = False, crosscheck: bool = False) -> list[str]:
    extra = [row.get("vs_baseline", "-")] if baseline else []
    if crosscheck:
        extra.append(_agree(row))
    return [
        row["test_id"],
        _model_cell(row),
        str(row["n"]),
        str(row["batch"]),
        format_count(row["total"], unit, suffix=False),
        format_count(row["attention"], unit, suffix=False),
        format_count(row["ffn"], unit, suffix=False),
        format_count(row["other"], unit, suffix=False),
        f"{row['attention_share']:.3f}",
        f"{row['quadratic_share']:.3f}",
        _deviation(row["deviation"]),
        _percent(row["linear_attention_saving"]),
        *extra,
        row.get("verdict", "-"),
    ]


def _headers(unit: str, baseline: bool = False, crosscheck: bool = False) -> list[str]:
    label = unit.upper()
    columns = [f"{c} [{label}]" if c in ("total", "attention", "FFN", "other") else c for c in _COLUMNS]
    if baseline:
        columns.insert(len(columns) - 1, "vs baseline")
    if crosscheck:
        columns.insert(len(columns) - 1, "agree")
    return columns


def _spec_text(spec: Mapping[str, Any]) -> str:
    parts = [f"hidden {spec['hidden']}", f"{spec['heads']} heads x {spec['head_dim']}"]
    if spec.get("kv_heads"):
        parts.append(f"{spec['kv_heads']} kv heads")
    parts.append(f"ffn {spec['ffn_dim']}{' gated' if spec.get('gated') else ''}")
    if spec.get("cross_attention"):
        parts.append("cross-attention")
    parts.append(f"{spec['layers']} layers")
    return ", ".join(parts)


def threshold_lines(rows: Sequence[Row]) -> list[str]:
    """One line per distinct spec: where attention overtakes the FFN and where the core dominates."""
    seen: dict[str, str] = {}
    for row in rows:
        spec = row.get("spec")
        if not spec:
            continue
        key = json.dumps(spec, sort_keys=True)
        if key not in seen:
            first, second = threshold_notes(row)
            seen[key] = f"{row['name']} ({_spec_text(spec)}): {first}; {second}"
    return list(seen.values())


def unsupported_lines(rows: Sequence[Row]) -> list[str]:
    """Ops fvcore skipped, one line per model and set of ops; matrix products among them are flagged.

    Profiles of one model usually skip the same ops at every length, so they share a line
    that names them all (the first three, then how many more).
    """
    groups: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        ops = row.get("unsupported_ops") or {}
        if not ops:
            continue
        skipped = set(row.get("skipped_matmul_ops") or {})
        text = ", ".join(f"{op.removeprefix('aten::')} x{count}" + (" (MATMUL, not counted!)" if op in skipped else "")
                         for op, count in sorted(ops.items()))
        groups.setdefault((row["name"], text), []).append(f"{row['test_id']} n={row['n']}")
    lines = []
    for (name, text), where in groups.items():
        shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
        lines.append(f"{name} [{shown}]: {text}")
    return lines


def table(headers: Sequence[str], body: Sequence[Sequence[str]], *, right: Iterable[int] | None = None,
          rule: bool = True) -> list[str]:
    """Lines of a plain-text table: the one formatter of the report and the CLI.

    Args:
        headers: column titles.
        body: rows of cells, already formatted.
        right: indices of the right-aligned (numeric) columns; default: all but the first two and the last,
            the report's layout (test and model on the left, verdict last).
        rule: a line of dashes under the headers.
    """
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    numeric = set(range(2, len(headers) - 1) if right is None else right)

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    return [line(headers), *([line(["-" * w for w in widths])] if rule else []), *(line(r) for r in body)]


_table = table  # the name the report's renderers used before the CLI shared it


def sweep_lines(sweeps: Sequence[Row]) -> list[str]:
    """One line per sweep: thresholds solved from the measurements, beside the formula's."""
    lines = []
    for data in sweeps:
        head = f"{data['test_id']} [{data['name']} n={data['lengths']}]"
        if data.get("error"):
            lines.append(f"{head}: {data['error']}")
            continue
        lines.append(
            f"{head}: attention = FFN at n={format_tokens(data['crossover_n'])} "
            f"(formula {format_tokens(data['formula_crossover_n'])}); quadratic term = linear terms at "
            f"n={format_tokens(data['quadratic_crossover_n'])} (formula {format_tokens(data['formula_quadratic_n'])})"
        )
    return lines


def _short_ids(ids: Sequence[str]) -> list[str]:
    """Test ids without the directory they all share (``examples/``)."""
    directories = [i.split("::", 1)[0].rpartition("/")[0] for i in ids]
    common = os.path.commonpath(directories) if all(directories) else ""
    if not common:
        return list(ids)
    return [i[len(common) + 1 :] for i in ids]


def _middle_cut(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    keep = width - 1
    return text[: keep // 2] + "…" + text[len(text) - (keep - keep // 2) :]


def _fit(headers: list[str], body: list[list[str]], width: int) -> tuple[list[str], list[list[str]]]:
    """Fit the table to *width*: shorter test ids, then fewer columns, then ids and names cut in the middle.

    Columns go least essential first (other, linear saving, quadratic share, a batch of 1), then
    the ids are cut to 32 characters, then the counts go (FFN, attention, deviation, total);
    the test, model, n, attention share and verdict always stay.
    """
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
            body = [[*r[:column], _middle_cut(r[column], room), *r[column + 1 :]] for r in body]

    if total(headers, body) > width:
        names = [r[0].rpartition("::")[2] for r in body]
        files = {r[0].rpartition("::")[0] for r in body}
        # one file, or test names that say which test they are on their own: drop the file part
        if len(files) == 1 or len(set(names)) == len({r[0] for r in body}):
            body = [[name, *r[1:]] for name, r in zip(names, body)]
    drop(("other", "lin. saving", "quad share", "batch"))
    cut(0, 32)
    cut(1, 20)
    drop(("FFN", "attention", "deviation", "total"))
    cut(1, 14)
    cut(0, 16)
    cut(0, 8)
    return headers, body


def _wrap(line: str, width: int | None, indent: str = "    ") -> list[str]:
    if width is None or len(line) <= width:
        return [line]
    lead = line[: len(line) - len(line.lstrip())]
    return textwrap.wrap(line, width, initial_indent="", subsequent_indent=lead + indent,
                         break_on_hyphens=False) or [line]


def render_terminal(rows: Sequence[Row], unit: str = "mac", sweeps: Sequence[Row] = (),
                    width: int | None = None, full: bool = False) -> list[str]:
    """The report as terminal lines (no section header: the caller writes it).

    With a *width*, the table keeps its essential columns and shortened test ids so that every
    line fits, and long lines wrap with indentation; ``full=True`` keeps every column.
    """
    lines = [wrapped for line in _render_terminal(rows, unit, sweeps, width, full) for wrapped in _wrap(line, width)]
    return lines


def _render_terminal(rows: Sequence[Row], unit: str, sweeps: Sequence[Row], width: int | None,
                     full: bool) -> list[str]:
    rows = sort_rows(rows)
    if not rows:
        return ["no profiles were made in this session"]
    baseline, crosscheck = _has_baseline(rows), _has_crosscheck(rows)
    headers = _headers(unit, baseline, crosscheck)
    body = [_cells(r, unit, baseline, crosscheck) for r in rows]
    if not full:
        for cells, short in zip(body, _short_ids([r["test_id"] for r in rows])):
            cells[0] = short
        if width is not None:
            headers, body = _fit(headers, body, width)
    lines = _table(headers, body)
    lines.append(f"counts in {unit.upper()} (1 MAC = 2 FLOP), decimal prefixes (G = 1e9); "
                 "shares are of attention + FFN; deviation is the largest relative difference from the formula")
    thresholds = threshold_lines(rows)
    if thresholds:
        lines += ["", "thresholds (per layer, from the formula):", *(f"  {t}" for t in thresholds)]
    if sweeps:
        lines += ["", "sweeps (thresholds solved exactly from the measured counts):",
                  *(f"  {t}" for t in sweep_lines(sweeps))]
        plotted = [path for data in sweeps for path in data.get("plots", []) if path.endswith(".png")]
        if plotted:
            lines += [f"  plots: {len(plotted)} PNG (and SVG) in {Path(plotted[0]).parent}"]
    unsupported = unsupported_lines(rows)
    if unsupported:
        lines += ["", "ops fvcore skipped (not in the counts; elementwise ops are expected here):",
                  *(f"  {u}" for u in unsupported)]
    cached = kv_cache_lines(rows)
    if cached:
        lines += ["", "KV cache of the decode steps (n = tokens already in the cache):", *(f"  {c}" for c in cached)]
    timed = time_lines(rows)
    if timed:
        lines += ["", TIME_HEADER + ":", *(f"  {t}" for t in timed)]
    warned = warning_lines(rows)
    if warned:
        lines += ["", WARNINGS_HEADER + ":", *(f"  {w}" for w in warned)]
    fallbacks = [r for r in rows if r.get("fallback")]
    if fallbacks:
        lines += ["", "counted by the torch backend because fvcore could not trace:",
                  *(f"  {r['test_id']} [{r['name']}]: {r['fallback']}" for r in fallbacks)]
    checked = [r for r in rows if r.get("crosscheck") and r["crosscheck"].get("agree") is not None]
    if checked:
        lines += ["", "cross-check (attention_core, attention_proj, ffn must agree; other may differ):"]
        for row in checked:
            cross: Mapping[str, Any] = row["crosscheck"]
            if "error" in cross:
                lines.append(f"  {row['test_id']} [{row['name']}]: {cross['error']}")
                continue
            first, second = cross["backends"]
            a, b = cross[first], cross[second]
            lines.append(f"  {row['test_id']} [{row['name']}]: {'agree' if cross['agree'] else 'DISAGREE'}; "
                         f"other {first} {a['other']:,} vs {second} {b['other']:,} MAC")
    failed = [r for r in rows if r.get("problems")]
    if failed:
        lines += ["", "checks failed:"]
        for row in failed:
            lines += [f"  {row['test_id']} [{row['name']}]: {p}" for p in row["problems"]]
    return lines


def render_markdown(rows: Sequence[Row], unit: str = "mac", sweeps: Sequence[Row] = (),
                    base: Path | None = None, link_plots: bool = True) -> str:
    """A GitHub-flavoured Markdown table, pasteable into a pull request; plots linked relative to *base*.

    ``link_plots=False`` for GitHub's step summary, which cannot show files of the runner.
    """
    rows = sort_rows(rows)
    out = ["## attncost report", ""]
    if not rows:
        return "\n".join([*out, "No profiles were made in this session.", ""])
    baseline, crosscheck = _has_baseline(rows), _has_crosscheck(rows)
    headers = _headers(unit, baseline, crosscheck)
    out.append("| " + " | ".join(headers) + " |")
    last = len(headers) - 1
    out.append("|" + "|".join("---" if i in (0, 1, last) else "---:" for i in range(len(headers))) + "|")
    for row in rows:
        cells = [c.replace("|", "\\|") for c in _cells(row, unit, baseline, crosscheck)]
        cells[0] = f"`{cells[0]}`"
        out.append("| " + " | ".join(cells) + " |")
    out += ["", f"Counts in {unit.upper()} (1 MAC = 2 FLOP), decimal prefixes (G = 10⁹)."]
    thresholds = threshold_lines(rows)
    if thresholds:
        out += ["", "**Thresholds** (per layer, from the formula):", "", *(f"- {t}" for t in thresholds)]
    if sweeps:
        out += ["", "**Sweeps** (thresholds solved exactly from the measured counts):", ""]
        for line, data in zip(sweep_lines(sweeps), sweeps):
            out.append(f"- {line}")
            for path in data.get("plots", []) if link_plots else ():
                if path.endswith(".png"):
                    target = Path(path)
                    if base is not None:
                        target = Path(os.path.relpath(target, base))
                    out.append(f"  ![{target.stem}]({target.as_posix()})")
    unsupported = unsupported_lines(rows)
    if unsupported:
        out += ["", "**Ops fvcore skipped** (not in the counts):", "", *(f"- {u}" for u in unsupported)]
    cached = kv_cache_lines(rows)
    if cached:
        out += ["", "**KV cache of the decode steps** (n = tokens already in the cache):", "", *(f"- {c}" for c in cached)]
    timed = time_lines(rows)
    if timed:
        out += ["", f"**{TIME_HEADER[0].upper()}{TIME_HEADER[1:]}:**", "", *(f"- {t}" for t in timed)]
    warned = warning_lines(rows)
    if warned:
        out += ["", f"**{WARNINGS_HEADER[0].upper()}{WARNINGS_HEADER[1:]}:**", "", *(f"- {w}" for w in warned)]
    fallbacks = [r for r in rows if r.get("fallback")]
    if fallbacks:
        out += ["", "**Counted by the torch backend** because fvcore could not trace:", "",
                *(f"- `{r['test_id']}` {r['name']}: {r['fallback']}" for r in fallbacks)]
    failed = [r for r in rows if r.get("problems")]
    if failed:
        out += ["", "**Checks failed:**", ""]
        for row in failed:
            out += [f"- `{row['test_id']}` {row['name']}: {p}" for p in row["problems"]]
    return "\n".join(out) + "\n"


def versions() -> dict[str, str]:
    """Versions of what produced the counts (read from package metadata: nothing is imported)."""
    found = {"python": ".".join(map(str, sys.version_info[:3]))}
    for dist in ("pytest-attncost", "torch", "fvcore", "transformers", "pytest"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return found


def render_json(rows: Sequence[Row], unit: str = "mac", sweeps: Sequence[Row] = ()) -> str:
    """The versioned JSON document: sorted keys and rows, fixed indentation, no NaN."""
    document: dict[str, Any] = {"schema": SCHEMA, "unit": "MAC", "versions": versions(), "profiles": sort_rows(rows)}
    if sweeps:
        document["sweeps"] = [{k: v for k, v in s.items() if k != "profiles"} for s in sweeps]
    return json.dumps(document, indent=2, sort_keys=True, allow_nan=False) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def append_once(path: Path, text: str) -> None:
    """Append in one write call (GitHub's step summary is shared by every step of a job)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode("utf-8"))
    finally:
        os.close(fd)


def module_rows(profile: Any, depth: int = 2) -> list[dict[str, Any]]:
    """The rows of :meth:`Profile.table`: module, label, class, role, params, MACs and self MACs (ints)."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"depth must be an int >= 0, got {depth!r}")
    modules = profile.modules
    containers = {name for name, (cls, _, _) in modules.items() if cls in ("ModuleList", "Sequential", "ModuleDict")}

    def level(name: str) -> int:
        parts = name.split(".") if name else []
        return sum(1 for i in range(len(parts)) if ".".join(parts[: i + 1]) not in containers)

    shown = [name for name in modules if name not in containers and level(name) <= depth]
    rows = []
    for name in shown:
        macs = int(profile.by_module.get(name, 0))
        below = [other for other in shown if other != name and (not name or other.startswith(name + "."))]
        # the rows directly under this one: shown modules with no shown module between
        direct = [b for b in below if not any(a != b and b.startswith(a + ".") for a in below)]
        parts = name.split(".")
        start = len(parts) - 1
        while start > 0 and ".".join(parts[:start]) in containers:  # "layer.0", not "0"
            start -= 1
        cls, params, role = modules[name]
        rows.append({"module": name, "label": "  " * level(name) + (".".join(parts[start:]) if name else "(model)"),
                     "class": cls, "role": role, "params": params, "macs": macs,
                     "self": macs - sum(int(profile.by_module.get(child, 0)) for child in direct)})
    return rows


def module_table(profile: Any, depth: int = 2) -> str:
    """See :meth:`Profile.table`."""
    body = [[r["label"], r["class"], r["role"], f"{r['params']:,}", format_count(r["macs"], "mac", suffix=False),
             format_count(r["self"], "mac", suffix=False)] for r in module_rows(profile, depth)]
    lines = table(["module", "class", "role", "params", "MACs", "self"], body, right=(3, 4, 5))
    lines.append(f"{profile.name} at n={profile.n}, batch={profile.batch}: {profile.total:,} MAC; "
                 "MACs include everything below a module, self what no row below it shows")
    return "\n".join(lines)
