"""A broken bound takes part in pytest's outcome logic exactly as an assertion in the body would;
sessions that end early or run partly still report what finished; a profile the plugin cannot
stand behind is marked in every report and fails under --attncost-strict."""

import json

import pytest

pytestmark = pytest.mark.shared_profiles  # its runs are about outcomes and failure text (conftest.project)

BROKEN = "@pytest.mark.attncost(n=512, attention_share_max=0.5)"  # bert_like at 512: share 0.600


def test_xfail_and_a_broken_bound(project: pytest.Pytester) -> None:
    project.makepyfile(f"""
        import pytest
        from tiny_models import bert_like

        @pytest.mark.xfail(reason="attention is too expensive here")
        {BROKEN}
        def test_xfail(attncost):
            attncost.profile(bert_like)

        @pytest.mark.xfail(strict=True, reason="known")
        {BROKEN}
        def test_xfail_strict(attncost):
            attncost.profile(bert_like)

        @pytest.mark.xfail(strict=True)
        @pytest.mark.attncost(n=512, attention_share_max=0.7)
        def test_strict_but_within_bounds(attncost):
            attncost.profile(bert_like)
    """)
    result = project.runpytest("-rxX", f"--junitxml={project.path / 'junit.xml'}")
    result.assert_outcomes(xfailed=2, failed=1)
    result.stdout.fnmatch_lines(["XFAIL *::test_xfail - attention is too expensive here",
                                 "XFAIL *::test_xfail_strict - known",
                                 ])
    result.stdout.fnmatch_lines(["*test_strict_but_within_bounds*", "[[]XPASS(strict)[]]*"])
    junit = (project.path / "junit.xml").read_text()
    assert junit.count("<skipped") == 2


def test_unittest_expected_failure_and_plain_unittest(project: pytest.Pytester) -> None:
    project.makepyfile(f"""
        import unittest
        import pytest
        from tiny_models import bert_like

        class Costs(unittest.TestCase):
            @pytest.fixture(autouse=True)
            def _attncost(self, attncost):
                self.attncost = attncost

            @unittest.expectedFailure
            {BROKEN}
            def test_expected(self):
                self.attncost.profile(bert_like)

            {BROKEN}
            def test_plain(self):
                self.attncost.profile(bert_like)
    """)
    result = project.runpytest("-rxf")
    result.assert_outcomes(xfailed=1, failed=1)
    result.stdout.fnmatch_lines(["*attncost: attention_share 0.600 > 0.5 at n=512*"])
    result.stdout.no_fnmatch_line("*Unexpected success*")


def test_skip_and_xfail_after_profiling_are_not_failures_in_the_report(project: pytest.Pytester) -> None:
    project.makepyfile(f"""
        import pytest
        from tiny_models import bert_like

        {BROKEN}
        def test_skips(attncost):
            attncost.profile(bert_like)
            pytest.skip("not on this machine")

        {BROKEN}
        def test_xfails(attncost):
            attncost.profile(bert_like)
            pytest.xfail("known")
    """)
    report = project.path / "report.json"
    result = project.runpytest("--attncost-report", f"--attncost-json={report}")
    result.assert_outcomes(skipped=1, xfailed=1)
    rows = {row["test_id"].split("::")[1]: row for row in json.loads(report.read_text())["profiles"]}
    assert {name: (row["outcome"], row["verdict"], row["problems"]) for name, row in rows.items()} == {
        "test_skips": ("skipped", "-", []), "test_xfails": ("skipped", "-", [])}
    result.stdout.no_fnmatch_line("* FAIL")  # no row's verdict (the legend under the table names it)


def test_a_marker_applied_at_run_time_is_checked(project: pytest.Pytester) -> None:
    project.makepyfile("""
        import pytest
        from tiny_models import bert_like

        def test_late(request, attncost):
            request.applymarker(pytest.mark.attncost(n=512, attention_share_max=0.5))
            result = attncost.profile(bert_like)
            assert result.n == 512
    """)
    result = project.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*attncost: attention_share 0.600 > 0.5 at n=512*"])


def test_lists_of_lengths_that_cannot_be_expanded_say_why(project: pytest.Pytester) -> None:
    project.makepyfile("""
        import unittest
        import pytest
        from tiny_models import bert_like

        @pytest.mark.parametrize("size", [pytest.param(1, marks=pytest.mark.attncost(n=[16, 32]))])
        def test_param(attncost, size):
            attncost.profile(bert_like)

        @pytest.mark.attncost(n=[16, 32])
        @pytest.mark.parametrize("attncost_n", [8, 64])
        def test_both(attncost):
            attncost.profile(bert_like)

        class Case(unittest.TestCase):
            @pytest.mark.attncost(n=[16, 32])
            def test_unittest(self):
                pass

        @pytest.mark.attncost(n=[16, 32])
        def test_fine(attncost):
            attncost.profile(bert_like)
    """)
    result = project.runpytest("-p", "no:randomly")
    result.assert_outcomes(errors=4, passed=2)  # test_fine runs at n=16 and n=32; the session goes on
    result.stdout.fnmatch_lines([
        "*test_param*n=?16, 32? was not expanded into one test per length*pytest.param(...)*",
        "*test_both*n=?16, 32? in @pytest.mark.attncost and @pytest.mark.parametrize('attncost_n', ...) both*",
        "*test_unittest*n=?16, 32? cannot parametrize a unittest.TestCase method*",
    ])


def test_a_users_own_attncost_property_does_not_break_the_session(project: pytest.Pytester) -> None:
    project.makepyfile("""
        import pytest
        from tiny_models import bert_like

        def test_text(record_property):
            record_property("attncost", "high")

        def test_dict(record_property):
            record_property("attncost", {"level": 3})

        def test_look_alike(record_property):
            record_property("attncost", {"test_id": "mine", "name": "not a profile"})

        @pytest.mark.attncost(n=64)
        def test_profiled(attncost):
            attncost.profile(bert_like)
    """)
    report = project.path / "report.json"
    result = project.runpytest("--attncost-report", f"--attncost-json={report}")
    result.assert_outcomes(passed=4)
    assert [row["test_id"] for row in json.loads(report.read_text())["profiles"]] == [
        "test_a_users_own_attncost_property_does_not_break_the_session.py::test_profiled"]


def test_a_failing_profile_prints_no_plugin_frames_and_no_torch_logs(project: pytest.Pytester) -> None:
    project.makepyfile("""
        import pytest
        import torch
        from torch import nn

        class Branchy(nn.Module):  # data-dependent: fvcore and fake tensors fail, real tensors count
            def __init__(self):
                super().__init__()
                self.attn = nn.MultiheadAttention(32, 2, batch_first=True)
                self.mlp = nn.Sequential(nn.Linear(32, 128), nn.Linear(128, 32))

            def forward(self, x):
                h = x + self.attn(x, x, x, need_weights=False)[0]
                if x.sum() > 0:
                    h = h + self.mlp(h)
                return h

        @pytest.mark.attncost(n=16, attention_share_max=0.1)
        def test_branchy(attncost):
            attncost.profile(Branchy(), inputs=(torch.ones(1, 16, 32),))
    """)
    result = project.runpytest()
    result.assert_outcomes(failed=1)
    output = result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines(["attncost: attention_share * > 0.1 at n=16*", "FAILED *test_branchy*"])
    assert "fake_tensor" not in output and "Traceback" not in output
    assert "pytest_attncost" not in output.replace("plugins: attncost", "")
    assert len(output.splitlines()) < 40


def test_measure_through_the_fixture_reports_and_checks_time_bounds(project: pytest.Pytester) -> None:
    project.makepyfile("""
        import pytest
        from tiny_models import bert_like

        @pytest.mark.attncost(n=32, attention_time_share_max=1.0)
        def test_timed(attncost):
            timing = attncost.measure(bert_like, repeats=5, warmup=1, threads=1)
            assert timing.profile.n == 32 and 0 < timing.attention_time_share < 1

        @pytest.mark.attncost(n=32, attention_time_share_max=0.9)
        def test_too_few_repeats(attncost):
            attncost.measure(bert_like, repeats=2, warmup=0, threads=1)

        @pytest.mark.attncost(n=32, attention_time_share_max=0.9)
        def test_nothing_timed(attncost):
            attncost.profile(bert_like)
    """)
    result = project.runpytest("--attncost-report", "--attncost-json=r.json")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines([
        "attncost: attention_time_share_max=0.9: BertModel at n=32 was timed 2 time(s); a bound on measured time*",
        "*attention_time_share_max: nothing was timed: call attncost.measure(model)*",
        "measured time beside the MACs (reported, never gated by a baseline):",
        "  *test_timed*: roofline of this CPU (* threads), predicted / measured: attention_core * / *, "
        "attention_proj * / *, ffn * / *, other * / *, forward * / *",
    ])
    rows = json.loads((project.path / "r.json").read_text())["profiles"]
    timed = [row for row in rows if row.get("timing")]
    assert len(timed) == 2 and all(row["timing"]["repeats"] in (2, 5) for row in timed)
    assert {row["test_id"].split("::")[1]: row["verdict"] for row in rows} == {
        "test_timed": "ok", "test_too_few_repeats": "FAIL", "test_nothing_timed": "FAIL"}


def test_the_short_summary_names_the_first_broken_bound(project: pytest.Pytester,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    project.makepyfile("""
        import pytest
        from tiny_models import bert_like

        @pytest.mark.attncost(n=512, attention_share_max=0.5, quadratic_share_max=0.3)
        def test_x(attncost):
            attncost.profile(bert_like)
    """)
    result = project.runpytest("-rf", "--tb=short")  # pytest 8's summary drops the message under --tb=line
    result.stdout.fnmatch_lines(["FAILED *::test_x - attncost: attention_share 0.600 > 0.5 at n=512 (formula 0.600*"])


# --- sessions that end early or run partly: the report still tells what finished ---------------

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
    # in-process: the test raises the interrupt itself (no signal), and no_reraise_ctrlc keeps it in the inner session
    result = project.runpytest("--attncost-json=out.json", "--attncost-report", no_reraise_ctrlc=True)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert _rows(project.path / "out.json") == [("test_a", 16), ("test_b", 32)]
    result.stdout.fnmatch_lines(["*attncost report*", "test_suite.py::test_a *", "test_suite.py::test_b *"])


# a worker that crashes under xdist: see test_plugin's one -n 2 session
# (test_xdist_writes_what_a_serial_run_writes_and_keeps_a_crashed_workers_finished_tests)


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


# --- a profile the plugin cannot stand behind: marked in every report, failed under --attncost-strict

ODD_MODEL = '''
import pytest
import torch
from torch import nn
from torch.nn import functional as F

D, H = 32, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, H, D // H).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, D))


class Block(nn.Module):
    """Beside attention and FFN, a product of two activations nothing explains."""

    def __init__(self):
        super().__init__()
        self.attn, self.up, self.down = Attention(), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.down(torch.relu(self.up(x))) * (x @ x.transpose(-1, -2)).mean()


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.attncost(n=16)
def test_odd(attncost):
    result = attncost.profile(Odd(), inputs=(torch.zeros(1, 16, D),))
    assert len(result.warnings) == 2
'''


@pytest.fixture
def odd(project: pytest.Pytester) -> pytest.Pytester:
    project.makepyfile(test_odd=ODD_MODEL)
    return project


def test_warnings_are_reported_and_pass_by_default(odd: pytest.Pytester) -> None:
    report = odd.path / "report.json"
    result = odd.runpytest("--attncost-report", f"--attncost-json={report}", f"--attncost-markdown={odd.path / 'r.md'}")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "*Odd (2 warnings)*",
        "warnings (these numbers may be wrong; --attncost-strict fails them):",
        "  test_odd.py::test_odd ?Odd n=16?: layers.0: 8,192 MAC of products of two activations outside the layer's "
        "attention module(s) could not be placed*",
    ])
    (row,) = json.loads(report.read_text())["profiles"]
    assert [w.split(":")[0] for w in row["warnings"]] == ["layers.0", "layers.1"]
    markdown = (odd.path / "r.md").read_text()
    assert "**Warnings (these numbers may be wrong; --attncost-strict fails them):**" in markdown
    assert "layers.1: 8,192 MAC of products of two activations" in markdown


def test_strict_fails_a_profile_with_warnings(odd: pytest.Pytester) -> None:
    result = odd.runpytest("--attncost-strict")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "attncost: the split cannot be trusted: layers.0: *",
        "attncost checks failed (2):",
        "*the split cannot be trusted: layers.0: 8,192 MAC of products of two activations*(--attncost-strict)*",
    ])
