"""Auditing a user's FLOPs formula against the count (issue 27, part 2): a correct formula passes at tolerance 0,
and each of the errors training frameworks shipped is named: causal attention not halved, an embedding lookup
counted as a matrix product, every expert of a mixture counted."""

from __future__ import annotations

from fractions import Fraction

import pytest
import transformers

from pytest_attncost import Formula, ModelSpec, sweep
from pytest_attncost.conventions import audit
from pytest_attncost.markers import MarkerError, parse_marker_kwargs

pytestmark = pytest.mark.shared_profiles  # its runs are about a user's formula and its verdicts (conftest.project)

# a tiny LLaMA: vocabulary, width, layers, query heads, K/V heads, head size, FFN width
V, D, L, H, G, Q, F = 100, 64, 2, 4, 2, 16, 96
LENGTHS = [16, 32, 64]
# transformers 4 builds LLaMA's rotary table with a product ([d/2, 1] @ [1, n]: n·d/2 MAC, counted in other);
# transformers 5 does not: a correct formula of what runs has it on 4
ROTARY = Q // 2 if int(transformers.__version__.split(".")[0]) < 5 else 0


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
                                        num_key_value_heads=G, intermediate_size=F))


def correct(n: int) -> int:
    """FLOPs of one sequence of n tokens, written as a careful user would: 2 FLOP per MAC."""
    proj = n * L * (2 * D * H * Q + 2 * D * G * Q)  # Q and O at every head; K and V at the G K/V heads
    ffn = n * L * 3 * D * F  # gate, up, down
    core = L * 2 * H * Q * (n * (n + 1) // 2)  # QKᵀ and AV over the n(n+1)/2 pairs a causal mask keeps
    head = n * V * D
    return 2 * (proj + ffn + core + head + n * ROTARY)


def causal_not_halved(n: int) -> int:
    return correct(n) + 2 * L * 2 * H * Q * (n * n - n * (n + 1) // 2)  # the n x n product


def embedding_as_matmul(n: int) -> int:
    return correct(n) + 2 * n * V * D  # the lookup charged as [n, V] @ [V, D]


def n_squared_over_two(n: int) -> int:
    return correct(n) - 2 * L * H * Q * n  # 2·L·h·d·n²/2 instead of 2·L·h·d·n(n+1)/2


@pytest.fixture(scope="module")
def counted():
    return sweep(llama, LENGTHS, causal="half")


def test_the_count_is_what_the_correct_formula_says(counted):
    # the hand formula in MAC, independently of the audit: n=16 -> 1,146,880 + 16·100·64
    assert [p.total for p in counted] == [correct(n) // 2 for n in LENGTHS]
    assert counted[0].total == (16 * L * (2 * D * H * Q + 2 * D * G * Q + 3 * D * F) + L * 2 * H * Q * 136 + 16 * V * D
                                + 16 * ROTARY)


def test_a_correct_formula_passes_at_tolerance_0(counted):
    result = counted.audit(Formula(correct, vocab=V))
    assert result.ok and result.terms == ()
    assert str(result) == "formula correct agrees with the count at n = 16, 32, 64 (tolerance 0)"
    assert [row[1] for row in result.rows] == [Fraction(correct(n), 2) for n in LENGTHS]


def test_causal_attention_not_halved_is_named(counted):
    result = counted.audit(Formula(causal_not_halved, vocab=V))
    assert not result.ok
    # at n=64: 2 layers x 4 heads x 2 products x 16 x (4096 - 2080) pairs = 516,096 MAC
    assert result.terms == (("causal attention not halved: the n×n product, where the count keeps the n(n+1)/2 pairs",
                             tuple(L * 2 * H * Q * (n * n - n * (n + 1) // 2) for n in LENGTHS)),)
    count = correct(64) // 2  # 4,874,240 MAC (+512 of rotary table on transformers 4)
    assert str(result).startswith(f"formula causal_not_halved gives {count + 516_096:,} MAC at n=64 where the count "
                                  f"is {count:,} (+10.59%; tolerance 0): causal attention not halved")
    assert str(result).endswith("(+516,096 MAC)")


def test_an_embedding_counted_as_a_matrix_product_is_named(counted):
    result = counted.audit(Formula(embedding_as_matmul, vocab=V))
    assert [term for term, _ in result.terms] == [
        "n·V·D more: an embedding lookup counted as a matrix product, or an output head the count does not have"]
    assert result.terms[0][1] == tuple(n * V * D for n in LENGTHS)


def test_the_diagonal_left_out_by_n_squared_over_two_is_named(counted):
    result = counted.audit(Formula(n_squared_over_two, vocab=V))
    assert [term for term, _ in result.terms] == [
        "causal attention halved as n²/2: the diagonal's L·h·d·n pairs left out of the n(n+1)/2"]
    assert result.terms[0][1] == tuple(-L * H * Q * n for n in LENGTHS)


def test_a_formula_per_token_in_mac_and_the_head_left_out(counted):
    def per_token(n: int) -> Fraction:
        return Fraction(correct(n) - 2 * n * V * D, 2 * n)  # MAC per token, without the head

    result = counted.audit(Formula(per_token, per="token", unit="MAC", vocab=V))
    assert [term for term, _ in result.terms] == ["the output head (n·V·D) left out"]


def test_a_formula_of_the_spec_and_n(counted):
    def from_spec(spec: ModelSpec, n: int) -> int:  # what a config-driven FLOPs helper looks like
        width = spec.heads * spec.head_dim
        proj = n * spec.layers * (2 * spec.hidden * width + 2 * spec.hidden * spec.g * spec.head_dim)
        core = spec.layers * 2 * width * n * (n + 1) // 2
        return 2 * (proj + n * spec.layers * 3 * spec.hidden * spec.ffn_dim + core + n * V * spec.hidden + n * ROTARY)

    assert counted.audit(from_spec).ok
    with pytest.raises(ValueError, match="takes \\(spec, n\\), and the profile has no spec"):
        audit(from_spec, [(16, 1, 0, 0)], None)


def test_a_difference_of_no_known_form_is_said_to_be_so(counted):
    result = counted.audit(Formula(lambda n: correct(n) + 2 * 7 * n, vocab=V))
    assert not result.ok and result.terms is None
    assert "is none of the known terms" in str(result)
    assert counted.audit(Formula(lambda n: correct(n) + 2 * 7 * n, tolerance=0.01)).ok


def test_a_pooler_left_out_is_named():
    from tiny_models import FFN, HEAD_DIM, HEADS, HIDDEN, LAYERS, bert_like

    def layers_only(n: int) -> int:  # the layers' products, without the norms and BERT's pooler
        return 2 * LAYERS * (4 * n * HIDDEN * HEADS * HEAD_DIM + 2 * n * HIDDEN * FFN + 2 * HEADS * n * n * HEAD_DIM)

    result = sweep(bert_like, [16, 32]).audit(layers_only)
    assert [term for term, _ in result.terms] == [
        "the count's other part left out (beyond the head: norms, poolers, classifiers, rotary tables; "
        "Profile.table() names them)"]
    # fvcore counts 5 MAC an element for each LayerNorm (the embeddings' and two a layer), the pooler D·D
    assert result.terms[0][1] == tuple(-(5 * n * HIDDEN * (1 + 2 * LAYERS) + HIDDEN * HIDDEN) for n in (16, 32))


def test_every_expert_counted_is_named():
    from transformers import MixtralConfig, MixtralForCausalLM

    experts, top_k, width = 4, 2, 32

    def all_experts(n: int) -> int:
        proj = n * L * (2 * D * H * Q + 2 * D * G * Q)
        moe = n * L * (experts * 3 * D * width + D * experts)  # every expert, and the router
        return 2 * (proj + moe + L * 2 * H * Q * n * n + n * V * D + n * ROTARY)

    model = MixtralForCausalLM(MixtralConfig(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
                                             num_key_value_heads=G, intermediate_size=width,
                                             num_local_experts=experts, num_experts_per_tok=top_k))
    result = sweep(model, [16, 32]).audit(Formula(all_experts, vocab=V))
    # per token and layer, the two experts not routed to: 2 x 3 x 64 x 32 = 12,288 MAC
    assert result.terms == (("every expert counted (4), not the top 2 a token is routed to",
                             tuple(n * L * 12_288 for n in (16, 32))),)


def test_the_audit_is_torch_free_over_hand_made_points():
    spec = ModelSpec(hidden=8, heads=2, head_dim=4, layers=1, ffn_dim=16)
    # n=4: projections 4·4·8·8 = 1,024, FFN 4·2·8·16 = 1,024, core 2·2·4·16 = 256
    points = [(4, 2304, 256, 0), (8, 2 * 2048 + 1024, 1024, 0)]
    assert audit(lambda n: 2 * (4 * 8 * 8 * n + 2 * 8 * 16 * n + 2 * 2 * 4 * n * n), points, spec).ok
    missing = audit(lambda n: 2 * (4 * 8 * 8 * n + 2 * 8 * 16 * n), points, spec)
    assert missing.terms == (("the n² attention core (QKᵀ and AV) missing", (-256, -1024)),)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(per="batch"), "per= must be one of 'sequence', 'token'"),
    (dict(unit="GFLOP"), "unit= must be one of 'FLOP', 'MAC'"),
    (dict(vocab=-1), "vocab= must be an int >= 0"),
    (dict(tolerance=-0.1), "tolerance= must be a number >= 0"),
])
def test_a_malformed_formula_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Formula(correct, **kwargs)


def test_a_formula_that_returns_no_number_is_named(counted):
    with pytest.raises(ValueError, match=r"formula <lambda>\(16\) returned None, not a number of FLOP"):
        counted.audit(lambda n: None)


def test_the_marker_takes_a_function_or_a_formula():
    assert parse_marker_kwargs((), {"audit": correct}).audit == Formula(correct)
    with pytest.raises(MarkerError, match="audit takes a function n -> FLOPs of one sequence"):
        parse_marker_kwargs((), {"audit": "6 * N * T"})


def test_the_marker_fails_with_the_named_error_and_passes_the_correct_formula(project):
    project.makepyfile(test_flops_formulas=f"""
        import pytest
        from pytest_attncost import Formula
        from tiny_models import *

        V, D, L, H, G, Q, F, ROTARY = {V}, {D}, {L}, {H}, {G}, {Q}, {F}, {ROTARY}

        def llama():
            from transformers import LlamaConfig, LlamaForCausalLM
            return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=D, num_hidden_layers=L,
                                                num_attention_heads=H, num_key_value_heads=G, intermediate_size=F))

        def correct(n):
            proj = n * L * (2 * D * H * Q + 2 * D * G * Q)
            return 2 * (proj + n * L * 3 * D * F + L * 2 * H * Q * (n * (n + 1) // 2) + n * V * D + n * ROTARY)

        def not_halved(n):
            return correct(n) + 2 * L * 2 * H * Q * (n * n - n * (n + 1) // 2)

        @pytest.mark.attncost(n=32, audit=Formula(correct, vocab=V))
        def test_correct(attncost):
            attncost.profile(llama, causal="half")

        @pytest.mark.attncost(audit=Formula(not_halved, vocab=V))
        def test_not_halved(attncost):
            attncost.sweep(llama, [16, 32], causal="half")
    """)
    result = project.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*attncost: sweep of LlamaForCausalLM: formula not_halved gives * MAC at n=32 where the count is * "
        "(+*%; tolerance 0): causal attention not halved: the n×n product, where the count keeps the n(n+1)/2 "
        "pairs (+126,976 MAC)",
    ])


def test_the_marker_audits_a_single_length_sweep_and_a_lone_profile_and_keeps_a_skip(project):
    project.makepyfile(test_more_formulas="""
        import pytest
        from tiny_models import llama_like

        def zero(n):
            return 0

        def nothing(n):
            return None

        @pytest.mark.attncost(audit=zero)
        def test_one_length(attncost):
            attncost.sweep(llama_like, [16])

        @pytest.mark.attncost(audit=zero)
        def test_beside_a_sweep(attncost):
            attncost.sweep(llama_like, [16, 32])
            attncost.profile(llama_like, 24)

        @pytest.mark.attncost(n=16, audit=nothing)
        def test_skipped(attncost):
            attncost.profile(llama_like)
            pytest.skip("the body's own outcome")

        @pytest.mark.attncost(n=16, audit=nothing)
        def test_no_number(attncost):
            attncost.profile(llama_like)
    """)
    result = project.runpytest("-p", "no:randomly", "-rfs")
    result.assert_outcomes(failed=3, skipped=1)
    result.stdout.fnmatch_lines([
        "attncost: *formula zero gives 0 MAC at n=16 where the count is *",  # a sweep of one length, alone
        # beside a sweep of two lengths, a lone profile is audited alone and the sweep over its lengths
        "  LlamaModel: formula zero gives 0 MAC at n=24 where the count is *",
        "  sweep of LlamaModel: formula zero gives 0 MAC at n=16 where the count is *; the difference at n = 16, 32 *",
        "*audit=nothing: formula nothing(16) returned None, not a number of FLOP at n=16*",
        "SKIPPED * the body's own outcome",
    ])
