"""Issue 12, "Honest numbers in every mode": the cache never serves another model's profile,
never outlives its session, can be turned off, and the fixture never drops the marker's n."""

from __future__ import annotations

import dataclasses

import pytest
import tiny_models as tm
import torch
from torch import nn

from pytest_attncost import ProfileError, cache, clear_cache, profile
from pytest_attncost.request import Request

D = tm.HIDDEN
FFN_ONLY = {"ffn": ["*"]}


def _key(model: nn.Module, inputs: object = None) -> object:
    return cache.cache_key(model, Request(16, inputs=inputs, name="x"))


# --- the key: configs ----------------------------------------------------------------------


def test_eager_and_sdpa_builds_never_share_an_entry():
    eager = profile(tm.llama_like(attn_implementation="eager"), 16)
    sdpa = profile(tm.llama_like(attn_implementation="sdpa"), 16)
    assert eager is not sdpa  # to_json_string omits _attn_implementation: it was one entry
    assert "eager" in repr(_key(tm.llama_like(attn_implementation="eager")))


def test_private_config_attributes_of_sub_configs_are_in_the_key():
    from transformers import CLIPConfig, CLIPTextModel

    config = CLIPConfig(text_config=dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=128))

    class Holder(nn.Module):  # the composite config hangs on a module; only its sub-config changes
        def __init__(self):
            super().__init__()
            self.config = config
            self.text = CLIPTextModel(config.text_config)

    model = Holder()
    before = _key(model)
    config.text_config._attn_implementation = "eager" if config.text_config._attn_implementation != "eager" else "sdpa"
    assert before is not None and _key(model) != before
    text = config.text_config
    if not hasattr(text, "_experts_implementation"):
        pytest.skip("transformers < 5 has no _experts_implementation (the MoE twin of _attn_implementation)")
    experts = _key(model)
    text._experts_implementation = "grouped_mm" if text._experts_implementation != "grouped_mm" else "eager"
    assert _key(model) != experts


# --- the key: module attributes ------------------------------------------------------------


@dataclasses.dataclass
class Choice:
    repeats: int


class Policy:  # a plain object the key cannot describe
    def __init__(self, repeats: int) -> None:
        self.repeats = repeats


def _repeats(choice: object) -> int:
    if isinstance(choice, (list, tuple, set)):
        return len(choice)
    if isinstance(choice, dict):
        return sum(choice.values())
    return choice.repeats  # type: ignore[attr-defined]


class Picky(nn.Module):
    """An MLP applied as many times as an attribute says: the attribute decides the count."""

    def __init__(self, choice: object) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.choice = choice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(_repeats(self.choice)):
            x = self.down(self.up(x))
        return x


def _count(model: nn.Module) -> object:
    return profile(model, 16, inputs=(torch.zeros(1, 16, D),), roles=FFN_ONLY)


# one pass: 16 tokens * (D * 2D + 2D * D) = 16 * 4 * 128 * 128 = 1_048_576 MACs
ONE_PASS = 16 * 4 * D * D


@pytest.mark.parametrize(("start", "grow"), [
    pytest.param(lambda: [1], lambda m: m.choice.append(1), id="list-in-place"),
    pytest.param(lambda: (1,), lambda m: setattr(m, "choice", (1, 1)), id="tuple"),
    pytest.param(lambda: {"k": 1}, lambda m: m.choice.update(k=2), id="dict-in-place"),
    pytest.param(lambda: {1}, lambda m: m.choice.add(2), id="set-in-place"),
    pytest.param(lambda: Choice(1), lambda m: setattr(m.choice, "repeats", 2), id="dataclass-in-place"),
])
def test_container_attributes_are_in_the_key(start, grow):
    model = Picky(start())
    assert _count(model).ffn == ONE_PASS
    assert _key(model) is not None  # simple containers stay cacheable
    grow(model)
    assert _count(model).ffn == 2 * ONE_PASS  # it was the stale one-pass profile


def test_an_attribute_the_key_cannot_describe_makes_the_call_uncacheable():
    model = Picky(Policy(1))
    assert _key(model, (torch.zeros(1, 16, D),)) is None
    assert _count(model).ffn == ONE_PASS
    model.choice.repeats = 2
    assert _count(model).ffn == 2 * ONE_PASS


def test_functions_and_modules_of_the_tree_stay_cacheable():
    model = Picky([1])
    model.act = torch.relu  # a function: by identity
    model.layers_view = [model.up, model.down]  # modules of the tree: by their names
    assert _key(model) is not None
    before = _key(model)
    model.act = torch.tanh
    assert _key(model) != before
    model.stray = [nn.Linear(2, 2)]  # a module outside the tree: its shape is not in the key
    assert _key(model) is None


class _Scale(nn.Module):
    """No weights, no children: kept aside in a dict, as the kernels package keeps its function wrappers."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def test_a_module_aside_without_weights_is_described_by_its_type_and_settings():
    model = Picky([1])
    model.aside = {"scale": _Scale(1.0)}
    before = _key(model)
    assert before is not None
    model.aside = {"scale": _Scale(1.0)}  # another instance, the same type and settings: the same entry
    assert _key(model) == before
    model.aside["scale"].factor = 2.0
    assert _key(model) not in (None, before)
    model.aside["scale"].inner = nn.Linear(2, 2)  # a child's shape is not in the key
    assert _key(model) is None


@pytest.mark.parametrize("factory", [tm.bert_like, tm.llama_like, tm.gpt2_like, tm.torch_encoder])
def test_real_models_still_hit_the_cache(factory):
    model = factory()
    assert _key(model) is not None
    first = profile(model, 24)
    assert profile(model, 24) is first
    assert profile(factory, 24) is profile(factory, 24)  # each call builds a new twin: the same entry


def test_switch_turns_lookups_and_stores_off():
    model = tm.bert_like()
    previous = cache.set_enabled(False)
    try:
        assert _key(model) is None
        assert profile(model, 20) is not profile(model, 20)
    finally:
        cache.set_enabled(previous)
    assert profile(model, 20) is profile(model, 20)


# --- the session ---------------------------------------------------------------------------

# Each inner run writes the attention core it saw; the conftest decides whether fused attention
# is counted twice, something no cache key can see (a table in another module).
TWO_SESSIONS_TEST = """
    from tiny_models import bert_like

    def test_count(attncost, pytestconfig):
        result = attncost.profile(bert_like, 16)
        (pytestconfig.rootpath / "core.txt").write_text(str(result.attention_core))
"""

DOUBLED_CONFTEST = """
    import pytest
    import pytest_attncost.counting as counting

    @pytest.fixture(autouse=True)
    def doubled_sdpa(monkeypatch):
        original = counting.jit.EXTRA_HANDLES["aten::scaled_dot_product_attention"]
        monkeypatch.setitem(counting.jit.EXTRA_HANDLES, "aten::scaled_dot_product_attention",
                            lambda i, o: 2 * original(i, o))
"""


def test_the_cache_does_not_outlive_its_session(project):
    clear_cache()
    honest = profile(tm.bert_like, 16).attention_core
    project.makepyfile(test_count=TWO_SESSIONS_TEST)
    project.makeconftest(DOUBLED_CONFTEST)
    project.runpytest().assert_outcomes(passed=1)
    assert int((project.path / "core.txt").read_text()) == 2 * honest
    project.makeconftest("")  # the second pytest.main() in this process counts honestly
    project.runpytest().assert_outcomes(passed=1)
    assert int((project.path / "core.txt").read_text()) == honest


SAME_OBJECT_TEST = """
    from tiny_models import bert_like

    def test_twice(attncost):
        assert attncost.profile(bert_like, 16) is attncost.profile(bert_like, 16)
"""


@pytest.mark.parametrize(("args", "ini", "outcome"), [
    ((), "", "passed"),
    (("--attncost-no-cache",), "", "failed"),
    ((), "attncost_cache = false\n", "failed"),
    ((), "attncost_cache = true\n", "passed"),
    (("--attncost-no-cache",), "attncost_cache = true\n", "failed"),  # the command line wins
])
def test_no_cache_option_and_ini(project, args, ini, outcome):
    project.makeini(f"[pytest]\nconsole_output_style = classic\n{ini}")
    project.makepyfile(test_twice=SAME_OBJECT_TEST)
    project.runpytest(*args).assert_outcomes(**{outcome: 1})
    assert cache.enabled is True  # the process gets its switch back after the run


def test_bad_cache_ini_value_names_the_key(project):
    project.makeini("[pytest]\nattncost_cache = maybe\n")
    result = project.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*attncost_cache in the ini file: invalid truth value 'maybe'; "
                                 "expected true or false*"])


def test_no_cache_is_in_help(project):
    result = project.runpytest("--help")
    result.stdout.fnmatch_lines(["*--attncost-no-cache*", "*attncost_cache (bool)*"])


# --- the fixture keeps the marker's n with explicit inputs -----------------------------------


def test_profile_refuses_inputs_of_another_length():
    ids = {"input_ids": torch.zeros(1, 16, dtype=torch.long)}
    with pytest.raises(ProfileError, match="n=512 was asked for") as raised:
        profile(tm.bert_like(), 512, inputs=ids)
    assert "16 tokens" in str(raised.value)


EXPLICIT_INPUTS_TEST = """
    import pytest
    import torch
    from tiny_models import bert_like

    @pytest.mark.attncost(n={n})
    def test_explicit(attncost):
        result = attncost.profile(bert_like, inputs={{"input_ids": torch.zeros(1, 16, dtype=torch.long)}})
        assert result.n == 16
"""


def test_marker_n_is_checked_against_explicit_inputs(project):
    project.makepyfile(test_explicit=EXPLICIT_INPUTS_TEST.format(n=512))
    result = project.runpytest()
    result.assert_outcomes(failed=1)  # it passed before, silently profiled at n=16
    result.stdout.fnmatch_lines(["*n=512 was asked for*16 tokens*"])
    project.makepyfile(test_explicit=EXPLICIT_INPUTS_TEST.format(n=16))
    project.runpytest().assert_outcomes(passed=1)


def test_marker_batch_is_checked_against_explicit_inputs(project):
    project.makepyfile("""
        import pytest
        import torch
        from tiny_models import bert_like

        @pytest.mark.attncost(n=16, batch=2)
        def test_batch(attncost):
            attncost.profile(bert_like, inputs={"input_ids": torch.zeros(1, 16, dtype=torch.long)})
    """)
    result = project.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*batch=2 was asked for, but the inputs hold a batch of 1*"])
