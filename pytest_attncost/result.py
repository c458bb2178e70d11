"""Profile: one counted forward pass, in MACs, split the article's way."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import formulas
from .ops import MATMUL_LIKE_UNSUPPORTED
from .formulas import Costs, ModelSpec, relative_deviation

__all__ = ["Profile"]

COMPONENTS = ("attention_core", "attention_proj", "ffn")


@dataclass(frozen=True)
class Profile:
    """One counted forward pass, in MACs, split the article's way.

    Attributes:
        name: the model's name (its class, or ``name=``).
        n: the sequence length the attention saw; in a decode step, the tokens already in the KV cache.
        batch: the batch size.
        attention_core: QK^T and AV (activation x activation products, fused attention).
        attention_proj: Q, K, V and O projections.
        ffn: the feed-forward networks.
        other: everything else fvcore counted (embeddings, norms, heads, poolers).
        layers: layers in the model (from the spec, else attention modules found).
        spec: the shape the formulas are evaluated for; None when unknown.
        m: memory length for cross-attention (None for self-attention-only models).
        unsupported_ops: op -> number of calls fvcore could not count.
        by_module: module name (``""`` is the root) -> MACs, fvcore's ``by_module``.
        backend: the counter that made the count, ``fvcore`` or ``torch`` (FlopCounterMode).
        mode: ``forward``, ``train`` (forward and backward), or ``decode`` (``new_tokens`` queries
            against a KV cache of ``n`` tokens).
        causal: ``full`` (the n x n product a dense kernel executes) or ``half`` (n(n+1)/2 pairs).
        causal_applied: some causal self-attention was counted as a half triangle.
        fallback: why the torch backend stood in for fvcore (None when it did not).
        versions: torch, fvcore and plugin versions that made the count.
        ffn_router: the part of ``ffn`` spent in mixture-of-experts routers (``D x E`` per token).
        warnings: why a number may be wrong, each naming the module, the MACs and the cause
            (products that could not be placed, parts that disagree with the formula, ...);
            ``--attncost-strict`` fails a test whose profile has one.
        notes: what the plugin changed or could not do without doubting the count (the
            experts implementation it ran, why there is no formula).
        new_tokens: the query tokens of a decode step (None outside decode mode).
        kv_cache_bytes: bytes of the KV cache the decode step read (its n tokens, every layer,
            in the cache's dtype); None outside decode mode.
    """

    name: str
    n: int
    batch: int
    attention_core: int
    attention_proj: int
    ffn: int
    other: int
    layers: int
    spec: ModelSpec | None = None
    m: int | None = None
    unsupported_ops: Mapping[str, int] = field(default_factory=dict)
    by_module: Mapping[str, int] = field(default_factory=dict)
    backend: str = "fvcore"
    mode: str = "forward"
    causal: str = "full"
    causal_applied: bool = False
    fallback: str | None = None
    versions: Mapping[str, str] = field(default_factory=dict)
    ffn_router: int = 0
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    new_tokens: int | None = None
    kv_cache_bytes: int | None = None
    # module -> (class, parameters, role): for table(); not part of the dict (it can be large)
    modules: Mapping[str, tuple[str, int, str]] = field(default_factory=dict, repr=False, compare=False)

    def __repr__(self) -> str:
        """Short enough for an assertion message: what was counted, and the split."""
        extra = "".join(
            f", {label}" for label, on in (
                (self.mode, self.mode != "forward"), (self.backend, self.backend != "fvcore"),
                ("causal half", self.causal_applied), (f"{len(self.warnings)} warnings", bool(self.warnings)))
            if on)
        return (f"Profile({self.name!r}, n={self.n}, batch={self.batch}, core={self.attention_core:,}, "
                f"proj={self.attention_proj:,}, ffn={self.ffn:,}, other={self.other:,}, "
                f"share={self.attention_share:.3f}{extra})")

    def table(self, depth: int = 2) -> str:
        """The module tree to *depth* (ModuleList/Sequential levels not counted), one row per module.

        Columns: module, class, role (layer, attention, ffn or other), parameters, MACs of the
        module and everything in it, and ``self``: the MACs no row below it shows, so that the
        ``self`` column sums to the whole count (as fvcore's ``flop_count_table`` does per row).
        """
        from .reporting import module_table

        return module_table(self, depth)

    @property
    def attention(self) -> int:
        return self.attention_core + self.attention_proj

    @property
    def total(self) -> int:
        return self.attention + self.ffn + self.other

    @property
    def attention_share(self) -> float:
        """attention / (attention + ffn): the article's comparison; 0.0 when both are zero."""
        denominator = self.attention + self.ffn
        return self.attention / denominator if denominator else 0.0

    @property
    def quadratic_share(self) -> float:
        """attention_core / (attention + ffn); 0.0 when both are zero."""
        denominator = self.attention + self.ffn
        return self.attention_core / denominator if denominator else 0.0

    @property
    def formula(self) -> Costs | None:
        """The formulas' attention_core, attention_proj and ffn for this spec, n, batch and m."""
        if self.spec is None:
            return None
        if self.mode == "decode":
            return formulas.decode_costs(self.spec, self.n, self.new_tokens or 1, self.batch)
        return formulas.model_costs(self.spec, self.n, self.batch, self.m, causal_half=self.causal_applied,
                                    train=self.mode == "train")

    @property
    def deviation(self) -> float | None:
        """Largest relative difference between measured and formula over the three parts."""
        expected = self.formula
        if expected is None:
            return None
        return max(relative_deviation(getattr(self, c), getattr(expected, c)) for c in COMPONENTS)

    @property
    def linear_attention_saving(self) -> float | None:
        """Fraction of attention + ffn saved if the core were linear attention, in [0, 1]."""
        if self.spec is None:
            return None
        denominator = self.attention + self.ffn
        if denominator == 0:
            return 0.0
        if self.mode == "decode":
            # recurrent form: each new token updates the d x d state (K^T V) and reads it (Q S): 2hd² per layer
            queries = self.batch * (self.new_tokens or 1)
            linear_decode = self.spec.layers * 2 * queries * self.spec.heads * self.spec.head_dim**2
            return min(1.0, max(0.0, (self.attention_core - linear_decode) / denominator))
        passes = 3 if self.mode == "train" else 1
        linear_core = passes * self.spec.layers * formulas.linear_attention_core(self.spec, self.n, self.batch, self.m)
        return min(1.0, max(0.0, (self.attention_core - linear_core) / denominator))

    @property
    def crossover_n(self) -> float | None:
        """Where attention overtakes the FFN for this spec (see :func:`formulas.crossover_n`); in decode
        mode, the context where the core alone reaches the FFN (:func:`formulas.decode_crossover_n`)."""
        if self.spec is None:
            return None
        value = formulas.decode_crossover_n(self.spec) if self.mode == "decode" else formulas.crossover_n(self.spec)
        return None if value is None else float(value)

    @property
    def quadratic_n(self) -> float | None:
        """Where the quadratic core overtakes the linear terms for this spec (decode: the core overtakes
        projections and FFN together, :func:`formulas.decode_quadratic_n`)."""
        if self.spec is None:
            return None
        value = formulas.decode_quadratic_n(self.spec) if self.mode == "decode" else formulas.quadratic_n(self.spec)
        return None if value is None else float(value)

    @property
    def skipped_matmul_ops(self) -> dict[str, int]:
        """Unsupported ops that multiply matrices: their MACs are missing from the count."""
        return {op: c for op, c in self.unsupported_ops.items() if op in MATMUL_LIKE_UNSUPPORTED}

    def check_formula(self, rtol: float = 0.01) -> None:
        """Assert that each measured part is within *rtol* of the formula.

        Raises:
            AssertionError: with a small measured-vs-formula table.
        """
        expected = self.formula
        if expected is None:
            raise AssertionError(
                f"{self.name}: no formula to compare with (unknown shape); pass spec=ModelSpec(...) to profile()"
            )
        from .reporting import table

        body = []
        bad = False
        for part in COMPONENTS:
            got, want = getattr(self, part), getattr(expected, part)
            dev = relative_deviation(got, want)
            bad |= dev > rtol
            body.append([part, f"{got:,}", f"{want:,}", f"{dev:.2%}", "<-" if dev > rtol else ""])
        if bad:
            step = f" (decode step of {self.new_tokens or 1})" if self.mode == "decode" else ""
            header = f"{self.name} at n={self.n}{step}, batch={self.batch} deviates from the formula by more than {rtol:.2%} (MACs):"
            raise AssertionError("\n".join([header, *table(["part", "measured", "formula", "deviation", ""], body,
                                                           right=(1, 2, 3), rule=False)]))

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe builtins only: the same dict feeds xdist, reports and baselines."""
        formula = self.formula
        data = {
            "name": self.name,
            "n": self.n,
            "batch": self.batch,
            "m": self.m,
            "layers": self.layers,
            "total": self.total,
            "attention": self.attention,
            "attention_core": self.attention_core,
            "attention_proj": self.attention_proj,
            "ffn": self.ffn,
            "other": self.other,
            "attention_share": self.attention_share,
            "quadratic_share": self.quadratic_share,
            "deviation": self.deviation,
            "linear_attention_saving": self.linear_attention_saving,
            "crossover_n": self.crossover_n,
            "quadratic_n": self.quadratic_n,
            "spec": None if self.spec is None else self.spec.to_dict(),
            "formula": None if formula is None else formula.to_dict(),
            "unsupported_ops": dict(sorted(self.unsupported_ops.items())),
            "by_module": dict(sorted(self.by_module.items())),
            "backend": self.backend,
            "mode": self.mode,
            "causal": self.causal,
            "causal_applied": self.causal_applied,
            "fallback": self.fallback,
            "versions": dict(sorted(self.versions.items())),
            "ffn_router": self.ffn_router,
            "warnings": list(self.warnings),
            "notes": list(self.notes),
        }
        if self.mode == "decode":  # present only in decode profiles: prefill rows and baselines keep their form
            data["new_tokens"] = self.new_tokens
            data["kv_cache_bytes"] = self.kv_cache_bytes
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        """Inverse of :meth:`to_dict` (derived fields are recomputed, not read)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        if kwargs.get("spec") is not None:
            kwargs["spec"] = ModelSpec.from_dict(kwargs["spec"])
        for name in ("warnings", "notes"):
            if name in kwargs:
                kwargs[name] = tuple(kwargs[name])
        return cls(**kwargs)
