"""--attncost-export (issue 27, part 6): the counts as the dashboards people run read them, checked against each
format's documented shape.

github-action-benchmark's ``customSmallerIsBetter`` reads a JSON list of ``BenchmarkResult`` objects: ``name``
(string), ``value`` (number), ``unit`` (string), optional ``range`` and ``extra`` (strings). Bencher's metric
format (BMF) is an object of benchmark names (at most 1024 characters), each an object of measures (slugs of at
most 64 characters), each ``{"value": number}`` with optional ``lower_value`` and ``upper_value`` numbers
(https://bencher.dev/bmf.json).
"""

from __future__ import annotations

import json
import numbers

from tiny_models import FFN, HEAD_DIM, HEADS, HIDDEN, LAYERS

N = 32
CORE = LAYERS * 2 * HEADS * N * N * HEAD_DIM  # QKᵀ and AV: 2 layers x 2 heads x 2 x 32² x 64
PROJ = LAYERS * 4 * N * HIDDEN * HEADS * HEAD_DIM
FFN_MACS = LAYERS * 2 * N * HIDDEN * FFN

SUITE = f"""
    import pytest
    from tiny_models import bert_like

    @pytest.mark.attncost(n={N})
    def test_bert(attncost):
        attncost.profile(bert_like())
"""


def _github_action_benchmark(document: object) -> list[dict]:
    assert isinstance(document, list) and document
    for entry in document:
        assert set(entry) <= {"name", "value", "unit", "range", "extra"}
        assert isinstance(entry["name"], str) and isinstance(entry["unit"], str)
        assert isinstance(entry["value"], numbers.Real) and not isinstance(entry["value"], bool)
        assert all(isinstance(entry[key], str) for key in ("range", "extra") if key in entry)
    assert len({entry["name"] for entry in document}) == len(document)  # one series per name
    return document


def _bencher(document: object) -> dict:
    assert isinstance(document, dict) and document
    for benchmark, measures in document.items():
        assert isinstance(benchmark, str) and 0 < len(benchmark) <= 1024
        assert isinstance(measures, dict) and measures
        for measure, metric in measures.items():
            assert isinstance(measure, str) and 0 < len(measure) <= 64
            assert set(metric) <= {"value", "lower_value", "upper_value"} and "value" in metric
            assert all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in metric.values())
    return document


def test_both_formats_are_written_in_their_documented_shapes(project):
    project.makepyfile(test_suite=SUITE)
    result = project.runpytest("--attncost-export=github-action-benchmark:gab.json",
                               "--attncost-export=bencher:bmf.json", "--attncost-report")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["attncost github-action-benchmark written to */gab.json",
                                 "attncost bencher written to */bmf.json"])
    gab = _github_action_benchmark(json.loads((project.path / "gab.json").read_text()))
    name = "test_suite.py::test_bert BertModel n=32 batch=1"
    values = {entry["name"]: entry["value"] for entry in gab}
    assert values[f"{name} attention_core-macs"] == CORE
    assert values[f"{name} attention_proj-macs"] == PROJ
    assert values[f"{name} ffn-macs"] == FFN_MACS
    assert values[f"{name} attention-share"] == (CORE + PROJ) / (CORE + PROJ + FFN_MACS)
    assert {entry["unit"] for entry in gab} == {"MAC", "share"}
    bmf = _bencher(json.loads((project.path / "bmf.json").read_text()))
    assert list(bmf) == [name]
    assert bmf[name]["attention_core-macs"] == {"value": CORE}
    assert bmf[name]["total-macs"]["value"] == values[f"{name} total-macs"]


def test_a_decode_step_exports_its_kv_cache_bytes(project):
    project.makepyfile(test_decode_export="""
        import pytest
        from tiny_models import llama_like

        @pytest.mark.attncost(n=64, mode="decode")
        def test_step(attncost):
            attncost.profile(llama_like())
    """)
    project.runpytest("--attncost-export=bencher:bmf.json").assert_outcomes(passed=1)
    [measures] = _bencher(json.loads((project.path / "bmf.json").read_text())).values()
    # 2 layers x (K and V) x 2 K/V heads x 64 cached tokens x 64 x 4 bytes (float32)
    assert measures["kv-cache-bytes"] == {"value": LAYERS * 2 * HEADS * 64 * HEAD_DIM * 4}


def test_a_wrong_export_is_a_usage_error(project):
    project.makepyfile(test_suite=SUITE)
    result = project.runpytest("--attncost-export=prometheus:out.txt")
    assert result.ret == 4
    result.stderr.fnmatch_lines(["*--attncost-export=prometheus:out.txt: expected FORMAT:PATH with FORMAT one of "
                                 "github-action-benchmark, bencher*"])
    clash = project.runpytest("--attncost-export=bencher:out.json", "--attncost-json=out.json")
    clash.stderr.fnmatch_lines(["*--attncost-json=*/out.json and --attncost-export=bencher:*/out.json "
                                "name the same file*"])
