"""The ``attncost`` marker: one spec of allowed keywords, parsed and validated, and every check over a
:class:`Profile`, a :class:`Sweep` or a :class:`Timing` (bounds on measured time included).

Plain functions of plain data: no pytest session is needed to test them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from . import devices
from .conventions import Formula
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .footprint import MEMORY_BOUNDS, MEMORY_SHARE_BOUNDS, MEMORY_SIZE_BOUNDS, memory_problems
from .formulas import relative_deviation
from .request import COMPONENTS, MODES, PARTS
from .result import Profile, Timing
from .series import Sweep, SweepError
from .units import format_bytes, format_count, format_seconds, format_tokens, parse_bytes, parse_count

__all__ = ["GATED_PARTS", "MARKER_HELP", "MIN_REPEATS", "TIME_BOUNDS", "Bounds", "MarkerError", "check_bounds",
           "check_mfu", "check_sweep", "check_time_bounds", "parse_marker_kwargs", "parse_time_bound"]

#: The counts a baseline compares (and a per-part increase limit names): the total first.
GATED_PARTS = ("total", *PARTS)

MARKER_HELP = (
    "attncost(n=None, batch=1, **bounds): profile with the attncost fixture at length n "
    "(a list parametrizes the test, one item per length) and fail the test when a profile "
    "breaks a bound: attention_share_max, attention_share_min, quadratic_share_max, "
    "total_max, attention_max, ffn_max, executed_max (MACs, or strings such as '45 GMAC' / '90 GFLOP'), "
    "formula_rtol, linear_saving_max, max_increase (percent over the --attncost-compare baseline), "
    "crossover_min, crossover_max, crossover_rtol (checked on attncost.sweep() results), "
    "crosscheck (count with fvcore and torch's FlopCounterMode, fail when they disagree), "
    "mode ('forward', 'train' or 'decode': the fixture's default), new_tokens (a decode step's queries), "
    "kv_cache_max (bytes of a decode step's KV cache: an int or '2 GiB', '512 MB'), "
    "attention_time_share_max/min and quadratic_time_share_max/min (shares of the time attncost.measure() "
    "measured, broken only beyond the spread of at least 5 repeats), "
    "audit (a function n -> FLOPs, or pytest_attncost.Formula: fails with the terms it differs from the count by), "
    "mfu_min with peak ('h100-sxm-bf16', 'cpu-fp32' or FLOP/s: the counted FLOPs over the measured forward time), "
    "peak_memory_max/min and activation_memory_max/min (bytes of the memory estimate: an int or '80 GB', '2 GiB'; "
    "with mode='train' a training step) and attention_memory_share_max/min (the n×n matrices' share of saved "
    "activations): any of them estimates the memory too."
)

NO_PROFILE = "no model was profiled: call attncost.profile(model) in the test body"


class MarkerError(ValueError):
    """A malformed attncost marker; the message is shown to the user verbatim."""


@dataclass(frozen=True)
class Bounds:
    """The marker, parsed. ``None`` means "no bound"."""

    lengths: tuple[int, ...] = ()
    batch: int | None = None
    m: int | None = None  # the second sequence's length (encoder-decoders, cross-attention)
    attention_share_max: float | None = None
    attention_share_min: float | None = None
    quadratic_share_max: float | None = None
    total_max: Fraction | None = None  # MACs
    executed_max: Fraction | None = None  # MACs a train step executes: total and the recompute (hardware_flops / 2)
    attention_max: Fraction | None = None
    ffn_max: Fraction | None = None
    formula_rtol: float | None = None
    linear_saving_max: float | None = None
    max_increase: float | dict[str, float] | None = None  # percent over the baseline, or per part
    crossover_min: float | None = None  # tokens, measured by sweeps
    crossover_max: float | None = None
    crossover_rtol: float | None = None
    crosscheck: bool | None = None  # count with both backends and fail when they disagree
    mode: str | None = None  # the fixture's default mode ("decode": a step against a KV cache)
    new_tokens: int | None = None  # the fixture's default decode step
    kv_cache_max: int | None = None  # bytes of a decode step's KV cache
    # measured time shares (attncost.measure): broken only beyond the repeats' own spread
    attention_time_share_max: float | None = None
    attention_time_share_min: float | None = None
    quadratic_time_share_max: float | None = None
    quadratic_time_share_min: float | None = None
    audit: Formula | None = None  # a user's FLOPs formula, which must agree with the count
    mfu_min: float | None = None  # counted FLOPs / measured time / peak, beyond the noise
    peak: str | float | None = None  # "h100-sxm-bf16", "cpu-fp32" or FLOP/s
    # the memory estimate (profile(memory=True), implied by any of them): bytes, and the n×n matrices' share
    peak_memory_max: int | None = None
    peak_memory_min: int | None = None
    activation_memory_max: int | None = None
    activation_memory_min: int | None = None
    attention_memory_share_max: float | None = None
    attention_memory_share_min: float | None = None

    @property
    def has_bounds(self) -> bool:
        return any(getattr(self, f.name) not in (None, False) for f in dataclasses.fields(self)
                   if f.name not in ("lengths", "batch", "m", "mode", "new_tokens"))

    @property
    def has_memory_bounds(self) -> bool:
        return any(getattr(self, name) is not None for name in MEMORY_BOUNDS)

    @property
    def has_sweep_bounds(self) -> bool:
        return any(getattr(self, name) is not None for name in _CROSSOVERS)


_CROSSOVERS = ("crossover_min", "crossover_max", "crossover_rtol")
_SHARES = ("attention_share_max", "attention_share_min", "quadratic_share_max", "linear_saving_max")
_COUNTS = ("total_max", "attention_max", "ffn_max", "executed_max")
KEYWORDS = frozenset({"n"} | {f.name for f in dataclasses.fields(Bounds)} - {"lengths"})


def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _length(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MarkerError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise MarkerError(f"{name} must be a positive int, got {value!r}")
    return value


def _lengths(value: object) -> tuple[int, ...]:
    if isinstance(value, (list, tuple)):
        if not value:
            raise MarkerError("n=[] is empty: give one length or a list of lengths, e.g. n=[128, 512]")
        lengths = tuple(_length("every n", v) for v in value)
        if len(set(lengths)) != len(lengths):
            raise MarkerError(f"n={list(value)!r} repeats a length")
        return lengths
    return (_length("n", value),)


def _number(ok: Callable[[Any], bool], want: str) -> Callable[[str, object], float]:
    """A keyword's parser of numbers *ok* accepts; the MarkerError says the keyword must be *want*."""
    def parser(name: str, value: object) -> float:
        if not _is_number(value) or not ok(value):
            raise MarkerError(f"{name} must be {want}, got {value!r}")
        return float(value)  # type: ignore[arg-type]

    return parser


_share = _number(lambda v: 0 <= v <= 1, "a number in [0, 1]")
_rtol = _number(lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0 (a relative tolerance such as 0.01)")
_tokens = _number(lambda v: math.isfinite(v) and v > 0, "a positive number of tokens")


def _read(parse: Callable[[object], Any]) -> Callable[[str, object], Any]:
    """A keyword's parser from a parser of values: its ValueError becomes the keyword's MarkerError."""
    def parser(name: str, value: object) -> Any:
        try:
            return parse(value)
        except ValueError as exc:  # a UnitError too
            raise MarkerError(f"{name}: {exc}") from None

    return parser


# --- bounds on measured time -------------------------------------------------------------------

#: The repeats a bound on measured time needs: fewer cannot tell a broken bound from a noisy one.
MIN_REPEATS = 5
TIME_BOUNDS = ("attention_time_share_max", "attention_time_share_min", "quadratic_time_share_max",
               "quadratic_time_share_min")
TIME_BOUND_MESSAGE = ("{stat} {median:.3f} {op} {limit:g} beyond the noise at n={n} on {where} "
                      "(median of {repeats} repeats, spread ±{spread:.3f}; MAC share {macs:.3f})")
TOO_FEW_REPEATS = ("{bound}={limit:g}: {name} at n={n} was timed {repeats} time(s); a bound on measured time needs "
                   "at least {minimum} repeats to tell a broken bound from noise: measure(..., repeats={minimum})")
NO_TIMING = "{bound}: nothing was timed: call attncost.measure(model) in the test body"


def parse_time_bound(name: str, value: object) -> float:
    """Validate one marker keyword of :data:`TIME_BOUNDS`; raises MarkerError naming it."""
    if name not in TIME_BOUNDS:
        raise MarkerError(f"unknown time bound {name!r}; valid: {', '.join(TIME_BOUNDS)}")
    return _share(name, value)


_INCREASE_FORM = "expected a percentage >= 0 such as 2.5, or per part such as ffn:5%,total:0%"
#: What a per-part increase limit may name (``*``: every part not named).
INCREASE_PARTS = (*GATED_PARTS, "*")


def parse_increase(value: object) -> float | dict[str, float]:
    """An allowed increase over the baseline, in percent: one number for every part (``2.5``, ``"2.5%"``), or per
    part (``"ffn:5%,total:0%"``, ``{"ffn": 5, "total": 0}``), the parts not named held to ``*`` or else 0.
    A ValueError names what is wrong and the form expected."""
    if isinstance(value, str) and ":" not in value:
        value = value.strip().rstrip("%").strip()
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{_INCREASE_FORM}, got {value!r}") from None
    if isinstance(value, str):
        pairs = [item.partition(":") for item in value.split(",") if item.strip()]
        value = {part.strip(): percent.strip().rstrip("%") for part, _, percent in pairs}
    if isinstance(value, dict):
        unknown = [part for part in value if part not in INCREASE_PARTS]
        if unknown or not value:
            raise ValueError(f"per-part increase limits name {', '.join(map(repr, unknown)) or 'no part'}; the "
                             f"parts are {', '.join(INCREASE_PARTS)}")
        return {part: parse_increase(percent) for part, percent in value.items()}  # type: ignore[misc]
    if not _is_number(value) or not math.isfinite(value) or value < 0:  # type: ignore[arg-type,operator]
        raise ValueError(f"{_INCREASE_FORM}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def increase_for(allowed: float | Mapping[str, float], part: str) -> float:
    """The increase *allowed* lets *part* grow by, in percent."""
    return float(allowed.get(part, allowed.get("*", 0.0)) if isinstance(allowed, Mapping) else allowed)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise MarkerError(f"{name} must be True or False, got {value!r}")
    return value


def _formula(name: str, value: object) -> Formula:
    if isinstance(value, Formula):
        return value
    if not callable(value):
        raise MarkerError(f"{name} takes a function n -> FLOPs of one sequence (or (spec, n) -> FLOPs), or "
                          f"pytest_attncost.Formula(function, per='token', unit='MAC', vocab=..., tolerance=...), "
                          f"got {value!r}")
    return Formula(value)


def _mode(name: str, value: object) -> str:
    if value not in MODES:
        raise MarkerError(f"{name} must be one of {', '.join(map(repr, MODES))}, got {value!r}")
    return str(value)


#: How each keyword is read (in the order problems are reported).
_PARSERS: Mapping[str, Callable[[str, object], Any]] = {
    "batch": _length, "m": _length, **dict.fromkeys(_SHARES, _share), **dict.fromkeys(_COUNTS, _read(parse_count)),
    "formula_rtol": _rtol, "max_increase": _read(parse_increase), "crossover_min": _tokens, "crossover_max": _tokens,
    "crosscheck": _flag, "crossover_rtol": _rtol, "mode": _mode, "new_tokens": _length,
    "kv_cache_max": _read(parse_bytes), **dict.fromkeys(TIME_BOUNDS, _share), "audit": _formula, "mfu_min": _share,
    "peak": _read(devices.check_peak),
    **dict.fromkeys(MEMORY_SIZE_BOUNDS, _read(parse_bytes)), **dict.fromkeys(MEMORY_SHARE_BOUNDS, _share),
}


def parse_marker_kwargs(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Bounds:
    """Validate the marker's arguments; every problem raises a MarkerError naming the keyword."""
    if args:
        raise MarkerError("takes keyword arguments only, e.g. attncost(n=512, attention_share_max=0.5)")
    for name in sorted(set(kwargs) - KEYWORDS):
        close = difflib.get_close_matches(name, KEYWORDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise MarkerError(f"unknown keyword {name!r}{hint}; valid: {', '.join(sorted(KEYWORDS))}")
    values: dict[str, Any] = {"lengths": _lengths(kwargs["n"])} if "n" in kwargs else {}
    for name, parse in _PARSERS.items():
        if name in kwargs:
            values[name] = parse(name, kwargs[name])
        if name == "new_tokens" and name in kwargs and values.get("mode") != "decode":
            raise MarkerError("new_tokens is a decode step's query length: add mode='decode'")
    if values.get("m") is not None and values.get("mode") == "decode":
        raise MarkerError("m is the second sequence's length (encoder-decoders, cross-attention); a decode step has "
                          "n (its cache) and new_tokens: drop m")
    bounds = Bounds(**values)
    if (bounds.mfu_min is None) != (bounds.peak is None):
        raise MarkerError("mfu_min and peak go together: mfu_min=0.35 with peak='h100-sxm-bf16' (a device of "
                          f"{', '.join(devices.DEVICES)} or 'cpu' with its dtype), or peak= a number of FLOP/s")
    low, high = bounds.crossover_min, bounds.crossover_max
    if low is not None and high is not None and low > high:
        raise MarkerError(f"crossover_min {low:g} > crossover_max {high:g}: no sweep can pass")
    low, high = bounds.attention_share_min, bounds.attention_share_max
    if low is not None and high is not None and low > high:
        raise MarkerError(f"attention_share_min {low} > attention_share_max {high}: no share can pass")
    return bounds


def merged_kwargs(marks: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Combine marks from closest (function) to farthest (module): the nearest keyword wins."""
    args = next((tuple(mark.args) for mark in marks if mark.args), ())
    return args, {key: value for mark in reversed(marks) for key, value in mark.kwargs.items()}


# --- checks ------------------------------------------------------------------------------


def _fraction_text(value: float) -> str:
    return f"{int(value)}" if float(value).is_integer() else f"{float(value):.1f}"


def threshold_notes(profile: Profile) -> tuple[str, str]:
    """'attention overtakes FFN at n=1536 = 2hd' and 'quadratic term dominates at n=4608 = 6hd'."""
    if profile.spec is None:
        return ("no spec, so no threshold", "no spec, so no threshold")
    crossover, quadratic = profile.crossover_n, profile.quadratic_n
    hd = profile.spec.heads * profile.spec.head_dim
    first = ("attention costs more than the FFN at every n" if crossover is None else
             f"attention overtakes FFN at n={_fraction_text(crossover)}" + (" = 2hd" if crossover == 2 * hd else ""))
    second = ("no quadratic crossover" if quadratic is None else
              f"quadratic term dominates at n={_fraction_text(quadratic)}" + (" = 6hd" if quadratic == 6 * hd else ""))
    return first, second


def _formula_share(profile: Profile, part: str) -> str:
    formula = profile.formula
    if formula is None:
        return "no formula"
    denominator = formula.attention + formula.ffn
    return f"formula {getattr(formula, part) / denominator if denominator else 0.0:.3f}"


def check_bounds(bounds: Bounds, profile: Profile, unit: str = "mac") -> list[str]:
    """Every bound *profile* breaks, as one readable line each."""
    where = f"at n={profile.n}" + (f", batch={profile.batch}" if profile.batch != 1 else "")
    return [*_share_problems(bounds, profile, where), *_count_problems(bounds, profile, unit, where),
            *_shape_problems(bounds, profile, where), *_audit_problems(bounds.audit, profile.audit, where),
            *memory_problems({name: getattr(bounds, name) for name in MEMORY_BOUNDS}, profile.memory, where)]


def _audit_problems(formula: Formula | None, audit: Callable[[Formula], Any], where: str) -> list[str]:
    """The formula's disagreement with the count, or why it could not be audited, as problem lines."""
    if formula is None:
        return []
    try:
        audited = audit(formula)
    except ValueError as exc:  # a formula that returns no number, a decode step, a train-mode sweep
        return [f"audit={formula.name}: {exc} {where}"]
    return [] if audited.ok else [str(audited)]


def _share_problems(bounds: Bounds, profile: Profile, where: str) -> list[str]:
    crossover_note, quadratic_note = threshold_notes(profile)
    share, quadratic = profile.attention_share, profile.quadratic_share
    checks = (("attention_share", share, bounds.attention_share_max, ">", "attention", crossover_note),
              ("attention_share", share, bounds.attention_share_min, "<", "attention", crossover_note),
              ("quadratic_share", quadratic, bounds.quadratic_share_max, ">", "attention_core", quadratic_note))
    return [f"{name} {value:.3f} {op} {limit} {where} ({_formula_share(profile, part)}; {note})"
            for name, value, limit, op, part, note in checks
            if limit is not None and (value > limit if op == ">" else value < limit)]


def _count_problems(bounds: Bounds, profile: Profile, unit: str, where: str) -> list[str]:
    problems: list[str] = []
    formula = profile.formula
    for name in _COUNTS:
        part, limit = name.removesuffix("_max"), getattr(bounds, name)
        measured = profile.hardware_flops // 2 if part == "executed" else getattr(profile, part)
        if limit is None or measured <= limit:
            continue
        if part == "executed":
            note = f"the recompute of activation checkpointing {format_count(sum(profile.recompute.values()), unit)}"
        elif formula is not None:
            expected = formula.attention + formula.ffn if part == "total" else getattr(formula, part)
            note = f"formula{' attention+ffn' if part == 'total' else ''} {format_count(expected, unit)}"
        else:
            note = "no formula"
        problems.append(f"{part} {format_count(measured, unit)} > {name} {format_count(limit, unit)} {where} "
                        f"({measured:,} > {_exact(limit)} MAC; {note})")
    return problems


_NEEDS_SHAPE = "needs the model's shape: pass spec=ModelSpec(...) to profile()"
#: The bounds on what a profile may lack: the attribute each reads, and what it needs when that is missing.
_NEEDS = {"linear_saving_max": ("linear_attention_saving", _NEEDS_SHAPE),
          "kv_cache_max": ("kv_cache_bytes", "bounds a decode step's KV cache: profile with mode='decode'"),
          "formula_rtol": ("formula", _NEEDS_SHAPE)}


def _shape_problems(bounds: Bounds, profile: Profile, where: str) -> list[str]:
    """The bounds that need the model's shape or mode: linear saving, KV cache, the formula's tolerance."""
    problems: list[str] = []
    for name, (attribute, need) in _NEEDS.items():
        limit, value = getattr(bounds, name), getattr(profile, attribute)
        if limit is None:
            continue
        if value is None:
            problems.append(f"{name} {need} {where}")
        elif name == "linear_saving_max" and value > limit:
            problems.append(f"linear_attention_saving {value:.4f} > {limit} {where} (linear attention would save "
                            f"{value:.2%} of attention+ffn; {threshold_notes(profile)[0]})")
        elif name == "kv_cache_max" and value > limit:
            problems.append(f"kv_cache_bytes {format_bytes(value)} > kv_cache_max {format_bytes(limit)} {where} "
                            f"({value:,} > {limit:,} bytes; decode step of {profile.new_tokens} against "
                            f"{profile.n:,} cached tokens)")
        elif name == "formula_rtol":
            deviations = [(part, profile.in_layers(part), getattr(value, part)) for part in COMPONENTS]
            problems += [f"{part} {got:,} MAC deviates {relative_deviation(got, want):.2%} from the formula's "
                         f"{want:,} (formula_rtol {limit}) {where}"
                         for part, got, want in deviations if relative_deviation(got, want) > limit]
    return problems


def _exact(value: Fraction) -> str:
    return f"{value.numerator:,}" if value.denominator == 1 else f"{float(value):,.1f}"


NO_SWEEP = "crossover bounds need a sweep: call attncost.sweep(model, [n1, n2, ...]) in the test body"


def check_sweep(bounds: Bounds, sweep: Sweep) -> list[str]:
    """Every crossover bound *sweep* breaks, and the formula it audits where it disagrees over the lengths."""
    if bounds.audit is not None and len(sweep) > 1:
        audited = _audit_problems(bounds.audit, sweep.audit, f"(sweep of {sweep.name} over n={sweep.lengths})")
        return [f"sweep of {sweep.name}: {problem}" for problem in audited] + check_sweep(
            dataclasses.replace(bounds, audit=None), sweep)
    if not bounds.has_sweep_bounds:
        return []
    try:
        exact = sweep.crossover()
    except SweepError as exc:
        return [f"sweep of {sweep.name}: {exc}"]
    expected = sweep.formula_crossover()
    formula = None if expected is None else float(expected)
    note = "no formula" if formula is None else f"formula {format_tokens(formula)}"
    where = f"(sweep of {sweep.name} over n={sweep.lengths}; {note})"
    if exact is None:
        return [f"no crossover: attention never equals the FFN {where}"]
    measured = float(exact)
    problems = [f"crossover n={format_tokens(measured)} {op} {bound} {format_tokens(limit)} {where}"
                for bound, op, limit in (("crossover_min", "<", bounds.crossover_min),
                                         ("crossover_max", ">", bounds.crossover_max))
                if limit is not None and (measured < limit if op == "<" else measured > limit)]
    if bounds.crossover_rtol is not None:
        if formula is None:
            problems.append(f"crossover_rtol needs the model's shape: pass spec=ModelSpec(...) {where}")
        elif abs(measured - formula) > bounds.crossover_rtol * formula:
            problems.append(
                f"crossover n={format_tokens(measured)} deviates {abs(measured - formula) / formula:.2%} from the "
                f"formula's {format_tokens(formula)} (crossover_rtol {bounds.crossover_rtol}) {where}"
            )
    return problems


def _where(timing: Timing) -> str:
    return "this CPU" if timing.device == "cpu" else timing.device_name or timing.device


def _judged(timings: Sequence[Timing] | Timing, wanted: Mapping[str, float],
            judge: Callable[[Timing, str, float], str | None]) -> list[str]:
    """*judge*'s problem with each timing under each bound of *wanted* (bound -> limit), timing by timing; a timing
    of too few repeats cannot be judged, and nothing timed is a problem of its own."""
    timings = [timings] if isinstance(timings, Timing) else timings
    if not wanted:
        return []
    if not timings:
        return [NO_TIMING.format(bound=", ".join(sorted(wanted)))]
    found = (judge(timing, bound, limit) if timing.repeats >= MIN_REPEATS else
             TOO_FEW_REPEATS.format(bound=bound, limit=limit, name=timing.name, n=timing.n, repeats=timing.repeats,
                                    minimum=MIN_REPEATS)
             for timing in timings for bound, limit in wanted.items())
    return [problem for problem in found if problem is not None]


def check_time_bounds(timings: Sequence[Timing] | Timing, bounds: Mapping[str, float | None]) -> list[str]:
    """Every broken bound on measured shares, as messages (empty: all hold): a ``*_max`` bound fails when ``median -
    spread > limit``, a ``*_min`` bound when ``median + spread < limit``. A bound over a timing of fewer than
    :data:`MIN_REPEATS` repeats fails with a message asking for more, rather than passing on noise."""
    wanted = {k: v for k, v in bounds.items() if v is not None}
    for key in [key for key in wanted if key not in TIME_BOUNDS]:
        raise ValueError(f"unknown time bound {key!r}; valid: {', '.join(TIME_BOUNDS)}")
    return _judged(timings, wanted, _time_share_problem)


def _time_share_problem(timing: Timing, bound: str, limit: float) -> str | None:
    stat, _, side = bound.rpartition("_")
    median, spread = timing.median(stat), timing.spread(stat)
    if not (median - spread > limit if side == "max" else median + spread < limit):
        return None
    macs = timing.attention_mac_share if stat.startswith("attention") else timing.quadratic_mac_share
    return TIME_BOUND_MESSAGE.format(stat=stat, median=median, op=">" if side == "max" else "<", limit=limit,
                                     n=timing.n, where=_where(timing), repeats=timing.repeats, spread=spread, macs=macs)


MFU_MESSAGE = ("MFU {mfu:.3f} < mfu_min {limit:g} beyond the noise at n={n} on {where}: {flops:.4g} model FLOP (the "
               "exact count of the forward, 2 FLOP per MAC, causal={causal!r}) in {seconds} (median of {repeats} "
               "forwards, spread ±{spread}) = {rate:.4g} FLOP/s against {peak}")


def check_mfu(timings: Sequence[Timing] | Timing, mfu_min: float | None, peak: str | float | None) -> list[str]:
    """MFU (the counted FLOPs of a forward over its measured time, over the peak) below *mfu_min* even at the
    median less the spread. A forward re-runs nothing: model and hardware FLOPs agree (:attr:`Profile.model_flops`)."""
    if mfu_min is None or peak is None:
        return []
    if isinstance(timings, Timing) or timings:  # the peak read (or this CPU's measured) once, as soon as anything ran
        rate_at_peak, named = devices.peak_flops(peak)

    def judge(timing: Timing, bound: str, limit: float) -> str | None:
        flops = 2 * sum(timing.macs.values())
        seconds, spread = timing.forward, timing.spread("forward")
        if not flops / max(seconds - spread, 1e-12) / rate_at_peak < limit:
            return None
        return MFU_MESSAGE.format(
            mfu=flops / seconds / rate_at_peak, limit=limit, n=timing.n, where=_where(timing), flops=flops,
            causal=getattr(timing.profile, "causal", "full"), seconds=format_seconds(seconds),
            repeats=timing.repeats, spread=format_seconds(spread), rate=flops / seconds, peak=named)

    return _judged(timings, {"mfu_min": mfu_min}, judge)
