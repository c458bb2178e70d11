"""Options and their ini twins, resolved once into :class:`Settings` (command line, then ini, then default)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from . import files
from .baseline import is_baseline
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .markers import parse_increase
from .plots import require_matplotlib
from .reporting import EXPORTS
from .request import BACKENDS
from .units import UNITS

__all__ = ["Settings", "add_options"]


@dataclass(frozen=True)
class Settings:
    """Options resolved once: command line, then ini, then default."""

    report: bool = False
    unit: str = "mac"
    strict: bool = False
    report_full: bool = False
    json_path: Path | None = None
    markdown_path: Path | None = None
    exports: tuple[tuple[str, Path], ...] = ()  # (format, path) of --attncost-export
    save_path: Path | None = None
    save_prune: bool = False
    compare_path: Path | None = None
    max_increase: float | dict[str, float] = 0.0  # percent, or per part
    compare_strict: bool = False
    plot_dir: Path | None = None
    backend: str = "fvcore"
    crosscheck: bool = False
    cache: bool = True
    lock_timeout: float = 60.0  # seconds
    replace_baseline: bool = False  # a report may replace a file that holds a saved baseline
    disabled: bool = False  # --attncost-disable: the markers check nothing
    save_tree: bool = False  # --attncost-save-tree: baselines keep the per-module tree

    @classmethod
    def from_config(cls, config: pytest.Config) -> Settings:
        def flag(name: str) -> bool:
            value = config.getoption(name)
            return _ini_bool(config, name) if value is None else bool(value)

        unit = _value(config, "attncost_unit", _one_of(UNITS), "mac")
        json_path = _report_path(config, "attncost_json")
        markdown_path = _report_path(config, "attncost_markdown")
        save_path = _report_path(config, "attncost_save", what="baseline")
        compare_path = _path(config, "attncost_compare")
        given = config.getoption("attncost_export")
        base = Path(config.invocation_params.dir if given else config.rootpath)
        lines = [line.strip() for line in config.getini("attncost_export")]
        exports = tuple(_export(value, base) for value in given or filter(None, lines))
        reports = {"--attncost-json": json_path, "--attncost-markdown": markdown_path,
                   **{f"--attncost-export={kind}": path for kind, path in exports}}
        full = flag("attncost_report_full")
        report = full or flag("attncost_report")
        summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if summary and (report or markdown_path is not None):  # the step summary is appended to
            reports["GITHUB_STEP_SUMMARY"] = Path(summary)
        _distinct({"--attncost-save": save_path, "--attncost-compare": compare_path, **reports})
        replace_baseline = bool(config.getoption("attncost_replace_baseline"))
        if not replace_baseline:
            _not_a_baseline(reports)
        plot_dir = _plot_dir(config)
        if config.getoption("attncost_save_prune") and save_path is None:
            raise pytest.UsageError("--attncost-save-prune needs --attncost-save=PATH")
        disabled = flag("attncost_disable")
        if disabled and (save_path or compare_path):
            raise pytest.UsageError("--attncost-disable turns the attncost checks off, so --attncost-save and "
                                    "--attncost-compare have nothing to work on: drop one or the other")
        return cls(
            disabled=disabled, report=report, report_full=full, unit=unit, strict=flag("attncost_strict"),
            json_path=json_path, markdown_path=markdown_path, exports=exports, save_path=save_path,
            save_prune=bool(config.getoption("attncost_save_prune")), save_tree=flag("attncost_save_tree"),
            compare_path=compare_path, max_increase=_value(config, "attncost_max_increase", parse_increase, "0"),
            compare_strict=flag("attncost_compare_strict"), plot_dir=plot_dir,
            backend=_value(config, "attncost_backend", _one_of(BACKENDS), "fvcore"),
            crosscheck=flag("attncost_crosscheck"),
            cache=_ini_bool(config, "attncost_cache") if config.getoption("attncost_no_cache") is None else False,
            replace_baseline=replace_baseline, lock_timeout=_value(config, "attncost_lock_timeout", _seconds, "60"),
        )


def _export(value: str, base: Path) -> tuple[str, Path]:
    kind, _, path = value.partition(":")
    if kind not in EXPORTS or not path:
        raise pytest.UsageError(f"--attncost-export={value}: expected FORMAT:PATH with FORMAT one of "
                                f"{', '.join(EXPORTS)}, e.g. --attncost-export=bencher:attncost-bmf.json")
    return kind, _checked(base / path, "--attncost-export", value)


def _value(config: pytest.Config, name: str, parse: Callable[[str], Any], default: str) -> Any:
    """The option's value (read by its argparse type), else its ini twin's read by *parse*: a ValueError is a usage
    error naming the key."""
    value = config.getoption(name)
    if value is not None:
        return value
    text = str(config.getini(name)).strip() or default
    try:
        return parse(text)
    except ValueError as exc:
        raise pytest.UsageError(f"{name} = {text!r} in the ini file: {exc}") from None


def _distinct(named: dict[str, Path | None]) -> None:
    """Two options that name one file would overwrite each other: a usage error naming both. One file is
    one real path (links resolved, ``..`` walked, whatever directory each was relative to), or two paths
    that :func:`os.path.samefile` joins (hard links, bind mounts)."""
    seen: list[tuple[str, Path, str]] = []
    for option, path in named.items():
        if path is None:
            continue
        real = os.path.realpath(path)
        for other, earlier, earlier_real in seen:
            if real == earlier_real or _samefile(path, earlier):
                where = f" ({real})" if str(path) != real or str(earlier) != real else ""
                raise pytest.UsageError(f"{_spelled(other, earlier)} and {_spelled(option, path)} name the same "
                                        f"file{where}: give them different paths")
        seen.append((option, path, real))


def _spelled(option: str, path: Path) -> str:
    return f"{option}{':' if option.startswith('--attncost-export=') else '='}{path}"


def _samefile(one: Path, other: Path) -> bool:
    try:
        return os.path.samefile(one, other)
    except OSError:  # one of them does not exist (yet): their real paths told
        return False


def _not_a_baseline(named: dict[str, Path | None]) -> None:
    """A report written over a saved baseline would replace its entries: refused (--attncost-replace-baseline)."""
    for option, path in named.items():
        if path is not None and is_baseline(path):
            raise pytest.UsageError(f"{option}={path}: {path} is a saved attncost baseline, which this report would "
                                    "replace; give the report another path, or pass --attncost-replace-baseline")


def _plot_dir(config: pytest.Config) -> Path | None:
    """--attncost-plot, checked before any test runs: a directory that can be written, and matplotlib."""
    plot_dir = _path(config, "attncost_plot")
    if plot_dir is None:
        return None
    if (planted := files.planted_link(plot_dir)) is not None:  # the plots' own files are checked as they are written
        raise pytest.UsageError(f"--attncost-plot={plot_dir}: {planted}")
    if plot_dir.exists() and not plot_dir.is_dir():
        raise pytest.UsageError(f"--attncost-plot={plot_dir}: is a file; give a directory")
    if not plot_dir.parent.is_dir():
        raise pytest.UsageError(f"--attncost-plot={plot_dir}: directory {plot_dir.parent} does not exist; "
                                "create it first")
    where = plot_dir if plot_dir.exists() else plot_dir.parent
    if not os.access(where, os.W_OK | os.X_OK):
        raise pytest.UsageError(f"--attncost-plot={plot_dir}: directory {where} is not writable")
    try:
        require_matplotlib()
    except ImportError as exc:
        raise pytest.UsageError(str(exc)) from None
    return plot_dir


def _ini_bool(config: pytest.Config, ini: str) -> bool:
    """A boolean ini value; a value pytest cannot read is a usage error naming the key."""
    try:
        return bool(config.getini(ini))
    except (ValueError, pytest.UsageError) as exc:  # pytest's message ("invalid truth value 'maybe'") names no key
        raise pytest.UsageError(f"{ini} in the ini file: {exc}; expected true or false") from None


def _path(config: pytest.Config, name: str) -> Path | None:
    """The option's path (relative to the directory pytest was started in), else its ini twin's (relative to the
    rootdir)."""
    value = config.getoption(name)
    base, text = (config.invocation_params.dir, value) if value else (config.rootpath, str(config.getini(name)).strip())
    return Path(base) / text if text else None


def _report_path(config: pytest.Config, name: str, what: str = "report") -> Path | None:
    """A report path, checked before any test runs: a lost report after a long run helps no one."""
    path = _path(config, name)
    option = "--" + name.replace("_", "-")
    return None if path is None else _checked(path, option, config.getoption(name) or str(path), what)


def _checked(path: Path, option: str, value: str, what: str = "report") -> Path:
    if path.is_dir():
        raise pytest.UsageError(f"{option}={value}: is a directory; give a file path such as {value}/attncost.json")
    parent = path.parent
    if not parent.exists():
        raise pytest.UsageError(f"{option}={value}: directory {parent} does not exist; create it first")
    if not parent.is_dir():
        raise pytest.UsageError(f"{option}={value}: {parent} is not a directory")
    if (problem := files.unwritable(path)) is not None:  # read-only, a socket, a directory it cannot be replaced in
        raise pytest.UsageError(f"{option}={value}: {what} {problem}")
    return path


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.strip().lower() not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text.strip().lower()

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError("expected seconds >= 0, such as 60")
    return value


def _argument(parse: Callable[[str], Any], problem: str | None = None) -> Callable[[str], Any]:
    """An argparse type from a parser whose ValueError names the problem (or says *problem*, then the value)."""
    def argument(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc) if problem is None else f"{problem}, got {text!r}") from None

    return argument


_seconds_argument = _argument(_seconds, "expected a number of seconds >= 0 such as 60")
_FLAG = {"action": "store_true"}
_PATH = {"metavar": "PATH"}
_BOOL = ("bool", False)  # an ini twin of type bool, false by default
_STRING = (None, "")

#: Every option (after ``--attncost-``; None: none) with its argparse keywords, its ini twin's type and default
#: (None: no twin, or an ini twin alone) and the help both show.
_OPTIONS: tuple[tuple[str, dict[str, Any] | None, tuple[Any, Any] | None, str], ...] = (
    ("report", _FLAG, _BOOL, "Print the attncost table (one row per profile) at the end of the session."),
    ("unit", {"metavar": "UNIT", "type": _argument(_one_of(UNITS))}, (None, "mac"),
     "Unit of the counts in reports: mac (default) or flop (1 MAC = 2 FLOP)."),
    ("report-full", _FLAG, _BOOL, "Print the attncost table with every column and full test ids, whatever the "
     "terminal's width (the default table fits the terminal)."),
    ("disable", _FLAG, _BOOL, "Turn the attncost markers into no-ops: no bound, baseline or audit is checked, no "
     "report or file is written; the tests run as plain tests (the fixture still counts)."),
    ("strict", _FLAG, _BOOL, "Fail a test whose profile skipped a matrix-multiplying op, fell back to the torch "
     "backend, or carries a warning (a split that cannot be trusted)."),
    ("json", _PATH, _STRING, "Write every profile of the session to this JSON file (versioned schema)."),
    ("markdown", _PATH, _STRING, "Write the report as a Markdown table to this file."),
    ("export", {"metavar": "FORMAT:PATH", "action": "append"}, None, "Write the counts for a dashboard: "
     "github-action-benchmark:PATH (its customSmallerIsBetter JSON) or bencher:PATH (Bencher's metric format); one "
     "benchmark per test and profile, with the MACs of each part, the attention share and a decode step's KV cache "
     "bytes. May be given more than once."),
    ("export", None, ("linelist", []), "Dashboard exports, one FORMAT:PATH a line (as --attncost-export)."),
    ("save", _PATH, _STRING, "Save every profile of the run to this JSON baseline (merged with what it holds)."),
    ("save-prune", _FLAG, None, "With --attncost-save: drop baseline entries of tests this run did not see."),
    ("save-tree", _FLAG, _BOOL, "With --attncost-save: keep each profile's per-module tree (by_module) in the "
     "baseline; left out by default, since the gate compares the parts and the tree makes every diff noisy."),
    ("compare", _PATH, _STRING, "Compare every profile with this JSON baseline; a regression fails its test."),
    ("max-increase", {"metavar": "PCT", "type": _argument(parse_increase)}, (None, "0"),
     "Allowed growth over the baseline, in percent (default 0: any increase fails)."),
    ("lock-timeout", {"metavar": "SECONDS", "type": _seconds_argument},
     (None, "60"), "Seconds --attncost-save waits for the lock of another run saving to the same baseline, then gives "
     "up with a message naming the lock file (default 60)."),
    ("replace-baseline", _FLAG, None, "Let a report (--attncost-json, --attncost-markdown, --attncost-export) replace "
     "a file that holds a saved baseline (refused otherwise: its entries would be lost)."),
    ("compare-strict", _FLAG, _BOOL, "Fail the session when baseline entries were not seen in this run."),
    ("plot", {"metavar": "DIR"}, _STRING,
     "Write PNG and SVG plots of every attncost.sweep() to this directory (needs matplotlib)."),
    ("backend", {"metavar": "NAME", "type": _argument(_one_of(BACKENDS))}, (None, "fvcore"),
     "Default counter: fvcore (jit trace, default) or torch (FlopCounterMode on fake tensors)."),
    ("crosscheck", _FLAG, _BOOL, "Count every profile with both backends; fail a test whose counts disagree."),
    ("no-cache", _FLAG, None, "Count every profile afresh instead of reusing an identical earlier one "
     "(the cache cannot see globals or functions patched in other modules)."),
    ("cache", None, ("bool", True), "Reuse the profile of an identical earlier call in the session (default true)."),
)


def add_options(parser: pytest.Parser) -> None:
    """Register the --attncost-* options and their ini twins (plugin.pytest_addoption)."""
    group = parser.getgroup("attncost", "attention cost budgets (pytest-attncost)")
    for name, argument, ini, text in _OPTIONS:
        if argument is not None:  # default=None, not False: "not given" is told apart so the ini twin is consulted
            group.addoption(f"--attncost-{name}", default=None, help=text, **argument)
        if ini is not None:  # (type, default)
            parser.addini(f"attncost_{name.replace('-', '_')}", text, *ini)
