"""The timing engine behind ``measure()``: time real forward passes and split the time with the role map
``profile()`` split the MACs with (the counts stay the source of truth: time is never stored in a baseline).

How a forward pass is timed, and where each op's time goes: docs/time.md ("How a forward pass is timed").
"""

from __future__ import annotations

import contextlib
import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .counting import kept_torch_state, real_twin, unwrap
from .errors import TimingError
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .inputs import Built
from .ops import FUSED_ATTENTION_OPS, MATMUL_LIKE_UNSUPPORTED, PRODUCTS, attention_macs
from .request import COMPONENTS, DEFAULT_REPEATS, DEFAULT_WARMUP, PARTS
from .result import TOTALS, Profile, Timing, median
from .roles import product_part, role_of
from .units import format_seconds

__all__ = ["DEFAULT_REPEATS", "DEFAULT_WARMUP", "Runs", "device_of", "time_forward"]

MODULE_RANGE = "attncost.module:"
REPEAT_RANGE = "attncost.repeat:"

TIMED_MACS_NOTE = ("the timed run multiplied {timed:,} MAC in {part} but the count says {counted:,}: the model ran "
                   "another path than the one counted, or a product was placed differently; compare by_module")
TRACE_OVERHEAD_NOTE = ("the traced forward took {traced}, the plain one {forward}: the profiler's per-op cost (many "
                       "small ops) or a busy machine; the parts are shares of the traced forward")
UNREAD_MACS_NOTE = "the MACs of {count} timed product op(s) could not be read from their shapes ({ops})"


#: Ops timed as an attention core wherever they run: fused attention, and torch's fused MHA kernel.
_FUSED = FUSED_ATTENTION_OPS | {op for op in MATMUL_LIKE_UNSUPPORTED if "attention" in op}


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value) if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value) else None


def _operand_shapes(op: str, shapes: Sequence[Any]) -> list[tuple[int, ...]]:
    positions = PRODUCTS[op].operands if op in PRODUCTS else ()
    if positions:
        picked = [_shape(shapes[i]) for i in positions if i < len(shapes)]
    else:  # einsum and friends: every tensor operand (lists of shapes flattened)
        picked = [_shape(v) for value in shapes
                  for v in (value if _shape(value) is None and isinstance(value, (list, tuple)) else [value])]
    return [s for s in picked if s]


def _op_macs(op: str, shapes: Sequence[Any]) -> int | None:
    """MACs of one timed product from its recorded operand shapes (the op table's), None where they cannot tell."""
    try:
        if op in _FUSED:
            q, k, v = (_shape(s) for s in shapes[:3])
            return attention_macs(q, k, v) if q and k and v else None
        product, operands = PRODUCTS[op], _operand_shapes(op, shapes)
        return product.macs(operands[0], operands[1], ()) if product.macs is not None and len(operands) == 2 else None
    except (TypeError, IndexError, ValueError, KeyError):
        return None


@dataclass
class _Placement:
    """The role map and what the split needs about each module, for placing timed ops."""

    roles: Mapping[str, str]
    explicit: bool  # the user's roles= (no structure): fused attention is a core anywhere
    param_shapes: Mapping[str, frozenset[tuple[int, ...]]]  # module -> shapes of its subtree's parameters
    buffer_shapes: Mapping[str, frozenset[tuple[int, ...]]]

    def origin(self, op: str, scope: str, shapes: Sequence[Any]) -> str:
        if PRODUCTS[op].weight:
            return "param"
        operands = [s for s in _operand_shapes(op, shapes) if len(s) >= 2]
        for origin, held in (("param", self.param_shapes), ("buffer", self.buffer_shapes)):
            if any(s in held.get(scope, ()) for s in operands):
                return origin
        return "activation"

    def part(self, op: str, scope: str, shapes: Sequence[Any]) -> str:
        """The part one timed op belongs to (the table of docs/time.md, "How a forward pass is timed")."""
        role = role_of(scope, self.roles)
        fused = op in _FUSED
        if fused or op in PRODUCTS:
            origin = "activation" if fused else self.origin(op, scope, shapes)
            part = product_part(role, fused, origin, self.explicit)
            return "other" if part == "unplaced" else part  # the split counts those as other too
        if role == "attention":
            return "attention_core"
        return "ffn" if role == "ffn" else "other"


def _shape_sets(model: Any) -> tuple[dict[str, frozenset[tuple[int, ...]]], dict[str, frozenset[tuple[int, ...]]]]:
    def shapes(tensors: Iterator[Any]) -> frozenset[tuple[int, ...]]:
        found = {tuple(t.shape) for t in tensors if t.dim() >= 2}
        return frozenset(found | {s[::-1] for s in found if len(s) == 2})

    modules = list(model.named_modules())
    return {name: shapes(m.parameters()) for name, m in modules}, {name: shapes(m.buffers()) for name, m in modules}


def device_of(device: Any) -> Any:
    """The torch device *device* names, checked: 'cpu' or an available 'cuda' device."""
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


@dataclass(frozen=True)
class Runs:
    """How measure() runs the forwards (its arguments, checked as they are made; the device resolved)."""

    device: Any = "cpu"
    dtype: Any = None
    warmup: int = DEFAULT_WARMUP
    repeats: int = DEFAULT_REPEATS
    seed: int = 0
    threads: int | None = None

    def __post_init__(self) -> None:
        for label, value, least in (("warmup", self.warmup, 0), ("repeats", self.repeats, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise TimingError(f"{label} must be an int >= {least}, got {value!r}")
        threads = self.threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise TimingError(f"threads must be a positive int, got {threads!r}")
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise TimingError(f"dtype= must be a torch.dtype such as torch.bfloat16, got {self.dtype!r}")
        object.__setattr__(self, "device", device_of(self.device))


def _runner(model: Any, device: Any, dtype: Any, seed: int) -> Any:
    """The module that is run: a copy of the user's (their weights), or a factory's, on *device*."""
    if isinstance(model, nn.Module):
        model = unwrap(model)
        if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            raise TimingError(f"{type(model).__name__} lives on the meta device: it has no weights to run; "
                              "pass a model with weights, or a zero-argument factory (random weights)")
        try:
            runner = real_twin(model)
        except Exception as exc:  # noqa: BLE001 - the model's own copy failed
            raise TimingError(f"cannot copy {type(model).__name__} to time it ({type(exc).__name__}: {exc}); "
                              "pass a zero-argument factory instead") from exc
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
        runner = unwrap(runner)
    else:
        raise TimingError(f"measure() takes an nn.Module or a zero-argument factory, got {type(model).__name__}")
    return runner.to(device, dtype).eval()


def _real_inputs(value: Any, device: Any, dtype: Any, generator: Any) -> Any:
    """Inputs on *device*: meta tensors (default inputs) become values (random floats, zero ids,
    true masks); real ones are moved (floats cast to *dtype* when given)."""
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
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # the fused encoder-layer kernel hides the whole block
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with kept_torch_state(), torch.no_grad(), \
                torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        torch.set_num_threads(before)


class _Ranges:
    """A ``record_function`` range per module call, from forward pre/post hooks on the runner."""

    def __init__(self, model: Any) -> None:
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


def _seconds(run: Callable[[], Any], cuda: bool) -> float:
    """One forward's time: perf_counter on the CPU, CUDA events (device time) on a GPU."""
    if not cuda:
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
    """The repeat ranges, each with its nested events, from the profiler's raw (kineto) events: ten times faster
    than ``prof.events()``. Kernels go to the op that launched them by correlation id, as torch's profiler does."""
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
        # not device runtime calls (cudaLaunchKernel), other threads, async events or the profiler's own
        if linked == 0 and event.start_thread_id() == thread == event.end_thread_id() and not event.is_async() \
                and not event.name().startswith(("profiler::", "[memory]")):
            frontend.append(event)
    nodes = sorted((_Node(e.name(), e.start_ns(), e.end_ns(), list(e.shapes()), kernels.get(e.correlation_id(), 0))
                    for e in frontend), key=lambda node: (node.start_ns, -node.end_ns))
    roots: list[_Node] = []
    stack: list[_Node] = []
    for node in nodes:
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
            if child.name in PRODUCTS or child.name in _FUSED:
                counted = _op_macs(child.name, child.shapes)
                if counted is None:
                    unread[child.name] = unread.get(child.name, 0) + 1
                else:
                    macs[part] += counted

    visit(repeat, "")
    return parts, modules, macs, unread


def _describe(device: Any) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    threads = torch.get_num_threads()
    return f"{platform.machine() or 'unknown'} CPU, {threads} thread{'' if threads == 1 else 's'}"


def time_forward(counted: Profile, model: Any, built: Built, runs: Runs) -> Timing:
    """Time *model*'s forward on *built*'s inputs (given values, or default inputs filled with random floats),
    and place the time with *counted*'s role map; the MACs are *counted*'s.

    Raises:
        TimingError: a model that cannot run on *device* (the message says why).
    """
    device, dtype, repeats = runs.device, runs.dtype, runs.repeats
    runner = _runner(model, device, dtype, runs.seed)
    generator = torch.Generator().manual_seed(runs.seed)
    # the inputs profile() counted, now with values (for a vision model n stays None: the image decides)
    args, kwargs = _real_inputs(built.given or (built.args, built.kwargs), device, dtype, generator)
    try:
        plain, traced, events, device_name = _timed_runs(runner, lambda: runner(*args, **kwargs), runs)
    except TimingError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model's reason is the user's best clue
        raise TimingError(f"{counted.name} could not run on {device} ({type(exc).__name__}: {exc})") from exc
    if len(events) != repeats:
        raise TimingError(f"{counted.name}: the profiler recorded {len(events)} of {repeats} repeats")
    placement = _Placement(counted.roles, counted.roles_given, *_shape_sets(runner))
    samples: dict[str, list[float]] = {key: [] for key in (*PARTS, *TOTALS)}
    by_module: dict[str, list[float]] = {}
    timed_macs, unread = dict.fromkeys(PARTS, 0), {}
    for i, event in enumerate(events):
        parts, modules, macs, missing = _split_repeat(event, placement, device.type == "cuda")
        for key, value in (*parts.items(), ("attributed", sum(parts.values())), ("traced", traced[i]),
                           ("unattributed", traced[i] - sum(parts.values())), ("forward", plain[i])):
            samples[key].append(value)
        for module, seconds in modules.items():
            by_module.setdefault(module, []).append(seconds)
        if i == 0:
            timed_macs, unread = macs, missing
    mac_parts = {part: getattr(counted, part) for part in PARTS}
    return Timing(
        name=counted.name, n=counted.n, batch=counted.batch, device=str(device), device_name=device_name,
        dtype=str(next((p.dtype for p in runner.parameters()), torch.get_default_dtype())).replace("torch.", ""),
        clock="device" if device.type == "cuda" else "wall", warmup=runs.warmup, repeats=repeats,
        samples={key: tuple(values) for key, values in samples.items()}, macs=mac_parts, roles=dict(counted.roles),
        by_module={module: median(values) for module, values in by_module.items()}, timed_macs=timed_macs,
        notes=tuple(_notes(mac_parts, timed_macs, unread, plain, traced)), profile=counted,
    )


def _timed_runs(runner: nn.Module, run: Callable[[], Any], runs: Runs
                ) -> tuple[list[float], list[float], list[_Node], str]:
    """Warm-up, the plain forwards timed whole, then the traced ones under the profiler: (plain seconds,
    traced seconds, the repeats' event trees, the device's description with the threads in force)."""
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    cuda = runs.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    traced: list[float] = []
    with _timing_environment(runs.device, runs.threads):
        for _ in range(runs.warmup):
            _seconds(run, cuda)
        plain = [_seconds(run, cuda) for _ in range(runs.repeats)]
        ranges = _Ranges(runner)
        try:
            with torch_profile(activities=activities, record_shapes=True) as prof:
                run()  # the profiler's own first-call costs stay out of the repeats
                for i in range(runs.repeats):
                    with record_function(f"{REPEAT_RANGE}{i}"):
                        traced.append(_seconds(run, cuda))
        finally:
            ranges.remove()
        device_name = _describe(runs.device)  # the thread count in force while timing
    return plain, traced, _event_tree(prof), device_name


def _notes(mac_parts: Mapping[str, int], timed_macs: Mapping[str, int], unread: Mapping[str, int],
           plain: list[float], traced: list[float]) -> list[str]:
    """What makes the figures doubtful: a path other than the counted one, products not read, tracing overhead."""
    notes: list[str] = []
    for part in COMPONENTS:
        if not unread and timed_macs[part] != mac_parts[part]:
            notes.append(TIMED_MACS_NOTE.format(timed=timed_macs[part], part=part, counted=mac_parts[part]))
    if unread:
        notes.append(UNREAD_MACS_NOTE.format(count=sum(unread.values()), ops=", ".join(sorted(unread))))
    forward, traced_median = median(plain), median(traced)
    if forward > 0 and traced_median > 1.5 * forward:
        notes.append(TRACE_OVERHEAD_NOTE.format(forward=format_seconds(forward), traced=format_seconds(traced_median)))
    return notes
