"""``measure()``: time real forward passes and split the time with the same roles as ``profile()``.

The counts stay the source of truth (DECISIONS: measured time is reported, never gated by a
baseline unless the user asks); this module puts the time next to them, to show where the
article's cost model and a real machine disagree ("attention: 40% of MACs, 58% of time at
n=512 on this CPU").

How a forward pass is timed:

* The model runs for real: a deep copy of the user's model (their weights) or a model built
  by a factory on the device (random weights), in eval mode, under ``no_grad``, on real
  inputs (the user's, or the default inputs ``profile()`` counts, with random floats). The
  user's model is never moved, cast, hooked or switched to eval.
* ``warmup`` plain forwards, then ``repeats`` plain forwards timed whole (wall clock on the
  CPU, CUDA events on a GPU): :attr:`Timing.forward`.
* Then ``repeats`` forwards under ``torch.profiler``, with a profiler range per module call
  (forward pre/post hooks on the copy). Every op the profiler sees directly inside
  a module's range (not inside another op) is timed: its inclusive CPU time on the CPU, the
  device time of the kernels it launched on a GPU.
* Each op goes to a part by the same rules as ``profile()``'s MACs (:func:`roles.split`), with
  the same role map (:func:`roles.find_structure` on the same count), extended to ops that do
  not multiply:

  ====================  ===========================================================
  where the op runs     part
  ====================  ===========================================================
  attention module      fused attention and products of two activations (QK^T, AV):
                        ``attention_core``; products with a parameter (Q, K, V, O):
                        ``attention_proj``; products with a buffer: ``other``;
                        every other op (softmax, masking, head reshapes, dropout,
                        rotary, and a residual or norm the model keeps inside the
                        attention module): ``attention_core``, the part that is not
                        a projection
  FFN (rest of a layer) products with a parameter and every op that is not a
                        product (activations, norms, residuals): ``ffn``; a product
                        of two activations or with a buffer: ``other`` (as the
                        count, which cannot place it)
  outside the layers    ``other`` (embeddings, poolers, heads)
  ====================  ===========================================================

  With ``roles=`` the user's globs decide, and a fused attention op is a core wherever it runs.
* Time between ops (Python, the module calls, the hooks and the profiler themselves) is
  nobody's: it is :attr:`Timing.unattributed`, ``traced - attributed``, reported, never
  spread over the parts.

Whether a product has a parameter operand is read from the operand shapes the profiler
records: ``aten::linear`` and convolutions take a weight; any other product whose operand has
the shape (or the transposed shape) of a parameter of the module running it (or of its
submodules) is a parameter product. The MACs of the timed products, computed from the same shapes, are kept in
:attr:`Timing.timed_macs`; when they differ from the count, a note says so.

Noise: every figure is a median over the repeats, with its spread (the median absolute
deviation). A bound on a measured share fails only when broken beyond that spread, and only
with at least :data:`MIN_REPEATS` repeats (:func:`check_time_bounds`).
"""

from __future__ import annotations

import contextlib
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .formulas import ModelSpec

__all__ = [
    "DEFAULT_REPEATS",
    "DEFAULT_WARMUP",
    "MIN_REPEATS",
    "PARTS",
    "TIME_BOUNDS",
    "Timing",
    "TimingError",
    "TimingSweep",
    "check_time_bounds",
    "disagreement_line",
    "disagreement_lines",
    "measure",
    "measure_sweep",
    "parse_time_bound",
    "plot_time_shares",
    "time_change_line",
]

PARTS = ("attention_core", "attention_proj", "ffn", "other")
#: Sample names besides the parts: op time in the parts, time between ops, the traced forward's
#: wall (or device) time, and the plain forward's.
TOTALS = ("attributed", "unattributed", "traced", "forward")

DEFAULT_WARMUP = 2
DEFAULT_REPEATS = 5
#: A bound on measured time is checked only with at least this many repeats: fewer cannot
#: tell a broken bound from a noisy one.
MIN_REPEATS = 5

MODULE_RANGE = "attncost.module:"
REPEAT_RANGE = "attncost.repeat:"

#: Marker keywords on measured shares (same meaning as the MAC shares, over measured time).
TIME_BOUNDS = ("attention_time_share_max", "attention_time_share_min", "quadratic_time_share_max",
               "quadratic_time_share_min")

TIME_BOUND_MESSAGE = ("{stat} {median:.3f} {op} {limit:g} beyond the noise at n={n} on {where} "
                      "(median of {repeats} repeats, spread ±{spread:.3f}; MAC share {macs:.3f})")
TOO_FEW_REPEATS = ("{bound}={limit:g}: {name} at n={n} was timed {repeats} time(s); a bound on measured time needs "
                   "at least {minimum} repeats to tell a broken bound from noise: measure(..., repeats={minimum})")
NO_TIMING = "{bound}: nothing was timed: call attncost.measure(model) in the test body"
TIMED_MACS_NOTE = ("the timed run multiplied {timed:,} MAC in {part} but the count says {counted:,}: the model ran "
                   "another path than the one counted, or a product was placed differently; compare by_module")
TRACE_OVERHEAD_NOTE = ("the traced forward took {traced}, the plain one {forward}: the profiler's per-op cost (many "
                       "small ops) or a busy machine; the parts are shares of the traced forward")
UNREAD_MACS_NOTE = "the MACs of {count} timed product op(s) could not be read from their shapes ({ops})"


class TimingError(ValueError):
    """measure() was called with something it cannot run; the message names the fix."""


# --- the result ----------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _spread(values: Sequence[float]) -> float:
    """Median absolute deviation from the median: one slow repeat does not widen it."""
    if len(values) < 2:
        return 0.0
    middle = statistics.median(values)
    return float(statistics.median(abs(v - middle) for v in values))


def _ratio(top: float, bottom: float) -> float:
    return top / bottom if bottom > 0 else 0.0


def format_seconds(seconds: float) -> str:
    """``0.0123`` -> ``'12.3 ms'``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


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

    # -- samples -------------------------------------------------------------------------

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
        return _median(self.values(stat))

    def spread(self, stat: str) -> float:
        """Median absolute deviation of *stat* over the repeats (seconds, or a share)."""
        return _spread(self.values(stat))

    def _at(self, part: str, i: int) -> float:
        if part == "attention":
            return self.samples["attention_core"][i] + self.samples["attention_proj"][i]
        return self.samples[part][i]

    # -- seconds (medians) ----------------------------------------------------------------

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

    # -- shares -----------------------------------------------------------------------------

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
        attention = self.macs.get("attention_core", 0) + self.macs.get("attention_proj", 0)
        return _ratio(attention, attention + self.macs.get("ffn", 0))

    @property
    def quadratic_mac_share(self) -> float:
        attention = self.macs.get("attention_core", 0) + self.macs.get("attention_proj", 0)
        return _ratio(self.macs.get("attention_core", 0), attention + self.macs.get("ffn", 0))

    def time_share(self, part: str) -> float:
        """*part*'s share of the traced forward (the parts and ``unattributed`` sum to 1)."""
        return _median([_ratio(self._at(part, i), self.samples["traced"][i]) for i in range(self.repeats)])

    def macs_per_second(self, part: str) -> float | None:
        """The count's MACs of *part* over its measured time; None when it took no time."""
        if part == "attention":
            macs = self.macs.get("attention_core", 0) + self.macs.get("attention_proj", 0)
        elif part in ("attributed", "traced", "forward"):
            macs = sum(self.macs.get(p, 0) for p in PARTS)
        else:
            macs = self.macs.get(part, 0)
        seconds = self.median(part)
        return macs / seconds if seconds > 0 else None

    # -- JSON -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe builtins only (no NaN, no infinity): for xdist, reports and baselines."""
        figures = [*PARTS, "attention", *TOTALS]
        rates = {part: self.macs_per_second(part) for part in (*PARTS, "attention", "forward")}
        return {
            "name": self.name,
            "n": self.n,
            "batch": self.batch,
            "device": self.device,
            "device_name": self.device_name,
            "dtype": self.dtype,
            "clock": self.clock,
            "warmup": self.warmup,
            "repeats": self.repeats,
            "seconds": {f: self.median(f) for f in figures},
            "spread": {f: self.spread(f) for f in figures},
            "samples": {k: list(v) for k, v in sorted(self.samples.items())},
            "time_share": {part: self.time_share(part) for part in (*PARTS, "attention", "unattributed")},
            "attention_time_share": self.attention_time_share,
            "quadratic_time_share": self.quadratic_time_share,
            "attention_mac_share": self.attention_mac_share,
            "quadratic_mac_share": self.quadratic_mac_share,
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
    def from_samples(
        cls, samples: Mapping[str, Sequence[float]], *, name: str = "model", n: int = 1, batch: int = 1,
        macs: Mapping[str, int] | None = None, device: str = "cpu", **extra: Any,
    ) -> Timing:
        """A Timing from given per-repeat seconds of the four parts (and optionally ``traced``,
        ``forward``): for tests and injected clocks. Missing totals are the parts' sum."""
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
        return cls(name=name, n=n, batch=batch, device=device, device_name=extra.pop("device_name", device),
                   dtype=extra.pop("dtype", "float32"), clock=extra.pop("clock", "wall"), warmup=extra.pop("warmup", 0),
                   repeats=repeats, samples=full, macs=dict(macs or {}), **extra)


def _share_of(top: Callable[[Timing, int], float]) -> Callable[[Timing, int], float]:
    def share(timing: Timing, i: int) -> float:
        return _ratio(top(timing, i), timing._at("attention", i) + timing._at("ffn", i))

    return share


#: Per-repeat shares of measured time, by name (each a function of the Timing and the repeat).
SHARES: Mapping[str, Callable[[Timing, int], float]] = {
    "attention_time_share": _share_of(lambda t, i: t._at("attention", i)),
    "quadratic_time_share": _share_of(lambda t, i: t._at("attention_core", i)),
}


# --- noise-aware bounds ----------------------------------------------------------------------


def parse_time_bound(name: str, value: object) -> float:
    """Validate one marker keyword of :data:`TIME_BOUNDS`; raises ValueError naming it."""
    if name not in TIME_BOUNDS:
        raise ValueError(f"unknown time bound {name!r}; valid: {', '.join(TIME_BOUNDS)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _where(timing: Timing) -> str:
    return "this CPU" if timing.device == "cpu" else timing.device_name or timing.device


def check_time_bounds(timings: Sequence[Timing] | Timing, bounds: Mapping[str, float | None]) -> list[str]:
    """Every broken bound on measured shares, as messages (empty: all hold).

    A ``*_max`` bound fails when ``median - spread > limit``, a ``*_min`` bound when
    ``median + spread < limit``: broken beyond the noise the repeats themselves show. A
    bound over a timing of fewer than :data:`MIN_REPEATS` repeats fails with a message
    asking for more, rather than passing on noise.
    """
    if isinstance(timings, Timing):
        timings = [timings]
    wanted = {k: v for k, v in bounds.items() if v is not None}
    for key in wanted:
        if key not in TIME_BOUNDS:
            raise ValueError(f"unknown time bound {key!r}; valid: {', '.join(TIME_BOUNDS)}")
    if not wanted:
        return []
    if not timings:
        return [NO_TIMING.format(bound=", ".join(sorted(wanted)))]
    problems: list[str] = []
    for timing in timings:
        for bound, limit in wanted.items():
            if timing.repeats < MIN_REPEATS:
                problems.append(TOO_FEW_REPEATS.format(bound=bound, limit=limit, name=timing.name, n=timing.n,
                                                       repeats=timing.repeats, minimum=MIN_REPEATS))
                continue
            stat, _, side = bound.rpartition("_")
            median, spread = timing.median(stat), timing.spread(stat)
            broken = median - spread > limit if side == "max" else median + spread < limit
            if broken:
                macs = timing.attention_mac_share if stat.startswith("attention") else timing.quadratic_mac_share
                problems.append(TIME_BOUND_MESSAGE.format(
                    stat=stat, median=median, op=">" if side == "max" else "<", limit=limit, n=timing.n,
                    where=_where(timing), repeats=timing.repeats, spread=spread, macs=macs))
    return problems


# --- lines for the report ------------------------------------------------------------------

DISAGREEMENT_LINE = "{name}: attention: {macs:.0%} of MACs, {time:.0%} of time at n={n} on {where}"


def disagreement_line(timings: Sequence[Timing]) -> str | None:
    """For one model's timings: the one where the attention share in time is furthest from
    the share in MACs, as ``"BertModel: attention: 40% of MACs, 58% of time at n=512 on this CPU"``."""
    if not timings:
        return None
    worst = max(timings, key=lambda t: (abs(t.attention_time_share - t.attention_mac_share), -t.n))
    return DISAGREEMENT_LINE.format(name=worst.name, macs=worst.attention_mac_share,
                                    time=worst.attention_time_share, n=worst.n, where=_where(worst))


def disagreement_lines(timings: Sequence[Timing]) -> list[str]:
    """One :func:`disagreement_line` per model name (and device), sorted by name."""
    groups: dict[tuple[str, str], list[Timing]] = {}
    for timing in timings:
        groups.setdefault((timing.name, timing.device), []).append(timing)
    return [line for key in sorted(groups) if (line := disagreement_line(groups[key])) is not None]


def time_change_line(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """Baseline comparison of two :meth:`Timing.to_dict` entries, for display only (never a failure)."""
    before, after = old["seconds"]["forward"], new["seconds"]["forward"]
    change = f" ({(after - before) / before:+.1%})" if before > 0 else ""
    same_place = (old.get("device_name"), old.get("dtype")) == (new.get("device_name"), new.get("dtype"))
    where = "" if same_place else f"; measured on {old.get('device_name')} then {new.get('device_name')}"
    return (f"time {format_seconds(before)} -> {format_seconds(after)}{change}, attention time share "
            f"{old['attention_time_share']:.3f} -> {new['attention_time_share']:.3f} (reported, not gated{where})")


# --- measuring -------------------------------------------------------------------------------

# Top-level ops (as the profiler names them in eager mode) that multiply matrices, and the
# positions of their two matrix operands.
_PRODUCTS: Mapping[str, tuple[int, ...]] = {
    "aten::linear": (0, 1), "aten::matmul": (0, 1), "aten::mm": (0, 1), "aten::bmm": (0, 1),
    "aten::addmm": (1, 2), "aten::baddbmm": (1, 2), "aten::addbmm": (1, 2), "aten::mv": (0, 1),
    "aten::addmv": (1, 2), "aten::dot": (0, 1), "aten::vdot": (0, 1), "aten::einsum": (),
    "aten::bilinear": (), "aten::tensordot": (), "aten::_grouped_mm": (0, 1),
    "aten::conv1d": (0, 1), "aten::conv2d": (0, 1), "aten::conv3d": (0, 1), "aten::convolution": (0, 1),
    "aten::_convolution": (0, 1), "aten::conv_transpose1d": (0, 1), "aten::conv_transpose2d": (0, 1),
    "aten::conv_transpose3d": (0, 1),
}
# Products whose second operand is a weight by construction.
_WEIGHT_OPS = frozenset({"aten::linear", "aten::bilinear", "aten::conv1d", "aten::conv2d", "aten::conv3d",
                         "aten::convolution", "aten::_convolution", "aten::conv_transpose1d",
                         "aten::conv_transpose2d", "aten::conv_transpose3d"})


def _fused_ops() -> frozenset[str]:
    from .counting import ATTENTION_OPS, TORCH_ATTENTION_OPS, MATMUL_LIKE_UNSUPPORTED

    fused = {op for op in MATMUL_LIKE_UNSUPPORTED if "attention" in op}
    return frozenset(ATTENTION_OPS | TORCH_ATTENTION_OPS | fused)


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return tuple(value)
    return None


def _operand_shapes(op: str, shapes: Sequence[Any]) -> list[tuple[int, ...]]:
    positions = _PRODUCTS.get(op, ())
    if positions:
        picked = [_shape(shapes[i]) for i in positions if i < len(shapes)]
    else:  # einsum and friends: every tensor operand (lists of shapes flattened)
        flat: list[Any] = []
        for value in shapes:
            if _shape(value) is not None:
                flat.append(value)
            elif isinstance(value, (list, tuple)):
                flat.extend(v for v in value if _shape(v) is not None)
        picked = [_shape(v) for v in flat]
    return [s for s in picked if s]


def _matmul_macs(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    if len(a) == 1 and len(b) == 1:
        return a[0]
    if len(a) == 1:
        a = (1, *a)
    if len(b) == 1:
        b = (*b, 1)
    batch_a, batch_b = a[:-2], b[:-2]
    width = max(len(batch_a), len(batch_b))
    batch_a, batch_b = (1,) * (width - len(batch_a)) + batch_a, (1,) * (width - len(batch_b)) + batch_b
    batch = math.prod(max(x, y) for x, y in zip(batch_a, batch_b))
    return batch * a[-2] * a[-1] * b[-1]


def _op_macs(op: str, shapes: Sequence[Any], fused: frozenset[str]) -> int | None:
    """MACs of one timed product from its recorded operand shapes (the counters' rules)."""
    try:
        if op in fused:
            q, k, v = (_shape(s) for s in shapes[:3])
            if not (q and k and v):
                return None
            # q: [.., n, d] @ k^T: [.., d, m], then [.., n, m] @ v: [.., m, dv], per query head
            return math.prod(q[:-1]) * k[-2] * (q[-1] + v[-1])
        operands = _operand_shapes(op, shapes)
        if op == "aten::linear" and len(operands) == 2:
            x, w = operands
            return math.prod(x[:-1]) * w[0] * w[1]  # [.., in] @ [in, out]
        if op in ("aten::matmul", "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm") and len(operands) == 2:
            return _matmul_macs(*operands)
    except (TypeError, IndexError, ValueError):
        return None
    return None


@dataclass
class _Placement:
    """The role map and what the split needs about each module, for placing timed ops."""

    roles: Mapping[str, str]
    explicit: bool  # the user's roles= (no structure): fused attention is a core anywhere
    param_shapes: Mapping[str, frozenset[tuple[int, ...]]]  # module -> shapes of its subtree's parameters
    buffer_shapes: Mapping[str, frozenset[tuple[int, ...]]]
    fused: frozenset[str]

    def origin(self, op: str, scope: str, shapes: Sequence[Any]) -> str:
        if op in _WEIGHT_OPS:
            return "param"
        operands = _operand_shapes(op, shapes)
        params = self.param_shapes.get(scope, frozenset())
        if any(s in params for s in operands if len(s) >= 2):
            return "param"
        buffers = self.buffer_shapes.get(scope, frozenset())
        if any(s in buffers for s in operands if len(s) >= 2):
            return "buffer"
        return "activation"

    def part(self, op: str, scope: str, shapes: Sequence[Any]) -> str:
        """The part one timed op belongs to (see the module docstring's table)."""
        from .roles import product_part, role_of

        role = role_of(scope, self.roles)
        if op in self.fused or op in _PRODUCTS:
            origin = "activation" if op in self.fused else self.origin(op, scope, shapes)
            part = product_part(role, op in self.fused, origin, self.explicit)
            return "other" if part == "unplaced" else part  # the split counts those as other too
        if role == "attention":
            return "attention_core"
        return "ffn" if role == "ffn" else "other"


def _shape_sets(model: Any) -> tuple[dict[str, frozenset[tuple[int, ...]]], dict[str, frozenset[tuple[int, ...]]]]:
    params: dict[str, frozenset[tuple[int, ...]]] = {}
    buffers: dict[str, frozenset[tuple[int, ...]]] = {}
    for name, module in model.named_modules():
        found = {tuple(p.shape) for p in module.parameters() if p.dim() >= 2}
        params[name] = frozenset(found | {s[::-1] for s in found if len(s) == 2})
        held = {tuple(b.shape) for b in module.buffers() if b.dim() >= 2}
        buffers[name] = frozenset(held | {s[::-1] for s in held if len(s) == 2})
    return params, buffers


def _role_map(target: Any, n: int | None, batch: int, inputs: Any, roles: Any,
              backend: str) -> tuple[dict[str, str], bool]:
    """The role map ``profile()``'s split uses: the same structure analysis on the same count
    (a meta twin, the same inputs, the backend that made the profile), or the user's globs."""
    from . import api, families
    from . import roles as roles_mod
    from torch import nn
    from .counting import CountError, count_forward, count_forward_torch, meta_twin, to_meta

    names = [name for name, _ in target.named_modules()]
    if roles is not None:
        return roles_mod.explicit_roles(roles, names), True
    if inputs is None:
        args, kwargs = api.default_inputs(target, n, batch)
    else:
        args, kwargs = to_meta(api._user_inputs(inputs, n, batch))
    twin = meta_twin(target)
    families.prepare_twin(twin)
    containers = [name for name, module in twin.named_modules() if isinstance(module, (nn.ModuleList, nn.Sequential))]
    experts = families.experts_of(twin)
    try:
        raw = count_forward(twin, args, kwargs) if backend == "fvcore" else count_forward_torch(twin, args, kwargs)
    except CountError:
        twin = meta_twin(target)
        families.prepare_twin(twin)
        raw = count_forward_torch(twin, args, kwargs)
    return roles_mod.find_structure(raw.records, containers, experts).roles(), False


def _device_of(device: Any) -> Any:
    import torch

    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise TimingError(f"device={device!r} is not a torch device: {exc}") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise TimingError(f"device={device!r}: no CUDA device is available here")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    elif resolved.type != "cpu":
        raise TimingError(f"device={device!r}: measure() runs on 'cpu' or 'cuda'")
    return resolved


def _runner(model: Any, device: Any, dtype: Any, seed: int) -> Any:
    """The module that is run: a copy of the user's (their weights), or a factory's, on *device*."""
    import torch
    from torch import nn

    from .api import _unwrap
    from .counting import real_twin

    if isinstance(model, nn.Module):
        model = _unwrap(model)
        if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            raise TimingError(f"{type(model).__name__} lives on the meta device: it has no weights to run; "
                              "pass a model with weights, or a zero-argument factory (random weights)")
        try:
            runner = real_twin(model)
        except Exception as exc:  # noqa: BLE001 - the model's own copy failed
            raise TimingError(f"cannot copy {type(model).__name__} to time it ({type(exc).__name__}: {exc}); "
                              "pass a zero-argument factory instead") from exc
        runner = runner.to(device)
    elif callable(model):
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            try:
                with torch.device(device):
                    runner = model()
            except Exception as exc:  # noqa: BLE001 - the factory is the user's code
                raise TimingError(f"the model factory {getattr(model, '__name__', model)!r} failed on {device} "
                                  f"({type(exc).__name__}: {exc})") from exc
        if not isinstance(runner, nn.Module):
            raise TimingError(f"the model factory returned {type(runner).__name__}, not an nn.Module")
        runner = _unwrap(runner).to(device)
    else:
        raise TimingError(f"measure() takes an nn.Module or a zero-argument factory, got {type(model).__name__}")
    if dtype is not None:
        runner = runner.to(dtype)
    return runner.eval()


def _real_inputs(value: Any, device: Any, dtype: Any, generator: Any) -> Any:
    """Inputs on *device*: meta tensors (default inputs) become values (random floats, zero ids,
    true masks); real ones are moved (floats cast to *dtype* when given)."""
    import torch
    from torch.utils import _pytree as pytree

    def leaf(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.is_floating_point():
            kind = dtype if dtype is not None else x.dtype
            if x.is_meta:
                return torch.randn(x.shape, generator=generator, dtype=torch.float32).to(device=device, dtype=kind)
            return x.to(device=device, dtype=kind)
        if x.is_meta:
            fill = 1 if x.dtype == torch.bool else 0
            return torch.full(x.shape, fill, dtype=x.dtype, device=device)
        return x.to(device)

    return pytree.tree_map(leaf, value)


@contextlib.contextmanager
def _timing_environment(device: Any, threads: int | None) -> Iterator[None]:
    """What the counters run: no autograd, the plain (not fused-block) attention path; RNG and
    the thread count restored afterwards."""
    import torch

    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # the fused encoder-layer kernel hides the whole block
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        torch.set_num_threads(before)


class _Ranges:
    """A ``record_function`` range per module call, from forward pre/post hooks on the runner."""

    def __init__(self, model: Any) -> None:
        import torch
        from torch.autograd.profiler import record_function

        # The fast range (torch >= 2.2) costs about 1 µs where record_function costs about 7: the
        # hooks' own time is unattributed, so it should be small.
        self._record_function = getattr(torch._C._profiler, "_RecordFunctionFast", record_function)
        self._open: list[Any] = []
        self._handles: list[Any] = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._enter(MODULE_RANGE + name)))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, label: str) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            scope = self._record_function(label)
            scope.__enter__()
            self._open.append(scope)

        return hook

    def _leave(self, module: Any, args: Any, output: Any) -> None:
        if self._open:
            self._open.pop().__exit__(None, None, None)

    def remove(self) -> None:
        while self._open:
            self._open.pop().__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()


class _Clock:
    """Times one forward: perf_counter on the CPU, CUDA events (device time) on a GPU."""

    def __init__(self, device: Any) -> None:
        self.cuda = device.type == "cuda"

    def time(self, run: Callable[[], Any]) -> float:
        import torch

        if not self.cuda:
            start = time.perf_counter()
            run()
            return time.perf_counter() - start
        begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
        begin.record()
        run()
        end.record()
        end.synchronize()
        return float(begin.elapsed_time(end)) / 1e3  # milliseconds -> seconds


@dataclass
class _Node:
    """One profiler event on the model's thread, with what nests inside it."""

    name: str
    start_ns: int
    end_ns: int
    shapes: list[Any]
    device_ns: int = 0  # kernels this op launched itself (a GPU)
    children: list[_Node] = field(default_factory=list)

    def seconds(self, device_time: bool) -> float:
        """Inclusive: the op's span on the CPU; on a GPU its kernels' and its children's."""
        return (self.kernel_ns() if device_time else self.end_ns - self.start_ns) / 1e9

    def kernel_ns(self) -> int:
        return self.device_ns + sum(child.kernel_ns() for child in self.children)

    def holds_module_range(self) -> bool:
        return any(c.name.startswith(MODULE_RANGE) or c.holds_module_range() for c in self.children)


def _event_tree(prof: Any) -> list[_Node]:
    """The repeat ranges, each with its nested events, from the profiler's raw (kineto) events.

    Reading the raw events is ten times faster than ``prof.events()`` (which builds a Python
    object with memory and stack details per event): it matters for 12-layer models. Kernels are
    attached to the op that launched them by correlation id, as ``torch.autograd.profiler`` does.
    """
    from torch._C._autograd import DeviceType

    raw = prof.profiler.kineto_results.events()
    repeats = [e for e in raw if e.name().startswith(REPEAT_RANGE)]
    if not repeats:
        return []
    thread = repeats[0].start_thread_id()
    kernels: dict[int, int] = {}
    frontend = []
    for event in raw:
        linked = event.linked_correlation_id()
        if event.device_type() != DeviceType.CPU:
            if linked > 0:
                kernels[linked] = kernels.get(linked, 0) + event.duration_ns()
            continue
        if linked != 0 or event.start_thread_id() != thread or event.end_thread_id() != thread:
            continue  # device runtime calls (cudaLaunchKernel) and other threads
        if event.is_async() or event.name().startswith(("profiler::", "[memory]")):
            continue
        frontend.append(event)
    nodes = [(_Node(e.name(), e.start_ns(), e.end_ns(), list(e.shapes())), e.correlation_id()) for e in frontend]
    for node, key in nodes:
        node.device_ns = kernels.get(key, 0)
    nodes.sort(key=lambda pair: (pair[0].start_ns, -pair[0].end_ns))
    roots: list[_Node] = []
    stack: list[_Node] = []
    for node, _ in nodes:
        while stack and (node.start_ns >= stack[-1].end_ns or node.end_ns > stack[-1].end_ns):
            stack.pop()
        (stack[-1].children if stack else roots).append(node)
        stack.append(node)
    return sorted((n for n in roots if n.name.startswith(REPEAT_RANGE)), key=lambda n: int(n.name[len(REPEAT_RANGE):]))


def _split_repeat(repeat: _Node, placement: _Placement, device_time: bool,
                  ) -> tuple[dict[str, float], dict[str, float], dict[str, int], dict[str, int]]:
    """Seconds per part and per module, timed MACs per part, and unread product ops, for one repeat."""
    parts = dict.fromkeys(PARTS, 0.0)
    modules: dict[str, float] = {}
    macs = dict.fromkeys(PARTS, 0)
    unread: dict[str, int] = {}

    def visit(event: _Node, scope: str) -> None:
        for child in event.children:
            if child.name.startswith(MODULE_RANGE):
                visit(child, child.name[len(MODULE_RANGE):])
                continue
            if child.name.startswith(REPEAT_RANGE) or child.holds_module_range():
                visit(child, scope)  # a range of the user's around module calls
                continue
            seconds = child.seconds(device_time)
            part = placement.part(child.name, scope, child.shapes)
            parts[part] += seconds
            modules[scope] = modules.get(scope, 0.0) + seconds
            if child.name in _PRODUCTS or child.name in placement.fused:
                counted = _op_macs(child.name, child.shapes, placement.fused)
                if counted is None:
                    unread[child.name] = unread.get(child.name, 0) + 1
                else:
                    macs[part] += counted

    visit(repeat, "")
    return parts, modules, macs, unread


def _describe(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    threads = torch.get_num_threads()
    return f"{platform.machine() or 'unknown'} CPU, {threads} thread{'' if threads == 1 else 's'}"


def measure(
    model: Any,
    n: int | None = None,
    *,
    batch: int | None = None,
    inputs: Any = None,
    roles: Mapping[str, Any] | None = None,
    spec: ModelSpec | None = None,
    name: str | None = None,
    device: Any = "cpu",
    dtype: Any = None,
    warmup: int = DEFAULT_WARMUP,
    repeats: int = DEFAULT_REPEATS,
    backend: str | None = None,
    seed: int = 0,
    threads: int | None = None,
) -> Timing:
    """Time *model*'s forward pass and split the time with the same roles as :func:`profile`.

    The model runs for real (see the module docstring): a copy of an ``nn.Module`` with its
    weights, or a factory's model built on *device* with random weights (seeded), in eval
    mode under ``no_grad``; the user's model and RNG are left as they were.

    Args:
        model: an ``nn.Module`` (its weights are used), or a zero-argument factory.
        n, batch, inputs, roles, spec, name, backend: as for :func:`profile`, which is run
            first for the MACs (cached).
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:1"``, a ``torch.device``). On a GPU the parts
            are kernel (device) times and the forward is timed with CUDA events.
        dtype: cast the copy's floating parameters and float inputs (``torch.bfloat16``);
            None keeps the model's.
        warmup: untimed forwards first.
        repeats: timed forwards (each plain and each traced); bounds need :data:`MIN_REPEATS`.
        seed: the seed for a factory's weights and for random float inputs.
        threads: CPU threads for the ops while timing (``torch.set_num_threads``, restored
            afterwards); None keeps the process's setting. On a busy machine, 1 is the least noisy.

    Returns:
        The :class:`Timing`.

    Raises:
        TimingError: bad arguments, or a model that cannot run (the message says why).
        ProfileError: anything :func:`profile` raises.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile, record_function

    from . import api

    for label, value, least in (("warmup", warmup, 0), ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise TimingError(f"{label} must be an int >= {least}, got {value!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise TimingError(f"threads must be a positive int, got {threads!r}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TimingError(f"dtype= must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
    where = _device_of(device)
    counted = api.profile(model, n, batch=batch, inputs=inputs, roles=roles, spec=spec, name=name, backend=backend)
    target = api._resolve_model(model)
    try:
        role_map, explicit = _role_map(target, n, counted.batch, inputs, roles, counted.backend)
    except Exception as exc:  # noqa: BLE001 - profile() just counted it: this should not fail
        raise TimingError(f"{counted.name}: the role map could not be rebuilt ({type(exc).__name__}: {exc})") from exc

    runner = _runner(model, where, dtype, seed)
    generator = torch.Generator().manual_seed(seed)
    # the inputs profile() counted, now with values (for a vision model n stays None: the image decides)
    if inputs is None:
        args, kwargs = api.default_inputs(target, n, counted.batch)
    else:
        args, kwargs = api._user_inputs(inputs, n, counted.batch)
    args, kwargs = _real_inputs((args, kwargs), where, dtype, generator)
    params, buffers = _shape_sets(runner)
    placement = _Placement(role_map, explicit, params, buffers, _fused_ops())
    clock = _Clock(where)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if where.type == "cuda" else [])

    def run() -> None:
        runner(*args, **kwargs)

    plain: list[float] = []
    traced: list[float] = []
    with _timing_environment(where, threads):
        try:
            for _ in range(warmup):
                clock.time(run)
            plain = [clock.time(run) for _ in range(repeats)]
            ranges = _Ranges(runner)
            try:
                with torch_profile(activities=activities, record_shapes=True) as prof:
                    run()  # the profiler's own first-call costs stay out of the repeats
                    for i in range(repeats):
                        with record_function(f"{REPEAT_RANGE}{i}"):
                            traced.append(clock.time(run))
            finally:
                ranges.remove()
        except TimingError:
            raise
        except Exception as exc:  # noqa: BLE001 - the model's reason is the user's best clue
            raise TimingError(f"{counted.name} could not run on {where} ({type(exc).__name__}: {exc})") from exc
        device_name = _describe(where)  # the thread count in force while timing

    repeat_events = _event_tree(prof)
    if len(repeat_events) != repeats:
        raise TimingError(f"{counted.name}: the profiler recorded {len(repeat_events)} of {repeats} repeats")
    samples: dict[str, list[float]] = {key: [] for key in (*PARTS, *TOTALS)}
    by_module: dict[str, list[float]] = {}
    timed_macs = dict.fromkeys(PARTS, 0)
    unread: dict[str, int] = {}
    device_time = where.type == "cuda"
    for i, event in enumerate(repeat_events):
        parts, modules, macs, missing = _split_repeat(event, placement, device_time)
        attributed = sum(parts.values())
        for part in PARTS:
            samples[part].append(parts[part])
        samples["attributed"].append(attributed)
        samples["traced"].append(traced[i])
        samples["unattributed"].append(traced[i] - attributed)
        samples["forward"].append(plain[i])
        for module, seconds in modules.items():
            by_module.setdefault(module, []).append(seconds)
        if i == 0:
            timed_macs, unread = macs, missing

    notes: list[str] = []
    mac_parts = {part: getattr(counted, part) for part in PARTS}
    for part in ("attention_core", "attention_proj", "ffn"):
        if not unread and timed_macs[part] != mac_parts[part]:
            notes.append(TIMED_MACS_NOTE.format(timed=timed_macs[part], part=part, counted=mac_parts[part]))
    if unread:
        notes.append(UNREAD_MACS_NOTE.format(count=sum(unread.values()), ops=", ".join(sorted(unread))))
    forward, traced_median = _median(plain), _median(traced)
    if forward > 0 and traced_median > 1.5 * forward:
        notes.append(TRACE_OVERHEAD_NOTE.format(forward=format_seconds(forward), traced=format_seconds(traced_median)))
    return Timing(
        name=counted.name,
        n=counted.n,
        batch=counted.batch,
        device=str(where),
        device_name=device_name,
        dtype=str(next((p.dtype for p in runner.parameters()), torch.get_default_dtype())).replace("torch.", ""),
        clock="device" if device_time else "wall",
        warmup=warmup,
        repeats=repeats,
        samples={key: tuple(values) for key, values in samples.items()},
        macs=mac_parts,
        roles=dict(role_map),
        by_module={module: _median(values) for module, values in by_module.items()},
        timed_macs=timed_macs,
        notes=tuple(notes),
        profile=counted,
    )


# --- sweeps ----------------------------------------------------------------------------------


class TimingSweep(Sequence[Timing]):
    """Timings of one model at several lengths (ordered by n), with the measured time crossover."""

    def __init__(self, timings: Sequence[Timing], spec: ModelSpec | None = None) -> None:
        self._timings = tuple(sorted(timings, key=lambda t: t.n))
        if len({t.n for t in self._timings}) != len(self._timings):
            raise ValueError("a sweep needs distinct lengths")
        self.spec = spec

    def __getitem__(self, index: Any) -> Any:
        return self._timings[index]

    def __len__(self) -> int:
        return len(self._timings)

    def __repr__(self) -> str:
        return f"TimingSweep({self.name!r}, n={self.lengths})"

    @property
    def name(self) -> str:
        return self._timings[0].name if self._timings else ""

    @property
    def lengths(self) -> list[int]:
        return [t.n for t in self._timings]

    def crossover(self) -> float | None:
        """Where attention's *time* overtakes the FFN's: the attention time share crosses 1/2,
        interpolated linearly between the two measured lengths around it (the first crossing);
        None when it does not cross within the sweep."""
        points = [(t.n, t.attention_time_share - 0.5) for t in self._timings]
        for (n1, d1), (n2, d2) in zip(points, points[1:]):
            if d1 < 0 <= d2:
                return n1 + (n2 - n1) * (-d1) / (d2 - d1)
        return None

    def formula_crossover(self) -> float | None:
        """The formula's crossover for the spec (2hd for the article's shape)."""
        from .formulas import crossover_n

        value = crossover_n(self.spec) if self.spec is not None else None
        return None if value is None else float(value)

    def mac_crossover(self) -> float | None:
        """Where attention's MACs overtake the FFN's: solved exactly from the profiles (see
        :meth:`Sweep.crossover`) when every timing has one, else interpolated like :meth:`crossover`."""
        profiles = [t.profile for t in self._timings]
        if len(profiles) >= 2 and all(p is not None for p in profiles):
            from .sweep import Sweep, SweepError

            try:
                exact = Sweep(profiles).crossover()
                return None if exact is None else float(exact)
            except SweepError:
                pass  # not of the form a·n + b·n²: interpolate
        points = [(t.n, t.attention_mac_share - 0.5) for t in self._timings]
        for (n1, d1), (n2, d2) in zip(points, points[1:]):
            if d1 < 0 <= d2:
                return n1 + (n2 - n1) * (-d1) / (d2 - d1)
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: every timing, the measured time crossover, and the formula's."""
        return {
            "name": self.name,
            "lengths": self.lengths,
            "time_crossover_n": self.crossover(),
            "mac_crossover_n": self.mac_crossover(),
            "formula_crossover_n": self.formula_crossover(),
            "timings": [t.to_dict() for t in self._timings],
        }


def measure_sweep(model: Any, ns: Sequence[int], **measure_kwargs: Any) -> TimingSweep:
    """:func:`measure` at every length in *ns* (one factory, built for each length)."""
    from . import api

    if isinstance(ns, (str, bytes)) or not hasattr(ns, "__iter__"):
        raise TimingError(f"ns must be a list of lengths such as [128, 512, 2048], got {ns!r}")
    lengths = list(ns)
    if not lengths or len(set(lengths)) != len(lengths):
        raise TimingError(f"ns must hold distinct lengths, got {lengths!r}")
    if "n" in measure_kwargs:
        raise TimingError("measure_sweep() takes the lengths as ns=[...], not n=")
    timings = [measure(model, n, **measure_kwargs) for n in lengths]
    # the profiles' spec: read from the config and corrected by the structure (gating, hybrid stacks)
    first = timings[0].profile
    spec = measure_kwargs.get("spec") or (first.spec if first is not None else api.spec_of(api._resolve_model(model)))
    return TimingSweep(timings, spec)


def plot_time_shares(data: Mapping[str, Any], directory: Path, stem: str) -> list[Path]:
    """Write ``<stem>-time-shares`` (PNG and SVG): attention's share of MACs and of time vs n,
    with the formula's crossover and the measured ones; *data* is :meth:`TimingSweep.to_dict`."""
    from .plots import shares_plot

    rows = sorted(data["timings"], key=lambda r: r["n"])
    ns = [r["n"] for r in rows]

    def draw(ax: Any) -> None:
        ax.plot(ns, [r["attention_mac_share"] for r in rows], marker="o", label="attention share of MACs")
        ax.plot(ns, [r["attention_time_share"] for r in rows], marker="s", label="attention share of time")
        formula = data.get("formula_crossover_n")
        if formula:
            ax.axvline(formula, color="black", linestyle="--", linewidth=1,
                       label=f"attention = FFN in MACs (formula): n={formula:,.0f}")
        measured = data.get("time_crossover_n")
        if measured:
            ax.axvline(measured, color="red", linestyle="-.", linewidth=1,
                       label=f"attention = FFN in time (measured): n={measured:,.0f}")

    where = rows[0]["device_name"] if rows else ""
    return shares_plot(ns, f"{data['name']}: MACs vs time ({where})", directory, f"{stem}-time-shares", draw)
