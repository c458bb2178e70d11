"""Published FLOP conventions, in MACs for one forward pass, each with the terms in which it differs.

Each convention is a formula people report model FLOPs or MFU with. Here it is evaluated for a
:class:`~pytest_attncost.formulas.ModelSpec` at ``n`` tokens and set beside the exact count of the layers
(the plugin's ``causal="full"`` split: attention core, projections and FFN, ``b·n·N + 2·L·b·h·d·n²`` with
``N`` the layers' matrix parameters a token meets), so that every difference is a named term with its MACs:
the terms add up to the convention minus the exact count, to the MAC. 1 MAC = 2 FLOP throughout.

Sources: PaLM (Chowdhery et al. 2022, appendix B: ``6N + 12·L·H·Q·T`` per token for training, so
``2N + 4·L·H·Q·T`` forward); Megatron-LM's ``num_floating_point_operations`` as of 2024 (the output head
included, causal attention counted in full) and today's (causal attention halved as ``s/2``, as
FlashAttention's benchmarks and MaxText do); Kaplan et al. 2020 (``2N + 2·L·n_ctx·d_attn``); Hoffmann et al.
2022, appendix F (Chinchilla: embeddings as a matrix product, softmax counted, the head, K and V at every
head, an ungated FFN); Hugging Face's ``floating_point_ops`` (``6·tokens·N``, no ``n²`` term).
"""

from __future__ import annotations

from dataclasses import dataclass

from .formulas import ModelSpec, model_costs
from .errors import hidden

__tracebackhide__ = hidden  # pytest shows the user's frames, not these (see errors.hidden)

__all__ = ["Convention", "conventions"]


@dataclass(frozen=True)
class Convention:
    """One published convention's count of a forward pass.

    Attributes:
        name: who publishes it.
        macs: the forward pass's MACs under it (FLOPs / 2).
        differs: ``(term, MACs)`` pairs, convention minus exact count; they add up to ``macs - exact``.
        exact: the layers' exact count it is set beside (attention core, projections, FFN; no head).
    """

    name: str
    macs: int
    differs: tuple[tuple[str, int], ...]
    exact: int

    @property
    def relative(self) -> float:
        """(convention - exact) / exact."""
        return (self.macs - self.exact) / self.exact


def conventions(spec: ModelSpec, n: int, batch: int = 1, *, vocab: int = 0, causal: bool = False) -> list[Convention]:
    """Each convention's forward MACs for *spec* at *n* tokens, beside the exact count of its layers.

    Args:
        vocab: the vocabulary, for the conventions that count the output head (0: no head).
        causal: the model's self-attention is causal, so the conventions that halve causal attention do.
    """
    exact_costs = model_costs(spec, n, batch)
    exact = exact_costs.attention + exact_costs.ffn
    core = exact_costs.attention_core  # 2·L·b·h·d·n² (plus cross-attention)
    b, L, d, hd = batch, spec.layers, spec.hidden, spec.heads * spec.head_dim
    head = b * n * vocab * d
    head_term = [("the output head (n·V·D)", head)] if head else []
    halved = [("causal attention halved as n²/2 (L·h·d·n² less than a dense kernel runs; the diagonal, "
               "L·h·d·n, below causal='half')", -(core // 2))] if causal else []
    flops_softmax = 3 * spec.heads * n * n * L * b  # Chinchilla counts softmax: 3 FLOP per score
    chinchilla = [
        ("the embedding lookup as a matrix product (n·V·D)", head),
        ("the output head (n·V·D)", head),
        ("softmax counted (3 FLOP per score)", flops_softmax // 2),
        ("K and V at every query head (no grouped-query attention)", b * n * L * 2 * d * (hd - spec.g * spec.head_dim)),
        ("the FFN as two matrices (gated: three)", -b * n * (spec.model_ffn_per_token - L * 2 * d * spec.ffn_dim)),
    ]
    rows = [
        ("PaLM", []),
        ("Megatron-LM (2024)", head_term),
        ("Megatron-LM (today), MaxText", [*halved, *head_term]),
        ("Kaplan et al.", [("the n² term counted once (L·n·h·d per token): half of QKᵀ and AV", -(core // 2))]),
        ("Chinchilla", [term for term in chinchilla if term[1]]),
        ("Hugging Face floating_point_ops", [("no n² term: the attention core missing", -core)]),
    ]
    return [Convention(name, exact + sum(macs for _, macs in terms), tuple(terms), exact) for name, terms in rows]
