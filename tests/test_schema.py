"""The published format: docs/schema/attncost.schema.json describes what --attncost-json, --attncost-save and
``profile --json`` write, and their output validates against it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.shared_profiles  # its runs are about the JSON's schema (conftest.project)

jsonschema = pytest.importorskip("jsonschema", reason="the schema test needs jsonschema (the test extra has it)")

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "docs" / "schema" / "attncost.schema.json").read_text(encoding="utf-8"))
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def errors(document: object) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(document)]


def test_the_schema_is_a_valid_draft_2020_12_schema_and_rejects_what_it_should() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    committed = json.loads((ROOT / "examples" / "attncost-baseline.json").read_text(encoding="utf-8"))
    assert errors(committed) == []
    entry = committed["profiles"][0]
    assert errors({**committed, "schema": 2}) and errors({**committed, "unit": "FLOP"})
    assert errors({**committed, "profiles": [{**entry, "total": -1}]})
    assert errors({**committed, "profiles": [{**entry, "verdict": "passed"}]})
    assert errors({**committed, "profiles": [{k: v for k, v in entry.items() if k != "ffn"}]})


def test_the_plugins_report_and_baseline_validate(project: pytest.Pytester) -> None:
    project.makepyfile(test_suite="""
        import pytest
        from tiny_models import bert_like, llama_like

        @pytest.mark.attncost(attention_share_max=0.99, crosscheck=True)
        def test_sweep(attncost):
            attncost.sweep(bert_like, [16, 32])

        @pytest.mark.attncost(n=32, mode="decode", formula_rtol=0)
        def test_step(attncost):
            attncost.profile(llama_like)

        @pytest.mark.attncost(n=16, total_max=1)
        def test_fails(attncost):
            attncost.profile(llama_like, causal="half")
    """)
    result = project.runpytest("--attncost-json=r.json", "--attncost-save=b.json")
    result.assert_outcomes(passed=2, failed=1)
    report = json.loads((project.path / "r.json").read_text())
    assert {p["mode"] for p in report["profiles"]} == {"forward", "decode"} and report["sweeps"]
    assert {"ok", "FAIL"} <= {p["verdict"] for p in report["profiles"]}
    assert errors(report) == []
    assert errors(json.loads((project.path / "b.json").read_text())) == []


def test_the_docs_link_the_schema() -> None:
    assert "schema/attncost.schema.json" in (ROOT / "docs" / "reports.md").read_text(encoding="utf-8")
