"""Report files: existing targets, concurrent writers, nothing half-written."""

import json
import subprocess
import sys

import pytest

SUITE = """
from tiny_models import torch_encoder

def test_x(attncost):
    attncost.profile(torch_encoder, 16)
"""


def test_existing_targets_are_replaced_whole(project):
    project.makepyfile(test_suite=SUITE)
    (project.path / "out.json").write_text("x" * 100_000)
    (project.path / "out.md").write_text("old report\n" * 1000)
    project.runpytest("--attncost-json=out.json", "--attncost-markdown=out.md").assert_outcomes(passed=1)
    assert json.loads((project.path / "out.json").read_text())["profiles"][0]["n"] == 16
    assert "old report" not in (project.path / "out.md").read_text()
    assert [p.name for p in project.path.iterdir() if p.name.endswith(".tmp")] == []


def test_two_sessions_writing_one_report(project):
    project.makepyfile(test_suite=SUITE)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--attncost-json=shared.json",
               "--attncost-markdown=shared.md"]
    runs = [subprocess.Popen(command, cwd=project.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for _ in range(2)]
    for run in runs:
        run.communicate(timeout=300)
        assert run.returncode == 0
    document = json.loads((project.path / "shared.json").read_text())  # whole, not interleaved
    assert [row["test_id"] for row in document["profiles"]] == ["test_suite.py::test_x"]
    assert (project.path / "shared.md").read_text().count("## attncost report") == 1
    assert not [p for p in project.path.iterdir() if p.name.endswith(".tmp")]


# xdist: the report is written once, from the controller: see test_hardening_sessions'
# test_worker_crash_under_xdist_keeps_finished_tests (one -n 2 session checks both).
