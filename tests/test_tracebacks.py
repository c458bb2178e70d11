"""A failing model shows the user's frames, not the plugin's; --full-trace and the plugin's own bugs show all."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import pytest_attncost
from pytest_attncost import errors

MODEL = """
import torch
from torch import nn


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        raise ValueError("the user's model breaks here")
"""

TEST = """
import pytest
import torch
from mymodel import Broken


@pytest.mark.attncost(n=4)
def test_broken(attncost):
    attncost.profile(Broken(), inputs=(torch.zeros(1, 4, 8),))
"""


@pytest.fixture
def suite(pytester):
    pytester.makepyfile(mymodel=MODEL, test_model=TEST)
    pytester.syspathinsert()
    return pytester


def plugin_frames(lines: list[str]) -> list[str]:
    return [line for line in lines if "pytest_attncost/" in line and ".py:" in line]


def test_a_failing_model_shows_its_own_frames_and_none_of_the_plugins(suite):
    result = suite.runpytest("-p", "no:randomly")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*raise ValueError(\"the user's model breaks here\")*", "mymodel.py:12: ValueError",
                                 "*attncost.profile(Broken()*", "*CountError: Broken: fvcore could not trace*"])
    assert plugin_frames(result.outlines) == []


def test_full_trace_shows_every_frame(suite):
    result = suite.runpytest("-p", "no:randomly", "--full-trace")
    assert any("pytest_attncost/api.py" in line for line in plugin_frames(result.outlines))


def test_a_bug_of_the_plugins_own_shows_its_frames(suite, monkeypatch):
    monkeypatch.setattr(pytest_attncost.families, "prepare_twin", None)  # the pipeline calls None: a TypeError
    result = suite.runpytest("-p", "no:randomly")
    result.stdout.fnmatch_lines(["*TypeError*"])
    assert any("pytest_attncost/pipeline.py" in line for line in plugin_frames(result.outlines))


def test_every_module_of_the_package_hides_its_frames():
    names = [module.name for module in pkgutil.walk_packages(pytest_attncost.__path__, "pytest_attncost.")]
    assert len(names) > 20
    for name in ["pytest_attncost", *names]:
        if name == "pytest_attncost.__main__":  # importing it runs the command line
            continue
        module = importlib.import_module(name)
        assert module.__dict__.get("__tracebackhide__") is errors.hidden, name


def test_a_marker_error_is_its_message_alone(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.attncost(n=0)
        def test_bad(attncost):
            pass
    """)
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*test_bad: @pytest.mark.attncost: n must be a positive int, got 0"])
    assert "traceback entries are hidden" not in result.stdout.str()  # pytest.fail(pytrace=False) keeps our frames


def test_every_plugin_failure_is_located_in_the_users_code(project: pytest.Pytester) -> None:
    # the crash line (pytest's "file:line: Error", the short summary's and junit's location) is the user's test
    project.makepyfile(test_checks="""
        import pytest
        from tiny_models import bert_like
        from pytest_attncost import ModelSpec, profile

        def test_check_formula():
            spec = ModelSpec(hidden=128, heads=2, head_dim=64, layers=2, ffn_dim=999)
            profile(bert_like, 16, spec=spec).check_formula(rtol=0)

        @pytest.mark.attncost(n=16, total_max=1)
        def test_marker(attncost):
            attncost.profile(bert_like)

        @pytest.mark.attncost(n=16, audit=lambda n: 5)
        def test_audit(attncost):
            attncost.profile(bert_like)
    """)
    reports = [r for r in project.inline_run().getreports("pytest_runtest_logreport") if r.failed]
    assert sorted(r.location[2] for r in reports) == ["test_audit", "test_check_formula", "test_marker"]
    for report in reports:
        crash = getattr(report.longrepr, "reprcrash", None)
        if crash is not None:  # a traceback: its crash line is the user's
            assert crash.path.endswith("test_checks.py"), (report.location, crash.path)
            if report.location[2] == "test_check_formula":
                assert crash.lineno == 7  # the line that called check_formula
        assert "pytest_attncost" + __import__("os").sep not in report.longreprtext, report.longreprtext
