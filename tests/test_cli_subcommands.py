"""python -m pytest_attncost compare / profile: two reports part by part, and a model of your own."""

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_attncost import baseline, cli, one_run, reporting

TINY = Path(__file__).parent / "tiny_models.py"


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "pytest_attncost", *args], capture_output=True, text=True, cwd=cwd)


def row(test_id="t.py::test_a", name="BertModel", n=512, batch=1, core=100, proj=200, ffn=400, other=10, **extra):
    return {"test_id": test_id, "name": name, "n": n, "batch": batch, "total": core + proj + ffn + other,
            "attention_core": core, "attention_proj": proj, "ffn": ffn, "other": other, **extra}


def write(path, *rows):
    path.write_text(reporting.render_documents(list(rows)))
    return str(path)


# --- the top level: formulas by default, subcommands listed -----------------------------------------


def test_help_lists_the_subcommands_and_cites_the_article():
    result = run("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "{compare,profile}" in text and "compare" in text and "profile" in text
    assert 'Su Jianlin, "Linear attention is probably not the model you are waiting for"' in text
    assert "(PaperWeekly / kexue.fm, 2021)" in text
    for command in ("compare", "profile"):
        sub = run(command, "--help")
        assert sub.returncode == 0 and f"python -m pytest_attncost {command}" in sub.stdout


def test_a_subcommand_after_formula_options_says_where_it_goes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--preset", "bert-base", "compare", "a.json", "b.json"])
    assert exit_info.value.code == 2
    assert "compare goes first: python -m pytest_attncost compare" in capsys.readouterr().err


def test_one_table_formatter():
    # the report, the formula, decode, compare and profile tables and check_formula's all come from units.table
    from pytest_attncost import result, units

    for source in (inspect.getsource(cli), inspect.getsource(result.Profile.check_formula),
                   inspect.getsource(reporting.render_terminal), inspect.getsource(result.module_table)):
        assert "rjust" not in source and "ljust" not in source and ":<" not in source and ":>" not in source
    lines = units.table(["n", "cost"], [["1", "10"], ["100", "1,000"]], right=range(2), rule=False)
    assert lines == ["  n   cost", "  1     10", "100  1,000"]
    assert units.table(["test", "model", "n", "verdict"], [["a", "b", "1", "ok"]])[1] == "----  -----  -  -------"


# --- compare ---------------------------------------------------------------------------------------


def test_compare_identical_reports(tmp_path, capsys):
    a = write(tmp_path / "a.json", row(), row(n=128))
    assert cli.main(["compare", a, a]) == 0
    out = capsys.readouterr().out
    assert "0 changed, 0 added, 0 removed, 2 unchanged; no part grew beyond 0%" in out
    assert "changed (" not in out


def test_compare_growth_fails_with_one_line_per_part(tmp_path, capsys):
    a = write(tmp_path / "a.json", row(), row(n=128))
    b = write(tmp_path / "b.json", row(ffn=500), row(n=128))
    assert cli.main(["compare", a, b]) == cli.GREW == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    changed = next(line for line in lines if line.startswith("t.py::test_a") and "512" in line)
    # test, model, n, batch, total before and after, then the change of every part
    assert changed.split() == ["t.py::test_a", "BertModel", "512", "1", "710", "810", "+14.08%", "=", "=",
                               "+25.00%", "="]
    assert "  t.py::test_a [BertModel n=512 batch=1]: total 710 → 810 MAC (+14.1%) over the baseline " \
           "(max_increase 0%)" in lines
    assert "  t.py::test_a [BertModel n=512 batch=1]: ffn 400 → 500 MAC (+25.0%) over the baseline " \
           "(max_increase 0%)" in lines
    assert lines[-1] == "1 changed, 0 added, 0 removed, 1 unchanged; 2 parts grew beyond 0%"


def test_compare_within_the_allowed_increase_passes(tmp_path, capsys):
    a = write(tmp_path / "a.json", row())
    b = write(tmp_path / "b.json", row(ffn=500))
    assert cli.main(["compare", a, b, "--max-increase", "25"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "1 changed, 0 added, 0 removed, 0 unchanged; " \
                                                      "no part grew beyond 25%"
    assert cli.main(["compare", a, b, "--max-increase", "24.9"]) == 1  # ffn +25% > 24.9%


def test_compare_decrease_and_new_cost(tmp_path, capsys):
    a = write(tmp_path / "a.json", row(other=0))
    b = write(tmp_path / "b.json", row(ffn=300, other=5))
    assert cli.main(["compare", a, b, "--max-increase", "1000"]) == 1  # other 0 -> 5: a new cost
    out = capsys.readouterr().out
    assert "-25.00%" in out and "-13.57%" in out and "+inf" in out and "other 0 → 5 MAC (new cost)" in out


def test_compare_added_and_removed(tmp_path, capsys):
    a = write(tmp_path / "a.json", row(), row(test_id="t.py::test_gone", n=64))
    b = write(tmp_path / "b.json", row(), row(test_id="t.py::test_new", name="GPT2Model", n=2048, mode="decode",
                                              backend="torch"))
    assert cli.main(["compare", a, b]) == 0  # added and removed entries are listed, not failed
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{a} (2 entries) → {b} (2 entries), counts in MAC:"
    added = lines.index("added (1):")
    assert lines[added + 3].split() == ["t.py::test_new", "GPT2Model", "(decode,", "torch)", "2,048", "1", "710"]
    removed = lines.index("removed (1):")
    assert lines[removed + 3].split() == ["t.py::test_gone", "BertModel", "64", "1", "710"]
    assert lines[-1] == "0 changed, 1 added, 1 removed, 1 unchanged; no part grew beyond 0%"


def test_compare_matches_an_entry_whose_backend_changed(tmp_path, capsys):
    a = write(tmp_path / "a.json", row(), row(test_id="t.py::test_b"))
    b = write(tmp_path / "b.json", row(backend="torch"), row(test_id="t.py::test_b", ffn=900, backend="torch"))
    assert cli.main(["compare", a, b]) == 1  # the same entries, counted by the other backend: one grew
    lines = capsys.readouterr().out.splitlines()
    changed = lines.index("changed (2):")
    assert lines[changed + 3].split()[:7] == ["t.py::test_a", "BertModel", "(backend", "fvcore", "→", "torch)", "512"]
    assert lines[changed + 4].split()[:2] == ["t.py::test_b", "BertModel"] and "+125.00%" in lines[changed + 4]
    assert lines[-1] == "2 changed, 0 added, 0 removed, 0 unchanged; 2 parts grew beyond 0%"  # ffn and total


def test_compare_keys_entries_by_mode_and_backend(tmp_path, capsys):
    # a test that profiles with both backends (a cross-check) keeps two entries: nothing is paired
    a = write(tmp_path / "a.json", row(), row(backend="torch"))
    b = write(tmp_path / "b.json", row(), row(backend="torch"), row(mode="decode"))
    assert cli.main(["compare", a, b]) == 0
    assert "0 changed, 1 added, 0 removed, 2 unchanged" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist; create it with --attncost-save="),
        ("", "is empty"),
        ('{"schema": 1, "unit": "MAC", "profiles": [', "is not valid JSON (truncated or corrupt?)"),
        ('{"schema": 99, "unit": "MAC", "profiles": []}', "has schema 99; this pytest-attncost reads schema 1"),
        ('{"a": 1}', "is not an attncost baseline"),
        pytest.param("[" * 100_000 + "]" * 100_000, "is nested too deeply to be an attncost report (", id="nested"),
    ],
)
def test_compare_unreadable_files_are_usage_errors(tmp_path, capsys, content, message):
    good = write(tmp_path / "good.json", row())
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    for args in ([str(bad), good], [good, str(bad)]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["compare", *args])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "python -m pytest_attncost compare: error: baseline" in err and str(bad) in err and message in err
        assert err.splitlines()[-1].startswith("python -m pytest_attncost compare: error: baseline")  # one line


@pytest.mark.parametrize("value", ["-1", "x", "nan", "inf"])
def test_compare_bad_max_increase(tmp_path, capsys, value):
    a = write(tmp_path / "a.json", row())
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["compare", a, a, "--max-increase", value])
    assert exit_info.value.code == 2
    assert "argument --max-increase: expected a percentage >= 0 such as 2.5" in capsys.readouterr().err


def test_compare_exit_codes_as_a_subprocess(tmp_path):
    a = write(tmp_path / "a.json", row())
    b = write(tmp_path / "b.json", row(core=150))
    assert run("compare", a, a).returncode == 0
    grew = run("compare", a, b)
    assert grew.returncode == 1 and "attention_core 100 → 150 MAC (+50.0%)" in grew.stdout
    assert run("compare", a, b, "--max-increase", "50").returncode == 0
    missing = run("compare", a, str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and "nope.json does not exist" in missing.stderr


# --- profile ---------------------------------------------------------------------------------------


def test_profile_a_factory_from_a_file(capsys):
    from tiny_models import bert_like

    from pytest_attncost import profile

    assert cli.main(["profile", f"{TINY}:bert_like", "--n", "16", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{TINY}:bert_like: BertModel, batch 1, counted by fvcore, whole model in MAC (1 MAC = 2 FLOP):"
    assert lines[1].split() == ["n", "total", "attention_core", "attention_proj", "ffn", "other", "attn", "share",
                                "deviation", "warnings"]
    for line, n in zip(lines[2:4], (16, 32)):
        expected = profile(bert_like, n)
        assert line.split() == [f"{n:,}", f"{expected.total:,}", f"{expected.attention_core:,}",
                                f"{expected.attention_proj:,}", f"{expected.ffn:,}", f"{expected.other:,}",
                                f"{expected.attention_share:.4f}", "0", "0"]


def test_profile_a_dotted_module_with_batch_and_backend(monkeypatch, capsys):
    monkeypatch.chdir(TINY.parent)
    assert cli.main(["profile", "tiny_models:gpt2_like", "--n", "8", "--batch", "2", "--backend", "torch"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tiny_models:gpt2_like: GPT2Model, batch 2, counted by torch, ")
    assert lines[2].split()[0] == "8"


def test_profile_several_lengths_with_the_torch_backend_is_one_run(capsys):
    from tiny_models import gpt2_like

    from pytest_attncost import clear_cache, profile

    assert cli.main(["profile", f"{TINY}:gpt2_like", "--n", "40", "8", "--backend", "torch", "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)["profiles"]
    clear_cache()
    assert sorted((e["n"], e["attention_core"], e["ffn"], e["other"]) for e in entries) == [
        (p.n, p.attention_core, p.ffn, p.other) for p in (profile(gpt2_like, n, backend="torch") for n in (8, 40))]
    assert cli.main(["profile", f"{TINY}:gpt2_like", "--n", "40", "8", "--backend", "torch"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert ("counted by torch (one run for all lengths)" in first) == one_run.POSSIBLE, first


def test_profile_json_is_a_report_compare_reads(tmp_path, capsys):
    assert cli.main(["profile", f"{TINY}:bert_like", "--n", "16", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["schema"] == reporting.SCHEMA and document["unit"] == "MAC"
    (entry,) = document["profiles"]
    assert entry["test_id"] == f"{TINY}:bert_like" and entry["n"] == 16 and entry["name"] == "BertModel"
    path = tmp_path / "a.json"
    path.write_text(json.dumps(document))
    entries, _ = baseline.load(path)
    assert list(entries) == [baseline.entry_key(entry)]
    assert cli.main(["compare", str(path), str(path)]) == 0


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("tiny_models", "expected MODULE:FACTORY (a dotted module or a .py file, a colon, a function), "
                        "got 'tiny_models'"),
        (":bert_like", "expected MODULE:FACTORY"),
        ("no_such_module_xyz:f", "cannot import no_such_module_xyz:f: No module named 'no_such_module_xyz'; "
                                 "give a dotted module importable from the current directory"),
        ("missing.py:f", "cannot import missing.py:f: no file missing.py; "
                         "give an existing .py file or a dotted module"),
        ("tiny_models:bert_lik", "cannot use tiny_models:bert_lik: module tiny_models has no attribute 'bert_lik' "
                                 "(did you mean 'bert_like'?); after the colon, name a zero-argument function"),
        ("tiny_models:LAYERS", "cannot use tiny_models:LAYERS: LAYERS is not callable (it is an int); point at a "
                               "zero-argument function that returns the model"),
        ("broken.py:f", "cannot import broken.py:f: importing broken.py raised RuntimeError: boom; fix the module"),
        ("broken_dep:f", "cannot import broken_dep:f: importing broken_dep raised ModuleNotFoundError: "
                         "No module named 'not_installed_dep_xyz'"),
        ("factories.py:needs_arguments", "factories.py:needs_arguments at n=8: the model factory 'needs_arguments' "
                                         "failed on the meta device"),
        ("factories.py:a_config", "factories.py:a_config at n=8: the model factory returned dict, not an nn.Module"),
    ],
)
def test_profile_usage_errors_name_the_target_and_the_fix(tmp_path, monkeypatch, capsys, target, message):
    (tmp_path / "tiny_models.py").write_text(TINY.read_text())
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "broken_dep.py").write_text("import not_installed_dep_xyz\n")
    (tmp_path / "factories.py").write_text("def needs_arguments(width):\n    pass\n\ndef a_config():\n    return {}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["profile", target, "--n", "8"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "python -m pytest_attncost profile: error: " in err
    assert message in " ".join(err.split())


def test_profile_a_model_without_default_inputs_points_to_python(tmp_path, monkeypatch, capsys):
    (tmp_path / "custom.py").write_text(
        "from torch import nn\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 4)\n\n"
        "    def forward(self, x):\n        return self.fc(x)\n"
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["profile", "custom.py:Net", "--n", "8"])
    assert exit_info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "custom.py:Net at n=8: cannot guess the inputs of Net" in err
    assert "for others pass --inputs MODULE:FN, a function (n, batch) -> tuple | dict" in err


def test_profile_takes_inputs_from_a_function(tmp_path, monkeypatch, capsys):
    # a (batch, n, d) attention model of one's own: two layers of one sdpa over 4 heads of 8, an FFN of 4 x 32
    (tmp_path / "mine.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Block(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)\n"
        "        self.mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))\n\n"
        "    def forward(self, x):\n"
        "        b, n, _ = x.shape\n"
        "        q, k, v = (t.view(b, n, 4, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))\n"
        "        a = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, 32)\n"
        "        x = x + self.o(a)\n"
        "        return x + self.mlp(x)\n\n"
        "def model():\n    return nn.Sequential(Block(), Block())\n\n"
        "def inputs(n, batch):\n    return (torch.zeros(batch, n, 32),)\n"
        "not_a_function = 3\n"
    )
    monkeypatch.chdir(tmp_path)
    assert cli.main(["profile", "mine.py:model", "--inputs", "mine.py:inputs", "--n", "16", "--batch", "2"]) == 0
    row = capsys.readouterr().out.splitlines()[2].split()
    core, proj, ffn = 2 * 2 * 2 * 4 * 16 * 16 * 8, 2 * 2 * 16 * 32 * 128, 2 * 2 * 16 * 32 * 256
    assert row[:5] == ["16", f"{core + proj + ffn:,}", f"{core:,}", f"{proj:,}", f"{ffn:,}"]
    with pytest.raises(SystemExit):
        cli.main(["profile", "mine.py:model", "--inputs", "mine.py:not_a_function", "--n", "16"])
    assert "not_a_function is not callable (it is an int); point at a function (n, batch) -> tuple | dict" in " ".join(
        capsys.readouterr().err.split())


def test_profile_needs_lengths(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["profile", f"{TINY}:bert_like"])
    assert exit_info.value.code == 2
    assert "the following arguments are required: --n" in capsys.readouterr().err


ENCODER = """from torch import nn

import sibling_layer  # a sibling imported while the module is: found beside it


def build():
    layer = nn.TransformerEncoderLayer(sibling_layer.WIDTH, 2, 16, batch_first=True)
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
"""


@pytest.mark.parametrize("form", ["file", "dotted"])
def test_profile_leaves_sys_path_as_it_was(tmp_path, monkeypatch, capsys, form):
    # a sibling named like a dependency must not replace it for what the command imports after the user's module
    from pytest_attncost import clear_cache, formulas

    clear_cache()  # counted afresh, so fvcore is imported after the user's module
    (tmp_path / "attncost_sibling_model.py").write_text(ENCODER)
    (tmp_path / "sibling_layer.py").write_text("WIDTH = 8\n")
    (tmp_path / "fvcore.py").write_text("raise ImportError('the sibling fvcore.py was imported')\n")
    monkeypatch.chdir(tmp_path)
    for name in [m for m in sys.modules if m == "fvcore" or m.startswith("fvcore.")]:
        monkeypatch.delitem(sys.modules, name)  # imported afresh by the count; the originals come back after
    for name in ("attncost_sibling_model", "sibling_layer"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = list(sys.path)
    target = f"{tmp_path / 'attncost_sibling_model.py'}:build" if form == "file" else "attncost_sibling_model:build"
    try:
        assert cli.main(["profile", target, "--n", "8"]) == 0
    finally:
        sys.modules.pop("sibling_layer", None)
        sys.modules.pop("attncost_sibling_model", None)
    assert sys.path == before
    assert Path(sys.modules["fvcore"].__file__).parent.name == "fvcore"  # the package, not the sibling
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{target}: TransformerEncoder, batch 1, counted by fvcore, ")
    layer = formulas.layer_costs(formulas.ModelSpec(8, 2, 4, 1, 16), 8, 1)
    n, _total, core, proj, ffn, _other, _share, deviation, warnings = lines[2].split()
    assert [n, core, proj, ffn, deviation, warnings] == [
        "8", f"{layer.attention_core:,}", f"{layer.attention_proj:,}", f"{layer.ffn:,}", "0", "0"]


@pytest.mark.parametrize(("body", "code", "options"), [
    ("sys.exit(0)", "0", []),
    ("sys.exit()", "None", []),
    ("raise SystemExit('bye')", "'bye'", []),
    ("sys.exit(0)", "0", ["--n", "16", "--backend", "torch"]),  # the torch backend's sweep
])
def test_profile_a_factory_that_exits_is_an_error(tmp_path, monkeypatch, capsys, body, code, options):
    (tmp_path / "exits.py").write_text(f"import sys\n\n\ndef build():\n    {body}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["profile", "exits.py:build", "--n", "8", *options])
    assert exit_info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (f"python -m pytest_attncost profile: error: cannot use exits.py:build: the factory called "
            f"sys.exit({code}); a factory must return the model") in err


def test_profile_a_factory_interrupted_is_not_swallowed(tmp_path, monkeypatch):
    (tmp_path / "interrupted.py").write_text("def build():\n    raise KeyboardInterrupt\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["profile", "interrupted.py:build", "--n", "8"])


def test_compare_keys_a_second_sequence_that_differs_from_n(tmp_path, capsys):
    # one test, one model, n 64: the target at 32 and at 16 are two entries; m equal to n is no second key
    a = write(tmp_path / "a.json", row(name="Transformer", n=64, m=32), row(test_id="t.py::test_b", n=64, m=64))
    b = write(tmp_path / "b.json", row(name="Transformer", n=64, m=16), row(test_id="t.py::test_b", n=64, m=None))
    assert cli.main(["compare", a, b]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[lines.index("added (1):") + 3].split()[:5] == ["t.py::test_a", "Transformer", "64", "(m", "16)"]
    assert lines[lines.index("removed (1):") + 3].split()[:5] == ["t.py::test_a", "Transformer", "64", "(m", "32)"]
    assert lines[-1] == "0 changed, 1 added, 1 removed, 1 unchanged; no part grew beyond 0%"


def test_profile_checks_its_arguments_before_importing_torch(tmp_path):
    # the user's module imports torch (seconds, more on a loaded machine): a bad argument is told before that
    (tmp_path / "heavy.py").write_text("import torch\n\ndef model():\n    return torch.nn.Linear(2, 2)\n")
    probe = ("import sys\nfrom pytest_attncost import cli\ntry:\n    cli.main(sys.argv[1:])\n"
             "except SystemExit as exc:\n    print('exit', exc.code, 'torch' in sys.modules)\n")
    for args, message in ((["--inputs", "no_colon"], "expected MODULE:FACTORY"),
                          (["--inputs", "missing.py:fn"], "no file missing.py"),
                          (["--spec", "hidden=64,heds=4"], "'heds=4' is not KEY=VALUE of a ModelSpec keyword (did you "
                                                           "mean 'heads'?)"),
                          (["--spec", "hidden=64,heads=4,head_dim=16,layers=0,ffn_dim=8"],
                           "ModelSpec.layers must be a positive int, got 0")):
        done = subprocess.run([sys.executable, "-c", probe, "profile", "heavy.py:model", "--n", "8", *args],
                              capture_output=True, text=True, cwd=tmp_path)
        assert done.stdout.split() == ["exit", "2", "False"], (args, done.stdout, done.stderr)
        assert message in " ".join(done.stderr.split()), args


def test_profile_takes_a_spec_by_keywords(tmp_path, monkeypatch, capsys):
    (tmp_path / "mlp.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "def model():\n    return nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2)\n")
    monkeypatch.chdir(tmp_path)
    spec = "hidden=32,heads=4,head_dim=8,layers=2,ffn_dim=128"  # a wider FFN than the model's 64
    assert cli.main(["profile", "mlp.py:model", "--n", "16", "--spec", spec, "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["profiles"]
    # |2·n·D·64 - 2·n·D·128| / 2·n·D·128
    assert entry["spec"]["ffn_dim"] == 128 and entry["deviation"] == pytest.approx(0.5)
