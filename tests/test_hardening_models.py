"""Models users bring in their first week: each gets a correct count or a clear error, and stays as it was."""

import pytest
import torch
from torch import nn

import tiny_models as tm
from pytest_attncost import ProfileError, api, profile

D, H, F = tm.HIDDEN, tm.HEADS, tm.FFN


def core(n, b=1, layers=1):
    return layers * b * 2 * n * n * D  # 2 b n^2 h d, with h d = D


class Wrapper(nn.Module):
    """One encoder layer, returning its output in a container of the caller's choice."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.layer = nn.TransformerEncoderLayer(D, H, F, batch_first=True)

    def forward(self, x):
        y = self.layer(x)
        if self.kind == "dict":
            return {"hidden": y, "note": "text"}
        if self.kind == "tuple":
            return y, (y.sum(), None)
        if self.kind == "model_output":
            from transformers.modeling_outputs import BaseModelOutput

            return BaseModelOutput(last_hidden_state=y)
        return None


@pytest.mark.parametrize("kind", ["dict", "tuple", "model_output", "none"])
def test_any_return_type(kind):
    result = profile(Wrapper(kind), inputs=(torch.zeros(1, 32, D),))
    assert (result.attention_core, result.ffn) == (core(32), 2 * 32 * D * F)


def test_forward_that_raises():
    class Broken(tm.HandWritten):
        def forward(self, x):
            raise ValueError("shape mismatch in my model")

    model = Broken()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ProfileError, match="could not trace Broken on the meta device: ValueError: shape mismatch"):
        profile(model, inputs=(torch.zeros(1, 8, D),), roles=tm.HAND_ROLES)  # the fallback fails too
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_data_dependent_control_flow_is_explained():
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(D, H, batch_first=True)

        def forward(self, x):
            return self.attn(x, x, x)[0] if bool(x.mean() >= 0) else x

    with pytest.raises(ProfileError, match=r"(?s)could not trace Gate.*no data-dependent Python control flow"):
        profile(Gate(), inputs=(torch.zeros(1, 8, D),), fallback=False)
    # with the fallback (the default) it is counted exactly, by torch's counter on real tensors
    result = profile(Gate(), inputs=(torch.zeros(1, 8, D),))
    assert result.backend == "torch" and "could not trace Gate" in result.fallback
    assert (result.attention_core, result.attention_proj) == (core(8), 4 * 8 * D * D)


def test_existing_hooks_fire_for_the_user_and_are_not_counted():
    model = tm.torch_encoder()
    calls = []
    extra = nn.Parameter(torch.randn(D, D))

    def hook(module, inputs, output):
        calls.append(1)
        return output @ extra  # a matmul the count must not include

    handle = model.layers[0].register_forward_hook(hook)
    result = profile(model, 16)
    assert calls == []
    assert result.attention_core == core(16, layers=2) and result.total == profile(tm.torch_encoder(), 16).total
    model(torch.zeros(1, 16, D))
    assert calls == [1]
    handle.remove()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_weights(dtype):
    model = tm.torch_encoder().to(dtype)
    result = profile(model, 32)
    assert result.attention_core == core(32, layers=2) and result.deviation == 0
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_factory_moving_to_cuda_gets_a_clear_error():
    if torch.cuda.is_available():
        pytest.importorskip("no_such_module", reason="this machine has a GPU: the CPU-only case cannot arise")
    with pytest.raises(ProfileError, match=r"the model factory .* failed on the meta device .*if it builds on the CPU, pass the built nn.Module instead; otherwise the error is the factory's own"):
        profile(lambda: tm.torch_encoder().to("cuda"), 16)


def test_inputs_callable_that_raises_is_named():
    def inputs(n, batch):
        raise RuntimeError("no such device")

    with pytest.raises(ProfileError, match=r"inputs\(n=16, batch=1\) raised RuntimeError: no such device"):
        profile(tm.torch_encoder(), 16, inputs=inputs)


@pytest.mark.filterwarnings("ignore:.*is deprecated:DeprecationWarning")  # torch.compile's own imports
def test_compiled_and_data_parallel_models_count_the_original():
    encoder = tm.torch_encoder()
    compiled = torch.compile(encoder)
    assert profile(compiled, 16).attention_core == core(16, layers=2)
    assert profile(nn.DataParallel(encoder), 16).attention_core == core(16, layers=2)


def test_tied_weights_stay_tied_and_count_per_use():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(D, H, batch_first=True)
            self.up = nn.Linear(D, D, bias=False)
            self.down = nn.Linear(D, D, bias=False)
            self.down.weight = self.up.weight  # tied
            self.unused = nn.Linear(D, 4 * D)  # never called

        def forward(self, x):
            x = self.attn(x, x, x)[0]
            return self.down(torch.relu(self.up(x)))

    model = Tied()
    result = profile(model, inputs=(torch.zeros(1, 8, D),), roles={"attention": ["attn"], "ffn": ["up", "down"]})
    assert result.ffn == 2 * 8 * D * D
    assert model.down.weight is model.up.weight and model.up.weight.device.type == "cpu"


def test_meta_model_from_the_user():
    with torch.device("meta"):
        model = tm.torch_encoder()
    assert profile(model, 64).attention_core == core(64, layers=2)


def test_mlp_with_ffn_roles_only():
    result = profile(tm.PlainMLP(), 16, inputs=(torch.zeros(1, 16, D),), roles={"ffn": ["*"]})
    assert (result.attention, result.attention_share, result.ffn) == (0, 0.0, 2 * 16 * D * F)


def test_huge_length():
    # 2**27 tokens still count exactly on meta: the n x n scores are 2**54 elements
    n = 2**27
    result = profile(nn.MultiheadAttention(D, H, batch_first=True), n)
    assert result.attention_core == 2 * n * n * D
    assert result.attention_proj == 4 * n * D * D
    # 2**31: the scores would be 2**62 floats, which torch cannot describe even on meta
    with pytest.raises(ProfileError, match=r"(?s)the length is too large to trace.*model_costs\(spec, n\)"):
        profile(nn.MultiheadAttention(D, H, batch_first=True), 2**31)


def test_sweep_of_a_factory_builds_it_once():
    built = []

    def factory():
        built.append(1)
        return tm.torch_encoder()

    api.sweep(factory, [8, 16, 32])
    assert built == [1]
