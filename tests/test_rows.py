"""One typed row from the checks to every output: its JSON form, its identity, shared sections."""

from __future__ import annotations

import json

from pytest_attncost import ModelSpec
from pytest_attncost.baseline import entry_key
from pytest_attncost.reporting import Row, SweepRow, render_json, render_markdown, render_terminal, row_key, sections
from pytest_attncost.result import Profile

SPEC = ModelSpec(hidden=128, heads=2, head_dim=64, layers=2, ffn_dim=512)


def _profile(**changes) -> Profile:
    # BERT-like, 2 layers, hidden 128, n = 128: core 2·n²·D·L, proj 4·n·D²·L, ffn 2·n·D·f·L (by hand)
    values = dict(name="BertModel", n=128, batch=1, attention_core=2 * 128 * 128 * 128 * 2,
                  attention_proj=4 * 128 * 128 * 128 * 2, ffn=2 * 128 * 128 * 512 * 2, other=425_984, layers=2,
                  spec=SPEC, unsupported_ops={"aten::add": 6}, versions={"torch": "x"})
    values.update(changes)
    return Profile(**values)


def _rows() -> list[Row]:
    cross = {"agree": False, "backends": ["fvcore", "torch"],
             "fvcore": {"attention_core": 1, "attention_proj": 2, "ffn": 3, "other": 4},
             "torch": {"attention_core": 1, "attention_proj": 2, "ffn": 5, "other": 4}}
    timing = {"attention_mac_share": 0.4, "attention_time_share": 0.5, "seconds": {"forward": 0.01},
              "repeats": 5, "device": "cpu", "spread": {"attention_time_share": 0.01}}
    return [
        Row("t.py::test_b", _profile(n=256, warnings=("layer.0: something the formula does not describe",)),
            problems=("attention_share 0.6 > 0.5 at n=256",), verdict="FAIL", outcome="failed", vs_baseline="+1.00%",
            crosscheck=cross),
        Row("t.py::test_a", _profile(backend="torch", fallback="fvcore could not trace"), verdict="ok",
            outcome="passed", vs_baseline="=", timing=timing),
        Row("t.py::test_c", _profile(mode="decode", new_tokens=1, kv_cache_bytes=2**20), outcome="passed"),
    ]


def test_json_round_trip_gives_the_same_row():
    for row in _rows():
        data = json.loads(json.dumps(row.to_dict()))
        again = Row.from_dict(data)
        assert again == row and again.to_dict() == row.to_dict()
        assert again.crosscheck == row.crosscheck and again.timing == row.timing


def test_absent_fields_stay_out_of_the_json():
    data = Row("t.py::test_x", _profile()).to_dict()
    assert "vs_baseline" not in data and "crosscheck" not in data and "timing" not in data and "outcome" not in data
    assert data["verdict"] == "-" and data["problems"] == [] and data["test_id"] == "t.py::test_x"


def test_one_identity_for_rows_baselines_and_order():
    rows = _rows()
    for row in rows:
        assert entry_key(row.to_dict()) == row.key
    assert rows[1].key == row_key("t.py::test_a", {"name": "BertModel", "n": 128, "batch": 1, "mode": "forward",
                                                   "causal": "full", "backend": "torch"})
    document = json.loads(render_json(rows))
    assert [p["test_id"] for p in document["profiles"]] == ["t.py::test_a", "t.py::test_b", "t.py::test_c"]


def test_terminal_and_markdown_show_the_same_sections():
    rows = sorted(_rows(), key=lambda r: r.key)
    found = sections(rows)
    titles = [s.title for s in found]
    assert len(titles) == 8  # thresholds, skipped ops, KV cache, time, warnings, fallback, cross-check, checks
    terminal = "\n".join(render_terminal(rows, full=True))
    markdown = render_markdown(rows)
    for section in found:
        assert section.title + ":" in terminal
        assert f"**{section.title[0].upper()}{section.title[1:]}:**" in markdown
        for line in section.lines:
            shown = line
            # ids in code spans, as in the table
            for test_id in sorted({r.test_id for r in rows}, key=len, reverse=True):
                shown = shown.replace(test_id, f"`{test_id}`")
            assert line in terminal and f"- {shown}" in markdown
    assert "DISAGREE" in markdown  # the cross-check once missing from Markdown
    assert "- `t.py::test_b` [BertModel]: attention_share 0.6 > 0.5 at n=256" in markdown


def test_a_sweep_row_round_trips_and_solves_its_thresholds_again():
    from pytest_attncost.series import Sweep

    # by hand for this shape (D = 128, f = 512, 2 layers): attention = FFN at n = 2·D = 256, quadratic
    # term = linear terms at n = 6·D = 768
    sweep = Sweep([_profile(n=n, attention_core=2 * n * n * 128 * 2, attention_proj=4 * n * 128 * 128 * 2,
                            ffn=2 * n * 128 * 512 * 2) for n in (64, 256, 1024)])
    row = SweepRow("t.py::test_sweep", sweep, problems=("crossover n=256 < crossover_min 300",), plots=("a.png",))
    data = json.loads(json.dumps(row.to_dict()))
    assert data["crossover_n"] == 256 and data["quadratic_crossover_n"] == 768 and data["plots"] == ["a.png"]
    again = SweepRow.from_dict(data)
    assert again.sweep.crossover() == 256 and again.sweep.lengths == [64, 256, 1024]
    assert again.problems == row.problems and again.plots == row.plots and again.key == row.key
    document = json.loads(render_json([], sweeps=[row]))
    assert "profiles" not in document["sweeps"][0] and document["sweeps"][0]["test_id"] == "t.py::test_sweep"
