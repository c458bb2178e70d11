"""Memory beside MACs: the peak of a forward or of a training step, estimated on fake tensors.

Nothing is allocated: the model's twin runs on fake CPU tensors (CPU kernels, so CPU's choices of path: a
float dropout mask, sdpa's CPU kernels) under a live-bytes dispatch mode (:class:`_Live`) that adds each new
output storage once and takes it away when the storage dies, the way the CPU allocator sees it. Saved-tensor
hooks tag what autograd keeps for the backward with the roles the count found (the parts of
:mod:`pytest_attncost.roles`), and a storage that descends from a ``QK^T`` product of two activations inside an
attention module is an attention matrix (scores, probabilities, their dropout mask).

A training step is one steady-state step: the optimizer's state already exists, the gradients do not (they
were set to ``None``), then forward, backward of the plugin's loss (the sum of the float outputs), and the
optimizer's ``step()``. :func:`measure_memory` runs the same step for real and reads the peak from torch's
profiler memory records (CPU) or ``max_memory_allocated`` (CUDA), so the estimate can be checked.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from . import families
from .errors import VALUE_READS, ProfileError, site
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .footprint import CATEGORIES, OPTIMIZERS, Memory
from .inputs import Built, remade
from .roles import role_of

__all__ = ["Measured", "Step", "estimate", "loss_of", "make_optimizer", "measure_memory"]

#: torch functions that multiply: saved by one of these with a parameter operand is a projection's input.
_PRODUCTS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "__matmul__", "__rmatmul__",
                       "conv1d", "conv2d", "bilinear", "addbmm"})
#: aten products of two operands (the seed of an attention matrix when both are activations).
_ATEN_PRODUCTS = frozenset({"mm", "bmm", "matmul", "baddbmm", "addmm"})
#: Fused CPU kernels that allocate inside themselves what their fake kernels do not (nn.MultiheadAttention's and
#: nn.TransformerEncoderLayer's eval fast path: measured 12 % of a tiny encoder's forward peak).
_OPAQUE = frozenset({"_transformer_encoder_layer_fwd", "_native_multi_head_attention"})
OPAQUE_WARNING = ("{ops} ran (the eval fast path of torch's Transformer modules): its CPU kernel allocates buffers "
               "inside itself that its fake kernel does not, so the forward's estimate may be low; check it with "
               "measure_memory()")
NO_FAKE_KERNEL = ("the memory estimate could not run {model} on fake tensors{where} ({reason}); {fix}, or profile "
                  "without memory=True")
CUSTOM_OP = "a custom op needs a fake (meta) kernel to be estimated (torch.library.register_fake)"
READS_VALUES = ("forward() reads tensor values (.item(), bool(tensor), .tolist()), which fake tensors do not have: "
                "read them from the config or the inputs' shapes")
NO_GRAD_OUTPUT = "mode='train' needs an output that requires grad; none of {model}'s outputs did"


def loss_of(output: Any) -> torch.Tensor:
    """The plugin's training loss (as the torch counter's backward): the sum of every float output that requires
    grad."""
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    grads = [t for t in leaves if t.requires_grad and t.is_floating_point()]
    if not grads:
        raise ProfileError(NO_GRAD_OUTPUT.format(model="the model"))
    return torch.stack([t.sum() for t in grads]).sum()


@dataclass(frozen=True)
class Step:
    """The step estimated or run: its *mode* (``forward``, ``train``, ``decode``), and in a training step its
    *optimizer* (``"adamw"``, ``"sgd"``, None: no optimizer step, or a callable ``params -> optimizer``) with its
    kernel (*foreach*: True, False for single-tensor, None for torch's default)."""

    mode: str
    optimizer: Any = None
    foreach: bool | None = True

    @property
    def train(self) -> bool:
        return self.mode == "train"


def make_optimizer(step: Step, params: list[nn.Parameter]) -> Any:
    """The optimizer of a training *step* (see :class:`Step`), in its steady state (its state made by a first step
    on zero gradients, then the gradients dropped); None for a forward or a step without one."""
    optimizer, foreach = step.optimizer, step.foreach
    if not step.train or optimizer is None:
        return None
    made: Any
    if optimizer == "adamw":
        made = torch.optim.AdamW(params, foreach=foreach)
    elif optimizer == "sgd":
        made = torch.optim.SGD(params, lr=0.01, foreach=foreach)
    elif callable(optimizer) and not isinstance(optimizer, str):
        made = optimizer(params)
    else:
        raise ProfileError(f"optimizer= must be one of {', '.join(map(repr, OPTIMIZERS))}, None, or a callable "
                           f"params -> torch.optim.Optimizer, got {optimizer!r}")
    for p in params:
        p.grad = torch.zeros_like(p)
    made.step()
    made.zero_grad(set_to_none=True)
    return made


def _storages(tensors: Any) -> dict[int, torch.UntypedStorage]:
    found: dict[int, torch.UntypedStorage] = {}
    for t in pytree.tree_leaves(tensors):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            storage = t.untyped_storage()
            found.setdefault(storage._cdata, storage)
    return found


def _state_tensors(optimizer: Any) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


@dataclass
class _Ledger:
    """Live bytes by category, their peak and what made it up."""

    live: dict[int, list[Any]] = field(default_factory=dict)  # storage key -> [bytes, category]
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    current: int = 0
    peak: int = 0
    phase: str = "forward"
    peak_phase: str = "forward"
    at_peak: dict[str, int] = field(default_factory=dict)
    square: set[int] = field(default_factory=set)  # storage keys of attention matrices
    mask: tuple[int, ...] | None = None  # the largest [b, 1, n, n] bool mask built outside attention, its shape
    opaque: set[str] = field(default_factory=set)  # fused CPU kernels whose inner buffers fake tensors do not see

    def add(self, storage: torch.UntypedStorage, category: str) -> None:
        key = storage._cdata
        if key in self.live:
            return
        size = storage.nbytes()
        self.live[key] = [size, category]
        self.totals[category] += size
        self.current += size
        weakref.finalize(storage, self._free, key)
        if self.current > self.peak:
            self.peak, self.peak_phase, self.at_peak = self.current, self.phase, dict(self.totals)

    def _free(self, key: int) -> None:
        size, category = self.live.pop(key, (0, "temporaries"))
        self.totals[category] -= size
        self.current -= size
        self.square.discard(key)

    def retag(self, storage: torch.UntypedStorage, category: str, only_from: tuple[str, ...] = ("temporaries",)
              ) -> bool:
        entry = self.live.get(storage._cdata)
        if entry is None or entry[1] not in only_from:
            return False
        self.totals[entry[1]] -= entry[0]
        self.totals[category] += entry[0]
        entry[1] = category
        return True


class _Live(TorchDispatchMode):
    """Every new output storage added to the ledger once; attention matrices followed from their QK^T seed."""

    def __init__(self, ledger: _Ledger, scopes: list[str], roles: Mapping[str, str], state: set[int]) -> None:
        super().__init__()
        self.ledger, self.scopes, self.roles, self.state = ledger, scopes, roles, state
        self.shared: set[tuple[Any, ...]] = set()  # (shape, dtype) of parameters whose gradients autograd sums

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.shared and func is torch.ops.aten.add.Tensor and self._sums_in_place(args, kwargs):
            return args[0].add_(args[1])
        if func.overloadpacket.__name__ in _OPAQUE:
            self.ledger.opaque.add(func.overloadpacket.__name__)
        out = func(*args, **(kwargs or {}))
        outs = _storages(out)
        for storage in outs.values():
            self.ledger.add(storage, "temporaries")
        if outs and self.scopes and role_of(self.scopes[-1], self.roles) == "attention":
            self._follow(func, args, kwargs, out, outs)
        elif outs:
            for t in pytree.tree_leaves(out):
                if (isinstance(t, torch.Tensor) and t.dtype == torch.bool and t.dim() == 4 and t.shape[1] == 1
                        and t.shape[-1] == t.shape[-2] > 1 and t.numel() > math.prod(self.ledger.mask or (0,))):
                    self.ledger.mask = tuple(t.shape)  # a model's [b, 1, n, n] attention mask
        return out

    def _sums_in_place(self, args: Any, kwargs: Any) -> bool:
        """Whether this add is autograd summing two fresh gradients of a parameter used twice (a tied head, GPT-2's
        token types through wte): on real tensors the engine adds the second into the first in place; on fake
        tensors (a tensor subclass) it cannot, and would hold a third gradient-sized tensor."""
        if self.ledger.phase != "backward" or kwargs or len(args) != 2:
            return False
        first, second = args
        if not (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)) or first.shape != second.shape:
            return False
        fresh = all(self.ledger.live.get(t.untyped_storage()._cdata, (0, ""))[1] == "temporaries"
                    and t.is_contiguous() and t._base is None for t in (first, second))
        return fresh and (tuple(first.shape), first.dtype) in self.shared

    def _follow(self, func: Any, args: Any, kwargs: Any, out: Any, outs: dict[int, Any]) -> None:
        """Mark *out* an attention matrix when it is QK^T (a product of two activations, neither of them a matrix
        already) or made from one at its shape (softmax, masking, dropout and its mask)."""
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                   and t.layout == torch.strided]
        keys = [t.untyped_storage()._cdata for t in tensors]
        squares = [t for t, k in zip(tensors, keys) if k in self.ledger.square]
        name = func.overloadpacket.__name__
        if name in _ATEN_PRODUCTS:
            operands = [k for k in keys if k not in self.state]
            seed = len(operands) >= 2 and not squares and len(keys) - len(operands) == 0
            if seed:
                self.ledger.square.update(outs)
            return
        shapes = {tuple(t.shape) for t in squares}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and tuple(t.shape) in shapes and t.layout == torch.strided:
                self.ledger.square.add(t.untyped_storage()._cdata)


class _Saving(TorchFunctionMode):
    """Which torch function is running (the outermost), and whether it multiplies a parameter: what saved a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.current: tuple[str, bool] | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        outer = self.current
        if outer is None:
            name = getattr(func, "__name__", "")
            product = name in _PRODUCTS and any(isinstance(a, nn.Parameter) for a in pytree.tree_leaves((args, kwargs)))
            self.current = (name, product)
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = outer


@dataclass
class _Run:
    """What one estimate keeps while the step runs: the ledger, the saved storages and their parts."""

    ledger: _Ledger
    roles: Mapping[str, str]
    layers: tuple[str, ...]
    scopes: list[str] = field(default_factory=list)
    saving: _Saving = field(default_factory=_Saving)
    saved: dict[int, tuple[str, bool, bool]] = field(default_factory=dict)  # key -> (part, square, in a layer)
    kept: list[Any] = field(default_factory=list)  # weakrefs of the saved storages, to read them at forward's end

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.layout != torch.strided:
            return tensor
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.saved or not self.ledger.retag(storage, "saved_activations"):
            return tensor  # saved already, or a parameter, buffer or input
        scope = self.scopes[-1] if self.scopes else ""
        role = role_of(scope, self.roles)
        square = key in self.ledger.square
        if role == "attention":
            product = self.saving.current is not None and self.saving.current[1]
            part = "attention_proj" if product and not square else "attention_core"
        else:
            part = "ffn" if role == "ffn" else "other"
        in_layer = any(scope == layer or scope.startswith(layer + ".") for layer in self.layers if layer)
        self.saved[key] = (part, square, in_layer)
        self.kept.append((key, weakref.ref(storage)))
        return tensor

    def scoped(self, model: nn.Module) -> list[Any]:
        handles = []
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(lambda m, a, name=name: self.scopes.append(name)))
            handles.append(module.register_forward_hook(self._leave, always_call=True))
        return handles

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.scopes:  # a hook that returned the popped name would replace the module's output
            self.scopes.pop()

    def saved_now(self) -> tuple[dict[str, int], int, int]:
        """The saved activations alive now, by part; of which attention matrices; of which in the layers."""
        parts: dict[str, int] = {}
        matrices = layers = 0
        for key, ref in self.kept:
            storage = ref()
            if storage is None or key not in self.ledger.live:
                continue
            part, square, in_layer = self.saved[key]
            size = storage.nbytes()
            parts[part] = parts.get(part, 0) + size
            matrices += size if square else 0
            layers += size if in_layer else 0
        return dict(sorted(parts.items())), matrices, layers


def _fake_cpu(mode: Any, model: nn.Module, call: Any) -> tuple[nn.Module, Any]:
    """The twin's parameters and buffers and the inputs as fake CPU tensors of the same sizes."""
    def fake(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        made = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu")
        return made.requires_grad_(t.requires_grad) if t.is_floating_point() else made

    made: dict[int, Any] = {}  # tied parameters stay tied
    with mode:
        for module in model.modules():
            for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
                if tensor is None:
                    continue
                if id(tensor) not in made:
                    twin = fake(tensor)
                    parameter = isinstance(tensor, nn.Parameter)
                    made[id(tensor)] = nn.Parameter(twin, tensor.requires_grad) if parameter else twin
                table = module._parameters if name in module._parameters else module._buffers
                table[name] = made[id(tensor)]
        return model, remade(call, fake)[0]


def estimate(twin: nn.Module, call: tuple[tuple[Any, ...], dict[str, Any]], step: Step, roles: Mapping[str, str],
             layers: tuple[str, ...]) -> Memory:
    """The peak of *twin* (a meta twin, made fake here) run once on *call*: see the module docstring. *roles* and
    *layers* (the module names of the repeated layers) are the count's.

    Raises:
        ProfileError: the model cannot run on fake tensors (a custom op without a fake kernel), or a training
            step whose outputs need no grad.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    try:
        model, fake_call = _fake_cpu(fake_mode, twin, call)
        with fake_mode:
            return _step(model, fake_call, step, _Run(_Ledger(), roles, layers))
    except ProfileError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model's reason, reported whole
        reason = f"{type(exc).__name__}: {exc}".strip()[:400]
        fix = READS_VALUES if any(needle in reason for needle in VALUE_READS) else CUSTOM_OP
        raise ProfileError(NO_FAKE_KERNEL.format(model=type(twin).__name__, where=site(exc, twin), reason=reason,
                                                 fix=fix)) from exc


def _step(model: nn.Module, call: tuple[tuple[Any, ...], dict[str, Any]], step: Step, run: _Run) -> Memory:
    """One forward (no grad) or one training step under *run*'s ledger, on fake tensors already made."""
    args, kwargs = call
    train, ledger = step.train, run.ledger
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(step, params)
    kept = {"parameters": list(model.parameters()), "buffers": list(model.buffers()), "inputs": (args, kwargs),
            "optimizer_state": _state_tensors(opt), "kv_cache": list(remade((args, kwargs), lambda t: t)[1].values())}
    for category, tensors in kept.items():
        for storage in _storages(tensors).values():
            ledger.add(storage, category)
    state = set(_storages([kept["parameters"], kept["buffers"]]))
    # module hooks (the scopes saved tensors are tagged with) only where something is saved: a hook, like a
    # torch-function mode, turns nn.MultiheadAttention's fast path off, which a real eval forward takes
    handles = run.scoped(model) if train else []
    def gradient(p: nn.Parameter) -> None:
        assert p.grad is not None  # the hook runs once the gradient is accumulated
        ledger.retag(p.grad.untyped_storage(), "gradients", ("temporaries", "saved_activations"))

    handles += [p.register_post_accumulate_grad_hook(gradient) for p in params] if train else []
    live = _Live(ledger, run.scopes, run.roles, state)
    try:
        with live, run.saving if train else contextlib.nullcontext(), torch.set_grad_enabled(train), \
                torch.autograd.graph.saved_tensors_hooks(run.pack, lambda t: t):
            with families.no_padding_check():
                output = model(*args, **kwargs)
            saved, matrices, in_layers = run.saved_now()
            if train:
                loss = loss_of(output)
                live.shared = _shared_parameters(loss)
                del output
                ledger.phase = "backward"
                loss.backward()
                del loss
                if opt is not None:
                    ledger.phase = "optimizer"
                    opt.step()
            else:
                del output
    finally:
        for handle in handles:
            handle.remove()
    return Memory(mode=step.mode, peak=ledger.peak, phase=ledger.peak_phase, at_peak=ledger.at_peak, saved=saved,
                  attention_matrices=matrices, saved_in_layers=in_layers,
                  optimizer=None if not train else _optimizer_name(step.optimizer),
                  mask_bytes=math.prod(ledger.mask) if ledger.mask else 0,
                  warnings=() if not ledger.opaque else (OPAQUE_WARNING.format(ops=", ".join(sorted(ledger.opaque))),),
                  assumptions={**_assumptions(model, step),
                               **({} if ledger.mask is None else {"mask": f"bool {list(ledger.mask)}"})})


def _shared_parameters(loss: torch.Tensor) -> set[tuple[Any, ...]]:
    """(shape, dtype) of every parameter more than one gradient reaches (edges into its AccumulateGrad node)."""
    edges: dict[int, int] = {}
    leaves: dict[int, torch.Tensor] = {}
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for following, _ in node.next_functions:
            if following is not None and hasattr(following, "variable"):
                edges[id(following)] = edges.get(id(following), 0) + 1
                leaves[id(following)] = following.variable
            todo.append(following)
    return {(tuple(leaves[key].shape), leaves[key].dtype) for key, count in edges.items() if count > 1}


def _optimizer_name(optimizer: Any) -> str | None:
    if optimizer is None or isinstance(optimizer, str):
        return optimizer
    return getattr(optimizer, "__name__", type(optimizer).__name__)


def _assumptions(model: nn.Module, step: Step) -> dict[str, str]:
    """What the estimate took as given: kernels, dtype, masks, the attention path, the optimizer's kernel."""
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    dropout = any(isinstance(m, nn.Dropout) and m.p > 0 and m.training for m in model.modules())
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    found = {"kernels": "cpu", "dtype": str(floats[0] if floats else torch.float32).removeprefix("torch."),
             "dropout": "active, float masks (4 bytes an element on CPU; CUDA keeps bool, 1 byte)" if dropout
             else "off", "attention": str(implementation or "the model's own")}
    if step.train and step.optimizer is not None:
        kernel = "foreach" if step.foreach else "single-tensor" if step.foreach is False else "torch default"
        found["optimizer_kernel"] = kernel
    return found


# --- the real step ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    """A real step's peak beside the estimate of the same step.

    Attributes:
        peak: bytes at the real peak (profiler memory records on CPU, ``max_memory_allocated`` on CUDA).
        estimate: the fake-tensor :class:`~pytest_attncost.footprint.Memory` of the same step.
        device: where it ran.
        source: how the peak was read.
    """

    peak: int
    estimate: Memory
    device: str
    source: str

    @property
    def difference(self) -> int:
        """estimate - measured, in bytes."""
        return self.estimate.peak - self.peak

    def __repr__(self) -> str:
        return (f"Measured(peak={self.peak:,} B on {self.device}, estimate={self.estimate.peak:,} B, "
                f"difference={self.difference:+,} B)")


def _real_inputs(call: Any, given: Any, where: torch.device) -> Any:
    """The user's inputs (copied, their cache too), or default ones: random floats, zero ids, on *where*."""
    def real(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            return t.detach().clone().to(where).requires_grad_(t.requires_grad)
        if t.is_floating_point():
            return torch.randn(t.shape, dtype=t.dtype, device=where).requires_grad_(t.requires_grad)
        return torch.zeros(t.shape, dtype=t.dtype, device=where)

    return remade(given if given is not None else call, real)[0]


@contextlib.contextmanager
def _cuda_peak(device: torch.device) -> Iterator[list[int]]:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    found: list[int] = []
    yield found
    torch.cuda.synchronize(device)
    found.append(torch.cuda.max_memory_allocated(device))


def _profiled_peak(run: Callable[[], None], start: int) -> int:
    """The peak of *run* on the CPU: what was live at the start plus the largest running sum of the
    profiler's memory records (every allocation and free, in order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    records = [e for e in prof.profiler.kineto_results.events()
               if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    records.sort(key=lambda e: e.start_ns())
    running = peak = 0
    for record in records:
        running += record.nbytes()
        peak = max(peak, running)
    return start + peak


def real_step(model: nn.Module, call: Any, step: Step, device: torch.device) -> tuple[int, str]:
    """The peak of the real *step* (see :func:`measure_memory`), and how it was read."""
    args, kwargs = call
    train = step.train
    opt = make_optimizer(step, [p for p in model.parameters() if p.requires_grad])

    def run() -> None:
        with torch.set_grad_enabled(train):
            output = model(*args, **kwargs)
            if train:
                loss = loss_of(output)
                del output
                loss.backward()
                del loss
                if opt is not None:
                    opt.step()

    gc.collect()
    if device.type == "cuda":
        with _cuda_peak(device) as found:
            run()
        return found[0], "torch.cuda.max_memory_allocated"
    held = list(remade(call, lambda t: t)[1].values())  # the inputs, a cache's tensors too
    start = sum(s.nbytes() for s in _storages([list(model.parameters()), list(model.buffers()), held,
                                               _state_tensors(opt)]).values())
    return _profiled_peak(run, start), "torch.profiler memory records"


def measure_memory(model: nn.Module, guess: Memory, built: Built, step: Step, device: Any) -> Measured:
    """The real *step*'s peak beside *guess*, its estimate, on a copy of *model* (the user's is left as it was), run
    on *built*'s inputs (the user's, copied, or default ones)."""
    where = torch.device(device)
    real = copy.deepcopy(model).to(where)
    inputs = _real_inputs(built.call(), built.given, where)
    with torch.random.fork_rng(devices=[]):
        peak, source = real_step(real, inputs, step, where)
    return Measured(peak, guess, str(where), source)


# --- a profile's memory -------------------------------------------------------------------------------

FUSED_NOTE = ("attention_memory_share is 0: the attention ran a fused kernel ({path}) that keeps no n×n tensor for "
              "the backward, so there are no attention matrices to bound (the share bound says nothing here)")
FORWARD_NOTE = "an inference forward (no grad) keeps nothing for a backward: saved activations and their share are 0"
NOT_MODELLED = ("CPU kernels, not CUDA's (CUDA keeps bool dropout masks, runs fused sdpa with dropout, and picks "
                "other optimizer kernels); the CUDA allocator's reserve and fragmentation, the CUDA context and "
                "kernel workspaces are not modelled, nor the CPU scalars the optimizer's .item() reads make on a real "
                "run (an 8- and a 4-byte temporary: a real step may peak 12 B above the estimate)")
NO_FORMULA = "no per-layer memory formula: {why}"
FAKE_MASK_NOTE = ("transformers built a {shape} bool mask ({size:,} B) on fake tensors, which it treats as tracing: "
                  "with sdpa a real run whose attention_mask is all ones skips it, so such a step's forward may peak "
                  "{size:,} B below the estimate; pass no attention_mask to estimate that run")


def _formula(profiled: Any, found: Memory, largest: int) -> tuple[dict[str, Any] | None, str | None]:
    """The per-layer formula's figures for the layers of the step *found* of the Profile *profiled* (its spec, n,
    batch and layers), or why there is none; *largest*: the bytes of the largest parameter."""
    from . import footprint

    spec, n, batch = profiled.spec, profiled.n, profiled.batch
    if found.mode != "train":
        return None, None
    if spec is None:
        return None, "no spec (pass spec=)"
    if spec.gated or spec.experts or spec.cross_attention or spec.ffn_dim != 4 * spec.hidden:
        return None, "it describes an ungated FFN of 4·hidden without cross-attention or experts"
    p = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}.get(found.assumptions.get("dtype", ""), 4)
    dropout = found.assumptions.get("dropout", "off") != "off"
    fused = found.attention_matrices == 0 and not dropout
    kind = "fused attention" if fused else ("eager, dropout" if dropout else "eager, no dropout")
    per_layer = footprint.activation_bytes(spec, n, batch, p=p, mask=p, dropout=dropout, fused=fused)
    # a fused kernel keeps no n×n tensor; the eager path 2p + m bytes a pair with dropout (m = p here), p without
    matrices = 0 if fused else footprint.attention_matrix_bytes(spec, n, batch, 3 * p if dropout else p)
    kernel = {True: "foreach", False: "single-tensor"}.get(found.assumptions.get("optimizer_kernel") == "foreach")
    state = footprint.model_state_bytes(found.at_peak.get("parameters", 0), found.optimizer, kernel, largest) if (
        found.optimizer in (*footprint.OPTIMIZERS, None)) else None
    layers = profiled.layers
    return {"activations": layers * per_layer, **({} if state is None else {"model_state": state}),
            "per_layer": per_layer, "attention_matrices": layers * matrices, "kind": kind, "p": p, "mask": p,
            "crossover_n": float(footprint.memory_crossover_n(spec, p=p, mask=p, dropout=dropout))}, None


def of_profile(target: nn.Module, call: Any, profiled: Any, *, optimizer: Any, foreach: bool | None) -> Memory:
    """The memory of the step *profiled* (a Profile) counted: its mode, its roles and layers, checked against the
    per-layer formula (a warning past :data:`~pytest_attncost.footprint.MEMORY_TOLERANCE`)."""
    import dataclasses

    from . import families, footprint
    from .counting import meta_twin

    twin = meta_twin(target)
    families.prepare_twin(twin)
    layers = tuple(name for name, row in profiled.modules.items() if row[2] == "layer")
    found = estimate(twin, call, Step(profiled.mode, optimizer, foreach), profiled.roles, layers)
    notes, warnings = [NOT_MODELLED], list(found.warnings)
    if found.mode != "train":
        notes.append(FORWARD_NOTE)
    elif found.attention_matrices == 0:
        notes.append(FUSED_NOTE.format(path=found.assumptions.get("attention", "fused")))
    largest = max((p.numel() * p.element_size() for p in twin.parameters()), default=0)
    if found.mask_bytes and found.assumptions.get("attention") == "sdpa" and "attention_mask" in call[1]:
        shape = found.assumptions["mask"].removeprefix("bool ")
        notes.append(FAKE_MASK_NOTE.format(shape=shape, size=found.mask_bytes))
    formula, why = _formula(profiled, found, largest)
    if why is not None:
        notes.append(NO_FORMULA.format(why=why))
    found = dataclasses.replace(found, formula=formula, notes=tuple(notes))
    deviation = found.deviation
    if formula is not None and deviation is not None and deviation > footprint.MEMORY_TOLERANCE:
        warnings.append(footprint.MEMORY_FORMULA_WARNING.format(
            measured=found.saved_in_layers, expected=formula["activations"],
            deviation=(found.saved_in_layers - formula["activations"]) / formula["activations"], kind=formula["kind"]))
    return dataclasses.replace(found, warnings=tuple(warnings))
