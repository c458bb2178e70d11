"""The counters, and the one interface over them: :func:`count` and its fallback chain (fvcore, then torch on
meta tensors, or on fake ones from a fresh twin where meta ones do not run the model, then on real ones at small n;
docs/architecture.md, docs/second-opinion.md ``fallback=True``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import CountError
from ..errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from ..families import prepare_twin
from ..inputs import Built, to_real
from ..ops import RawCount, is_fused, is_product
from ..request import Request
from . import flex
from .dispatch import STAGES, Refused, at_lengths, at_stage, count_forward_torch, module_totals
from .graphs import model_class, run_in_scopes, shell_containers, unscoped
from .jit import count_forward
from .masks import buffer_masks
from .repeats import full_trace
from .twin import HOOKS_NOTE, kept_torch_state, meta_twin, real_twin, unwrap, user_hooks

T = TypeVar("T")

__all__ = ["HOOKS_NOTE", "Counted", "at_lengths", "buffer_masks", "count", "count_forward",
           "count_forward_torch", "fresh_count", "full_trace", "kept_torch_state", "meta_twin", "model_class",
           "module_totals", "real_twin", "shell_containers", "unscoped", "unwrap", "user_hooks"]


@dataclass(frozen=True)
class Counted:
    """A count and how it was made.

    Attributes:
        raw: the records and totals.
        backend: the counter that made it.
        fallback: why the torch backend stood in for fvcore (None when it did not).
        unchecked: a warning: custom autograd Functions fvcore saw as opaque could not be looked into.
        real: counted on real tensors (the last resort): it holds for these inputs' values only.
        notes: how FlexAttention was counted (:mod:`.flex`), where it ran.
        unread: (module, warning) where a FlexAttention mask could not be evaluated: the split's cores there
            have a mask of unknown form (the warning is for those it counts in full).
    """

    raw: RawCount
    backend: str
    fallback: str | None = None
    unchecked: str | None = None
    real: bool = False
    notes: tuple[str, ...] = ()
    unread: tuple[tuple[str, str], ...] = ()


#: Lengths up to which the fallback may run real tensors (weights and activations in memory).
REAL_TENSOR_MAX_N = 4096

OPAQUE = ("fvcore sees {ops} (custom torch.autograd.Function) as one opaque op each: the products inside them "
          "({hidden:,} MAC by the torch backend's count) are invisible to it")
OPAQUE_FIX = "\nFix: count with backend='torch' (its counter sees inside at the dispatcher), or leave fallback on"
OPAQUE_UNCHECKED = ("{ops}: custom torch.autograd.Function(s) fvcore sees as one opaque op each, and the torch backend "
                    "could not look inside ({why}); products inside them, if any, are not counted")


def fresh_count(target: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                masks: Mapping[str, Any] | None) -> RawCount:
    """A second opinion on *target*: the torch backend on a twin of its own (raises CountError)."""
    return staged(target, _prepared(target), lambda twin: count_forward_torch(twin, args, kwargs, buffer_masks=masks))


def staged(target: nn.Module, twin: nn.Module, run: Callable[[nn.Module], T]) -> T:
    """``run(twin)`` at the first of the torch backend's :data:`~.dispatch.STAGES`; where a stage refuses the model,
    ``run`` of a fresh twin of *target* at the next. Where the last stage cannot run it either, the error is the
    refusal that led there (fake tensors as if compiling: what they could not run).

    Raises:
        CountError: no stage ran the model.
    """
    refused: Refused | None = None
    stage = STAGES[0]
    while True:
        try:
            with at_stage(stage):
                return run(twin)
        except Refused as exc:
            refused, stage, twin = exc, exc.next, _prepared(target)
        except CountError:
            if stage != STAGES[-1] or refused is None:
                raise
            raise CountError(str(refused)) from refused.__cause__


def _prepared(target: nn.Module) -> nn.Module:
    twin = meta_twin(target)
    prepare_twin(twin)
    return twin


def count(target: nn.Module, twin: nn.Module, built: Built, masks: Mapping[str, Any] | None,
          request: Request) -> Counted:
    """Count *twin* (of *target*) on *built* inputs (fresh ones each time: a decode step appends to its cache),
    with the request's backend, falling back as :mod:`.counting` says.

    The last resort runs on the user's own inputs with their values (``built.real_call``), so data-dependent
    branches take the path they take. FlexAttention runs as its stand-ins meanwhile (:mod:`.flex`).

    Raises:
        CountError: no counter could count the model; the message says why and what to do.
    """
    def run(twin: nn.Module) -> tuple[Counted, Any]:
        with flex.standing_in(twin, request.causal, built.real_call) as session:
            return _count(target, twin, built, masks, request), session

    counted, session = staged(target, twin, run)
    if session is None or not session.calls:
        return counted
    return dataclasses.replace(counted, notes=(flex.FLEX_NOTES[session.causal],), unread=flex.unread(session))


def _count(target: nn.Module, twin: nn.Module, built: Built, masks: Mapping[str, Any] | None,
           request: Request) -> Counted:
    train = request.mode == "train"
    backend = "torch" if train else request.backend  # a backward needs the dispatcher's counter
    try:
        raw = (count_forward(twin, *built.call(), buffer_masks=masks) if backend == "fvcore"
               else count_forward_torch(twin, *built.call(), train=train, buffer_masks=masks))
    except CountError as exc:
        if backend != "fvcore" or not request.fallback:
            raise
        raw, real = _fallback(target, built, exc, masks, request.n)
        return Counted(raw, "torch", fallback=str(exc).splitlines()[0], real=real)
    if backend == "fvcore" and raw.opaque:
        return _look_inside(target, raw, built, masks, request.fallback)
    return Counted(raw, backend)


def _fallback(target: nn.Module, built: Built, first: CountError, masks: Mapping[str, Any] | None,
              n: int | None) -> tuple[RawCount, bool]:
    """fvcore could not trace: count with FlopCounterMode on fake tensors, else on real ones at small n: the user's
    own inputs as given (data-dependent branches take their path), or default inputs filled with zeros."""
    args, kwargs = built.call()
    try:
        return fresh_count(target, args, kwargs, masks), False
    except CountError as fake_error:
        on_meta = any(t.is_meta for t in [*target.parameters(), *target.buffers()])
        lengths = [d for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) for d in t.shape[1:2]]
        too_long = (n or max(lengths, default=0)) > REAL_TENSOR_MAX_N
        real_args = built.real_call()
        user_meta = real_args is not None and any(
            isinstance(t, torch.Tensor) and t.is_meta for t in pytree.tree_leaves(real_args))
        if on_meta or too_long or user_meta:
            why = ("the model lives on the meta device" if on_meta else f"n > {REAL_TENSOR_MAX_N}" if too_long
                   else "the inputs are meta tensors")
            fix = ("" if too_long or user_meta else
                   f"\nFix: pass the model built on the CPU (not a factory, not on meta): the torch backend then runs "
                   f"it on real tensors (n <= {REAL_TENSOR_MAX_N}), and the values it reads choose its branches.")
            raise CountError(f"{first}\nThe torch backend could not count it either ({fake_error}); real tensors "
                             f"were not tried: {why}.{fix}") from first.__cause__ or first  # the user's error, if any
        real_args = real_args if real_args is not None else (to_real(args), to_real(kwargs))
        twin = real_twin(target)
        run_in_scopes(twin)
        prepare_twin(twin)
        try:
            return count_forward_torch(twin, real_args[0], real_args[1], fake=False, buffer_masks=masks), True
        except CountError as real_error:
            raise CountError(f"{first}\nThe fallback failed too: {real_error}") from first.__cause__ or first


def _look_inside(target: nn.Module, raw: RawCount, built: Built, masks: Mapping[str, Any] | None,
                 fallback: bool) -> Counted:
    """fvcore saw custom autograd Functions as opaque ops: the torch backend tells whether they hide products
    (docs/second-opinion.md); a warning where it could not look inside."""
    def products(count: RawCount) -> int:
        return sum(r.macs for r in count.records if is_product(r.op) or is_fused(r.op))

    ops = ", ".join(raw.opaque)
    try:
        seen = fresh_count(target, *built.call(), masks)
    except CountError as exc:
        return Counted(raw, "fvcore", unchecked=OPAQUE_UNCHECKED.format(ops=ops, why=str(exc).splitlines()[0]))
    hidden = products(seen) - products(raw)
    if hidden <= 0:
        return Counted(raw, "fvcore")
    reason = OPAQUE.format(ops=ops, hidden=hidden)
    if not fallback:
        raise CountError(f"{reason}{OPAQUE_FIX}")
    return Counted(seen, "torch", fallback=reason)
