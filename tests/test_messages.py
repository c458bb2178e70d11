"""Messages that name the key, the value and the fix (issue 13, 'Unclear messages')."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tiny_models as tm
from pytest_attncost import ProfileError, cli, inputs, profile


def test_roles_as_a_list_names_the_form() -> None:
    with pytest.raises(ProfileError, match=r"roles= must be a dict .* got list \['layers\.\*\.attn'\]; e\.g\. roles="):
        profile(tm.HandWritten(), 8, roles=["layers.*.attn"])


@pytest.mark.parametrize(("n", "batch"), [(2**63, None), (8, 2**62), (2**40, 2**30)])
def test_lengths_torch_cannot_describe(n: int, batch: int | None) -> None:
    with pytest.raises(ProfileError) as info:
        profile(tm.bert_like, n, batch=batch)
    assert str(info.value) == inputs.TOO_LARGE.format(n=n, batch=batch or 1)


def test_cli_refuses_absurd_sizes_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--hidden", str(10**400), "--heads", "10"])
    err = capsys.readouterr().err
    assert "argument --hidden: 401-digit value: sizes above 2**48 describe no model" in err
    assert "Traceback" not in err


def test_cli_without_an_ffn_says_attention_always_leads(capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(["--hidden", "768", "--heads", "12", "--ffn", "0"])
    out = capsys.readouterr().out
    assert "attention overtakes the FFN at every n (the FFN is no larger than the projections)" in out
    assert "never" not in out


def test_cli_lengths_repeated_or_listed(capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(["--preset", "bert-base", "--n", "512", "--n", "1024", "--json"])
    repeated = capsys.readouterr().out
    cli.main(["--preset", "bert-base", "--n", "512", "1024", "--json"])
    assert repeated == capsys.readouterr().out
    assert '"n": 512' in repeated and '"n": 1024' in repeated


def test_cli_into_a_closed_pipe_is_quiet() -> None:
    lengths = " ".join(str(n) for n in range(1, 4001))  # ~600 KB of table: far more than a pipe holds
    done = subprocess.run(f"{sys.executable} -m pytest_attncost --preset llama-2-7b --n {lengths} | head -1",
                          shell=True, capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("llama-2-7b: hidden 4096")
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr
