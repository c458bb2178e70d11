"""Today's PyTorch idioms counted like the models they came from (issue 33, parts 2 and 3).

* Activation checkpointing (``torch.utils.checkpoint`` both ways, transformers' ``gradient_checkpointing_enable()``,
  from 5.25 ``activation_checkpointing_enable()``): a checkpointed train step splits exactly like the same step
  without it, and the forward work run again inside the backward is reported apart (``Profile.recompute``), with
  model FLOPs (3x the forward) beside hardware FLOPs.
* Graphs without containers (``torch.export``'s ``module()``, ``unflatten``, the ``ExportedProgram`` itself,
  ``torch.fx.symbolic_trace``): scopes come from the nodes' ``nn_module_stack``, so layers, attention and the head
  are found as for the original model; a graph without that metadata is warned.

Every count is checked against a formula written here: D=32, H=2 heads of 16, N=8 tokens, 2 blocks of
qkv (D x 3D), o (D x D), QK^T and AV (H x N x N x 16 each), fc1 (D x 4D) and fc2 (4D x D), an embedding
projection (D x D) before them and a head (D x 10) after.
"""

from __future__ import annotations

import inspect
import json
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from pytest_attncost import profile
from pytest_attncost.counting.graphs import NO_SCOPES
from pytest_attncost.result import Profile

D, H, N, L, CLASSES = 32, 2, 8, 2, 10
HEAD_DIM = D // H

# one block's forward, by part
CORE = 2 * H * N * N * HEAD_DIM  # QK^T and AV: 4,096
PROJ = N * D * 3 * D + N * D * D  # qkv and o: 32,768
FC1 = FC2 = N * D * 4 * D  # 32,768 each
EMBED, HEAD = N * D * D, N * D * CLASSES  # 8,192 and 2,560
FORWARD = L * (CORE + PROJ + FC1 + FC2) + EMBED + HEAD  # 215,552


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.o = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, HEAD_DIM).permute(2, 0, 3, 1, 4)
        mixed = (q @ k.transpose(-1, -2)).softmax(-1) @ v
        return self.o(mixed.transpose(1, 2).reshape(b, n, D))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.fc1 = nn.Linear(D, 4 * D, bias=False)
        self.fc2 = nn.Linear(4 * D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.fc2(F.gelu(self.fc1(x)))


class Tiny(nn.Module):
    """Two blocks between an input projection and a head; *reentrant* None runs them plainly, else each under
    ``torch.utils.checkpoint`` of that kind."""

    def __init__(self, reentrant: bool | None = None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.embed = nn.Linear(D, D, bias=False)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.head = nn.Linear(D, CLASSES, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x) if self.reentrant is None else checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


def _x() -> torch.Tensor:
    return torch.randn(1, N, D)


def _split(p: Profile) -> tuple[int, int, int, int]:
    return p.attention_core, p.attention_proj, p.ffn, p.other


# --- 2. recompute is forward work ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_step() -> Profile:
    return profile(Tiny(), inputs=(_x(),), mode="train")


def test_a_train_step_without_checkpointing_is_three_forwards_and_recomputes_nothing(plain_step: Profile) -> None:
    # every product's backward is two products of its size; the input projection's input needs no gradient
    assert _split(plain_step) == (3 * L * CORE, 3 * L * PROJ, 3 * L * (FC1 + FC2), 2 * EMBED + 3 * HEAD)
    assert plain_step.recompute == {} and plain_step.forward_macs == FORWARD
    assert plain_step.model_flops == 6 * FORWARD == 1_293_312
    assert plain_step.hardware_flops == 2 * plain_step.total


@pytest.mark.parametrize(("reentrant", "early_stop", "recomputed"), [
    # reentrant: the whole block again, before its backward
    (True, True, {"attention_core": L * CORE, "attention_proj": L * PROJ, "ffn": L * (FC1 + FC2)}),
    # non-reentrant stops once the saved tensors are back: fc2's result is saved by nothing, fc2 is not rerun
    (False, True, {"attention_core": L * CORE, "attention_proj": L * PROJ, "ffn": L * FC1}),
    (False, False, {"attention_core": L * CORE, "attention_proj": L * PROJ, "ffn": L * (FC1 + FC2)}),
], ids=["reentrant", "non-reentrant", "non-reentrant-no-early-stop"])
def test_a_checkpointed_step_splits_like_the_plain_one_plus_its_recompute(
        plain_step: Profile, reentrant: bool, early_stop: bool, recomputed: dict[str, int]) -> None:
    with set_checkpoint_early_stop(early_stop):
        p = profile(Tiny(reentrant), inputs=(_x(),), mode="train")
    assert _split(p) == _split(plain_step) and p.by_module == plain_step.by_module
    assert p.recompute == recomputed
    assert p.forward_macs == FORWARD and p.model_flops == plain_step.model_flops
    assert p.hardware_flops == 2 * (plain_step.total + sum(recomputed.values()))
    assert f"activation checkpointing ran {sum(recomputed.values()):,} MAC of the forward again" in "\n".join(p.notes)
    assert not p.warnings


def test_a_train_profile_carries_its_recompute_and_both_flops_through_json() -> None:
    p = profile(Tiny(True), inputs=(_x(),), mode="train")
    data = json.loads(json.dumps(p.to_dict()))
    assert data["recompute"] == {"attention_core": L * CORE, "attention_proj": L * PROJ, "ffn": L * (FC1 + FC2)}
    assert (data["forward_macs"], data["model_flops"]) == (FORWARD, 6 * FORWARD)
    assert data["hardware_flops"] == 2 * (data["total"] + L * (CORE + PROJ + FC1 + FC2))
    assert Profile.from_dict(data) == p
    assert "recompute" not in profile(Tiny(), inputs=(_x(),)).to_dict()  # a forward profile keeps its form


class Fickle(nn.Module):
    """Runs another product when checkpointing calls it again: the recompute repeats no forward op."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.again = nn.Linear(D, D), nn.Linear(D, D, bias=False)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return (self.first if self.calls == 1 else self.again)(x)


class FickleStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.block, self.fickle = nn.Linear(D, D, bias=False), Block(), Fickle()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.fickle, self.block(self.embed(x)), use_reentrant=True)


def test_a_recompute_that_repeats_no_forward_op_is_warned() -> None:
    p = profile(FickleStep(), inputs=(_x(),), mode="train")
    assert p.recompute == {"other": N * D * D}
    assert [w for w in p.warnings if "match no forward op" in w] == [
        f"{N * D * D:,} MAC that activation checkpointing ran again in the backward (fickle.again) match no forward "
        "op (none of that op and shapes ran in the forward, or it was recomputed twice): counted in recompute as "
        "other (or the part roles= names)"]


# transformers' LLaMA: hidden 64, 4 heads of 16 (2 kv heads), FFN 128, 2 layers, 16 tokens
LD, LH, LKV, LI, LN = 64, 4, 2, 128, 16
L_CORE = 2 * LH * LN * LN * (LD // LH)
L_PROJ = LN * LD * (LD + 2 * LKV * (LD // LH) + LD)
L_MLP = LN * LD * LI  # each of gate, up and down


def _llama(checkpointing: dict | None) -> nn.Module:
    from transformers import LlamaConfig, LlamaModel

    model = LlamaModel(LlamaConfig(hidden_size=LD, intermediate_size=LI, num_hidden_layers=L, num_attention_heads=LH,
                                   num_key_value_heads=LKV, vocab_size=100, max_position_embeddings=64))
    if checkpointing is not None:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.25's name; the old one warns there
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    return model.train()


@pytest.mark.parametrize(("checkpointing", "mlp"), [
    # non-reentrant (transformers 5's default; 4's is reentrant): down_proj's result is saved by nothing
    ({"use_reentrant": False}, 2 * L_MLP),
    ({"use_reentrant": True}, 3 * L_MLP),
], ids=["non-reentrant", "reentrant"])
def test_transformers_gradient_checkpointing_splits_like_the_plain_step(checkpointing: dict, mlp: int) -> None:
    pytest.importorskip("transformers")
    plain = profile(_llama(None), n=LN, mode="train")
    p = profile(_llama(checkpointing), n=LN, mode="train")
    assert _split(plain) == (3 * L * L_CORE, 3 * L * L_PROJ, 3 * L * 3 * L_MLP, plain.other)
    assert _split(p) == _split(plain) and not p.warnings
    assert p.recompute == {"attention_core": L * L_CORE, "attention_proj": L * L_PROJ, "ffn": L * mlp}
    assert p.model_flops == plain.model_flops == 6 * plain.forward_macs


# --- 3. graphs without containers --------------------------------------------------------------------------

FORWARD_SPLIT = (L * CORE, L * PROJ, L * (FC1 + FC2), EMBED + HEAD)


def _graphs() -> dict[str, object]:
    model, x = Tiny(), _x()
    exported = torch.export.export(model, (x,))
    return {"export.module()": exported.module(), "ExportedProgram": exported,
            "unflatten": torch.export.unflatten(torch.export.export(model, (x,))),
            "fx.symbolic_trace": torch.fx.symbolic_trace(model)}


@pytest.fixture(scope="module")
def graphs() -> dict[str, object]:
    return _graphs()


@pytest.mark.parametrize("backend", ["fvcore", "torch"])
@pytest.mark.parametrize("kind", ["export.module()", "ExportedProgram", "unflatten", "fx.symbolic_trace"])
def test_a_graph_is_split_like_the_model_it_came_from(graphs: dict[str, object], kind: str, backend: str) -> None:
    p = profile(graphs[kind], inputs=(_x(),), backend=backend)
    assert _split(p) == FORWARD_SPLIT  # the head is other, not FFN
    assert p.layers == L and not p.warnings
    assert p.name == ("UnflattenedModule" if kind == "unflatten" else "Tiny")  # an exported graph: its model's class
    assert p.by_module["blocks.1.attn"] == CORE + PROJ and p.by_module["head"] == HEAD


def test_an_exported_transformers_model_keeps_its_layers_and_head() -> None:
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4's LLaMA builds its causal mask with vmap over a value read, which torch.export "
                    "cannot export (the user's export fails before any count)")
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = 100
    model = LlamaForCausalLM(LlamaConfig(hidden_size=LD, intermediate_size=LI, num_hidden_layers=L,
                                         num_attention_heads=LH, num_key_value_heads=LKV, vocab_size=vocab,
                                         max_position_embeddings=64)).eval()
    tokens = torch.zeros(1, LN, dtype=torch.long)
    exported = torch.export.export(model, (tokens,), {"use_cache": False})
    p = profile(exported, inputs={"input_ids": tokens, "use_cache": False})
    # the LM head (D x vocab per token) is other, not FFN
    assert _split(p) == (L * L_CORE, L * L_PROJ, L * 3 * L_MLP, LN * LD * vocab)
    assert p.layers == L and not p.warnings


def test_a_graph_without_module_paths_is_warned_not_made_one_layer_silently() -> None:
    traced = torch.fx.symbolic_trace(Tiny())
    for node in traced.graph.nodes:
        node.meta.pop("nn_module_stack", None)
    p = profile(traced, inputs=(_x(),))
    assert p.total == FORWARD
    assert p.warnings == (NO_SCOPES.format(name="Tiny"),)
    assert "nn_module_stack" in p.warnings[0] and "exported.module()" in p.warnings[0]


def test_a_users_suite_gates_the_step_with_or_without_its_recompute(project: pytest.Pytester) -> None:
    plain = 3 * L * (CORE + PROJ + FC1 + FC2) + 2 * EMBED + 3 * HEAD  # 638,464: the step without checkpointing
    executed = plain + L * (CORE + PROJ + FC1 + FC2)  # 843,264: and the reentrant recompute
    source = "\n\n".join(inspect.getsource(c) for c in (Attention, Block, Tiny))
    project.makepyfile(test_idiom_suite=f"""
        import pytest
        import torch
        import torch.nn.functional as F
        from torch import nn
        from torch.utils.checkpoint import checkpoint

        D, H, HEAD_DIM, L, CLASSES = {D}, {H}, {HEAD_DIM}, {L}, {CLASSES}

{textwrap.indent(source, " " * 8)}

        @pytest.mark.attncost(mode="train", total_max={plain}, executed_max={executed})
        def test_within(attncost):
            attncost.profile(Tiny(True), inputs=(torch.randn(1, {N}, D),))

        @pytest.mark.attncost(mode="train", executed_max={executed - 1})
        def test_recompute_over(attncost):
            attncost.profile(Tiny(True), inputs=(torch.randn(1, {N}, D),))

        def test_flat(attncost):
            traced = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(D, D), nn.ReLU()))
            for node in traced.graph.nodes:
                node.meta.pop("nn_module_stack", None)
            attncost.profile(traced, inputs=(torch.randn(1, {N}, D),), roles={{"ffn": ["*"]}}, n={N})
    """)
    result = project.runpytest("--attncost-strict", "--attncost-json=out.json")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines([f"*attncost: executed 843K MAC > executed_max 843K MAC at n={N} "
                                 "(843,264 > 843,263 MAC; the recompute of activation checkpointing 205K MAC)*"])
    result.stdout.fnmatch_lines(["*test_flat*", "*carry no nn_module_stack*"])
    steps = [p for p in json.loads((project.path / "out.json").read_text())["profiles"] if p["mode"] == "train"]
    assert steps and all(step["hardware_flops"] == 2 * executed and step["model_flops"] == 6 * FORWARD
                         for step in steps)
