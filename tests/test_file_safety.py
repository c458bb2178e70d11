"""Hostile and unlucky paths: one file under two names, a report over a baseline, links and locks other users
planted, owners and groups, read-only file systems, full disks, temporaries killed writes left, Ctrl-C in a
write, and baselines that must not be read."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_attncost import baseline as baseline_mod
from pytest_attncost import files

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="other users' files and links need root to make")
OTHER = 1234  # a uid and gid no file here has


def _private_parent() -> Path | None:
    """The first directory above this checkout or the interpreter's environment that other users cannot pass
    through (a clone under ``mktemp -d``, 0700), where the package could not be imported as another user."""
    for start in (Path.cwd(), Path(sys.prefix)):
        for directory in (start, *start.parents):
            if not directory.stat().st_mode & 0o001:
                return directory
    return None


#: The tests that import the package as uid OTHER need root and a checkout that uid can reach.
_PRIVATE = _private_parent()
runs_the_package_as_another_user = pytest.mark.skipif(
    os.geteuid() != 0 or _PRIVATE is not None,
    reason="other users' files need root to make" if os.geteuid() != 0 else
    f"{_PRIVATE} is private (0700?): uid {OTHER} could not import the package from this checkout")


def entry(test_id: str = "t.py::test_a", **changes: object) -> dict:
    # counts written by hand: parts 3 + 4 + 5 + 6 = total 18
    row = dict(test_id=test_id, name="M", n=16, batch=1, total=18, attention_core=3, attention_proj=4, ffn=5,
               other=6)
    row.update(changes)
    return row


class Row:
    """What baseline.save takes: anything with to_dict()."""

    def __init__(self, test_id: str = "t.py::test_a", total: int = 18) -> None:
        self.data = entry(test_id, total=total, other=total - 12)

    def to_dict(self) -> dict:
        return dict(self.data)


def as_other_user(*command: str) -> None:
    subprocess.run(["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", *command], check=True)


@pytest.fixture
def base(project: pytest.Pytester) -> Path:
    """A saved baseline of one entry, and a suite with one test that profiles nothing."""
    project.makepyfile(test_suite="def test_x():\n    pass\n")
    path = project.path / "b.json"
    path.write_text(baseline_mod.render_baseline([entry()]))
    return path


# --- one file, many names ------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["dotdot", "link", "ini and a linked directory"])
def test_two_options_naming_one_real_file_are_a_usage_error(project: pytest.Pytester, base: Path, how: str) -> None:
    before = base.read_bytes()
    (project.path / "sub").mkdir()
    if how == "dotdot":
        args = ["--attncost-save=b.json", "--attncost-markdown=sub/../b.json"]
    elif how == "link":
        (project.path / "l.json").symlink_to(base)
        args = ["--attncost-save=b.json", "--attncost-json=l.json"]
    else:  # the ini's path is relative to the rootdir, the option's to wherever it points
        (project.path / "sub" / "here").symlink_to(project.path)
        project.makeini("[pytest]\nattncost_save = b.json\naddopts = -p no:hypothesispytest -p no:anyio\n")
        args = [f"--attncost-export=bencher:{project.path}/sub/here/b.json"]
    result = project.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    second = "--attncost-export=bencher:" if "ini" in how else args[1].split("=")[0] + "="
    result.stderr.fnmatch_lines([f"*--attncost-save=*b.json and {second}*.json name the same file*give them different "
                                 "paths"])
    assert base.read_bytes() == before


def test_a_report_over_a_saved_baseline_is_refused_unless_asked(project: pytest.Pytester, base: Path) -> None:
    before = base.read_bytes()
    for option in ("--attncost-json", "--attncost-markdown", "--attncost-export=bencher:"):
        result = project.runpytest(f"{option}{'' if option.endswith(':') else '='}b.json")
        assert result.ret == pytest.ExitCode.USAGE_ERROR, option
        result.stderr.fnmatch_lines(["*b.json is a saved attncost baseline, which this report would replace; give "
                                     "the report another path, or pass --attncost-replace-baseline"])
        assert base.read_bytes() == before
    project.runpytest("--attncost-json=r.json").assert_outcomes(passed=1)
    project.runpytest("--attncost-json=r.json").assert_outcomes(passed=1)  # a report over a report: as ever
    project.runpytest("--attncost-json=b.json", "--attncost-replace-baseline").assert_outcomes(passed=1)
    assert json.loads(base.read_text())["profiles"] == []


# --- links and locks other users planted ---------------------------------------------------------------------


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory other users can reach (pytest's tmp_path lies under a private one)."""
    directory = Path(tempfile.mkdtemp(prefix="attncost-"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory)


@pytest.fixture
def shared(open_dir: Path) -> Path:
    directory = open_dir / "shared"
    directory.mkdir()
    directory.chmod(0o1777)  # /tmp: anyone may write, the sticky bit keeps each user's names their own
    return directory


@root_only
def test_a_lock_link_another_user_planted_is_never_followed(shared: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("victim\n")
    as_other_user("ln", "-s", str(victim), str(shared / ".b.json.lock"))
    with pytest.raises(baseline_mod.BaselineError, match=r"\.b\.json\.lock is a link that another user \(uid 1234\)"):
        baseline_mod.save(shared / "b.json", [Row()], None)
    assert victim.read_text() == "victim\n" and not (shared / "b.json").exists()


def test_a_lock_link_is_refused_and_the_lock_is_opened_without_following_links(tmp_path: Path) -> None:
    victim, lock = tmp_path / "victim", tmp_path / ".b.json.lock"
    victim.write_text("victim\n")
    lock.symlink_to(victim)
    with pytest.raises(baseline_mod.BaselineError, match=r"\.b\.json\.lock is a symbolic link \(to .*victim\).*delete"):
        baseline_mod.save(tmp_path / "b.json", [Row()], None)
    # the check above could be raced; the lock's own O_NOFOLLOW cannot be
    with pytest.raises(OSError) as raised, files.locked(lock, timeout=0):
        pass
    assert raised.value.errno == errno.ELOOP and victim.read_text() == "victim\n" and lock.is_symlink()


@root_only
def test_a_link_another_user_planted_in_a_parent_directory_is_not_followed(project: pytest.Pytester,
                                                                          shared: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victimdir"
    victim.mkdir()
    as_other_user("ln", "-s", str(victim), str(shared / "out"))
    problem = files.unwritable(shared / "out" / "r.json")
    assert problem is not None and f"{shared}/out is a link that another user (uid 1234) made" in problem
    project.makepyfile(test_suite="def test_x():\n    pass\n")
    for option in ("--attncost-json", "--attncost-save"):
        result = project.runpytest(f"{option}={shared}/out/r.json")
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines([f"*{option}=*r.json: *out is a link that another user (uid 1234) made*"])
    assert list(victim.iterdir()) == []
    os.lchown(shared / "out", 0, 0)  # this user's own link is followed
    files.write(shared / "out" / "r.json", "{}")
    assert (victim / "r.json").read_text() == "{}"


# --- owners, groups, read-only file systems, full disks -------------------------------------------------------


@root_only
@pytest.mark.parametrize(("uid", "gid"), [(OTHER, OTHER), (0, OTHER)], ids=["a user's file", "a group-shared file"])
def test_a_save_by_root_keeps_the_owner_and_group(tmp_path: Path, uid: int, gid: int) -> None:
    path = tmp_path / "b.json"
    path.write_text(baseline_mod.render_baseline([entry("t.py::test_old")]))
    os.chown(path, uid, gid)
    path.chmod(0o664)
    baseline_mod.save(path, [Row()], None)
    info = path.stat()
    assert (info.st_uid, info.st_gid, info.st_mode & 0o777) == (uid, gid, 0o664)
    assert [row["test_id"] for row in json.loads(path.read_text())["profiles"]] == ["t.py::test_a", "t.py::test_old"]


@runs_the_package_as_another_user
def test_a_user_who_cannot_keep_the_owner_is_refused_saying_why(open_dir: Path) -> None:
    path = open_dir / "r.json"
    path.write_text("old\n")
    os.chown(path, 4321, OTHER)  # another user's file that this user's group may write
    path.chmod(0o664)
    open_dir.chmod(0o777)
    code = f"from pathlib import Path; from pytest_attncost import files; files.write(Path({str(path)!r}), 'new')"
    done = subprocess.run(["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", sys.executable, "-c",
                           code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 1
    assert ("r.json belongs to uid 4321 and group 1234; replacing it as uid 1234 would change its owner or group"
            in done.stderr)
    assert path.read_text() == "old\n" and path.stat().st_uid == 4321


def test_a_read_only_file_system_is_named_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "b.json"
    path.write_text("{}")
    statvfs = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: types.SimpleNamespace(f_flag=os.ST_RDONLY) if Path(p).is_relative_to(
        tmp_path) else statvfs(p))  # what a read-only mount says; making one needs privileges a test lacks
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: not (mode & os.W_OK) and access(p, mode) if Path(
        p).is_relative_to(tmp_path) else access(p, mode))  # and what the kernel answers there (EROFS), even to root
    for target in (path, tmp_path / "new.json"):
        problem = files.unwritable(target)
        assert problem is not None and "on a read-only file system" in problem and "chmod" not in problem, problem


def test_an_unchanged_save_writes_nothing_so_a_full_disk_cannot_fail_it(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "b.json"
    saved = baseline_mod.save(path, [Row()], None)
    assert saved.written and str(saved) == f"attncost: baseline saved to {path}: 1 entry (1 new, 0 changed, 0 pruned)"
    inode = path.stat().st_ino

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tempfile, "mkstemp", full_disk)
    again = baseline_mod.save(path, [Row()], None)
    assert not again.written and "nothing written" in str(again) and path.stat().st_ino == inode
    with pytest.raises(OSError, match="No space left"):
        baseline_mod.save(path, [Row(total=20)], None)  # a change needs the disk
    assert path.stat().st_ino == inode and json.loads(path.read_text())["profiles"][0]["total"] == 18


# --- temporaries killed writes left, Ctrl-C ---------------------------------------------------------------------


def test_every_temporary_a_killed_write_left_is_removed_by_the_next_run(project: pytest.Pytester) -> None:
    project.makepyfile(test_suite="def test_x():\n    pass\n")
    report = project.path / "report.json"
    killer = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from pytest_attncost import files
        os.replace = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # die between write and rename
        files.write(Path({str(report)!r}), "{{}}")
    """)
    assert subprocess.run([sys.executable, "-c", killer]).returncode == -signal.SIGKILL
    (left,) = project.path.glob(".report.json.*.attncost.tmp")
    planted = {name: project.path / f".{name}.abcd_123.attncost.tmp" for name in ("report.md", "bmf.json", "x.png")}
    for path in planted.values():
        path.write_text("a killed write's data")  # what SIGKILL leaves: data, and no writer holding it
    held, foreign, unrelated = (project.path / f".{name}" for name in
                                ("report.md.held0000.attncost.tmp", "report.md.foreign0.attncost.tmp", "report.md.tmp"))
    for path in (held, foreign, unrelated):
        path.write_text("keep me")
    os.chown(foreign, OTHER, OTHER) if os.geteuid() == 0 else foreign.unlink()
    holder = os.open(held, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a live writer
    try:
        project.runpytest("--attncost-json=report.json", "--attncost-markdown=report.md",
                          "--attncost-export=bencher:bmf.json").assert_outcomes(passed=1)
        assert not left.exists() and not any(path.exists() for path in planted.values())
        assert held.exists() and unrelated.exists() and (foreign.exists() or os.geteuid() != 0)
    finally:
        os.close(holder)
    assert files.drop_temporaries(project.path) == [held.name]


def test_ctrl_c_inside_the_baseline_write_ends_as_an_interrupted_session(project: pytest.Pytester,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    project.makepyfile(test_suite="""
        import pytest
        from torch import nn

        @pytest.mark.attncost(n=8)
        def test_a(attncost):  # no transformers to import: the subprocess stays quick
            attncost.profile(lambda: nn.TransformerEncoderLayer(16, 2, 32, batch_first=True))
    """)
    base = project.path / "b.json"
    base.write_text(baseline_mod.render_baseline([entry("test_suite.py::test_old")]))
    before = base.read_bytes()
    fsync = os.fsync

    def interrupted_fsync(fd: int) -> None:
        if ".b.json." in os.readlink(f"/proc/self/fd/{fd}"):  # the baseline's temporary, its data written
            # what Python's SIGINT handler raises at a Ctrl-C, here, raised as it would be (a signal sent to the
            # process is delivered to its main thread, and an xdist worker may not run the test there)
            raise KeyboardInterrupt
        fsync(fd)

    monkeypatch.setattr(os, "fsync", interrupted_fsync)
    try:
        result = project.runpytest("--attncost-save=b.json", "--attncost-json=r.json")
    except KeyboardInterrupt:  # it escaped the session: the traceback and exit 130 users saw
        pytest.fail("Ctrl-C in the baseline write escaped pytest's session")
    finally:
        monkeypatch.undo()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*Interrupted: KeyboardInterrupt while attncost wrote the baseline (*b.json): it "
                                 "holds its old content or the new one whole; the other files were written*"])
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
    assert base.read_bytes() == before and not list(project.path.glob("*.attncost.tmp"))
    assert [row["test_id"] for row in json.loads((project.path / "r.json").read_text())["profiles"]] == [
        "test_suite.py::test_a"]


def test_the_lock_removed_by_its_holder_is_taken_afresh_by_a_waiter(tmp_path: Path) -> None:
    import threading

    lock, order = tmp_path / ".b.json.lock", []
    with files.locked(lock, timeout=0):
        waiter = threading.Thread(target=lambda: _hold(lock, order))
        waiter.start()  # it opens this lock file and waits for it
        waiter.join(0.3)
        order.append("first done")
    waiter.join(60)
    assert order == ["first done", "second held a lock that was the file at the path"] and not lock.exists()
    with pytest.raises(files.LockTimeout), files.locked(lock, timeout=0):
        with files.locked(lock, timeout=0):
            pass


def _hold(lock: Path, order: list[str]) -> None:
    with files.locked(lock, timeout=60):
        fresh = lock.exists()
        order.append("second held a lock that was the file at the path" if fresh else "second held a removed file")


def test_a_save_says_what_it_saved_where_and_leaves_no_lock(project: pytest.Pytester) -> None:
    project.makepyfile(test_suite="""
        import pytest
        from tiny_models import torch_encoder

        @pytest.mark.attncost(n=16)
        def test_a(attncost):
            attncost.profile(torch_encoder)
    """)
    result = project.runpytest("--attncost-save=b.json")
    result.stdout.fnmatch_lines(["attncost: baseline saved to */b.json: 1 entry (1 new, 0 changed, 0 pruned)"])
    result = project.runpytest("--attncost-save=b.json")
    result.stdout.fnmatch_lines(["attncost: baseline */b.json already held this run's profiles (1 entry): nothing "
                                 "written"])
    assert sorted(p.name for p in project.path.iterdir() if p.name.startswith((".b.json", "b.json"))) == ["b.json"]


# --- baselines that must not be read -----------------------------------------------------------------------------


def _document(profiles: str, schema: str = "1") -> str:
    return f'{{"schema": {schema}, "unit": "MAC", "versions": {{}}, "profiles": [{profiles}]}}'


GOOD = json.dumps(entry())


@pytest.mark.parametrize(("text", "message"), [
    (_document(GOOD[:-1] + ', "total": 100}'),
     r"the key 'total' is given twice in the entry t\.py::test_a \[M\]"),
    ('{"schema": 1, "schema": 2, "unit": "MAC", "profiles": []}', "the key 'schema' is given twice"),
    (_document(GOOD, "true"), "has schema True; this pytest-attncost reads schema 1"),
    (_document(GOOD, "1.0"), "has schema 1.0; this pytest-attncost reads schema 1"),
    (_document(json.dumps(entry(test_id=""))), "profile #0 has an empty 'test_id'"),
    (_document(json.dumps(entry(name=" "))), "profile #0 has an empty 'name'"),
    (_document(json.dumps(entry(total=19))),
     r"profile #0 \(t\.py::test_a \[M\]\) has total=19 but its parts \(attention_core, attention_proj, ffn, other\) "
     "add up to 18"),
], ids=["duplicate key in an entry", "duplicate key at the top", "schema true", "schema 1.0", "empty test id",
        "empty name", "parts that do not add up"])
def test_a_baseline_that_must_not_be_read_is_refused_naming_the_entry_and_field(tmp_path: Path, text: str,
                                                                                message: str) -> None:
    path = tmp_path / "b.json"
    path.write_text(text)
    with pytest.raises(baseline_mod.BaselineError, match=message):
        baseline_mod.load(path)
    path.write_text(_document(GOOD))
    assert list(baseline_mod.load(path)[0].values()) == [entry()]  # the same file, well-formed, is read


@runs_the_package_as_another_user
def test_another_users_file_is_named_as_theirs_not_as_read_only(open_dir: Path) -> None:
    path = open_dir / "b.json"
    path.write_text("old\n")
    path.chmod(0o644)  # root's, as an earlier save by root in a CI container left a user's baseline
    code = f"from pathlib import Path; from pytest_attncost import files; print(files.unwritable(Path({str(path)!r})))"
    done = subprocess.run(["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", sys.executable, "-c",
                           code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.stdout.strip() == (f"{path} belongs to uid 0 and group 0, and this user (uid 1234) may not write it; "
                                   "write it as its owner, or have them give it back (chown), or write elsewhere")


@runs_the_package_as_another_user
def test_a_set_group_id_directory_gives_the_group_back_without_a_chown(open_dir: Path) -> None:
    shared = open_dir / "team"
    shared.mkdir()
    os.chown(shared, OTHER, 4321)
    shared.chmod(0o2775)  # new files take the directory's group, one this user is not in
    path = shared / "r.json"
    path.write_text("old\n")
    os.chown(path, OTHER, 4321)
    code = f"from pathlib import Path; from pytest_attncost import files; files.write(Path({str(path)!r}), 'new')"
    subprocess.run(["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", sys.executable, "-c", code],
                   check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    info = path.stat()
    assert path.read_text() == "new" and (info.st_uid, info.st_gid) == (OTHER, 4321)
