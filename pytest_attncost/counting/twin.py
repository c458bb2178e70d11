"""The twin a count runs on: a copy of the user's model with no hooks, on the meta device (or with its
weights, for the real-tensor fallback). The user's model is never run, moved or hooked, and neither
counter fires the user's global module hooks."""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..errors import CountError
from ..errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from ..families import patchify_conv
from .graphs import graph_metadata, run_in_scopes

__all__ = ["HOOKS_NOTE", "all_meta", "as_if_compiling", "drop_hooks", "kept_torch_state", "meta_autocast", "meta_twin",
           "no_global_hooks", "real_twin", "refuse_scripted", "tensor_leaves", "unwrap", "user_hooks"]


SCRIPTED_MESSAGE = (
    "{what} is a TorchScript module (made by torch.jit.script or torch.jit.trace): its code is compiled, "
    "so it can be neither copied to the meta device nor hooked per module, and its MACs cannot be split.\n"
    "Fix: count the eager nn.Module you scripted, e.g. profile(MyModel(cfg)), or pass a zero-argument "
    "factory that builds it, e.g. profile(lambda: MyModel(cfg))."
)


SHARDED_MESSAGE = (
    "{what} is sharded by FSDP2 (fully_shard): its parameters are DTensors spread over the ranks, and FSDP "
    "refuses to be copied, so it cannot be counted as it is.\n"
    "Fix: FSDP shards the parameters, not the computation, so each rank runs the unsharded model's MACs: "
    "count the model before fully_shard(), e.g. profile(lambda: MyModel(cfg)) with a factory that does not "
    "shard it."
)


def refuse_scripted(model: nn.Module) -> None:
    """A clear CountError for TorchScript modules (they refuse forward hooks with a raw RuntimeError) and for
    modules sharded by FSDP2 (they refuse to be copied)."""
    for name, module in model.named_modules():
        what = type(model).__name__ if not name else f"{type(model).__name__}.{name}"
        if isinstance(module, torch.jit.ScriptModule):
            raise CountError(SCRIPTED_MESSAGE.format(what=what))
        if any(cls.__name__ == "FSDPModule" for cls in type(module).__mro__):
            raise CountError(SHARDED_MESSAGE.format(what=what))


#: Global module hooks (torch.nn.modules.module.register_module_*_hook) a count must not fire.
_GLOBAL_HOOK_DICTS = (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_with_kwargs",
    "_global_forward_hooks_always_called", "_global_backward_pre_hooks", "_global_backward_hooks",
    "_global_module_registration_hooks", "_global_parameter_registration_hooks",
    "_global_buffer_registration_hooks",
)


@contextlib.contextmanager
def no_global_hooks() -> Iterator[None]:
    """Set the user's global module hooks aside while counting, and put them back, even on error: in place (their
    handles hold the dictionaries), so a hook removed later by its handle is still removed."""
    from torch.nn.modules import module as module_mod
    found = (getattr(module_mod, name, None) for name in _GLOBAL_HOOK_DICTS)
    saved = [(hooks, dict(hooks)) for hooks in found if hooks is not None]
    for hooks, _ in saved:
        hooks.clear()
    full_backward = getattr(module_mod, "_global_is_full_backward_hook", None)
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.clear()
            hooks.update(items)
        if hasattr(module_mod, "_global_is_full_backward_hook"):
            module_mod._global_is_full_backward_hook = full_backward


def meta_twin(model: nn.Module) -> nn.Module:
    """A deep copy of *model* whose parameters and buffers are empty meta tensors.

    The copy shares nothing with the original: tied weights stay tied to each other, the ``training`` flags are kept,
    and every hook is dropped (the user's hooks must neither fire during counting nor be copied into the count).
    """
    refuse_scripted(model)
    memo: dict[int, Any] = graph_metadata(model)
    for module in model.modules():
        stand_in = _quantized_stand_in(module)
        if stand_in is not None:
            memo[id(module)] = stand_in
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in memo:
            continue
        # same sizes and strides; empty_like runs Python prims (100x slower)
        twin = (torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="meta")
                if tensor.layout == torch.strided else torch.empty_like(tensor, device="meta"))
        if isinstance(tensor, nn.Parameter):
            twin = nn.Parameter(twin, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = twin
    try:
        clone = _copy_module(model, memo)
    except Exception as exc:  # noqa: BLE001 - any failure here is the model's, reported whole
        raise CountError(
            f"cannot copy {type(model).__name__} to count it ({type(exc).__name__}: {exc}); "
            "pass a zero-argument factory instead of the module, e.g. profile(lambda: MyModel(cfg))"
        ) from exc
    drop_hooks(clone)
    for module in clone.modules():
        patchify_conv(module)
    run_in_scopes(clone)  # a GraphModule runs in its original modules' scopes (see .graphs)
    return clone


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


def _plain_state(cls: type) -> bool:
    """Whether copy.deepcopy would copy an instance as nn.Module's __getstate__ dict, then __setstate__."""
    inherited = (("__reduce_ex__", object), ("__reduce__", object), ("__getstate__", nn.Module))
    return (getattr(cls, "__deepcopy__", None) is None and all(getattr(cls, name) is getattr(base, name)
                                                              for name, base in inherited)
            and all("__slots__" not in vars(base) for base in cls.__mro__[:-1]))


def _copy_module(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``copy.deepcopy(module, memo)``, a module at a time (a third of the time on a BERT-base): deepcopy's steps,
    except that the hook dictionaries ``drop_hooks`` clears anyway start empty. A module whose class copies itself
    some other way goes to deepcopy."""
    found = memo.get(id(module))
    if found is not None:
        return found  # type: ignore[no-any-return]
    cls = type(module)
    if not _plain_state(cls):
        return copy.deepcopy(module, memo)  # type: ignore[no-any-return]
    clone = cls.__new__(cls)
    memo[id(module)] = clone
    state: dict[str, Any] = {}
    for key, value in module.__dict__.items():
        if key == "_compiled_call_impl":
            continue  # nn.Module.__getstate__ drops it
        if key == "_modules":
            state[key] = type(value)((name, None if child is None else _copy_module(child, memo))
                                     for name, child in value.items())
        elif key in ("_parameters", "_buffers"):  # deepcopy's dict steps, without its memo entry for the dict
            state[key] = type(value)((name, None if t is None else copy.deepcopy(t, memo))
                                     for name, t in value.items())
        elif key in _HOOK_DICTS and type(value) in (dict, OrderedDict):
            state[key] = type(value)()
        else:
            state[key] = copy.deepcopy(value, memo)
    clone.__setstate__(state)
    return clone


def _quantized_stand_in(module: nn.Module) -> nn.Module | None:
    """A meta ``nn.Linear`` of the same shape for a dynamically quantized Linear, whose packed int8 weight cannot
    live on the meta device: the twin counts the same ``[.., in] @ [in, out]`` as an ``aten::linear``."""
    from torch.ao.nn.quantized import dynamic as qdynamic
    if not isinstance(module, qdynamic.Linear):
        return None
    return nn.Linear(module.in_features, module.out_features, bias=module.bias() is not None,
                     device="meta").requires_grad_(False)


def drop_hooks(clone: nn.Module) -> None:
    """A copy's hooks are the user's: they must neither fire during counting nor be counted."""
    for module in clone.modules():
        for name in _HOOK_DICTS:
            hooks = getattr(module, name, None)
            if hooks is not None:
                hooks.clear()


def real_twin(model: nn.Module) -> nn.Module:
    """A full copy, weights included, without hooks: for the real-tensor fallback at small n."""
    clone = copy.deepcopy(model, graph_metadata(model))
    drop_hooks(clone)
    return clone


def all_meta(model: nn.Module, inputs: Any) -> bool:
    """Whether every tensor a run starts from is a meta tensor (the twin's weights, the inputs): no values anywhere,
    so nothing the model does can depend on data."""
    from torch.utils import _pytree as pytree

    leaves = [*model.parameters(), *model.buffers(), *pytree.tree_leaves(inputs)]
    return all(t.is_meta for t in leaves if isinstance(t, torch.Tensor))


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in *value*, through dicts, tuples and lists (anything else, a DynamicCache, carries no count)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (Mapping, tuple, list)):
        return [t for item in (value.values() if isinstance(value, Mapping) else value) for t in tensor_leaves(item)]
    return []


def unwrap(model: nn.Module) -> nn.Module:
    """What a wrapper runs: DataParallel/DDP's module, torch.compile's original."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod  # type: ignore[assignment]
        else:
            return model


@contextlib.contextmanager
def meta_autocast() -> Iterator[None]:
    """``torch.autocast("meta", ...)`` is a disabled CPU autocast while counting, instead of raising "unsupported
    scalarType": rotary embeddings run under ``torch.autocast(device_type=x.device.type, enabled=False)``
    (transformers 4, x-transformers), and nothing computed on the meta device has anything to cast."""
    cls = torch.amp.autocast_mode.autocast
    original = cls.__init__

    def __init__(self: Any, device_type: str, dtype: Any = None, enabled: bool = True,
                 cache_enabled: Any = None) -> None:
        if device_type == "meta":
            device_type, enabled = "cpu", False
        original(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    cls.__init__ = __init__  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.__init__ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def as_if_compiling() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` is true while a model runs on fake tensors, which have no values to read:
    library code skips its reads of tensor values when compiling (transformers 4's padding warning and its choice
    of ``is_causal`` from the mask's values), as it does under fvcore's trace."""
    original = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compiler.is_compiling = original  # type: ignore[assignment]


HOOKS_NOTE = ("the model's hooks do not run in the count (the copy counted has none), so what they compute is not "
              "counted: {hooks}")


def user_hooks(model: nn.Module) -> list[str]:
    """The user's module hooks a count drops, each as ``forward hook NAME on MODULE`` (global hooks too)."""
    from torch.nn.modules import module as module_mod

    def name(hook: Any) -> str:
        return getattr(hook, "__qualname__", None) or type(hook).__name__

    found = [f"{kind.strip('_').replace('_', ' ').removesuffix(' hooks')} hook {name(hook)} on "
             f"{where or 'the model'}"
             for where, module in model.named_modules() for kind in _HOOK_DICTS[:4] + _HOOK_DICTS[6:]
             for hook in (getattr(module, kind, None) or {}).values()]
    return found + [f"{kind.strip('_').replace('_', ' ').removesuffix(' hooks')} hook {name(hook)}"
                    for kind in _GLOBAL_HOOK_DICTS[:2] + _GLOBAL_HOOK_DICTS[4:6]
                    for hook in (getattr(module_mod, kind, None) or {}).values()]


def _autocast(device: str) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    """(read, restore) of autocast on *device*: whether it is enabled, and its dtype."""
    def restore(value: tuple[bool, Any]) -> None:
        torch.set_autocast_enabled(device, value[0])
        torch.set_autocast_dtype(device, value[1])

    return lambda: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)), restore


def _restore_device(device: torch.device) -> None:
    """Put the default device back (:func:`kept_torch_state` calls it only where the forward changed it)."""
    torch.set_default_device(None if device == torch.device("cpu") else device)
    context = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)  # torch 2.6 leaves None there, which its own
    if context is not None and getattr(context, "device_context", False) is None:  # get_default_device refuses
        del context.device_context


#: Global torch settings a forward may change, as (read, restore): every count and timing puts them back.
_SETTINGS: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
    "default dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "default device": (torch.get_default_device, _restore_device),
    "threads": (torch.get_num_threads, torch.set_num_threads),
    "interop threads": (torch.get_num_interop_threads, torch.set_num_interop_threads),
    "grad mode": (torch.is_grad_enabled, torch.set_grad_enabled),
    "anomaly mode": (torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    "deterministic algorithms": (
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
    "float32 matmul precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "cpu autocast": _autocast("cpu"),
    "cuda autocast": _autocast("cuda"),
}


#: Backend flags a forward may set, put back the same way (TF32 is the matmul precision's: torch refuses to read
#: its legacy flags once the new API was used).
_FLAGS = tuple((owner, name) for owner, name in (
    (torch.backends.cudnn, "deterministic"), (torch.backends.cudnn, "benchmark"),
    (torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
    (torch.backends, "fp32_precision"), (torch.backends.cuda.matmul, "fp32_precision"),  # torch >= 2.9
    (torch.backends.cudnn, "fp32_precision"), (torch.backends.mkldnn, "fp32_precision"),
) if hasattr(owner, name))


@contextlib.contextmanager
def kept_torch_state() -> Iterator[None]:
    """Put back every global torch setting in :data:`_SETTINGS` that the user's code changed meanwhile (a forward
    that calls ``torch.set_default_dtype`` or ``torch.set_num_threads``), even on error. A setting torch will not
    set again (interop threads, once parallel work has started) stays as the forward left it."""
    saved = {name: _read(read) for name, (read, _) in _SETTINGS.items()}
    flags = [getattr(owner, name) for owner, name in _FLAGS]
    try:
        yield
    finally:
        for (owner, name), value in zip(_FLAGS, flags):
            if getattr(owner, name) != value:
                setattr(owner, name, value)
        for name, (read, restore) in _SETTINGS.items():
            if saved[name] is not _UNREADABLE and _read(read) != saved[name]:
                with contextlib.suppress(RuntimeError):
                    restore(saved[name])


_UNREADABLE = object()


def _read(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except RuntimeError:  # torch refuses to say (the matmul precision after a mix of its TF32 APIs)
        return _UNREADABLE
