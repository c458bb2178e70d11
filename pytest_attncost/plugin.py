"""The pytest side: the hooks of the test protocol and the ``attncost`` fixture, nothing else.

Options live in :mod:`~pytest_attncost.settings`, rows, checks, baselines and files in :mod:`~pytest_attncost.session`.
torch and fvcore are imported only when a test profiles a model, so ``pytest --help`` does not pay for them.
"""

from __future__ import annotations

import functools
import unittest
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

from . import cache
from .markers import MARKER_HELP, Bounds, MarkerError
from .request import DEFAULT_REPEATS, DEFAULT_WARMUP
from .session import (
    BASELINE_KEY,
    BOUNDS_KEY,
    CACHE_WAS_KEY,
    CROSSCHECK_KEY,
    LENGTH_ARG,
    PROFILES_KEY,
    PROPERTIES_KEY,
    SETTINGS_KEY,
    SWEEPS_KEY,
    TIMINGS_KEY,
    AttncostCheckError,
    AttncostSession,
    XdistHooks,
    check,
    current_bounds,
    failure_text,
    load_baselines,
    parse_marker,
)
from .settings import Settings, add_options

if TYPE_CHECKING:
    from .result import Profile
    from .series import Sweep
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)

__all__ = ["AttncostCheckError", "AttncostFixture", "attncost", "attncost_n"]


def pytest_addoption(parser: pytest.Parser) -> None:
    """Start-up: register the --attncost-* options and their ini twins."""
    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    """Start-up: register the marker, resolve the settings, start the session collector."""
    config.addinivalue_line("markers", MARKER_HELP)
    settings = Settings.from_config(config)
    config.stash[SETTINGS_KEY] = settings
    config.stash[BASELINE_KEY] = load_baselines(config, settings)
    # A new session starts from an empty cache: a second pytest.main() in one process must
    # not be served profiles counted under the first one's code and settings.
    config.stash[CACHE_WAS_KEY] = cache.set_enabled(settings.cache)
    cache.clear_cache()
    config.pluginmanager.register(AttncostSession(config), "attncost-session")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(XdistHooks(), "attncost-xdist")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Shut-down: drop this session's profiles and give the process its cache switch back."""
    if CACHE_WAS_KEY in config.stash:
        cache.clear_cache()
        cache.set_enabled(config.stash[CACHE_WAS_KEY])


# --- marker ------------------------------------------------------------------------------


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Collection: expand n=[...] into one item per length, with ids n=<len>."""
    try:
        bounds = parse_marker(metafunc.definition)
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
    return [name.strip() for name in names.split(",")] if isinstance(names, str) else list(names)


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
    cls = getattr(item, "cls", None)  # (pytest < 8.1 makes item._testcase only at setup)
    kind = "unittest" if isinstance(cls, type) and issubclass(cls, unittest.TestCase) else "late"
    return UNEXPANDED[kind].format(lengths=list(bounds.lengths))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before each test's fixtures: refuse a malformed marker, naming the test and the keyword."""
    problem: str | None = None
    try:
        bounds = parse_marker(item)
    except MarkerError as exc:
        problem = str(exc)
    if problem is None and bounds is not None:
        problem = _unexpanded(item, bounds)
    if problem is not None:  # outside the except block: no chained traceback in the report
        pytest.fail(f"{item.nodeid}: @pytest.mark.attncost: {problem}", pytrace=False)
    if bounds is not None:
        item.stash[BOUNDS_KEY] = bounds


class AttncostFixture:
    """What the ``attncost`` fixture gives a test: ``profile()`` with the marker's n and batch."""

    def __init__(self, item: pytest.Item, length: int | None) -> None:
        self._item, self._length = item, length

    @property
    def _bounds(self) -> Bounds | None:
        # read when used: a marker applied at run time (request.applymarker) counts too
        return current_bounds(self._item)

    @property
    def n(self) -> int | None:
        """This item's sequence length from the marker (None without one)."""
        bounds = self._bounds
        if self._length is None and bounds is not None and len(bounds.lengths) == 1:
            return bounds.lengths[0]
        return self._length

    @property
    def batch(self) -> int:
        """The marker's batch (1 by default)."""
        bounds = self._bounds
        return bounds.batch if bounds is not None and bounds.batch is not None else 1

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
        m: int | None = None,
        memory: bool | None = None,
        optimizer: Any = "adamw",
    ) -> Profile:
        """Like :func:`pytest_attncost.profile`, defaulting n, m and batch to the marker's and the backend to
        the ini's, and memory to whether the marker bounds it; recorded for the report (and counted by both
        backends when cross-checking)."""
        from .api import profile

        n, call = self._marked(n, batch=batch, inputs=inputs, roles=roles, spec=spec, name=name, backend=backend,
                               mode=mode, causal=causal, new_tokens=new_tokens, m=m)
        bounds = self._bounds
        if memory is None:
            memory = bounds is not None and bounds.has_memory_bounds
        result = profile(model, n, fallback=fallback, memory=memory, optimizer=optimizer, **call)
        self._item.stash.setdefault(PROFILES_KEY, []).append(result)
        wanted = bounds.crosscheck if bounds is not None and bounds.crosscheck is not None else (
            self._item.config.stash[SETTINGS_KEY].crosscheck)
        if wanted and call["mode"] == "forward":
            other = "torch" if result.backend == "fvcore" else "fvcore"
            try:
                second: Any = profile(model, n, fallback=False, **{**call, "backend": other})
            except Exception as exc:  # noqa: BLE001 - reported as the cross-check's failure
                second = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            self._item.stash.setdefault(CROSSCHECK_KEY, {})[id(result)] = second
        return result

    def measure(self, model: Any, n: int | None = None, *, batch: int | None = None, inputs: Any = None,
                roles: Any = None, spec: Any = None, name: str | None = None, backend: str | None = None,
                device: Any = "cpu", dtype: Any = None, warmup: int = DEFAULT_WARMUP, repeats: int = DEFAULT_REPEATS,
                seed: int = 0, threads: int | None = None) -> Any:
        """Like :func:`pytest_attncost.measure`: time the real model beside its count, with the marker's n
        and batch; the profile and the timing go to the report, and the marker's time bounds check it."""
        from .api import measure

        n, call = self._marked(n, batch=batch, inputs=inputs, roles=roles, spec=spec, name=name, backend=backend)
        timing = measure(model, n, device=device, dtype=dtype, warmup=warmup, repeats=repeats, seed=seed,
                         threads=threads, **call)
        self._item.stash.setdefault(PROFILES_KEY, []).append(timing.profile)
        self._item.stash.setdefault(TIMINGS_KEY, []).append(timing)
        return timing

    def sweep(self, model: Any, ns: Any, **profile_kwargs: Any) -> Sweep:
        """Like :func:`pytest_attncost.sweep`; every profile is recorded, and the sweep is checked
        against the marker's crossover bounds."""
        from .api import sweep

        _, call = self._marked(None, **{"batch": None, "backend": None, **profile_kwargs})
        result = sweep(model, ns, **call)
        self._item.stash.setdefault(PROFILES_KEY, []).extend(result)
        self._item.stash.setdefault(SWEEPS_KEY, []).append(result)
        return result

    def _marked(self, n: int | None, **call: Any) -> tuple[int | None, dict[str, Any]]:
        """*n* and the *call*'s keywords, the marker's (and ``--attncost-backend``'s) where the test gave none;
        they hold for explicit tensors too: profile() then checks that the inputs agree."""
        bounds = self._bounds
        for key in ("batch", "m", "mode"):
            if key in call and call[key] is None and bounds is not None:
                call[key] = getattr(bounds, key)
        if "mode" in call:  # the marker's mode (and decode step), else a forward pass
            call["mode"] = call["mode"] or "forward"
            if call["mode"] == "decode" and call["new_tokens"] is None and bounds is not None:
                call["new_tokens"] = bounds.new_tokens
        call["backend"] = call["backend"] or self._item.config.stash[SETTINGS_KEY].backend
        return (self.n if n is None else n), call


@pytest.fixture
def attncost_n() -> int | None:
    """This item's length when the marker gives a list of lengths (parametrized), else None."""
    return None


@pytest.fixture
def attncost(request: pytest.FixtureRequest, attncost_n: int | None) -> AttncostFixture:
    """Profile models in a test: ``attncost.profile(model)``; bounds come from ``@pytest.mark.attncost``."""
    return AttncostFixture(request.node, attncost_n)


# --- the call phase: checks fail the test as an assertion would ------------------------


def _checked_unittest_method(item: pytest.Item) -> Any:
    """unittest runs the method inside its own result logic: check there (around ``item.obj``, the method pytest
    hands unittest), so expectedFailure applies."""
    if getattr(item, "_testcase", None) is None:
        return None
    method = item.obj  # type: ignore[attr-defined]

    @functools.wraps(method)
    def checked(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # noqa: F811  this frame too
        value = method(*args, **kwargs)
        problems = check(item)
        if problems:
            raise AttncostCheckError(failure_text(problems))
        return value

    item.obj = checked  # type: ignore[attr-defined]
    return method


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """The call phase: after the body, a broken bound fails the test as an assertion in it would."""
    __tracebackhide__ = True  # noqa: F811  this frame too
    patched = _checked_unittest_method(item)
    try:
        result = yield
    except BaseException:
        check(item, body_passed=False)  # failed, skipped or xfailed: its rows still go to the report
        raise
    finally:
        if patched is not None:
            item.obj = patched  # type: ignore[attr-defined]
    problems = check(item)
    if problems:
        raise AttncostCheckError(failure_text(problems))
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """After the call phase: attach the profiles to the report; a failed check reads as its message."""
    report = yield
    if call.when == "call":
        stored: list[tuple[str, object]] = item.stash.get(PROPERTIES_KEY, [])
        item.user_properties.extend(stored)
        report.user_properties = list(item.user_properties)
        if report.failed and call.excinfo is not None and isinstance(call.excinfo.value, AttncostCheckError):
            report.longrepr = _Failure(str(call.excinfo.value), *item.location[:2])  # type: ignore[assignment]
    return report


class _Failure:
    """A failed check as pytest shows it: the checks' own words (no plugin frames), the first of them in the
    short summary and junitxml's message (pytest reads ``longrepr.reprcrash``; every version since 7)."""

    def __init__(self, text: str, path: str, line: int | None) -> None:
        self.text = text
        self.reprcrash = _Crash(path, (line or 0) + 1, text.splitlines()[0] if text else "")

    def toterminal(self, tw: Any) -> None:
        for line in self.text.splitlines():
            tw.line(line)

    def __str__(self) -> str:
        return self.text


class _Crash:
    def __init__(self, path: str, lineno: int, message: str) -> None:
        self.path, self.lineno, self.message = path, lineno, message

    def __str__(self) -> str:
        return f"{self.path}:{self.lineno}: {self.message}"
