"""Honest numbers in every mode (issue 12): train-mode scopes, causal masks, what torch runs,
exact einsum, quantized and scripted models, global hooks, a user's model left alone, and the
twin's LayerDrop; each as the counters record it and as profile() returns it.

The two models are written out here: a nanoGPT-style GPT (one fused ``c_attn``, sdpa with
``is_causal=True``, an ``MLP``) and the "Let's build GPT" lecture model (``Head`` with a
``tril`` buffer and ``masked_fill``, ``MultiHeadAttention``, ``FeedForward``, ``Block``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import warnings
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pytest_attncost import ModelSpec, ProfileError, clear_cache, formulas, profile
from pytest_attncost.counting import buffer_masks, count_forward, count_forward_torch, meta_twin, real_twin
from pytest_attncost.counting.twin import SCRIPTED_MESSAGE
from pytest_attncost.errors import CountError
from pytest_attncost.inputs import to_meta
from pytest_attncost.ops import MASK_CAUSAL, MASK_NONE, MASK_UNKNOWN

VOCAB, BLOCK, D, H, LAYERS = 64, 32, 32, 2, 2
BATCH, T = 2, 16
DH = D // H


# --- the two models ---------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(D, 3 * D)
        self.c_proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(D, 4 * D)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(D), CausalSelfAttention(), nn.LayerNorm(D), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, D), wpe=nn.Embedding(BLOCK, D),
            h=nn.ModuleList([NanoBlock() for _ in range(LAYERS)]), ln_f=nn.LayerNorm(D),
        ))
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT does

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class Head(nn.Module):
    """The lecture's head; ``mask`` picks how the causal (or other) mask is written."""

    def __init__(self, mask: str = "buffer") -> None:
        super().__init__()
        self.key = nn.Linear(D, DH, bias=False)
        self.query = nn.Linear(D, DH, bias=False)
        self.value = nn.Linear(D, DH, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(BLOCK, BLOCK)))
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, t, _ = x.shape
        k, q, v = self.key(x), self.query(x), self.value(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        if self.mask == "buffer":
            wei = wei.masked_fill(self.tril[:t, :t] == 0, float("-inf"))
        elif self.mask == "inline_tril":
            wei = wei.masked_fill(torch.tril(torch.ones(t, t, device=x.device)) == 0, float("-inf"))
        elif self.mask == "method_tril":
            wei = wei.masked_fill(torch.ones(t, t, device=x.device).tril() == 0, float("-inf"))
        elif self.mask == "triu_bool":
            wei = wei.masked_fill(torch.triu(torch.ones(t, t, device=x.device), diagonal=1).bool(), float("-inf"))
        elif self.mask == "additive":  # nn.Transformer.generate_square_subsequent_mask
            wei = wei + torch.triu(torch.full((t, t), float("-inf"), device=x.device), diagonal=1)
        elif self.mask == "anti_causal":  # masks the lower triangle: not causal
            wei = wei.masked_fill(self.tril[:t, :t] == 1, float("-inf"))
        elif self.mask == "shifted":  # a crop away from the origin: the form cannot be told
            wei = wei.masked_fill(self.tril[1 : t + 1, 1 : t + 1] == 0, float("-inf"))
        elif self.mask == "padding":
            wei = wei.masked_fill(x[:, None, :, 0] > 0, float("-inf"))
        wei = F.softmax(wei, dim=-1)
        return wei @ v


class MultiHeadAttention(nn.Module):
    def __init__(self, mask: str) -> None:
        super().__init__()
        self.heads = nn.ModuleList([Head(mask) for _ in range(H)])
        self.proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([head(x) for head in self.heads], dim=-1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 4 * D), nn.ReLU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    def __init__(self, mask: str) -> None:
        super().__init__()
        self.sa, self.ffwd = MultiHeadAttention(mask), FeedForward()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.sa(self.ln1(x))
        return x + self.ffwd(self.ln2(x))


class LectureGPT(nn.Module):
    def __init__(self, mask: str = "buffer") -> None:
        super().__init__()
        self.token_embedding_table = nn.Embedding(VOCAB, D)
        self.position_embedding_table = nn.Embedding(BLOCK, D)
        self.blocks = nn.Sequential(*[Block(mask) for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        tok = self.token_embedding_table(idx)
        pos = self.position_embedding_table(torch.arange(idx.shape[1], device=idx.device))
        return self.lm_head(self.ln_f(self.blocks(tok + pos)))


MODELS = {"nanogpt": NanoGPT, "lecture": LectureGPT}

# Written out by hand for B=2, T=16, d=32, h=2 (d_h=16), ffn 4d=128, vocab 64, two layers:
QKV = BATCH * T * D * 3 * D  # 98,304: c_attn, or key+query+value over both heads
CORE = 2 * BATCH * H * T * T * DH  # 32,768: QK^T [T, d_h] @ [d_h, T] and AV [T, T] @ [T, d_h], per head
OUT = BATCH * T * D * D  # 32,768
FFN = 2 * BATCH * T * D * 4 * D  # 262,144
LM_HEAD = BATCH * T * D * VOCAB  # 65,536
FORWARD = LAYERS * (QKV + CORE + OUT + FFN) + LM_HEAD  # 917,504 (no layer norms on the torch backend)


def _tokens() -> tuple[torch.Tensor, ...]:
    return to_meta((torch.zeros(BATCH, T, dtype=torch.long),))


def _per_scope(records) -> dict[str, int]:
    scopes: Counter[str] = Counter()
    for record in records:
        scopes[record.scope] += record.macs
    return dict(scopes)


PARTS = ("attention_core", "attention_proj", "ffn")
FORWARD_PARTS = {"attention_core": LAYERS * CORE, "attention_proj": LAYERS * (QKV + OUT), "ffn": LAYERS * FFN}
# causal: T(T+1)/2 query-key pairs per head instead of T^2, for QK^T and AV
HALF_CORE = LAYERS * 2 * BATCH * H * DH * T * (T + 1) // 2


def tokens(batch: int = BATCH, n: int = T) -> tuple[torch.Tensor]:
    return (torch.zeros(batch, n, dtype=torch.long),)


def parts(p) -> dict[str, int]:
    return {part: getattr(p, part) for part in PARTS}


# --- the forward split, as profile() returns it -----------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_split(name: str) -> None:
    p = profile(MODELS[name](), inputs=tokens())
    assert parts(p) == FORWARD_PARTS
    assert (p.n, p.batch, p.layers, p.warnings) == (T, BATCH, LAYERS, ())


# train = 3x forward per part, the same under two hash seeds, through profile(): see
# test_train_is_three_times_forward_in_every_scope below, and test_plugin's test_a_fresh_interpreter_..., whose
# subprocess counts the records and profile()'s parts again under another hash seed.


# --- 1. train mode: every backward product in the scope of its forward op --------------------

@functools.cache  # asked here and by test_plugin's fresh-interpreter test (in its process too): once a process
def train_counts() -> dict[str, Any]:
    """Each model's train-mode records and scopes, and profile()'s split of it: what must not depend on the
    hash seed (JSON-shaped, to compare with another process's)."""
    out = {}
    for name, cls in MODELS.items():
        model = cls()
        train = count_forward_torch(meta_twin(model), _tokens(), {}, train=True, buffer_masks=buffer_masks(model))
        # and as profile() splits it: the role of every backward product follows its forward op
        p = profile(cls(), inputs=(torch.zeros(BATCH, T, dtype=torch.long),), mode="train")
        out[name] = {"train": _per_scope(train.records), "by_module": train.by_module,
                     "records": [[r.op, r.scope, r.macs, r.origin, r.mask] for r in train.records],
                     "parts": [p.attention_core, p.attention_proj, p.ffn, p.backend, list(p.warnings)]}
    return json.loads(json.dumps(out, sort_keys=True))


def test_train_is_three_times_forward_in_every_scope():
    """The hash seed plays no part in these records either: test_plugin's test_a_fresh_interpreter_... counts
    them again under another seed (in the subprocess it starts anyway) and compares all of it."""
    for name, counts in train_counts().items():
        forward = _per_scope(count_forward_torch(meta_twin(MODELS[name]()), _tokens(), {}).records)
        train = counts["train"]
        assert sum(forward.values()) == FORWARD
        assert sum(train.values()) == 3 * FORWARD == 2_752_512
        assert counts["by_module"][""] == 3 * FORWARD
        assert set(train) == set(forward), name
        for scope, macs in forward.items():
            assert train[scope] == 3 * macs, (name, scope, train[scope], macs)
        # profile(): 3x the forward split per part, written out by hand (CORE, QKV, OUT, FFN above)
        assert counts["parts"] == [3 * LAYERS * CORE, 3 * LAYERS * (QKV + OUT), 3 * LAYERS * FFN, "torch", []]


@pytest.mark.parametrize("name", MODELS)
def test_backward_products_keep_their_forward_origin_and_mask(name):
    model = MODELS[name]()
    raw = count_forward_torch(meta_twin(model), _tokens(), {}, train=True, buffer_masks=buffer_masks(model))
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    for record in raw.records:
        if record.scope in linears:
            # x @ W^T, dL/dx = g @ W, dL/dW = g^T @ x: all three are products of that Linear's weight
            assert record.origin == "param" and record.mask == MASK_NONE, record
        else:
            # QK^T, AV and their four gradients: activations, under the causal mask
            assert record.op == "aten::bmm" and record.origin == "activation" and record.mask == MASK_CAUSAL, record
    cores = [r for r in raw.records if r.origin == "activation"]
    assert sum(r.macs for r in cores) == 3 * LAYERS * CORE


# --- 2. causal masks ---------------------------------------------------------------------------


def _cores(raw):
    return [r for r in raw.records if r.origin == "activation" and r.macs and r.op != "aten::layer_norm"]


@pytest.mark.parametrize("backend", ["fvcore", "torch"])
def test_nanogpt_is_causal_sdpa(backend):
    count = count_forward if backend == "fvcore" else count_forward_torch
    raw = count(meta_twin(NanoGPT()), _tokens(), {})
    cores = _cores(raw)
    assert cores and all(r.mask == MASK_CAUSAL for r in cores)
    assert sum(r.macs for r in cores) == LAYERS * CORE
    assert all(r.mask == MASK_NONE for r in raw.records if r.origin == "param")


@pytest.mark.parametrize("backend", ["fvcore", "torch"])
@pytest.mark.parametrize(
    ("form", "expected"),
    [("buffer", MASK_CAUSAL), ("inline_tril", MASK_CAUSAL), ("method_tril", MASK_CAUSAL),
     ("triu_bool", MASK_CAUSAL), ("additive", MASK_CAUSAL), ("anti_causal", MASK_UNKNOWN),
     ("shifted", MASK_UNKNOWN), ("padding", MASK_UNKNOWN), ("none", MASK_NONE)],
)
def test_mask_forms(backend, form, expected):
    model = LectureGPT(form)
    count = count_forward if backend == "fvcore" else count_forward_torch
    raw = count(meta_twin(model), _tokens(), {}, buffer_masks=buffer_masks(model))
    cores = _cores(raw)
    assert len(cores) == 2 * H * LAYERS  # QK^T and AV per head and layer
    assert [r.mask for r in cores] == [expected] * len(cores)
    assert sum(r.macs for r in cores) == LAYERS * CORE


@pytest.mark.parametrize("backend", ["fvcore", "torch"])
def test_a_mask_buffer_is_unknown_without_its_values(backend):
    """The twin's buffers are empty: without buffer_masks= the form of ``self.tril`` cannot be told."""
    count = count_forward if backend == "fvcore" else count_forward_torch
    raw = count(meta_twin(LectureGPT()), _tokens(), {})
    assert {r.mask for r in _cores(raw)} == {MASK_UNKNOWN}


def test_buffer_masks_reads_the_original():
    model = LectureGPT()
    assert buffer_masks(model) == {f"blocks.{i}.sa.heads.{j}.tril": (("lower", 0), 1.0)
                                   for i in range(LAYERS) for j in range(H)}
    assert buffer_masks(meta_twin(model)) == {}  # nothing to read on the meta device
    assert buffer_masks(NanoGPT()) == {}


@pytest.mark.parametrize(("kind", "expected"), [("bool", MASK_CAUSAL), ("float", MASK_CAUSAL),
                                              ("is_causal", MASK_CAUSAL), ("padding", MASK_UNKNOWN),
                                              ("none", MASK_NONE)])
def test_sdpa_attn_mask_forms(kind, expected):
    class Attention(nn.Module):
        def forward(self, q, k, v):
            n = q.shape[-2]
            if kind == "is_causal":
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if kind == "none":
                return F.scaled_dot_product_attention(q, k, v)
            if kind == "padding":  # True = attend; its form depends on values
                return F.scaled_dot_product_attention(q, k, v, attn_mask=k[..., :1].transpose(-2, -1) > 0)
            if kind == "bool":  # True = attend
                mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            else:
                mask = torch.zeros(n, n, device=q.device).masked_fill(
                    torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    qkv = to_meta(tuple(torch.zeros(BATCH, H, T, DH) for _ in range(3)))
    for count in (count_forward, count_forward_torch):
        raw = count(meta_twin(Attention()), qkv, {})
        assert {r.mask for r in raw.records} == {expected}, count.__name__
        assert raw.total == CORE


@pytest.mark.parametrize("name", sorted(MODELS))
def test_causal_half_is_applied_to_sdpa_and_tril_masks(name: str) -> None:
    p = profile(MODELS[name](), inputs=tokens(), causal="half")
    assert p.attention_core == HALF_CORE
    assert (p.causal_applied, p.attention_proj, p.ffn, p.warnings) == (True, LAYERS * (QKV + OUT), LAYERS * FFN, ())


@pytest.mark.parametrize("backend", ["fvcore", "torch"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_factorys_tril_buffer_halves_as_on_the_cpu(name: str, backend: str) -> None:
    # minGPT registers torch.tril(torch.ones(T, T)) as a buffer; built by a factory on the meta device it has
    # no values to read, so its form is followed while the factory builds it
    p = profile(MODELS[name], inputs=tokens(), causal="half", backend=backend)  # the class as the factory
    assert (p.attention_core, p.causal_applied, p.warnings) == (HALF_CORE, True, ())


def test_a_mask_of_unknown_form_is_counted_in_full_and_said() -> None:
    p = profile(LectureGPT("padding"), inputs=tokens(), causal="half")
    assert p.attention_core == LAYERS * CORE and not p.causal_applied
    masked = [w for w in p.warnings if "cannot tell" in w]
    # one warning per head module, each with its QK^T and AV: 2 x B x T x T x d_h
    assert len(masked) == LAYERS * H
    assert masked[0].startswith(f"blocks.0.sa.heads.0: causal='half' asked for, but the mask of "
                                f"{2 * BATCH * T * T * DH:,} core MAC")


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
                "fewer query-key pairs than the n(n+1)/2 counted; causal='kept' counts the pairs they keep",)
    assert p.warnings == (expected if warned else ())


def test_causal_half_leaves_bidirectional_attention_in_full_without_a_warning() -> None:
    # T5's encoder adds a position bias, BERT a padding mask: forms the plugin cannot read, on
    # attention that declares itself bidirectional (is_causal=False), where full is right.
    from transformers import BertConfig, BertModel, T5Config, T5Model

    b, h, n, d = 2, 4, 16, 16
    full, half = b * h * n * n * 2 * d, b * h * (n * (n + 1) // 2) * 2 * d
    t5 = profile(lambda: T5Model(T5Config(vocab_size=128, d_model=64, d_kv=d, d_ff=96, num_layers=2, num_heads=h,
                                          decoder_start_token_id=0)), n, batch=b, causal="half")
    mask = torch.ones(b, n, dtype=torch.long)
    mask[0, 10:] = 0
    bert = profile(BertModel(BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=h,
                                        intermediate_size=96)),
                   inputs=dict(input_ids=torch.zeros(b, n, dtype=torch.long), attention_mask=mask), causal="half")
    if int(importlib.metadata.version("transformers").split(".")[0]) < 5:
        # transformers 4's attention modules do not say is_causal, and T5 adds its mask to the scores in place
        # with its position bias: nothing is halved, and every core says why (never a silent full count)
        assert (t5.attention_core, bert.attention_core) == (6 * full, 3 * full)
        assert len(t5.warnings) == 6 and len(bert.warnings) == 3
        assert all("causal='half' asked for, but the mask" in w for w in t5.warnings + bert.warnings)
        return
    assert t5.attention_core == 2 * full + 2 * half + 2 * full  # encoder self, decoder self (halved), cross
    assert t5.warnings == ()
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
            "n(n+1)/2 counted; causal='kept' counts the pairs they keep") in p.warnings


def test_kept_pairs_refuses_a_window_of_no_size() -> None:
    for size in (0, -4, True, 2.5):
        with pytest.raises(ValueError, match="must be a positive int or None"):
            formulas.kept_pairs(16, window=size)
        with pytest.raises(ValueError, match="must be a positive int or None"):
            formulas.kept_pairs(16, chunk=size)
    with pytest.raises(ValueError, match="causal must be 'full', 'half' or 'kept', got 'halved'"):
        formulas.attention_core(ModelSpec(hidden=64, heads=4, head_dim=16, layers=2, ffn_dim=96), 16, causal="halved")


def test_local_layers_are_read_from_a_wrappers_text_config() -> None:
    from transformers import Gemma3Config, Gemma3TextConfig

    from pytest_attncost import families

    text = Gemma3TextConfig(num_hidden_layers=6, sliding_window=16)  # five local layers to one global
    wrapper = nn.Module()
    wrapper.config = Gemma3Config(text_config=text.to_dict())
    assert families.local_attention(wrapper) == [("window", 16, 5)]


def test_kept_pairs_by_hand() -> None:
    # 5 tokens, window 2: query 0 sees 1 key, queries 1..4 see 2; chunks of 2: 3 + 3 + 1
    assert [formulas.kept_pairs(5), formulas.kept_pairs(5, window=2), formulas.kept_pairs(5, chunk=2)] == [15, 9, 7]
    assert formulas.kept_pairs(4, window=8) == 10  # a window wider than the sequence keeps the triangle


def _kept_profile(config_class: str, model_class: str, n: int, **config: Any):
    import transformers

    build = getattr(transformers, model_class)
    settings = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
    return profile(lambda: build(getattr(transformers, config_class)(**{**settings, **config})), n, causal="kept")


def test_kept_on_mistral_counts_the_window_of_4096_at_16384_tokens() -> None:
    p = _kept_profile("MistralConfig", "MistralModel", 16_384, num_hidden_layers=2, sliding_window=4096)
    # queries 0..4095 see 1..4096 keys, the 12,288 after them 4096 each
    pairs = 4096 * 4097 // 2 + 12_288 * 4096
    assert pairs == 58_722_304
    assert p.attention_core == 2 * 4 * 2 * 16 * pairs  # layers x heads x (QK^T + AV) x head_dim
    assert (p.causal_applied, p.warnings, p.deviation) == (True, (), 0.0)
    assert "causal kept" in repr(p)


def test_kept_on_gemma2_counts_alternating_local_and_global_layers() -> None:
    p = _kept_profile("Gemma2Config", "Gemma2Model", 32, num_hidden_layers=4, head_dim=16, sliding_window=8)
    # layers 0 and 2 slide over 8 tokens (36 + 24 x 8 = 228 pairs), layers 1 and 3 keep the triangle (528)
    assert p.attention_core == 2 * 4 * 2 * 16 * 228 + 2 * 4 * 2 * 16 * 528
    assert (p.spec.sliding_window, p.spec.sliding_layers, p.warnings, p.deviation) == (8, 2, (), 0.0)


def test_kept_on_qwen2_counts_the_layers_past_max_window_layers() -> None:
    p = _kept_profile("Qwen2Config", "Qwen2Model", 32, num_hidden_layers=4, use_sliding_window=True, sliding_window=8,
                      max_window_layers=1)
    # layer 0 attends in full causal (528 pairs), layers 1-3 within the window (228)
    assert p.attention_core == 1 * 4 * 2 * 16 * 528 + 3 * 4 * 2 * 16 * 228
    assert (p.spec.sliding_layers, p.warnings, p.deviation) == (3, (), 0.0)
    without = _kept_profile("Qwen2Config", "Qwen2Model", 32, num_hidden_layers=4, use_sliding_window=False,
                            sliding_window=8)
    assert without.attention_core == 4 * 4 * 2 * 16 * 528 and without.spec.sliding_window is None


@pytest.mark.parametrize("backend", ["fvcore", "torch"])
def test_kept_on_gpt_neo_counts_its_local_layers(backend: str) -> None:
    from transformers import GPTNeoConfig, GPTNeoModel

    config = GPTNeoConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, window_size=8,
                          attention_types=[[["global", "local"], 1]], intermediate_size=96, eos_token_id=0,
                          bos_token_id=0)
    p = profile(lambda: GPTNeoModel(config), 32, causal="kept", backend=backend)
    # layer 0 global (528 pairs), layer 1 local: its mask keeps keys i-8 < j <= i (36 + 24 x 8 = 228 pairs)
    assert p.attention_core == 4 * 2 * 16 * 528 + 4 * 2 * 16 * 228
    assert (p.spec.sliding_window, p.spec.sliding_layers, p.warnings, p.deviation) == (8, 1, (), 0.0)


def test_kept_on_llama4_counts_each_chunk_and_says_there_is_no_formula() -> None:
    p = _kept_profile("Llama4TextConfig", "Llama4TextModel", 20, num_hidden_layers=4, head_dim=16,
                      intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1, attention_chunk_size=8,
                      intermediate_size=32)
    # three chunked layers (chunks of 8, 8, 4: 36 + 36 + 10 pairs), the fourth (no rope) full causal: 210
    assert p.attention_core == 3 * 4 * 2 * 16 * 82 + 4 * 2 * 16 * 210
    assert p.spec is None and p.warnings == ()
    assert any("not chunked attention" in note for note in p.notes)


# --- 3. the torch backend counts what it runs ----------------------------------------------------


def test_real_cpu_sdpa_kernel_is_counted_forward_and_backward():
    """On real CPU tensors sdpa runs _scaled_dot_product_flash_attention_for_cpu (no formula in torch)."""
    model = NanoGPT()
    tokens = (torch.zeros(BATCH, T, dtype=torch.long),)
    raw = count_forward_torch(real_twin(model), tokens, {}, fake=False)
    assert raw.total == FORWARD
    fused = [r for r in raw.records if r.op == "aten::_scaled_dot_product_flash_attention_for_cpu"]
    assert [r.macs for r in fused] == [CORE] * LAYERS and all(r.mask == MASK_CAUSAL for r in fused)
    assert not raw.unsupported_ops
    train = count_forward_torch(real_twin(model), tokens, {}, fake=False, train=True)
    backward = [r for r in train.records if r.op.endswith("_for_cpu_backward")]
    # torch's sdpa backward formula: recompute QK^T, then dV, dP, dQ, dK: 5 products of CORE / 2
    assert [r.macs for r in backward] == [5 * CORE // 2] * LAYERS
    assert all(r.scope.endswith(".attn") and r.mask == MASK_CAUSAL for r in backward)


@pytest.mark.parametrize("fake", [True, False])
@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason=f"torch {torch.__version__} has no _grouped_mm (2.8+)")
def test_grouped_mm_is_counted(fake):
    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4, 32, 64, dtype=torch.bfloat16))

        def forward(self, x, offs):
            return torch._grouped_mm(x, self.w, offs=offs)

    inputs = (torch.zeros(24, 32, dtype=torch.bfloat16), torch.tensor([6, 12, 18, 24], dtype=torch.int32))
    if fake:
        raw = count_forward_torch(meta_twin(Experts()), to_meta(inputs), {})
    else:
        raw = count_forward_torch(real_twin(Experts()), inputs, {}, fake=False)
    # 24 routed rows [24, 32], each through one expert's [32, 64]
    assert raw.total == 24 * 32 * 64 == 49_152
    assert [(r.op, r.origin) for r in raw.records] == [("aten::_grouped_mm", "param")]


def test_products_without_a_formula_are_reported():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bilinear = nn.Bilinear(8, 8, 4)

        def forward(self, a, b):
            return self.bilinear(a, b)

    raw = count_forward_torch(meta_twin(Pair()), to_meta((torch.zeros(2, 8), torch.zeros(2, 8))), {})
    assert raw.unsupported_ops == Counter({"aten::_trilinear": 1})


def test_mv_dot_addbmm_addr_have_formulas():
    class Small(nn.Module):
        def forward(self, m, v, a, b, c):
            return m @ v, v @ v, torch.addbmm(c, a, b), torch.addr(c, v[:5], v[:5])

    inputs = (torch.zeros(6, 5), torch.zeros(5), torch.zeros(3, 5, 4), torch.zeros(3, 4, 5), torch.zeros(5, 5))
    raw = count_forward_torch(meta_twin(Small()), to_meta(inputs), {})
    assert {r.op: r.macs for r in raw.records} == {
        "aten::mv": 6 * 5, "aten::dot": 5, "aten::addbmm": 3 * 5 * 4 * 5, "aten::addr": 5 * 5}
    assert not raw.unsupported_ops


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


# --- 4. exact einsum --------------------------------------------------------------------------------


def test_einsum_is_exact():
    class Contract(nn.Module):
        def forward(self, a, b):
            return torch.einsum("bij,bjk->bik", a, b)

    raw = count_forward(meta_twin(Contract()), to_meta((torch.zeros(4, 64, 256), torch.zeros(4, 256, 256))), {})
    assert raw.total == 4 * 64 * 256 * 256 == 16_777_216  # fvcore's own handle says 16,778,000
    assert [r.op for r in raw.records] == ["aten::einsum"]


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


class MultiQueryEinsum(nn.Module):
    """Six query heads over one shared key/value head, in einsum: torch runs it with the heads folded into the rows."""

    def __init__(self, width: int = 96, heads: int = 6, head_dim: int = 16) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q, self.kv = nn.Linear(width, heads * head_dim, bias=False), nn.Linear(width, 2 * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, width, bias=False)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)  # b h n d
        k, v = self.kv(x).split(self.head_dim, dim=-1)  # b n d: one head for every query head
        scores = torch.einsum("bhnd,bmd->bhnm", q, k).softmax(-1)
        y = torch.einsum("bhnm,bmd->bhnd", scores, v).transpose(1, 2).reshape(b, n, -1)
        x = x + self.o(y)
        return x + self.mlp(x)


@pytest.mark.parametrize("backend", ["fvcore", "torch"])
def test_einsum_multi_query_attention_reads_n_on_both_backends(backend: str) -> None:
    # the torch backend saw bmm's [b, h x n, m] and read h x n = 768 queries: it refused the model
    n, width, heads, head_dim = 128, 96, 6, 16
    p = profile(nn.Sequential(MultiQueryEinsum(), MultiQueryEinsum()), n, inputs=(torch.zeros(1, n, width),),
                backend=backend)
    assert (p.n, p.batch) == (n, 1)
    assert p.attention_core == 2 * 2 * heads * n * n * head_dim
    q, kv, out = n * width * heads * head_dim, n * width * 2 * head_dim, n * heads * head_dim * width
    assert p.attention_proj == 2 * (q + kv + out)
    assert (p.ffn, p.warnings) == (2 * 2 * n * width * 4 * width, ())


# --- 5. quantized models -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["fvcore", "torch"])
def test_dynamically_quantized_linears_are_counted_as_parameter_products(backend):
    model = LectureGPT()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates torch.ao.quantization
        quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    count = count_forward if backend == "fvcore" else count_forward_torch
    expected = count(meta_twin(model), _tokens(), {}, buffer_masks=buffer_masks(model))
    raw = count(meta_twin(quantized), _tokens(), {}, buffer_masks=buffer_masks(quantized))
    assert raw.total == expected.total
    assert _per_scope(raw.records) == _per_scope(expected.records)
    linears = {n for n, m in quantized.named_modules() if type(m).__name__ == "Linear"}
    assert linears and all(r.origin == "param" for r in raw.records if r.scope in linears)
    assert sum(r.macs for r in raw.records if r.scope in linears) == LAYERS * (QKV + OUT + FFN) + LM_HEAD
    assert isinstance(quantized.lm_head, torch.ao.nn.quantized.dynamic.Linear)  # left as it was


def test_quantized_model_counts_like_the_float_one() -> None:
    float_model = NanoGPT()
    quantized = torch.ao.quantization.quantize_dynamic(float_model, {nn.Linear}, dtype=torch.qint8)
    assert parts(profile(quantized, inputs=tokens())) == FORWARD_PARTS


# --- 6. scripted modules --------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch 2.13 deprecates torch.jit
@pytest.mark.parametrize("how", ["script", "trace", "nested"])
def test_scripted_modules_get_a_clear_error(how):
    model = LectureGPT()
    if how == "script":
        target = torch.jit.script(MLP())
    elif how == "trace":
        target = torch.jit.trace(model, torch.zeros(1, 4, dtype=torch.long))
    else:
        model.blocks[0].ffwd = torch.jit.script(FeedForward())
        target = model
    first_line = SCRIPTED_MESSAGE.split(":")[0].split("{what}")[1]
    with pytest.raises(CountError, match="TorchScript") as caught:
        meta_twin(target)
    assert first_line in str(caught.value) and "eager nn.Module" in str(caught.value)
    for count in (count_forward, count_forward_torch):
        with pytest.raises(CountError, match="TorchScript"):
            count(target, (torch.zeros(1, 4, dtype=torch.long),), {})
    if how == "nested":
        assert "LectureGPT.blocks.0.ffwd" in str(caught.value)


@pytest.mark.parametrize("how", ["script", "trace"])
def test_scripted_modules_get_a_clear_error_from_profile(how: str) -> None:
    mlp = MLP()
    scripted = torch.jit.script(mlp) if how == "script" else torch.jit.trace(mlp, torch.zeros(1, 4, D))
    with pytest.raises(ProfileError, match="TorchScript") as info:
        profile(scripted, inputs=(torch.zeros(1, 4, D),))
    assert "eager" in str(info.value)


# --- 7. the user's global hooks ---------------------------------------------------------------------


def test_global_hooks_do_not_fire_and_stay_registered():
    from torch.nn.modules import module as module_mod

    calls = []

    def raising(module, args, output=None):
        raise RuntimeError("the user's global hook ran")

    def counting(module, args):
        calls.append(type(module).__name__)

    handles = [module_mod.register_module_forward_hook(raising),
               module_mod.register_module_forward_pre_hook(counting),
               module_mod.register_module_full_backward_hook(lambda *a: calls.append("backward"))]
    try:
        before = [dict(d) for d in (module_mod._global_forward_hooks, module_mod._global_forward_pre_hooks,
                                    module_mod._global_backward_hooks)]
        model = LectureGPT()
        fv = count_forward(meta_twin(model), _tokens(), {})
        tr = count_forward_torch(meta_twin(model), _tokens(), {}, train=True)
        assert fv.total > 0 and tr.total == 3 * FORWARD
        assert calls == []
        after = [dict(d) for d in (module_mod._global_forward_hooks, module_mod._global_forward_pre_hooks,
                                   module_mod._global_backward_hooks)]
        assert after == before
        with pytest.raises(RuntimeError, match="the user's global hook ran"):
            nn.Identity()(torch.zeros(1))  # still registered, still the user's
        assert calls == ["Identity"]
    finally:
        for handle in handles:
            handle.remove()
    assert not module_mod._global_forward_hooks and not module_mod._global_forward_pre_hooks


def test_global_hooks_neither_fire_nor_break_the_count() -> None:
    calls = []

    def hook(module, args, output):
        calls.append(type(module).__name__)
        raise RuntimeError("the user's global hook")

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        p = profile(NanoGPT(), inputs=tokens())
    finally:
        handle.remove()
    assert parts(p) == FORWARD_PARTS and calls == []


# --- 8. a failing trace leaves the user's model as it was -------------------------------------------


class Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        if self.inner(x).sum().item() > 0:  # a value: meta tensors have none
            return x
        return -x


def _hook_state(model):
    return [(m.training, dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in model.modules()]


@pytest.mark.parametrize("backend", ["fvcore", "torch"])
def test_a_failing_count_leaves_the_model_untouched(backend):
    model = Fails().train()
    handle = model.inner.register_forward_hook(lambda *a: None)
    weight = model.inner.weight.detach().clone()
    before = _hook_state(model)
    count = count_forward if backend == "fvcore" else count_forward_torch
    with pytest.raises(CountError):
        count(meta_twin(model), to_meta((torch.zeros(2, 4),)), {})
    assert _hook_state(model) == before
    assert model.inner.weight.device.type == "cpu" and torch.equal(model.inner.weight, weight)
    handle.remove()


# --- 9. the twin counts with LayerDrop off; the user's model keeps it ---------------------------


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
