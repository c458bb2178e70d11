"""The pytest side: options, the ``attncost`` marker and fixture, bound checks, reports.

torch and fvcore are imported only when a test profiles a model, so ``pytest --help``
and suites that never use the fixture do not pay for them.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from . import cache
from .markers import (
    MARKER_HELP,
    NO_PROFILE,
    NO_SWEEP,
    Bounds,
    MarkerError,
    check_bounds,
    check_sweep,
    merged_kwargs,
    parse_marker_kwargs,
)
from .reporting import append_once, render_json, render_markdown, render_terminal, write_atomic
from .units import UNITS

if TYPE_CHECKING:
    from .result import Profile
    from .sweep import Sweep

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

_REPORT_HELP = "Print the attncost table (one row per profile) at the end of the session."
_REPORT_FULL_HELP = ("Print the attncost table with every column and full test ids, whatever the terminal's width "
                     "(the default table fits the terminal).")
_UNIT_HELP = "Unit of the counts in reports: mac (default) or flop (1 MAC = 2 FLOP)."
_STRICT_HELP = ("Fail a test whose profile skipped a matrix-multiplying op, fell back to the torch backend, "
                "or carries a warning (a split that cannot be trusted).")
_JSON_HELP = "Write every profile of the session to this JSON file (versioned schema)."
_MARKDOWN_HELP = "Write the report as a Markdown table to this file."
_SAVE_HELP = "Save every profile of the run to this JSON baseline (merged with what it holds)."
_PRUNE_HELP = "With --attncost-save: drop baseline entries of tests this run did not see."
_COMPARE_HELP = "Compare every profile with this JSON baseline; a regression fails its test."
_INCREASE_HELP = "Allowed growth over the baseline, in percent (default 0: any increase fails)."
_COMPARE_STRICT_HELP = "Fail the session when baseline entries were not seen in this run."
_BACKEND_HELP = "Default counter: fvcore (jit trace, default) or torch (FlopCounterMode on fake tensors)."
_CROSSCHECK_HELP = "Count every profile with both backends; fail a test whose counts disagree."
_PLOT_HELP = "Write PNG and SVG plots of every attncost.sweep() to this directory (needs matplotlib)."
_NO_CACHE_HELP = ("Count every profile afresh instead of reusing an identical earlier one "
                  "(the cache cannot see globals or functions patched in other modules).")
_CACHE_INI_HELP = "Reuse the profile of an identical earlier call in the session (default true)."

# Bounds, baseline regressions, cross-checks and strict mode all fail a test through this one header.
CHECKS_FAILED = "attncost checks failed"
FALLBACK_MESSAGE = "counted by the torch backend because fvcore could not trace the model ({reason}) (--attncost-strict)"
CROSSCHECK_MESSAGE = "backends disagree on {part}: {first} {a:,} vs {second} {b:,} MAC (formula {formula})"


def _crosscheck(result: Profile, second: Any) -> tuple[dict[str, Any], list[str]]:
    """Compare the two backends' parts; every disagreement is one message."""
    if isinstance(second, str):
        other = "torch" if result.backend == "fvcore" else "fvcore"
        return ({"agree": False, "backends": [result.backend, other], "error": second},
                [f"cross-check: the {other} backend could not count the model: {second}"])
    formula = result.formula
    parts = ("attention_core", "attention_proj", "ffn")
    problems = []
    for part in parts:
        a, b = getattr(result, part), getattr(second, part)
        if a != b:
            expected = f"{getattr(formula, part):,}" if formula is not None else "n/a"
            problems.append(CROSSCHECK_MESSAGE.format(part=part, first=result.backend, a=a, second=second.backend,
                                                      b=b, formula=expected))
    data = {"agree": not problems, "backends": [result.backend, second.backend],
            result.backend: {p: getattr(result, p) for p in (*parts, "other")},
            second.backend: {p: getattr(second, p) for p in (*parts, "other")}}
    return data, problems


STRICT_MESSAGE = "fvcore skipped {ops}: these ops multiply matrices, so the count is short (--attncost-strict)"
WARNING_MESSAGE = "the split cannot be trusted: {warning} (--attncost-strict)"
DUPLICATE_KEY = ("two profiles named {name!r} at n={n}, batch={batch} in one test: the baseline cannot tell them "
                 "apart; give each a distinct name=, e.g. attncost.profile(model, name='{name}-small')")


@dataclass(frozen=True)
class Settings:
    """Options resolved once: command line, then ini, then default."""

    report: bool = False
    unit: str = "mac"
    strict: bool = False
    report_full: bool = False
    json_path: Path | None = None
    markdown_path: Path | None = None
    save_path: Path | None = None
    save_prune: bool = False
    compare_path: Path | None = None
    max_increase: float = 0.0
    compare_strict: bool = False
    plot_dir: Path | None = None
    backend: str = "fvcore"
    crosscheck: bool = False
    cache: bool = True

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
        json_path = _report_path(config, "attncost_json", "--attncost-json")
        markdown_path = _report_path(config, "attncost_markdown", "--attncost-markdown")
        save_path = _report_path(config, "attncost_save", "--attncost-save", ini="attncost_save")
        compare_path = _path_value(config, "attncost_compare", "attncost_compare")
        named = {"--attncost-json": json_path, "--attncost-markdown": markdown_path,
                 "--attncost-save": save_path, "--attncost-compare": compare_path}
        seen: dict[Path, str] = {}
        for option, path in named.items():
            if path is None:
                continue
            if path in seen:
                raise pytest.UsageError(
                    f"{seen[path]} and {option} name the same file {path}: give them different paths"
                )
            seen[path] = option
        raw_increase = config.getoption("attncost_max_increase")
        if raw_increase is None:
            text = str(config.getini("attncost_max_increase")).strip() or "0"
            try:
                raw_increase = _percent(text)
            except ValueError:
                raise pytest.UsageError(
                    f"attncost_max_increase = {text!r} in the ini file: expected a percentage such as 2.5"
                ) from None
        plot_dir = _path_value(config, "attncost_plot", None)
        if plot_dir is not None:
            if plot_dir.exists() and not plot_dir.is_dir():
                raise pytest.UsageError(f"--attncost-plot={plot_dir}: is a file; give a directory")
            if not plot_dir.parent.is_dir():
                raise pytest.UsageError(
                    f"--attncost-plot={plot_dir}: directory {plot_dir.parent} does not exist; create it first"
                )
            where = plot_dir if plot_dir.exists() else plot_dir.parent
            if not os.access(where, os.W_OK | os.X_OK):
                raise pytest.UsageError(f"--attncost-plot={plot_dir}: directory {where} is not writable")
            from .plots import require_matplotlib

            try:
                require_matplotlib()
            except ImportError as exc:
                raise pytest.UsageError(str(exc)) from None
        if config.getoption("attncost_save_prune") and save_path is None:
            raise pytest.UsageError("--attncost-save-prune needs --attncost-save=PATH")
        if save_path is not None:
            from .baseline import writable

            problem = writable(save_path)
            if problem is not None:
                raise pytest.UsageError(f"--attncost-save={save_path}: {problem}")
        full = bool(config.getoption("attncost_report_full"))
        return cls(
            report=full or flag("attncost_report", "attncost_report"),
            report_full=full,
            unit=unit,
            strict=flag("attncost_strict", "attncost_strict"),
            json_path=json_path,
            markdown_path=markdown_path,
            save_path=save_path,
            save_prune=bool(config.getoption("attncost_save_prune")),
            compare_path=compare_path,
            max_increase=raw_increase,
            compare_strict=flag("attncost_compare_strict", "attncost_compare_strict"),
            plot_dir=plot_dir,
            backend=_backend(config),
            crosscheck=flag("attncost_crosscheck", "attncost_crosscheck"),
            cache=_ini_bool(config, "attncost_cache") if config.getoption("attncost_no_cache") is None else False,
        )


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


def _percent(text: str) -> float:
    value = float(text.strip().rstrip("%"))
    if not math.isfinite(value) or value < 0:
        raise ValueError(text)
    return value


def _percent_arg(text: str) -> float:
    try:
        return _percent(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage >= 0 such as 2.5, got {text!r}") from None


def _report_path(config: pytest.Config, dest: str, option: str, ini: str | None = None) -> Path | None:
    """A report path, checked before any test runs: a lost report after a long run helps no one."""
    path = _path_value(config, dest, ini)
    if path is None:
        return None
    value = config.getoption(dest) or str(path)
    if path.is_dir():
        raise pytest.UsageError(f"{option}={value}: is a directory; give a file path such as {value}/attncost.json")
    parent = path.parent
    if not parent.exists():
        raise pytest.UsageError(f"{option}={value}: directory {parent} does not exist; create it first")
    if not parent.is_dir():
        raise pytest.UsageError(f"{option}={value}: {parent} is not a directory")
    if not os.access(parent, os.W_OK):
        raise pytest.UsageError(f"{option}={value}: directory {parent} is not writable")
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


def pytest_addoption(parser: pytest.Parser) -> None:
    """Start-up: register the --attncost-* options and their ini twins."""
    group = parser.getgroup("attncost", "attention cost budgets (pytest-attncost)")
    # default=None, not False: "not given" must be told apart so the ini twin is consulted.
    group.addoption("--attncost-report", action="store_true", default=None, help=_REPORT_HELP)
    group.addoption("--attncost-unit", metavar="UNIT", type=_unit_arg, default=None, help=_UNIT_HELP)
    group.addoption("--attncost-report-full", action="store_true", default=False, help=_REPORT_FULL_HELP)
    group.addoption("--attncost-strict", action="store_true", default=None, help=_STRICT_HELP)
    group.addoption("--attncost-json", metavar="PATH", default=None, help=_JSON_HELP)
    group.addoption("--attncost-markdown", metavar="PATH", default=None, help=_MARKDOWN_HELP)
    group.addoption("--attncost-save", metavar="PATH", default=None, help=_SAVE_HELP)
    group.addoption("--attncost-save-prune", action="store_true", default=False, help=_PRUNE_HELP)
    group.addoption("--attncost-compare", metavar="PATH", default=None, help=_COMPARE_HELP)
    group.addoption("--attncost-max-increase", metavar="PCT", type=_percent_arg, default=None, help=_INCREASE_HELP)
    group.addoption("--attncost-compare-strict", action="store_true", default=None, help=_COMPARE_STRICT_HELP)
    group.addoption("--attncost-plot", metavar="DIR", default=None, help=_PLOT_HELP)
    group.addoption("--attncost-backend", metavar="NAME", type=_backend_arg, default=None, help=_BACKEND_HELP)
    group.addoption("--attncost-crosscheck", action="store_true", default=None, help=_CROSSCHECK_HELP)
    group.addoption("--attncost-no-cache", action="store_true", default=None, help=_NO_CACHE_HELP)
    parser.addini("attncost_cache", _CACHE_INI_HELP, type="bool", default=True)
    parser.addini("attncost_backend", _BACKEND_HELP, default="fvcore")
    parser.addini("attncost_crosscheck", _CROSSCHECK_HELP, type="bool", default=False)
    parser.addini("attncost_report", _REPORT_HELP, type="bool", default=False)
    parser.addini("attncost_save", _SAVE_HELP, default="")
    parser.addini("attncost_compare", _COMPARE_HELP, default="")
    parser.addini("attncost_max_increase", _INCREASE_HELP, default="0")
    parser.addini("attncost_compare_strict", _COMPARE_STRICT_HELP, type="bool", default=False)
    parser.addini("attncost_unit", _UNIT_HELP, default="mac")
    parser.addini("attncost_strict", _STRICT_HELP, type="bool", default=False)


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")  # pytest-xdist worker; no xdist import needed


def pytest_configure(config: pytest.Config) -> None:
    """Start-up: register the marker, resolve the settings, start the session collector."""
    config.addinivalue_line("markers", MARKER_HELP)
    settings = Settings.from_config(config)
    config.stash[SETTINGS_KEY] = settings
    config.stash[BASELINE_KEY] = _load_baselines(config, settings)
    # A new session starts from an empty cache: a second pytest.main() in one process must
    # not be served profiles counted under the first one's code and settings.
    config.stash[CACHE_WAS_KEY] = cache.set_enabled(settings.cache)
    cache.clear_cache()
    config.pluginmanager.register(AttncostSession(config), "attncost-session")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistHooks(), "attncost-xdist")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Shut-down: drop this session's profiles and give the process its cache switch back."""
    if CACHE_WAS_KEY in config.stash:
        cache.clear_cache()
        cache.set_enabled(config.stash[CACHE_WAS_KEY])


@dataclass
class Baselines:
    """The --attncost-compare baseline and the --attncost-save file's current entries."""

    compare: dict[tuple[str, str, int, int, str, str, str], dict[str, Any]] | None = None
    compare_versions: dict[str, str] | None = None
    existing: dict[tuple[str, str, int, int, str, str, str], dict[str, Any]] | None = None


def _load_baselines(config: pytest.Config, settings: Settings) -> Baselines:
    """Controller: read and validate once; workers get the compare entries through workerinput."""
    from .baseline import BaselineError, entry_key, load

    if _is_worker(config):
        shipped = config.workerinput.get("attncost_baseline")  # type: ignore[attr-defined]
        if shipped is None:
            return Baselines()
        return Baselines(compare={entry_key(row): row for row in shipped})
    result = Baselines()
    try:
        if settings.compare_path is not None:
            result.compare, result.compare_versions = load(settings.compare_path)
        if settings.save_path is not None and settings.save_path.exists():
            result.existing, _ = load(settings.save_path)
    except BaselineError as exc:
        raise pytest.UsageError(str(exc)) from None
    return result


class _XdistHooks:
    def pytest_configure_node(self, node: Any) -> None:
        """Controller: hand each worker the baseline it already validated."""
        baselines = node.config.stash[BASELINE_KEY]
        if baselines.compare is not None:
            node.workerinput["attncost_baseline"] = list(baselines.compare.values())


# --- marker ------------------------------------------------------------------------------


def _parse(node: Any) -> Bounds | None:
    marks = list(node.iter_markers("attncost"))
    if not marks:
        return None
    args, kwargs = merged_kwargs(marks)
    return parse_marker_kwargs(args, kwargs)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Collection: expand n=[...] into one item per length, with ids n=<len>."""
    try:
        bounds = _parse(metafunc.definition)
    except MarkerError:
        return  # left unexpanded; the test reports the problem at setup
    if bounds is None or len(bounds.lengths) < 2:
        return
    if any(LENGTH_ARG in _argnames(mark) for mark in metafunc.definition.iter_markers("parametrize")):
        return  # the user parametrizes the lengths: setup says the two cannot both decide
    if LENGTH_ARG not in metafunc.fixturenames:
        metafunc.fixturenames.append(LENGTH_ARG)
    metafunc.parametrize(LENGTH_ARG, list(bounds.lengths), ids=[f"n={n}" for n in bounds.lengths])


def _argnames(mark: Any) -> list[str]:
    names = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
    if isinstance(names, str):
        return [name.strip() for name in names.split(",")]
    return list(names)


#: Why a list of lengths could not become one item per length, by what holds the list.
UNEXPANDED = {
    "parametrize": ("n={lengths} in @pytest.mark.attncost and @pytest.mark.parametrize('attncost_n', ...) both "
                    "give the lengths; keep one of them"),
    "unittest": ("n={lengths} cannot parametrize a unittest.TestCase method (pytest does not parametrize "
                 "unittest tests); give one n, or write a plain test function"),
    "late": ("n={lengths} was not expanded into one test per length: a list of lengths works on the test "
             "function, its class or module, not on pytest.param(...) or request.applymarker(); give one n "
             "there, or move the list to @pytest.mark.attncost on the function"),
}


def _unexpanded(item: pytest.Item, bounds: Bounds) -> str | None:
    """Why a marker's list of lengths did not parametrize this item, if it did not."""
    if len(bounds.lengths) < 2:
        return None
    callspec = getattr(item, "callspec", None)
    if callspec is not None and LENGTH_ARG in callspec.params:
        if any(LENGTH_ARG in _argnames(mark) for mark in item.iter_markers("parametrize")):
            return UNEXPANDED["parametrize"].format(lengths=list(bounds.lengths))
        return None
    kind = "unittest" if getattr(item, "_testcase", None) is not None else "late"
    return UNEXPANDED[kind].format(lengths=list(bounds.lengths))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before each test's fixtures: refuse a malformed marker, naming the test and the keyword."""
    problem: str | None = None
    try:
        bounds = _parse(item)
    except MarkerError as exc:
        problem = str(exc)
    if problem is None and bounds is not None:
        problem = _unexpanded(item, bounds)
    if problem is not None:  # outside the except block: no chained traceback in the report
        pytest.fail(f"{item.nodeid}: @pytest.mark.attncost: {problem}", pytrace=False)
    if bounds is not None:
        item.stash[BOUNDS_KEY] = bounds


def _current_bounds(item: pytest.Item) -> Bounds | None:
    """The marker as it stands now: request.applymarker() may have added one after setup."""
    try:
        bounds = _parse(item)
    except MarkerError:
        return item.stash.get(BOUNDS_KEY, None)
    if bounds is not None:
        item.stash[BOUNDS_KEY] = bounds
    return bounds


# --- fixture -----------------------------------------------------------------------------


class AttncostFixture:
    """What the ``attncost`` fixture gives a test: ``profile()`` with the marker's n and batch."""

    def __init__(self, item: pytest.Item, bounds: Bounds | None, length: int | None) -> None:
        self._item = item
        self._length = length

    @property
    def _bounds(self) -> Bounds | None:
        # read when used: a marker applied at run time (request.applymarker) counts too
        return _current_bounds(self._item)

    @property
    def _n(self) -> int | None:
        bounds = self._bounds
        if self._length is None and bounds is not None and len(bounds.lengths) == 1:
            return bounds.lengths[0]
        return self._length

    @property
    def n(self) -> int | None:
        """This item's sequence length from the marker (None without one)."""
        return self._n

    @property
    def batch(self) -> int:
        """The marker's batch (1 by default)."""
        return self._bounds.batch if self._bounds is not None and self._bounds.batch is not None else 1

    @property
    def profiles(self) -> list[Profile]:
        """Profiles made so far in this test."""
        return list(self._item.stash.get(PROFILES_KEY, []))  # type: ignore[arg-type]

    def profile(
        self,
        model: Any,
        n: int | None = None,
        *,
        batch: int | None = None,
        inputs: Any = None,
        roles: Any = None,
        spec: Any = None,
        name: str | None = None,
        backend: str | None = None,
        mode: str | None = None,
        causal: str = "full",
        fallback: bool = True,
        new_tokens: int | None = None,
    ) -> Profile:
        """Like :func:`pytest_attncost.profile`, defaulting n and batch to the marker's and the backend to
        the ini's; recorded for the report (and counted by both backends when cross-checking)."""
        from .api import profile

        # The marker's n and batch hold for explicit tensors too: profile() then checks that the
        # inputs agree, instead of the test silently passing at another length.
        if n is None:
            n = self._n
        if batch is None and self._bounds is not None:
            batch = self._bounds.batch
        if mode is None:  # the marker's mode (and decode step), else a forward pass
            mode = (self._bounds.mode if self._bounds is not None else None) or "forward"
        if mode == "decode" and new_tokens is None and self._bounds is not None:
            new_tokens = self._bounds.new_tokens
        settings = self._item.config.stash[SETTINGS_KEY]
        options = dict(batch=batch, inputs=inputs, roles=roles, spec=spec, name=name, mode=mode, causal=causal,
                       new_tokens=new_tokens)
        result = profile(model, n, backend=backend or settings.backend, fallback=fallback, **options)
        self._item.stash.setdefault(PROFILES_KEY, []).append(result)
        wanted = self._bounds.crosscheck if self._bounds is not None and self._bounds.crosscheck is not None else (
            settings.crosscheck)
        if wanted and mode == "forward":
            other = "torch" if result.backend == "fvcore" else "fvcore"
            try:
                second: Any = profile(model, n, backend=other, fallback=False, **options)
            except Exception as exc:  # noqa: BLE001 - reported as the cross-check's failure
                second = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            self._item.stash.setdefault(CROSSCHECK_KEY, {})[id(result)] = second
        return result

    def measure(self, model: Any, n: int | None = None, *, batch: int | None = None, inputs: Any = None,
                roles: Any = None, spec: Any = None, name: str | None = None, backend: str | None = None,
                device: Any = "cpu", dtype: Any = None, warmup: int = 2, repeats: int = 5,
                threads: int | None = None) -> Any:
        """Like :func:`pytest_attncost.measure`: time the real model beside its count, with the marker's n
        and batch; the profile and the timing go to the report, and the marker's time bounds check it."""
        from .timing import measure

        if n is None:
            n = self._n
        if batch is None and self._bounds is not None:
            batch = self._bounds.batch
        settings = self._item.config.stash[SETTINGS_KEY]
        timing = measure(model, n, batch=batch, inputs=inputs, roles=roles, spec=spec, name=name,
                         backend=backend or settings.backend, device=device, dtype=dtype, warmup=warmup,
                         repeats=repeats, threads=threads)
        self._item.stash.setdefault(PROFILES_KEY, []).append(timing.profile)
        self._item.stash.setdefault(TIMINGS_KEY, []).append(timing)
        return timing

    def sweep(self, model: Any, ns: Any, **profile_kwargs: Any) -> Sweep:
        """Like :func:`pytest_attncost.sweep`; every profile is recorded, and the sweep is checked
        against the marker's crossover bounds."""
        from .api import sweep

        if profile_kwargs.get("batch") is None and self._bounds is not None and self._bounds.batch is not None:
            profile_kwargs["batch"] = self._bounds.batch
        result = sweep(model, ns, **profile_kwargs)
        self._item.stash.setdefault(PROFILES_KEY, []).extend(result)
        self._item.stash.setdefault(SWEEPS_KEY, []).append(result)
        return result


@pytest.fixture
def attncost_n() -> int | None:
    """This item's length when the marker gives a list of lengths (parametrized), else None."""
    return None


@pytest.fixture
def attncost(request: pytest.FixtureRequest, attncost_n: int | None) -> AttncostFixture:
    """Profile models in a test: ``attncost.profile(model)``; bounds come from ``@pytest.mark.attncost``."""
    item = request.node
    return AttncostFixture(item, item.stash.get(BOUNDS_KEY, None), attncost_n)


# --- checks after the call ---------------------------------------------------------------


def _rows_for(item: pytest.Item, settings: Settings) -> tuple[list[dict[str, Any]], list[str]]:
    from .baseline import compare, entry_key

    bounds = item.stash.get(BOUNDS_KEY, None)
    baseline = item.config.stash[BASELINE_KEY].compare
    allowed = bounds.max_increase if bounds is not None and bounds.max_increase is not None else settings.max_increase
    rows, problems = [], []
    keys_seen: set[Any] = set()
    profiles = item.stash.get(PROFILES_KEY, [])
    timings = {id(t.profile): t for t in item.stash.get(TIMINGS_KEY, [])}
    for result in profiles:
        row = result.to_dict()
        timing = timings.get(id(result))
        if timing is not None:
            row["timing"] = timing.to_dict()
        row["skipped_matmul_ops"] = result.skipped_matmul_ops
        found = check_bounds(bounds, row, settings.unit) if bounds is not None else []
        if settings.strict and result.skipped_matmul_ops:
            ops = ", ".join(f"{op} x{count}" for op, count in sorted(result.skipped_matmul_ops.items()))
            found.append(STRICT_MESSAGE.format(ops=ops))
        if settings.strict and result.fallback:
            found.append(FALLBACK_MESSAGE.format(reason=result.fallback))
        if settings.strict:
            found += [WARNING_MESSAGE.format(warning=warning) for warning in result.warnings]
        second = item.stash.get(CROSSCHECK_KEY, {}).get(id(result))
        if second is not None:
            row["crosscheck"], disagreements = _crosscheck(result, second)
            found += disagreements
        row["test_id"] = item.nodeid
        if settings.save_path is not None or baseline is not None:
            key = entry_key(row)
            if key in keys_seen:
                found.append(DUPLICATE_KEY.format(name=result.name, n=result.n, batch=result.batch))
            keys_seen.add(key)
        if baseline is not None:
            entry = baseline.get(entry_key(row))
            if entry is None:
                row["vs_baseline"] = "new"
            else:
                regressions, row["vs_baseline"] = compare(entry, row, allowed)
                found += [str(r) for r in regressions]
        row["problems"] = found
        checked = (bounds is not None and bounds.has_bounds) or row.get("vs_baseline", "new") != "new"
        row["verdict"] = "FAIL" if found else ("ok" if checked else "-")
        prefix = f"{result.name}: " if len(profiles) > 1 else ""
        problems += [prefix + p for p in found]
        rows.append(row)
    return rows, problems


class AttncostCheckError(AssertionError):
    """Broken bounds (or baseline regressions, cross-checks, strict mode) after a test body ran.

    Raised in the call phase, like an assertion in the body, so that ``xfail``, ``skip`` and
    unittest's ``expectedFailure`` treat it as they would treat the test's own failure.
    """


def failure_text(problems: list[str]) -> str:
    """The failure, first problem on the header line (pytest's short summary shows that line)."""
    if problems == [NO_PROFILE]:
        return f"@pytest.mark.attncost: {NO_PROFILE}"
    headline = f"attncost: {problems[0]}"
    if len(problems) == 1:
        return headline
    return "\n".join([headline, f"{CHECKS_FAILED} ({len(problems)}):", *(f"  {p}" for p in problems)])


def _check(item: pytest.Item, body_passed: bool = True) -> list[str]:
    """Make the item's rows (kept for the report) and return what its bounds, baseline and modes reject.

    When the body did not pass (it failed, skipped or xfailed), its profiles are reported but not
    judged: the test's own outcome stands, as it would for an assertion after the failing line.
    """
    if CHECKED_KEY in item.stash:
        return item.stash[CHECKED_KEY]
    problems: list[str] = []
    properties: list[tuple[str, object]] = []
    bounds = _current_bounds(item)
    if PROFILES_KEY in item.stash or bounds is not None:
        rows, problems = _rows_for(item, item.config.stash[SETTINGS_KEY])
        if bounds is not None and body_passed:
            from .timing import TIME_BOUNDS, check_time_bounds

            wanted = {key: getattr(bounds, key) for key in TIME_BOUNDS}
            timed = check_time_bounds(item.stash.get(TIMINGS_KEY, []), wanted)
            problems += timed
            for row in rows if timed else ():
                row["problems"], row["verdict"] = [*row["problems"], *timed], "FAIL"
        if not body_passed:
            problems = []
            for row in rows:
                row["problems"], row["verdict"] = [], "-"
        # JSON strings, so --junitxml shows JSON and xdist ships plain text
        properties += [(USER_PROPERTY, json.dumps(row, sort_keys=True, allow_nan=False)) for row in rows]
        sweeps = item.stash.get(SWEEPS_KEY, [])
        for made in sweeps:
            data = made.to_dict()
            data["test_id"] = item.nodeid
            found = check_sweep(bounds, data) if bounds is not None else []
            data["problems"] = found
            problems += found
            properties.append((SWEEP_PROPERTY, json.dumps(data, sort_keys=True, allow_nan=False)))
        if not body_passed:
            problems = []
        elif bounds is not None and not rows:
            problems = [NO_PROFILE]
        elif bounds is not None and bounds.has_sweep_bounds and not sweeps:
            problems.append(NO_SWEEP)
    item.stash[PROPERTIES_KEY] = properties
    item.stash[CHECKED_KEY] = problems
    return problems


def _checked_unittest_method(item: pytest.Item) -> Any:
    """unittest runs the method inside its own result logic: check there, so expectedFailure applies.

    pytest hands unittest ``item.obj`` as the method to run; the checks go around it.
    """
    if getattr(item, "_testcase", None) is None:
        return None
    method = item.obj  # type: ignore[attr-defined]

    @functools.wraps(method)
    def checked(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        value = method(*args, **kwargs)
        problems = _check(item)
        if problems:
            raise AttncostCheckError(failure_text(problems))
        return value

    expecting = getattr(method, "__unittest_expecting_failure__", None)
    if expecting is not None:
        checked.__unittest_expecting_failure__ = expecting  # type: ignore[attr-defined]
    item.obj = checked  # type: ignore[attr-defined]
    return method


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """The call phase: after the body, a broken bound fails the test as an assertion in it would."""
    __tracebackhide__ = True
    patched = _checked_unittest_method(item)
    try:
        result = yield
    except BaseException:
        _check(item, body_passed=False)  # failed, skipped or xfailed: its rows still go to the report
        raise
    finally:
        if patched is not None:
            item.obj = patched  # type: ignore[attr-defined]
    problems = _check(item)
    if problems:
        raise AttncostCheckError(failure_text(problems))
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """After the call phase: attach the profiles to the report; a failed check reads as its message."""
    report = yield
    if call.when == "call":
        stored = item.stash.get(PROPERTIES_KEY, None)
        if stored is not None:
            item.user_properties.extend(stored)
        report.user_properties = list(item.user_properties)
        if report.failed and call.excinfo is not None and isinstance(call.excinfo.value, AttncostCheckError):
            report.longrepr = str(call.excinfo.value)  # the checks' own words; no plugin frames
    return report


# --- session -----------------------------------------------------------------------------


def _ours(value: object) -> dict[str, Any] | None:
    """A row or sweep this plugin recorded (a JSON object with its test id), else None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if isinstance(value, dict) and isinstance(value.get("test_id"), str) and isinstance(value.get("name"), str):
        return value
    return None


FILE_ERROR = "attncost: could not write the {what} ({path}): {reason}; the other reports were written"
PRUNE_SKIPPED = ("attncost: --attncost-save-prune pruned nothing: {why}; entries of tests this run did not see "
                 "were kept (prune after a complete run)")


class AttncostSession:
    """Per-run state on the controller (or the only process): rows for reports and files."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.settings = config.stash[SETTINGS_KEY]
        self.rows: dict[tuple[str, int], dict[str, Any]] = {}
        self.sweeps: dict[tuple[str, int], dict[str, Any]] = {}
        self.outcomes: dict[str, str] = {}
        self.collected = 0
        self.incomplete: list[str] = []  # why this run did not see the whole suite
        self.file_errors: list[str] = []  # files that could not be written after the tests

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
        ran = sum(1 for outcome in self.outcomes.values())
        if not reasons and ran < self.collected:
            reasons.append(f"only {ran} of {self.collected} collected tests ran")
        return "; ".join(dict.fromkeys(reasons)) if reasons else None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Each test phase, on the controller too under xdist: collect outcomes and profiles."""
        previous = self.outcomes.get(report.nodeid, "passed")
        if report.failed:
            self.outcomes[report.nodeid] = "failed" if report.when == "call" else "error"
        elif report.skipped and previous == "passed":
            self.outcomes[report.nodeid] = "skipped"
        else:
            self.outcomes.setdefault(report.nodeid, "passed")
        if report.when != "teardown":
            return
        index = 0
        for key, value in report.user_properties:
            if key in (USER_PROPERTY, SWEEP_PROPERTY):
                data = _ours(value)
                if data is not None:  # a user's own record_property("attncost", ...) is theirs
                    (self.rows if key == USER_PROPERTY else self.sweeps)[(report.nodeid, index)] = data
            index += 1

    def final_sweeps(self) -> list[dict[str, Any]]:
        return sorted(self.sweeps.values(), key=lambda s: (s["test_id"], s["name"], s["lengths"]))

    def final_rows(self) -> list[dict[str, Any]]:
        rows = []
        for (nodeid, _), row in self.rows.items():
            rows.append({**row, "outcome": self.outcomes.get(nodeid, "passed")})
        return rows

    def missing(self) -> list[tuple[str, str, int, int, str, str, str]]:
        """Baseline entries that no profile of this run matched."""
        compared = self.config.stash[BASELINE_KEY].compare
        if compared is None:
            return []
        from .baseline import entry_key

        seen = {entry_key(row) for row in self.rows.values()}
        return sorted(key for key in compared if key not in seen)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """End of the run, before the summary: save the baseline, write the report files (controller only).

        The baseline and the reports come first; plots and the step summary after, and a file that
        cannot be written is reported (and fails the run) without costing the others.
        """
        if _is_worker(self.config):
            return
        rows = self.final_rows()
        sweeps = self.final_sweeps()
        unit = self.settings.unit
        if self.settings.save_path is not None:
            self._save(session, rows)
        if self.settings.compare_strict and self.missing() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.settings.plot_dir is not None and sweeps:
            self._write("plots", self.settings.plot_dir, lambda: self._plot(sweeps, unit))
        if self.settings.json_path is not None:
            self._write("json", self.settings.json_path,
                        lambda: write_atomic(self.settings.json_path, render_json(rows, unit, sweeps)))  # type: ignore[arg-type]
        markdown = None
        if self.settings.markdown_path is not None:
            markdown = render_markdown(rows, unit, sweeps, self.settings.markdown_path.parent)
            self._write("markdown", self.settings.markdown_path,
                        lambda: write_atomic(self.settings.markdown_path, markdown))  # type: ignore[arg-type]
        summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if summary and (self.settings.report or self.settings.markdown_path is not None):
            text = render_markdown(rows, unit, sweeps, link_plots=False)
            self._write("GITHUB_STEP_SUMMARY", Path(summary), lambda: append_once(Path(summary), text))
        if self.file_errors and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _write(self, what: str, path: Path, write: Callable[[], None]) -> None:
        try:
            write()
        except OSError as exc:
            self.file_errors.append(FILE_ERROR.format(what=what, path=path, reason=exc.strerror or exc))

    def _plot(self, sweeps: list[dict[str, Any]], unit: str) -> None:
        from .plots import plot_sweep, stem_for

        assert self.settings.plot_dir is not None
        self.settings.plot_dir.mkdir(exist_ok=True)
        for data in sweeps:
            paths = plot_sweep(data, self.settings.plot_dir, stem_for(data["test_id"], data["name"]), unit)
            data["plots"] = [str(path) for path in paths]

    def _save(self, session: pytest.Session, rows: list[dict[str, Any]]) -> None:
        from .baseline import BaselineError, save

        keep: set[str] | None = None
        if self.settings.save_prune:
            blocker = self._prune_blocker(session)
            if blocker is None:
                keep = set(self.outcomes)
            else:
                self.file_errors.append(PRUNE_SKIPPED.format(why=blocker))
        path = self.settings.save_path
        assert path is not None
        try:
            save(path, rows, keep)
        except BaselineError as exc:
            self.file_errors.append(f"attncost: the baseline was not saved: {exc}")
        except OSError as exc:
            self.file_errors.append(FILE_ERROR.format(what="baseline", path=path, reason=exc.strerror or exc))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """End of the run: baseline notes, then the table when asked for."""
        if _is_worker(self.config):
            return
        self._baseline_summary(terminalreporter)
        unit = self.settings.unit
        for line in self.file_errors:
            terminalreporter.write_line(line, red=not line.startswith(PRUNE_SKIPPED[:30]))
        if not self.settings.report:
            return
        terminalreporter.write_sep("=", f"attncost report (counts in {unit.upper()})")
        width = None if self.settings.report_full else self.config.get_terminal_writer().fullwidth
        for line in render_terminal(self.final_rows(), unit, self.final_sweeps(), width=width,
                                    full=self.settings.report_full):
            terminalreporter.write_line(line)
        failed = " ".join(self.file_errors)
        for label, path in (("json", self.settings.json_path), ("markdown", self.settings.markdown_path)):
            if path is not None and str(path) not in failed:
                terminalreporter.write_line(f"attncost {label} written to {path}")

    def _baseline_summary(self, terminalreporter: Any) -> None:
        baselines = self.config.stash[BASELINE_KEY]
        if baselines.compare is None:
            return
        from .reporting import versions

        lines = []
        now = versions()
        drift = [f"{name} {old} -> {now.get(name, 'absent')}" for name, old in sorted((baselines.compare_versions or {}).items())
                 if name in ("torch", "fvcore", "pytest-attncost") and now.get(name) != old]
        if drift:
            lines.append(f"warning: the baseline was made with other versions ({', '.join(drift)}); counts may differ")
        new = sorted({(r["test_id"], r["name"], r["n"], r["batch"]) for r in self.rows.values() if r.get("vs_baseline") == "new"})
        lines += [f"new (not in the baseline): {t} [{name} n={n} batch={b}]" for t, name, n, b in new]
        missing = self.missing()
        strict = " (fails the run: --attncost-compare-strict)" if self.settings.compare_strict else ""
        lines += [f"missing (in the baseline, not seen in this run){strict}: {t} [{name} n={n} batch={b}]"
                  for t, name, n, b, *_ in missing]
        if lines:
            terminalreporter.write_sep("-", f"attncost baseline {self.settings.compare_path}")
            for line in lines:
                terminalreporter.write_line(line)
