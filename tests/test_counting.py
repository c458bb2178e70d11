"""Counts against independently computed integers, on every architecture the plugin knows."""

import copy

import pytest
import torch
from torch import nn

import pytest_attncost
import tiny_models as tm
from pytest_attncost import ModelSpec, ProfileError, profile

D, H, DH, F, L = tm.HIDDEN, tm.HEADS, tm.HEAD_DIM, tm.FFN, tm.LAYERS


def expected(n, b, *, gated=False, g=H, cross_m=None, layers=L, ffn=F):
    """(core, proj, ffn) written out from the article's arithmetic, independently of formulas.py."""
    core = layers * b * 2 * n * n * H * DH  # QK^T and AV: [n, d] @ [d, n], [n, n] @ [n, d] per head
    proj = layers * b * n * (2 * D * H * DH + 2 * D * g * DH)  # Q, O: D -> hd; K, V: D -> gd
    if cross_m is not None:
        core += layers * b * 2 * n * cross_m * H * DH
        proj += layers * b * (2 * n * D * D + 2 * cross_m * D * D)
    ffn_macs = layers * b * n * D * ffn * (3 if gated else 2)
    return core, proj, ffn_macs


def _hf(name, impl):
    import transformers as t

    common = dict(hidden_size=D, num_attention_heads=H, num_hidden_layers=L, intermediate_size=F,
                  attn_implementation=impl)
    if name == "bert":
        return t.BertModel(t.BertConfig(**common)), {}
    if name == "roberta":
        return t.RobertaModel(t.RobertaConfig(**common)), {}
    if name == "distilbert":
        return t.DistilBertModel(t.DistilBertConfig(dim=D, n_heads=H, n_layers=L, hidden_dim=F,
                                                    attn_implementation=impl)), {}
    if name == "gpt2":
        return t.GPT2Model(t.GPT2Config(n_embd=D, n_head=H, n_layer=L, n_inner=F, attn_implementation=impl)), {}
    if name == "llama":
        return t.LlamaModel(t.LlamaConfig(**common)), {"gated": True}
    if name == "mistral":
        return t.MistralModel(t.MistralConfig(**common, num_key_value_heads=1)), {"gated": True, "g": 1}
    if name == "qwen2":
        return t.Qwen2Model(t.Qwen2Config(**common, num_key_value_heads=1)), {"gated": True, "g": 1}
    if name == "t5":
        return t.T5EncoderModel(t.T5Config(d_model=D, num_heads=H, num_layers=L, d_ff=F, d_kv=DH,
                                           attn_implementation=impl)), {}
    raise AssertionError(name)


HF_TEXT = ["bert", "roberta", "distilbert", "gpt2", "llama", "mistral", "qwen2", "t5"]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", HF_TEXT)
def test_transformers_exact(name, impl):
    model, shape = _hf(name, impl)
    for n, batch in ((128, 1), (512, 2), (2048, 1)):  # every length, both batches: the terms scale apart
        result = profile(model, n, batch=batch)
        assert (result.attention_core, result.attention_proj, result.ffn) == expected(n, batch, **shape), (n, batch)
        assert result.deviation == 0
        assert result.total == result.attention + result.ffn + result.other
        assert result.unsupported_ops.get("aten::scaled_dot_product_attention") is None


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_vit_exact(impl):
    from transformers import ViTConfig, ViTModel

    for image, patches in ((64, 16), (128, 64), (256, 256)):
        model = ViTModel(ViTConfig(hidden_size=D, num_attention_heads=H, num_hidden_layers=L, intermediate_size=F,
                                   image_size=image, patch_size=16, attn_implementation=impl))
        for batch in (1, 2):
            result = profile(model, batch=batch)
            n = patches + 1  # the [CLS] token
            assert result.n == n
            assert (result.attention_core, result.attention_proj, result.ffn) == expected(n, batch)
            # the patch embedding (a conv) is counted as other: 3 * 16 * 16 inputs -> D per patch
            assert result.by_module["embeddings.patch_embeddings"] == batch * patches * 3 * 16 * 16 * D


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_torch_modules_exact(train, batch_first):
    encoder = tm.torch_encoder(batch_first).train(train)
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(D, H, F, batch_first=batch_first), L).train(train)
    mha = nn.MultiheadAttention(D, H, batch_first=batch_first).train(train)
    for n in (128, 512, 2048):
        for batch in (1, 2):
            with torch.no_grad():
                enc = profile(encoder, n, batch=batch)
                dec = profile(decoder, n, batch=batch)
                attn = profile(mha, n, batch=batch)
            assert (enc.attention_core, enc.attention_proj, enc.ffn) == expected(n, batch)
            assert (dec.attention_core, dec.attention_proj, dec.ffn) == expected(n, batch, cross_m=n)
            assert dec.m == n
            assert (attn.attention_core, attn.attention_proj, attn.ffn) == expected(n, batch, layers=1, ffn=0)
            assert enc.deviation == dec.deviation == attn.deviation == 0


def test_fast_path_is_counted_like_the_plain_path():
    # eval + no_grad would take the fused kernels that hide attention in one op
    encoder = tm.torch_encoder().eval()
    with torch.no_grad():
        result = profile(encoder, 64)
    assert "aten::_transformer_encoder_layer_fwd" not in result.unsupported_ops
    assert (result.attention_core, result.attention_proj, result.ffn) == expected(64, 1)
    assert torch.backends.mha.get_fastpath_enabled()  # restored


def test_cross_attention_memory_length():
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(D, H, F, batch_first=True), L)
    tgt, memory = torch.zeros(2, 40, D), torch.zeros(2, 90, D)
    result = profile(decoder, inputs=(tgt, memory))
    assert (result.n, result.m, result.batch) == (40, 90, 2)
    assert (result.attention_core, result.attention_proj, result.ffn) == expected(40, 2, cross_m=90)
    assert result.deviation == 0


def test_bert_base_reproduces_the_article():
    from transformers import BertConfig, BertModel

    rows = [
        (128, 327_155_712, 603_979_776, 0.3514, 0.0270),
        (512, 1_610_612_736, 2_415_919_104, 0.4000, 0.1000),
        (1536, 7_247_757_312, 7_247_757_312, 0.5000, 0.2500),
        (4608, 43_486_543_872, 21_743_271_936, 0.6667, 0.5000),
    ]
    for n, sa, ffn, share, quad in rows:
        # past max_position_embeddings (512) too: explicit position ids on the meta device
        result = profile(lambda: BertModel(BertConfig()), n)
        assert result.layers == 12
        assert result.attention == 12 * sa
        assert result.ffn == 12 * ffn
        assert round(result.attention_share, 4) == share
        assert round(result.quadratic_share, 4) == quad
    assert profile(lambda: BertModel(BertConfig()), 512).attention + profile(
        lambda: BertModel(BertConfig()), 512).ffn == 48_318_382_080


def test_hand_written_attention_with_roles():
    model = tm.HandWritten()
    x = torch.zeros(1, 96, D)
    result = profile(model, inputs=(x,), roles=tm.HAND_ROLES, name="hand")
    # x @ W (a parameter) is a projection; q @ k^T and scores @ v are the core
    assert (result.attention_core, result.attention_proj, result.ffn) == expected(96, 1)
    assert result.n == 96 and result.name == "hand"
    assert result.spec is None and result.deviation is None
    spec = ModelSpec(hidden=D, heads=H, head_dim=DH, layers=L, ffn_dim=F)
    assert profile(model, inputs=(x,), roles=tm.HAND_ROLES, spec=spec).deviation == 0


def test_mlp_without_attention_needs_roles():
    with pytest.raises(ProfileError, match=r"neither attention nor an FFN.*roles=\{'attention'"):
        profile(tm.PlainMLP(), 16, inputs=(torch.zeros(1, 16, D),))
    result = profile(tm.PlainMLP(), 16, inputs=(torch.zeros(1, 16, D),), roles={"ffn": ["up", "down"]})
    assert result.ffn == 2 * 16 * D * F and result.attention == 0 and result.attention_share == 0.0


def test_bare_multihead_attention_has_no_ffn():
    result = profile(nn.MultiheadAttention(D, H, batch_first=True), 32)
    assert result.ffn == 0 and result.attention_share == 1.0


def test_rotary_buffer_product_is_other():
    class Rotary(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.ones(DH // 2, 1))
            self.attn = tm.HandWrittenAttention()

        def forward(self, x, positions):
            angles = self.inv_freq @ positions  # a buffer times activations: not attention
            return self.attn(x) + angles.sum()

    model = Rotary()
    roles = {"attention": ["attn", "*"]}
    result = profile(model, inputs=(torch.zeros(1, 8, D), torch.zeros(1, 8)), roles=roles)
    assert result.other == (DH // 2) * 8


def test_factory_builds_on_meta():
    built = []

    def factory():
        model = tm.bert_like()
        built.append(next(model.parameters()).device.type)
        return model

    profile(factory, 64)
    assert built == ["meta"]


def _snapshot(model):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {name: m.training for name, m in model.named_modules()},
        {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in model.named_modules()},
        sorted(vars(model)),
        {k: (v.device, v.dtype) for k, v in model.state_dict().items()},
    )


def _assert_same(model, before):
    state, flags, hooks, attrs, placement = _snapshot(model)
    assert flags == before[1] and hooks == before[2] and attrs == before[3] and placement == before[4]
    assert state.keys() == before[0].keys()
    for key, value in state.items():
        assert torch.equal(value, before[0][key]), key


def test_model_is_untouched(monkeypatch):
    model = tm.bert_like().train()
    model.encoder.layer[0].eval()  # mixed flags must survive
    calls = []
    model.encoder.register_forward_hook(lambda *args: calls.append(1))
    before = _snapshot(model)
    rng = torch.random.get_rng_state()

    profile(model, 64)
    _assert_same(model, before)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert calls == []  # the user's hook never fired for the count

    # a failure mid-count (inside the trace, after several layers ran) changes nothing either
    import pytest_attncost.counting as counting

    def explode(inputs, outputs):
        raise RuntimeError("forced failure")

    monkeypatch.setitem(counting.jit.EXTRA_HANDLES, "aten::scaled_dot_product_attention", explode)
    pytest_attncost.api.clear_cache()  # the same call is cached: count it again
    with pytest.raises(ProfileError, match="forced failure"):
        profile(model, 64, fallback=False)
    monkeypatch.undo()
    bad_inputs = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "attention_mask": torch.ones(1, 3)}
    with pytest.raises(ProfileError, match="could not trace"):
        profile(model, inputs=bad_inputs, fallback=False)
    _assert_same(model, before)
    assert torch.equal(torch.random.get_rng_state(), rng)

    model(torch.zeros(1, 4, dtype=torch.long))
    assert calls == [1]  # the user's hook fires exactly once on a real forward


def test_cache_hits_and_never_goes_stale():
    from pytest_attncost import api

    model = tm.bert_like()
    first = profile(model, 96)
    assert profile(model, 96) is first  # served from the cache
    assert profile(model, 96, batch=2) is not first
    model.encoder.layer = model.encoder.layer[:1]  # one layer fewer: a new structure
    fewer = profile(model, 96)
    assert fewer.attention_core == first.attention_core // 2
    model.train(not model.training)
    assert profile(model, 96) is not fewer  # flags are part of the key
    callable_inputs = profile(tm.torch_encoder(), 16, inputs=lambda n, b: (torch.zeros(b, n, D),))
    assert api.cache_key(tm.torch_encoder(), 16, 1, False, lambda n, b: (), None, None, "x") is None
    assert callable_inputs.n == 16


def test_half_and_meta_models():
    half = tm.torch_encoder().half()
    assert profile(half, 32).deviation == 0
    assert next(half.parameters()).dtype == torch.float16
    with torch.device("meta"):
        meta = tm.bert_like()
    assert profile(meta, 32).deviation == 0


def test_wrapped_models_and_reused_layers():
    encoder = tm.torch_encoder()
    assert profile(nn.DataParallel(encoder), 32).attention_core == expected(32, 1)[0]

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(D, H, F, batch_first=True)

        def forward(self, x):
            return self.layer(self.layer(x))

    twice = profile(Twice(), 32, inputs=(torch.zeros(1, 32, D),))
    assert (twice.attention_core, twice.attention_proj, twice.ffn) == expected(32, 1)


def test_unsupported_ops_are_kept():
    result = profile(tm.bert_like(), 32)
    assert result.unsupported_ops["aten::gelu"] == L
    assert result.skipped_matmul_ops == {}


def test_model_returning_nothing_is_still_counted():
    class Silent(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(D, H, batch_first=True)

        def forward(self, x):
            self.attn(x, x, x)
            return None

    result = profile(Silent(), inputs=(torch.zeros(1, 16, D),))
    assert result.attention_core == expected(16, 1, layers=1)[0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": "bert"}, "takes an nn.Module or a zero-argument factory returning one, got str"),
        ({"model": lambda: 3}, "returned int, not an nn.Module"),
        ({"n": 0}, "n must be a positive int, got 0"),
        ({"n": -5}, "n must be a positive int"),
        ({"n": True}, "n must be a positive int, got True"),
        ({"batch": 0}, "batch must be a positive int, got 0"),
        ({"inputs": 3.5}, "inputs= got float; pass inputs= as a tuple"),
        ({"roles": {"attention": ["nope*"]}}, "glob 'nope\\*' matches no module; module names are"),
        ({"roles": {"mlp": ["x"]}}, "unknown role 'mlp'"),
        ({"spec": {"hidden": 1}}, "spec= must be a pytest_attncost.ModelSpec"),
    ],
)
def test_bad_input(kwargs, message):
    args = {"model": tm.torch_encoder(), "n": 16, **kwargs}
    with pytest.raises(ProfileError, match=message):
        profile(args.pop("model"), args.pop("n"), **args)


def test_unknown_model_needs_inputs():
    with pytest.raises(ProfileError, match="cannot guess the inputs of HandWritten; pass inputs= as a tuple"):
        profile(tm.HandWritten(), 16)


def test_n_must_agree_with_inputs():
    with pytest.raises(ProfileError, match="n=32 was asked for, but the attention saw 16 tokens"):
        profile(tm.torch_encoder(), 32, inputs=(torch.zeros(1, 16, D),))


def test_untraceable_model_gives_the_tracers_reason():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(D, H, batch_first=True)

        def forward(self, x):
            if x.sum() > 0:  # needs values: meta tensors have none
                return self.attn(x, x, x)[0]
            return x

    with pytest.raises(ProfileError, match=r"could not trace DataDependent on the meta device: .*\nFix: make forward"):
        profile(DataDependent(), inputs=(torch.zeros(1, 16, D),), fallback=False)


def test_callable_inputs_and_dict_inputs():
    encoder = tm.torch_encoder()
    result = profile(encoder, 24, batch=3, inputs=lambda n, b: (torch.zeros(b, n, D),))
    assert (result.n, result.batch) == (24, 3)
    assert result.attention_core == expected(24, 3)[0]
    bert = tm.bert_like()
    result = profile(bert, inputs={"input_ids": torch.zeros(2, 40, dtype=torch.long)})
    assert (result.n, result.batch) == (40, 2)


def test_check_formula_message():
    result = profile(tm.torch_encoder(), 16)
    result.check_formula(rtol=0)
    wrong = copy.replace(result, ffn=result.ffn + 1) if hasattr(copy, "replace") else None
    if wrong is None:
        import dataclasses

        wrong = dataclasses.replace(result, ffn=result.ffn + 1)
    with pytest.raises(AssertionError, match=r"(?s)deviates from the formula.*ffn\s+4,194,305\s+4,194,304"):
        wrong.check_formula(rtol=0)


def test_to_dict_round_trip_is_json_safe():
    import json

    result = profile(tm.bert_like(), 32)
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert pytest_attncost.Profile.from_dict(data) == result
    assert data["formula"]["attention_core"] == expected(32, 1)[0]
