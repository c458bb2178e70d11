"""Baselines: load and validate, compare a run against one, and save (merged, atomically).

A baseline uses the ``--attncost-json`` schema, so a JSON report can serve as one.
Only JSON is read: nothing is unpickled or evaluated.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .reporting import SCHEMA, render_json

__all__ = ["BaselineError", "Regression", "compare", "entry_key", "load", "merge", "MAX_BYTES"]

MAX_BYTES = 64 * 1024 * 1024
PARTS = ("total", "attention_core", "attention_proj", "ffn", "other")
_REQUIRED = {"test_id": str, "name": str, "n": int, "batch": int, **{p: int for p in PARTS}}

Key = tuple[str, str, int, int, str, str, str]


class BaselineError(ValueError):
    """A baseline file that cannot be used; the message names the file and the fix."""


def entry_key(row: Mapping[str, Any]) -> Key:
    """Profiles are keyed by test id, profile name, n, batch, mode, causal accounting and backend."""
    return (row["test_id"], row["name"], row["n"], row["batch"], row.get("mode", "forward"),
            row.get("causal", "full"), row.get("backend", "fvcore"))


def load(path: Path) -> tuple[dict[Key, dict[str, Any]], dict[str, str]]:
    """Read and validate a baseline: (entries by key, versions that produced it).

    Raises:
        BaselineError: missing, too large, empty, not JSON, truncated, another schema,
            or entries without the counts.
    """
    fix = f"fix or delete it, or re-create it with --attncost-save={path}"
    if not path.exists():
        raise BaselineError(f"baseline {path} does not exist; create it with --attncost-save={path}")
    if path.is_dir():
        raise BaselineError(f"baseline {path} is a directory, not a JSON file")
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise BaselineError(f"baseline {path} is {size:,} bytes, over the {MAX_BYTES:,}-byte limit; {fix}")
    with open(path, "rb") as handle:
        raw = handle.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise BaselineError(f"baseline {path} is over the {MAX_BYTES:,}-byte limit; {fix}")
    if not raw.strip():
        raise BaselineError(f"baseline {path} is empty; {fix}")
    try:
        document = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BaselineError(f"baseline {path} is not valid JSON (truncated or corrupt?): {exc}; {fix}") from None
    if not isinstance(document, dict) or "profiles" not in document or "schema" not in document:
        raise BaselineError(f"baseline {path} is not an attncost baseline (no 'schema' and 'profiles'); {fix}")
    if document["schema"] != SCHEMA:
        raise BaselineError(
            f"baseline {path} has schema {document['schema']!r}; this pytest-attncost reads schema {SCHEMA}; {fix}"
        )
    if document.get("unit") != "MAC":
        raise BaselineError(f"baseline {path} counts in {document.get('unit')!r}, not 'MAC'; {fix}")
    profiles = document["profiles"]
    if not isinstance(profiles, list):
        raise BaselineError(f"baseline {path}: 'profiles' must be a list; {fix}")
    entries: dict[Key, dict[str, Any]] = {}
    for index, row in enumerate(profiles):
        if not isinstance(row, dict):
            raise BaselineError(f"baseline {path}: profile #{index} is not an object; {fix}")
        for name, kind in _REQUIRED.items():
            value = row.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise BaselineError(f"baseline {path}: profile #{index} has no valid {name!r}; {fix}")
        entries[entry_key(row)] = row
    versions = document.get("versions")
    return entries, dict(versions) if isinstance(versions, dict) else {}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a count")


@dataclass(frozen=True)
class Regression:
    """One part that grew beyond the allowed increase; ``str()`` is the message."""

    part: str
    before: int
    after: int
    allowed: float  # percent

    @property
    def change(self) -> float:
        """Relative change in percent (infinite when the baseline was 0)."""
        if self.before == 0:
            return math.inf if self.after > 0 else 0.0
        return (self.after - self.before) / self.before * 100

    def __str__(self) -> str:
        change = "new cost" if math.isinf(self.change) else f"{self.change:+.1f}%"
        return (f"{self.part} {self.before:,} → {self.after:,} MAC ({change}) over the baseline "
                f"(max_increase {self.allowed:g}%)")


def compare(baseline: Mapping[str, Any], row: Mapping[str, Any], allowed: float) -> tuple[list[Regression], str]:
    """Regressions of *row* against its baseline entry, and the 'vs baseline' cell for the total."""
    regressions = []
    for part in PARTS:
        before, after = int(baseline[part]), int(row[part])
        if after <= before:
            continue
        regression = Regression(part, before, after, allowed)
        if regression.change > allowed:
            regressions.append(regression)
    before, after = int(baseline["total"]), int(row["total"])
    if before == after:
        cell = "="
    elif before == 0:
        cell = "+inf"
    else:
        cell = f"{(after - before) / before * 100:+.2f}%"
    return regressions, cell


def merge(
    existing: Mapping[Key, Mapping[str, Any]], rows: Iterable[Mapping[str, Any]], keep_tests: set[str] | None
) -> list[dict[str, Any]]:
    """This run's profiles replace their entries; the others stay (unless pruned to *keep_tests*)."""
    merged = {key: dict(value) for key, value in existing.items()}
    fresh = {entry_key(row): dict(row) for row in rows}
    for key, row in fresh.items():
        merged[key] = row
    if keep_tests is not None:
        merged = {key: row for key, row in merged.items() if key[0] in keep_tests}
    return list(merged.values())


# Run-specific fields left out of a baseline, so that an unchanged re-save is byte-identical.
VOLATILE = ("outcome", "verdict", "problems", "vs_baseline", "baseline_status")


def render_baseline(rows: Iterable[Mapping[str, Any]]) -> str:
    """The baseline document: the JSON report's schema, minus run-specific fields."""
    clean = [{k: v for k, v in row.items() if k not in VOLATILE} for row in rows]
    return render_json(clean)
