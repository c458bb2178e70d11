"""The public entry points: ``profile()``, ``sweep()``, ``decode_sweep()``, ``measure()``, ``measure_sweep()``.

Each checks its arguments, then calls below: the pipeline counts (:mod:`~pytest_attncost.pipeline`), the
timing engine times (:mod:`~pytest_attncost.timing`). Usable outside pytest (a notebook, a script); the
``attncost`` fixture is a thin wrapper that adds the marker's defaults and records the result for the report.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from . import families, one_run, pipeline, timing
from . import memory as memory_mod
from .cache import cache_key, clear_cache, lookup, store  # api.cache_key and api.clear_cache stay importable
from .counting import HOOKS_NOTE, kept_torch_state, masks, model_class, unwrap, user_hooks
from .errors import ProfileError, TimingError
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .formulas import ModelSpec
from .inputs import Built, build, one_sequence_per_row
from .request import DEFAULT_REPEATS, DEFAULT_WARMUP, Inputs, Request, positive
from .result import Profile, Timing
from .series import DecodeSweep, Sweep, TimingSweep

__all__ = ["ProfileError", "clear_cache", "decode_sweep", "measure", "measure_memory", "measure_sweep", "profile",
           "spec_of", "sweep"]

#: measure_memory() runs the real step only below this estimated peak (the estimate comes first).
REAL_STEP_LIMIT = 2 * 10**9
TOO_BIG_TO_RUN = ("measure_memory() runs the real step only when its estimated peak is under {limit:,} B; this one "
                  "is estimated at {peak:,} B: measure at a smaller n or batch (the estimate holds at any size)")
NO_CUDA = "measure_memory(device={device!r}): no CUDA device here (torch.cuda.is_available() is False)"
_OLD_TORCH = one_run.TORCH_VERSION < (2, 9)


def _exported(model: object) -> object:
    """An ExportedProgram as the module it runs (``exported.module()``: its nodes keep the module paths, which
    the count reads); anything else as it is."""
    kind = type(model)
    if kind.__module__.startswith("torch.export") and kind.__name__ == "ExportedProgram":
        return model.module()  # type: ignore[attr-defined]
    return model


def _resolve_model(model: object) -> nn.Module:
    """The module to count: the model itself, or what a zero-argument factory builds on the meta device."""
    model = _exported(model)
    if isinstance(model, nn.Module):
        return unwrap(model)
    if callable(model):
        if _OLD_TORCH:  # its _dynamo runs tensor ops as it is imported: not first inside the meta device
            importlib.import_module("torch._dynamo")  # (transformers' models import it: a factory's would)
        try:
            with torch.device("meta"), masks.recording() as patterns:  # a tril buffer's form, read as it is built
                built = model()
        except Exception as exc:  # noqa: BLE001 - the factory is the user's code
            raise ProfileError(f"the model factory {getattr(model, '__name__', model)!r} failed on the meta device "
                               f"({type(exc).__name__}: {exc}); if it builds on the CPU, pass the built nn.Module "
                               "instead; otherwise the error is the factory's own (its config or its code)") from exc
        if not isinstance(built, nn.Module):
            raise ProfileError(f"the model factory returned {type(built).__name__}, not an nn.Module; "
                               "a factory takes no arguments and returns the model")
        masks.remember(unwrap(built), patterns)
        return unwrap(built)
    raise ProfileError("profile() takes an nn.Module or a zero-argument factory returning one, "
                       f"got {type(model).__name__}")


def spec_of(model: nn.Module) -> ModelSpec | None:
    """The cost-model shape of a transformers model or a torch Transformer module, if known.

    The config's view: a profile corrects it by the structure it counted (a gated FFN the weights
    show, no formula for a hybrid stack); ``Profile.spec`` is the spec a profile compared with.
    """
    return families.spec_of(model)[0]


default_inputs = families.default_inputs  # api.default_inputs stays importable


def profile(
    model: nn.Module | Callable[[], nn.Module],
    n: int | None = None,
    *,
    batch: int | None = None,
    inputs: Inputs | None = None,
    roles: Mapping[str, Any] | None = None,
    spec: ModelSpec | None = None,
    name: str | None = None,
    backend: str | None = None,
    mode: str = "forward",
    causal: str = "full",
    fallback: bool = True,
    new_tokens: int | None = None,
    m: int | None = None,
    memory: bool = False,
    optimizer: Any = "adamw",
) -> Profile:
    """Count one forward pass of *model* and split it into attention_core, attention_proj, ffn, other.

    The count comes from fvcore, traced on a meta-device twin: no weights or
    activations are allocated, no arithmetic is done, and *model* is left exactly
    as it was (parameters, device, dtype, ``training`` flags, hooks).

    Args:
        model: an ``nn.Module`` (an exported or fx graph too), or a zero-argument factory (built on the meta device).
        n: sequence length. Needed unless *inputs* are given, in which case it is
            the length the attention saw (ViT: patches + 1) and must agree if given.
        batch: batch size for default inputs (1).
        inputs: a tuple of positional args, a dict of keyword args, a tensor, or a
            callable ``(n, batch) -> tuple | dict``. Default: token ids ``(batch, n)``
            for transformers text models, ``(batch, n, d_model)`` floats for torch's
            Transformer modules (``batch_first`` respected).
        roles: ``{"attention": [globs], "ffn": [globs]}`` naming the modules by
            fnmatch globs over their dotted names, for models the automatic
            detection does not know.
        spec: the shape for the formulas; read from the model when omitted.
        name: the profile's name (default: the model's class name).
        backend: ``"fvcore"`` (default: jit trace) or ``"torch"`` (FlopCounterMode at the
            dispatcher, on fake tensors).
        mode: ``"forward"``, ``"train"``: forward plus a real backward (torch backend; recompute apart), or
            ``"decode"``: one step of ``new_tokens`` query tokens against a KV cache holding ``n``
            tokens (a transformers decoder's own cache on the meta device; custom models take
            ``inputs=`` that build their cache for n). The profile's ``n`` is the cache's length.
        causal: ``"full"``: the n x n product a dense kernel executes; ``"half"``: the n(n+1)/2 pairs of causal
            self-attention (never cross-attention or bidirectional); ``"kept"``: the pairs each layer's mask
            keeps, fewer where a sliding window or chunks confine it (Mistral, Gemma-2, Qwen2, Llama-4).
        fallback: when fvcore cannot trace the model, count with the torch backend (on fake
            tensors, else on real ones at small n) and say so in ``Profile.fallback``.
        new_tokens: decode mode: the query tokens of the step (default 1).
        m: the second sequence's length (:attr:`Profile.m`: an encoder-decoder's target, a decoder's memory),
            for default inputs (default n); your own inputs must agree with it.
        memory: also estimate the peak memory of the step on fake tensors (:attr:`Profile.memory`, see
            :mod:`pytest_attncost.memory`): an inference forward (``mode="forward"``) or one steady-state training
            step (``mode="train"``: forward, backward of the sum of the outputs, the optimizer's step).
        optimizer: the training step's optimizer: ``"adamw"`` (foreach, as torch runs it on CUDA), ``"sgd"``, a
            callable ``params -> torch.optim.Optimizer``, or None (no step).

    Returns:
        The count, split into attention_core, attention_proj, ffn and other.

    Raises:
        ProfileError: bad arguments, or a model that cannot be counted (the message
            says why and what to do).
    """
    # long: the docstring documents every argument; the body is two lines
    request = Request.of(n, batch=batch, inputs=inputs, roles=roles, spec=spec, name=name, backend=backend, mode=mode,
                         causal=causal, fallback=fallback, new_tokens=new_tokens, m=m)
    return _answered(*_opened(model, request), memory, optimizer)


def _opened(model: object, request: Request) -> tuple[nn.Module, Request]:
    """The module to count, and *request* with what it says (its name, its spec: :func:`pipeline.for_model`)."""
    target = _resolve_model(model)
    return target, pipeline.for_model(target, request)


def _answered(target: nn.Module, request: Request, memory: bool, optimizer: Any) -> Profile:
    """profile()'s answer to a checked *request* for *target*, with its memory estimate if asked for: cached beside
    the count where the count is, for an optimizer named by a string or None (a callable's cannot be described)."""
    counted, built, key = _counted(target, request)
    if not memory:
        return counted
    stepped = optimizer if counted.mode == "train" else None
    named = stepped is None or isinstance(stepped, str)
    known = key is not None and named and pipeline.REAL_NOTE not in counted.notes
    if (estimated := lookup(memory_key := (key, "memory", stepped) if known else None)) is not None:
        assert estimated.memory is not None
        return dataclasses.replace(counted, memory=estimated.memory,
                                   warnings=(*counted.warnings, *estimated.memory.warnings))
    answer = with_memory(counted, target, built or build(target, request), optimizer)
    store(memory_key, answer)
    return answer


def with_memory(counted: Profile, target: nn.Module, built: Built, optimizer: Any) -> Profile:
    """*counted* with its memory estimate, made now."""
    if optimizer is not None and not isinstance(optimizer, str) and not callable(optimizer):
        raise ProfileError(f"optimizer= must be 'adamw', 'sgd', None or a callable params -> optimizer, "
                           f"got {optimizer!r}")
    stepped = optimizer if counted.mode == "train" else None
    with one_sequence_per_row(target, built.given):
        found = memory_mod.of_profile(target, built.call(), counted, optimizer=stepped, foreach=True)
    return dataclasses.replace(counted, memory=found, warnings=(*counted.warnings, *found.warnings))


def _counted(target: nn.Module, request: Request) -> tuple[Profile, Built | None, Hashable | None]:
    """The profile *request* asks of *target*, the inputs it was counted on (None: it came from the cache), and its
    key in the cache (None: uncacheable, or the cache is off)."""
    # None: not counted yet, uncacheable (key None), or the cache is off
    if (cached := lookup(key := cache_key(target, request))) is not None:
        return _hooks_named(cached, target), None, key
    with kept_torch_state():  # a forward that sets the default dtype or the threads leaves them as they were
        built = build(target, request)
        with one_sequence_per_row(target, built.given):
            result = pipeline.run(target, request, built)
    if pipeline.REAL_NOTE not in result.notes:  # a count on real values holds for those values only
        store(key, result)
    return _hooks_named(result, target), built, key


def _hooks_named(result: Profile, target: nn.Module, hooks: list[str] | None = None) -> Profile:
    """*result* with a note naming the user's hooks that the count dropped (the model's hooks now: the cache's
    key leaves hooks out, as the count does); *hooks*: :func:`user_hooks` of *target*, found already."""
    if not (hooks := user_hooks(target) if hooks is None else hooks):
        return result
    shown = ", ".join(hooks[:5]) + (f" and {len(hooks) - 5} more" if len(hooks) > 5 else "")
    return dataclasses.replace(result, notes=(*result.notes, HOOKS_NOTE.format(hooks=shown)))


def sweep(model: nn.Module | Callable[[], nn.Module], ns: Any, **profile_kwargs: Any) -> Sweep:
    """Profile *model* at every length in *ns*; the :class:`Sweep` solves the thresholds exactly.

    A factory is built once (on the meta device) and counted at each length; with the torch backend every
    length is counted in one run where that can be (see ``Sweep.one_run``).

    Raises:
        ProfileError: bad lengths, or any error :func:`profile` raises.
    """
    if isinstance(ns, (str, bytes)) or not hasattr(ns, "__iter__"):
        raise ProfileError(f"ns must be a list of lengths such as [512, 1024, 4096], got {ns!r}")
    lengths = [positive("every n", n) for n in ns]
    if len(set(lengths)) != len(lengths) or not lengths:
        raise ProfileError(f"ns must hold distinct lengths, got {list(ns)!r}")
    if "n" in profile_kwargs:
        raise ProfileError("sweep() takes the lengths as ns=[...], not n=")
    memory, optimizer = profile_kwargs.pop("memory", False), profile_kwargs.pop("optimizer", "adamw")
    target, request = _opened(model, Request.of(lengths=lengths, **profile_kwargs))
    if not memory:
        # the user's inputs= are made per length inside: their positions are not known here, so left to transformers
        with kept_torch_state(), (one_sequence_per_row(target, None) if request.inputs is None else nullcontext()):
            swept = pipeline.sweep_in_one_run(target, request)
        if swept is not None:
            hooks = user_hooks(target)  # once: a walk over every module
            return Sweep([_hooks_named(p, target, hooks) for p in swept], one_run=True)
    return Sweep([_answered(target, request.at(n), memory, optimizer) for n in lengths])


def decode_sweep(model: Any, ns: Any, new_tokens: int = 1, **profile_kwargs: Any) -> DecodeSweep:
    """Profile a decode step of *model* at every cache length in *ns* (two or more, distinct).

    Raises:
        ProfileError: bad lengths, or anything :func:`pytest_attncost.profile` raises.
    """
    lengths = list(ns) if not isinstance(ns, (str, bytes)) and hasattr(ns, "__iter__") else None
    if not lengths or len(lengths) < 2 or len(set(lengths)) != len(lengths):
        raise ProfileError(f"ns must hold two or more distinct cache lengths such as [1024, 4096], got {ns!r}")
    target = _resolve_model(model)
    profile_kwargs.setdefault("name", model_class(target))
    profiles = [profile(target, n, mode="decode", new_tokens=new_tokens, **profile_kwargs) for n in sorted(lengths)]
    return DecodeSweep(tuple(profiles))


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

    The model runs for real (see :mod:`pytest_attncost.timing`): a copy of an ``nn.Module`` with its
    weights, or a factory's model built on *device* with random weights (seeded), in eval
    mode under ``no_grad``; the user's model and RNG are left as they were.

    Args:
        model: an ``nn.Module`` (its weights are used), or a zero-argument factory.
        n: and *batch*, *inputs*, *roles*, *spec*, *name*, *backend*: as for :func:`profile`, which counts
            the MACs (once, or not at all when an identical profile is cached) on the inputs then timed.
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:1"``, a ``torch.device``). On a GPU the parts
            are kernel (device) times and the forward is timed with CUDA events.
        dtype: cast the copy's floating parameters and float inputs (``torch.bfloat16``);
            None keeps the model's.
        warmup: untimed forwards first.
        repeats: timed forwards (each plain and each traced); bounds need ``markers.MIN_REPEATS``.
        seed: the seed for a factory's weights and for random float inputs.
        threads: CPU threads for the ops while timing (``torch.set_num_threads``, restored
            afterwards); None keeps the process's setting. On a busy machine, 1 is the least noisy.

    Returns:
        The measured seconds of each part, beside the counted MACs.

    Raises:
        TimingError: bad arguments, or a model that cannot run (the message says why).
        ProfileError: anything :func:`profile` raises.
    """
    runs = timing.Runs(device, dtype, warmup, repeats, seed, threads)
    request = Request.of(n, batch=batch, inputs=inputs, roles=roles, spec=spec, name=name, backend=backend)
    model = _exported(model)  # after the arguments' checks: exported.module() builds a module
    target, request = _opened(model, request)
    counted, built, _ = _counted(target, request)
    built = built or build(target, request)  # cached: inputs built here
    with one_sequence_per_row(target, built.given):
        return timing.time_forward(counted, model, built, runs)


def measure_memory(model: Any, n: int | None = None, *, batch: int | None = None, inputs: Any = None,
                   mode: str = "forward", optimizer: Any = "adamw", device: Any = "cpu", seed: int = 0,
                   **profile_kwargs: Any) -> memory_mod.Measured:
    """Run *model*'s step for real and set its measured peak beside the fake-tensor estimate of the same step.

    The step is :func:`profile`'s with ``memory=True`` (``mode="forward"``: an inference forward;
    ``mode="train"``: forward, backward, the optimizer's step from a steady state), run on a copy of the model (a
    factory's model built on the CPU with seeded random weights). On the CPU the peak is read from torch's profiler
    memory records (every allocation and free of the step) plus what was live at its start; on CUDA from
    ``torch.cuda.max_memory_allocated`` (which the CPU kernels the estimate assumes need not match).

    Raises:
        ProfileError: bad arguments, a step estimated at more than :data:`REAL_STEP_LIMIT` bytes, no CUDA device
            for ``device="cuda"``, or anything :func:`profile` raises.
    """
    where = torch.device(device)
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError(NO_CUDA.format(device=str(device)))
    target, request = _opened(model, Request.of(n, batch=batch, inputs=inputs, mode=mode, **profile_kwargs))
    counted, built, _ = _counted(target, request)
    built = built or build(target, request)
    estimated = with_memory(counted, target, built, optimizer).memory
    assert estimated is not None
    if estimated.peak > REAL_STEP_LIMIT:
        raise ProfileError(TOO_BIG_TO_RUN.format(limit=REAL_STEP_LIMIT, peak=estimated.peak))
    if isinstance(model, nn.Module):
        real = model
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            real = model()
    with one_sequence_per_row(target, built.given):
        return memory_mod.measure_memory(real, estimated, built, memory_mod.Step(mode, optimizer), where)


def measure_sweep(model: Any, ns: Sequence[int], **measure_kwargs: Any) -> TimingSweep:
    """:func:`measure` at every length in *ns* (one factory, built for each length)."""
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
    spec = measure_kwargs.get("spec") or (first.spec if first is not None else spec_of(_resolve_model(model)))
    return TimingSweep(timings, spec)
