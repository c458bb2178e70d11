"""The user's world after a profile: global torch settings as they were, dropped hooks named, an endless
recursion the user's own error; ids and names in Markdown rendered as written."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pytest_attncost
from pytest_attncost.reporting import Row, render_markdown
from pytest_attncost.result import Profile

HIDDEN = 16


def settings() -> dict:
    return {
        "dtype": torch.get_default_dtype(), "device": torch.get_default_device(), "threads": torch.get_num_threads(),
        "grad": torch.is_grad_enabled(), "anomaly": torch.is_anomaly_enabled(),
        "deterministic": (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()),
        "precision": torch.get_float32_matmul_precision(), "autocast": torch.is_autocast_enabled("cpu"),
        "cudnn benchmark": torch.backends.cudnn.benchmark, "cudnn deterministic": torch.backends.cudnn.deterministic,
    }


class Meddling(nn.Module):
    """A forward that changes every global setting it can, after computing its output."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.up(x)
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(1)
        torch.set_grad_enabled(False)
        torch.set_anomaly_enabled(True)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_float32_matmul_precision("medium")
        torch.set_autocast_enabled("cpu", True)
        torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
        torch.backends.cudnn.deterministic = not torch.backends.cudnn.deterministic
        torch.set_default_device("meta")
        return out


def test_a_forward_that_changes_global_settings_leaves_them_as_they_were() -> None:
    before = settings()
    profile = pytest_attncost.profile(Meddling(), 4, inputs=(torch.zeros(1, 4, HIDDEN),), roles={"ffn": ["up"]},
                                      name="meddling", fallback=False)
    after = settings()
    assert after == before, {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    assert profile.ffn == 4 * HIDDEN * HIDDEN  # n·D·D for the one Linear, by hand
    timing = pytest_attncost.measure(Meddling(), 4, inputs=(torch.zeros(1, 4, HIDDEN),), roles={"ffn": ["up"]},
                                     warmup=0, repeats=1)  # real forwards, timed: the same settings put back
    assert settings() == before and timing.profile.ffn == profile.ffn


def test_the_users_hooks_dropped_from_the_count_are_named() -> None:
    model = Meddling()
    plain = pytest_attncost.profile(model, 4, inputs=(torch.zeros(1, 4, HIDDEN),), roles={"ffn": ["up"]},
                                    name="hooked")
    assert not [note for note in plain.notes if "hooks do not run" in note]

    def log_output(module: nn.Module, args: object, output: object) -> None:
        pass

    def check_input(module: nn.Module, args: object) -> None:
        pass

    model.up.register_forward_hook(log_output)
    model.register_forward_pre_hook(check_input)
    profile = pytest_attncost.profile(model, 4, inputs=(torch.zeros(1, 4, HIDDEN),), roles={"ffn": ["up"]},
                                      name="hooked")  # from the cache (hooks are not in its key): named all the same
    assert profile.ffn == plain.ffn
    (note,) = [note for note in profile.notes if "hooks do not run" in note]
    assert "forward hook test_the_users_hooks_dropped_from_the_count_are_named.<locals>.log_output on up" in note
    assert "forward pre hook test_the_users_hooks_dropped_from_the_count_are_named.<locals>.check_input on the model" \
        in note


def test_a_forward_recursing_without_end_fails_with_its_recursion_error(project: pytest.Pytester) -> None:
    project.makepyfile(test_deep="""
        import pytest, torch
        from torch import nn

        class Deep(nn.Module):
            def __init__(self):
                super().__init__()
                self.up = nn.Linear(8, 8)

            def forward(self, x):
                return self(self.up(x))

        @pytest.mark.attncost(n=4)
        def test_deep(attncost):
            attncost.profile(Deep(), inputs=(torch.zeros(1, 4, 8),), roles={"ffn": ["up"]})
    """)
    result = project.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*RecursionError: maximum recursion depth exceeded*"])
    assert "could not trace" not in result.stdout.str()  # the user's error, not a fallback's wrapping of it


HOSTILE = ["t.py::test_x[a`b]", "t.py::test_y[a|b]", "t.py::test_z[<img src=x onerror=alert(1)>]",
           "t.py::test_w[[c](javascript:alert(1))]"]


def test_ids_and_names_are_escaped_in_markdown() -> None:
    rows = [Row(test_id, Profile(name="<img src=x onerror=alert(2)>", n=4, batch=1, attention_core=0,
                                 attention_proj=0, ffn=4, other=0, layers=1, unsupported_ops={"aten::add": 1}))
            for test_id in HOSTILE]
    markdown = render_markdown(rows)
    table = [line for line in markdown.splitlines() if line.startswith("| `")]
    assert sorted(line.split(" | ")[0] for line in table) == sorted([
        "| ``t.py::test_x[a`b]``", "| `t.py::test_y[a\\|b]`", "| `t.py::test_z[<img src=x onerror=alert(1)>]`",
        "| `t.py::test_w[[c](javascript:alert(1))]`"])
    assert all(line.count(" | ") == len(line.split(" | ")) - 1 and "\\<img src=x onerror=alert(2)>" in line
               for line in table)
    (skipped,) = [line for line in markdown.splitlines() if "add x1" in line]  # the "ops fvcore skipped" list
    assert skipped == ("- \\<img src=x onerror=alert(2)> [`t.py::test_w[[c](javascript:alert(1))]` n=4, "
                       "``t.py::test_x[a`b]`` n=4, `t.py::test_y[a|b]` n=4 and 1 more]: add x1")
    outside = markdown.replace("`t.py::test_z[<img src=x onerror=alert(1)>]`", "")
    assert "<img" not in outside.replace("\\<img", "") and "](javascript" not in outside.replace(
        "`t.py::test_w[[c](javascript:alert(1))]`", "")
