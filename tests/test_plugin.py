"""The plugin as users run it: real pytest sessions through pytester."""

import json
import os
from pathlib import Path

import pytest

from pytest_attncost.markers import NO_PROFILE

pytestmark = pytest.mark.shared_profiles  # its runs are about options, reports and sessions (conftest.project)

# bert_like at n=512: share = (4*128 + 2*512) / (4*128 + 2*512 + 8*128) = 0.6
# bert_like at n=128: share = (512 + 256) / (512 + 256 + 1024) = 0.428...; crossover n = 2hd = 256


@pytest.mark.parametrize(("limit", "outcome"), [(0.7, "passed"), (0.6, "passed"), (0.5999, "failed")])
def test_share_bound(project, limit, outcome):
    project.makepyfile(f"""
        import pytest
        from tiny_models import bert_like

        @pytest.mark.attncost(n=512, attention_share_max={limit})
        def test_bert(attncost):
            attncost.profile(bert_like)
    """)
    result = project.runpytest()
    result.assert_outcomes(**{outcome: 1})
    if outcome == "failed":
        result.stdout.fnmatch_lines([
            f"*attention_share 0.600 > {limit} at n=512 (formula 0.600; attention overtakes FFN at n=256 = 2hd)*"
        ])


def test_every_violation_is_listed(project):
    project.makepyfile("""
        import pytest
        from tiny_models import bert_like

        @pytest.mark.attncost(n=512, attention_share_max=0.5, quadratic_share_max=0.3, total_max="100 MMAC",
                              ffn_max=1000, linear_saving_max=0.1)
        def test_bert(attncost):
            attncost.profile(bert_like)
    """)
    result = project.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "attncost: attention_share 0.600 > 0.5 at n=512 (formula 0.600; attention overtakes FFN at n=256 = 2hd)",
        "attncost checks failed (5):",
        "*attention_share 0.600 > 0.5 at n=512*",
        "*quadratic_share 0.400 > 0.3 at n=512 (formula 0.400; quadratic term dominates at n=768 = 6hd)*",
        "*total 337M MAC > total_max 100M MAC at n=512 (337,199,104 > 100,000,000 MAC; "
        "formula attention+ffn 336M MAC)*",
        "*ffn 134M MAC > ffn_max 1K MAC at n=512 (134,217,728 > 1,000 MAC; formula 134M MAC)*",
        "*linear_attention_saving 0.3500 > 0.1 at n=512*",
    ])


def test_share_min_and_count_units(project):
    project.makepyfile("""
        import pytest
        from tiny_models import bert_like

        @pytest.mark.attncost(n=128, attention_share_min=0.5)
        def test_min(attncost):
            attncost.profile(bert_like)

        # 59,146,240 MACs = 118,292,480 FLOP
        @pytest.mark.attncost(n=128, total_max="118292480 FLOP")
        def test_flop_exact(attncost):
            attncost.profile(bert_like)

        @pytest.mark.attncost(n=128, total_max="118292479 FLOP")
        def test_flop_half_mac_short(attncost):
            attncost.profile(bert_like)
    """)
    result = project.runpytest()
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines([
        "*attention_share 0.429 < 0.5 at n=128*",
        "*total 59.1M MAC > total_max 59.1M MAC at n=128 (59,146,240 > 59,146,239.5 MAC*",
    ])


def test_list_of_lengths_parametrizes(project):
    project.makepyfile("""
        import pytest
        from tiny_models import bert_like

        @pytest.mark.attncost(n=[128, 512], attention_share_max=0.5)
        def test_bert(attncost):
            assert attncost.n in (128, 512)
            result = attncost.profile(bert_like)
            assert result.n == attncost.n

        def test_plain(attncost):
            assert attncost.n is None
    """)
    result = project.runpytest("-v")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_bert?n=128? PASSED*", "*test_bert?n=512? FAILED*"])


def test_class_and_module_marks_combine(project):
    project.makepyfile("""
        import pytest
        from tiny_models import bert_like

        pytestmark = pytest.mark.attncost(n=128, attention_share_max=0.1)

        class TestShapes:
            pytestmark = pytest.mark.attncost(batch=2)

            @pytest.mark.attncost(attention_share_max=0.5)
            def test_nearest_wins(self, attncost):
                result = attncost.profile(bert_like)
                assert (result.n, result.batch) == (128, 2)

            def test_module_bound(self, attncost):
                attncost.profile(bert_like)
    """)
    result = project.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*attention_share 0.429 > 0.1 at n=128, batch=2*"])


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ("n=512, atention_share_max=0.5",
         "unknown keyword 'atention_share_max' (did you mean 'attention_share_max'?); valid: *"),
        ("n='512'", "n must be a positive int, got str '512'"),
        ("n=0", "n must be a positive int, got 0"),
        ("n=[128, -1]", "every n must be a positive int, got -1"),
        ("n=[]", "n=[] is empty*"),
        ("n=128, attention_share_max=1.5", "attention_share_max must be a number in [[]0, 1[]], got 1.5"),
        ("n=128, attention_share_max=True", "attention_share_max must be a number in [[]0, 1[]], got True"),
        ("n=128, attention_share_max=float('nan')", "attention_share_max must be a number in [[]0, 1[]], got nan"),
        ("n=128, attention_share_min=0.6, attention_share_max=0.5",
         "attention_share_min 0.6 > attention_share_max 0.5*"),
        ("n=128, total_max='45 GB'", "total_max: cannot read '45 GB' as a count*"),
        ("n=128, formula_rtol=-1", "formula_rtol must be a finite number >= 0*"),
        ("128", "takes keyword arguments only*"),
    ],
)
def test_misuse_errors_that_test_only(project, marker, message):
    project.makepyfile(f"""
        import pytest
        from tiny_models import bert_like

        @pytest.mark.attncost({marker})
        def test_bad(attncost):
            raise AssertionError("the body must not run")

        def test_other():
            pass
    """)
    result = project.runpytest()
    result.assert_outcomes(errors=1, passed=1)
    result.stdout.fnmatch_lines([f"*test_bad*@pytest.mark.attncost: {message}"])
    result.stdout.no_fnmatch_line("*Traceback*")
    result.stdout.no_fnmatch_line("*the body must not run*")


def test_marked_test_without_profile_fails(project):
    project.makepyfile("""
        import pytest

        @pytest.mark.attncost(n=128, attention_share_max=0.5)
        def test_forgot(attncost):
            pass
    """)
    result = project.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*{NO_PROFILE}*"])


def test_strict_markers_and_marker_help(project):
    project.makepyfile("""
        import pytest
        from tiny_models import torch_encoder

        @pytest.mark.attncost(n=32)
        def test_ok(attncost):
            attncost.profile(torch_encoder)
    """)
    project.runpytest("--strict-markers").assert_outcomes(passed=1)
    result = project.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.attncost(n=None, batch=1, **bounds):*"])
    help_text = project.runpytest("--help")
    help_text.stdout.fnmatch_lines(["*--attncost-report*", "*--attncost-unit=UNIT*", "*--attncost-json=PATH*",
                                    "*attncost_report (bool)*"])


def test_disabled_with_p_no(autoloaded):
    project = autoloaded
    project.makepyfile("""
        def test_plain():
            pass
    """)
    result = project.runpytest("-p", "no:attncost", "--strict-markers")
    result.assert_outcomes(passed=1)
    result = project.runpytest("-p", "no:attncost", "--attncost-report")
    assert result.ret == pytest.ExitCode.USAGE_ERROR


REPORT_SUITE = """
import pytest
from tiny_models import bert_like, torch_encoder

@pytest.mark.attncost(n=[128, 512], attention_share_max=0.5)
def test_bert(attncost):
    attncost.profile(bert_like)

def test_encoder(attncost):
    attncost.profile(torch_encoder, 64, name="encoder")

def test_untouched():
    pass
"""


def test_report_table(project):
    project.makepyfile(test_suite=REPORT_SUITE)
    result = project.runpytest("--attncost-report-full")  # the skipped ops listed per model
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines([
        "*= attncost report (counts in MAC) =*",
        "test * model * n * batch * total [[]MAC[]] * attention [[]MAC[]] * FFN [[]MAC[]] * other [[]MAC[]] "
        "* attn share * quad share * deviation * lin. saving * verdict",
        # 2 layers at n=128: attention 2*(4*128*128^2 + 2*128^2*128) = 25,165,824; FFN 2*8*128*128^2 = 33,554,432
        "test_suite.py::test_bert?n=128? * BertModel * 128 * 1 * 59.1M * 25.2M * 33.6M * 426K "
        "* 0.429 * 0.143 * 0 * 7.14% * ok",
        "test_suite.py::test_bert?n=512? * BertModel * 512 * 1 * 337M * 201M * 134M * 1.65M "
        "* 0.600 * 0.400 * 0 * 35.00% * FAIL",
        "test_suite.py::test_encoder * encoder * 64 * 1 * * * * * * * 0 * * -",
        "thresholds (per layer, from the formula):",
        "  BertModel (hidden 128, 2 heads x 64, ffn 512, 2 layers): attention overtakes FFN at n=256 = 2hd; "
        "quadratic term dominates at n=768 = 6hd",
        "ops fvcore skipped*",
        # which elementwise ops BERT runs is transformers' own code (4.x adds add_ and sub): the line's form is ours
        "  BertModel [[]test_suite.py::test_bert[[]n=128[]] n=128, test_suite.py::test_bert[[]n=512[]] n=512[]]: "
        "add x6, *embedding x3, gelu x2, *tanh x1",
    ])
    result.stdout.no_fnmatch_line("*test_untouched*BertModel*")


def test_report_in_flop_and_from_ini(autoloaded):
    project = autoloaded
    project.makeini("[pytest]\nconsole_output_style = classic\nattncost_report = true\nattncost_unit = flop\n")
    project.makepyfile(test_suite=REPORT_SUITE)
    result = project.runpytest()
    result.stdout.fnmatch_lines([
        "*= attncost report (counts in FLOP) =*",
        "*total [[]FLOP[]]*",
        "test_suite.py::test_bert?n=128? * BertModel * 128 * 1 * 118M * 50.3M * 67.1M *",
    ])
    assert "attncost report" not in project.runpytest("-p", "no:attncost", "-q").stdout.str()


def test_bad_unit_is_a_usage_error(project):
    result = project.runpytest("--attncost-unit=bytes")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--attncost-unit: expected one of mac, flop, got 'bytes'*"])
    project.makeini("[pytest]\nattncost_unit = watts\n")
    result = project.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*attncost_unit = 'watts' in the ini file: expected one of mac, flop*"])


def _profiles(path):
    document = json.loads(path.read_text())
    assert document["schema"] == 1 and document["unit"] == "MAC"
    assert {"torch", "fvcore", "pytest-attncost"} <= set(document["versions"])
    return document["profiles"]


def test_json_and_markdown_files(project, monkeypatch):
    summary = project.path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    project.makepyfile(test_suite=REPORT_SUITE)
    result = project.runpytest("--attncost-json=out.json", "--attncost-markdown=out.md", "--attncost-report")
    result.assert_outcomes(passed=3, failed=1)
    rows = _profiles(project.path / "out.json")
    assert [(r["test_id"], r["n"], r["outcome"], r["verdict"]) for r in rows] == [
        ("test_suite.py::test_bert[n=128]", 128, "passed", "ok"),
        ("test_suite.py::test_bert[n=512]", 512, "failed", "FAIL"),
        ("test_suite.py::test_encoder", 64, "passed", "-"),
    ]
    first = rows[0]
    assert (first["attention_core"], first["attention_proj"], first["ffn"]) == (8_388_608, 16_777_216, 33_554_432)
    assert first["deviation"] == 0 and first["spec"]["hidden"] == 128 and first["by_module"][""] == first["total"]
    assert rows[1]["problems"] == [
        "attention_share 0.600 > 0.5 at n=512 (formula 0.600; attention overtakes FFN at n=256 = 2hd)"
    ]
    markdown = (project.path / "out.md").read_text()
    assert "| `test_suite.py::test_bert[n=512]` | BertModel | 512 | 1 | 337M |" in markdown
    assert summary.read_text() == "earlier step\n" + markdown


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--attncost-json=missing/out.json", "--attncost-json=missing/out.json: directory * does not exist*"),
        ("--attncost-markdown=file.txt/out.md", "--attncost-markdown=file.txt/out.md: * is not a directory"),
        ("--attncost-json=.", "--attncost-json=.: is a directory*"),
    ],
)
def test_bad_report_paths_fail_before_tests(project, option, message):
    (project.path / "file.txt").write_text("x")
    project.makepyfile("def test_x():\n    raise AssertionError('must not run')\n")
    result = project.runpytest(option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}"])


def test_junitxml_carries_json_properties(project):
    import xml.etree.ElementTree as ET

    project.makepyfile(test_suite=REPORT_SUITE)
    project.runpytest("--junitxml=junit.xml")
    tree = ET.parse(project.path / "junit.xml")
    props = {case.get("name"): [json.loads(p.get("value")) for p in case.iter("property")
                                if p.get("name") == "attncost"]
             for case in tree.iter("testcase")}
    assert props["test_bert[n=128]"][0]["attention_core"] == 8_388_608
    assert props["test_encoder"][0]["name"] == "encoder"
    assert props["test_untouched"] == []


def test_strict_fails_on_skipped_matmul(project):
    project.makepyfile("""
        import torch
        from torch import nn

        class Bilinear(nn.Module):
            def __init__(self):
                super().__init__()
                self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
                self.mix = nn.Bilinear(16, 16, 16)

            def forward(self, x):
                x = self.attn(x, x, x)[0]
                return self.mix(x, x)

        def test_bilinear(attncost):
            attncost.profile(Bilinear(), inputs=(torch.zeros(1, 8, 16),))
    """)
    project.runpytest().assert_outcomes(passed=1)
    result = project.runpytest("--attncost-strict", "--attncost-report")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*fvcore skipped aten::bilinear x1: these ops multiply matrices, so the count is short (--attncost-strict)*",
        "*kinds of op in 1 profile; MATMUL, not counted: bilinear (--attncost-report-full lists them)",
    ])
    project.runpytest("--attncost-report-full").stdout.fnmatch_lines(["*bilinear x1 (MATMUL, not counted!)*"])


def test_profile_error_fails_the_test_clearly(project):
    project.makepyfile("""
        from tiny_models import HandWritten

        def test_needs_inputs(attncost):
            attncost.profile(HandWritten(), 16)
    """)
    result = project.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ProfileError: cannot guess the inputs of HandWritten; pass inputs= as a tuple*"])


# One xdist session for what xdist must keep: a report, a JSON and a Markdown file as a serial run writes them, a
# baseline's verdicts, a crashed worker's finished tests, and what each process imports (merged from test_plugin's
# test_xdist_matches_serial, test_baseline's test_xdist_gives_the_same_verdicts and test_outcomes'
# test_worker_crash_under_xdist_keeps_finished_tests: each -n 2 session costs its two workers' imports). torch's
# own encoder everywhere (bert_like's shape, so n=512 breaks the bound): the workers need not import transformers.
XDIST_FILES = {
    "test_report": REPORT_SUITE.replace("attncost.profile(bert_like)", "attncost.profile(torch_encoder)"),
    # a baseline saved at two layers, compared at three (BERT_LAYERS): test_bert grows by half
    "test_verdicts": """
import os
import pytest
from tiny_models import torch_encoder

LAYERS = int(os.environ.get("BERT_LAYERS", "2"))

@pytest.mark.attncost(n=128)
def test_bert(attncost):
    attncost.profile(lambda: torch_encoder(layers=LAYERS))

@pytest.mark.attncost(n=64)
def test_encoder(attncost):
    attncost.profile(torch_encoder)
""",
    # what each process of the session imported by its end: written by the controller and by each worker
    "conftest": """
import sys

def pytest_unconfigure(config):
    name = config.workerinput["workerid"] if hasattr(config, "workerinput") else "controller"
    if name != "controller" or config.getoption("dist", "no") != "no":
        loaded = [module for module in ("torch", "transformers", "fvcore") if module in sys.modules]
        (config.rootpath / f"imports-{name}.txt").write_text(" ".join(loaded))
""",
    # a worker that dies (a serial run in this process fails the test instead): the tests around it are kept
    "test_worker": """
import os
import pytest
from tiny_models import torch_encoder

def test_a(attncost):
    attncost.profile(torch_encoder, 16)

def test_b(attncost):
    attncost.profile(torch_encoder, 32)

def test_stop(attncost):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os._exit(3)
    raise AssertionError("stopped")

def test_z_after(attncost):
    attncost.profile(torch_encoder, 64)
""",
}


def test_xdist_writes_what_a_serial_run_writes_and_keeps_a_crashed_workers_finished_tests(project, monkeypatch):
    pytest.importorskip("xdist")
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # this suite's own worker: test_stop must not exit it
    project.makepyfile(**XDIST_FILES)
    project.runpytest("--attncost-save=base.json", "test_verdicts.py").assert_outcomes(passed=2)
    monkeypatch.setenv("BERT_LAYERS", "3")
    options = ["--attncost-compare=base.json", "--attncost-report"]
    serial = project.runpytest(*options, "--attncost-json=serial.json", "--attncost-markdown=serial.md")
    parallel = project.runpytest_subprocess("-p", "xdist", "-n", "2", *options, "--attncost-json=parallel.json",
                                            "--attncost-markdown=parallel.md")
    assert serial.ret == parallel.ret == pytest.ExitCode.TESTS_FAILED
    # test_report: test_bert[n=512] breaks its bound; test_verdicts: test_bert grew; test_worker: test_stop stopped
    serial.assert_outcomes(passed=7, failed=3)
    parallel.assert_outcomes(passed=7, failed=3)
    assert _profiles(project.path / "serial.json") == _profiles(project.path / "parallel.json")
    assert (project.path / "serial.md").read_text() == (project.path / "parallel.md").read_text()

    def table(result):
        lines = result.stdout.lines
        start = next(i for i, line in enumerate(lines) if "attncost report" in line)
        return [line for line in lines[start + 1:] if line.startswith("test_")]

    assert table(serial) == table(parallel) and len(table(serial)) == 8
    parallel.stdout.fnmatch_lines(["*attention_core 8,388,608 → 12,582,912 MAC (+50.0%)*"])
    # written once, from the controller (workers write nothing), in test-id order, whole
    rows = [(r["test_id"].split("::")[1], r["n"]) for r in _profiles(project.path / "parallel.json")
            if r["test_id"].startswith("test_worker.py")]
    assert rows == [("test_a", 16), ("test_b", 32), ("test_z_after", 64)]
    assert not [p for p in project.path.iterdir() if p.name.endswith(".tmp")]
    # xdist's own words, in either order its versions use
    assert any("crashed" in line and "test_stop" in line for line in parallel.stdout.lines), parallel.stdout.str()
    # workers that start warm: the controller, which writes every report, imports no torch; the workers import
    # torch for their profiles and never transformers, which no test here uses
    imports = {path.stem.removeprefix("imports-"): path.read_text().split()
               for path in project.path.glob("imports-*.txt")}
    assert imports.pop("controller") == []
    assert len(imports) >= 2 and all("torch" in loaded and "transformers" not in loaded for loaded in imports.values())


def test_a_fresh_interpreter_under_W_error_and_another_hash_seed(project, monkeypatch):
    """One subprocess session, two things only a fresh interpreter shows (merged from test_plugin's
    test_warnings_as_errors and test_counting_modes' hash-seed child, each of which started one):

    * the plugin's own imports and traces raise nothing under -W error (--attncost-crosscheck: both counters,
      fvcore's trace and torch's fake tensors), while the user's warnings still do;
    * train-mode records, scopes, origins and masks, and profile()'s split of them, do not depend on the hash
      seed, which is fixed at start-up (an order that follows the seed differs between almost any two)."""
    import test_counting_modes

    project.makepyfile(f"""
        import json
        import sys
        import warnings
        import pytest
        from tiny_models import bert_like

        @pytest.mark.attncost(n=64, attention_share_max=0.9)
        def test_clean(attncost):
            attncost.profile(bert_like)

        def test_user_warning(attncost):
            warnings.warn("from the user's code", UserWarning)

        def test_train_counts():
            sys.path.insert(0, {str(Path(test_counting_modes.__file__).parent)!r})
            import test_counting_modes
            with open("train_counts.json", "w") as out:
                json.dump(test_counting_modes.train_counts(), out, sort_keys=True)
    """)
    ours = os.environ.get("PYTHONHASHSEED")
    monkeypatch.setenv("PYTHONHASHSEED", next(seed for seed in ("0", "1") if seed != ours))
    result = project.runpytest_subprocess("-W", "error", "--attncost-crosscheck")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*UserWarning: from the user's code*"])
    theirs = json.loads((project.path / "train_counts.json").read_text())
    assert theirs == test_counting_modes.train_counts()  # records, scopes, origins, masks: all of it


# --- options and ini: the same option twice, bad ini values, an option missing its partner --------


def test_same_option_twice_last_wins(project):
    project.makepyfile(test_suite="""
        from tiny_models import torch_encoder
        def test_x(attncost):
            attncost.profile(torch_encoder, 16)
    """)
    result = project.runpytest("--attncost-report", "--attncost-unit=mac", "--attncost-unit=flop")
    result.stdout.fnmatch_lines(["*attncost report (counts in FLOP)*"])
    result = project.runpytest("--attncost-json=a.json", "--attncost-json=b.json")
    assert (project.path / "b.json").exists() and not (project.path / "a.json").exists()


def test_bad_ini_values_are_usage_errors(project):
    project.makeini("[pytest]\nattncost_max_increase = two\n")
    result = project.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*attncost_max_increase = 'two' in the ini file: "
                                 "expected a percentage >= 0 such as 2.5, or per part such as ffn:5%,total:0%*"])


def test_prune_without_save_is_a_usage_error(project):
    result = project.runpytest("--attncost-save-prune")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--attncost-save-prune needs --attncost-save=PATH*"])
