"""The session side: stash keys, marker reading, checks that make rows, baselines, xdist, files.

The test hooks are in :mod:`pytest_attncost.plugin`; how rows travel: docs/reports.md, "How a report is built".
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from . import files, plots
from .baseline import BaselineError, Prune, compare, entry_key, is_baseline, load, save
from .markers import (
    NO_PROFILE,
    NO_SWEEP,
    TIME_BOUNDS,
    Bounds,
    MarkerError,
    check_bounds,
    check_mfu,
    check_sweep,
    check_time_bounds,
    merged_kwargs,
    parse_marker_kwargs,
)
from .reporting import Row, RowKey, SweepRow, render_export, render_json, render_markdown, render_terminal, row_key
from .request import COMPONENTS, PARTS
from .result import versions

if TYPE_CHECKING:
    from .result import Profile
    from .series import Sweep
    from .settings import Settings
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)

SETTINGS_KEY = pytest.StashKey["Settings"]()
BOUNDS_KEY = pytest.StashKey[Bounds]()
PROFILES_KEY = pytest.StashKey["list[Profile]"]()
SWEEPS_KEY = pytest.StashKey[list["Sweep"]]()
CROSSCHECK_KEY = pytest.StashKey[dict[int, Any]]()
BASELINE_KEY = pytest.StashKey["Baselines"]()
CHECKED_KEY = pytest.StashKey[list[str]]()
TIMINGS_KEY = pytest.StashKey[list[Any]]()
PROPERTIES_KEY = pytest.StashKey[list[tuple[str, object]]]()
CACHE_WAS_KEY = pytest.StashKey[bool]()

USER_PROPERTY = "attncost"
SWEEP_PROPERTY = "attncost_sweep"
LENGTH_ARG = "attncost_n"

CHECKS_FAILED = "attncost checks failed"
FALLBACK_MESSAGE = ("counted by the torch backend because fvcore could not trace the model ({reason}) "
                    "(--attncost-strict)")
CROSSCHECK_MESSAGE = "backends disagree on {part}: {first} {a:,} vs {second} {b:,} MAC (formula {formula})"


def _crosscheck(result: Profile, second: Any) -> tuple[dict[str, Any], list[str]]:
    """Compare the two backends' parts; every disagreement is one message."""
    if isinstance(second, str):
        other = "torch" if result.backend == "fvcore" else "fvcore"
        return ({"agree": False, "backends": [result.backend, other], "error": second},
                [f"cross-check: the {other} backend could not count the model: {second}"])
    formula = result.formula
    problems = [CROSSCHECK_MESSAGE.format(part=part, first=result.backend, a=getattr(result, part),
                                          second=second.backend, b=getattr(second, part),
                                          formula=f"{getattr(formula, part):,}" if formula is not None else "n/a")
                for part in COMPONENTS if getattr(result, part) != getattr(second, part)]
    data = {"agree": not problems, "backends": [result.backend, second.backend],
            result.backend: {p: getattr(result, p) for p in PARTS},
            second.backend: {p: getattr(second, p) for p in PARTS}}
    return data, problems


STRICT_MESSAGE = "fvcore skipped {ops}: these ops multiply matrices, so the count is short (--attncost-strict)"
WARNING_MESSAGE = "the split cannot be trusted: {warning} (--attncost-strict)"
DUPLICATE_KEY = ("two profiles named {name!r} at n={n}, batch={batch} in one test: the baseline cannot tell them "
                 "apart; give each a distinct name=, e.g. attncost.profile(model, name='{name}-small')")


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")  # pytest-xdist worker; no xdist import needed


# --- the marker as it stands ----------------------------------------------------------


def parse_marker(node: Any) -> Bounds | None:
    marks = list(node.iter_markers("attncost"))
    return parse_marker_kwargs(*merged_kwargs(marks)) if marks else None


def current_bounds(item: pytest.Item) -> Bounds | None:
    """The marker as it stands now: request.applymarker() may have added one after setup."""
    try:
        bounds = parse_marker(item)
    except MarkerError:
        return item.stash.get(BOUNDS_KEY, None)
    if bounds is not None:
        item.stash[BOUNDS_KEY] = bounds
    return bounds


# --- checks after the call: a Row per profile ---------------------------------------------


def rows_for(item: pytest.Item, settings: Settings) -> tuple[list[Row], list[str]]:
    """A :class:`Row` per profile the test made, and every problem its checks found."""
    bounds = item.stash.get(BOUNDS_KEY, None)
    baseline = item.config.stash[BASELINE_KEY].compare
    allowed = bounds.max_increase if bounds is not None and bounds.max_increase is not None else settings.max_increase
    rows: list[Row] = []
    problems: list[str] = []
    keys_seen: set[RowKey] = set()
    profiles = item.stash.get(PROFILES_KEY, [])
    timings = {id(t.profile): t for t in item.stash.get(TIMINGS_KEY, [])}
    # a profile of a sweep of several lengths is audited with them (check_sweep), not alone
    swept = {id(p) for made in item.stash.get(SWEEPS_KEY, []) if len(made) > 1 for p in made}
    alone = dataclasses.replace(bounds, audit=None) if bounds is not None else None
    for result in profiles:
        own = alone if id(result) in swept else bounds
        found = check_bounds(own, result, settings.unit) if own is not None else []
        if settings.strict:
            if result.skipped_matmul_ops:
                ops = ", ".join(f"{op} x{count}" for op, count in sorted(result.skipped_matmul_ops.items()))
                found.append(STRICT_MESSAGE.format(ops=ops))
            if result.fallback:
                found.append(FALLBACK_MESSAGE.format(reason=result.fallback))
            found += [WARNING_MESSAGE.format(warning=warning) for warning in result.warnings]
        second = item.stash.get(CROSSCHECK_KEY, {}).get(id(result))
        crosscheck, disagreements = _crosscheck(result, second) if second is not None else (None, [])
        found += disagreements
        key = row_key(item.nodeid, result)
        if (settings.save_path is not None or baseline is not None) and key in keys_seen:
            found.append(DUPLICATE_KEY.format(name=result.name, n=result.n, batch=result.batch))
        keys_seen.add(key)
        vs_baseline, entry = (None, None) if baseline is None else ("new", baseline.get(key))
        if entry is not None:
            regressions, vs_baseline = compare(entry, result, allowed)
            found += [str(r) for r in regressions]
        checked = (bounds is not None and bounds.has_bounds) or vs_baseline not in (None, "new")
        rows.append(Row(item.nodeid, result, tuple(found), "FAIL" if found else ("ok" if checked else "-"),
                        vs_baseline=vs_baseline, crosscheck=crosscheck,
                        timing=timings[id(result)].to_dict() if id(result) in timings else None))
        prefix = f"{result.name}: " if len(profiles) > 1 else ""
        problems += [prefix + p for p in found]
    if any(row.vs_baseline not in (None, "new") and any("over the baseline" in p for p in row.problems)
           for row in rows):
        problems.append(accept_line(item, settings))
    return rows, problems


ACCEPT = "an intended change? accept it: pytest {test} --attncost-save={path}"


def accept_line(item: pytest.Item, settings: Settings) -> str:
    """The command that records this test's profiles as the new baseline (the failure's last line)."""
    path = settings.compare_path
    assert path is not None
    try:
        shown = os.path.relpath(path, item.config.invocation_params.dir)
    except ValueError:  # another drive (Windows)
        shown = str(path)
    return ACCEPT.format(test=shlex.quote(item.nodeid), path=shlex.quote(shown))


def sweep_verdicts(rows: list[Row], judged: list[tuple[Sweep, list[str]]], bounded: bool) -> list[Row]:
    """Each row's verdict as the sweeps that hold its profile judged it too: ``FAIL`` on every row of a sweep
    whose crossover bound broke (the test failed on them), ``ok`` on a row a passed sweep bound checked."""
    def verdict(row: Row) -> str:
        verdicts = [bool(found) for made, found in judged if any(row.profile is p or row.profile == p for p in made)]
        return "FAIL" if any(verdicts) else "ok" if verdicts and row.verdict == "-" else row.verdict

    return [row.replace(verdict=verdict(row)) for row in rows] if bounded else rows


class AttncostCheckError(AssertionError):
    """Broken bounds (or baseline regressions, cross-checks, strict mode) after a test body ran. Raised in the call
    phase, like an assertion in the body, so that ``xfail``, ``skip`` and ``expectedFailure`` treat it alike."""


def failure_text(problems: list[str]) -> str:
    """The failure, first problem on the header line (pytest's short summary shows that line)."""
    if problems == [NO_PROFILE]:
        return f"@pytest.mark.attncost: {NO_PROFILE}"
    headline = f"attncost: {problems[0]}"
    return headline if len(problems) == 1 else "\n".join([headline, f"{CHECKS_FAILED} ({len(problems)}):",
                                                          *(f"  {p}" for p in problems)])


def check(item: pytest.Item, body_passed: bool = True) -> list[str]:
    """Make the item's rows (kept for the report) and return what its bounds, baseline and modes reject. A body
    that did not pass has its profiles reported but not judged: the test's own outcome stands."""
    if CHECKED_KEY in item.stash:
        return item.stash[CHECKED_KEY]
    if item.config.stash[SETTINGS_KEY].disabled:  # --attncost-disable: the marker is a no-op
        item.stash[PROPERTIES_KEY], item.stash[CHECKED_KEY] = [], []
        return []
    problems: list[str] = []
    properties: list[tuple[str, object]] = []
    bounds = current_bounds(item)
    if PROFILES_KEY in item.stash or bounds is not None:
        rows, problems = rows_for(item, item.config.stash[SETTINGS_KEY])
        if bounds is not None and body_passed:
            timed = check_time_bounds(item.stash.get(TIMINGS_KEY, []), {k: getattr(bounds, k) for k in TIME_BOUNDS})
            timed += check_mfu(item.stash.get(TIMINGS_KEY, []), bounds.mfu_min, bounds.peak)
            problems += timed
            if timed:
                rows = [row.replace(problems=(*row.problems, *timed), verdict="FAIL") for row in rows]
        sweeps = item.stash.get(SWEEPS_KEY, [])
        judged = [(made, check_sweep(bounds, made) if bounds is not None else []) for made in sweeps]
        rows = sweep_verdicts(rows, judged, bool(bounds is not None and bounds.has_sweep_bounds))
        problems += [problem for _, found in judged for problem in found]
        if not body_passed:
            problems, rows = [], [row.replace(problems=(), verdict="-") for row in rows]
        elif bounds is not None and not rows:
            problems = [NO_PROFILE]
        elif bounds is not None and bounds.has_sweep_bounds and not sweeps:
            problems.append(NO_SWEEP)
        # JSON strings, so --junitxml shows JSON and xdist ships plain text
        properties += [(USER_PROPERTY, json.dumps(row.to_dict(), sort_keys=True, allow_nan=False)) for row in rows]
        properties += [(SWEEP_PROPERTY, json.dumps(SweepRow(item.nodeid, made, tuple(found)).to_dict(),
                                                   sort_keys=True, allow_nan=False)) for made, found in judged]
    item.stash[PROPERTIES_KEY], item.stash[CHECKED_KEY] = properties, problems
    return problems


# --- baselines and xdist -------------------------------------------------------------


@dataclass
class Baselines:
    """The --attncost-compare baseline's entries and the versions that made it."""

    compare: dict[RowKey, dict[str, Any]] | None = None
    compare_versions: dict[str, str] | None = None


def load_baselines(config: pytest.Config, settings: Settings) -> Baselines:
    """Controller: read and validate once; workers get the compare entries through workerinput."""
    if is_worker(config):
        shipped = config.workerinput.get("attncost_baseline")  # type: ignore[attr-defined]
        return Baselines() if shipped is None else Baselines(compare={entry_key(row): row for row in shipped})
    result = Baselines()
    try:
        if settings.compare_path is not None:
            result.compare, result.compare_versions = load(settings.compare_path)
        if settings.save_path is not None and settings.save_path.exists():
            load(settings.save_path)  # a file the save could not merge into is refused before the tests run
    except BaselineError as exc:
        raise pytest.UsageError(str(exc)) from None
    return result


class XdistHooks:
    def pytest_configure_node(self, node: Any) -> None:
        """Controller: hand each worker the baseline it already validated."""
        baselines = node.config.stash[BASELINE_KEY]
        if baselines.compare is not None:
            node.workerinput["attncost_baseline"] = list(baselines.compare.values())


def _ours(value: object) -> dict[str, Any] | None:
    """A row or sweep this plugin recorded (a JSON object with its test id), else None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):  # a user's own property, of any shape
            return None
    if isinstance(value, dict) and isinstance(value.get("test_id"), str) and isinstance(value.get("name"), str):
        return value
    return None


DISABLED = ("attncost: disabled (--attncost-disable): the @pytest.mark.attncost checks were not run, and no report "
            "or file was written")
FILE_ERROR = "attncost: could not write the {what} ({path}): {reason}; the other reports were written"
PRUNE_SKIPPED = ("attncost: --attncost-save-prune pruned nothing: {why}; entries of tests this run did not see "
                 "were kept (prune after a complete run)")
PRUNE_SCOPED = ("attncost: --attncost-save-prune pruned only entries of tests under {paths} (the paths this run was "
                "given); the others were kept")


class AttncostSession:
    """Per-run state on the controller (or the only process): rows for reports and files."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.settings = config.stash[SETTINGS_KEY]
        self.rows: dict[tuple[str, int], Row] = {}
        self.sweeps: dict[tuple[str, int], SweepRow] = {}
        self.outcomes: dict[str, str] = {}
        self.collected = 0
        self.incomplete: list[str] = []  # why this run did not see the whole suite
        self.file_errors: list[str] = []  # files that could not be written after the tests
        self.saved: str | None = None  # the line that says what --attncost-save did
        self.interrupted: str | None = None
        self.session: pytest.Session | None = None

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """Collection of one file or directory: an error means part of the suite is unseen."""
        if report.failed:
            self.incomplete.append(f"a collection error in {report.nodeid or 'the session'}")

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        """-k / -m / --lf and the like deselect tests: their entries must not be pruned."""
        if items:
            self.incomplete.append(f"{len(items)} test(s) deselected (-k, -m, --lf, ...)")

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """After collection: how many tests this run means to run."""
        self.collected = len(session.items)

    def _prune_blocker(self, session: pytest.Session) -> str | None:
        """Why pruning would drop entries of tests this run did not see, or None for a complete run."""
        reasons = list(self.incomplete)
        option = self.config.option
        if getattr(option, "collectonly", False):
            reasons.append("--collect-only ran no test")
        if getattr(option, "lf", False):
            reasons.append("--lf runs only the last failures")
        if session.shouldstop or session.shouldfail:
            reasons.append(f"the run stopped early ({session.shouldstop or session.shouldfail})")
        if session.exitstatus == pytest.ExitCode.INTERRUPTED:
            reasons.append("the run was interrupted")
        if not reasons and len(self.outcomes) < self.collected:
            reasons.append(f"only {len(self.outcomes)} of {self.collected} collected tests ran")
        return "; ".join(dict.fromkeys(reasons)) if reasons else None

    def _prune_scope(self) -> tuple[str, ...] | str:
        """The paths (relative to the rootdir, "" for all of it) whose tests this run collected, or why a
        positional argument selects part of them (a node id, a module under --pyargs)."""
        config = self.config
        if getattr(config.option, "pyargs", False):
            return "--pyargs names modules, not the suite's paths"
        paths = []
        for arg in config.args:
            relative = self._relative(arg)
            if "::" in arg:
                return f"the node id {arg} selects part of the suite"
            if relative is None:
                return f"{arg} lies outside the rootdir ({config.rootpath})"
            paths.append(relative)
        return tuple(paths) or ("",)

    def _prune(self, session: pytest.Session) -> Prune | None:
        """What --attncost-save-prune may drop this run (None: nothing, and the reason is noted)."""
        blocker, scope = self._prune_blocker(session), self._prune_scope()
        if isinstance(scope, str) or blocker is not None:
            self.file_errors.append(PRUNE_SKIPPED.format(why=blocker or scope))
            return None
        option = self.config.option
        ignored = tuple(p if self._relative(p) is None else str(self._relative(p))
                        for p in getattr(option, "ignore", None) or ())
        ignored += tuple(getattr(option, "ignore_glob", None) or ())
        if "" not in scope:
            self.file_errors.append(PRUNE_SCOPED.format(paths=", ".join(scope)))
        return Prune(frozenset(self.outcomes), scope, ignored)

    def _relative(self, path: str) -> str | None:
        """*path* (as given on the command line) relative to the rootdir ("" for the rootdir), or None outside it."""
        try:
            relative = (self.config.invocation_params.dir / path).resolve().relative_to(self.config.rootpath.resolve())
        except ValueError:
            return None
        return "" if relative == Path() else relative.as_posix()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Each test phase, on the controller too under xdist: collect outcomes and profiles."""
        if report.failed:
            self.outcomes[report.nodeid] = "failed" if report.when == "call" else "error"
        elif report.skipped and self.outcomes.get(report.nodeid, "passed") == "passed":
            self.outcomes[report.nodeid] = "skipped"
        else:
            self.outcomes.setdefault(report.nodeid, "passed")
        if report.when != "teardown":
            return
        for index, (key, value) in enumerate(report.user_properties):
            # None: a user's own record_property("attncost", ...), which is theirs
            data = _ours(value) if key in (USER_PROPERTY, SWEEP_PROPERTY) else None
            if data is not None and key == SWEEP_PROPERTY:
                self.sweeps[(report.nodeid, index)] = SweepRow.from_dict(data)
            elif data is not None and "verdict" in data and "problems" in data:  # ours: one unread is a bug
                self.rows[(report.nodeid, index)] = Row.from_dict(data)

    def final_sweeps(self) -> list[SweepRow]:
        return sorted(self.sweeps.values(), key=lambda s: s.key)

    def final_rows(self) -> list[Row]:
        return [row.replace(outcome=self.outcomes.get(nodeid, "passed")) for (nodeid, _), row in self.rows.items()]

    def missing(self) -> list[RowKey]:
        """Baseline entries that no profile of this run matched."""
        compared = self.config.stash[BASELINE_KEY].compare
        if compared is None:
            return []
        seen = {row.key for row in self.rows.values()}
        return sorted(key for key in compared if key not in seen)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """End of the run, before the summary: save the baseline, write the report files (controller only), in
        the order and with the failure handling of docs/reports.md, "Options"; Ctrl-C while one is written ends
        the session as interrupted (exit 2) once the others are written."""
        if is_worker(self.config) or self.settings.disabled:
            return
        self.session = session
        rows, sweeps, unit = self.final_rows(), self.final_sweeps(), self.settings.unit
        if self.settings.save_path is not None:
            self._save(session, rows)
        if self.settings.compare_strict and self.missing() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.settings.plot_dir is not None and sweeps:
            self._write("plots", self.settings.plot_dir, lambda: self._plot(sweeps, unit), errors=Exception)
        if (json_path := self.settings.json_path) is not None:
            self._write("json", json_path, lambda: files.write(json_path, render_json(rows, unit, sweeps)))
        for kind, path in self.settings.exports:
            self._write(kind, path, functools.partial(files.write, path, render_export(kind, rows)))
        if (markdown_path := self.settings.markdown_path) is not None:
            markdown = render_markdown(rows, unit, sweeps, markdown_path.parent)
            self._write("markdown", markdown_path, lambda: files.write(markdown_path, markdown))
        summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if summary and (self.settings.report or self.settings.markdown_path is not None):
            text = render_markdown(rows, unit, sweeps, link_plots=False)
            self._write("GITHUB_STEP_SUMMARY", Path(summary), lambda: files.write(Path(summary), text, append=True))
        if self.interrupted is not None:
            session.exitstatus = pytest.ExitCode.INTERRUPTED
        elif self.file_errors and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _stopped(self, what: str) -> None:
        """Ctrl-C while *what* was written (the writer renames a complete temporary, or removes it)."""
        self.interrupted = (f"KeyboardInterrupt while attncost wrote the {what}: it holds its old content or the "
                            "new one whole; the other files were written")

    def _write(self, what: str, path: Path, write: Callable[[], None],
               errors: type[Exception] | tuple[type[Exception], ...] = (OSError, files.Refused)) -> None:
        try:
            if what != "plots" and not self.settings.replace_baseline and is_baseline(path):  # made since the start
                raise files.Refused(f"{path} holds a saved baseline now, which this report would replace; give the "
                                    "report another path, or pass --attncost-replace-baseline")
            write()
        except KeyboardInterrupt:
            self._stopped(f"{what} ({path})")
        except errors as exc:
            reason = (exc.strerror if isinstance(exc, OSError) and exc.strerror
                      else str(exc) if isinstance(exc, files.Refused) else f"{type(exc).__name__}: {exc}")
            self.file_errors.append(FILE_ERROR.format(what=what, path=path, reason=reason))

    def _plot(self, sweeps: list[SweepRow], unit: str) -> None:
        """Draw every sweep; each row in *sweeps* (and the session's) is replaced by one that knows its plots."""
        assert self.settings.plot_dir is not None
        self.settings.plot_dir.mkdir(exist_ok=True)
        where = {id(row): key for key, row in self.sweeps.items()}
        stems = plots.stems_for([(row.test_id, row.sweep.name) for row in sweeps])
        for index, (row, stem) in enumerate(zip(sweeps, stems)):
            paths = plots.plot_sweep(row.to_dict(), self.settings.plot_dir, stem, unit)
            sweeps[index] = dataclasses.replace(row, plots=tuple(str(path) for path in paths))
            if id(row) in where:  # the terminal summary, later, names the plots too
                self.sweeps[where[id(row)]] = sweeps[index]

    def _save(self, session: pytest.Session, rows: list[Row]) -> None:
        prune = self._prune(session) if self.settings.save_prune else None
        path = self.settings.save_path
        assert path is not None
        try:
            self.saved = str(save(path, rows, prune, self.settings.lock_timeout, self.settings.save_tree))
        except KeyboardInterrupt:
            self._stopped(f"baseline ({path})")
        except (BaselineError, files.Refused) as exc:
            self.file_errors.append(f"attncost: the baseline was not saved: {exc}")
        except OSError as exc:
            self.file_errors.append(FILE_ERROR.format(what="baseline", path=path, reason=exc.strerror or exc))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """End of the run: baseline notes, then the table when asked for."""
        if is_worker(self.config):
            return
        try:
            self._summary(terminalreporter)
        except KeyboardInterrupt:
            self.interrupted = "KeyboardInterrupt while attncost printed its report"
            if self.session is not None:
                self.session.exitstatus = pytest.ExitCode.INTERRUPTED
        if self.interrupted is not None:
            terminalreporter.write_sep("!", f"Interrupted: {self.interrupted}", red=True)

    def _summary(self, terminalreporter: Any) -> None:
        if self.settings.disabled:
            terminalreporter.write_line(DISABLED)
            return
        if self.saved is not None:
            terminalreporter.write_line(self.saved)
        self._baseline_summary(terminalreporter)
        for line in self.file_errors:
            terminalreporter.write_line(line, red=not line.startswith(PRUNE_SKIPPED[:30]))
        if not self.settings.report:
            return
        terminalreporter.write_sep("=", f"attncost report (counts in {self.settings.unit.upper()})")
        width = None if self.settings.report_full else self.config.get_terminal_writer().fullwidth
        for line in render_terminal(self.final_rows(), self.settings.unit, self.final_sweeps(), width=width,
                                    full=self.settings.report_full):
            terminalreporter.write_line(line)
        failed = " ".join(self.file_errors)
        for label, path in (("json", self.settings.json_path), ("markdown", self.settings.markdown_path),
                            *self.settings.exports):
            if path is not None and str(path) not in failed:
                terminalreporter.write_line(f"attncost {label} written to {path}")

    def _baseline_summary(self, terminalreporter: Any) -> None:
        baselines = self.config.stash[BASELINE_KEY]
        if baselines.compare is None:
            return
        now = versions()
        drift = [f"{name} {old} -> {now.get(name, 'absent')}"
                 for name, old in sorted((baselines.compare_versions or {}).items())
                 if name in ("torch", "fvcore", "pytest-attncost") and now.get(name) != old]
        lines = ([f"warning: the baseline was made with other versions ({', '.join(drift)}); counts may differ"]
                 if drift else [])
        new = sorted({r.key[:4] for r in self.rows.values() if r.vs_baseline == "new"})
        lines += [f"new (not in the baseline): {t} [{name} n={n} batch={b}]" for t, name, n, b in new]
        strict = " (fails the run: --attncost-compare-strict)" if self.settings.compare_strict else ""
        lines += [f"missing (in the baseline, not seen in this run){strict}: {t} [{name} n={n} batch={b}]"
                  for t, name, n, b, *_ in self.missing()]
        if lines:
            terminalreporter.write_sep("-", f"attncost baseline {self.settings.compare_path}")
            for line in lines:
                terminalreporter.write_line(line)
