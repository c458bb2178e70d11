"""Published FLOP conventions, in MACs for one forward pass, each beside the exact count of the layers with the
named terms it differs by (docs/conventions.md, "Published FLOP conventions"); and auditing a user's formula.

Sources: PaLM (Chowdhery et al. 2022, appendix B: ``6N + 12·L·H·Q·T`` per token for training, so
``2N + 4·L·H·Q·T`` forward); Megatron-LM's ``num_floating_point_operations`` as of 2024 (the output head
included, causal attention counted in full) and today's (causal attention halved as ``s/2``, as
FlashAttention's benchmarks and MaxText do); Kaplan et al. 2020 (``2N + 2·L·n_ctx·d_attn``); Hoffmann et al.
2022, appendix F (Chinchilla: embeddings as a matrix product, softmax counted, the head, K and V at every
head, an ungated FFN); Hugging Face's ``floating_point_ops`` (``6·tokens·N``, no ``n²`` term); FlashAttention's
benchmarks (the attention block alone, ``4nD² + 2n²D`` a layer forward, the causal core as ``n²/2``).
"""

from __future__ import annotations

import inspect
import itertools
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .formulas import ModelSpec, model_costs

__all__ = ["Audit", "Convention", "Formula", "audit", "conventions"]


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
    gqa = ("K and V at every query head (no grouped-query attention)",
           b * n * L * 2 * d * (hd - spec.g * spec.head_dim))
    chinchilla = [
        ("the embedding lookup as a matrix product (n·V·D)", head),
        ("the output head (n·V·D)", head),
        ("softmax counted (3 FLOP per score)", 3 * spec.heads * n * n * L * b // 2),
        gqa,
        ("the FFN as two matrices (gated: three)", -b * n * (spec.model_ffn_per_token - L * 2 * d * spec.ffn_dim)),
    ]
    # FlashAttention's accounting of the attention block alone: 4nD² + 2n²D a layer, the core halved as n²/2
    flash_core = b * L * 2 * n * n * d
    reshaped = b * L * 4 * n * d * d + flash_core - exact_costs.attention - gqa[1]  # h·d ≠ D, cross-attention
    flash = [("the FFN left out: the attention block alone", -exact_costs.ffn), gqa,
             (f"the projections and core as 4nD² + 2n²D (h·d = {hd}, D = {d}; cross-attention left out)", reshaped),
             *([("causal attention halved as n²/2 (L·D·n² less)", -(flash_core // 2))] if causal else [])]
    rows = [
        ("PaLM", []),
        ("Megatron-LM (2024)", head_term),
        ("Megatron-LM (today), MaxText", [*halved, *head_term]),
        ("Kaplan et al.", [("the n² term counted once (L·n·h·d per token): half of QKᵀ and AV", -(core // 2))]),
        ("Chinchilla", [term for term in chinchilla if term[1]]),
        ("Hugging Face floating_point_ops", [("no n² term: the attention core missing", -core)]),
        ("FlashAttention", [term for term in flash if term[1]]),
    ]
    return [Convention(name, exact + sum(macs for _, macs in terms), tuple(terms), exact) for name, terms in rows]


# --- auditing a user's formula ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Formula:
    """A user's FLOPs formula, to be audited against the count.

    Attributes:
        function: ``n -> FLOPs`` (or MACs, with ``unit="MAC"``) of one sequence of ``n`` tokens (per token, with
            ``per="token"``), or ``(spec, n) -> FLOPs``, given the profile's :class:`ModelSpec`.
        per: ``"sequence"`` or ``"token"``.
        unit: ``"FLOP"`` (2 per MAC) or ``"MAC"``.
        vocab: the vocabulary, so that the output head and an embedding counted as a product can be named (0: not).
        tolerance: the relative difference allowed at every n (0: to the MAC).
    """

    function: Callable[..., float]
    per: str = "sequence"
    unit: str = "FLOP"
    vocab: int = 0
    tolerance: float = 0.0

    def __post_init__(self) -> None:
        if not callable(self.function):
            raise ValueError(f"Formula takes a function n -> FLOPs, got {self.function!r}")
        for name, value, allowed in (("per", self.per, ("sequence", "token")), ("unit", self.unit, ("FLOP", "MAC"))):
            if value not in allowed:
                raise ValueError(f"Formula {name}= must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        if isinstance(self.vocab, bool) or not isinstance(self.vocab, int) or self.vocab < 0:
            raise ValueError(f"Formula vocab= must be an int >= 0, got {self.vocab!r}")
        if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, (int, float)) or not self.tolerance >= 0:
            raise ValueError(f"Formula tolerance= must be a number >= 0, got {self.tolerance!r}")

    @property
    def name(self) -> str:
        return getattr(self.function, "__name__", type(self.function).__name__)

    @property
    def takes_spec(self) -> bool:
        """The function reads ``(spec, n)``: it has two positional parameters without defaults."""
        try:
            parameters = inspect.signature(self.function).parameters.values()
        except (TypeError, ValueError):
            return False
        return sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                   for p in parameters) == 2

    def macs(self, n: int, batch: int, spec: ModelSpec | None = None) -> Fraction:
        """The formula's MACs for *batch* sequences of *n* tokens, exactly as it states them."""
        if self.takes_spec and spec is None:
            raise ValueError(f"formula {self.name} takes (spec, n), and the profile has no spec: pass spec= to "
                             "profile(), or bind the shape in a function of n")
        value = self.function(spec, n) if self.takes_spec else self.function(n)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"formula {self.name}({n}) returned {value!r}, not a number of {self.unit}")
        per_sequence = Fraction(value if isinstance(value, numbers.Rational) else float(value)) * (
            n if self.per == "token" else 1)
        return per_sequence * batch / (2 if self.unit == "FLOP" else 1)


@dataclass(frozen=True)
class Audit:
    """A formula set beside the count at each n, and the difference explained by named terms.

    Attributes:
        formula: the formula's name.
        rows: ``(n, the formula's MACs, the counted MACs)`` per length.
        terms: ``(term, MACs per length)``: the known differences that add up to the formula minus the count
            (within the tolerance); None when no combination of them does.
        tolerance: the relative difference allowed.
    """

    formula: str
    rows: tuple[tuple[int, Fraction, int], ...]
    terms: tuple[tuple[str, tuple[int, ...]], ...] | None
    tolerance: float

    @property
    def ok(self) -> bool:
        """The formula agrees with the count at every n, within the tolerance."""
        return all(abs(claimed - counted) <= self.tolerance * counted for _, claimed, counted in self.rows)

    def __str__(self) -> str:
        at = ", ".join(f"{n:,}" for n, _, _ in self.rows)
        if self.ok:
            return f"formula {self.formula} agrees with the count at n = {at} (tolerance {self.tolerance:g})"
        n, claimed, counted = max(self.rows, key=lambda row: abs(row[1] - row[2]) / max(row[2], 1))
        head = (f"formula {self.formula} gives {float(claimed):,.0f} MAC at n={n:,} where the count is {counted:,} "
                f"({float((claimed - counted) / max(counted, 1)):+.2%}; tolerance {self.tolerance:g})")
        if self.terms is None:
            return (f"{head}; the difference at n = {at} is none of the known terms (causal halving, the n² core, "
                    "the other part, the output head or an embedding as n·V·D, a gated FFN's third matrix, "
                    "grouped-query attention, all experts; pass vocab= for the head): compare the parts, "
                    "Profile.table()")
        last = [n for n, _, _ in self.rows].index(n)
        return f"{head}: " + "; ".join(f"{term} ({values[last]:+,} MAC)" for term, values in self.terms)


Point = tuple[int, int, int, int]  # (n, counted MACs in all, counted attention core, counted other)


def audit(formula: Formula | Callable[..., float], points: Sequence[Point], spec: ModelSpec | None,
          batch: int = 1) -> Audit:
    """Set *formula* beside the counts at *points* and name the terms it differs by.

    The difference at each n is matched exactly (to the tolerance) by the fewest known terms, each counted
    either way: the causal core halved or not, ``n²/2`` for the ``n(n+1)/2`` pairs, the ``n²`` core missing,
    ``n·V·D`` (the output head, or an embedding lookup counted as a product), a gated FFN's third matrix, K and
    V at every query head, every expert of a mixture. Several lengths tell linear terms from quadratic ones.
    """
    wanted = formula if isinstance(formula, Formula) else Formula(formula)
    rows = tuple((n, wanted.macs(n, batch, spec), total) for n, total, _, _ in points)
    gaps = [claimed - counted for _, claimed, counted in rows]
    slack = [wanted.tolerance * counted for _, _, counted in rows]
    candidates = _terms(points, spec, batch, wanted.vocab)
    for size in range(len(candidates) + 1):
        for chosen in itertools.combinations(candidates, size):
            for signs in itertools.product((1, -1), repeat=size):
                sums = [sum(sign * term[2][i] for sign, term in zip(signs, chosen)) for i in range(len(rows))]
                if all(abs(gap - value) <= room for gap, value, room in zip(gaps, sums, slack)):
                    named = tuple((term[0] if sign > 0 else term[1], tuple(sign * v for v in term[2]))
                                  for sign, term in zip(signs, chosen))
                    return Audit(wanted.name, rows, named, wanted.tolerance)
    return Audit(wanted.name, rows, None, wanted.tolerance)


def _terms(points: Sequence[Point], spec: ModelSpec | None, batch: int, vocab: int
           ) -> list[tuple[str, str, tuple[int, ...]]]:
    """The known differences: (name counted one way, name the other, MACs per point), the empty ones left out."""
    ns = [n for n, _, _, _ in points]
    head = [batch * n * vocab * spec.hidden if spec is not None else 0 for n in ns]
    terms = [("the attention core counted twice", "the n² attention core (QKᵀ and AV) missing",
              tuple(core for _, _, core, _ in points)),
             ("the count's other part counted twice", "the count's other part left out (beyond the head: norms, "
              "poolers, classifiers, rotary tables; Profile.table() names them)",
              tuple(other - h if other >= h else other for (_, _, _, other), h in zip(points, head)))]
    if spec is not None:
        b, L, D, h, d = batch, spec.layers, spec.hidden, spec.heads, spec.head_dim
        full = [model_costs(spec, n, b).attention_core for n in ns]
        half = [model_costs(spec, n, b, causal="half").attention_core for n in ns]
        dense = spec.layers - spec.moe_layers
        terms += [
            ("causal attention not halved: the n×n product, where the count keeps the n(n+1)/2 pairs",
             "attention halved where the count is the full n×n a dense kernel runs (count with causal='half')",
             tuple(f - k for f, k in zip(full, half))),
            ("the diagonal counted twice (L·h·d·n)",
             "causal attention halved as n²/2: the diagonal's L·h·d·n pairs left out of the n(n+1)/2",
             tuple(b * L * h * d * n for n in ns)),
            ("the FFN counted as gated (three matrices) where the model's has two" if not spec.gated else
             "an FFN matrix too many", "the gated FFN counted as two matrices, not three" if spec.gated else
             "an FFN matrix missing", tuple(b * n * dense * D * spec.ffn_dim for n in ns)),
            (f"K and V projected at every query head: grouped-query attention ({spec.g} K/V heads for {h}) left out",
             "K and V projections too few", tuple(b * n * L * 2 * D * (h - spec.g) * d for n in ns)),
            (f"every expert counted ({spec.experts}), not the top {spec.top_k} a token is routed to",
             "experts too few", tuple(b * n * spec.moe_layers * (spec.experts - spec.top_k) * (3 if spec.gated else 2)
                                      * D * spec.expert_ffn_dim for n in ns)),
        ]
        if vocab:
            terms.append(("n·V·D more: an embedding lookup counted as a matrix product, or an output head the count "
                          "does not have", "the output head (n·V·D) left out", tuple(head)))
    merged: dict[tuple[int, ...], tuple[str, str]] = {}  # terms of equal MACs at every n: either may be the cause
    for plus, minus, values in terms:
        if any(values):
            known = merged.get(values)
            merged[values] = (f"{known[0]}, or {plus}", f"{known[1]}, or {minus}") if known else (plus, minus)
    return [(plus, minus, values) for values, (plus, minus) in merged.items()]
