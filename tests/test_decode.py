"""Decode steps against a KV cache, the decode formulas, whole generations and KV-cache bytes (issue 16)."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pytest_attncost import ModelSpec, ProfileError, formulas, profile
from pytest_attncost.cli import PRESETS, main
from pytest_attncost.pipeline import CACHE_BYTES_WARNING
from pytest_attncost.result import Profile
from pytest_attncost.units import parse_bytes

LLAMA_7B = PRESETS["llama-2-7b"]


def llama_2_7b():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_hidden_layers=32, intermediate_size=11008,
                         vocab_size=32000)
    return LlamaForCausalLM(config).half()  # on the meta device (profile() builds factories there): free


def gpt2_tiny():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=128, n_head=4, n_layer=2, n_inner=512, vocab_size=50257))


def mistral_tiny(window=16):
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                            intermediate_size=256, num_hidden_layers=2, vocab_size=100,
                                            sliding_window=window))


# --- the done criteria ------------------------------------------------------------------------


@pytest.mark.parametrize("n", [4096, 32768])
def test_llama_2_7b_decode_step_is_exact_in_seconds(n):
    step = profile(llama_2_7b, n, mode="decode")
    # per layer: core 2·h·q·(n + q)·d, projections 4·D², gated FFN 3·D·f; 32 layers
    assert step.attention_core == 32 * 2 * 32 * 1 * (n + 1) * 128
    assert step.attention_proj == 32 * 4 * 4096 * 4096
    assert step.ffn == 32 * 3 * 4096 * 11008
    assert step.deviation == 0 and step.warnings == ()
    assert (step.n, step.new_tokens, step.mode) == (n, 1, "decode")
    assert step.kv_cache_bytes == 2 * 32 * 32 * 128 * n * 2  # float16: 2,147,483,648 at n = 4096


def test_kv_cache_bytes_llama_2_7b():
    assert formulas.kv_cache_bytes(LLAMA_7B, 4096, bytes_per_element=2) == 2 * 32 * 32 * 128 * 4096 * 2 == 2**31


def test_decode_crossover_llama_2_7b_and_ungated():
    # F / 2hd = 3·4096·11008 / (2·4096)
    assert formulas.decode_crossover_n(LLAMA_7B) == 16_512
    bert_shaped = ModelSpec(768, 12, 64, 12, 4 * 768)
    assert formulas.decode_crossover_n(bert_shaped) == 4 * 768  # 8D² / 2D
    # attention (core + projections) meets the FFN where it does in the prefill
    assert formulas.decode_attention_n(LLAMA_7B) == formulas.crossover_n(LLAMA_7B) == 8_320
    assert formulas.decode_quadratic_n(LLAMA_7B) == 24_704  # (P + F) / 2hd


def test_decode_crossover_is_where_the_executed_core_meets_the_ffn():
    # a one-token step over a cache of 16,511 attends to 16,512 keys: core = FFN exactly
    step = formulas.decode_costs(LLAMA_7B, 16_511)
    assert step.attention_core == step.ffn
    assert formulas.decode_costs(LLAMA_7B, 16_510).attention_core < step.ffn


def test_gpt2_decode_step_against_hand_formula():
    step = profile(gpt2_tiny, 100, mode="decode", new_tokens=3)
    # 2 layers; core 2·h·q·(n + q)·d = 2·4·3·103·32; projections 4·D² (Conv1D addmm); FFN 2·D·f
    assert step.attention_core == 2 * (2 * 4 * 3 * 103 * 32)
    assert step.attention_proj == 2 * 3 * 4 * 128 * 128
    assert step.ffn == 2 * 3 * 2 * 128 * 512
    assert step.deviation == 0
    assert step.kv_cache_bytes == 2 * 2 * 4 * 32 * 100 * 4  # float32


@pytest.mark.parametrize(("n", "keys"), [(8, 8 + 2), (64, 15 + 2)])
def test_mistral_gqa_and_sliding_window_against_hand_formula(n, keys):
    # transformers 5.24's DynamicSlidingWindowLayer keeps the last W - 1 = 15 tokens; the 2 new ones join them
    step = profile(mistral_tiny, n, mode="decode", new_tokens=2)
    assert step.attention_core == 2 * (2 * 4 * 2 * keys * 32)  # query heads h = 4, not g = 2
    assert step.attention_proj == 2 * 2 * (2 * 128 * 128 + 2 * 128 * 2 * 32)  # Q, O: D·hd; K, V: D·gd
    assert step.ffn == 2 * 2 * 3 * 128 * 256
    assert step.spec.sliding_window == 16 and step.deviation == 0
    assert step.kv_cache_bytes == 2 * 2 * 2 * 32 * min(n, 15) * 4


def test_both_backends_agree_on_a_decode_step():
    fv = profile(mistral_tiny, 40, mode="decode", new_tokens=2)
    th = profile(mistral_tiny, 40, mode="decode", new_tokens=2, backend="torch")
    assert th.backend == "torch"
    for part in ("attention_core", "attention_proj", "ffn", "kv_cache_bytes"):
        assert getattr(fv, part) == getattr(th, part)


# --- a whole generation, every step profiled -------------------------------------------------


class _Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, x, cache):
        b, q, width = x.shape
        split = lambda t: t.view(b, q, self.heads, -1).transpose(1, 2)  # noqa: E731
        keys = torch.cat([cache[0], split(self.k(x))], dim=2)
        values = torch.cat([cache[1], split(self.v(x))], dim=2)
        out = F.scaled_dot_product_attention(split(self.q(x)), keys, values)
        return self.o(out.transpose(1, 2).reshape(b, q, width))


class _Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.attn = _Attention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width, bias=False), nn.ReLU(),
                                 nn.Linear(4 * width, width, bias=False))

    def forward(self, x, cache):
        x = x + self.attn(x, cache)
        return x + self.mlp(x)


class CachedDecoder(nn.Module):
    """One layer that takes its KV cache as an argument: a custom model in decode mode."""

    def __init__(self, width=16, heads=2):
        super().__init__()
        self.block = _Block(width, heads)
        self.width, self.heads = width, heads

    def forward(self, x, cache=None):
        if cache is None:  # prefill: an empty cache
            empty = x.new_zeros(x.shape[0], self.heads, 0, self.width // self.heads)
            cache = (empty, empty)
        return self.block(x, cache)


TINY = ModelSpec(16, 2, 8, 1, 64)


def _step_inputs(n, batch):
    return (torch.zeros(batch, 1, 16), (torch.zeros(batch, 2, n, 8), torch.zeros(batch, 2, n, 8)))


def test_generation_cost_is_the_sum_of_every_profiled_step():
    # examples/test_generation.py does the same for a prompt of 1,000 and 1,000 new tokens (999 profiles)
    model = CachedDecoder()
    prompt, new_tokens = 64, 64
    prefill = profile(model, prompt, inputs=lambda n, b: (torch.zeros(b, n, 16),), spec=TINY)
    steps = [profile(model, n, mode="decode", inputs=_step_inputs, spec=TINY)
             for n in range(prompt, prompt + new_tokens - 1)]  # the prefill yields the first new token
    assert all(step.deviation == 0 for step in [prefill, *steps])
    generation = formulas.generation_cost(TINY, prompt=prompt, new_tokens=new_tokens)
    for part in ("attention_core", "attention_proj", "ffn"):
        assert getattr(generation.total, part) == getattr(prefill, part) + sum(getattr(s, part) for s in steps)
    assert generation.steps == 63
    total = generation.total
    assert generation.attention_share == total.attention / total.total


def test_generation_cost_closed_form_1000_plus_1000():
    generation = formulas.generation_cost(TINY, prompt=1000, new_tokens=1000)
    steps = [formulas.decode_costs(TINY, n) for n in range(1000, 1999)]
    prefill = formulas.model_costs(TINY, 1000)
    for part in ("attention_core", "attention_proj", "ffn"):
        assert getattr(generation.total, part) == getattr(prefill, part) + sum(getattr(s, part) for s in steps)


def test_generation_cost_closed_form_with_windows():
    spec = ModelSpec(64, 4, 16, 3, 128, sliding_window=10, sliding_layers=2)
    for prompt, new_tokens in [(1, 1), (3, 30), (9, 2), (20, 7)]:
        generation = formulas.generation_cost(spec, prompt, new_tokens)
        steps = [formulas.decode_costs(spec, n) for n in range(prompt, prompt + new_tokens - 1)]
        prefill = formulas.model_costs(spec, prompt)
        assert generation.total.attention_core == prefill.attention_core + sum(s.attention_core for s in steps)
        assert generation.total.ffn == prefill.ffn + sum(s.ffn for s in steps)


# --- the profile's record, JSON, the marker --------------------------------------------------


def test_decode_profile_round_trips_and_prefill_json_keeps_its_form():
    step = profile(mistral_tiny, 20, mode="decode", new_tokens=2)
    data = step.to_dict()
    assert (data["mode"], data["new_tokens"], data["kv_cache_bytes"]) == ("decode", 2, step.kv_cache_bytes)
    # every layer attends to at most W = 16 keys: the core never reaches the FFN
    assert formulas.decode_crossover_n(step.spec) is None and data["crossover_n"] is None
    back = Profile.from_dict(json.loads(json.dumps(data)))
    assert back.formula == step.formula and back.kv_cache_bytes == step.kv_cache_bytes
    prefill = profile(mistral_tiny, 20).to_dict()
    assert "new_tokens" not in prefill and "kv_cache_bytes" not in prefill
    assert "sliding_window" not in prefill["spec"]  # the window changes decode steps only


def test_bad_decode_arguments():
    with pytest.raises(ProfileError, match="needs n="):
        profile(gpt2_tiny, mode="decode")
    with pytest.raises(ProfileError, match="new_tokens= is the query length"):
        profile(gpt2_tiny, 8, new_tokens=2)
    with pytest.raises(ProfileError, match="new_tokens must be a positive int"):
        profile(gpt2_tiny, 8, mode="decode", new_tokens=0)
    with pytest.raises(ProfileError, match="ran 1 query tokens"):
        profile(CachedDecoder(), 8, mode="decode", new_tokens=2, inputs=_step_inputs, spec=TINY)
    with pytest.raises(ProfileError, match="cannot build a KV cache"):
        profile(CachedDecoder(), 8, mode="decode")


@pytest.mark.parametrize("backend", ["fvcore", "torch"])
def test_a_decode_step_whose_model_never_gets_the_cache_is_an_error(backend):
    # one new token and no cache argument: the attention sees 1 key, not the 64 cached ones
    expected = (r"cache of n=64 tokens was asked for, but the attention saw 1 key\(s\), no "
                r"more than the step's own new_tokens=1: the model never received the cache")
    with pytest.raises(ProfileError, match=expected):
        profile(CachedDecoder(), 64, mode="decode", inputs=lambda n, b: (torch.zeros(b, 1, 16),), spec=TINY,
                backend=backend)
    # two new tokens and a cache of 3: the attention sees 5 keys, the cache holds 2 x [1, 2, 3, 8] floats
    def step_inputs(n, b):
        return {"x": torch.zeros(b, 2, 16), "cache": (torch.zeros(b, 2, n, 8), torch.zeros(b, 2, n, 8))}

    step = profile(CachedDecoder(), 3, mode="decode", new_tokens=2, backend=backend, spec=TINY, inputs=step_inputs)
    assert (step.attention_core, step.kv_cache_bytes, step.warnings) == (2 * 1 * 2 * 2 * 5 * 8, 2 * 2 * 3 * 8 * 4, ())
    # the same cache in a plain tuple argument is not read as one: the 0 bytes carry a warning
    step = profile(CachedDecoder(), 3, mode="decode", new_tokens=2, backend=backend, spec=TINY,
                   inputs=lambda n, b: tuple(step_inputs(n, b).values()))
    assert step.kv_cache_bytes == 0 and step.warnings == (CACHE_BYTES_WARNING.format(n=3),)


def test_user_cache_is_left_alone():
    x, (keys, values) = _step_inputs(8, 1)
    profile(CachedDecoder(), 8, mode="decode", inputs=(x, (keys, values)), spec=TINY)
    assert keys.shape == (1, 2, 8, 8) and keys.device.type == "cpu"


@pytest.mark.parametrize(("text", "size"), [("2 GiB", 2**31), ("512MiB", 2**29), ("2 GB", 2 * 10**9), (7, 7),
                                            ("0.001 GiB", 1_073_742), ("1.5 B", 2), ("2.5 B", 2), ("0.4 kB", 400)])
def test_parse_bytes(text, size):
    assert parse_bytes(text) == size


def test_cli_decode_table(capsys):
    assert main(["--preset", "llama-2-7b", "--decode", "--n", "4096"]) == 0
    out = capsys.readouterr().out
    assert "2,147,483,648" in out and "2 GiB" in out
    assert "the core overtakes the FFN at a context of 16,512 tokens" in out
    assert main(["--preset", "bert-base", "--decode", "--json", "--prompt", "1000", "--new-tokens", "1000"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["decode"]["crossover_n"] == 4 * 768
    expected = formulas.generation_cost(PRESETS["bert-base"], 1000, 1000)
    assert data["generation"]["total"]["attention"] == expected.total.attention


def test_fixture_takes_the_markers_decode_mode(pytester):
    pytester.makepyfile("""
        import pytest
        from transformers import GPT2Config, GPT2LMHeadModel

        def tiny():
            return GPT2LMHeadModel(GPT2Config(n_embd=64, n_head=2, n_layer=1, vocab_size=50257))

        @pytest.mark.attncost(n=64, mode="decode", new_tokens=2, kv_cache_max="10 KiB")
        def test_step(attncost):
            step = attncost.profile(tiny)
            assert (step.mode, step.n, step.new_tokens) == ("decode", 64, 2)
            assert step.kv_cache_bytes == 2 * 1 * 2 * 32 * 64 * 4  # 32 KiB: over the bound
    """)
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*kv_cache_bytes 32 KiB > kv_cache_max 10 KiB at n=64*"])


def test_decode_sweep_solves_the_crossover_from_the_counts(tmp_path):
    import pytest_attncost
    from pytest_attncost.plots import plot_decode

    sweep = pytest_attncost.decode_sweep(gpt2_tiny, [64, 256, 1024])
    # ungated FFN of width 4D: the core meets it at 4D = 512 keys
    assert sweep.crossover() == sweep.formula_crossover() == 4 * 128
    # every series answers the same way: methods for what is solved, iteration over what was measured
    assert [p.n for p in sweep] == sweep.lengths == [64, 256, 1024] and len(sweep) == 3
    assert sweep.to_dict()["lengths"] == [64, 256, 1024]
    windowed = pytest_attncost.decode_sweep(mistral_tiny, [8, 64])  # the window fills between them
    assert windowed.crossover() is None
    path = plot_decode(LLAMA_7B, [1024, 16384, 32768], tmp_path / "decode.png")
    assert path.stat().st_size > 0


TEXT = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96)


def test_an_encoder_is_not_given_a_decode_step():
    # BERT takes a cache argument and ran a "step" against it, reported with a KV cache size; its
    # attention is bidirectional, so no generation looks like that.
    from transformers import BertConfig, BertModel

    with pytest.raises(ProfileError, match=r"BertModel is not a decoder: its attention is bidirectional"):
        profile(lambda: BertModel(BertConfig(**TEXT)), 16, batch=2, mode="decode")


def test_causal_half_on_a_decode_step_says_it_is_not_applied():
    from transformers import LlamaConfig, LlamaModel

    b, h, n, q, d = 2, 4, 16, 4, 16
    p = profile(lambda: LlamaModel(LlamaConfig(**TEXT, num_key_value_heads=2)), n, batch=b, mode="decode",
                new_tokens=q, causal="half")
    assert p.attention_core == 3 * b * h * q * (n + q) * 2 * d  # every cached key, as the kernel runs it
    assert any(note.startswith("causal='half' does not apply to a decode step") for note in p.notes)
