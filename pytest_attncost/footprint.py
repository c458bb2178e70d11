"""Memory's cost model and its record, torch-free: what a Transformer keeps for the backward, what its model state
weighs under each optimizer, where the ``n×n`` term passes the rest, and :class:`Memory`, the record a
:class:`~pytest_attncost.result.Profile` holds (made by :mod:`pytest_attncost.memory`).

Per layer of ``s`` tokens, batch ``b``, hidden ``H``, ``a`` heads, ``p`` bytes per activation and ``m`` per
dropout-mask element (Korthikanti et al. 2022, "Reducing Activation Recomputation", with the mask's bytes kept
apart; their ``sbh(34 + 5as/h)`` is ``p = 2, m = 1``)::

    with dropout     s·b·H·(16p + 2m) + a·s²·b·(2p + m)
    without dropout  16·s·b·H·p + a·s²·b·p        (eager: the probabilities only)
    fused (sdpa)     16·s·b·H·p + a·s·b·4          (no n×n tensor; a float32 logsumexp per query and head)

The ``n²`` term passes the linear one at ``n = d·(16p + 2m)/(2p + m)`` (``16·d`` without dropout), far below the
MAC crossover ``6·h·d`` (:func:`memory_crossover_n`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .formulas import ModelSpec, relative_deviation

__all__ = ["CATEGORIES", "Memory", "OPTIMIZERS", "STATE_FACTORS", "activation_bytes",
           "memory_crossover_n", "memory_crossovers", "model_state_bytes"]

#: What is live at the peak, by what it is.
CATEGORIES = ("parameters", "buffers", "gradients", "optimizer_state", "inputs", "kv_cache", "saved_activations",
              "temporaries")
OPTIMIZERS = ("adamw", "sgd")
#: Peak model state in parameter bytes: parameters + gradients + optimizer state + the step's temporaries.
#: AdamW foreach: exp_avg and exp_avg_sq, and one temporary of every parameter's size (4 + 1); fused: no
#: temporary; single-tensor: a temporary of the largest parameter twice (see :func:`model_state_bytes`); SGD:
#: parameters and gradients (no momentum buffer by default).
STATE_FACTORS = {("adamw", "foreach"): 5, ("adamw", "fused"): 4, ("adamw", "single-tensor"): 4, ("sgd", "foreach"): 2,
                 ("sgd", "single-tensor"): 2, (None, None): 1}
#: Above this relative deviation from the per-layer formula, a profile's memory carries a warning.
MEMORY_TOLERANCE = 0.02
MEMORY_FORMULA_WARNING = ("saved activations in the layers are {measured:,} B but the per-layer formula gives "
                          "{expected:,} B ({deviation:+.2%}, {kind}): the layers keep what BERT's layer, which the "
                          "formula describes, does not (an activation written as several ops such as GPT-2's "
                          "gelu_new, dropout inside the FFN, another norm or attention path); the estimate is of "
                          "what this model's autograd keeps")


def activation_bytes(spec: ModelSpec, n: int, batch: int = 1, *, p: int = 4, mask: int = 4, dropout: bool = True,
                     fused: bool = False) -> int:
    """Bytes one layer keeps for the backward (see the module docstring), for an ungated FFN of ``4·H``.

    Args:
        spec: the shape (``hidden`` H, ``heads`` a).
        n: tokens s. batch: b.
        p: bytes per activation (4 fp32, 2 fp16/bf16). mask: bytes per dropout-mask element (4 on CPU, 1 on CUDA).
        dropout: dropout active (training with p > 0). fused: a fused attention kernel keeps no ``n×n`` tensor
            (CPU sdpa without dropout; with dropout CPU sdpa falls back to the eager path).
    """
    # s·b·H terms: 16 activations of H (2 LayerNorms, q, k, v, context, projections, 4H FFN in and GELU), and
    # with dropout two masks of H
    linear = n * batch * spec.hidden * (16 * p + 2 * mask if dropout else 16 * p)
    if fused and not dropout:
        return linear + spec.heads * n * batch * 4  # a float32 logsumexp per query and head
    return linear + attention_matrix_bytes(spec, n, batch, 2 * p + mask if dropout else p)


def attention_matrix_bytes(spec: ModelSpec, n: int, batch: int, element: int) -> int:
    """The ``n×n`` part of :func:`activation_bytes`, one layer, at *element* bytes per query-key pair and head:
    ``2p + m`` with dropout (scores, probabilities and the dropout mask), ``p`` without (the probabilities)."""
    return spec.heads * n * n * batch * element


def memory_crossover_n(spec: ModelSpec, *, p: int = 4, mask: int = 4, dropout: bool = True) -> Fraction:
    """The n at which a layer's ``n×n`` activations pass the rest: ``d·(16p + 2m)/(2p + m)``, or ``16·d`` without
    dropout (``d`` the head size; the MAC crossover :func:`~pytest_attncost.formulas.quadratic_n` is ``6·h·d``)."""
    # s·b·H·(16p + 2m) = a·s²·b·(2p + m)  ->  s = (H/a)·(16p + 2m)/(2p + m), H/a = d
    if not dropout:
        return Fraction(16 * spec.hidden, spec.heads)
    return Fraction(spec.hidden * (16 * p + 2 * mask), spec.heads * (2 * p + mask))


def memory_crossovers(spec: ModelSpec) -> dict[str, float] | None:
    """Where a training layer's n×n activations pass the rest (:func:`memory_crossover_n`): fp32 with
    CPU's float dropout masks, fp16 with CUDA's bool masks, and without dropout; None where the per-layer memory
    formula does not describe the layer (gated FFN, experts, an FFN other than 4·hidden)."""
    if spec.gated or spec.experts or spec.ffn_dim != 4 * spec.hidden:
        return None
    return {"fp32": float(memory_crossover_n(spec, p=4, mask=4)),
            "fp16": float(memory_crossover_n(spec, p=2, mask=1)),
            "no_dropout": float(memory_crossover_n(spec, dropout=False))}


def model_state_bytes(parameter_bytes: int, optimizer: str | None = "adamw", kernel: str | None = "foreach",
                      largest: int = 0) -> int:
    """Peak bytes of parameters, gradients and optimizer state in a step (:data:`STATE_FACTORS`).

    Single-tensor AdamW is 4× the parameters plus 2× the *largest* parameter's bytes (its temporaries, one
    parameter at a time); foreach 5× (a temporary of every parameter at once); fused 4×; SGD 2×; no optimizer
    (a forward) 1×.
    """
    key = (optimizer, kernel) if optimizer is not None else (None, None)
    if key not in STATE_FACTORS:
        raise ValueError(f"no model-state formula for optimizer {optimizer!r} with kernel {kernel!r}; "
                         f"known: {sorted(k for k in STATE_FACTORS if k[0])}")
    extra = 2 * largest if key == ("adamw", "single-tensor") else 0
    return STATE_FACTORS[key] * parameter_bytes + extra


@dataclass(frozen=True)
class Memory:
    """The memory estimate of one forward or training step, in bytes (see :mod:`pytest_attncost.memory`).

    Attributes:
        mode: ``forward`` (inference, no grad) or ``train`` (forward, backward, optimizer step).
        peak: live bytes at the peak.
        phase: where the peak falls: ``forward``, ``backward`` or ``optimizer``.
        at_peak: what was live at the peak, by category (:data:`CATEGORIES`); sums to ``peak``.
        saved: saved activations at the end of the forward, by part (attention_core, attention_proj, ffn, other).
        attention_matrices: of those, the ``n×n`` matrices (scores, probabilities, dropout masks).
        saved_in_layers: of those, what the repeated layers keep (what the per-layer formula describes).
        optimizer: the optimizer of the step (None: forward, or a step without one).
        mask_bytes: bytes of the largest ``[b, 1, n, n]`` bool attention mask the model built outside its attention
            modules (0: none); transformers builds one on fake tensors where a real run may skip it.
        assumptions: kernels, dtype, masks, attention path, optimizer kernel.
        formula: the per-layer formula's figures (``activations``, ``attention_matrices``, ``kind``) for the
            profile's spec, n and batch, or None when it does not describe the layers.
        notes: what to know to read the numbers (a fused model keeps no n×n tensor, ...).
        warnings: why a number may be wrong (the layers deviate from the formula past the tolerance).
    """

    mode: str
    peak: int
    phase: str
    at_peak: Mapping[str, int]
    saved: Mapping[str, int]
    attention_matrices: int
    saved_in_layers: int = 0
    optimizer: str | None = None
    mask_bytes: int = 0
    assumptions: Mapping[str, str] = field(default_factory=dict)
    formula: Mapping[str, Any] | None = None
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def activations(self) -> int:
        """Saved activations at the end of the forward, every part."""
        return sum(self.saved.values())

    @property
    def attention_memory_share(self) -> float:
        """attention_matrices / activations; 0.0 with nothing saved (a forward) or no n×n tensor kept."""
        return self.attention_matrices / self.activations if self.activations else 0.0

    @property
    def deviation(self) -> float | None:
        """Relative difference between the layers' saved activations and the formula; None without one."""
        if self.formula is None:
            return None
        return relative_deviation(self.saved_in_layers, int(self.formula["activations"]))

    def __repr__(self) -> str:
        return (f"Memory({self.mode}, peak={self.peak:,} B in {self.phase}, activations={self.activations:,} B, "
                f"attention_memory_share={self.attention_memory_share:.3f})")

    def summary(self) -> str:
        """One line for the report: the peak, where it falls, the saved activations and the n×n share."""
        from .units import format_bytes

        step = f"training step ({self.optimizer or 'no optimizer'})" if self.mode == "train" else "forward"
        line = f"{step}: peak {format_bytes(self.peak)} ({self.peak:,} B) in {self.phase}"
        if self.mode == "train":
            line += (f"; saved activations {format_bytes(self.activations)}, of which n×n matrices "
                     f"{self.attention_memory_share:.1%}")
            if self.deviation is not None:
                line += f" (per-layer formula deviation {self.deviation:.2%})"
        return line

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe builtins only."""
        return {"mode": self.mode, "peak": self.peak, "phase": self.phase, "at_peak": dict(self.at_peak),
                "saved": dict(sorted(self.saved.items())), "activations": self.activations,
                "attention_matrices": self.attention_matrices, "saved_in_layers": self.saved_in_layers,
                "attention_memory_share": self.attention_memory_share, "optimizer": self.optimizer,
                "mask_bytes": self.mask_bytes,
                "assumptions": dict(sorted(self.assumptions.items())),
                "formula": None if self.formula is None else dict(self.formula), "deviation": self.deviation,
                "notes": list(self.notes), "warnings": list(self.warnings)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Memory:
        return cls(mode=data["mode"], peak=int(data["peak"]), phase=data["phase"], at_peak=dict(data["at_peak"]),
                   saved=dict(data["saved"]), attention_matrices=int(data["attention_matrices"]),
                   saved_in_layers=int(data.get("saved_in_layers", 0)), optimizer=data.get("optimizer"),
                   mask_bytes=int(data.get("mask_bytes", 0)),
                   assumptions=dict(data.get("assumptions", {})), formula=data.get("formula"),
                   notes=tuple(data.get("notes", ())), warnings=tuple(data.get("warnings", ())))


# --- bounds on a profile's memory (the marker's peak_memory_*, activation_memory_*, attention_memory_share_*) ---

#: Size bounds (bytes) and share bounds, each ``_max`` and ``_min``.
MEMORY_SIZE_BOUNDS = ("peak_memory_max", "peak_memory_min", "activation_memory_max", "activation_memory_min")
MEMORY_SHARE_BOUNDS = ("attention_memory_share_max", "attention_memory_share_min")
MEMORY_BOUNDS = MEMORY_SIZE_BOUNDS + MEMORY_SHARE_BOUNDS
#: Worded like pytest-memray's ("Test was limited to X but allocated Y"), with the split and the formula.
MEMORY_MESSAGE = "{what} was limited to {limit} but the estimate is {value} {where}"
MEMORY_MIN_MESSAGE = "{what} was to be at least {limit} but the estimate is {value} {where}"
NO_MEMORY = "{bound}: the profile has no memory estimate (profile it with memory=True)"
NOT_TRAINING = ("{bound}: a {mode} keeps nothing for a backward, so its saved activations are 0 and bound nothing; "
                "bound a training step (mode='train'), or bound peak_memory")


def _both(size: int) -> str:
    """A size in binary and decimal units: pytest-memray reads "MB" as 2**20 bytes, this plugin as 10**6."""
    from .units import format_bytes

    return f"{format_bytes(size)} ({size / 10**6:,.1f} MB of 10^6 B = {size / 2**20:,.1f} pytest-memray MB of 2^20 B)"


def memory_problems(limits: Mapping[str, Any], memory: Memory | None, where: str) -> list[str]:
    """Every memory bound in *limits* (name -> bytes or share; None: no bound) that *memory* breaks."""
    asked = {name: value for name, value in limits.items() if value is not None}
    if not asked:
        return []
    if memory is None:
        return [NO_MEMORY.format(bound=name) for name in asked]
    values: dict[str, Any] = {"peak_memory": memory.peak, "activation_memory": memory.activations,
              "attention_memory_share": memory.attention_memory_share}
    problems = []
    for name, limit in asked.items():
        what, _, side = name.rpartition("_")
        value = values[what]
        if what != "peak_memory" and memory.mode != "train":
            mode = "decode step" if memory.mode == "decode" else "forward"
            problems.append(NOT_TRAINING.format(bound=name, mode=mode))
            continue
        if not (value > limit if side == "max" else value < limit):
            continue
        share = what == "attention_memory_share"
        template = MEMORY_MESSAGE if side == "max" else MEMORY_MIN_MESSAGE
        problems.append(template.format(what=what, limit=f"{limit:g}" if share else _both(limit),
                                        value=f"{value:.3f}" if share else _both(value), where=where)
                        + f" ({_split(memory, what)})")
    return problems


def _split(memory: Memory, what: str) -> str:
    """What makes up the number, and the formula's figure beside it."""
    formula = memory.formula
    if what == "peak_memory":
        parts = ", ".join(f"{k} {v:,}" for k, v in memory.at_peak.items() if v)
        state = "" if formula is None or "model_state" not in formula else (
            f"; the formulas give model state {int(formula['model_state']):,} B + saved activations "
            f"{int(formula['activations']):,} B in the layers")
        return f"peak in {memory.phase}: {parts}{state}"
    parts = ", ".join(f"{k} {v:,}" for k, v in memory.saved.items())
    text = f"saved by part: {parts}; attention matrices {memory.attention_matrices:,}"
    if formula is not None:
        text += (f"; the per-layer formula ({formula['kind']}) gives {int(formula['activations']):,} B in the layers, "
                 f"{int(formula['attention_matrices']):,} B of matrices")
    return text + "".join(f"; {note}" for note in memory.notes if "attention_memory_share is 0" in note)
