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

pytestmark = pytest.mark.shared_profiles  # their runs are about files and verdicts (conftest.project)

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


# The first session (a subprocess) holds its save's window open, between reading the baseline and replacing it, until
# the second (in-process) has reached its save and then a moment more: a save without the lock reads the old
# baseline in that moment and loses the first's entries (before the lock, every attempt lost one run's, 5 of 5).
HELD_SAVE = """
import os, time
from pathlib import Path
import pytest

def wait_for(flag):
    deadline = time.monotonic() + 600  # a safety net for a session that never comes, not a measure of speed
    while not Path(flag).exists():
        assert time.monotonic() < deadline, flag
        time.sleep(0.05)

if os.environ.get("SAVE_ROLE") == "first":
    from pytest_attncost import baseline

    render = baseline.render_baseline
    def held(*args, **kwargs):  # called with the baseline read, before it is replaced
        Path("first-in.flag").touch()
        wait_for("second-ready.flag")
        deadline = time.monotonic() + 2  # the second's read: at once without the lock, never while we hold it
        while not Path("second-read.flag").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return render(*args, **kwargs)
    baseline.render_baseline = held

if os.environ.get("SAVE_ROLE") == "second":
    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(session):  # just before the plugin's save
        wait_for("first-in.flag")
        Path("second-ready.flag").touch()
"""


def test_concurrent_saves_and_reports_lose_nothing(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    # two pytest sessions in two processes saving one baseline and writing one JSON and one Markdown report; the
    # first with its own TMPDIR (two containers or tox environments on one shared file system); one of them
    # in-process, as the sessions overlap by the flags above, not by starting together
    suite.makeconftest(HELD_SAVE)
    (suite.path / "tmp-first").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(suite.path), os.environ.get("PYTHONPATH", "")]),
           "SAVE_ROLE": "first", "TMPDIR": str(suite.path / "tmp-first")}
    target = suite.path / "same.json"
    reports = [f"--attncost-save={target}", "--attncost-json=shared.json", "--attncost-markdown=shared.md"]
    first = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                              "test_a or test_b", *reports], cwd=suite.path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        monkeypatch.setenv("SAVE_ROLE", "second")
        render = baseline_mod.render_baseline

        def read(*args: object, **kwargs: object) -> str:  # the second's save has read the baseline
            (suite.path / "second-read.flag").touch()
            return render(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(baseline_mod, "render_baseline", read)
        second = suite.runpytest("-k", "test_c or test_d", *reports)
        monkeypatch.undo()
    finally:
        output = first.communicate(timeout=600)[0].decode()  # a safety net for a hung run
    assert (first.returncode, second.ret) == (0, pytest.ExitCode.OK), output + second.stdout.str()
    assert saved_tests(target) == ["test_a", "test_b", "test_c", "test_d"]
    # the lock is removed by the last holder; no temporary is left, here or in the first's TMPDIR
    assert sorted(p.name for p in suite.path.iterdir() if p.name.startswith(".same")) == []
    assert list((suite.path / "tmp-first").iterdir()) == []
    # each report is one session's, whole, not interleaved
    document = json.loads((suite.path / "shared.json").read_text())
    assert sorted(row["test_id"] for row in document["profiles"]) in (
        ["test_suite.py::test_a", "test_suite.py::test_b"], ["test_suite.py::test_c", "test_suite.py::test_d"])
    assert (suite.path / "shared.md").read_text().count("## attncost report") == 1
    assert not [p for p in suite.path.iterdir() if p.name.endswith(".tmp")]


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
        baseline.save(Path({str(target)!r}), [], baseline.Prune(frozenset()))  # a change: prune every entry
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


# two sessions writing one report at once: test_concurrent_saves_and_reports_lose_nothing above (one pair of
# pytest processes checks the baseline and both reports).


# xdist: the report is written once, from the controller: see test_plugin's
# test_xdist_writes_what_a_serial_run_writes_and_keeps_a_crashed_workers_finished_tests (one -n 2 session checks all).


# --- one writer, one reader: planted links, private temporaries, locks beside the file, special files -------


def test_a_planted_temporary_link_is_not_followed(suite: pytest.Pytester) -> None:
    # another user plants links at the temporary names the files would have had (.NAME.PID.tmp, in-process: this pid)
    base, victim = suite.path / "base.json", suite.path / "victim"
    suite.runpytest(f"--attncost-save={base}").assert_outcomes(passed=4)
    base.chmod(0o600)
    victim.write_text("victim\n")
    victim.chmod(0o644)
    for name in ("base.json", "report.json", "report.md"):
        (suite.path / f".{name}.{os.getpid()}.tmp").symlink_to(victim)
    result = suite.runpytest(f"--attncost-save={base}", "--attncost-json=report.json", "--attncost-markdown=report.md")
    result.assert_outcomes(passed=4)
    assert victim.read_text() == "victim\n" and oct(victim.stat().st_mode & 0o777) == "0o644"
    for name in ("base.json", "report.json", "report.md"):
        assert not (suite.path / name).is_symlink() and (suite.path / name).stat().st_size > 100, name
    assert oct(base.stat().st_mode & 0o777) == "0o600" and saved_tests(base) == ["test_a", "test_b", "test_c", "test_d"]


def test_a_temporary_is_private_while_it_holds_the_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = tmp_path / "base.json"
    base.write_text(baseline_mod.render_baseline([]) + "\n")  # not what a save writes: it is replaced
    base.chmod(0o640)
    seen: list[tuple[str, int]] = []
    fsync, replace = os.fsync, os.replace

    def watched_fsync(fd: int) -> None:
        seen.append(("fsync", os.fstat(fd).st_mode & 0o777))  # the data is written and flushed: who may read it?
        fsync(fd)

    def watched_replace(source: str, target: str) -> None:
        seen.append(("replace", os.stat(source).st_mode & 0o777))
        replace(source, target)

    monkeypatch.setattr(os, "fsync", watched_fsync)
    monkeypatch.setattr(os, "replace", watched_replace)
    baseline_mod.save(base, [], None)
    new = tmp_path / "new.json"
    baseline_mod.save(new, [], None)
    monkeypatch.undo()
    umask = os.umask(0o077)
    os.umask(umask)
    assert seen == [("fsync", 0o600), ("replace", 0o640), ("fsync", 0o600), ("replace", 0o666 & ~umask)]
    assert base.stat().st_mode & 0o777 == 0o640 and new.stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_held_lock_fails_the_save_in_time(suite: pytest.Pytester) -> None:
    from pytest_attncost import files

    base = suite.path / "base.json"
    suite.runpytest(f"--attncost-save={base}", "-k", "test_a").assert_outcomes(passed=1)
    before = base.read_bytes()
    with files.locked(suite.path / ".base.json.lock", timeout=0):  # a run that stopped (Ctrl-Z) while it saved
        # in-process: flock excludes another open file description of this same process as it does another process
        result = suite.runpytest(f"--attncost-save={base}", "--attncost-lock-timeout=0.5", "-k", "test_b")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([f"attncost: the baseline was not saved: the lock {suite.path}/.base.json.lock was "
                                 "still held after 0.5 s: another pytest run saving to this baseline holds it*delete "
                                 "the lock file if no run is active*"])
    assert base.read_bytes() == before


def test_a_lock_that_cannot_be_taken_is_named(suite: pytest.Pytester) -> None:
    (suite.path / ".base.json.lock").mkdir()  # what root's denied permissions cannot show: no lock can be opened
    result = suite.runpytest("--attncost-save=base.json", "-k", "test_a")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["attncost: the baseline was not saved: cannot take the lock *.base.json.lock: *"])
    assert not (suite.path / "base.json").exists()


@pytest.mark.parametrize(("option", "ini", "message"), [
    ("--attncost-lock-timeout=soon", "", "*--attncost-lock-timeout: expected a number of seconds >= 0*'soon'*"),
    ("", "attncost_lock_timeout = -1", "*attncost_lock_timeout = '-1' in the ini file: expected seconds >= 0*"),
])
def test_a_bad_lock_timeout_is_a_usage_error(project: pytest.Pytester, option: str, ini: str, message: str) -> None:
    if ini:
        project.makeini(f"[pytest]\n{ini}\n")
    result = project.runpytest(*[o for o in (option,) if o])
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


@pytest.mark.skipif(not (Path("/dev/null").is_char_device() and os.access("/dev/null", os.W_OK)),
                    reason="needs a writable /dev/null")
def test_dev_null_as_a_report_is_written_in_place(project: pytest.Pytester) -> None:
    project.makepyfile(test_suite=ONE_PROFILE)
    result = project.runpytest("--attncost-json=/dev/null")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK and Path("/dev/null").is_char_device()


def test_dev_null_as_the_baseline_is_not_a_regular_file(suite: pytest.Pytester) -> None:
    result = suite.runpytest("--attncost-compare=/dev/null")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*baseline /dev/null is not a regular file (a character device)*"])
    result.stderr.no_fnmatch_line("*is empty*")


@pytest.mark.parametrize("option", ["--attncost-save", "--attncost-compare"])
def test_a_fifo_as_the_baseline_is_refused_without_hanging(suite: pytest.Pytester, option: str) -> None:
    os.mkfifo(suite.path / "base.json")
    # a subprocess with a timeout: an open() that blocked on the FIFO would hang this session, not fail a test
    result = suite.runpytest_subprocess(f"{option}=base.json", timeout=600)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*baseline *base.json is not a regular file (a FIFO)*"])


def test_a_fifo_as_a_report_is_written_in_place_or_refused(project: pytest.Pytester) -> None:
    import threading

    project.makepyfile(test_suite="def test_x():\n    pass\n")  # no model: the subprocess need not import torch
    read, unread = project.path / "read.fifo", project.path / "unread.fifo"
    os.mkfifo(read)
    os.mkfifo(unread)
    received: list[bytes] = []

    def reader() -> None:  # `--attncost-json=>(jq .)` in a shell: someone reads the pipe
        with open(read, "rb") as handle:
            received.append(handle.read())

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    # a subprocess with a timeout, as above: a write that blocked on the unread FIFO would hang this session
    result = project.runpytest_subprocess(f"--attncost-json={read}", f"--attncost-markdown={unread}", timeout=600)
    thread.join(timeout=600)
    result.assert_outcomes(passed=1)
    assert json.loads(received[0])["schema"] == 1
    result.stdout.fnmatch_lines([f"attncost: could not write the markdown ({unread}): {unread} is a FIFO that no "
                                 "process is reading*"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert read.is_fifo() and unread.is_fifo()


def test_a_symlinked_report_stays_a_link(project: pytest.Pytester) -> None:
    project.makepyfile(test_suite=ONE_PROFILE)
    (project.path / "runs").mkdir()
    (project.path / "reports").mkdir()
    for name in ("latest.json", "latest.md"):
        (project.path / "runs" / name).write_text("stale\n")
        (project.path / "reports" / name).symlink_to(project.path / "runs" / name)
    project.runpytest("--attncost-json=reports/latest.json", "--attncost-markdown=reports/latest.md").assert_outcomes(
        passed=1)
    assert all((project.path / "reports" / name).is_symlink() for name in ("latest.json", "latest.md"))
    assert json.loads((project.path / "runs" / "latest.json").read_text())["profiles"][0]["n"] == 16
    assert "## attncost report" in (project.path / "runs" / "latest.md").read_text()


def test_a_read_only_report_is_refused(project: pytest.Pytester) -> None:
    project.makepyfile(test_suite=ONE_PROFILE)
    report = project.path / "report.json"
    report.write_text("kept\n")
    report.chmod(0o444)  # the mode bits, not access(): root could write it anyway
    result = project.runpytest("--attncost-json=report.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--attncost-json=report.json: *report.json is read-only; make it writable "
                                 "(chmod u+w *report.json) or write elsewhere*"])
    assert report.read_text() == "kept\n" and oct(report.stat().st_mode & 0o777) == "0o444"


def test_plot_stems_never_collide() -> None:
    from pytest_attncost import plots

    ids = [("t.py::test_x[sp ace]", "m"), ("t.py::test_x[sp_ace]", "m"), ("a/b/../c.py::t", "m"),
           ("a_b_.._c.py::t", "m"), ("t.py::test_y", "m"), ("t.py::test_y", "m")]
    stems = plots.stems_for(ids)
    assert len(set(stems)) == len(ids), stems
    assert stems == plots.stems_for(ids)  # stable: the same run names its files the same way
    assert stems[4].startswith("t.py_test_y-m-") and stems[5].startswith("t.py_test_y-m-")
    assert stems[0].startswith("t.py_test_x_sp_ace_-m-") and stems[3] == "a_b_.._c.py_t-m"
    assert plots.stems_for([("t.py::test_y", "m")]) == ["t.py_test_y-m"]  # nothing replaced, no twin: no hash


def test_two_sweeps_of_one_model_in_one_test_get_their_own_plots(project: pytest.Pytester) -> None:
    project.makepyfile(test_plotted="""
        from tiny_models import torch_encoder

        def test_sweeps(attncost):
            attncost.sweep(torch_encoder, [8, 16, 32])
            attncost.sweep(torch_encoder, [8, 16, 32])
    """)
    result = project.runpytest("--attncost-plot=plots", "--attncost-markdown=report.md")
    result.assert_outcomes(passed=1)
    names = sorted(p.name for p in (project.path / "plots").iterdir())
    assert len(names) == 8, names  # shares and parts, PNG and SVG, twice
    markdown = (project.path / "report.md").read_text()
    linked = {line.split("(")[1].rstrip(")") for line in markdown.splitlines() if line.lstrip().startswith("![")}
    assert len(linked) == 4 and all((project.path / link).exists() for link in linked), linked  # two PNGs a sweep


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving a link to another user needs root")
def test_a_link_another_user_planted_in_a_shared_directory_is_not_followed(tmp_path: Path) -> None:
    from pytest_attncost import files

    shared, victim = tmp_path / "shared", tmp_path / "victim"
    shared.mkdir()
    shared.chmod(0o1777)  # /tmp: anyone may write, the sticky bit keeps each user's names their own
    victim.write_text("victim\n")
    (shared / "report.json").symlink_to(victim)
    os.lchown(shared / "report.json", 65534, 65534)
    with pytest.raises(files.Refused, match="report.json is a link that another user .uid 65534. made"):
        files.write(shared / "report.json", "{}")
    assert victim.read_text() == "victim\n" and (shared / "report.json").is_symlink()
    os.lchown(shared / "report.json", 0, 0)  # this user's own link is followed, and stays a link
    files.write(shared / "report.json", "{}")
    assert victim.read_text() == "{}" and (shared / "report.json").is_symlink()
