"""Baselines: load and validate, compare a run against one, and save (merged, atomically).

A baseline uses the ``--attncost-json`` schema, so a JSON report can serve as one.
Only JSON is read: nothing is unpickled or evaluated.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .result import Profile

from . import files
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .markers import GATED_PARTS, increase_for
from .reporting import SCHEMA, Row, RowKey, field_of, render_documents, row_key
from .request import PARTS

__all__ = ["BaselineError", "Regression", "Saved", "compare", "entry_key", "is_baseline", "load", "merge", "save",
           "MAX_BYTES"]

MAX_BYTES = 64 * 1024 * 1024
_REQUIRED = {"test_id": str, "name": str, "n": int, "batch": int, **{p: int for p in GATED_PARTS}}


class BaselineError(ValueError):
    """A baseline file that cannot be used; the message names the file and the fix."""


def entry_key(entry: Mapping[str, Any]) -> RowKey:
    """A baseline entry's key: the identity of the row it was saved from (:func:`reporting.row_key`)."""
    return row_key(entry["test_id"], entry)


def _check_entry(row: Any, where: str, fix: str) -> None:
    """A saved row has its identity and its counts, each of the right type and sign."""
    if not isinstance(row, dict):
        raise BaselineError(f"{where} is not an object; {fix}")
    for name, kind in _REQUIRED.items():
        value = row.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise BaselineError(f"{where} has no valid {name!r} (got {value!r}); {fix}")
        if isinstance(value, int) and value < (1 if name in ("n", "batch") else 0):
            raise BaselineError(f"{where} has {name}={value}, which no count can be; {fix}")
        if isinstance(value, str) and not value.strip():
            raise BaselineError(f"{where} has an empty {name!r}; {fix}")
    parts = sum(row[part] for part in PARTS)
    if parts != row["total"]:
        raise BaselineError(f"{where} ({row['test_id']} [{row['name']}]) has total={row['total']:,} but its parts "
                            f"({', '.join(PARTS)}) add up to {parts:,}; {fix}")
    for name in ("mode", "causal", "backend"):
        if name in row and not isinstance(row[name], str):
            raise BaselineError(f"{where} has {name}={row[name]!r}, not a string such as 'forward'; {fix}")
    m = row.get("m")
    if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
        raise BaselineError(f"{where} has m={m!r}, which no second sequence can be; {fix}")


def load(path: Path) -> tuple[dict[RowKey, dict[str, Any]], dict[str, str]]:
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
    try:
        raw = files.read(path, MAX_BYTES)
    except files.Refused as exc:
        raise BaselineError(f"baseline {exc}; give the path of a JSON file") from None
    if len(raw) > MAX_BYTES:
        raise BaselineError(f"baseline {path} is over the {MAX_BYTES:,}-byte limit; {fix}")
    if not raw.strip():
        raise BaselineError(f"baseline {path} is empty; {fix}")
    try:
        document = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)
    except _Duplicate as exc:
        raise BaselineError(f"baseline {path}: {exc}; {fix}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise BaselineError(f"baseline {path} is not valid JSON (truncated or corrupt?): {exc}; {fix}") from None
    except RecursionError as exc:  # the parser's limit, met before any schema check
        raise BaselineError(f"baseline {path} is nested too deeply to be an attncost report ({exc}); {fix}") from None
    if not isinstance(document, dict) or "profiles" not in document or "schema" not in document:
        raise BaselineError(f"baseline {path} is not an attncost baseline (no 'schema' and 'profiles'); {fix}")
    if type(document["schema"]) is not int or document["schema"] != SCHEMA:  # not true, not 1.0
        raise BaselineError(f"baseline {path} has schema {document['schema']!r}; this pytest-attncost reads schema "
                            f"{SCHEMA}; {fix}")
    if document.get("unit") != "MAC":
        raise BaselineError(f"baseline {path} counts in {document.get('unit')!r}, not 'MAC'; {fix}")
    profiles = document["profiles"]
    if not isinstance(profiles, list):
        raise BaselineError(f"baseline {path}: 'profiles' must be a list; {fix}")
    entries: dict[RowKey, dict[str, Any]] = {}
    for index, row in enumerate(profiles):
        _check_entry(row, f"baseline {path}: profile #{index}", fix)
        key = entry_key(row)
        if key in entries:
            raise BaselineError(f"baseline {path}: profiles #{index} and an earlier one share the key {key}; {fix}")
        entries[key] = row
    versions = document.get("versions")
    return entries, dict(versions) if isinstance(versions, dict) else {}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a count")


class _Duplicate(ValueError):
    """A key given twice in one object of a baseline."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object of the document; a key given twice (``"total": 1, "total": 100``) is refused, not read as the
    last one, naming the key and the object (its test id and name, where it has them)."""
    document = dict(pairs)
    if len(document) < len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))  # type: ignore[func-returns-value]
        where = (f" in the entry {document['test_id']} [{document.get('name')}]"
                 if isinstance(document.get("test_id"), str) else "")
        raise _Duplicate(f"the key {twice!r} is given twice{where}")
    return document


def is_baseline(path: Path) -> bool:
    """Whether *path* holds a saved baseline with entries (a document of the baseline schema whose entries carry
    no run's verdicts, as :func:`render_baseline` writes it), which a report must not replace unasked. A JSON
    report (entries with verdicts) or an empty baseline is not one: replacing it loses nothing."""
    try:
        if not path.is_file():
            return False
        document = json.loads(files.read(path, MAX_BYTES).decode("utf-8"))
    except (OSError, ValueError, RecursionError, files.Refused):
        return False
    profiles = document.get("profiles") if isinstance(document, dict) and "schema" in document else None
    return (isinstance(profiles, list) and bool(profiles)
            and all(isinstance(row, dict) and not any(field in row for field in VOLATILE) for row in profiles))


@dataclass(frozen=True)
class Regression:
    """One part that grew beyond the allowed increase; ``str()`` is the message."""

    part: str
    before: int
    after: int
    allowed: float  # percent
    unit: str = "MAC"  # "B" for the memory estimate's peak

    @property
    def change(self) -> float:
        """Relative change in percent (infinite when the baseline was 0)."""
        if self.before == 0:
            return math.inf if self.after > 0 else 0.0
        return (self.after - self.before) / self.before * 100

    def __str__(self) -> str:
        change = "new cost" if math.isinf(self.change) else f"{self.change:+.1f}%"
        return (f"{self.part} {self.before:,} → {self.after:,} {self.unit} ({change}) over the baseline "
                f"(max_increase {self.allowed:g}%)")


def _memory_peak(counts: Mapping[str, Any] | Profile) -> int | None:
    """The memory estimate's peak, in bytes; None where memory was not estimated."""
    if isinstance(counts, Mapping):
        memory = counts.get("memory")
        return int(memory["peak"]) if isinstance(memory, Mapping) and "peak" in memory else None
    return None if counts.memory is None else counts.memory.peak


def moved(before: int, after: int) -> str:
    """One count's change as a cell: ``=``, ``+inf`` (from 0) or ``+1.20%``."""
    if before == after:
        return "="
    return "+inf" if before == 0 else f"{(after - before) / before * 100:+.2f}%"


def compare(baseline: Mapping[str, Any], now: Mapping[str, Any] | Profile,
            allowed: float | Mapping[str, float]) -> tuple[list[Regression], str]:
    """Regressions of *now* (a profile, or another file's entry) against its baseline entry, and the
    'vs baseline' cell: the total's change, and the part that moved most when one did (``+1.20% (ffn +4.00%)``).
    *allowed*: percent for every part, or per part (:func:`~pytest_attncost.markers.parse_increase`)."""
    counts = [(part, int(baseline[part]), int(field_of(now, part)), "MAC") for part in GATED_PARTS]
    peak_before, peak_after = _memory_peak(baseline), _memory_peak(now)
    if peak_before is not None and peak_after is not None:  # both estimated memory
        counts.append(("peak_memory", peak_before, peak_after, "B"))
    grown = [Regression(part, before, after, increase_for(allowed, part), unit)
             for part, before, after, unit in counts if after > before]
    regressions = [regression for regression in grown if regression.change > regression.allowed]
    changes = [(abs(after - before) / before if before else math.inf, part, moved(before, after))
               for part in PARTS for before, after in [(int(baseline[part]), int(field_of(now, part)))]
               if before != after]
    cell = moved(int(baseline["total"]), int(field_of(now, "total")))
    if changes:
        _, part, change = max(changes)
        cell += f" ({part} {change})"
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


def merge(existing: Mapping[RowKey, Mapping[str, Any]], rows: Iterable[Mapping[str, Any]],
          prune: Prune | None) -> list[dict[str, Any]]:
    """This run's profiles replace their entries; the others stay (unless *prune* drops them)."""
    fresh = {entry_key(row): dict(row) for row in rows}
    merged = {**{key: dict(value) for key, value in existing.items()}, **fresh}
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


#: The per-module tree: kept in a baseline only when asked (--attncost-save-tree); the gate compares the parts.
TREE = "by_module"


def _clean(entry: Mapping[str, Any], tree: bool = False) -> dict[str, Any]:
    left_out = VOLATILE if tree else (*VOLATILE, TREE)
    return {k: v for k, v in entry.items() if k not in left_out}


def render_baseline(entries: Iterable[Mapping[str, Any]], tree: bool = False) -> str:
    """The baseline document: the JSON report's schema, minus run-specific fields (and the per-module tree
    unless *tree*), in row order."""
    return render_documents(sorted((_clean(entry, tree) for entry in entries), key=entry_key))


LOCK_HELD = ("the lock {lock} was still held after {timeout:g} s: another pytest run saving to this baseline "
             "holds it (or one that was stopped); let it finish or raise --attncost-lock-timeout, or delete the lock "
             "file if no run is active")
LOCK_FAILED = ("cannot take the lock {lock}: {reason}; every run saving to this baseline locks that file, so it must "
               "be a file this user can create or write (delete it if another user left it and no run is active)")
LOCK_LINK = ("the lock {lock} is a symbolic link (to {target}); a lock is never taken through a link, which could "
             "truncate the file it points to: delete the link")


def entries(count: int) -> str:
    return f"{count} entr{'y' if count == 1 else 'ies'}"


@dataclass(frozen=True)
class Saved:
    """What a save did: the entries the file holds now, how many this run added or changed, and whether the
    file was written (an unchanged save writes nothing)."""

    path: Path
    entries: int
    added: int
    changed: int
    dropped: int
    written: bool

    def __str__(self) -> str:
        held = entries(self.entries)
        if not self.written:
            return f"attncost: baseline {self.path} already held this run's profiles ({held}): nothing written"
        return (f"attncost: baseline saved to {self.path}: {held} ({self.added} new, {self.changed} changed, "
                f"{self.dropped} pruned)")


def save(path: Path, rows: Iterable[Row], prune: Prune | None, lock_timeout: float = 60.0,
         tree: bool = False) -> Saved:
    """Merge this run's profiles into the baseline at *path*, under a file lock, atomically; say what changed.

    How the lock and the write behave (links, owners, concurrent runs): docs/ci.md. *tree* keeps each entry's
    per-module tree (``by_module``), which is left out by default: the gate compares the parts only.

    Raises:
        BaselineError: the file is read-only, the lock is a link or cannot be taken in time, or what the file
            holds now cannot be read.
    """
    if (problem := files.unwritable(path)) is not None:
        raise BaselineError(f"baseline {problem}")
    target = path.resolve() if path.is_symlink() else path
    lock_path = target.with_name(f".{target.name}.lock")
    problem = files.planted_link(lock_path)
    if problem is None and lock_path.is_symlink():
        problem = LOCK_LINK.format(lock=lock_path, target=os.readlink(lock_path))
    if problem is not None:
        raise BaselineError(f"baseline {path} was not saved: {problem}")
    try:
        with files.locked(lock_path, lock_timeout):
            existing = load(target)[0] if target.exists() and target.stat().st_size > 0 else {}
            merged = merge(existing, [row.to_dict() for row in rows], prune)
            text = render_baseline(merged, tree)
            written = not (target.is_file() and target.read_bytes() == text.encode("utf-8"))
            files.write(target, text)  # nothing is written when the file holds it already
    except files.LockTimeout:
        raise BaselineError(LOCK_HELD.format(lock=lock_path, timeout=lock_timeout)) from None
    except OSError as exc:
        if str(exc.filename) != str(lock_path):
            raise
        reason = "it is a symbolic link, never followed" if exc.errno == errno.ELOOP else exc.strerror or exc
        raise BaselineError(LOCK_FAILED.format(lock=lock_path, reason=reason)) from None
    before = {key: _clean(row, tree) for key, row in existing.items()}
    after = {entry_key(row): _clean(row, tree) for row in merged}
    return Saved(path, len(after), sum(key not in before for key in after),
                 sum(key in before and before[key] != row for key, row in after.items()),
                 sum(key not in after for key in before), written)
