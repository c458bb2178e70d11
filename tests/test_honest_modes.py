"""Honest numbers in every mode, as profile() returns them (issue 12).

The nanoGPT-style and lecture-style models come from test_counting_modes; every expected
number is written out by hand below.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import test_counting_modes as models
from test_counting_modes import BATCH, CORE, D, DH, FFN, H, LAYERS, OUT, QKV, T
from pytest_attncost import ModelSpec, ProfileError, clear_cache, profile

PARTS = ("attention_core", "attention_proj", "ffn")
FORWARD = {"attention_core": LAYERS * CORE, "attention_proj": LAYERS * (QKV + OUT), "ffn": LAYERS * FFN}
# causal: T(T+1)/2 query-key pairs per head instead of T^2, for QK^T and AV
HALF_CORE = LAYERS * 2 * BATCH * H * DH * T * (T + 1) // 2


def tokens(batch: int = BATCH, n: int = T) -> tuple[torch.Tensor]:
    return (torch.zeros(batch, n, dtype=torch.long),)


def parts(p) -> dict[str, int]:
    return {part: getattr(p, part) for part in PARTS}


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_forward_split(name: str) -> None:
    p = profile(models.MODELS[name](), inputs=tokens())
    assert parts(p) == FORWARD
    assert (p.n, p.batch, p.layers, p.warnings) == (T, BATCH, LAYERS, ())


# train = 3x forward per part, the same under three hash seeds, through profile(): see
# test_counting_modes.test_train_scopes_are_the_same_under_every_hash_seed_and_three_times_forward,
# whose subprocesses check the records and profile()'s parts together.


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_causal_half_is_applied_to_sdpa_and_tril_masks(name: str) -> None:
    p = profile(models.MODELS[name](), inputs=tokens(), causal="half")
    assert p.attention_core == HALF_CORE
    assert (p.causal_applied, p.attention_proj, p.ffn, p.warnings) == (True, LAYERS * (QKV + OUT), LAYERS * FFN, ())


def test_a_mask_of_unknown_form_is_counted_in_full_and_said() -> None:
    p = profile(models.LectureGPT("padding"), inputs=tokens(), causal="half")
    assert p.attention_core == LAYERS * CORE and not p.causal_applied
    masked = [w for w in p.warnings if "cannot tell" in w]
    # one warning per head module, each with its QK^T and AV: 2 x B x T x T x d_h
    assert len(masked) == LAYERS * H
    assert masked[0].startswith(f"blocks.0.sa.heads.0: causal='half' asked for, but the mask of "
                                f"{2 * BATCH * T * T * DH:,} core MAC")


class Branchy(nn.Module):
    """Data-dependent control flow: fvcore and fake tensors cannot follow it; real tensors can."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, H, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(x, x, x, need_weights=False)[0]
        if x.sum() > 0:
            h = h + self.mlp(h)
        return h


@pytest.mark.parametrize("train", [False, True])
def test_fallback_runs_the_users_tensors(train: bool) -> None:
    model = Branchy().train(train)
    ones = profile(model, inputs=(torch.ones(1, T, D),))
    assert ones.fallback and ones.backend == "torch"
    # the branch is taken: the FFN counts; and the real CPU sdpa kernel's core counts too
    assert ones.ffn == 2 * T * D * 4 * D
    assert ones.attention_core == 2 * H * T * T * DH and ones.attention_proj == 4 * T * D * D
    zeros = profile(model, inputs=(torch.zeros(1, T, D),))
    assert zeros.ffn == 0  # the branch is not taken with these inputs: nothing to count


def test_quantized_model_counts_like_the_float_one() -> None:
    float_model = models.NanoGPT()
    quantized = torch.ao.quantization.quantize_dynamic(float_model, {nn.Linear}, dtype=torch.qint8)
    assert parts(profile(quantized, inputs=tokens())) == FORWARD


@pytest.mark.parametrize("how", ["script", "trace"])
def test_scripted_modules_get_a_clear_error(how: str) -> None:
    mlp = models.MLP()
    scripted = torch.jit.script(mlp) if how == "script" else torch.jit.trace(mlp, torch.zeros(1, 4, D))
    with pytest.raises(ProfileError, match="TorchScript") as info:
        profile(scripted, inputs=(torch.zeros(1, 4, D),))
    assert "eager" in str(info.value)


class Trimming(nn.Module):
    """Trims padding with .item(): with all-padding inputs, nothing is left to attend to."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, H, batch_first=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x[:, : int(mask.sum().item())]
        return self.attn(x, x, x, need_weights=False)[0]


def test_inputs_trimmed_to_nothing_are_an_error() -> None:
    with pytest.raises(ProfileError, match="0 tokens"):
        profile(Trimming(), inputs=(torch.zeros(1, T, D), torch.zeros(1, T)))
    kept = profile(Trimming(), inputs=(torch.zeros(1, T, D), torch.ones(1, 5)))
    assert kept.n == 5 and kept.attention_core == 2 * H * 5 * 5 * DH


class EinsumAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(256, 3 * 256), nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, 4, 64) for t in self.qkv(x).chunk(3, dim=-1))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k).softmax(-1)
        return self.out(torch.einsum("bhqk,bkhd->bqhd", scores, v).reshape(b, n, 256))


class EinsumBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = EinsumAttention()
        self.mlp = nn.Sequential(nn.Linear(256, 1024), nn.Linear(1024, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


def test_einsum_is_exact_to_the_mac() -> None:
    model = nn.Sequential(EinsumBlock())
    spec = ModelSpec(hidden=256, heads=4, head_dim=64, layers=1, ffn_dim=1024)
    p = profile(model, inputs=(torch.zeros(1, 128, 256),), spec=spec)
    assert p.attention_core == 2 * 4 * 128 * 128 * 64 == 8_388_608  # fvcore's own handle: 8,389,000
    assert (p.deviation, p.warnings) == (0, ())
    p.check_formula(rtol=0)


def test_global_hooks_neither_fire_nor_break_the_count() -> None:
    calls = []

    def hook(module, args, output):
        calls.append(type(module).__name__)
        raise RuntimeError("the user's global hook")

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        p = profile(models.NanoGPT(), inputs=tokens())
    finally:
        handle.remove()
    assert parts(p) == FORWARD and calls == []


class _Restating(nn.Module):
    """Attention that replaces its buffers on every call (as I-BERT's QuantAct does in training)."""

    def __init__(self, d: int = 16, stats: int = 8) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.stats = stats
        for i in range(stats):
            self.register_buffer(f"stat{i}", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.stats):
            setattr(self, f"stat{i}", x.detach().amax())  # the old buffer is freed here
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.o((q @ k.transpose(-1, -2)).softmax(-1) @ v)


class _RestatingLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.up, self.down = _Restating(), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.down(self.up(x).relu())


@pytest.mark.parametrize("backend", ["torch", "fvcore"])
def test_a_forward_that_replaces_its_buffers_counts_the_same_every_time(backend: str) -> None:
    # A freed buffer's id can be taken by an activation: the counter must not then take QK^T
    # for a product of model state (the split changed from run to run).
    model = nn.Sequential(_RestatingLayer(), _RestatingLayer())
    n = 8
    want = {"attention_core": 2 * (2 * n * n * 16), "attention_proj": 2 * (4 * n * 16 * 16),
            "ffn": 2 * (2 * n * 16 * 32)}
    for _ in range(12):
        clear_cache()
        p = profile(model, n, inputs=lambda n, b: (torch.randn(b, n, 16),), backend=backend)
        assert {part: getattr(p, part) for part in want} == want
        assert p.warnings == ()


class _Scores(torch.autograd.Function):
    """QK^T inside a custom autograd Function (as YOSO's cumulation is)."""

    @staticmethod
    def forward(ctx: object, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return q @ k.transpose(-1, -2)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> None:  # type: ignore[override]
        raise NotImplementedError


class _OpaqueAttention(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.o(_Scores.apply(q, k).softmax(-1) @ v)


class _OpaqueLayer(_RestatingLayer):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _OpaqueAttention()


def test_products_inside_a_custom_autograd_function_are_not_lost() -> None:
    # fvcore's trace holds the Function as one prim::PythonOp with no MACs: QK^T would vanish.
    model, n = nn.Sequential(_OpaqueLayer(), _OpaqueLayer()), 8
    p = profile(model, n, inputs=lambda n, b: (torch.zeros(b, n, 16),))
    assert (p.attention_core, p.attention_proj, p.ffn) == (2 * (2 * n * n * 16), 2 * (4 * n * 16 * 16),
                                                            2 * (2 * n * 16 * 32))
    hidden = 2 * n * n * 16  # QK^T in both layers
    assert p.backend == "torch" and p.fallback == (
        f"fvcore sees prim::PythonOp._Scores (custom torch.autograd.Function) as one opaque op each: the products "
        f"inside them ({hidden:,} MAC by the torch backend's count) are invisible to it")
    with pytest.raises(ProfileError, match=r"(?s)prim::PythonOp\._Scores.*invisible to it.*"
                                           r"Fix: count with backend='torch'"):
        profile(model, n, inputs=lambda n, b: (torch.zeros(b, n, 16),), fallback=False)


class _Gelu(torch.autograd.Function):
    """An activation in a custom Function (Bloom's GELU in training): no products inside."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return F.gelu(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> None:  # type: ignore[override]
        raise NotImplementedError


class _GeluLayer(_RestatingLayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.down(_Gelu.apply(self.up(x)))


def test_a_custom_function_without_products_keeps_fvcores_count() -> None:
    model, n = nn.Sequential(_GeluLayer(), _GeluLayer()), 8
    for fallback in (True, False):
        p = profile(model, n, inputs=lambda n, b: (torch.zeros(b, n, 16),), fallback=fallback)
        assert (p.backend, p.fallback, p.warnings) == ("fvcore", None, ())
        assert (p.attention_core, p.ffn) == (2 * (2 * n * n * 16), 2 * (2 * n * 16 * 32))


def test_layerdrop_never_decides_the_count_on_the_layer_or_in_the_config() -> None:
    # M2M-100 keeps LayerDrop on its stacks, wav2vec2 reads self.config.layerdrop in forward; both
    # skip whole layers at random in training mode (a model built from a config trains). The twin
    # counts with it off, says so, and the user's model keeps its setting.
    import transformers as T

    b, n, d, h, f = 2, 16, 64, 4, 96
    t = b * n
    m2m = T.M2M100Model(T.M2M100Config(vocab_size=128, d_model=d, encoder_layers=2, decoder_layers=2,
                                       encoder_attention_heads=h, decoder_attention_heads=h, encoder_ffn_dim=f,
                                       decoder_ffn_dim=f, encoder_layerdrop=0.5, decoder_layerdrop=0.5))
    for seed in range(3):
        clear_cache()
        torch.manual_seed(seed)
        p = profile(m2m, n, batch=b)
        self_core = b * h * n * n * 2 * (d // h)
        assert (p.attention_core, p.attention_proj, p.ffn) == (
            2 * self_core + 2 * 2 * self_core,  # encoder self; decoder self and cross
            2 * 4 * t * d * d + 2 * 8 * t * d * d,
            4 * 2 * t * d * f,
        )
        assert any("LayerDrop" in note and "encoder_layerdrop=0.5" in note for note in p.notes)
    assert m2m.encoder.layerdrop == 0.5 and m2m.training

    frames = 399  # 4000 samples through convolutions (10, stride 5) and (3, stride 2)
    config = dict(vocab_size=128, hidden_size=d, num_hidden_layers=2, num_attention_heads=h, intermediate_size=f,
                  conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                  num_conv_pos_embedding_groups=4, layerdrop=0.5)
    wav2vec2 = T.Wav2Vec2Model(T.Wav2Vec2Config(**config))
    for seed in range(3):
        clear_cache()
        torch.manual_seed(seed)
        p = profile(wav2vec2, inputs={"input_values": torch.zeros(b, 4000)})
        tokens = b * frames
        assert (p.n, p.attention_core, p.attention_proj, p.ffn) == (
            frames, 2 * b * h * frames * frames * 2 * (d // h), 2 * 4 * tokens * d * d, 2 * 2 * tokens * d * f)
        assert any("config.layerdrop=0.5" in note for note in p.notes)
    assert wav2vec2.config.layerdrop == 0.5


@pytest.mark.parametrize(("window", "warned"), [(8, True), (32, False)])
def test_causal_half_under_a_sliding_window_says_the_window_keeps_fewer_pairs(window: int, warned: bool) -> None:
    from transformers import MistralConfig, MistralModel

    b, h, n, d, layers = 2, 4, 16, 16, 3
    p = profile(lambda: MistralModel(MistralConfig(vocab_size=128, hidden_size=64, num_hidden_layers=layers,
                                                   num_attention_heads=h, num_key_value_heads=2,
                                                   intermediate_size=96, sliding_window=window)),
                n, batch=b, causal="half")
    assert p.attention_core == layers * b * h * (n * (n + 1) // 2) * 2 * d
    expected = (f"causal='half': {layers} layer(s) attend within a sliding window of {window} tokens, which keeps "
                "fewer query-key pairs than the n(n+1)/2 counted (window-aware accounting is not done)",)
    assert p.warnings == (expected if warned else ())


def test_causal_half_leaves_bidirectional_attention_in_full_without_a_warning() -> None:
    # T5's encoder adds a position bias, BERT a padding mask: forms the plugin cannot read, on
    # attention that declares itself bidirectional (is_causal=False), where full is right.
    from transformers import BertConfig, BertModel, T5Config, T5Model

    b, h, n, d = 2, 4, 16, 16
    full, half = b * h * n * n * 2 * d, b * h * (n * (n + 1) // 2) * 2 * d
    t5 = profile(lambda: T5Model(T5Config(vocab_size=128, d_model=64, d_kv=d, d_ff=96, num_layers=2, num_heads=h,
                                          decoder_start_token_id=0)), n, batch=b, causal="half")
    assert t5.attention_core == 2 * full + 2 * half + 2 * full  # encoder self, decoder self (halved), cross
    assert t5.warnings == ()
    mask = torch.ones(b, n, dtype=torch.long)
    mask[0, 10:] = 0
    bert = profile(BertModel(BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=h,
                                        intermediate_size=96)),
                   inputs=dict(input_ids=torch.zeros(b, n, dtype=torch.long), attention_mask=mask), causal="half")
    assert (bert.attention_core, bert.warnings) == (3 * full, ())


def test_causal_half_under_chunked_attention_says_the_chunks_keep_fewer_pairs() -> None:
    from transformers import Llama4TextConfig, Llama4TextModel

    config = Llama4TextConfig(vocab_size=128, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_local_experts=4, num_experts_per_tok=1, attention_chunk_size=8)
    b, h, n, d, layers = 2, 4, 16, 16, 4
    p = profile(lambda: Llama4TextModel(config), n, batch=b, causal="half")
    assert p.attention_core == layers * b * h * (n * (n + 1) // 2) * 2 * d
    assert ("causal='half': 3 layer(s) attend within chunks of 8 tokens, which keep fewer query-key pairs than the "
            "n(n+1)/2 counted (chunk-aware accounting is not done)") in p.warnings
