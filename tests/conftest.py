import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

TINY_MODELS_SOURCE = (Path(__file__).parent / "tiny_models.py").read_text()


@pytest.fixture(scope="session")
def _counted_once() -> None:
    """Count once before the first pytester run of a process, so every module torch imports lazily
    while tracing is loaded outside it: pytester drops modules first imported inside a run, and
    some of torch's (operator libraries) cannot be imported twice. A fixture, not import-time
    work, so that collection traces nothing and processes without pytester tests skip it (xdist's
    controller, which runs no test, imports neither torch nor transformers)."""
    import tiny_models
    import torch  # noqa: F401  kept loaded across pytester's in-process runs (imported before the first)
    import transformers  # noqa: F401  likewise: a heavy package must not be re-imported per run

    from pytest_attncost import clear_cache, profile

    profile(tiny_models.torch_encoder(), 8)
    profile(tiny_models.bert_like(), 8)
    profile(tiny_models.llama_like(), 8)
    profile(tiny_models.bert_like(), 8, backend="torch")
    clear_cache()


@pytest.fixture(autouse=True)
def _count_once_before_pytester(request: pytest.FixtureRequest) -> None:
    """Every test that runs pytester gets the warm-up first (however it asks for pytester)."""
    if "pytester" in request.fixturenames:
        request.getfixturevalue("_counted_once")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "shared_profiles: this module's pytester runs share one profile cache (see "
                                       "the project fixture)")


@pytest.fixture(scope="session")
def _shared_profiles() -> dict:
    """The profile cache that pytester runs of a ``shared_profiles`` module share (one per process)."""
    from collections import OrderedDict

    return OrderedDict()


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
            request: pytest.FixtureRequest) -> pytest.Pytester:
    """A pytester project with the tiny models importable and stable output.

    A wide terminal, so that the report keeps every column the tests look for; the tests of
    the report's fitting set COLUMNS themselves.

    In a module marked ``shared_profiles`` (its tests are about what the plugin writes, reads and reports, not about
    counting), each run starts from the profiles the earlier runs of this process counted, instead of from an empty
    cache: the same tiny model at the same length is counted once per process, and served as any repeated
    ``profile()`` is (the cache's own tests, which run without this, show that a served profile is the one a count
    gives). A test file's own ``clear_cache()`` still empties it.
    """
    if request.node.get_closest_marker("shared_profiles"):
        from pytest_attncost import cache

        monkeypatch.setattr(cache, "_CACHE", request.getfixturevalue("_shared_profiles"))
        monkeypatch.setattr(cache, "clear_cache", lambda: None)  # what a session does at its start and end
    monkeypatch.setenv("COLUMNS", "300")
    # the plugin by its entry point's name and nothing else: scanning every installed distribution for pytest11
    # entry points is a fifth of an in-process run (tests with a bare pytester keep pytest's autoloading)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p attncost")
    # hypothesis' and anyio's plugins cost a second of imports in every subprocess run and play no part here
    pytester.makeini("[pytest]\nconsole_output_style = classic\naddopts = -p no:hypothesispytest -p no:anyio\n")
    pytester.makepyfile(tiny_models=TINY_MODELS_SOURCE)
    return pytester


@pytest.fixture
def autoloaded(project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A project whose runs load plugins as users' do, by pytest's autoloading: what ``-p no:attncost`` disables
    is the plugin loaded from its entry point (after a ``-p attncost`` it would stay loaded)."""
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
    monkeypatch.delenv("PYTEST_ADDOPTS")
    return project
