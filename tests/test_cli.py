"""python -m pytest_attncost: the article's table for any shape."""

import json
import subprocess
import sys

import pytest

from pytest_attncost import cli


def run(*args):
    return subprocess.run([sys.executable, "-m", "pytest_attncost", *args], capture_output=True, text=True)


def test_bert_base_table_as_a_subprocess():
    result = run("--preset", "bert-base")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[0] == "bert-base: hidden 768, 12 heads x 64, ffn 3072, 12 layers"
    # the article's rows: SA, FFN, shares, linear-attention saving
    assert any(line.split()[:8] == ["512", "1,610,612,736", "2,415,919,104", "402,653,184", "1,207,959,552",
                                    "0.4000", "0.1000", "8.75%"] for line in lines)
    assert any(line.split()[:3] == ["4,608", "43,486,543,872", "21,743,271,936"] for line in lines)
    assert "attention overtakes the FFN at n = 1,536 = 2hd" in lines
    assert "the quadratic term dominates the layer at n = 4,608 = 6hd" in lines


# (preset, crossover, quadratic), each from (F - P) / 2hd and (F + P) / 2hd
PRESET_THRESHOLDS = {
    "bert-base": (1536, 4608),
    "bert-large": (2048, 6144),
    "gpt2": (1536, 4608),
    "gpt2-xl": (3200, 9600),
    "t5-base": (1536, 4608),
    # gated: F = 3 * 4096 * 11008; P = 4 * 4096^2
    "llama-2-7b": ((3 * 4096 * 11008 - 4 * 4096**2) / 8192, (3 * 4096 * 11008 + 4 * 4096**2) / 8192),
    "llama-2-13b": ((3 * 5120 * 13824 - 4 * 5120**2) / 10240, (3 * 5120 * 13824 + 4 * 5120**2) / 10240),
    # GQA: P = 2 * 4096^2 + 2 * 4096 * 8 * 128
    "llama-3-8b": ((3 * 4096 * 14336 - (2 * 4096**2 + 2 * 4096 * 1024)) / 8192,
                   (3 * 4096 * 14336 + (2 * 4096**2 + 2 * 4096 * 1024)) / 8192),
    "mistral-7b": (16384, 26624),
    # mixture of experts: the active FFN, top-2 of 8 gated experts of 14336 plus the router [4096, 8]
    "mixtral-8x7b": ((2 * 3 * 4096 * 14336 + 4096 * 8 - (2 * 4096**2 + 2 * 4096 * 1024)) / 8192,
                     (2 * 3 * 4096 * 14336 + 4096 * 8 + (2 * 4096**2 + 2 * 4096 * 1024)) / 8192),
}


def test_mixture_of_experts_options(capsys):
    # Mixtral-8x7B by hand: crossover (F - P) / 2hd with F = k*3*D*f_e + D*E
    assert cli.main(["--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--gated", "--experts", "8",
                     "--top-k", "2", "--expert-ffn", "14336", "--layers", "32", "--n", "512", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["crossover_n"] == 37892
    assert data["rows"][0]["ffn"] == 512 * (2 * 3 * 4096 * 14336 + 4096 * 8)
    assert data["spec"]["experts"] == 8 and data["spec"]["top_k"] == 2
    with pytest.raises(SystemExit):
        cli.main(["--hidden", "64", "--heads", "4", "--experts", "4"])
    assert "--experts needs --top-k" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--hidden", "64", "--heads", "4", "--top-k", "2"])
    assert "give --experts too" in capsys.readouterr().err


@pytest.mark.parametrize("preset", sorted(cli.PRESETS))
def test_every_preset(preset, capsys):
    assert cli.main(["--preset", preset, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["crossover_n"], data["quadratic_n"]) == PRESET_THRESHOLDS[preset]
    assert data["name"] == preset and data["unit"] == "MAC"
    assert [r["n"] for r in data["rows"]][:2] == [128, 512]
    assert cli.main(["--preset", preset]) == 0
    assert capsys.readouterr().out.startswith(f"{preset}: hidden")


def test_custom_shape_and_overrides(capsys):
    cli.main(["--hidden", "4096", "--heads", "32", "--ffn", "14336", "--kv-heads", "8", "--gated",
              "--layers", "32", "--n", "4096", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["spec"] == {"hidden": 4096, "heads": 32, "head_dim": 128, "layers": 32, "ffn_dim": 14336,
                            "kv_heads": 8, "gated": True, "cross_attention": False}
    row = data["rows"][0]
    # core 2 n^2 h d; projections n (2 D hd + 2 D g d)
    assert row["attention_core"] == 2 * 4096**2 * 4096
    assert row["attention_proj"] == 4096 * (2 * 4096 * 4096 + 2 * 4096 * 1024)
    assert row["ffn"] == 3 * 4096 * 4096 * 14336


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "give --hidden and --heads, or a --preset"),
        (["--hidden", "768"], "give --hidden and --heads, or a --preset"),
        (["--hidden", "100", "--heads", "3"], "--hidden 100 is not divisible by --heads 3: give --head-dim"),
        (["--hidden", "0", "--heads", "12"], "argument --hidden: expected a positive integer, got 0"),
        (["--hidden", "x", "--heads", "12"], "argument --hidden: expected a positive integer, got 'x'"),
        (["--preset", "bert-huge"], "argument --preset: invalid choice: 'bert-huge'"),
        (["--preset", "bert-base", "--n", "-5"], "argument --n: expected a positive integer, got -5"),
        (["--hidden", "768", "--heads", "12", "--kv-heads", "5"], "--heads 12 is not a multiple of --kv-heads 5"),
    ],
)
def test_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
