"""The article's cost model: exact integers, thresholds and identities."""

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_attncost import formulas
from pytest_attncost.families import spec_from_config
from pytest_attncost.formulas import ModelSpec

BERT_BASE = ModelSpec(hidden=768, heads=12, head_dim=64, layers=12, ffn_dim=3072)
BERT_LARGE = ModelSpec(hidden=1024, heads=16, head_dim=64, layers=24, ffn_dim=4096)

# ARTICLE.md, "Reference numbers, BERT-base, one layer, batch 1 (MACs)"
ARTICLE_ROWS = [
    (128, 327_155_712, 603_979_776, 0.3514, 0.0270, 0.0135),
    (512, 1_610_612_736, 2_415_919_104, 0.4000, 0.1000, 0.0875),
    (1536, 7_247_757_312, 7_247_757_312, 0.5000, 0.2500, 0.2396),
    (4608, 43_486_543_872, 21_743_271_936, 0.6667, 0.5000, 0.4931),
]


@pytest.mark.parametrize(("n", "sa", "ffn", "share", "quad", "saving"), ARTICLE_ROWS)
def test_article_table(n, sa, ffn, share, quad, saving):
    costs = formulas.layer_costs(BERT_BASE, n)
    assert costs.attention == sa
    assert costs.ffn == ffn
    assert round(costs.attention / costs.total, 4) == share
    assert round(costs.attention_core / costs.total, 4) == quad
    assert round(formulas.linear_attention_saving(BERT_BASE, n), 4) == saving


def test_bert_base_parts_at_512():
    # core 2 n^2 hd = 2 * 512^2 * 768; proj 4 n (hd)^2 = 4 * 512 * 768^2; ffn 8 n (hd)^2
    assert formulas.attention_core(BERT_BASE, 512) == 402_653_184
    assert formulas.attention_proj(BERT_BASE, 512) == 1_207_959_552
    assert formulas.ffn(BERT_BASE, 512) == 2_415_919_104
    # twelve layers: 12 * (1_610_612_736 + 2_415_919_104) = 48_318_382_080 (FIELD-NOTES)
    assert formulas.model_costs(BERT_BASE, 512).total == 48_318_382_080


def test_batch_multiplies_everything():
    one, three = formulas.model_costs(BERT_BASE, 256), formulas.model_costs(BERT_BASE, 256, batch=3)
    assert three == one.scaled(3)


@pytest.mark.parametrize(("spec", "cross", "quad"), [(BERT_BASE, 1536, 4608), (BERT_LARGE, 2048, 6144)])
def test_thresholds(spec, cross, quad):
    assert formulas.crossover_n(spec) == Fraction(cross)
    assert formulas.quadratic_n(spec) == Fraction(quad)


def test_gqa_and_gated_thresholds():
    # Mistral-7B: D=4096, h=32, g=8, d=128, f=14336 gated.
    mistral = ModelSpec(hidden=4096, heads=32, head_dim=128, layers=32, ffn_dim=14336, kv_heads=8, gated=True)
    p = 2 * 4096 * 4096 + 2 * 4096 * 8 * 128  # Q, O plus K, V per token
    f = 3 * 4096 * 14336
    assert formulas.crossover_n(mistral) == Fraction(f - p, 2 * 4096)
    assert formulas.quadratic_n(mistral) == Fraction(f + p, 2 * 4096)


def test_no_crossover_when_ffn_is_small():
    spec = ModelSpec(hidden=64, heads=1, head_dim=64, layers=1, ffn_dim=0)
    assert formulas.crossover_n(spec) is None


def test_t5_style_head_size():
    # D=512, h=8, d_kv=32 (h*d_kv != D): Q, O cost n*D*h*d_kv each, K, V n*D*g*d_kv each
    spec = ModelSpec(hidden=512, heads=8, head_dim=32, layers=1, ffn_dim=2048)
    assert formulas.attention_proj(spec, 10) == 4 * 10 * 512 * 8 * 32
    assert formulas.attention_core(spec, 10) == 2 * 10 * 10 * 8 * 32


def test_cross_attention():
    spec = ModelSpec(hidden=128, heads=2, head_dim=64, layers=1, ffn_dim=512, cross_attention=True)
    n, m = 10, 30
    # self: 4 n D^2 and 2 n^2 hd; cross: Q, O on n (2 n D^2), K, V on m (2 m D^2), core 2 n m hd
    assert formulas.attention_proj(spec, n, m=m) == 4 * n * 128**2 + 2 * n * 128**2 + 2 * m * 128**2
    assert formulas.attention_core(spec, n, m=m) == 2 * n * n * 128 + 2 * n * m * 128


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, None])
def test_lengths_are_checked(bad):
    with pytest.raises(ValueError, match="n must be a positive int"):
        formulas.attention_core(BERT_BASE, bad)


def test_spec_is_validated():
    with pytest.raises(ValueError, match="heads must be a positive int"):
        ModelSpec(hidden=768, heads=0, head_dim=64, layers=12, ffn_dim=3072)


def test_from_config_families():
    transformers = pytest.importorskip("transformers")
    assert spec_from_config(transformers.BertConfig()) == BERT_BASE
    gpt2 = spec_from_config(transformers.GPT2Config())
    assert (gpt2.hidden, gpt2.heads, gpt2.ffn_dim, gpt2.layers) == (768, 12, 3072, 12)
    llama = spec_from_config(transformers.LlamaConfig(num_key_value_heads=8))
    assert llama.gated and llama.kv_heads == 8 and llama.ffn_dim == 11008
    t5 = spec_from_config(transformers.T5Config(d_model=512, d_kv=32, num_heads=8, d_ff=2048, num_layers=6))
    assert (t5.hidden, t5.head_dim, t5.heads, t5.ffn_dim, t5.layers, t5.gated) == (512, 32, 8, 2048, 6, False)
    xlnet = spec_from_config(transformers.XLNetConfig())  # XLNet-large: its FFN is d_inner, not 4 x d_model
    assert (xlnet.hidden, xlnet.heads, xlnet.head_dim, xlnet.ffn_dim, xlnet.layers) == (1024, 16, 64, 4096, 24)
    assert spec_from_config(transformers.XLNetConfig(d_model=64, n_head=4, d_inner=96)).ffn_dim == 96
    doge = spec_from_config(transformers.DogeConfig())  # 16,384 experts configured, but is_moe=False: a gated MLP
    assert (doge.experts, doge.top_k, doge.gated, doge.ffn_dim) == (0, 0, True, 2048)
    gemma3n = spec_from_config(transformers.Gemma3nTextConfig())  # a width per layer, all alike
    assert (gemma3n.hidden, gemma3n.layers, gemma3n.ffn_dim, gemma3n.gated) == (2048, 35, 16384, True)
    with pytest.raises(ValueError, match=r"per-layer FFN widths \(\[96, 128\]\).*pass spec="):
        spec_from_config(transformers.Gemma3nTextConfig(
            num_hidden_layers=2, intermediate_size=[96, 128], layer_types=["sliding_attention", "full_attention"],
            num_kv_shared_layers=0, activation_sparsity_pattern=[0.0, 0.0]))


specs = st.builds(
    ModelSpec,
    hidden=st.integers(1, 4096),
    heads=st.integers(1, 64),
    head_dim=st.integers(1, 256),
    layers=st.integers(1, 96),
    ffn_dim=st.integers(0, 32768),
    kv_heads=st.one_of(st.none(), st.integers(1, 64)),
    gated=st.booleans(),
)


@given(specs)
def test_sa_equals_ffn_at_crossover(spec):
    n = formulas.crossover_n(spec)
    per_token_gap = spec.ffn_per_token - spec.proj_per_token
    if n is None:
        assert per_token_gap <= 0
        return
    # SA(n)/n = P + 2 n h d must equal F/n = F at the crossover, exactly
    assert spec.proj_per_token + 2 * n * spec.heads * spec.head_dim == spec.ffn_per_token


@given(specs)
def test_quadratic_equals_linear_at_quadratic_n(spec):
    n = formulas.quadratic_n(spec)
    assert n is not None
    assert 2 * n * spec.heads * spec.head_dim == spec.proj_per_token + spec.ffn_per_token


@given(st.integers(1, 256), st.integers(1, 64), st.integers(1, 10_000), st.integers(1, 8))
def test_generalised_reduces_to_article(heads, d, n, batch):
    hd = heads * d
    spec = ModelSpec(hidden=hd, heads=heads, head_dim=d, layers=1, ffn_dim=4 * hd)
    assert formulas.attention_proj(spec, n, batch) == batch * 4 * n * hd**2
    assert formulas.attention_core(spec, n, batch) == batch * 2 * n * n * hd
    assert formulas.ffn(spec, n, batch) == batch * 8 * n * hd**2
    assert formulas.crossover_n(spec) == 2 * hd
    assert formulas.quadratic_n(spec) == 6 * hd


@given(specs, st.integers(1, 100_000))
def test_saving_is_a_fraction(spec, n):
    saving = formulas.linear_attention_saving(spec, n)
    assert 0.0 <= saving <= 1.0
