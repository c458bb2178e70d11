"""The records: :class:`Profile` (one counted forward pass, split the article's way) and :class:`Timing`
(one timed forward pass, split the same way), and the vocabularies every module shares."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from . import devices, formulas
from .conventions import Audit, Convention, Formula, audit, conventions
from .errors import CheckFailed
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .footprint import Memory
from .formulas import Costs, ModelSpec, relative_deviation
from .ops import MATMUL_LIKE_UNSUPPORTED
from .request import BACKENDS, CAUSAL, COMPONENTS, MODES, PARTS
from .units import format_count, format_seconds, table

__all__ = ["BACKENDS", "CAUSAL", "COMPONENTS", "MODES", "PARTS", "TOTALS", "Profile", "Timing", "median", "versions"]


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
        m: the second sequence's length, for models that read two: an encoder-decoder's target
            (``decoder_input_ids``, ``nn.Transformer``'s ``tgt``), a decoder stack's memory
            (``nn.TransformerDecoder``; the formulas' cross-attention keys), ``nn.MultiheadAttention``'s
            keys, the inputs a Perceiver's latents read; None for a model that reads one sequence. ``n`` is the
            main (first) input's length, or what the layers run on where that is no input (latents).
        unsupported_ops: op -> number of calls fvcore could not count.
        by_module: module name (``""`` is the root) -> MACs, fvcore's ``by_module``.
        backend: the counter that made the count, ``fvcore`` or ``torch`` (FlopCounterMode).
        mode: ``forward``, ``train`` (forward and backward), or ``decode`` (``new_tokens`` queries
            against a KV cache of ``n`` tokens).
        causal: ``full`` (the n x n product a dense kernel executes), ``half`` (n(n+1)/2 pairs of causal
            self-attention) or ``kept`` (the pairs each layer's mask keeps: causal, sliding windows, chunks).
        causal_applied: some causal self-attention was counted with fewer pairs than the kernel runs.
        fallback: why the torch backend stood in for fvcore (None when it did not).
        versions: torch, fvcore and plugin versions that made the count.
        ffn_router: the part of ``ffn`` spent in mixture-of-experts routers (``D x E`` per token).
        warnings: why a number may be wrong, each naming the module, the MACs and the cause
            (products that could not be placed, parts that disagree with the formula, ...);
            ``--attncost-strict`` fails a test whose profile has one.
        notes: what the plugin changed or could not do without doubting the count (the
            experts implementation it ran, why there is no formula).
        new_tokens: the query tokens of a decode step (None outside decode mode).
        dtype: the dtype of the model's parameters, in which its bytes are counted.
        moved: part -> (weight bytes, activation bytes) its products read and write: each product's matrix
            operands (weights are the parameters among them; in a decode step the KV cache is read as
            activations) and its result. Norms, activations, softmax and biases are not products, and are not in.
        kv_cache_bytes: bytes of the KV cache the decode step read (its n tokens, every layer,
            in the cache's dtype); None outside decode mode.
        memory: the memory estimate (:class:`~pytest_attncost.footprint.Memory`) when ``memory=True`` asked for
            it (or a memory bound implied it); None otherwise.
        outside: MACs of attention that runs outside the repeated layers (Perceiver IO's cross-attention,
            attention-pooling heads), by part: counted in the parts, left out of the comparison with the
            formula, which describes the layers (:meth:`in_layers`).
        recompute: in train mode, by part, the MACs of forward ops activation checkpointing ran again inside
            the backward, each in the part of the forward op it repeats; not in the parts or :attr:`total`
            (a checkpointed step splits like the same step without it): :attr:`hardware_flops` adds them.
        forward_macs: in train mode, the forward pass's MACs alone (:attr:`model_flops` is 3x it); None otherwise.
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
    outside: Mapping[str, int] = field(default_factory=dict)
    dtype: str = "float32"
    moved: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    memory: Memory | None = None
    recompute: Mapping[str, int] = field(default_factory=dict)
    forward_macs: int | None = None
    # module -> (class, parameters, role): for table(); not part of the dict (it can be large)
    modules: Mapping[str, tuple[str, int, str]] = field(default_factory=dict, repr=False, compare=False)
    # module -> "attention" / "ffn": the role map the split used (measure() places time with it), and
    # whether it is the user's roles= (a fused attention op is then a core wherever it runs)
    roles: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)
    roles_given: bool = field(default=False, repr=False, compare=False)

    def __repr__(self) -> str:
        """Short enough for an assertion message: what was counted, and the split."""
        extra = "".join(
            f", {label}" for label, on in (
                (self.mode, self.mode != "forward"), (self.backend, self.backend != "fvcore"),
                (f"causal {self.causal}", self.causal_applied), (f"{len(self.warnings)} warnings", bool(self.warnings)))
            if on)
        m = f", m={self.m}" if self.m is not None and self.m != self.n else ""
        return (f"Profile({self.name!r}, n={self.n}{m}, batch={self.batch}, core={self.attention_core:,}, "
                f"proj={self.attention_proj:,}, ffn={self.ffn:,}, other={self.other:,}, "
                f"share={self.attention_share:.3f}{extra})")

    def table(self, depth: int = 2) -> str:
        """The module tree to *depth* (ModuleList/Sequential levels not counted), one row per module.

        Columns: module, class, role (layer, attention, ffn or other), parameters, MACs of the
        module and everything in it, and ``self``: the MACs no row below it shows, so that the
        ``self`` column sums to the whole count (as fvcore's ``flop_count_table`` does per row).
        """
        return module_table(self, depth)

    @property
    def attention(self) -> int:
        return self.attention_core + self.attention_proj

    def in_layers(self, part: str) -> int:
        """*part*'s MACs in the repeated layers: what the formula describes (attention outside them left out)."""
        return int(getattr(self, part)) - self.outside.get(part, 0)

    @property
    def total(self) -> int:
        return self.attention + self.ffn + self.other

    @property
    def hardware_flops(self) -> int:
        """What the step executes: 2 FLOP per MAC of :attr:`total` and of the :attr:`recompute`."""
        return 2 * (self.total + sum(self.recompute.values()))

    @property
    def model_flops(self) -> int:
        """What the model needs, as MFU counts it: in train mode 3x the forward (PaLM's: no recompute, the
        backward as twice the forward), else 2 FLOP per MAC of :attr:`total`."""
        return 6 * self.forward_macs if self.forward_macs is not None else 2 * self.total

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
        return formulas.model_costs(self.spec, self.n, self.batch, self.m, train=self.mode == "train",
                                    causal=self.causal if self.causal_applied else "full")

    @property
    def deviation(self) -> float | None:
        """Largest relative difference between measured and formula over the three parts."""
        expected = self.formula
        return None if expected is None else max(
            relative_deviation(self.in_layers(c), getattr(expected, c)) for c in COMPONENTS)

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
            linear = self.spec.layers * 2 * queries * self.spec.heads * self.spec.head_dim**2
        else:
            passes = 3 if self.mode == "train" else 1
            linear = passes * self.spec.layers * formulas.linear_attention_core(self.spec, self.n, self.batch, self.m)
        return min(1.0, max(0.0, (self.attention_core - linear) / denominator))

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

    @property
    def head_vocab(self) -> int:
        """The vocabulary of the model's output head, read from its modules (0: none): the widest module outside the
        layers that holds a ``V x D`` matrix (and its bias) and ran it on every token, ``b·n·V·D`` MACs. A profile
        read back from JSON has no module table: 0, so pass ``vocab=`` to :meth:`conventions` there."""
        if self.spec is None:
            return 0
        tokens, width = self.batch * self.n, self.spec.hidden
        found = [vocab for name, (_, size, role) in self.modules.items() if role == "other"
                 for vocab in {size // width, size // (width + 1)}  # a V x D matrix, without its bias or with it
                 if vocab and size in (vocab * width, vocab * (width + 1))
                 and self.by_module.get(name) == tokens * vocab * width]
        return max(found, default=0)

    def conventions(self, vocab: int | None = None, causal: bool = False) -> list[Convention]:
        """This forward pass in the published FLOP conventions (PaLM, Megatron-LM, Kaplan, Chinchilla, Hugging
        Face, FlashAttention), each with the terms in which it differs from the exact count of the layers; see
        :mod:`pytest_attncost.conventions`.

        Args:
            vocab: the output head's vocabulary; None (the default) reads it from the model's head
                (:attr:`head_vocab`, 0 for a model without one); 0 leaves the head out.
            causal: the self-attention is causal (the conventions that halve it do).

        Returns:
            One per convention, in the order above.

        Raises:
            ValueError: no spec (the conventions need the shape), or not a forward pass.
        """
        if self.spec is None or self.mode != "forward":
            raise ValueError(f"{self.name}: the conventions need a forward profile with a spec (mode {self.mode!r}, "
                             f"spec {'known' if self.spec else 'unknown'}); pass spec=ModelSpec(...) to profile()")
        return conventions(self.spec, self.n, self.batch, vocab=self.head_vocab if vocab is None else vocab,
                           causal=causal)

    def audit(self, formula: Formula | Callable[..., float]) -> Audit:
        """Set a FLOPs formula (a :class:`~pytest_attncost.conventions.Formula`, or a function ``n -> FLOPs`` or
        ``(spec, n) -> FLOPs`` of one sequence) beside this forward pass's count, and name the terms it differs by;
        a :class:`Sweep`'s ``audit`` does it over several lengths, which tell linear terms from quadratic ones.

        Raises:
            ValueError: not a forward pass, or a malformed formula.
        """
        if self.mode != "forward":
            raise ValueError(f"{self.name}: a formula is audited against a forward pass, not mode {self.mode!r}")
        return audit(formula, [(self.n, self.total, self.attention_core, self.other)], self.spec, self.batch)

    def roofline(self, device: str = "h100-sxm", dtype: str | None = None) -> list[devices.Roof]:
        """Each part's FLOPs, bytes, arithmetic intensity and roofline time on *device* (a name of
        :data:`~pytest_attncost.devices.DEVICES`, or ``"cpu"``: this machine, measured), with its verdict, and
        the whole forward last (``"total"``). *dtype*: the peak to use (default: the profile's own dtype).

        Raises:
            ValueError: an unknown device or dtype, or a profile counted without bytes.
        """
        if not self.moved:
            raise ValueError(f"{self.name}: this profile has no bytes "
                             "(read from a file written before they were counted)")
        found, dtype = devices.device(device), dtype or self.dtype
        rows = []
        for part in (*PARTS, "total"):
            macs = self.total if part == "total" else getattr(self, part)
            weights, activations = (map(sum, zip(*self.moved.values())) if part == "total"
                                    else self.moved.get(part, (0, 0)))
            moved = weights + activations
            rows.append(devices.Roof(part, 2 * macs, weights, activations, found.seconds(2 * macs, moved, dtype),
                                     found.bound(2 * macs, moved, dtype) if macs or moved else "-"))
        return rows

    def check_formula(self, rtol: float = 0.01) -> None:
        """Assert that each measured part is within *rtol* of the formula.

        Raises:
            CheckFailed: an AssertionError, with a small measured-vs-formula table (pytest locates it at
                the caller's line).
        """
        expected = self.formula
        if expected is None:
            raise CheckFailed(f"{self.name}: no formula to compare with (unknown shape); "
                              "pass spec=ModelSpec(...) to profile()")
        rows = [(part, self.in_layers(part), getattr(expected, part)) for part in COMPONENTS]
        deviations = [relative_deviation(got, want) for _, got, want in rows]
        if any(dev > rtol for dev in deviations):
            body = [[part, f"{got:,}", f"{want:,}", f"{dev:.2%}", "<-" if dev > rtol else ""]
                    for (part, got, want), dev in zip(rows, deviations)]
            step = f" (decode step of {self.new_tokens or 1})" if self.mode == "decode" else ""
            header = (f"{self.name} at n={self.n}{step}, batch={self.batch} deviates from the formula by more than "
                      f"{rtol:.2%} (MACs):")
            raise CheckFailed("\n".join([header, *table(["part", "measured", "formula", "deviation", ""], body,
                                                           right=(1, 2, 3), rule=False)]))

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe builtins only: the same dict feeds xdist, reports and baselines."""
        data: dict[str, Any] = {key: getattr(self, key) for key in _PLAIN}  # the files sort their keys
        data.update(
            spec=None if self.spec is None else self.spec.to_dict(),
            formula=None if (formula := self.formula) is None else formula.to_dict(),
            unsupported_ops=dict(sorted(self.unsupported_ops.items())), by_module=dict(sorted(self.by_module.items())),
            versions=dict(sorted(self.versions.items())), warnings=list(self.warnings), notes=list(self.notes))
        if self.mode == "decode":  # present only in decode profiles: prefill rows and baselines keep their form
            data.update(new_tokens=self.new_tokens, kv_cache_bytes=self.kv_cache_bytes)
        if self.mode == "train":  # present only in train profiles
            data.update(recompute=dict(sorted(self.recompute.items())), forward_macs=self.forward_macs,
                        model_flops=self.model_flops, hardware_flops=self.hardware_flops)
        if self.outside:  # present only where attention ran outside the layers
            data["outside"] = dict(sorted(self.outside.items()))
        if self.moved:  # bytes: present where the count recorded them
            data.update(dtype=self.dtype, moved={part: list(pair) for part, pair in sorted(self.moved.items())})
        if self.memory is not None:  # present only where memory was estimated
            data["memory"] = self.memory.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        """Inverse of :meth:`to_dict` (derived fields are recomputed, not read)."""
        kwargs = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        if kwargs.get("spec") is not None:
            kwargs["spec"] = ModelSpec.from_dict(kwargs["spec"])
        kwargs.update({name: tuple(kwargs[name]) for name in ("warnings", "notes") if name in kwargs})
        if "moved" in kwargs:
            kwargs["moved"] = {part: tuple(pair) for part, pair in kwargs["moved"].items()}
        if kwargs.get("memory") is not None:
            kwargs["memory"] = Memory.from_dict(kwargs["memory"])
        return cls(**kwargs)


#: What :meth:`Profile.to_dict` writes as it is (fields and properties of plain values).
_PLAIN = ("name", "n", "batch", "m", "layers", "total", "attention", *PARTS,
          "attention_share", "quadratic_share", "deviation", "linear_attention_saving", "crossover_n", "quadratic_n",
          "backend", "mode", "causal", "causal_applied", "fallback", "ffn_router")


def versions() -> dict[str, str]:
    """Versions of what produced the counts (read from package metadata: nothing is imported)."""
    return dict(_versions())


@functools.cache
def _versions() -> tuple[tuple[str, str], ...]:
    # Read once per process: each lookup scans sys.path (~1.5 ms), and what is imported cannot change.
    found = {"python": ".".join(map(str, sys.version_info[:3]))}
    for dist in ("pytest-attncost", "torch", "fvcore", "transformers", "pytest"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[dist] = metadata.version(dist)
    return tuple(found.items())


def module_rows(profile: Profile, depth: int = 2) -> list[dict[str, Any]]:
    """The rows of :meth:`Profile.table`: module, label, class, role, params, MACs and self MACs (ints)."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"depth must be an int >= 0, got {depth!r}")
    modules = profile.modules
    containers = {name for name, (cls, _, _) in modules.items() if cls in ("ModuleList", "Sequential", "ModuleDict")}

    def level(name: str) -> int:
        parts = name.split(".") if name else []
        return sum(1 for i in range(len(parts)) if ".".join(parts[: i + 1]) not in containers)

    shown = [name for name in modules if name not in containers and level(name) <= depth]
    rows = []
    for name in shown:
        macs = int(profile.by_module.get(name, 0))
        below = [other for other in shown if other != name and (not name or other.startswith(name + "."))]
        # the rows directly under this one: shown modules with no shown module between
        direct = [b for b in below if not any(a != b and b.startswith(a + ".") for a in below)]
        parts = name.split(".")
        start = len(parts) - 1
        while start > 0 and ".".join(parts[:start]) in containers:  # "layer.0", not "0"
            start -= 1
        cls, params, role = modules[name]
        rows.append({"module": name, "label": "  " * level(name) + (".".join(parts[start:]) if name else "(model)"),
                     "class": cls, "role": role, "params": params, "macs": macs,
                     "self": macs - sum(int(profile.by_module.get(child, 0)) for child in direct)})
    return rows


def module_table(profile: Profile, depth: int = 2) -> str:
    """See :meth:`Profile.table`."""
    body = [[r["label"], r["class"], r["role"], f"{r['params']:,}", format_count(r["macs"], "mac", suffix=False),
             format_count(r["self"], "mac", suffix=False)] for r in module_rows(profile, depth)]
    lines = table(["module", "class", "role", "params", "MACs", "self"], body, right=(3, 4, 5))
    lines.append(f"{profile.name} at n={profile.n}, batch={profile.batch}: {profile.total:,} MAC; "
                 "MACs include everything below a module, self what no row below it shows")
    return "\n".join(lines)


# --- measured time ------------------------------------------------------------------------------

#: Sample names besides the parts: op time in the parts, time between ops, the traced forward's
#: wall (or device) time, and the plain forward's.
TOTALS = ("attributed", "unattributed", "traced", "forward")


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _ratio(top: float, bottom: float) -> float:
    return top / bottom if bottom > 0 else 0.0


@dataclass(frozen=True)
class Timing:
    """Measured time of one model's forward pass, split like its :class:`Profile`'s MACs.

    Every figure is the median over the repeats; :meth:`spread` gives the median absolute
    deviation. Seconds are wall time on the CPU and device (kernel) time on a GPU.

    Attributes:
        name: the model's name (as in its profile).
        n: the sequence length.
        batch: the batch size.
        device: where it ran, ``"cpu"`` or ``"cuda:0"``.
        device_name: the processor (``"x86_64 CPU, 2 threads"``, ``"NVIDIA H200"``).
        dtype: the parameters' dtype while timed, e.g. ``"float32"``.
        clock: ``"wall"`` (CPU) or ``"device"`` (kernel times on the GPU).
        warmup: untimed forwards run first.
        repeats: timed forwards (each plain, and each traced).
        samples: seconds per repeat: the four parts, ``attributed`` (their sum),
            ``unattributed`` (traced - attributed: time between ops), ``traced`` (the traced
            forward) and ``forward`` (the plain forward, no profiler, no hooks).
        macs: the count's MACs per part (from ``profile()``), for MAC/s and shares.
        roles: module -> ``"attention"`` / ``"ffn"``: the role map the split used, the one
            ``profile()``'s split uses.
        by_module: median seconds of the ops each module ran itself (innermost scope).
        timed_macs: MACs of the timed products per part, read from their shapes (a cross-check
            of the placement against the count).
        notes: what may make the figures doubtful (a path other than the counted one,
            tracing overhead).
        profile: the :class:`Profile` the MACs come from (not in JSON: it has its own entry).
    """

    name: str
    n: int
    batch: int
    device: str
    device_name: str
    dtype: str
    clock: str
    warmup: int
    repeats: int
    samples: Mapping[str, tuple[float, ...]]
    macs: Mapping[str, int] = field(default_factory=dict)
    roles: Mapping[str, str] = field(default_factory=dict)
    by_module: Mapping[str, float] = field(default_factory=dict)
    timed_macs: Mapping[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    profile: Any = field(default=None, compare=False, repr=False)

    def __repr__(self) -> str:
        return (f"Timing({self.name!r}, n={self.n}, {self.device}, forward={format_seconds(self.forward)}, "
                f"attention_time_share={self.attention_time_share:.3f}, "
                f"attention_mac_share={self.attention_mac_share:.3f})")

    def values(self, stat: str) -> tuple[float, ...]:
        """Per-repeat values of a part or total (seconds), or of a share (see :data:`SHARES`)."""
        if stat in SHARES:
            return tuple(SHARES[stat](self, i) for i in range(self.repeats))
        if stat == "attention":
            return tuple(c + p for c, p in zip(self.samples["attention_core"], self.samples["attention_proj"]))
        if stat not in self.samples:
            raise KeyError(f"no such timing figure {stat!r}; known: {', '.join([*self.samples, 'attention', *SHARES])}")
        return tuple(self.samples[stat])

    def median(self, stat: str) -> float:
        return median(self.values(stat))

    def spread(self, stat: str) -> float:
        """Median absolute deviation of *stat* over the repeats (seconds, or a share): one slow repeat does not
        widen it."""
        values = self.values(stat)
        if len(values) < 2:
            return 0.0
        middle = statistics.median(values)
        return float(statistics.median(abs(v - middle) for v in values))

    def _at(self, part: str, i: int) -> float:
        if part == "attention":
            return self.samples["attention_core"][i] + self.samples["attention_proj"][i]
        return self.samples[part][i]

    @property
    def attention_core(self) -> float:
        return self.median("attention_core")

    @property
    def attention_proj(self) -> float:
        return self.median("attention_proj")

    @property
    def attention(self) -> float:
        return self.median("attention")

    @property
    def ffn(self) -> float:
        return self.median("ffn")

    @property
    def other(self) -> float:
        return self.median("other")

    @property
    def attributed(self) -> float:
        """Time of the ops placed in the four parts (median of their per-repeat sum)."""
        return self.median("attributed")

    @property
    def unattributed(self) -> float:
        """Time of the traced forward spent between ops (Python, module calls, the profiler)."""
        return self.median("unattributed")

    @property
    def traced(self) -> float:
        """The forward's time under the profiler: attributed + unattributed."""
        return self.median("traced")

    @property
    def forward(self) -> float:
        """The whole forward's time, untraced (wall clock on the CPU, device time on a GPU)."""
        return self.median("forward")

    @property
    def attention_time_share(self) -> float:
        """attention / (attention + ffn) in time: the MAC share's twin."""
        return self.median("attention_time_share")

    @property
    def quadratic_time_share(self) -> float:
        """attention_core / (attention + ffn) in time."""
        return self.median("quadratic_time_share")

    @property
    def attention_mac_share(self) -> float:
        """attention / (attention + ffn) in MACs (the profile's ``attention_share``)."""
        return _ratio(self._macs("attention"), self._macs("attention") + self._macs("ffn"))

    @property
    def quadratic_mac_share(self) -> float:
        return _ratio(self._macs("attention_core"), self._macs("attention") + self._macs("ffn"))

    def _macs(self, part: str) -> int:
        """The count's MACs of a part, of attention, or of the whole forward (a total's name)."""
        if part == "attention":
            return self.macs.get("attention_core", 0) + self.macs.get("attention_proj", 0)
        if part in ("attributed", "traced", "forward"):
            return sum(self.macs.get(p, 0) for p in PARTS)
        return self.macs.get(part, 0)

    def time_share(self, part: str) -> float:
        """*part*'s share of the traced forward (the parts and ``unattributed`` sum to 1)."""
        return median([_ratio(self._at(part, i), self.samples["traced"][i]) for i in range(self.repeats)])

    def macs_per_second(self, part: str) -> float | None:
        """The count's MACs of *part* over its measured time; None when it took no time."""
        seconds = self.median(part)
        return self._macs(part) / seconds if seconds > 0 else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe builtins only (no NaN, no infinity): for xdist, reports and baselines."""
        figures = [*PARTS, "attention", *TOTALS]
        rates = {part: self.macs_per_second(part) for part in (*PARTS, "attention", "forward")}
        return {
            **{key: getattr(self, key) for key in ("name", "n", "batch", "device", "device_name", "dtype", "clock",
                                                   "warmup", "repeats")},
            "seconds": {f: self.median(f) for f in figures},
            "spread": {f: self.spread(f) for f in figures},
            "samples": {k: list(v) for k, v in sorted(self.samples.items())},
            "time_share": {part: self.time_share(part) for part in (*PARTS, "attention", "unattributed")},
            **{key: getattr(self, key) for key in ("attention_time_share", "quadratic_time_share",
                                                   "attention_mac_share", "quadratic_mac_share")},
            "macs": dict(self.macs),
            "macs_per_second": {k: (None if v is None or not math.isfinite(v) else v) for k, v in rates.items()},
            "timed_macs": dict(self.timed_macs),
            "by_module": dict(sorted(self.by_module.items())),
            "roles": dict(sorted(self.roles.items())),
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Timing:
        """Inverse of :meth:`to_dict` (derived figures are recomputed from the samples)."""
        return cls(
            name=data["name"], n=data["n"], batch=data["batch"], device=data["device"],
            device_name=data.get("device_name", ""), dtype=data.get("dtype", ""), clock=data.get("clock", "wall"),
            warmup=data.get("warmup", 0), repeats=data["repeats"],
            samples={k: tuple(v) for k, v in data["samples"].items()}, macs=dict(data.get("macs", {})),
            roles=dict(data.get("roles", {})), by_module=dict(data.get("by_module", {})),
            timed_macs=dict(data.get("timed_macs", {})), notes=tuple(data.get("notes", ())),
        )

    @classmethod
    def from_samples(cls, samples: Mapping[str, Sequence[float]], **fields: Any) -> Timing:
        """A Timing from given per-repeat seconds of the four parts (and optionally ``traced``,
        ``forward``): for tests and injected clocks. Missing totals are the parts' sum. *fields* are the
        other attributes, by default ``name="model"``, ``n=1``, ``batch=1``, ``device="cpu"``, ``device_name``
        the device, ``dtype="float32"``, ``clock="wall"``, ``warmup=0``."""
        parts = {p: tuple(float(v) for v in samples.get(p, ())) for p in PARTS}
        repeats = max((len(v) for v in parts.values()), default=0)
        parts = {p: v or (0.0,) * repeats for p, v in parts.items()}
        if any(len(v) != repeats for v in parts.values()):
            raise ValueError("every part needs one value per repeat")
        attributed = tuple(sum(parts[p][i] for p in PARTS) for i in range(repeats))
        traced = tuple(float(v) for v in samples.get("traced", attributed))
        forward = tuple(float(v) for v in samples.get("forward", traced))
        full = {**parts, "attributed": attributed, "traced": traced, "forward": forward,
                "unattributed": tuple(t - a for t, a in zip(traced, attributed))}
        fields = {"name": "model", "n": 1, "batch": 1, "device": "cpu", "dtype": "float32", "clock": "wall",
                  "warmup": 0, **fields, "macs": dict(fields.get("macs") or {})}
        fields.setdefault("device_name", fields["device"])
        return cls(repeats=repeats, samples=full, **fields)


def _share_of(top: Callable[[Timing, int], float]) -> Callable[[Timing, int], float]:
    return lambda timing, i: _ratio(top(timing, i), timing._at("attention", i) + timing._at("ffn", i))


#: Per-repeat shares of measured time, by name (each a function of the Timing and the repeat).
SHARES: Mapping[str, Callable[[Timing, int], float]] = {
    "attention_time_share": _share_of(lambda t, i: t._at("attention", i)),
    "quadratic_time_share": _share_of(lambda t, i: t._at("attention_core", i)),
}
