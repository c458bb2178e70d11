"""Series: one model counted (or timed) at several lengths, and the thresholds solved from them.

Counts are polynomials in n, so two lengths fix the coefficients and the thresholds are solved exactly
(docs/sweeps.md, "Thresholds from the counts"): crossover ``n = (φ - α - π) / β``, quadratic ``β·n = α + π + φ``.
A decode step's core is ``β·(n + q)`` (:class:`DecodeSweep`); measured time is interpolated (:class:`TimingSweep`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Generic, TypeVar, overload

from . import formulas
from .conventions import Audit, audit
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .result import Profile, Timing

__all__ = ["Coefficients", "DecodeSweep", "Sweep", "SweepError", "TimingSweep"]


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
        return gap / self.beta if self.beta > 0 and gap > 0 else None

    def quadratic_crossover(self) -> Fraction | None:
        """Where the quadratic term equals all linear terms; None without a quadratic term."""
        return (self.alpha + self.pi + self.phi) / self.beta if self.beta > 0 else None


def _linear_fit(points: Sequence[tuple[int, int]], what: str) -> tuple[Fraction, Fraction]:
    """Exact (c1, c2) with value = c1·n + c2·n², from the end points, checked on every point."""
    (n1, v1), (n2, v2) = points[0], points[-1]
    # value / n = c1 + c2 * n: a straight line through (n1, v1/n1) and (n2, v2/n2)
    c2 = (Fraction(v2, n2) - Fraction(v1, n1)) / (n2 - n1)
    c1 = Fraction(v1, n1) - c2 * n1
    for n, value in points:
        if c1 * n + c2 * n * n != value:
            raise SweepError(f"{what} is not of the form a·n + b·n² across the sweep (n={n}: {value:,} MAC, "
                             f"fit predicts {float(c1 * n + c2 * n * n):,.0f})")
    return c1, c2


def as_float(value: Fraction | float | None) -> float | None:
    """A threshold as JSON writes it (None stays None)."""
    return None if value is None else float(value)


def _half_way(points: Sequence[tuple[int, float]]) -> float | None:
    """Where a share first crosses 1/2, interpolated linearly between the two lengths around it; None if it
    does not cross within the points."""
    shifted = [(n, share - 0.5) for n, share in points]
    for (n1, d1), (n2, d2) in zip(shifted, shifted[1:]):
        if d1 < 0 <= d2:
            return n1 + (n2 - n1) * (-d1) / (d2 - d1)
    return None


Item = TypeVar("Item", Profile, Timing)


class Series(Sequence[Item], Generic[Item]):
    """Records of one model at distinct lengths, ordered by n."""

    def __init__(self, items: Sequence[Item]) -> None:
        ordered = tuple(sorted(items, key=lambda item: item.n))
        if len({item.n for item in ordered}) != len(ordered):
            raise SweepError("a sweep needs distinct lengths")
        self._items: tuple[Item, ...] = ordered

    @overload
    def __getitem__(self, index: int) -> Item: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Item]: ...

    def __getitem__(self, index: int | slice) -> Item | Sequence[Item]:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Item]:
        return iter(self._items)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, n={self.lengths})"

    @property
    def name(self) -> str:
        return self._items[0].name if self._items else ""

    @property
    def lengths(self) -> list[int]:
        return [item.n for item in self._items]


class Sweep(Series[Profile]):
    """Profiles of one model at several lengths (a sequence, ordered by n)."""

    def __init__(self, profiles: Sequence[Profile], *, one_run: bool = False) -> None:
        super().__init__(profiles)
        self._one_run = one_run

    @property
    def one_run(self) -> bool:
        """Whether every length was counted in one run (the torch backend's sweeps; see the README)."""
        return self._one_run

    @property
    def spec(self) -> formulas.ModelSpec | None:
        return self._items[0].spec if self._items else None

    def coefficients(self) -> Coefficients:
        """The exact per-n coefficients; needs two lengths or more, at one batch size."""
        if len(self._items) < 2:
            raise SweepError(f"a crossover needs at least two lengths, this sweep has {self.lengths}")
        if len({p.batch for p in self._items}) != 1:
            raise SweepError("a sweep's profiles must share one batch size")
        alpha, beta = _linear_fit([(p.n, p.attention_core) for p in self._items], "attention_core")
        pi0, pi2 = _linear_fit([(p.n, p.attention_proj) for p in self._items], "attention_proj")
        phi0, phi2 = _linear_fit([(p.n, p.ffn) for p in self._items], "ffn")
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

    def audit(self, formula: Any) -> Audit:
        """:meth:`Profile.audit` over every length of the sweep (one batch size, forward passes)."""
        if len({(p.batch, p.mode) for p in self._items}) != 1 or self._items[0].mode != "forward":
            raise SweepError("a formula is audited over forward passes at one batch size")
        counts = [(p.n, p.total, p.attention_core, p.other) for p in self._items]
        return audit(formula, counts, self.spec, self._items[0].batch)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: the profiles plus both crossovers, measured and from the formula."""
        try:
            crossover, quadratic, error = self.crossover(), self.quadratic_crossover(), None
        except SweepError as exc:
            crossover, quadratic, error = None, None, str(exc)
        return {"name": self.name, "lengths": self.lengths, "crossover_n": as_float(crossover),
                "quadratic_crossover_n": as_float(quadratic), "formula_crossover_n": as_float(self.formula_crossover()),
                "formula_quadratic_n": as_float(self.formula_quadratic_crossover()), "error": error,
                "profiles": [p.to_dict() for p in self._items]}


class DecodeSweep(Series[Profile]):
    """Decode steps of one model at several cache lengths, and the crossover solved from the counts.

    A step's core is ``β·(n + q)`` in the cache length n (β = ``2·q·h·d·layers``) while its
    projections and FFN do not depend on n, so two lengths fix β and the others must fit.
    """

    @property
    def slope(self) -> Fraction | None:
        """β: core MACs per cached token, when every step fits ``core = β·(n + q)`` (None otherwise:
        a sliding window filled, or projections and FFN that change with n)."""
        first, last = self[0], self[-1]
        q = first.new_tokens or 1
        beta = Fraction(last.attention_core - first.attention_core, last.n - first.n)
        fits = all(p.attention_core == beta * (p.n + q) and p.ffn == first.ffn
                   and p.attention_proj == first.attention_proj for p in self)
        return beta if fits else None

    def crossover(self) -> Fraction | None:
        """The context (keys a new token attends to, itself included) where the measured core reaches
        the measured FFN: ``ffn / β``; compare :func:`pytest_attncost.formulas.decode_crossover_n`."""
        beta = self.slope
        return Fraction(self[0].ffn) / beta if beta is not None and beta > 0 else None

    def formula_crossover(self) -> Fraction | None:
        spec = self[0].spec
        return None if spec is None else formulas.decode_crossover_n(spec)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "lengths": self.lengths, "mode": "decode", "new_tokens": self[0].new_tokens,
                "crossover_n": as_float(self.crossover()), "formula_crossover_n": as_float(self.formula_crossover()),
                "profiles": [p.to_dict() for p in self]}


class TimingSweep(Series[Timing]):
    """Timings of one model at several lengths (ordered by n), with the measured time crossover."""

    def __init__(self, timings: Sequence[Timing], spec: formulas.ModelSpec | None = None) -> None:
        super().__init__(timings)
        self.spec = spec

    def crossover(self) -> float | None:
        """Where attention's *time* overtakes the FFN's: the attention time share crosses 1/2,
        interpolated linearly between the two measured lengths around it (the first crossing);
        None when it does not cross within the sweep."""
        return _half_way([(t.n, t.attention_time_share) for t in self._items])

    def formula_crossover(self) -> float | None:
        """The formula's crossover for the spec (2hd for the article's shape)."""
        return as_float(formulas.crossover_n(self.spec)) if self.spec is not None else None

    def mac_crossover(self) -> float | None:
        """Where attention's MACs overtake the FFN's: solved exactly from the profiles (see
        :meth:`Sweep.crossover`) when every timing has one, else interpolated like :meth:`crossover`."""
        profiles = [t.profile for t in self._items]
        if len(profiles) >= 2 and all(p is not None for p in profiles):
            try:
                return as_float(Sweep(profiles).crossover())  # type: ignore[arg-type]
            except SweepError:
                pass  # not of the form a·n + b·n²: interpolate
        return _half_way([(t.n, t.attention_mac_share) for t in self._items])

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: every timing, the measured time crossover, and the formula's."""
        return {"name": self.name, "lengths": self.lengths, "time_crossover_n": self.crossover(),
                "mac_crossover_n": self.mac_crossover(), "formula_crossover_n": self.formula_crossover(),
                "timings": [t.to_dict() for t in self._items]}
