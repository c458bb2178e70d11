"""Sessions that end early or run partly: the report still tells what finished."""

import json

import pytest

SUITE = """
import os
import pytest
from tiny_models import torch_encoder

def test_a(attncost):
    attncost.profile(torch_encoder, 16)

def test_b(attncost):
    attncost.profile(torch_encoder, 32)

def test_stop(attncost):
    {stop}

def test_z_after(attncost):
    attncost.profile(torch_encoder, 64)
"""


def _rows(path):
    return [(r["test_id"].split("::")[1], r["n"]) for r in json.loads(path.read_text())["profiles"]]


def test_keyboard_interrupt_keeps_finished_tests(project):
    project.makepyfile(test_suite=SUITE.format(stop="raise KeyboardInterrupt"))
    # a subprocess: in-process, the interrupt would stop this session too
    result = project.runpytest_subprocess("--attncost-json=out.json", "--attncost-report")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert _rows(project.path / "out.json") == [("test_a", 16), ("test_b", 32)]
    result.stdout.fnmatch_lines(["*attncost report*", "test_suite.py::test_a *", "test_suite.py::test_b *"])


def test_worker_crash_under_xdist_keeps_finished_tests(project):
    pytest.importorskip("xdist")
    project.makepyfile(test_suite=SUITE.format(stop="os._exit(3)"))
    result = project.runpytest_subprocess("-n", "2", "--attncost-json=out.json", "--attncost-report")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    # written once, from the controller (workers write nothing), in test-id order, whole: also what
    # test_hardening_files' xdist check asked, without a second -n 2 session
    assert _rows(project.path / "out.json") == [("test_a", 16), ("test_b", 32), ("test_z_after", 64)]
    assert not [p for p in project.path.iterdir() if p.name.endswith(".tmp")]
    result.stdout.fnmatch_lines(["*test_stop*crashed*"])


def test_last_failed_and_keyword_selection(project):
    project.makepyfile(test_suite=SUITE.format(stop="raise AssertionError('boom')"))
    project.runpytest("-p", "cacheprovider")
    result = project.runpytest("-p", "cacheprovider", "--lf", "--attncost-json=lf.json")
    result.assert_outcomes(failed=1)
    assert _rows(project.path / "lf.json") == []
    result = project.runpytest("-k", "test_b", "--attncost-json=k.json")
    result.assert_outcomes(passed=1)
    assert _rows(project.path / "k.json") == [("test_b", 32)]


def test_collect_only_runs_nothing(project):
    project.makepyfile(test_suite=SUITE.format(stop="pass"))
    result = project.runpytest("--collect-only", "--attncost-report", "--attncost-json=out.json")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*no profiles were made in this session*"])
    assert json.loads((project.path / "out.json").read_text())["profiles"] == []
