"""Options and their ini twins, resolved once into :class:`Settings` (command line, then ini, then default)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from . import files
from .baseline import is_baseline
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .markers import parse_increase
from .plots import require_matplotlib
from .reporting import EXPORTS
from .units import UNITS

__all__ = ["BACKENDS", "Settings", "add_options"]

_REPORT_HELP = "Print the attncost table (one row per profile) at the end of the session."
_REPORT_FULL_HELP = ("Print the attncost table with every column and full test ids, whatever the terminal's width "
                     "(the default table fits the terminal).")
_UNIT_HELP = "Unit of the counts in reports: mac (default) or flop (1 MAC = 2 FLOP)."
_STRICT_HELP = ("Fail a test whose profile skipped a matrix-multiplying op, fell back to the torch backend, "
                "or carries a warning (a split that cannot be trusted).")
_DISABLE_HELP = ("Turn the attncost markers into no-ops: no bound, baseline or audit is checked, no report or file is "
                 "written; the tests run as plain tests (the fixture still counts).")
_EXPORT_INI_HELP = "Dashboard exports, one FORMAT:PATH a line (as --attncost-export)."
_JSON_HELP = "Write every profile of the session to this JSON file (versioned schema)."
_MARKDOWN_HELP = "Write the report as a Markdown table to this file."
_SAVE_HELP = "Save every profile of the run to this JSON baseline (merged with what it holds)."
_SAVE_TREE_HELP = ("With --attncost-save: keep each profile's per-module tree (by_module) in the baseline; left out by "
                   "default, since the gate compares the parts and the tree makes every diff noisy.")
_PRUNE_HELP = "With --attncost-save: drop baseline entries of tests this run did not see."
_COMPARE_HELP = "Compare every profile with this JSON baseline; a regression fails its test."
_INCREASE_HELP = "Allowed growth over the baseline, in percent (default 0: any increase fails)."
_LOCK_TIMEOUT_HELP = ("Seconds --attncost-save waits for the lock of another run saving to the same baseline, then "
                      "gives up with a message naming the lock file (default 60).")
_REPLACE_HELP = ("Let a report (--attncost-json, --attncost-markdown, --attncost-export) replace a file that holds a "
                 "saved baseline (refused otherwise: its entries would be lost).")
_COMPARE_STRICT_HELP = "Fail the session when baseline entries were not seen in this run."
_BACKEND_HELP = "Default counter: fvcore (jit trace, default) or torch (FlopCounterMode on fake tensors)."
_CROSSCHECK_HELP = "Count every profile with both backends; fail a test whose counts disagree."
_EXPORT_HELP = ("Write the counts for a dashboard: github-action-benchmark:PATH (its customSmallerIsBetter JSON) or "
                "bencher:PATH (Bencher's metric format); one benchmark per test and profile, with the MACs of each "
                "part, the attention share and a decode step's KV cache bytes. May be given more than once.")
_PLOT_HELP = "Write PNG and SVG plots of every attncost.sweep() to this directory (needs matplotlib)."
_NO_CACHE_HELP = ("Count every profile afresh instead of reusing an identical earlier one "
                  "(the cache cannot see globals or functions patched in other modules).")
_CACHE_INI_HELP = "Reuse the profile of an identical earlier call in the session (default true)."


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
        def flag(option: str, ini: str) -> bool:
            value = config.getoption(option)
            return _ini_bool(config, ini) if value is None else bool(value)

        unit = config.getoption("attncost_unit")
        if unit is None:
            unit = str(config.getini("attncost_unit")).strip().lower() or "mac"
            if unit not in UNITS:
                raise pytest.UsageError(
                    f"attncost_unit = {unit!r} in the ini file: expected one of {', '.join(UNITS)}"
                )
        json_path = _report_path(config, "attncost_json", "--attncost-json", ini="attncost_json")
        markdown_path = _report_path(config, "attncost_markdown", "--attncost-markdown", ini="attncost_markdown")
        save_path = _report_path(config, "attncost_save", "--attncost-save", ini="attncost_save", what="baseline")
        compare_path = _path_value(config, "attncost_compare", "attncost_compare")
        given = config.getoption("attncost_export")
        exports = tuple(_export(config, value, Path(config.invocation_params.dir if given else config.rootpath))
                        for value in given or [line.strip() for line in config.getini("attncost_export") if line.strip()])
        reports = {"--attncost-json": json_path, "--attncost-markdown": markdown_path,
                   **{f"--attncost-export={kind}": path for kind, path in exports}}
        full = flag("attncost_report_full", "attncost_report_full")
        report = full or flag("attncost_report", "attncost_report")
        summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if summary and (report or markdown_path is not None):  # the step summary is appended to
            reports["GITHUB_STEP_SUMMARY"] = Path(summary)
        _distinct({"--attncost-save": save_path, "--attncost-compare": compare_path, **reports})
        _not_a_baseline(config, reports)
        plot_dir = _plot_dir(config)
        if config.getoption("attncost_save_prune") and save_path is None:
            raise pytest.UsageError("--attncost-save-prune needs --attncost-save=PATH")
        disabled = flag("attncost_disable", "attncost_disable")
        if disabled and (save_path or compare_path):
            raise pytest.UsageError("--attncost-disable turns the attncost checks off, so --attncost-save and "
                                    "--attncost-compare have nothing to work on: drop one or the other")
        return cls(
            disabled=disabled,
            report=report,
            report_full=full,
            unit=unit,
            strict=flag("attncost_strict", "attncost_strict"),
            json_path=json_path,
            markdown_path=markdown_path,
            exports=exports,
            save_path=save_path,
            save_prune=bool(config.getoption("attncost_save_prune")),
            save_tree=flag("attncost_save_tree", "attncost_save_tree"),
            compare_path=compare_path,
            max_increase=_increase(config),
            compare_strict=flag("attncost_compare_strict", "attncost_compare_strict"),
            plot_dir=plot_dir,
            backend=_backend(config),
            crosscheck=flag("attncost_crosscheck", "attncost_crosscheck"),
            cache=_ini_bool(config, "attncost_cache") if config.getoption("attncost_no_cache") is None else False,
            replace_baseline=bool(config.getoption("attncost_replace_baseline")),
            lock_timeout=_number(config, "attncost_lock_timeout", _seconds, "60", "seconds >= 0, such as 60"),
        )


def _export(config: pytest.Config, value: str, base: Path) -> tuple[str, Path]:
    kind, _, path = value.partition(":")
    if kind not in EXPORTS or not path:
        raise pytest.UsageError(f"--attncost-export={value}: expected FORMAT:PATH with FORMAT one of "
                                f"{', '.join(EXPORTS)}, e.g. --attncost-export=bencher:attncost-bmf.json")
    return kind, _checked(base / path, "--attncost-export", value)


def _number(config: pytest.Config, dest: str, parse: Callable[[str], float], default: str, expected: str) -> float:
    """A number: the option, else its ini twin of the same name (a value that cannot be read is a usage error)."""
    value = config.getoption(dest)
    if value is not None:
        return float(value)
    text = str(config.getini(dest)).strip() or default
    try:
        return parse(text)
    except ValueError:
        raise pytest.UsageError(f"{dest} = {text!r} in the ini file: expected {expected}") from None


def _increase(config: pytest.Config) -> float | dict[str, float]:
    """--attncost-max-increase, else its ini twin: percent for every part, or per part (ffn:5%,total:0%)."""
    value = config.getoption("attncost_max_increase")
    if value is not None:
        return value  # type: ignore[no-any-return]
    text = str(config.getini("attncost_max_increase")).strip() or "0"
    try:
        return parse_increase(text)
    except ValueError as exc:
        raise pytest.UsageError(f"attncost_max_increase = {text!r} in the ini file: {exc}") from None


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


def _not_a_baseline(config: pytest.Config, named: dict[str, Path | None]) -> None:
    """A report written over a saved baseline would replace its entries: refused unless asked for."""
    if config.getoption("attncost_replace_baseline"):
        return
    for option, path in named.items():
        if path is not None and is_baseline(path):
            raise pytest.UsageError(f"{option}={path}: {path} is a saved attncost baseline, which this report would "
                                    "replace; give the report another path, or pass --attncost-replace-baseline")


def _plot_dir(config: pytest.Config) -> Path | None:
    """--attncost-plot, checked before any test runs: a directory that can be written, and matplotlib."""
    plot_dir = _path_value(config, "attncost_plot", "attncost_plot")
    if plot_dir is None:
        return None
    planted = files.planted_link(plot_dir)  # the plots' own files are checked as they are written
    if planted is not None:
        raise pytest.UsageError(f"--attncost-plot={plot_dir}: {planted}")
    if plot_dir.exists() and not plot_dir.is_dir():
        raise pytest.UsageError(f"--attncost-plot={plot_dir}: is a file; give a directory")
    if not plot_dir.parent.is_dir():
        raise pytest.UsageError(f"--attncost-plot={plot_dir}: directory {plot_dir.parent} does not exist; create it first")
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


def _path_value(config: pytest.Config, dest: str, ini: str | None) -> Path | None:
    value = config.getoption(dest)
    if not value and ini is not None:
        value = str(config.getini(ini)).strip()
        if value:
            return Path(config.rootpath) / value if not Path(value).is_absolute() else Path(value)
    if not value:
        return None
    path = Path(value)
    return path if path.is_absolute() else Path(config.invocation_params.dir) / path


def _percent_arg(text: str) -> float | dict[str, float]:
    try:
        return parse_increase(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(text: str) -> float:
    value = float(text.strip())
    if not math.isfinite(value) or value < 0:
        raise ValueError(text)
    return value


def _seconds_arg(text: str) -> float:
    try:
        return _seconds(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0 such as 60, got {text!r}") from None


def _report_path(config: pytest.Config, dest: str, option: str, ini: str | None = None,
                 what: str = "report") -> Path | None:
    """A report path, checked before any test runs: a lost report after a long run helps no one."""
    path = _path_value(config, dest, ini)
    return None if path is None else _checked(path, option, config.getoption(dest) or str(path), what)


def _checked(path: Path, option: str, value: str, what: str = "report") -> Path:
    if path.is_dir():
        raise pytest.UsageError(f"{option}={value}: is a directory; give a file path such as {value}/attncost.json")
    parent = path.parent
    if not parent.exists():
        raise pytest.UsageError(f"{option}={value}: directory {parent} does not exist; create it first")
    if not parent.is_dir():
        raise pytest.UsageError(f"{option}={value}: {parent} is not a directory")
    problem = files.unwritable(path)  # read-only, a socket, a directory the file cannot be replaced in
    if problem is not None:
        raise pytest.UsageError(f"{option}={value}: {what} {problem}")
    return path


BACKENDS = ("fvcore", "torch")


def _backend(config: pytest.Config) -> str:
    value = config.getoption("attncost_backend")
    if value is not None:
        return str(value)
    text = str(config.getini("attncost_backend")).strip().lower() or "fvcore"
    if text not in BACKENDS:
        raise pytest.UsageError(f"attncost_backend = {text!r} in the ini file: expected one of {', '.join(BACKENDS)}")
    return text


def _backend_arg(value: str) -> str:
    backend = value.strip().lower()
    if backend not in BACKENDS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(BACKENDS)}, got {value!r}")
    return backend


def _unit_arg(value: str) -> str:
    unit = value.strip().lower()
    if unit not in UNITS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(UNITS)}, got {value!r}")
    return unit


def add_options(parser: pytest.Parser) -> None:
    """Register the --attncost-* options and their ini twins (plugin.pytest_addoption)."""
    group = parser.getgroup("attncost", "attention cost budgets (pytest-attncost)")
    # default=None, not False: "not given" must be told apart so the ini twin is consulted.
    group.addoption("--attncost-report", action="store_true", default=None, help=_REPORT_HELP)
    group.addoption("--attncost-unit", metavar="UNIT", type=_unit_arg, default=None, help=_UNIT_HELP)
    group.addoption("--attncost-report-full", action="store_true", default=None, help=_REPORT_FULL_HELP)
    group.addoption("--attncost-disable", action="store_true", default=None, help=_DISABLE_HELP)
    group.addoption("--attncost-strict", action="store_true", default=None, help=_STRICT_HELP)
    group.addoption("--attncost-json", metavar="PATH", default=None, help=_JSON_HELP)
    group.addoption("--attncost-markdown", metavar="PATH", default=None, help=_MARKDOWN_HELP)
    group.addoption("--attncost-export", metavar="FORMAT:PATH", action="append", default=None, help=_EXPORT_HELP)
    group.addoption("--attncost-save", metavar="PATH", default=None, help=_SAVE_HELP)
    group.addoption("--attncost-save-prune", action="store_true", default=False, help=_PRUNE_HELP)
    group.addoption("--attncost-save-tree", action="store_true", default=None, help=_SAVE_TREE_HELP)
    group.addoption("--attncost-compare", metavar="PATH", default=None, help=_COMPARE_HELP)
    group.addoption("--attncost-max-increase", metavar="PCT", type=_percent_arg, default=None, help=_INCREASE_HELP)
    group.addoption("--attncost-lock-timeout", metavar="SECONDS", type=_seconds_arg, default=None,
                    help=_LOCK_TIMEOUT_HELP)
    group.addoption("--attncost-replace-baseline", action="store_true", default=False, help=_REPLACE_HELP)
    group.addoption("--attncost-compare-strict", action="store_true", default=None, help=_COMPARE_STRICT_HELP)
    group.addoption("--attncost-plot", metavar="DIR", default=None, help=_PLOT_HELP)
    group.addoption("--attncost-backend", metavar="NAME", type=_backend_arg, default=None, help=_BACKEND_HELP)
    group.addoption("--attncost-crosscheck", action="store_true", default=None, help=_CROSSCHECK_HELP)
    group.addoption("--attncost-no-cache", action="store_true", default=None, help=_NO_CACHE_HELP)
    parser.addini("attncost_cache", _CACHE_INI_HELP, type="bool", default=True)
    parser.addini("attncost_backend", _BACKEND_HELP, default="fvcore")
    parser.addini("attncost_crosscheck", _CROSSCHECK_HELP, type="bool", default=False)
    parser.addini("attncost_report", _REPORT_HELP, type="bool", default=False)
    parser.addini("attncost_report_full", _REPORT_FULL_HELP, type="bool", default=False)
    parser.addini("attncost_disable", _DISABLE_HELP, type="bool", default=False)
    parser.addini("attncost_json", _JSON_HELP, default="")
    parser.addini("attncost_markdown", _MARKDOWN_HELP, default="")
    parser.addini("attncost_export", _EXPORT_INI_HELP, type="linelist", default=[])
    parser.addini("attncost_plot", _PLOT_HELP, default="")
    parser.addini("attncost_save", _SAVE_HELP, default="")
    parser.addini("attncost_save_tree", _SAVE_TREE_HELP, type="bool", default=False)
    parser.addini("attncost_compare", _COMPARE_HELP, default="")
    parser.addini("attncost_max_increase", _INCREASE_HELP, default="0")
    parser.addini("attncost_lock_timeout", _LOCK_TIMEOUT_HELP, default="60")
    parser.addini("attncost_compare_strict", _COMPARE_STRICT_HELP, type="bool", default=False)
    parser.addini("attncost_unit", _UNIT_HELP, default="mac")
    parser.addini("attncost_strict", _STRICT_HELP, type="bool", default=False)
