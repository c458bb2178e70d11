"""The split on its own: hand-built records in, parts out (no torch, no model).

Each record says which earlier products reach its operands (``sources``); the split follows that data
flow (see ``pytest_attncost.roles``). Records here are written the way the counters write them.
"""

from __future__ import annotations

import re

import pytest

from pytest_attncost import parts, roles
from pytest_attncost.errors import ProfileError
from pytest_attncost.ops import OpRecord

MAT = ((2, 4, 8), (8, 8))  # a token matrix and a weight: any product with a parameter
SCORES = (2, 4, 8, 8)  # [b, h, n, m]


def param(scope: str, *sources: int, macs: int = 10) -> OpRecord:
    return OpRecord("aten::linear", scope, macs, "param", MAT, (2, 8, 8), sources=(tuple(sources), ()))


def act(scope: str, left: tuple[int, ...], right: tuple[int, ...], out: tuple[int, ...] = SCORES,
        macs: int = 3) -> OpRecord:
    return OpRecord("aten::matmul", scope, macs, "activation", ((2, 4, 8, 2), (2, 4, 2, 8)), out,
                    sources=(left, right))


def attention(prefix: str, start: int, *stream: int, out: str | None = None) -> list[OpRecord]:
    """q, k, v, QK^T, AV, o of one attention call whose input is reached by *stream*, from index *start*."""
    q, k, v, qk, av = (start + i for i in range(5))
    return [param(f"{prefix}.to_q", *stream), param(f"{prefix}.to_k", *stream), param(f"{prefix}.to_v", *stream),
            act(f"{prefix}.attend", (q,), (k,)), act(f"{prefix}.attend", (qk,), (v,), out=(2, 4, 8, 2)),
            param(out or f"{prefix}.to_out", av)]


def parts_of(records: list[OpRecord], containers: list[str], outputs: tuple[int, ...] = ()) -> list[str]:
    return list(roles.find_structure(records, containers, outputs=outputs).parts)


def test_attention_and_ffn_blocks_in_one_list_form_layers() -> None:
    # x-transformers: layers[i] is itself a list; attention and FFN blocks alternate in the outer one
    records = attention("layers.0.1", 0)  # 0..5
    records += [param("layers.1.1.ff.0", 5), param("layers.1.1.ff.2", 6)]  # 6, 7
    records += attention("layers.2.1", 8, 5, 7)  # 8..13
    records += [param("layers.3.1.ff.0", 13, 7, 5), param("layers.3.1.ff.2", 14)]  # 14, 15
    containers = ["layers", *(f"layers.{i}" for i in range(4))]
    structure = roles.find_structure(records, containers)
    proj, core, ffn = "attention_proj", "attention_core", "ffn"
    assert list(structure.parts) == [proj, proj, proj, core, core, proj, ffn, ffn] * 2
    assert structure.layers == ("layers.0", "layers.2")
    assert structure.members == {"layers.1": "layers.0", "layers.3": "layers.2"}
    assert structure.attention == {"layers.0": ("layers.0.1",), "layers.2": ("layers.2.1",)}
    split = parts.split(records, structure.roles(), structure=structure)
    assert (split.attention_core, split.attention_proj, split.ffn) == (4 * 3, 8 * 10, 4 * 10)
    assert split.layer_ffn == {"layers.0": 20, "layers.2": 20} and structure.warnings == ()


def test_low_rank_and_gated_projections_are_projections() -> None:
    # q_a -> q_b -> core (feeds only a projection); a gate beside the result feeds only the output projection
    records = [param("blocks.0.attn.q_a"), param("blocks.0.attn.q_b", 0), param("blocks.0.attn.kv"),
               act("blocks.0.attn", (1,), (2,)), act("blocks.0.attn", (3,), (2,), out=(2, 4, 8, 2)),
               param("blocks.0.attn.gate"), param("blocks.0.attn.o", 4, 5),
               param("blocks.0.mlp.up", 6), param("blocks.0.mlp.down", 7)]
    assert parts_of(records, ["blocks"])[5:] == ["attention_proj", "attention_proj", "ffn", "ffn"]
    assert parts_of(records, ["blocks"])[:3] == ["attention_proj"] * 3


def test_scores_reaching_both_operands_are_no_attention() -> None:
    # x @ x^T of a residual stream that once carried scores: no chain (the scores would reach both operands)
    records = attention("blocks.0.attn", 0) + [param("blocks.0.mlp.up", 5), param("blocks.0.mlp.down", 6)]
    records += [act("blocks.0", (4, 7), (4, 7)), act("blocks.0", (8,), (8,))]  # 8, 9
    structure = roles.find_structure(records, ["blocks"])
    assert [structure.parts[i] for i in (3, 4, 8, 9)] == ["attention_core", "attention_core", "unplaced", "unplaced"]
    assert len(structure.groups) == 1


def test_a_table_of_positions_times_a_parameter_vector_is_no_projection() -> None:
    # rotary-embedding-torch: positions [n] x frequencies [d/2] (a parameter) feed q and k: a table, not a projection
    table = OpRecord("aten::einsum", "blocks.0.attn.rotary", 7, "param", ((8,), (4,)), (8, 4))
    records = [table, *attention("blocks.0.attn", 1, out="blocks.0.attn.to_out")]
    records[4] = act("blocks.0.attn.attend", (2, 0), (3, 0))  # q and k rotated by the table
    records += [param("blocks.0.mlp.up", 6), param("blocks.0.mlp.down", 7)]
    assert parts_of(records, ["blocks"])[0] == "other"


def test_attention_outside_the_layers_and_the_ffn_that_meets_its_result_again() -> None:
    records = attention("layers.0.attn", 0) + [param("layers.0.mlp.up", 5), param("layers.0.mlp.down", 6)]
    records += attention("pool.attn", 8, 5, 7)  # 8..13: attention over the layers' output, outside them
    records += [param("pool.mlp.up", 13), param("pool.mlp.down", 14)]  # 14, 15: its MLP, added back to it
    records += [param("head", 13)]  # 16: a head on the attention's result alone
    outputs = ((13, 15), (16,))  # the MLP's result meets the attention's in the first output; the head is the second
    structure = roles.find_structure(records, ["layers"], outputs=outputs)
    assert structure.outside == ("pool.attn",) and structure.layers == ("layers.0",)
    assert list(structure.parts[8:]) == ["attention_proj"] * 3 + ["attention_core"] * 2 + ["attention_proj",
                                                                                              "ffn", "ffn", "other"]
    split = parts.split(records, structure.roles(), structure=structure)
    assert split.outside == {"attention_core": 6, "attention_proj": 40, "ffn": 20}
    assert parts.outside_note(split, structure) == parts.OUTSIDE_NOTE.format(modules="pool.attn", core=6, proj=40,
                                                                             ffn=20)
    # without the residual around it, the MLP is no FFN of the block
    alone = roles.find_structure(records, ["layers"], outputs=((15,), (13,), (16,)))
    assert list(alone.parts[14:]) == ["other", "other", "other"]


def test_cross_attention_blocks_join_the_self_attention_layer_before_them() -> None:
    # a decoder list of self-attention, cross-attention (keys from the memory) and FFN blocks
    records = attention("layers.0.1", 0)  # 0..5, self-attention on the stream
    memory = OpRecord("aten::linear", "encoder.out", 10, "param", MAT, (2, 8, 8))  # 6: the memory
    records += [memory, param("layers.1.1.to_q", 5), param("layers.1.1.to_k", 6), param("layers.1.1.to_v", 6),
                act("layers.1.1.attend", (7,), (8,)), act("layers.1.1.attend", (10,), (9,), out=(2, 4, 8, 2)),
                param("layers.1.1.to_out", 11)]  # 7..12
    records += [param("layers.2.1.ff.0", 12, 5), param("layers.2.1.ff.2", 13)]  # 13, 14
    structure = roles.find_structure(records, ["layers", "layers.0", "layers.1", "layers.2"])
    assert structure.layers == ("layers.0",)
    assert structure.members == {"layers.1": "layers.0", "layers.2": "layers.0"}
    assert list(structure.parts[13:]) == ["ffn", "ffn"] and structure.parts[6] == "other"


def test_roles_given_by_the_user_place_by_module() -> None:
    records = attention("blocks.0.attn", 0) + [param("blocks.0.mlp.up", 5), param("blocks.0.mlp.down", 6)]
    classes = {"": "Model", "blocks": "ModuleList", "blocks.0": "Block", "blocks.0.attn": "Attention",
               "blocks.0.mlp": "FeedForward"}
    given = parts.explicit_roles({"attention": ["blocks.*.attn"], "ffn": ["blocks.*.mlp"]}, classes)
    split = parts.split(records, given)
    assert (split.attention_core, split.attention_proj, split.ffn) == (6, 40, 20)
    assert split.attention_modules == ["blocks.0.attn"] and split.lengths == [(8, 8, 8)]
    # the same modules by class name and by regular expression (a string or a compiled one)
    assert parts.explicit_roles({"attention": "class:Attention", "ffn": ["class:Feed*"]}, classes) == given
    assert parts.explicit_roles({"attention": [r"re:blocks\.\d+\.attn"], "ffn": re.compile(r".*\.mlp")},
                                classes) == given


def test_roles_that_match_nothing_or_are_no_patterns_are_errors_naming_the_modules() -> None:
    classes = {"": "Model", "blocks.0.attn": "Attention"}
    with pytest.raises(ProfileError, match=r"pattern 'class:Attn' matches no module; the modules are: "
                                           r"'blocks.0.attn' \(Attention\)"):
        parts.explicit_roles({"attention": ["class:Attn"]}, classes)
    with pytest.raises(ProfileError, match=r"'re:\(' is no regular expression"):
        parts.explicit_roles({"attention": ["re:("]}, classes)
    with pytest.raises(ProfileError, match=r"must hold module-name globs, 're:REGEX' or 'class:NAME' strings, got 3"):
        parts.explicit_roles({"ffn": [3]}, classes)


def linear(scope: str, x: tuple[int, ...], out: tuple[int, ...], *sources: int, macs: int = 10) -> OpRecord:
    """A parameter product of an input of shape *x* (its last dimension contracted) into *out*."""
    return OpRecord("aten::linear", scope, macs, "param", (x, (out[-1], x[-1])), out, sources=(tuple(sources), ()))


def test_a_projection_over_attention_concatenated_with_an_mlp_is_split_by_its_columns() -> None:
    # Flux: proj_out(cat([attention (8 columns), gelu(proj_mlp(x)) (24 columns)])): 1/4 attention, 3/4 FFN
    tokens = (2, 4, 8)
    records = [linear("b.0.q", tokens, tokens), linear("b.0.k", tokens, tokens), linear("b.0.v", tokens, tokens),
               OpRecord("aten::scaled_dot_product_attention", "b.0", 6, "activation", ((2, 2, 4, 4),) * 3,
                        (2, 2, 4, 4), sources=((0,), (1,), (2,))),
               linear("b.0.proj_mlp", tokens, (2, 4, 24)),
               linear("b.0.proj_out", (2, 4, 32), tokens, 3, 4, macs=40)]
    structure = roles.find_structure(records, ["b"])
    assert list(structure.parts) == ["attention_proj"] * 3 + ["attention_core", "ffn", "attention_proj"]
    assert structure.columns == {5: (("attention_proj", 8), ("ffn", 24))}  # columns, whatever the length
    split = parts.split(records, structure.roles(), structure=structure)
    assert (split.attention_proj, split.ffn) == (3 * 10 + 10, 10 + 30) and structure.warnings == ()


def test_products_on_the_batchs_rows_are_conditioning_and_lora_takes_the_part_it_adapts() -> None:
    tokens, rows = (2, 4, 8), (2, 8)  # 8 token rows; 2 rows: one per image of the batch (a timestep embedding)
    records = [linear("b.0.mod", rows, (2, 48)),  # adaLN: Linear(D, 6D) on the conditioning
               linear("b.0.q", tokens, tokens), linear("b.0.k", tokens, tokens), linear("b.0.v", tokens, tokens),
               OpRecord("aten::scaled_dot_product_attention", "b.0", 6, "activation", ((2, 2, 4, 4),) * 3,
                        (2, 2, 4, 4), sources=((1,), (2,), (3,))),
               linear("b.0.o", tokens, tokens, 4), linear("b.0.o.lora_A", tokens, (2, 4, 2), 4),  # 5, 6
               linear("b.0.o.lora_B", (2, 4, 2), tokens, 6),  # 7: fed only by A, writes where o writes
               linear("b.0.up", tokens, (2, 4, 32), 5, 7), linear("b.0.down", (2, 4, 32), tokens, 8)]
    structure = roles.find_structure(records, ["b"])
    assert list(structure.parts) == ["conditioning"] + ["attention_proj"] * 3 + ["attention_core"] + \
        ["attention_proj"] * 3 + ["ffn"] * 2
    split = parts.split(records, structure.roles(), structure=structure)
    assert split.conditioning == {"b.0.mod": 10} and split.other == 10
    assert parts.split_notes(split, structure) == [parts.CONDITIONING_NOTE.format(modules="b.0.mod", macs=10)]


def test_a_deep_residual_stream_splits_each_layer_with_sources_linear_in_depth() -> None:
    # 40 layers on one residual stream: each reads every earlier layer's o and down products, so a product's
    # sources grow with the depth; a low-rank query (q_a -> q_b) in every layer is found all the same
    from pytest_attncost.flow import NARROW, Flow

    records: list[OpRecord] = [param("embed")]
    stream = [0]
    for k in range(40):
        s, at = len(records), f"layers.{k}"
        records += [param(f"{at}.attn.q_a", *stream), param(f"{at}.attn.q_b", s), param(f"{at}.attn.k", *stream),
                    param(f"{at}.attn.v", *stream), act(f"{at}.attn", (s + 1,), (s + 2,)),
                    act(f"{at}.attn", (s + 4,), (s + 3,), out=(2, 4, 8, 2)), param(f"{at}.attn.o", s + 5),
                    param(f"{at}.mlp.up", *stream, s + 6), param(f"{at}.mlp.down", s + 7)]
        stream += [s + 6, s + 8]
    proj, core, ffn = "attention_proj", "attention_core", "ffn"
    structure = roles.find_structure(records, ["layers"])
    assert list(structure.parts) == ["other"] + [proj, proj, proj, proj, core, core, proj, ffn, ffn] * 40
    # the narrow sources are the matrix sources with at most NARROW consumers, in graph order; the stream's
    # first products feed 4 products a layer after them (q_a, k, v, up): far more
    flow = Flow(records)
    for user in flow.products:
        assert flow.narrow.get(user, []) == [s for s in sorted(records[user].fed_by) if s in flow.matrices
                                             and len(flow.consumers[s]) <= NARROW]
    assert len(flow.consumers[7]) > NARROW and 7 not in flow.narrow[len(records) - 9]  # layer 0's o, layer 39's q_a
    assert flow.narrow[len(records) - 8] == [len(records) - 9]  # layer 39's q_b is fed by its q_a
