"""Roles from structure: models nobody anticipated are split right, or say why they cannot be.

Each model is written here; each expected split is worked out by hand in the test.
"""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch
from torch import nn
from torch.nn import functional as F

from pytest_attncost import ModelSpec, ProfileError, api, families, formulas, parts, pipeline, profile, roles
from pytest_attncost.families import spec_from_config

D, H, FF, L = 64, 4, 128, 2


def lin(tokens: int, fan_in: int, fan_out: int) -> int:
    return tokens * fan_in * fan_out


# --- models whose FFN no class name announces -------------------------------------------------


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, H, D // H).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, D))


class SequentialBlock(nn.Module):
    """The FFN is an anonymous nn.Sequential named ``body``."""

    def __init__(self) -> None:
        super().__init__()
        self.mixer = SelfAttention()
        self.body = nn.Sequential(nn.Linear(D, FF), nn.GELU(), nn.Linear(FF, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(x)
        return x + self.body(x)


class AttentionPooling(nn.Module):
    """A learned query attends over the layers' output: attention, but outside the layers."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(1, 1, D))
        self.attn = nn.MultiheadAttention(D, H, batch_first=True)
        self.proj = nn.Linear(D, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled, _ = self.attn(self.query.expand(x.shape[0], -1, -1), x, x, need_weights=False)
        return self.proj(pooled)


class Encoder(nn.Module):
    def __init__(self, pooling: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, D)
        self.blocks = nn.ModuleList(SequentialBlock() for _ in range(L))
        self.head = AttentionPooling() if pooling else nn.Linear(D, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def block_split(n: int, b: int = 1) -> tuple[int, int, int]:
    tokens = b * n
    core = 2 * b * H * n * n * (D // H)  # QK^T + AV over h heads of d = D/h
    proj = lin(tokens, D, 3 * D) + lin(tokens, D, D)
    ffn = lin(tokens, D, FF) + lin(tokens, FF, D)
    return L * core, L * proj, L * ffn


def test_sequential_ffn_is_ffn() -> None:
    n, b = 24, 2
    p = profile(Encoder(), inputs=(torch.zeros(b, n, dtype=torch.long),))
    assert (p.attention_core, p.attention_proj, p.ffn) == block_split(n, b)
    assert (p.n, p.batch, p.layers, p.warnings) == (n, b, L, ())
    assert p.other == lin(b * n, D, 8)  # the head


def test_attention_pooling_head_is_attention_outside_the_layers() -> None:
    # Attention is attention wherever it runs: the head's core and projections are counted as such, named
    # in a note, and left out of what the formula describes (the layers); the head's Linear, which takes
    # the attention's result and never meets it again, is no FFN.
    n, b = 24, 2
    p = profile(Encoder(pooling=True), inputs=(torch.zeros(b, n, dtype=torch.long),))
    core, proj, ffn = block_split(n, b)
    # one query over n keys: q (b x 1 token), k and v (b x n tokens), out (b x 1); QK^T and AV per head
    head_core, head_proj = 2 * b * H * 1 * n * (D // H), lin(b, D, D) + 2 * lin(b * n, D, D) + lin(b, D, D)
    assert (p.attention_core, p.attention_proj, p.ffn) == (core + head_core, proj + head_proj, ffn)
    assert p.other == lin(b, D, 8)
    assert p.layers == L and p.outside == {"attention_core": head_core, "attention_proj": head_proj}
    assert [p.in_layers(part) for part in ("attention_core", "attention_proj", "ffn")] == [core, proj, ffn]
    assert any(note.startswith("attention outside the repeated layers") and "head.attn" in note
               and f"core {head_core:,}, projections {head_proj:,}" in note for note in p.notes)
    assert p.warnings == ()
    spec = ModelSpec(hidden=D, heads=H, head_dim=D // H, layers=L, ffn_dim=FF)
    with_spec = profile(Encoder(pooling=True), inputs=(torch.zeros(b, n, dtype=torch.long),), spec=spec)
    assert (with_spec.deviation, with_spec.warnings) == (0, ())  # the formula describes the layers


# --- nanoGPT and the lecture model ------------------------------------------------------------


class LectureHead(nn.Module):
    """One head of the 'Let's build GPT' lecture: q @ k^T under a tril mask, then @ v."""

    def __init__(self, size: int, block: int = 32) -> None:
        super().__init__()
        self.key = nn.Linear(D, size, bias=False)
        self.query = nn.Linear(D, size, bias=False)
        self.value = nn.Linear(D, size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block, block)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, t, _ = x.shape
        k, q = self.key(x), self.query(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        wei = wei.masked_fill(self.tril[:t, :t] == 0, float("-inf")).softmax(dim=-1)
        return wei @ self.value(x)


class LectureMultiHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList(LectureHead(D // H) for _ in range(H))
        self.proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))


class LectureBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sa = LectureMultiHead()
        self.ffwd = nn.Sequential(nn.Linear(D, 4 * D), nn.ReLU(), nn.Linear(4 * D, D))
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.sa(self.ln1(x))
        return x + self.ffwd(self.ln2(x))


class LectureGPT(nn.Module):
    def __init__(self, layers: int = L) -> None:
        super().__init__()
        self.token = nn.Embedding(65, D)
        self.position = nn.Embedding(32, D)
        self.blocks = nn.Sequential(*[LectureBlock() for _ in range(layers)])
        self.lm_head = nn.Linear(D, 65)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.token(idx) + self.position(torch.arange(idx.shape[1], device=idx.device))
        return self.lm_head(self.blocks(x))


@pytest.mark.parametrize("layers", [1, L])
def test_lecture_model_heads_in_a_module_list(layers: int) -> None:
    """The heads are a ModuleList inside each block: the block is the layer, not the head."""
    n, b = 16, 2
    p = profile(LectureGPT(layers), inputs=(torch.zeros(b, n, dtype=torch.long),))
    tokens = b * n
    assert p.attention_core == layers * H * 2 * b * n * n * (D // H)
    assert p.attention_proj == layers * (H * 3 * lin(tokens, D, D // H) + lin(tokens, D, D))
    assert p.ffn == layers * 2 * lin(tokens, D, 4 * D)
    assert p.by_module["lm_head"] == lin(tokens, D, 65)  # other: the head (and fvcore's layer norms)
    assert (p.n, p.batch, p.layers, p.warnings) == (n, b, layers, ())


# --- never silently wrong ---------------------------------------------------------------------


class InlineBlock(nn.Module):
    """Attention computed in the block's own forward: projections and FFN are siblings."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.up, self.down = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = (self.q(x) @ self.k(x).transpose(-1, -2)).softmax(-1)
        x = x + self.o(scores @ self.v(x))
        return x + self.down(torch.relu(self.up(x)))


class OddBlock(SequentialBlock):
    """Beside its attention, the block multiplies two activations: nothing says what that is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(x)
        gram = x @ x.transpose(-1, -2)  # [n, D] @ [D, n]
        return x + self.body(x) * gram.mean()


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(block() for _ in range(L))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_inline_attention_is_split_by_its_data_flow() -> None:
    # Projections and FFN are siblings on the layer: containers cannot tell them apart, the data flow can
    # (q, k, v reach the core, o takes its result, up and down do neither).
    n = 16
    p = profile(Stack(InlineBlock), inputs=(torch.zeros(1, n, D),))
    assert (p.attention_proj, p.ffn, p.warnings) == (L * 4 * lin(n, D, D), L * 2 * lin(n, D, FF), ())
    named = profile(Stack(InlineBlock), inputs=(torch.zeros(1, n, D),),
                    roles={"attention": ["layers.[0-9]"], "ffn": ["layers.*.up", "layers.*.down"]})
    assert (named.ffn, named.warnings) == (L * 2 * lin(n, D, FF), ())


def test_unplaced_products_are_named() -> None:
    n = 16
    p = profile(Stack(OddBlock), inputs=(torch.zeros(1, n, D),))
    unplaced = [w for w in p.warnings if "could not be placed" in w]
    assert unplaced == [parts.UNPLACED_WARNING.format(module=f"layers.{i}", macs=lin(n, D, n)) for i in range(L)]
    assert p.ffn == L * (lin(n, D, FF) + lin(n, FF, D))  # the real FFN is still found


# --- models built to fool the data-flow rule: each gets a warning naming it, never a silent placement ----


class SharedQuery(nn.Module):
    """Q is also the input of an MLP: a projection that feeds both the core and a non-attention product."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.up, self.down = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x)
        heads = [t.reshape(b, n, H, D // H).transpose(1, 2) for t in (q, self.k(x), self.v(x))]
        x = x + self.o(F.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(b, n, D))
        return x + self.down(F.gelu(self.up(q)))


class RawQuery(SequentialBlock):
    """The queries are the residual stream itself: no projection of this layer reaches them."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = nn.Linear(D, 2 * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        k, v = self.kv(x).chunk(2, dim=-1)
        q, k, v = (t.reshape(b, n, H, D // H).transpose(1, 2) for t in (x, k, v))
        x = x + self.mixer.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, D))
        return x + self.body(x)


class NoProjections(SequentialBlock):
    """Attention over the residual stream itself: Q, K and V are x."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        heads = x.reshape(b, n, H, D // H).transpose(1, 2)
        x = x + F.scaled_dot_product_attention(heads, heads, heads).transpose(1, 2).reshape(b, n, D)
        return x + self.body(x)


class OneWithoutFFN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([SequentialBlock(), SelfAttentionOnly(), SequentialBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_projection_that_also_feeds_an_mlp_is_named() -> None:
    n = 16
    p = profile(Stack(SharedQuery), inputs=(torch.zeros(1, n, D),))
    # placed as the data flow reads it (q reaches the core), and said
    assert (p.attention_proj, p.ffn) == (L * 4 * lin(n, D, D), L * 2 * lin(n, D, FF))
    assert p.warnings == tuple(roles.SHARED_PROJECTION_WARNING.format(
        module=f"layers.{i}.q", attention=f"layers.{i}", macs=lin(n, D, D), other=f"layers.{i}.up") for i in range(L))


def test_an_ffn_product_feeding_a_core_and_a_core_without_projections_are_named() -> None:
    n = 16
    raw = profile(Stack(RawQuery), inputs=(torch.zeros(1, n, D),))
    # layer 1's queries are layer 0's output: its FFN's last product (placed as ffn) feeds that core directly
    assert raw.warnings == (roles.FFN_FEEDS_CORE_WARNING.format(
        module="layers.0.body.2", macs=lin(n, FF, D), part="ffn", attention="layers.1"),)
    bare = profile(Stack(NoProjections), inputs=(torch.zeros(1, n, D),))
    core = 2 * H * n * n * (D // H)
    assert bare.warnings == (
        roles.NO_PROJECTION_WARNING.format(attention="layers.0", macs=core),
        roles.FFN_FEEDS_CORE_WARNING.format(module="layers.0.body.2", macs=lin(n, FF, D), part="ffn",
                                            attention="layers.1"),
        roles.NO_PROJECTION_WARNING.format(attention="layers.1", macs=core))
    # no projection in, so no guess at one out: the FFN that takes the result stays the FFN
    assert (bare.attention_core, bare.attention_proj, bare.ffn) == (L * core, 0, L * 2 * lin(n, D, FF))


def test_a_layer_without_ffn_among_layers_with_one_is_named() -> None:
    p = profile(OneWithoutFFN(), inputs=(torch.zeros(1, 16, D),))
    assert p.warnings == (parts.LAYER_NO_FFN_WARNING.format(module="layers.1", others=2),)


def test_strict_mode_fails_a_model_that_fools_the_rule(project: pytest.Pytester) -> None:
    project.makepyfile(test_fooled="""
        import pytest
        import torch
        from torch import nn
        from torch.nn import functional as F

        class SharedQuery(nn.Module):
            def __init__(self):
                super().__init__()
                self.q, self.k, self.v, self.o = (nn.Linear(64, 64) for _ in range(4))
                self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 64)

            def forward(self, x):
                b, n, _ = x.shape
                q = self.q(x)
                heads = [t.reshape(b, n, 4, 16).transpose(1, 2) for t in (q, self.k(x), self.v(x))]
                x = x + self.o(F.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(b, n, 64))
                return x + self.down(F.gelu(self.up(q)))

        @pytest.mark.attncost(n=16)
        def test_fooled(attncost):
            attncost.profile(nn.Sequential(SharedQuery(), SharedQuery()), inputs=(torch.zeros(1, 16, 64),))
    """)
    result = project.runpytest("--attncost-strict")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the split cannot be trusted: 0.q: a projection of the attention in 0 *"
                                 "also feeds 0.up*"])


def test_layer_without_ffn_while_the_spec_has_one() -> None:
    spec = ModelSpec(hidden=D, heads=H, head_dim=D // H, layers=L, ffn_dim=FF)
    p = profile(Stack(SelfAttentionOnly), inputs=(torch.zeros(1, 16, D),), spec=spec)
    assert sum("no FFN product" in w for w in p.warnings) == L
    assert any(w.startswith("ffn is 0 MAC but the formula gives") for w in p.warnings)


class SelfAttentionOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = SelfAttention()
        self.norm = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.attn(x))


# --- models without attention, and configs that differ ----------------------------------------


def test_mamba_has_neither_attention_nor_ffn() -> None:
    from transformers import MambaConfig, MambaModel

    with pytest.raises(ProfileError, match="found neither attention nor an FFN"):
        profile(lambda: MambaModel(MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=64, state_size=4)), 8)


def test_swin_counts_with_a_note_instead_of_a_formula() -> None:
    from transformers import SwinConfig, SwinModel

    config = SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)
    p = profile(lambda: SwinModel(config))
    # stage 1: 8x8 patches of width 16; stage 2 (after merging 2x2): 4x4 of width 32; windows of 4x4
    proj = 4 * lin(64, 16, 16) + 4 * lin(16, 32, 32)
    ffn = 2 * lin(64, 16, 64) + 2 * lin(16, 32, 128)
    core = 2 * 64 * 16 * 16 + 2 * 16 * 16 * 32  # QK^T + AV within each 16-token window
    assert (p.attention_proj, p.ffn, p.attention_core) == (proj, ffn, core)
    assert p.spec is None and any("per-stage heads ([2, 2])" in note for note in p.notes)
    with pytest.raises(ValueError, match="per-stage heads"):
        spec_from_config(config)


def test_configs_that_differ_give_a_spec_or_a_reason() -> None:
    from transformers import BartConfig, BartModel, CLIPConfig, GPT2Config

    bart, why = families.spec_of(BartModel(BartConfig(d_model=32, encoder_layers=1, decoder_layers=1,
                                                          encoder_attention_heads=2, decoder_attention_heads=2,
                                                          encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64)))
    assert bart is None and "encoder-decoder" in why
    with pytest.raises(ValueError, match="two towers"):
        spec_from_config(CLIPConfig())
    assert spec_from_config(GPT2Config(n_embd=96, n_head=3, n_layer=5)) == ModelSpec(96, 3, 32, 5, 384)

    class NanoConfig:  # a user's own config in GPT-2 style
        n_embd, n_head, n_layer = 64, 4, 3

    assert spec_from_config(NanoConfig()) == ModelSpec(64, 4, 16, 3, 256)

    class OddConfig:  # a field of a type no family gives it: the note names the config and the cause
        n_embd, n_head, n_layer, n_inner = 64, 4, 3, {"up": 96}

    class Odd(nn.Module):
        config = OddConfig()

    odd, why = families.spec_of(Odd())
    assert odd is None and why.startswith("OddConfig's fields do not read as one shape (") and "pass spec=" in why


@pytest.mark.parametrize("kind", ["bigbird", pytest.param("funnel", marks=tm.transformers_5(
    "Funnel reads its positions' values (.item() in torch.arange) on every backend"))])
def test_blocked_and_pooled_attention_keep_the_inputs_n(kind: str) -> None:
    import transformers as tf

    if kind == "bigbird":
        config = tf.BigBirdConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
                                  vocab_size=100, block_size=8, num_random_blocks=1, attention_type="block_sparse")
        factory = lambda: tf.BigBirdModel(config)  # noqa: E731
    else:
        config = tf.FunnelConfig(d_model=64, n_head=4, block_sizes=[1, 1], d_head=16, d_inner=128, vocab_size=100)
        factory = lambda: tf.FunnelModel(config)  # noqa: E731
    p = profile(factory, 64, batch=2)
    assert (p.n, p.batch) == (64, 2)
    # the FFN is linear in the tokens whatever the attention pattern: BigBird 2 layers of 2 x 64 tokens;
    # Funnel 2 encoder layers (the second on pooled 2 x 32 tokens) and 2 decoder layers at full length
    ffn = 2 * lin(128, 64, 128)
    assert p.ffn == (2 * ffn if kind == "bigbird" else ffn + ffn // 2 + 2 * ffn)
    if kind == "bigbird":  # block-sparse: fewer core MACs than n x n, and the profile says so
        assert p.attention_core < 2 * formulas.attention_core(p.spec, 64, 2)
        assert any(w.startswith("attention_core is") for w in p.warnings)


# --- mixture of experts --------------------------------------------------------------------------


@tm.transformers_5("Mixtral's experts are routed by value (nonzero): no count on the meta device")
def test_mixtral_default_experts_formula_agrees() -> None:
    from transformers import MixtralConfig, MixtralModel

    config = MixtralConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=2, num_hidden_layers=L,
                           intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, vocab_size=100)
    n, b = 16, 2
    p = profile(lambda: MixtralModel(config), n, batch=b)
    tokens = b * n
    # tokens * top_k * 3 * D * F_expert + tokens * D * E, per layer
    assert p.ffn == L * (tokens * 2 * 3 * D * 32 + tokens * D * 4)
    assert p.ffn_router == L * tokens * D * 4
    assert (p.deviation, p.warnings) == (0, ())
    assert (p.spec.experts, p.spec.top_k, p.spec.expert_ffn_dim) == (4, 2, 32)
    assert any("grouped_mm" in note for note in p.notes)
    assert p.to_dict()["ffn_router"] == p.ffn_router


def test_moe_spec_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="top_k must be in 1..experts"):
        ModelSpec(64, 4, 16, 2, 128, experts=4, top_k=5, expert_ffn_dim=32)
    with pytest.raises(ValueError, match="set experts= too"):
        ModelSpec(64, 4, 16, 2, 128, top_k=2)
    spec = ModelSpec(64, 4, 16, 4, 128, gated=True, experts=8, top_k=2, expert_ffn_dim=32, dense_layers=1)
    # 1 dense gated layer (3*D*f) + 3 MoE layers (2 experts of 3*D*f_e + router D*E), per token
    assert spec.model_ffn_per_token == 3 * 64 * 128 + 3 * (2 * 3 * 64 * 32 + 64 * 8)
    assert formulas.model_costs(spec, 10).ffn == 10 * spec.model_ffn_per_token


def test_roles_and_op_tables_need_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, pytest_attncost.ops, pytest_attncost.roles, pytest_attncost.formulas; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr


def test_modernbert_gated_mlp_matches_its_formula():
    # ModernBERT's MLP is a GLU: Wi maps D to 2f (gate and value), Wo maps f back to D. Found trying a family
    # no issue named: the count was right, the formula (read as ungated) was not, and the plugin warned.
    from transformers import ModernBertConfig, ModernBertModel

    config = ModernBertConfig(hidden_size=128, num_attention_heads=2, num_hidden_layers=2, intermediate_size=256,
                              vocab_size=1000, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                              sep_token_id=2)
    p = profile(lambda: ModernBertModel(config), 64)
    n, d, f, layers = 64, 128, 256, 2
    assert p.attention_core == layers * 2 * n * n * d == 2_097_152
    assert p.attention_proj == layers * 4 * n * d * d == 8_388_608  # fused Wqkv (3 D x D) and Wo
    assert p.ffn == layers * 3 * n * d * f == 12_582_912
    assert p.spec is not None and p.spec.gated and p.deviation == 0 and p.warnings == ()


class MixerOnlyBlock(nn.Module):
    """A layer of a hybrid stack without attention: a token mixer (a causal depthwise conv) and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.mixer_in = nn.Linear(D, D)
        self.conv = nn.Conv1d(D, D, kernel_size=3, padding=2, groups=D, bias=False)
        self.body = nn.Sequential(nn.Linear(D, FF), nn.GELU(), nn.Linear(FF, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.conv(self.mixer_in(x).transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        x = x + mixed
        return x + self.body(x)


class Hybrid(Encoder):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MixerOnlyBlock(), SequentialBlock(), MixerOnlyBlock(), SequentialBlock()])


def test_layers_without_attention_in_a_hybrid_stack_are_named() -> None:
    # The mixer-only layers are not attention layers; their products (their MLP included) stay
    # in other, and a warning names them and the MACs instead of leaving the FFN short unsaid.
    n, b = 12, 2
    tokens = b * n
    p = profile(Hybrid(), inputs=(torch.zeros(b, n, dtype=torch.long),))
    assert (p.attention_core, p.attention_proj, p.ffn) == block_split(n, b)  # the two attention layers
    mixer_only = lin(tokens, D, D) + b * D * (n + 2) * 3 + lin(tokens, D, FF) + lin(tokens, FF, D)
    assert p.other == 2 * mixer_only + lin(tokens, D, 8)
    assert p.warnings == (f"blocks.0, blocks.2: 2 layer(s) beside the attention layers ran no attention core; their "
                          f"{2 * mixer_only:,} MAC (their FFNs included) are counted as other; "
                          "pass roles= to place them",)


def test_a_hybrid_config_gets_no_formula_that_puts_attention_in_every_layer() -> None:
    from transformers import RecurrentGemmaConfig, RecurrentGemmaModel

    # block types: recurrent, recurrent, attention; the MLP is gated, intermediate_size // 2 wide
    n, b = 16, 2
    tokens, hidden, heads, kv, head_dim, width = b * n, 64, 4, 2, 16, 48
    p = profile(lambda: RecurrentGemmaModel(RecurrentGemmaConfig(
        vocab_size=128, hidden_size=hidden, num_hidden_layers=3, num_attention_heads=heads, num_key_value_heads=kv,
        intermediate_size=2 * width, attention_window_size=8)), n, batch=b)
    assert p.attention_core == 2 * b * heads * n * n * head_dim
    assert p.attention_proj == 2 * lin(tokens, hidden, heads * head_dim) + 2 * lin(tokens, hidden, kv * head_dim)
    assert p.ffn == 3 * lin(tokens, hidden, width)  # the attention layer's MLP only
    assert p.spec is None and p.deviation is None
    assert any("2 layer(s) run no attention beside 1 that do" in note for note in p.notes)
    assert len(p.warnings) == 1 and p.warnings[0].startswith("layers.0, layers.1: 2 layer(s) beside the attention")
    assert p.other >= 2 * 3 * lin(tokens, hidden, width)  # the recurrent layers' MLPs are there


GATED_CONFIGS = {  # families found gated in their modeling files (gate, up and down projections)
    "Ernie4_5Config": {},
    "Exaone4Config": {},
    "PhimoeConfig": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "JetMoeConfig": {},
}


@pytest.mark.parametrize("config", sorted(GATED_CONFIGS))
def test_gated_families_get_the_gated_formula(config: str) -> None:
    import transformers

    spec = spec_from_config(getattr(transformers, config)(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        **GATED_CONFIGS[config]))
    assert spec.gated


def test_ernie_and_ctrl_count_what_their_formulas_say() -> None:
    # Two families that warned falsely: Ernie 4.5's gated MLP was read as ungated, CTRL's FFN
    # width (dff) as 4 x hidden.
    from transformers import CTRLConfig, CTRLModel, Ernie4_5Config, Ernie4_5Model

    n, b, d, f, layers = 16, 2, 64, 96, 2
    tokens = n * b
    ernie = profile(lambda: Ernie4_5Model(Ernie4_5Config(
        vocab_size=128, hidden_size=d, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=f)), n, batch=b)
    assert ernie.ffn == layers * 3 * lin(tokens, d, f)
    assert ernie.attention_proj == layers * (2 * lin(tokens, d, d) + 2 * lin(tokens, d, 32))
    assert (ernie.deviation, ernie.warnings) == (0, ())
    ctrl = profile(lambda: CTRLModel(CTRLConfig(vocab_size=128, n_embd=d, n_layer=layers, n_head=4, dff=f)), n, batch=b)
    assert ctrl.spec is not None and ctrl.spec.ffn_dim == f
    assert ctrl.ffn == layers * 2 * lin(tokens, d, f)
    assert (ctrl.deviation, ctrl.warnings) == (0, ())


@tm.transformers_5("JetMoE's experts are routed by value (tolist): no count on the meta device")
def test_no_note_claims_an_experts_switch_that_did_not_happen() -> None:
    # JetMoE routes with its own code (no experts implementation to switch); counted on real
    # tensors, nothing ran as batched_mm, and no note may say so.
    from transformers import JetMoeConfig, JetMoeModel

    from pytest_attncost.families import EXPERTS_NOTE

    model = JetMoeModel(JetMoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, kv_channels=16))
    p = profile(model, 8)
    assert pipeline.REAL_NOTE in p.notes
    assert not any(note.startswith(EXPERTS_NOTE.split("{")[0]) for note in p.notes)


def test_experts_in_a_module_dict_have_their_router_counted() -> None:
    # SwitchTransformers keeps its experts in a ModuleDict (expert_0, expert_1, ...): its router,
    # t x D x E per sparse layer, was inside ffn but reported as ffn_router = 0.
    from transformers import SwitchTransformersConfig, SwitchTransformersModel

    b, n, d, f, experts = 2, 16, 64, 96, 4
    t = b * n
    model = SwitchTransformersModel(SwitchTransformersConfig(
        vocab_size=128, d_model=d, d_kv=16, d_ff=f, num_layers=2, num_decoder_layers=2, num_heads=4,
        num_experts=experts, expert_capacity=64, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
        decoder_start_token_id=0)).eval()
    p = profile(model, n, batch=b)  # counted on real tensors: the routing reads values
    router = lin(t, d, experts)
    assert p.ffn_router == 2 * router  # one sparse layer in each stack
    # dense layers, and top-1 experts (capacity 64 >= 32 tokens): every token through one expert
    assert p.ffn == 2 * 2 * lin(t, d, f) + 2 * (2 * lin(t, d, f) + router)


VISION = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=3, num_attention_heads=4)


@pytest.mark.parametrize(("ratio", "swiglu", "width"), [(2, False, 128), (4, False, 256), (4, True, 176),
                                                         (2, True, 88)])
def test_dinov2_mlp_is_sized_by_its_ratio(ratio: int, swiglu: bool, width: int) -> None:
    # DINOv2 has no intermediate_size: fc1 is D x int(D * mlp_ratio); its SwiGLU keeps two thirds
    # of that, rounded up to a multiple of 8, in three matrices. The formula read 4 x D, ungated.
    from transformers import Dinov2Config, Dinov2Model

    b, n, d = 2, 17, 64  # 16 patches and CLS
    p = profile(lambda: Dinov2Model(Dinov2Config(**VISION, mlp_ratio=ratio, use_swiglu_ffn=swiglu)), batch=b)
    assert p.n == n
    assert p.ffn == 3 * (3 if swiglu else 2) * lin(b * n, d, width)
    assert (p.deviation, p.warnings) == (0, ())


def test_video_models_get_a_clip_of_the_configs_frames() -> None:
    from transformers import VideoMAEConfig, VideoMAEModel

    # 4 frames in tubelets of 2 -> 2 x 16 patches = 32 tokens
    b, n, d, f = 2, 32, 64, 96
    p = profile(lambda: VideoMAEModel(VideoMAEConfig(**VISION, intermediate_size=f, num_frames=4, tubelet_size=2)),
                batch=b)
    assert (p.n, p.batch) == (n, b)
    assert (p.attention_core, p.attention_proj, p.ffn) == (3 * b * 4 * n * n * 32, 3 * 4 * lin(b * n, d, d),
                                                            3 * 2 * lin(b * n, d, f))


def test_a_vision_model_without_an_image_size_is_not_counted_at_a_guessed_one() -> None:
    from transformers import SegformerConfig, SegformerModel

    with pytest.raises(ProfileError, match=r"SegformerConfig has no image_size.*pass inputs=\{'pixel_values'"):
        profile(lambda: SegformerModel(SegformerConfig()), batch=2)


def test_the_batch_is_the_main_inputs_even_when_the_model_folds_frames_into_it() -> None:
    # TimeSformer's space-only attention runs batch x frames sequences: the batch is still 2.
    from transformers import TimesformerConfig, TimesformerModel

    b, frames, n = 2, 4, 17
    p = profile(lambda: TimesformerModel(TimesformerConfig(**VISION, intermediate_size=96, num_frames=frames,
                                                           attention_type="space_only")),
                inputs={"pixel_values": torch.zeros(b, frames, 3, 32, 32)}, batch=b)
    assert (p.n, p.batch) == (n, b)
    assert p.attention_core == 3 * b * frames * 4 * n * n * 32
    # one sequence per frame: the formulas (one per input) do not describe it, and say so instead of warning
    assert (p.spec, p.warnings) == (None, ())
    assert any(f"the attention ran {b * frames} sequences of {n} tokens for a batch of {b}" in note for note in p.notes)


class ParallelLists(nn.Module):
    """XLM's layout: the attention modules in one list, the FFNs in another, zipped in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, D)
        self.attentions = nn.ModuleList(SelfAttention() for _ in range(L))
        self.ffns = nn.ModuleList(nn.Sequential(nn.Linear(D, FF), nn.GELU(), nn.Linear(FF, D)) for _ in range(L))
        self.head = nn.Linear(D, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for attention, ffn in zip(self.attentions, self.ffns):
            x = x + attention(x)
            x = x + ffn(x)
        return self.head(x)


def test_ffns_in_a_list_beside_the_attention_list_are_the_ffn() -> None:
    # They were other, and the attention modules were warned about as layers whose projections
    # and FFN cannot be told apart.
    n, b = 12, 2
    p = profile(ParallelLists(), inputs=(torch.zeros(b, n, dtype=torch.long),))
    assert (p.attention_core, p.attention_proj, p.ffn) == block_split(n, b)
    assert (p.other, p.warnings) == (lin(b * n, D, 8), ())


def test_xlm_counts_its_ffns() -> None:
    from transformers import XLMConfig, XLMModel

    b, n, d, layers = 2, 16, 64, 3
    model = XLMModel(XLMConfig(vocab_size=128, emb_dim=d, n_layers=layers, n_heads=4, max_position_embeddings=64))
    p = profile(model.eval(), n, batch=b)  # real tensors: XLM checks its lengths with .item()
    assert p.ffn == layers * 2 * lin(b * n, d, 4 * d)
    assert p.attention_proj == layers * 4 * lin(b * n, d, d)
    assert (p.deviation, p.warnings) == (0, ())


class _Mlp(nn.Module):
    def __init__(self, *shapes: tuple[int, int]) -> None:
        super().__init__()
        for index, (fan_in, fan_out) in enumerate(shapes):  # w0, w1, ...: shapes are read, not names
            setattr(self, f"w{index}", nn.Linear(fan_in, fan_out))


@pytest.mark.parametrize(("shapes", "gated"), [
    (((D, FF), (D, FF), (FF, D)), True),  # gate, up, down
    (((D, 2 * FF), (FF, D)), True),  # fused gate and up
    (((D, FF), (FF, D)), False),
])
def test_gating_is_read_from_the_weights(shapes: tuple[tuple[int, int], ...], gated: bool) -> None:
    from pytest_attncost.families import gated_by_structure

    spec = ModelSpec(hidden=D, heads=H, head_dim=D // H, layers=1, ffn_dim=FF)
    layer = nn.Module()
    layer.attn, layer.mlp = SelfAttention(), _Mlp(*shapes)
    assert gated_by_structure(layer, [layer.attn], spec) is gated
    # split across two modules (BERT's intermediate / output): the weights do not tell
    split = nn.Module()
    split.attn, split.up, split.down = SelfAttention(), _Mlp((D, FF)), _Mlp((FF, D))
    assert gated_by_structure(split, [split.attn], spec) is None


@tm.transformers_5("gpt-oss's experts are routed by value (nonzero): no count on the meta device")
def test_a_family_nobody_listed_gets_its_gated_formula_from_its_weights() -> None:
    # gpt-oss's experts are gated (a fused gate_up_proj [E, D, 2f]); it is on no list.
    from transformers import GptOssConfig, GptOssModel

    b, n, d, fe, experts, top_k, layers = 2, 16, 64, 32, 4, 2, 4
    t = b * n
    p = profile(lambda: GptOssModel(GptOssConfig(
        vocab_size=128, hidden_size=d, intermediate_size=fe, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=experts, num_experts_per_tok=top_k,
        attn_implementation="eager")), n, batch=b)
    router = lin(t, d, experts)
    assert (p.ffn, p.ffn_router) == (layers * (t * top_k * 3 * d * fe + router), layers * router)
    assert p.spec is not None and p.spec.gated and (p.deviation, p.warnings) == (0, ())


def test_a_given_spec_and_a_read_one_are_cached_apart() -> None:
    # A spec read from the config is corrected by the structure (a hybrid stack has no formula); the
    # same spec given as spec= is the user's and kept. The cache must not hand one's result to the other.
    from transformers import RecurrentGemmaConfig, RecurrentGemmaModel

    from pytest_attncost import clear_cache

    config = RecurrentGemmaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=96, attention_window_size=8)
    with torch.device("meta"):
        read = api.spec_of(RecurrentGemmaModel(config))
    assert read is not None

    def factory() -> nn.Module:
        return RecurrentGemmaModel(config)

    for order in ((None, read), (read, None)):
        clear_cache()
        profiles = [profile(factory, 16, batch=2, spec=spec) for spec in order]
        for spec, p in zip(order, profiles):
            assert p.spec == spec  # read: dropped for the hybrid stack; given: kept


class _EarlyExits(nn.Module):
    """Inline blocks, and one early-exit head per block in a list beside them: heads, not FFNs."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(InlineBlock() for _ in range(L))
        self.exits = nn.ModuleList(nn.Linear(D, 10) for _ in range(L))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        for block, head in zip(self.blocks, self.exits):
            x = block(x)
            outs.append(head(x))
        return outs


def test_a_list_beside_the_layers_is_not_taken_for_their_ffns_unless_it_is_one() -> None:
    n, b = 8, 2
    p = profile(_EarlyExits(), inputs=(torch.zeros(b, n, D),))
    # the blocks' own FFNs; the heads beside them (one product each) stay in other
    assert p.ffn == L * 2 * lin(b * n, D, FF) and p.other == L * lin(b * n, D, 10)
    assert p.warnings == ()


def test_a_head_kept_in_the_layers_sequential_is_not_called_a_layer() -> None:
    layer = nn.TransformerEncoderLayer(D, H, FF, batch_first=True)
    second = nn.TransformerEncoderLayer(D, H, FF, batch_first=True)
    for head in (nn.Linear(D, D), nn.Sequential(nn.Linear(D, D), nn.Linear(D, D))):
        p = profile(nn.Sequential(layer, second, head), inputs=(torch.zeros(2, 8, D),))
        assert (p.n, p.batch) == (8, 2)  # (b, n, D) floats: the batch they hold, not 1
        assert not any("beside the attention layers" in w for w in p.warnings)
        assert p.ffn == 2 * 2 * lin(16, D, FF)  # the two layers' FFNs; the head stays in other


class _LinearAttention(nn.Module):
    """Katharopoulos et al.'s linear attention, written as performer-pytorch writes it: K'^T V first (a d x d
    context), Q' against the keys' sum for the normalizer, and one einsum of the context, Q' and the normalizer."""

    def __init__(self) -> None:
        super().__init__()
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (f(x).reshape(b, n, H, D // H).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        q, k = F.elu(q) + 1, F.elu(k) + 1
        context = torch.einsum("bhnd,bhne->bhde", k, v)
        normalizer = 1 / torch.einsum("bhnd,bhd->bhn", q, k.sum(dim=-2))
        out = torch.einsum("bhde,bhnd,bhn->bhne", context, q, normalizer)
        return self.to_out(out.transpose(1, 2).reshape(b, n, D))


class _Residual(nn.Module):
    def __init__(self, fn: nn.Module) -> None:
        super().__init__()
        self.norm, self.fn = nn.LayerNorm(D), fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fn(self.norm(x))


class _LinearTransformer(nn.Module):
    """Attention and FFN blocks as the two elements of each layer's list (performer-pytorch's layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleList([_Residual(_LinearAttention()), _Residual(nn.Sequential(
                nn.Linear(D, FF), nn.GELU(), nn.Linear(FF, D)))]) for _ in range(L))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attention, ffn in self.layers:
            x = ffn(attention(x))
        return x


@pytest.mark.parametrize("backend", ["fvcore", "torch"])
def test_linear_attention_is_attention_over_the_inputs_length(backend: str) -> None:
    n, b, d = 32, 2, D // H  # n != d: the d x d context is no n x n score
    p = profile(_LinearTransformer(), inputs=(torch.zeros(b, n, D),), backend=backend)
    assert (p.n, p.batch) == (n, b)  # the tokens, not the context's d rows
    # context (n d^2) + normalizer (n d) + output (n d^2) per head; to_out takes the normalized output: a projection
    assert (p.attention_core, p.attention_proj, p.ffn) == (
        L * b * H * (n * d * d + n * d + n * d * d), L * 4 * lin(b * n, D, D), L * 2 * lin(b * n, D, FF))
    assert p.spec is None and p.warnings == ()  # no softmax attention's shape is read from a d x d context
    assert p.notes == ("no formula: no config describes the model, and its trace shows no one shape to read: its "
                       "cores run over other rows than the tokens projected (a linear attention's d x d context); "
                       "pass spec=ModelSpec(...)",)


def test_a_layer_that_ran_nothing_is_named_beside_the_formulas_deviation() -> None:
    # Mllama's text model: layer 1 is a cross-attention layer, which skips itself without the vision states
    from transformers.models.mllama.configuration_mllama import MllamaTextConfig  # (not top-level in transformers 4)
    from transformers.models.mllama.modeling_mllama import MllamaTextModel

    n, kv, d = 16, 2, D // H
    config = MllamaTextConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=kv, num_hidden_layers=2,
                              intermediate_size=FF, vocab_size=128, cross_attention_layers=[1], pad_token_id=0,
                              bos_token_id=1, eos_token_id=2, rope_scaling={"rope_type": "default"})
    p = profile(lambda: MllamaTextModel(config), n)
    # layer 0 alone: GQA self-attention and a gated MLP
    assert (p.attention_core, p.attention_proj, p.ffn) == (
        2 * H * n * n * d, 2 * lin(n, D, D) + 2 * lin(n, D, kv * d), 3 * lin(n, D, FF))
    assert any(w.startswith("the attention ran 1 time(s) in the layers (layers.0), while the spec has 2 attention "
                            "layer(s)") and "give the inputs it needs" in w for w in p.warnings), p.warnings


# Mamba-2's chunked scan multiplies activations like QK^T and AV; a module holding A_log and D is no attention
SSM_N, SSM_KV = 16, 2
SSM_SHAPE = dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=SSM_KV, num_hidden_layers=2,
                 intermediate_size=FF, vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
#: one layer's self-attention (core, projections) and gated MLP at SSM_N tokens
SSM_ATTENTION = (2 * H * SSM_N * SSM_N * (D // H), 2 * lin(SSM_N, D, D) + 2 * lin(SSM_N, D, SSM_KV * (D // H)))
SSM_GATED = 3 * lin(SSM_N, D, FF)


@tm.transformers_5("Bamba's transformers 4 code reads cache_position's values (cache_position[0] > 0)")
def test_a_state_space_layer_beside_attention_layers_is_neither() -> None:
    from transformers import BambaConfig, BambaModel

    n, shape, attention, gated = SSM_N, SSM_SHAPE, SSM_ATTENTION, SSM_GATED
    # Bamba: layer 0 a Mamba-2 mixer and its MLP (a layer beside the attention layers: other), layer 1 attention
    bamba = profile(lambda: BambaModel(BambaConfig(**shape, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16,
                                                   mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16)),
                    n, backend="torch")
    assert (bamba.attention_core, bamba.attention_proj, bamba.ffn) == (*attention, gated)
    assert bamba.other > 0 and bamba.spec is None
    assert any(w.startswith("layers.0: 1 layer(s) beside the attention layers ran no attention core")
               for w in bamba.warnings), bamba.warnings


@tm.transformers_5("Falcon-H1's transformers 4 code reads cache_position's values (cache_position[0] > 0)")
def test_a_state_space_mixer_beside_a_layers_attention_is_neither() -> None:
    from transformers import FalconH1Config, FalconH1Model

    n, shape, attention, gated, d = SSM_N, SSM_SHAPE, SSM_ATTENTION, SSM_GATED, D // H
    # Falcon-H1: every layer runs attention and a Mamba-2 mixer side by side, then its MLP: the formula's parts exact
    falcon = profile(lambda: FalconH1Model(FalconH1Config(**shape, head_dim=d, mamba_d_ssm=64, mamba_n_heads=4,
                                                          mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                                                          mamba_chunk_size=16)), n, backend="torch")
    assert (falcon.attention_core, falcon.attention_proj, falcon.ffn) == (2 * attention[0], 2 * attention[1], 2 * gated)
    assert (falcon.deviation, falcon.warnings) == (0, ())
    assert any(note.startswith("state-space mixers in the layers, beside their attention (no attention and no FFN), "
                               f"counted as other: layers.0.mamba, layers.1.mamba: {falcon.other:,} MAC")
               for note in falcon.notes), falcon.notes


class _RelativeKeys(nn.Module):
    """Self-attention with relative keys looked up in a table (Shaw et al.'s, as SpeechT5 writes them); then, with
    *conv*, a 1x1 convolution over the channels of (batch, channels, tokens), as a Conformer's convolution module
    runs."""

    def __init__(self, reach: int = 4, conv: bool = False) -> None:
        super().__init__()
        self.reach, self.qkv, self.out = reach, nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.relative = nn.Embedding(2 * reach + 1, D // H)
        self.pointwise = nn.Conv1d(D, D, 1) if conv else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, H, D // H).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        positions = torch.arange(n, device=x.device)
        keys = self.relative((positions[None, :] - positions[:, None]).clamp(-self.reach, self.reach) + self.reach)
        scores = q @ k.transpose(-1, -2) + torch.einsum("bhnd,nmd->bhnm", q, keys)
        x = x + self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, D))
        return x if self.pointwise is None else x + self.pointwise(x.transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("backend", ["fvcore", "torch"])
def test_relative_keys_from_a_table_are_scores(backend: str) -> None:
    n, b, d = 16, 2, D // H
    p = profile(nn.Sequential(_RelativeKeys(), _RelativeKeys()), inputs=(torch.zeros(b, n, D),), backend=backend)
    assert (p.backend, p.fallback) == (backend, None)
    # QK^T, q . relative keys (an n x n score of their own: a core, not a projection), AV
    assert p.attention_core == 2 * 3 * b * H * n * n * d
    assert p.attention_proj == 2 * (lin(b * n, D, 3 * D) + lin(b * n, D, D))


def test_a_convolution_over_channels_runs_on_the_tokens() -> None:
    n, b = 96, 2  # more tokens than channels: b x channels rows would be fewer than the tokens
    model = nn.Sequential(_RelativeKeys(conv=True), _RelativeKeys(conv=True))
    p = profile(model, inputs=(torch.zeros(b, n, D),), backend="torch")
    # its rows are the tokens (its output's last dimension), not its channels: FFN by the rule, not conditioning
    assert p.ffn == 2 * lin(b * n, D, D)
    assert not any(note.startswith("conditioning") for note in p.notes), p.notes
