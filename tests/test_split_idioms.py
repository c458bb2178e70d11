"""Today's idioms split part by part, each against a hand formula (issue 33): Flux's parallel MLP, diffusion
transformers' conditioning, LoRA, talking heads, parametrized weights; jagged inputs and FSDP2 get errors.

Shapes: width D = 64 in H = 2 heads of 32, n = 16 tokens, FFN width 256, two layers."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pytest_attncost as pa
from pytest_attncost.errors import CountError, ProfileError

D, H, N, FF, L = 64, 2, 16, 256, 2
HD = D // H
BACKENDS = ("fvcore", "torch")


def tokens(n, batch):
    return (torch.randn(batch, n, D),)


def split_of(profile):
    return profile.attention_core, profile.attention_proj, profile.ffn


def mixes_warned(profile):
    """The spec read from the trace has no talking heads: the formula's core is QK^T and AV, and says so."""
    core = L * (2 * N * N * D + 2 * N * N * H * H)
    return profile.warnings == (f"attention_core is {core:,} MAC but the formula gives {L * 2 * N * N * D:,} (+6.25%): "
                                "the model does something the cost model does not describe, or a part was "
                                "misplaced; compare Profile.by_module, pass roles= or spec=",)


class Attention(nn.Module):
    """Q, K, V projections and sdpa, without an output projection (the block brings its own)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, H, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, D)


class FluxSingleBlock(nn.Module):
    """Flux's single-stream block: proj_out(cat([attention, gelu(proj_mlp(x))]))."""

    def __init__(self):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(D), Attention()
        self.proj_mlp, self.proj_out = nn.Linear(D, FF), nn.Linear(D + FF, D)

    def forward(self, x):
        h = self.norm(x)
        return x + self.proj_out(torch.cat([self.attn(h), F.gelu(self.proj_mlp(h))], dim=2))


class FusedParallelBlock(nn.Module):
    """ViT-22B's parallel block: one Linear for Q, K, V and the MLP's input, one for O and the MLP's output."""

    def __init__(self):
        super().__init__()
        self.norm, self.inp, self.out = nn.LayerNorm(D), nn.Linear(D, 3 * D + FF), nn.Linear(D + FF, D)

    def forward(self, x):
        b, n, _ = x.shape
        h = self.inp(self.norm(x))
        q, k, v = (t.reshape(b, n, H, HD).transpose(1, 2) for t in h[..., : 3 * D].chunk(3, -1))
        attention = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, D)
        return x + self.out(torch.cat([attention, F.gelu(h[..., 3 * D :])], -1))


class TalkingHeads(nn.Module):
    """CaiT's attention: an H x H mix of the heads before and after the softmax."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.pre, self.post = nn.Parameter(torch.randn(H, H)), nn.Parameter(torch.randn(H, H))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, HD).permute(2, 0, 3, 1, 4)
        dots = torch.einsum("bhij,hg->bgij", q @ k.transpose(-1, -2), self.pre)
        mixed = torch.einsum("bhij,hg->bgij", dots.softmax(-1), self.post)
        return self.out((mixed @ v).transpose(1, 2).reshape(b, n, D))


class Block(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.attn, self.ff = attention, nn.Sequential(nn.Linear(D, FF), nn.GELU(), nn.Linear(FF, D))

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.ff(x)


class Stack(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.layers = nn.ModuleList(make() for _ in range(L))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def flux_single():
    return Stack(FluxSingleBlock)


def cait():
    return Stack(lambda: Block(TalkingHeads()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_flux_parallel_mlp_is_ffn_and_its_projection_split_by_columns(backend):
    profile = pa.profile(flux_single, n=N, inputs=tokens, backend=backend)
    core = 2 * N * N * D  # QK^T and AV
    proj = 3 * N * D * D + N * D * D  # Q, K, V, and proj_out's D attention columns
    ffn = N * D * FF + N * FF * D  # proj_mlp, and proj_out's FF MLP columns
    assert split_of(profile) == (L * core, L * proj, L * ffn)
    assert not profile.warnings


def test_a_one_run_sweep_splits_by_columns_at_every_length():
    # one structure serves every length of the run: the columns, not the MACs of one length, are kept
    swept = pa.sweep(flux_single, [16, 48], inputs=tokens, backend="torch")
    for n, profile in zip((16, 48), swept):
        assert split_of(profile) == (L * 2 * n * n * D, L * 4 * n * D * D, L * 2 * n * D * FF)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_parallel_projections_are_split_by_their_columns(backend):
    profile = pa.profile(lambda: Stack(FusedParallelBlock), n=N, inputs=tokens, backend=backend)
    # inp: 3D columns Q, K, V and FF columns of MLP input; out: D attention columns and FF MLP columns
    proj = N * D * 3 * D + N * D * D
    ffn = N * D * FF + N * FF * D
    assert split_of(profile) == (L * 2 * N * N * D, L * proj, L * ffn)
    assert not profile.warnings


@pytest.mark.parametrize("backend", BACKENDS)
def test_cait_talking_heads_count_with_the_core(backend):
    profile = pa.profile(cait, n=N, inputs=tokens, backend=backend)
    core = 2 * N * N * D + 2 * (N * N * H * H)  # QK^T, AV, and the two H x H mixes over every score
    assert split_of(profile) == (L * core, L * 4 * N * D * D, L * 2 * N * D * FF)
    assert mixes_warned(profile)


@pytest.mark.parametrize("backend", BACKENDS)
def test_x_transformers_talking_heads_count_with_the_core(backend):
    # 1x1 convolutions over the heads, before the softmax (added to the scores) and after it
    x_transformers = pytest.importorskip("x_transformers", reason="x-transformers (the zoo extra) is not installed")

    def model():
        return x_transformers.Encoder(dim=D, depth=L, heads=H, attn_dim_head=HD, attn_pre_talking_heads=True,
                                      attn_post_talking_heads=True)

    profile = pa.profile(model, n=N, inputs=tokens, backend=backend)
    core = 2 * N * N * D + 2 * (N * N * H * H)
    assert split_of(profile) == (L * core, L * 4 * N * D * D, L * 2 * N * D * 4 * D)
    assert mixes_warned(profile)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gate", ["headwise", "dimwise"])
def test_gates_multiplied_into_the_attentions_result_are_projections(backend, gate):
    # x-transformers' value gates: sigmoid(Linear(D, H or D)) multiplied into each head's result (broadcast
    # over the head when headwise), not concatenated with it
    x_transformers = pytest.importorskip("x_transformers", reason="x-transformers (the zoo extra) is not installed")

    def model():
        return x_transformers.Encoder(dim=D, depth=L, heads=H, attn_dim_head=HD, attn_gate_values=True,
                                      attn_gate_values_headwise=gate == "headwise")

    profile = pa.profile(model, n=N, inputs=tokens, backend=backend)
    proj = 4 * N * D * D + N * D * (H if gate == "headwise" else D)
    assert split_of(profile) == (L * 2 * N * N * D, L * proj, L * 2 * N * D * 4 * D)
    # the formula has no gate, and says by how much the projections differ
    assert [w.split(" MAC")[0] for w in profile.warnings] == [f"attention_proj is {L * proj:,}"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_norm_weights_are_parameters(backend):
    from torch.nn.utils.parametrizations import weight_norm

    def model():
        stack = cait()
        for layer in stack.layers:
            weight_norm(layer.attn.qkv)
            weight_norm(layer.attn.out)
        return stack

    profile = pa.profile(model(), n=N, inputs=tokens, backend=backend)
    core = 2 * N * N * D + 2 * N * N * H * H
    assert split_of(profile) == (L * core, L * 4 * N * D * D, L * 2 * N * D * FF)
    assert mixes_warned(profile)


RANK = 4


def tiny_llama():
    from transformers import LlamaConfig, LlamaModel

    return LlamaModel(LlamaConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=H, num_hidden_layers=L,
                                  intermediate_size=FF, vocab_size=100))


def lora_llama(targets):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_llama(), LoraConfig(r=RANK, target_modules=list(targets)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("targets", [("o_proj",), ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj")], ids=["o", "every-linear"])
def test_lora_belongs_to_the_product_it_adapts(backend, targets):
    pytest.importorskip("peft", reason="peft (a test extra) is not installed")
    profile = pa.profile(lora_llama(targets), n=N, backend=backend)
    attention = [t for t in targets if t[0] in "qkvo"]
    mlp = {"gate_proj": D * RANK + RANK * FF, "up_proj": D * RANK + RANK * FF, "down_proj": FF * RANK + RANK * D}
    proj = 4 * N * D * D + len(attention) * N * (D * RANK + RANK * D)  # each adapter: A (D -> r), B (r -> D)
    ffn = 3 * N * D * FF + sum(N * mlp[t] for t in targets if t in mlp)
    assert split_of(profile) == (L * 2 * N * N * D, L * proj, L * ffn)
    # the formula describes the model without its adapters, and says by how much they differ
    assert any("attention_proj is" in warning for warning in profile.warnings)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dora_weights_belong_to_the_product_they_adapt(backend):
    # DoRA norms W + BA: peft runs lora_A and lora_B on an identity matrix (in_features rows), then on the tokens
    peft = pytest.importorskip("peft", reason="peft (a test extra) is not installed")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=RANK, target_modules=["q_proj", "o_proj", "down_proj"],
                                                              use_dora=True))
    profile = pa.profile(model, n=N, backend=backend)

    def dora(inputs, outputs):  # the identity's rows, then the tokens'
        return inputs * (inputs * RANK + RANK * outputs) + N * (inputs * RANK + RANK * outputs)

    proj = 4 * N * D * D + 2 * dora(D, D)
    ffn = 3 * N * D * FF + dora(FF, D)
    assert split_of(profile) == (L * 2 * N * N * D, L * proj, L * ffn)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_on_gpt2s_conv1d_projections(backend):
    peft = pytest.importorskip("peft", reason="peft (a test extra) is not installed")
    from transformers import GPT2Config, GPT2Model

    model = peft.get_peft_model(GPT2Model(GPT2Config(n_embd=D, n_head=H, n_layer=L, n_inner=FF, vocab_size=100)),
                                peft.LoraConfig(r=RANK, target_modules=["c_attn", "c_proj", "c_fc"],
                                                fan_in_fan_out=True))
    profile = pa.profile(model, n=N, backend=backend)
    proj = 4 * N * D * D + N * (D * RANK + RANK * 3 * D) + N * (2 * D * RANK)  # c_attn (D -> 3D), attn.c_proj
    ffn = 2 * N * D * FF + N * (D * RANK + RANK * FF) + N * (FF * RANK + RANK * D)  # c_fc, mlp.c_proj
    assert split_of(profile) == (L * 2 * N * N * D, L * proj, L * ffn)


# --- diffusers: conditioning in other, joint attention, single blocks, a UNet ------------------------------------

COND = "conditioning: products in the layers that run on the batch's conditioning"


def test_dit_conditioning_is_other_with_a_note():
    diffusers = pytest.importorskip("diffusers", reason="diffusers (a test extra) is not installed")

    def dit():
        return diffusers.DiTTransformer2DModel(num_attention_heads=H, attention_head_dim=HD, in_channels=4,
                                               num_layers=L, sample_size=8, patch_size=2, norm_num_groups=4)

    inputs = dict(hidden_states=torch.randn(1, 4, 8, 8), timestep=torch.ones(1, dtype=torch.long),
                  class_labels=torch.ones(1, dtype=torch.long))
    profile = pa.profile(dit, inputs=inputs)
    n = (8 // 2) ** 2  # 2 x 2 patches of an 8 x 8 latent
    assert profile.n == n
    assert split_of(profile) == (L * 2 * n * n * D, L * 4 * n * D * D, L * 2 * n * D * 4 * D)
    # per block: adaLN-Zero's timestep MLP (256 -> D -> D) and its Linear(D, 6D), on one row per image
    conditioning = 256 * D + D * D + D * 6 * D
    note = next(note for note in profile.notes if note.startswith(COND))
    # the output head runs block 0's timestep MLP again (its own Linear(D, 2D) sits outside the layers)
    assert note.endswith(f": {L * conditioning + 256 * D + D * D:,} MAC")


def test_sd3_joint_attention_and_its_context_stream():
    diffusers = pytest.importorskip("diffusers", reason="diffusers (a test extra) is not installed")

    def sd3():
        return diffusers.SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, num_layers=L, attention_head_dim=HD, num_attention_heads=H,
            joint_attention_dim=48, caption_projection_dim=D, pooled_projection_dim=40, out_channels=4,
            pos_embed_max_size=8)

    n, m = 16, 8  # image patches, caption tokens
    inputs = dict(hidden_states=torch.randn(1, 4, 8, 8), encoder_hidden_states=torch.randn(1, m, 48),
                  pooled_projections=torch.randn(1, 40), timestep=torch.ones(1, dtype=torch.long))
    profile = pa.profile(sd3, inputs=inputs, backend="torch")
    core = 2 * (n + m) ** 2 * D  # one attention over the joint sequence
    first = 3 * n * D * D + 3 * m * D * D + n * D * D + m * D * D  # to_q/k/v, add_q/k/v, to_out, to_add_out
    last = first - m * D * D  # the last block keeps no context output
    ffn = 2 * n * D * 4 * D + 2 * m * D * 4 * D
    assert split_of(profile) == (L * core, first + last, ffn + (ffn - 2 * m * D * 4 * D))
    # adaLN-Zero Linear(D, 6D) for both streams; the last context norm is AdaLayerNormContinuous: Linear(D, 2D)
    note = next(note for note in profile.notes if note.startswith(COND))
    assert note.endswith(f": {3 * D * 6 * D + D * 2 * D:,} MAC")


def test_flux_double_and_single_blocks():
    diffusers = pytest.importorskip("diffusers", reason="diffusers (a test extra) is not installed")

    def flux():
        return diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=HD,
            num_attention_heads=H, joint_attention_dim=48, pooled_projection_dim=40, axes_dims_rope=(8, 12, 12))

    n, m = 16, 8
    inputs = dict(hidden_states=torch.randn(1, n, 16), encoder_hidden_states=torch.randn(1, m, 48),
                  pooled_projections=torch.randn(1, 40), timestep=torch.ones(1), img_ids=torch.zeros(n, 3),
                  txt_ids=torch.zeros(m, 3))
    profile = pa.profile(flux, inputs=inputs)
    s = n + m
    core = 3 * 2 * s * s * D
    double_proj = 3 * n * D * D + 3 * m * D * D + n * D * D + m * D * D
    single_proj = 3 * s * D * D + s * D * D  # to_q/k/v, and proj_out's attention columns
    double_ffn = 2 * n * D * 4 * D + 2 * m * D * 4 * D
    single_ffn = s * D * 4 * D + s * 4 * D * D  # proj_mlp, and proj_out's MLP columns
    assert split_of(profile) == (core, double_proj + 2 * single_proj, double_ffn + 2 * single_ffn)
    note = next(note for note in profile.notes if note.startswith(COND))
    assert note.endswith(f": {2 * D * 6 * D + 2 * D * 3 * D:,} MAC")  # norm1, norm1_context; each single norm


def test_unet_cross_attention_blocks():
    diffusers = pytest.importorskip("diffusers", reason="diffusers (a test extra) is not installed")

    def unet():
        return diffusers.UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=48, attention_head_dim=16, norm_num_groups=8)

    m = 8
    inputs = dict(sample=torch.randn(1, 4, 8, 8), timestep=torch.ones(1, dtype=torch.long),
                  encoder_hidden_states=torch.randn(1, m, 48))
    profile = pa.profile(unet, inputs=inputs)

    def block(c, n):  # self-attention, cross-attention to the m caption tokens, GEGLU (c -> 8c, 4c -> c)
        return (2 * n * n * c + 2 * n * m * c, 4 * n * c * c + 2 * n * c * c + 2 * m * 48 * c, 12 * n * c * c)

    blocks = [block(32, 64), block(64, 16), block(32, 64), block(32, 64)]  # down, mid, two up
    assert split_of(profile) == tuple(sum(part) for part in zip(*blocks))


# --- what cannot be counted says what to do -------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_jagged_inputs_get_the_plugins_error_with_a_hint_that_works(backend):
    model = cait()
    x = torch.nested.nested_tensor([torch.randn(5, D), torch.randn(7, D)], layout=torch.jagged)
    with pytest.raises(ProfileError, match="nested .jagged. tensor of 2 sequences") as info:
        pa.profile(model, inputs=(x,), backend=backend)
    assert "x.unbind()" in str(info.value) and "to_padded_tensor" in str(info.value)
    each = sum(pa.profile(model, inputs=(seq.unsqueeze(0),), backend=backend).attention_core for seq in x.unbind())
    assert each == L * (2 * (5 * 5 + 7 * 7) * D + 2 * (5 * 5 + 7 * 7) * H * H)
    padded = pa.profile(model, inputs=(x.to_padded_tensor(0.0),), backend=backend)
    assert padded.attention_core == L * 2 * (2 * 7 * 7 * D + 2 * 7 * 7 * H * H)


def test_fsdp2_gets_the_plugins_error_with_a_hint(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = cait()
        fully_shard(model)
        with pytest.raises(CountError, match=r"(?s)sharded by FSDP2 .* count the model before fully_shard\(\)"):
            pa.profile(model, n=N, inputs=tokens)
    finally:
        dist.destroy_process_group()
