"""--attncost-disable (and its ini twin) makes the markers no-ops, as --benchmark-disable does; every output
option has an ini twin."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.shared_profiles  # its runs are about switching the plugin off (conftest.project)

BROKEN = """
import pytest
from tiny_models import bert_like

@pytest.mark.attncost(n=[16, 32], attention_share_max=0.01, total_max=1)
def test_bert(attncost):
    attncost.profile(bert_like)
    assert attncost.n in (16, 32)  # the marker's lengths still parametrize the test
"""


def test_disable_turns_the_markers_into_no_ops_and_says_so(project: pytest.Pytester) -> None:
    project.makepyfile(test_suite=BROKEN)
    project.runpytest().assert_outcomes(failed=2)  # the bounds break
    for args, ini in ((["--attncost-disable"], ""), ([], "attncost_disable = true\n")):
        if ini:
            project.makeini("[pytest]\naddopts = -p no:hypothesispytest -p no:anyio\n" + ini)
        result = project.runpytest("--attncost-report", "--attncost-json=r.json", *args)
        result.assert_outcomes(passed=2)
        result.stdout.fnmatch_lines(["attncost: disabled (--attncost-disable): the @pytest.mark.attncost checks "
                                     "were not run, and no report or file was written"])
        assert not (project.path / "r.json").exists()
        result.stdout.no_fnmatch_line("*attncost report*")


def test_disable_with_a_baseline_is_a_usage_error(project: pytest.Pytester) -> None:
    project.makepyfile(test_suite=BROKEN)
    result = project.runpytest("--attncost-disable", "--attncost-save=b.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--attncost-disable turns the attncost checks off, so --attncost-save and "
                                 "--attncost-compare have nothing to work on*"])


def test_every_output_option_has_an_ini_twin(project: pytest.Pytester) -> None:
    project.makepyfile(test_suite="""
        import pytest
        from tiny_models import bert_like

        @pytest.mark.attncost(n=16)
        def test_bert(attncost):
            attncost.profile(bert_like)
    """)
    (project.path / "out").mkdir()
    project.makeini("[pytest]\naddopts = -p no:hypothesispytest -p no:anyio\n"
                    "attncost_report_full = true\nattncost_json = out/r.json\nattncost_markdown = out/r.md\n"
                    "attncost_export =\n    bencher:out/bmf.json\n    github-action-benchmark:out/gab.json\n")
    result = project.runpytest()
    result.assert_outcomes(passed=1)
    assert any("quad share" in line for line in result.stdout.lines)  # the full report, every column
    assert json.loads((project.path / "out" / "r.json").read_text())["profiles"][0]["n"] == 16
    assert (project.path / "out" / "r.md").read_text().startswith("## attncost report")
    assert json.loads((project.path / "out" / "bmf.json").read_text())
    assert json.loads((project.path / "out" / "gab.json").read_text())[0]["unit"] == "MAC"
