"""Messages that name the key, the value and the fix (issue 13, 'Unclear messages')."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models as tm
import torch

from pytest_attncost import ProfileError, cli, errors, profile, request


def test_roles_as_a_list_names_the_form() -> None:
    with pytest.raises(ProfileError, match=r"roles= must be a dict .* got list \['layers\.\*\.attn'\]; e\.g\. roles="):
        profile(tm.HandWritten(), 8, roles=["layers.*.attn"])


@pytest.mark.parametrize(("n", "batch"), [(2**63, None), (8, 2**62), (2**40, 2**30)])
def test_lengths_torch_cannot_describe(n: int, batch: int | None) -> None:
    with pytest.raises(ProfileError) as info:
        profile(tm.bert_like, n, batch=batch)
    assert str(info.value) == request.TOO_LARGE.format(n=n, batch=batch or 1)


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
                          shell=True, capture_output=True, text=True, timeout=600)
    assert done.stdout.startswith("llama-2-7b: hidden 4096")
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


# --- a model that cannot be counted: where, and why ------------------------------------------------------

W = 16


class _Attention(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.qkv, self.o = torch.nn.Linear(W, 3 * W), torch.nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "values" and x.abs().sum().item() > 1e9:  # a value read: the line the message names
            x = x * 2
        if self.kind == "autocast":
            torch.get_autocast_dtype(x.device.type)  # autocast asked about 'meta': the line the message names
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.o(torch.nn.functional.scaled_dot_product_attention(q, k, v))


class _Model(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Attention(kind), _Attention(kind)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _line(text: str) -> str:
    """This file and the line number of *text* in it."""
    source = Path(__file__).read_text().splitlines()
    return f"{__file__}:{next(i for i, line in enumerate(source, 1) if text in line)}"


@pytest.mark.parametrize(("kind", "code", "fix"), [
    ("values", "x.abs().sum().item()", "Fix: forward() reads tensor values (.item(), bool(tensor)"),
    ("autocast", "torch.get_autocast_dtype(x.device.type)", "Fix: the model enters torch.autocast (or asks for "
                                                            "its dtype) with device_type taken from a tensor"),
])
def test_a_model_that_cannot_be_counted_is_named_with_its_module_its_line_and_the_cause(
        kind: str, code: str, fix: str) -> None:
    with pytest.raises(ProfileError) as info:
        profile(lambda: _Model(kind), 8, inputs=lambda n, b: (torch.zeros(b, n, W),))
    message = str(info.value)
    for counter in ("fvcore could not trace _Model on the meta device", "FlopCounterMode could not run _Model"):
        assert f"{counter}" in message
    assert message.count(f" in layers.0 (_Attention) at {_line(code)} (`") == 2, message
    assert message.count(fix) == 2 and ".item()" in message if kind == "values" else ".item()" not in message


def test_a_failure_of_unknown_cause_gets_the_general_hint_without_item() -> None:
    error = RuntimeError("something else")
    assert errors.hint(str(error)) == errors._DEFAULT_HINT and ".item()" not in errors._DEFAULT_HINT
    assert errors.site(error, _Model("plain")) == ""  # no traceback: nothing to name
