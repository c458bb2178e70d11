"""Sweeps, exact crossovers, the crossover bounds, and plots."""

import json
import sys
from fractions import Fraction

import pytest
import tiny_models as tm

from pytest_attncost import ModelSpec, api, profile
from pytest_attncost.series import Sweep, SweepError

pytestmark = pytest.mark.shared_profiles  # its runs are about bounds and plots (conftest.project)


def test_bert_shapes_crossovers_are_exact_integers():
    from transformers import BertConfig, BertModel

    base = api.sweep(lambda: BertModel(BertConfig()), [512, 2048, 8192])
    assert base.crossover() == Fraction(1536) and base.quadratic_crossover() == Fraction(4608)
    large_config = BertConfig(hidden_size=1024, num_attention_heads=16, num_hidden_layers=24, intermediate_size=4096)
    large = api.sweep(lambda: BertModel(large_config), [128, 4096])
    assert large.crossover() == Fraction(2048) and large.quadratic_crossover() == Fraction(6144)
    assert large.formula_crossover() == 2048 and large.formula_quadratic_crossover() == 6144
    assert large.lengths == [128, 4096] and len(large) == 2 and large[0].n == 128


def test_gqa_and_gated_crossover_not_on_the_grid():
    # Mistral-like: D=128, h=2, g=1, d=64, gated f=512. P = 2*128*128 + 2*128*64 = 49,152 per token,
    # F = 3*128*512 = 196,608; crossover (F - P) / (2*128) = 576, quadratic (F + P) / 256 = 960.
    result = api.sweep(lambda: tm.llama_like(kv_heads=1), [100, 333])
    assert result.crossover() == Fraction(576) and result.quadratic_crossover() == Fraction(960)


def test_linear_attention_has_no_quadratic_term():
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "examples"))
    from models import ROLES, TinyLM

    lin = api.sweep(lambda: TinyLM(width=128, heads=2, layers=2, linear=True), [64, 256],
                    inputs=lambda n, b: (__import__("torch").zeros(b, n, 128),), roles=ROLES)
    coefficients = lin.coefficients()
    assert coefficients.beta == 0 and lin.crossover() is None and lin.quadratic_crossover() is None


def test_sweep_errors():
    with pytest.raises(SweepError, match="at least two lengths"):
        api.sweep(tm.torch_encoder(), [64]).crossover()
    with pytest.raises(api.ProfileError, match="distinct lengths"):
        api.sweep(tm.torch_encoder(), [64, 64])
    with pytest.raises(api.ProfileError, match="ns must be a list of lengths"):
        api.sweep(tm.torch_encoder(), 64)
    a = profile(tm.torch_encoder(), 32)
    b = profile(tm.torch_encoder(), 64)
    doctored = __import__("dataclasses").replace(b, ffn=b.ffn + 1)
    c = profile(tm.torch_encoder(), 128)
    with pytest.raises(SweepError, match="ffn is not of the form"):
        Sweep([a, doctored, c]).crossover()


def test_sweep_of_a_factory_builds_it_once():
    built = []

    def factory():
        built.append(1)
        return tm.torch_encoder()

    api.sweep(factory, [8, 16, 32])
    assert built == [1]


SWEEP_SUITE = """
import pytest
from transformers import BertConfig, BertModel

def bert_base():
    return BertModel(BertConfig())

@pytest.mark.attncost(crossover_min={low}, crossover_max={high}, crossover_rtol=0)
def test_sweep(attncost):
    sweep = attncost.sweep(bert_base, [512, 8192])
    assert sweep.crossover() == 1536
"""


@pytest.mark.parametrize(("low", "high", "outcome"), [(1536, 1536, "passed"), (1537, 4000, "failed"),
                                                      (100, 1535, "failed")])
def test_crossover_bounds(project, low, high, outcome):
    project.makepyfile(SWEEP_SUITE.format(low=low, high=high))
    result = project.runpytest("--attncost-report", "--attncost-json=r.json")
    result.assert_outcomes(**{outcome: 1})
    # every row the sweep bound judged says what the test's outcome says, in the table and the JSON
    verdict = "ok" if outcome == "passed" else "FAIL"
    row_start = ["test_crossover_bounds.py::test_sweep", "BertModel"]
    rows = [line.split() for line in result.stdout.lines if line.split()[:2] == row_start]
    assert len(rows) == 2 and [row[-1] for row in rows] == [verdict, verdict]
    document = json.loads((project.path / "r.json").read_text())
    assert [entry["verdict"] for entry in document["profiles"]] == [verdict, verdict]
    result.stdout.fnmatch_lines([
        "*test_sweep [[]BertModel n=[[]512, 8192[]][]]: attention = FFN at n=1,536 (formula 1,536); "
        "quadratic term = linear terms at n=4,608 (formula 4,608)",
    ])
    if low > 1536:
        result.stdout.fnmatch_lines(["*crossover n=1,536 < crossover_min 1,537 "
                                     "(sweep of BertModel over n=[[]512, 8192[]]; formula 1,536)*"])
    if high < 1536:
        result.stdout.fnmatch_lines(["*crossover n=1,536 > crossover_max 1,535*"])


def test_crossover_bound_needs_a_sweep(project):
    project.makepyfile("""
        import pytest
        from tiny_models import torch_encoder

        @pytest.mark.attncost(n=32, crossover_max=1000)
        def test_no_sweep(attncost):
            attncost.profile(torch_encoder)
    """)
    result = project.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*crossover bounds need a sweep: call attncost.sweep(model, [[]n1, n2, ...[]])*"])


def test_plots_are_written_and_linked(project):
    project.makepyfile("""
        import pytest
        from tiny_models import bert_like

        def test_sweep(attncost):
            attncost.sweep(bert_like, [64, 256, 1024])
    """)
    (project.path / "out").mkdir()
    result = project.runpytest("--attncost-plot=out/plots", "--attncost-markdown=out/report.md",
                               "--attncost-json=out/report.json", "--attncost-report")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["sweeps (thresholds solved exactly from the measured counts):",
                                 "  test_plots_are_written_and_linked.py::test_sweep "
                                 "[[]BertModel n=[[]64, 256, 1024[]][]]: "
                                 "attention = FFN at n=256 (formula 256); quadratic term = linear terms at n=768 "
                                 "(formula 768)",
                                 "  plots: 2 PNG (and SVG) in */out/plots"])
    plots = project.path / "out" / "plots"
    stem = "test_plots_are_written_and_linked.py_test_sweep-BertModel"
    names = sorted(p.name for p in plots.iterdir())
    assert names == sorted(f"{stem}-{kind}.{fmt}" for kind in ("shares", "parts") for fmt in ("png", "svg"))
    for png in plots.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    shares = (plots / f"{stem}-shares.svg").read_text()
    assert shares.lstrip().startswith("<?xml") and "<svg" in shares
    for label in ("attention share", "quadratic share", "attention = FFN (formula): n=256",
                  "quadratic = linear terms (formula): n=768", "measured crossover: n=256"):
        assert label in shares, label
    parts = (plots / f"{stem}-parts.svg").read_text()
    for label in ("attention_core", "attention_proj", "ffn", "other"):
        assert label in parts
    markdown = (project.path / "out" / "report.md").read_text()
    assert f"![{stem}-shares](plots/{stem}-shares.png)" in markdown
    document = json.loads((project.path / "out" / "report.json").read_text())
    assert document["sweeps"][0]["crossover_n"] == 256 and document["sweeps"][0]["quadratic_crossover_n"] == 768


def test_plot_without_matplotlib_is_a_usage_error(project, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = project.runpytest("--attncost-plot=plots")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*plots need matplotlib: pip install 'pytest-attncost[[]plot[]]'*"])


def test_sweep_spec_is_the_profiles():
    result = api.sweep(tm.torch_encoder(), [16, 32])
    assert result.spec == ModelSpec(hidden=128, heads=2, head_dim=64, layers=2, ffn_dim=512)
    assert json.loads(json.dumps(result.to_dict()))["crossover_n"] == 256


def test_count_axes_use_the_report_units_not_an_offset():
    from matplotlib.figure import Figure

    from pytest_attncost.plots import count_ticks

    figure = Figure()
    ax = figure.add_subplot()
    ax.plot([1, 2, 3], [100_000_000, 250_000_000, 400_000_000])
    count_ticks(ax)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure).draw()
    labels = [tick.get_text() for tick in ax.get_yticklabels() if tick.get_text()]
    assert labels and all(label.endswith("M") for label in labels), labels
    assert "100M" in labels and "400M" in labels
    assert ax.yaxis.get_offset_text().get_text() == ""  # no "1e8" above the axis
