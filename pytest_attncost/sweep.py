"""Sweeps: one model profiled at several lengths, and the thresholds solved from the measurements.

A Transformer's counts are polynomials in n: the attention core ``α·n + β·n²``
(β = 0 for linear attention), the projections ``π·n`` and the FFN ``φ·n``. Two
lengths determine the coefficients exactly; every further length must fit them.
The thresholds are then solved in exact rational arithmetic, not interpolated
between grid points:

* crossover (attention = FFN): ``(α + π) + β·n = φ``, so ``n = (φ - α - π) / β``;
* quadratic crossover (the quadratic term = the linear terms): ``β·n = α + π + φ``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, overload

from . import formulas
from .result import Profile

__all__ = ["Coefficients", "Sweep", "SweepError"]


class SweepError(ValueError):
    """A sweep that cannot be solved; the message says why."""


@dataclass(frozen=True)
class Coefficients:
    """Per-n coefficients of the measured counts: core = α·n + β·n², proj = π·n, ffn = φ·n."""

    alpha: Fraction
    beta: Fraction
    pi: Fraction
    phi: Fraction

    def crossover(self) -> Fraction | None:
        """Where attention equals the FFN; None if it never does for n > 0."""
        gap = self.phi - self.alpha - self.pi
        if self.beta <= 0 or gap <= 0:
            return None
        return gap / self.beta

    def quadratic_crossover(self) -> Fraction | None:
        """Where the quadratic term equals all linear terms; None without a quadratic term."""
        if self.beta <= 0:
            return None
        return (self.alpha + self.pi + self.phi) / self.beta


def _linear_fit(points: Sequence[tuple[int, int]], what: str) -> tuple[Fraction, Fraction]:
    """Exact (c1, c2) with value = c1·n + c2·n², from the end points, checked on every point."""
    (n1, v1), (n2, v2) = points[0], points[-1]
    # value / n = c1 + c2 * n: a straight line through (n1, v1/n1) and (n2, v2/n2)
    c2 = (Fraction(v2, n2) - Fraction(v1, n1)) / (n2 - n1)
    c1 = Fraction(v1, n1) - c2 * n1
    for n, value in points:
        if c1 * n + c2 * n * n != value:
            raise SweepError(
                f"{what} is not of the form a·n + b·n² across the sweep (n={n}: {value:,} MAC, "
                f"fit predicts {float(c1 * n + c2 * n * n):,.0f})"
            )
    return c1, c2


class Sweep(Sequence[Profile]):
    """Profiles of one model at several lengths (a sequence, ordered by n)."""

    def __init__(self, profiles: Sequence[Profile], *, one_run: bool = False) -> None:
        ordered = sorted(profiles, key=lambda p: p.n)
        if len({p.n for p in ordered}) != len(ordered):
            raise SweepError("a sweep needs distinct lengths")
        self._profiles = tuple(ordered)
        self._one_run = one_run

    @property
    def one_run(self) -> bool:
        """Whether every length was counted in one run (the torch backend's sweeps; see the README)."""
        return self._one_run

    @overload
    def __getitem__(self, index: int) -> Profile: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Profile]: ...

    def __getitem__(self, index: int | slice) -> Profile | Sequence[Profile]:
        return self._profiles[index]

    def __len__(self) -> int:
        return len(self._profiles)

    def __iter__(self) -> Iterator[Profile]:
        return iter(self._profiles)

    def __repr__(self) -> str:
        return f"Sweep({self.name!r}, n={self.lengths})"

    @property
    def name(self) -> str:
        return self._profiles[0].name if self._profiles else ""

    @property
    def lengths(self) -> list[int]:
        return [p.n for p in self._profiles]

    @property
    def spec(self) -> formulas.ModelSpec | None:
        return self._profiles[0].spec if self._profiles else None

    def coefficients(self) -> Coefficients:
        """The exact per-n coefficients; needs two lengths or more, at one batch size."""
        if len(self._profiles) < 2:
            raise SweepError(f"a crossover needs at least two lengths, this sweep has {self.lengths}")
        if len({p.batch for p in self._profiles}) != 1:
            raise SweepError("a sweep's profiles must share one batch size")
        alpha, beta = _linear_fit([(p.n, p.attention_core) for p in self._profiles], "attention_core")
        pi0, pi2 = _linear_fit([(p.n, p.attention_proj) for p in self._profiles], "attention_proj")
        phi0, phi2 = _linear_fit([(p.n, p.ffn) for p in self._profiles], "ffn")
        if pi2 != 0 or phi2 != 0:
            raise SweepError("attention_proj and ffn must be linear in n; they grow faster in this sweep")
        return Coefficients(alpha, beta, pi0, phi0)

    def crossover(self) -> Fraction | None:
        """The measured n where attention equals the FFN (exact); None if there is none."""
        return self.coefficients().crossover()

    def quadratic_crossover(self) -> Fraction | None:
        """The measured n where attention_core's quadratic term equals the linear terms (exact)."""
        return self.coefficients().quadratic_crossover()

    def formula_crossover(self) -> Fraction | None:
        """The formula's crossover for this spec (None without a spec or a crossover)."""
        return formulas.crossover_n(self.spec) if self.spec is not None else None

    def formula_quadratic_crossover(self) -> Fraction | None:
        return formulas.quadratic_n(self.spec) if self.spec is not None else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: the profiles plus both crossovers, measured and from the formula."""

        def number(value: Fraction | None) -> float | None:
            return None if value is None else float(value)

        try:
            crossover, quadratic, error = self.crossover(), self.quadratic_crossover(), None
        except SweepError as exc:
            crossover, quadratic, error = None, None, str(exc)
        return {
            "name": self.name,
            "lengths": self.lengths,
            "crossover_n": number(crossover),
            "quadratic_crossover_n": number(quadratic),
            "formula_crossover_n": number(self.formula_crossover()),
            "formula_quadratic_n": number(self.formula_quadratic_crossover()),
            "error": error,
            "profiles": [p.to_dict() for p in self._profiles],
        }

