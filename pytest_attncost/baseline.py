"""Baselines: load and validate, compare a run against one, and save (merged, atomically).

A baseline uses the ``--attncost-json`` schema, so a JSON report can serve as one.
Only JSON is read: nothing is unpickled or evaluated.
"""

from __future__ import annotations

import hashlib
import json
import fnmatch
import math
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .result import Profile

from .reporting import SCHEMA, Row, RowKey, render_documents, row_key

__all__ = ["BaselineError", "Regression", "compare", "entry_key", "load", "merge", "save", "writable", "MAX_BYTES"]

MAX_BYTES = 64 * 1024 * 1024
PARTS = ("total", "attention_core", "attention_proj", "ffn", "other")
_REQUIRED = {"test_id": str, "name": str, "n": int, "batch": int, **{p: int for p in PARTS}}

Key = RowKey


class BaselineError(ValueError):
    """A baseline file that cannot be used; the message names the file and the fix."""


def entry_key(entry: Mapping[str, Any]) -> Key:
    """A baseline entry's key: the identity of the row it was saved from (:func:`reporting.row_key`)."""
    return row_key(entry["test_id"], entry["name"], entry["n"], entry["batch"], entry.get("mode"),
                   entry.get("causal"), entry.get("backend"))


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
                raise BaselineError(f"baseline {path}: profile #{index} has no valid {name!r} "
                                    f"(got {value!r}); {fix}")
            if isinstance(value, int) and value < (1 if name in ("n", "batch") else 0):
                raise BaselineError(f"baseline {path}: profile #{index} has {name}={value}, which no count can be; {fix}")
        for name in ("mode", "causal", "backend"):
            if name in row and not isinstance(row[name], str):
                raise BaselineError(f"baseline {path}: profile #{index} has {name}={row[name]!r}, not a string "
                                    f"such as 'forward'; {fix}")
        key = entry_key(row)
        if key in entries:
            raise BaselineError(f"baseline {path}: profiles #{index} and an earlier one share the key {key}; {fix}")
        entries[key] = row
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


def _part(counts: Mapping[str, Any] | Profile, part: str) -> int:
    return int(counts[part] if isinstance(counts, Mapping) else getattr(counts, part))


def compare(baseline: Mapping[str, Any], now: Mapping[str, Any] | Profile,
            allowed: float) -> tuple[list[Regression], str]:
    """Regressions of *now* (a profile, or another file's entry) against its baseline entry, and the
    'vs baseline' cell for the total."""
    regressions = []
    for part in PARTS:
        before, after = int(baseline[part]), _part(now, part)
        if after <= before:
            continue
        regression = Regression(part, before, after, allowed)
        if regression.change > allowed:
            regressions.append(regression)
    before, after = int(baseline["total"]), _part(now, "total")
    if before == after:
        cell = "="
    elif before == 0:
        cell = "+inf"
    else:
        cell = f"{(after - before) / before * 100:+.2f}%"
    return regressions, cell


@dataclass(frozen=True)
class Prune:
    """What ``--attncost-save-prune`` may drop: entries of tests in the files under *paths* (relative to the
    rootdir; ``""`` is all of it) and not under *ignored* (fnmatch patterns) that are not among *ran*."""

    ran: frozenset[str]
    paths: tuple[str, ...] = ("",)
    ignored: tuple[str, ...] = ()

    def covers(self, test_id: str) -> bool:
        """Whether this run could have seen *test_id*."""
        file = test_id.split("::", 1)[0]
        inside = any(not path or file == path or file.startswith(f"{path}/") for path in self.paths)
        return inside and not any(file == p or file.startswith(f"{p}/") or fnmatch.fnmatch(file, p)
                                  for p in self.ignored)


def merge(
    existing: Mapping[Key, Mapping[str, Any]], rows: Iterable[Mapping[str, Any]], prune: Prune | None
) -> list[dict[str, Any]]:
    """This run's profiles replace their entries; the others stay (unless *prune* drops them)."""
    merged = {key: dict(value) for key, value in existing.items()}
    fresh = {entry_key(row): dict(row) for row in rows}
    for key, row in fresh.items():
        merged[key] = row
    if prune is not None:
        # pruning, among the tests this run could see: tests that no longer exist go, and so do profiles a
        # test no longer makes (a test that profiled this run keeps exactly this run's profiles)
        profiled = {key[0] for key in fresh}
        merged = {key: row for key, row in merged.items() if not prune.covers(key[0])
                  or (key[0] in prune.ran and (key[0] not in profiled or key in fresh))}
    return list(merged.values())


# Run-specific fields left out of a baseline, so that an unchanged re-save is byte-identical.
# Measured time is noisy and machine-bound: reported, never stored to gate (DECISIONS).
VOLATILE = ("outcome", "verdict", "problems", "vs_baseline", "baseline_status", "timing")


def render_baseline(entries: Iterable[Mapping[str, Any]]) -> str:
    """The baseline document: the JSON report's schema, minus run-specific fields, in row order."""
    clean = [{k: v for k, v in entry.items() if k not in VOLATILE} for entry in entries]
    return render_documents(sorted(clean, key=entry_key))


def writable(path: Path) -> str | None:
    """Why a baseline cannot be saved to *path* (through a symlink: to its target), or None."""
    target = path.resolve() if path.is_symlink() else path
    # no write bit for anyone: the owner's intent, which root's access would override
    if target.exists() and (not target.stat().st_mode & 0o222 or not os.access(target, os.W_OK)):
        return (f"baseline {path} is read-only{f' (through the link to {target})' if target != path else ''}; "
                f"make it writable (chmod u+w {target}) or save elsewhere")
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _drop_stale_temporaries(target: Path) -> None:
    """Temporary files of saves that were killed (SIGKILL leaves them): removed once their process is gone."""
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.(\d+)\.tmp$")
    for candidate in target.parent.glob(f".{target.name}.*.tmp"):
        match = pattern.match(candidate.name)
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            candidate.unlink(missing_ok=True)


def save(path: Path, rows: Iterable[Row], prune: Prune | None) -> None:
    """Merge this run's profiles into the baseline at *path*, under a file lock, atomically.

    Another process saving to the same file waits for the lock, and each merges into what the
    other wrote, so concurrent runs lose nothing. A symlink is followed (the link stays a link),
    a read-only file is refused, the file keeps its permissions, and temporaries left by killed
    saves are removed.

    Raises:
        BaselineError: the file is read-only, or what it holds now cannot be read.
    """
    from filelock import FileLock

    problem = writable(path)
    if problem is not None:
        raise BaselineError(problem)
    target = path.resolve() if path.is_symlink() else path
    # the lock lives in the temporary directory, keyed by the file's real path: nothing is left in
    # the user's repository, and every process on this machine saving to that file takes the same lock
    key = hashlib.sha1(str(target.resolve()).encode("utf-8")).hexdigest()[:16]
    with FileLock(str(Path(tempfile.gettempdir()) / f"pytest-attncost-{key}.lock")):
        _drop_stale_temporaries(target)
        existing = load(target)[0] if target.exists() and target.stat().st_size > 0 else {}
        mode = target.stat().st_mode & 0o7777 if target.exists() else None
        text = render_baseline(merge(existing, [row.to_dict() for row in rows], prune))
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            if mode is not None:
                os.chmod(tmp, mode)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
