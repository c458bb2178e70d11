"""FlexAttention counted: hand-written models (the mask made in the forward, as torchtitan and gpt-fast do, or
outside and passed in) and transformers' ``attn_implementation="flex_attention"``, on both backends, built and
from a factory.

The hand formulas, per layer (width D = 64, H = 4 heads of DH = 16, n tokens, batch 1):

* projections: q, k, v, o are ``n·D·D`` each (with 2 kv heads, k and v are ``n·D·D/2``);
* under ``causal="full"`` the core is the dense n×m, every pair: ``2·H·n·n·DH`` (QK^T and AV);
* under ``causal="kept"`` it is ``2·DH·Σ pairs kept``, summed over heads: causal ``n(n+1)/2`` per head, a sliding
  window of W tokens ``Σ_i min(i+1, W)``, document masks each document's triangle.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

flex = pytest.importorskip("torch.nn.attention.flex_attention", reason="torch without FlexAttention")
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

from pytest_attncost import profile  # noqa: E402
from pytest_attncost.counting.flex import mask_keeps  # noqa: E402

D, H, DH, V, N = 64, 4, 16, 100, 40
BACKENDS = ("fvcore", "torch")


def causal_mask(b, h, q, k):
    return q >= k


def window_mask(width):
    def inner(b, h, q, k):
        return (q >= k) & (q - k < width)

    return inner


def per_head_window(b, h, q, k):
    return (q >= k) & (q - k < 4 * (h + 1))  # head h sees its last 4(h+1) tokens


def window_pairs(n: int, width: int) -> int:
    return sum(min(i + 1, width) for i in range(n))


class Attention(nn.Module):
    def __init__(self, mask=None, kv_heads: int = H, score_mod=None) -> None:
        super().__init__()
        self.mask, self.kv_heads, self.score_mod = mask, kv_heads, score_mod
        self.q = nn.Linear(D, D, bias=False)
        self.kv = nn.Linear(D, 2 * kv_heads * DH, bias=False)
        self.o = nn.Linear(D, D, bias=False)

    def forward(self, x, block_mask=None):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, H, DH).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, DH).permute(2, 0, 3, 1, 4)
        if block_mask is None and self.mask is not None:  # made in the forward, per call
            block_mask = create_block_mask(self.mask, None, H, t, t, device=x.device)
        y = flex_attention(q, k, v, score_mod=self.score_mod, block_mask=block_mask,
                           enable_gqa=self.kv_heads != H)
        return self.o(y.transpose(1, 2).reshape(b, t, D))


class Model(nn.Module):
    def __init__(self, mask=None, kv_heads: int = H, score_mod=None) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Attention(mask, kv_heads, score_mod) for _ in range(2)])
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids, block_mask=None):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x, block_mask)
        return self.head(x)


def proj(n: int, kv_heads: int = H) -> int:
    return 2 * (n * D * D + n * D * kv_heads * DH)  # q and o; k and v


def ids(n: int = N) -> torch.Tensor:
    return torch.zeros(1, n, dtype=torch.long)


# -- the mask evaluated --------------------------------------------------------------------------------------------

def test_mask_keeps_counts_the_pairs_causal_window_and_documents_keep() -> None:
    assert mask_keeps(causal_mask, 1, 1, 40, 40) == ((40 * 41 // 2, 1600), True)
    assert mask_keeps(window_mask(8), 2, 3, 40, 40) == ((6 * (8 * 9 // 2 + 32 * 8), 6 * 1600), False)
    docs = torch.tensor([0] * 10 + [1] * 25 + [2] * 5)
    kept, _ = mask_keeps(lambda b, h, q, k: (docs[q] == docs[k]) & (q >= k), 1, 1, 40, 40)
    assert kept == (55 + 325 + 15, 1600)
    # per head: head h keeps sum_i min(i+1, 4(h+1))
    assert mask_keeps(per_head_window, 1, H, 40, 40)[0][0] == sum(window_pairs(40, 4 * (h + 1)) for h in range(H))


def test_mask_keeps_evaluates_a_long_sequence_a_block_of_rows_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules["pytest_attncost.counting.flex"], "_BLOCK", 3000 * 7)  # 7 rows a block
    assert mask_keeps(window_mask(100), 1, 1, 3000, 3000) == ((100 * 101 // 2 + 2900 * 100, 3000 * 3000), False)
    assert mask_keeps(causal_mask, 1, 1, 3000, 3000) == ((3000 * 3001 // 2, 3000 * 3000), True)


def test_a_mask_that_reads_meta_tensors_is_refused_with_the_reason() -> None:
    docs = torch.zeros(40, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"reads a tensor of shape \(40,\) that holds no values"):
        mask_keeps(lambda b, h, q, k: docs[q] == docs[k], 1, 1, 40, 40)


# -- hand-written models -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_full_counts_the_dense_n_by_n_and_says_so(backend: str) -> None:
    for model in (Model(causal_mask), lambda: Model(causal_mask)):  # built, and a factory (on the meta device)
        p = profile(model, inputs=(ids(),), backend=backend)
        assert (p.attention_core, p.attention_proj) == (2 * 2 * H * N * N * DH, 2 * proj(N))
        assert p.other == N * D * V and p.warnings == ()
        assert any("FlexAttention counted as the dense n×m" in note for note in p.notes)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("mask", "pairs"), [
    (causal_mask, H * N * (N + 1) // 2),
    (window_mask(8), H * window_pairs(N, 8)),
    (per_head_window, sum(window_pairs(N, 4 * (h + 1)) for h in range(H))),
], ids=["causal", "window", "per-head-window"])
def test_kept_counts_the_pairs_the_mask_keeps_per_head_and_layer(backend: str, mask, pairs: int) -> None:
    models = (Model(mask), lambda: Model(mask)) if mask is causal_mask else (Model(mask),)  # built; a factory
    for model in models:
        p = profile(model, inputs=(ids(),), backend=backend, causal="kept")
        assert p.attention_core == 2 * 2 * DH * pairs  # 2 layers, QK^T and AV
        assert (p.attention_proj, p.causal_applied, p.warnings) == (2 * proj(N), True, ())
        assert any("FlexAttention counted over the query-key pairs its mask_mod keeps" in note for note in p.notes)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_document_mask_made_outside_and_grouped_query_heads(backend: str) -> None:
    docs = torch.tensor([0] * 10 + [1] * 25 + [2] * 5)

    def document(b, h, q, k):
        return (docs[q] == docs[k]) & (q >= k)

    mask = create_block_mask(document, 1, None, N, N, device="cpu")
    model = Model(kv_heads=2)
    full = profile(model, inputs=(ids(), mask), backend=backend)
    kept = profile(model, inputs=(ids(), mask), backend=backend, causal="kept")
    assert (full.attention_core, full.attention_proj) == (2 * 2 * H * N * N * DH, 2 * proj(N, kv_heads=2))
    assert kept.attention_core == 2 * 2 * DH * H * (55 + 325 + 15)  # each document's triangle, every query head
    assert kept.warnings == ()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mask_that_differs_per_batch_entry(backend: str) -> None:
    docs = torch.tensor([[0] * 20 + [1] * 20, [0] * 40])  # two documents in the first row, one in the second

    def document(b, h, q, k):
        return (docs[b, q] == docs[b, k]) & (q >= k)

    mask = create_block_mask(document, 2, None, N, N, device="cpu")
    p = profile(Model(), inputs=(torch.zeros(2, N, dtype=torch.long), mask), backend=backend, causal="kept")
    assert p.attention_core == 2 * 2 * DH * H * (2 * 20 * 21 // 2 + 40 * 41 // 2)
    assert p.batch == 2 and p.warnings == ()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_score_mod_changes_no_mac(backend: str) -> None:
    def alibi(score, b, h, q, k):
        return score - (h + 1) * (q - k).abs()

    plain = profile(Model(causal_mask), inputs=(ids(),), backend=backend, causal="kept")
    modded = profile(Model(causal_mask, score_mod=alibi), inputs=(ids(),), backend=backend, causal="kept")
    alone = profile(Model(score_mod=alibi), inputs=(ids(),), backend=backend, causal="kept")  # no block mask
    assert plain.attention_core == modded.attention_core == 2 * 2 * DH * H * N * (N + 1) // 2
    assert alone.attention_core == 2 * 2 * H * N * N * DH and alone.warnings == ()


class DocumentsFromTokens(Model):
    """Document ids read from the tokens in the forward (torchtitan's packing): a mask that reads data."""

    def forward(self, ids, block_mask=None):
        docs = (ids == 0).cumsum(-1)[0]

        def document(b, h, q, k):
            return docs[q] == docs[k]

        return super().forward(ids, create_block_mask(document, None, None, ids.shape[1], ids.shape[1],
                                                      device=ids.device))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mask_that_reads_data_in_the_forward_is_counted_in_full_with_a_warning(backend: str) -> None:
    p = profile(DocumentsFromTokens(), inputs=(ids(),), backend=backend, causal="kept")
    assert p.attention_core == 2 * 2 * H * N * N * DH
    flex_warnings = [w for w in p.warnings if w.startswith("FlexAttention in layers.")]
    assert [w.split(":")[0] for w in flex_warnings] == ["FlexAttention in layers.0", "FlexAttention in layers.1"]
    assert "could not be evaluated (it reads a tensor of shape (40,) that holds no values" in flex_warnings[0]
    assert "build the BlockMask outside the model" in flex_warnings[0]


def compiled() -> nn.Module:
    """torchtitan keeps a compiled flex_attention as a class attribute. Made by the test that uses it, not at import:
    torch.compile imports inductor, seconds every xdist worker's collection would pay."""

    class Compiled(nn.Module):
        flex = torch.compile(flex_attention)

        def __init__(self) -> None:
            super().__init__()
            self.inner = Model(causal_mask)

        def forward(self, ids):
            x = self.inner.embed(ids)
            q = x.view(1, ids.shape[1], H, DH).transpose(1, 2)
            return self.flex(q, q, q).sum()

    return Compiled()


def test_the_stand_ins_are_put_back_and_the_users_model_is_untouched() -> None:
    model = compiled()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    def bindings():
        return flex.flex_attention, flex.create_block_mask, globals()["flex_attention"], type(model).flex

    globals_before = bindings()
    for backend in BACKENDS:
        p = profile(model, inputs=(ids(),), backend=backend)
        assert p.attention_core == H * N * N * 2 * DH  # the compiled flex too: QK^T and AV, dense
    assert bindings() == globals_before
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.device.type == "cpu" for p in model.parameters())


# -- transformers --------------------------------------------------------------------------------------------------

def _llama(cls_name: str = "Llama", **extra):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{cls_name}Config")(
        vocab_size=128, hidden_size=D, intermediate_size=128, num_hidden_layers=2, num_attention_heads=H,
        num_key_value_heads=2, max_position_embeddings=256, attn_implementation="flex_attention", **extra)
    return getattr(transformers, f"{cls_name}ForCausalLM")(config)


@pytest.mark.parametrize("backend", BACKENDS)
def test_transformers_flex_llama_built_and_from_a_factory(backend: str) -> None:
    for model in (_llama(), _llama):
        full = profile(model, n=N, backend=backend)
        kept = profile(model, n=N, backend=backend, causal="kept")
        assert full.attention_core == 2 * 2 * H * N * N * DH
        assert kept.attention_core == 2 * 2 * H * DH * N * (N + 1) // 2
        assert full.warnings == kept.warnings == ()
        assert full.attention_proj == 2 * proj(N, kv_heads=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_transformers_flex_mistral_keeps_its_sliding_window(backend: str) -> None:
    p = profile(_llama("Mistral", sliding_window=8), n=N, backend=backend, causal="kept")
    assert p.attention_core == 2 * 2 * H * DH * window_pairs(N, 8)
    assert p.warnings == ()


# -- as a user runs it ---------------------------------------------------------------------------------------------

TEST_FILE = '''
import pytest
from test_flex import Model, causal_mask, window_mask


import torch


@pytest.mark.attncost(n=40)
def test_window(attncost):
    attncost.profile(Model(window_mask(8)), inputs=(torch.zeros(1, 40, dtype=torch.long),), causal="kept")
'''


def test_a_pytest_run_reports_the_kept_pairs_and_the_note(pytester: pytest.Pytester) -> None:
    pytester.syspathinsert(str(__import__("pathlib").Path(__file__).parent))
    pytester.makepyfile(test_user=TEST_FILE)
    result = pytester.runpytest("--attncost-json=out.json", "-p", "no:randomly")
    result.assert_outcomes(passed=1)
    row = json.loads((pytester.path / "out.json").read_text())["profiles"][0]
    assert row["attention_core"] == 2 * 2 * DH * H * window_pairs(N, 8)
    assert any("FlexAttention counted over the query-key pairs its mask_mod keeps" in note for note in row["notes"])
