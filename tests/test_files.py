"""Files users can trust: baselines survive partial runs, concurrent saves, links, locks and kills;
reports are written even when plots or the step summary cannot be, replace their targets whole, and
stay whole when two sessions write one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pytest_attncost import baseline as baseline_mod

SUITE = """
import pytest
from tiny_models import torch_encoder

@pytest.mark.attncost(n=16)
def test_a(attncost):
    attncost.profile(torch_encoder, name="a")

@pytest.mark.attncost(n=16)
def test_b(attncost):
    attncost.profile(torch_encoder, name="b")

@pytest.mark.attncost(n=16)
def test_c(attncost):
    attncost.profile(torch_encoder, name="c")

@pytest.mark.attncost(n=16)
def test_d(attncost):
    attncost.profile(torch_encoder, name="d")
"""


@pytest.fixture
def suite(project: pytest.Pytester) -> pytest.Pytester:
    project.makepyfile(test_suite=SUITE)
    return project


def saved_tests(path: Path) -> list[str]:
    return sorted(row["test_id"].split("::")[1] for row in json.loads(path.read_text())["profiles"])


@pytest.mark.parametrize("how", [["--collect-only"], ["-x", "-k", "test_a or test_b"], ["--lf"], ["broken"]])
def test_prune_needs_a_complete_run(suite: pytest.Pytester, how: list[str]) -> None:
    suite.runpytest("--attncost-save=base.json").assert_outcomes(passed=4)
    if how == ["broken"]:
        suite.makepyfile(test_broken="import nonexistent_module")
        how = []
    elif how == ["--lf"]:
        suite.makepyfile(test_fails="def test_fails():\n    assert False")
        suite.runpytest()
    result = suite.runpytest("--attncost-save=base.json", "--attncost-save-prune", *how)
    result.stdout.fnmatch_lines(["attncost: --attncost-save-prune pruned nothing: *"])
    assert saved_tests(suite.path / "base.json") == ["test_a", "test_b", "test_c", "test_d"]


def test_prune_after_a_run_given_paths_or_node_ids_drops_only_what_it_could_see(project: pytest.Pytester) -> None:
    # the baseline holds tests in two directories; a run given one of them (or one node id) never drops the other's
    for where in ("suite/unit", "suite/other"):
        (project.path / where).mkdir(parents=True)
        (project.path / where / f"test_{where[6:]}.py").write_text(SUITE)
    base = project.path / "base.json"

    def saved() -> list[str]:
        return sorted(row["test_id"] for row in json.loads(base.read_text())["profiles"])

    project.runpytest("suite", f"--attncost-save={base}").assert_outcomes(passed=8)
    everything = saved()
    assert len(everything) == 8
    by_id = project.runpytest("suite/unit/test_unit.py::test_a", f"--attncost-save={base}", "--attncost-save-prune")
    by_id.stdout.fnmatch_lines(["attncost: --attncost-save-prune pruned nothing: the node id "
                                "suite/unit/test_unit.py::test_a selects part of the suite*"])
    assert saved() == everything
    project.runpytest("suite/unit", f"--attncost-save={base}", "--attncost-save-prune").stdout.fnmatch_lines(
        ["attncost: --attncost-save-prune pruned only entries of tests under suite/unit *"])
    assert saved() == everything
    # a test removed under the path given goes; the other directory's tests stay, even those --ignore hides
    (project.path / "suite/unit/test_unit.py").write_text(SUITE.split("@pytest.mark.attncost(n=16)\ndef test_d")[0])
    project.runpytest("suite", "--ignore=suite/other", f"--attncost-save={base}",
                      "--attncost-save-prune").assert_outcomes(passed=3)
    assert saved() == [test for test in everything if test != "suite/unit/test_unit.py::test_d"]
    # a run over the whole suite prunes as before
    (project.path / "suite/other/test_other.py").write_text(SUITE.split("@pytest.mark.attncost(n=16)\ndef test_c")[0])
    project.runpytest(f"--attncost-save={base}", "--attncost-save-prune").assert_outcomes(passed=5)
    assert len(saved()) == 5


def test_concurrent_saves_lose_nothing(suite: pytest.Pytester) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(suite.path), os.environ.get("PYTHONPATH", "")])}
    for attempt in range(1):  # before the lock, every attempt lost one run's entries (5 of 5)
        target = suite.path / f"same{attempt}.json"
        runs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selection,
                                  f"--attncost-save={target}"], cwd=suite.path, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                for selection in ("test_a or test_b", "test_c or test_d")]
        outputs = [run.communicate(timeout=300)[0].decode() for run in runs]
        assert [run.returncode for run in runs] == [0, 0], outputs
        assert saved_tests(target) == ["test_a", "test_b", "test_c", "test_d"]
        assert sorted(p.name for p in suite.path.iterdir() if p.name.startswith(".")) == []  # no lock left


def test_saving_through_a_symlink_keeps_the_link(suite: pytest.Pytester) -> None:
    real = suite.path / "data" / "base.json"
    real.parent.mkdir()
    link = suite.path / "base.json"
    link.symlink_to(real)
    suite.runpytest(f"--attncost-save={link}").assert_outcomes(passed=4)
    assert link.is_symlink() and saved_tests(real) == ["test_a", "test_b", "test_c", "test_d"]
    suite.runpytest(f"--attncost-save={link}", "-k", "test_a").assert_outcomes(passed=1)
    assert link.is_symlink() and len(saved_tests(real)) == 4


def test_a_read_only_baseline_is_refused_before_the_tests(suite: pytest.Pytester) -> None:
    target = suite.path / "base.json"
    suite.runpytest(f"--attncost-save={target}").assert_outcomes(passed=4)
    before = target.read_bytes()
    target.chmod(0o444)  # refused on the mode bits, so root (who could write anyway) is refused too
    try:
        result = suite.runpytest(f"--attncost-save={target}")
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines(["*--attncost-save=*base.json: baseline * is read-only*chmod u+w*"])
        assert target.read_bytes() == before and oct(target.stat().st_mode & 0o777) == "0o444"
    finally:
        target.chmod(0o644)


def test_a_saved_baseline_keeps_its_permissions(suite: pytest.Pytester) -> None:
    target = suite.path / "base.json"
    suite.runpytest(f"--attncost-save={target}").assert_outcomes(passed=4)
    target.chmod(0o600)
    suite.runpytest(f"--attncost-save={target}", "-k", "test_a").assert_outcomes(passed=1)
    assert oct(target.stat().st_mode & 0o777) == "0o600"


def test_a_save_killed_midway_leaves_no_temporary_behind(suite: pytest.Pytester) -> None:
    target = suite.path / "base.json"
    suite.runpytest(f"--attncost-save={target}").assert_outcomes(passed=4)
    killer = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from pytest_attncost import baseline
        os.replace = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # die between write and rename
        baseline.save(Path({str(target)!r}), [], None)
    """)
    done = subprocess.run([sys.executable, "-c", killer], cwd=suite.path)
    assert done.returncode == -signal.SIGKILL
    left = list(suite.path.glob(".base.json.*.tmp"))
    assert len(left) == 1 and left[0].stat().st_size > 0
    suite.runpytest(f"--attncost-save={target}", "-k", "test_a").assert_outcomes(passed=1)
    assert list(suite.path.glob(".base.json.*.tmp")) == []
    assert saved_tests(target) == ["test_a", "test_b", "test_c", "test_d"]


def test_two_profiles_with_one_key_are_refused_when_saving(project: pytest.Pytester) -> None:
    project.makepyfile("""
        import pytest
        from tiny_models import bert_like

        @pytest.mark.attncost(n=16)
        def test_two_sizes(attncost):
            attncost.profile(lambda: bert_like(layers=1))
            attncost.profile(lambda: bert_like(layers=2))
    """)
    project.runpytest().assert_outcomes(passed=1)  # no baseline: nothing to confuse
    result = project.runpytest("--attncost-save=base.json")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*two profiles named 'BertModel' at n=16, batch=1 in one test*distinct name=*"])


@pytest.mark.parametrize(("change", "message"), [
    ({"ffn": -5}, "has ffn=-5, which no count can be"),
    ({"mode": 5}, "has mode=5, not a string"),
    ({"n": 0}, "has n=0, which no count can be"),
])
def test_a_baseline_with_impossible_values_is_refused(suite: pytest.Pytester, change: dict, message: str) -> None:
    target = suite.path / "base.json"
    suite.runpytest(f"--attncost-save={target}").assert_outcomes(passed=4)
    document = json.loads(target.read_text())
    document["profiles"][0].update(change)
    target.write_text(json.dumps(document))
    result = suite.runpytest(f"--attncost-compare={target}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])
    with pytest.raises(baseline_mod.BaselineError, match=message):
        baseline_mod.load(target)


def test_plots_that_cannot_be_written_cost_no_other_report(project: pytest.Pytester) -> None:
    project.makepyfile("""
        import os, pytest
        from tiny_models import torch_encoder

        @pytest.mark.attncost(n=16)
        def test_sweep_then_block_the_plots(attncost):
            attncost.sweep(torch_encoder, [8, 16, 32])
            open("plots", "w").close()  # a file where the plot directory should go
    """)
    result = project.runpytest("--attncost-plot=plots", "--attncost-json=report.json",
                               "--attncost-save=base.json", "--attncost-markdown=report.md")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["attncost: could not write the plots (*plots): *; the other reports were written"])
    for name in ("report.json", "base.json", "report.md"):
        assert (project.path / name).stat().st_size > 0, name


def test_an_unwritable_plot_directory_is_refused_up_front(project: pytest.Pytester) -> None:
    (project.path / "plots").write_text("not a directory")
    result = project.runpytest("--attncost-plot=plots")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--attncost-plot=*plots: is a file; give a directory*"])


def test_a_long_test_id_makes_a_short_plot_name(project: pytest.Pytester) -> None:
    name = "test_" + "very_long_name_" * 17
    project.makepyfile(f"""
        import pytest
        from tiny_models import torch_encoder

        @pytest.mark.attncost(n=16)
        def {name}(attncost):
            attncost.sweep(torch_encoder, [8, 16, 32])
    """)
    result = project.runpytest("--attncost-plot=plots")
    result.assert_outcomes(passed=1)
    assert result.ret == 0
    assert all(len(p.name) < 140 for p in (project.path / "plots").iterdir())
    assert len(list((project.path / "plots").iterdir())) == 4  # shares and parts, PNG and SVG


@pytest.mark.parametrize("where", ["directory", "missing", "read-only"])
def test_a_step_summary_that_cannot_be_written(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                               where: str) -> None:
    summary = suite.path / "summary"
    if where == "directory":
        summary.mkdir()
    elif where == "missing":
        summary = suite.path / "no-such-dir" / "summary.md"
    else:  # a file no one may write, root included
        summary = Path("/proc/version")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    result = suite.runpytest("--attncost-report", "--attncost-json=report.json")
    result.assert_outcomes(passed=4)
    assert (suite.path / "report.json").exists()
    result.stdout.fnmatch_lines(["attncost: could not write the GITHUB_STEP_SUMMARY (*): *", "*attncost report*"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_a_plot_matplotlib_cannot_draw_costs_no_report(project: pytest.Pytester,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    # the module the session will import (an earlier in-process run may have dropped it from sys.modules)
    plots = importlib.import_module("pytest_attncost.plots")

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no usable font")

    monkeypatch.setattr(plots, "plot_sweep", broken)
    project.makepyfile(test_plotted_sweep="""
        from tiny_models import torch_encoder

        def test_sweep(attncost):
            attncost.sweep(torch_encoder, [16, 32, 64])
    """)
    result = project.runpytest("--attncost-plot=plots", "--attncost-json=report.json", "--attncost-markdown=report.md")
    result.assert_outcomes(passed=1)
    assert json.loads((project.path / "report.json").read_text())["sweeps"][0]["lengths"] == [16, 32, 64]
    assert "## attncost report" in (project.path / "report.md").read_text()
    result.stdout.fnmatch_lines(["attncost: could not write the plots (*plots): RuntimeError: no usable font; *"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


# --- report files: existing targets, concurrent writers, nothing half-written ---------------------

ONE_PROFILE = """
from tiny_models import torch_encoder

def test_x(attncost):
    attncost.profile(torch_encoder, 16)
"""


def test_existing_targets_are_replaced_whole(project):
    project.makepyfile(test_suite=ONE_PROFILE)
    (project.path / "out.json").write_text("x" * 100_000)
    (project.path / "out.md").write_text("old report\n" * 1000)
    project.runpytest("--attncost-json=out.json", "--attncost-markdown=out.md").assert_outcomes(passed=1)
    assert json.loads((project.path / "out.json").read_text())["profiles"][0]["n"] == 16
    assert "old report" not in (project.path / "out.md").read_text()
    assert [p.name for p in project.path.iterdir() if p.name.endswith(".tmp")] == []


def test_two_sessions_writing_one_report(project):
    project.makepyfile(test_suite=ONE_PROFILE)
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


# xdist: the report is written once, from the controller: see test_outcomes'
# test_worker_crash_under_xdist_keeps_finished_tests (one -n 2 session checks both).
