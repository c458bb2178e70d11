"""The default report fits the terminal; --attncost-report-full keeps everything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_attncost.reporting import Row, render_terminal

pytestmark = pytest.mark.shared_profiles  # its runs are about the report's columns (conftest.project)

EXAMPLES = Path(__file__).parent.parent / "examples" / "attncost-baseline.json"


def example_rows() -> list[Row]:
    """Every profile of the examples suite, as its committed baseline holds them."""
    rows = json.loads(EXAMPLES.read_text())["profiles"]
    assert len(rows) >= 30
    return [Row.from_dict({**row, "verdict": "ok", "vs_baseline": "="}) for row in rows]


@pytest.mark.parametrize("width", [80, 100, 120, 200])
def test_the_examples_report_fits(width: int) -> None:
    lines = render_terminal(example_rows(), width=width)
    too_wide = [line for line in lines if len(line) > width]
    assert too_wide == []
    header = lines[0].split()
    # the essentials stay whatever the width
    assert header[:3] == ["test", "model", "n"] and header[-1] == "verdict"
    assert "total" in header  # a count stays whatever the width: the counts are the last thing dropped
    assert ("verdict: ok (its bounds held), FAIL (one broke), - (nothing bounded it)"
            in " ".join(" ".join(lines).split()))
    without_baseline = render_terminal([row.replace(vs_baseline=None) for row in example_rows()], width=width)
    assert "total" in without_baseline[0] and "share" in without_baseline[0]
    if width >= 200:
        assert "deviation" in header and "total" in header and "FFN" in header  # room for the counts


def test_full_keeps_every_column_and_id() -> None:
    rows = example_rows()
    lines = render_terminal(rows, full=True)
    assert "quad share" in lines[0] and "lin. saving" in lines[0] and "other [MAC]" in lines[0]
    assert all(row.test_id in "\n".join(lines) for row in rows)


def test_pytest_terminal_width_is_used(project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    project.makepyfile(**{"test_a_module_with_a_rather_long_name_for_its_tests": """
        import pytest
        from tiny_models import bert_like, torch_encoder

        @pytest.mark.attncost(n=[16, 32], attention_share_max=0.9)
        def test_bert_like_models_stay_below_the_bound_at_every_length(attncost):
            attncost.profile(bert_like, name="a bert-like model with a long descriptive name")

        @pytest.mark.attncost(n=16)
        def test_encoder(attncost):
            attncost.profile(torch_encoder)
    """})
    for columns in (80, 120):
        monkeypatch.setenv("COLUMNS", str(columns))
        result = project.runpytest("--attncost-report")
        result.assert_outcomes(passed=3)
        report = result.stdout.lines[result.stdout.lines.index(next(
            line for line in result.stdout.lines if "attncost report" in line)):]
        assert max(len(line) for line in report) <= columns
    full = project.runpytest("--attncost-report-full")
    assert any("test_a_module_with_a_rather_long_name_for_its_tests.py::test_encoder" in line
               and "quad share" not in line for line in full.stdout.lines)
    assert any("quad share" in line for line in full.stdout.lines)


def test_module_table_of_bert_base_at_depth_2() -> None:
    from transformers import BertConfig, BertModel

    from pytest_attncost import profile
    from pytest_attncost.result import module_rows

    n, hd = 512, 768
    p = profile(lambda: BertModel(BertConfig()), n)
    rows = module_rows(p, depth=2)
    layers = [r for r in rows if r["class"] == "BertLayer"]
    assert [r["label"].strip() for r in layers] == [f"layer.{i}" for i in range(12)]
    # one layer by hand: 12 n (hd)^2 + 2 n^2 hd, plus fvcore's 5 MACs per element of its two LayerNorms
    assert {(r["role"], r["macs"], r["self"]) for r in layers} == {
        ("layer", 12 * n * hd**2 + 2 * n**2 * hd + 2 * 5 * n * hd, 12 * n * hd**2 + 2 * n**2 * hd + 2 * 5 * n * hd)}
    assert sum(r["self"] for r in rows) == p.total  # every MAC shows exactly once
    text = p.table(depth=2)
    assert all(f"layer.{i}" in text for i in range(12)) and text.splitlines()[0].split() == [
        "module", "class", "role", "params", "MACs", "self"]
    assert [r["label"] for r in module_rows(p, depth=0)] == ["(model)"]
    assert len(repr(p)) < 160 and repr(p).startswith("Profile('BertModel', n=512, batch=1, core=")


def test_decode_rows_say_so_and_show_their_kv_cache(project: pytest.Pytester,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    project.makepyfile("""
        import pytest
        from tiny_models import llama_like

        @pytest.mark.attncost(n=64, mode="decode", new_tokens=2)
        def test_step(attncost):
            attncost.profile(llama_like)
    """)
    result = project.runpytest("--attncost-report", "--attncost-markdown=r.md")
    result.assert_outcomes(passed=1)
    # 2 (K, V) x 2 layers x 2 kv heads x 64 head size x 64 cached tokens x 4 bytes (float32)
    kv = 2 * 2 * 2 * 64 * 64 * 4
    result.stdout.fnmatch_lines(["*LlamaModel (decode +2)*", "KV cache of the decode steps*",
                                 f"*test_step ?LlamaModel n=64?: 128 KiB ({kv:,} bytes) for 64 cached*"])
    assert f"({kv:,} bytes)" in (project.path / "r.md").read_text()


def test_narrow_reports_cut_names_but_keep_parameter_ids_and_words() -> None:
    from pytest_attncost.reporting import _cut_id, _cut_name

    ids = [f"test_bert_base_stays_below_the_bound_ffn_at_2hd[n={n}]" for n in (128, 512, 2048)]
    cut = [_cut_id(i, 24) for i in ids]
    assert [c.rpartition("[")[2] for c in cut] == ["n=128]", "n=512]", "n=2048]"] and all(len(c) <= 24 for c in cut)
    assert _cut_name("GPTNeoXForCausalLM", 12) == "GPTNeoXFor…" and _cut_name("BertModel", 12) == "BertModel"
    assert _cut_name("a bert-like model with a long descriptive name", 20) == "a bert-like model…"
    # in the report at 80 columns: rows of one parametrized test stay apart
    rows = [Row.from_dict({**row, "test_id": f"tests/test_models.py::{test_id}", "name": "GPTNeoXForCausalLM"})
            for row, test_id in zip(json.loads(EXAMPLES.read_text())["profiles"], ids)]
    body = render_terminal(rows, width=80)[2:5]
    assert len({line.split()[0] for line in body}) == 3 and all("]" in line.split()[0] for line in body)


def test_thresholds_of_a_decode_step_say_so() -> None:
    from tiny_models import gpt2_like

    from pytest_attncost import profile
    from pytest_attncost.reporting import threshold_lines

    lines = threshold_lines([Row("t::a", profile(gpt2_like, 16)), Row("t::b", profile(gpt2_like, 16, mode="decode"))])
    assert len(lines) == 2 and "decode step" not in lines[0] and "a decode step (n: the context" in lines[1]


def test_ids_are_cut_at_the_end_and_keep_their_parameter() -> None:
    from pytest_attncost.reporting import _cut_id

    assert _cut_id("test_article_table[1536-7247757312-7247757312]", 24) == "test…[1536-7247757312-…]"
    assert _cut_id("test_bert_base_long_inputs[n=512]", 20) == "test_bert_ba…[n=512]"
    assert _cut_id("test_gpt2_at_its_context_length", 16) == "test_gpt2_at_it…"


def test_the_skipped_ops_are_one_line_unless_the_full_report_is_asked_for() -> None:
    rows = example_rows()
    kinds = {op for row in rows for op in row.profile.unsupported_ops}
    short = render_terminal(rows, width=200)
    start = short.index("ops fvcore skipped (not in the counts; elementwise ops are expected here):")
    profiles = sum(1 for r in rows if r.profile.unsupported_ops)
    assert short[start + 1:start + 3] == [
        f"  {len(kinds)} kinds of op in {profiles} profiles; none multiplies matrices "
        "(--attncost-report-full lists them)", ""]
    full = render_terminal(rows, full=True)
    start = full.index("ops fvcore skipped (not in the counts; elementwise ops are expected here):")
    assert full.index("", start) - start > 5  # a line per model and set of ops
