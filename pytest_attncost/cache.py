"""The cache key and the LRU: a repeated ``profile()`` of the same thing is served from memory.

What the key holds and cannot see: docs/architecture.md, "The profile cache's key".
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
import types
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from .request import Request
    from .result import Profile
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)

__all__ = ["CACHE_SIZE", "cache_key", "clear_cache", "enabled", "lookup", "set_enabled", "store"]

#: Profiles already counted in this process, by everything that decides the count.
_CACHE: OrderedDict[Hashable, Profile] = OrderedDict()
CACHE_SIZE = 512

#: The switch: when False, nothing is looked up or stored (the plugin's --attncost-no-cache).
enabled = True

#: How deep and how large a container attribute may be before the call becomes uncacheable.
MAX_DEPTH = 6
MAX_ITEMS = 4096

_SIMPLE = (int, float, bool, str, bytes, complex, type(None))
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.BuiltinMethodType,
              types.MethodWrapperType, types.WrapperDescriptorType, types.MethodDescriptorType)


class Uncacheable(Exception):
    """Something that may decide the count cannot be described: count, don't cache."""


def set_enabled(value: bool) -> bool:
    """Turn the cache on or off for this process; returns the previous setting."""
    global enabled
    previous, enabled = enabled, bool(value)
    return previous


def clear_cache() -> None:
    """Forget every cached profile."""
    _CACHE.clear()


def lookup(key: Hashable | None) -> Profile | None:
    """The cached profile for *key* (None: no key, the cache is off, or not counted yet)."""
    if key is None or not enabled:
        return None
    if (found := _CACHE.get(key)) is not None:
        _CACHE.move_to_end(key)
    return found


def store(key: Hashable | None, result: Profile) -> None:
    """Remember *result* under *key*, dropping the least recently used beyond CACHE_SIZE."""
    if key is None or not enabled:
        return
    _CACHE[key] = result
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)


class _Describer:
    """Turns attribute values into hashable descriptions; one per key, sharing config descriptions."""

    def __init__(self, module_names: Mapping[int, str]) -> None:
        import torch

        self.torch = torch
        self.module_names = module_names
        self.configs: dict[int, int] = {}  # id(config) -> index into self.config_parts
        self.config_parts: list[Any] = []
        self.config_refs: list[Any] = []  # keeps described configs alive while their ids are in use
        self.items = 0

    def attribute(self, value: Any) -> Hashable:
        """One attribute's description; the size bound applies to each attribute on its own."""
        self.items = 0
        return self.value(value)

    def value(self, value: Any, depth: int = 0) -> Hashable:
        torch = self.torch
        self.items += 1
        if self.items > MAX_ITEMS or depth > MAX_DEPTH:
            raise Uncacheable("too large or too deep")
        # type first: True == 1 == 1.0 hash alike, and must not share an entry
        if isinstance(value, _SIMPLE):
            return (type(value), value)
        if isinstance(value, (enum.Enum, torch.dtype, torch.device, torch.Size, torch.memory_format,
                              torch.layout, type, range, slice)):
            return value  # type: ignore[no-any-return,return-value]  # all hashable
        if isinstance(value, torch.Tensor):  # a tensor kept as a plain attribute, not a buffer
            return ("tensor", tuple(value.shape), value.dtype, value.device.type, value.requires_grad)
        if isinstance(value, torch.nn.Module):
            if (name := self.module_names.get(id(value))) is not None:
                return ("module", name)
            if value._parameters or value._buffers or value._modules:  # outside the tree: its shapes are not in the key
                raise Uncacheable(f"a {type(value).__name__} outside the model's tree")
            # a module without weights or children kept aside (the kernels package's function wrappers, which
            # transformers 5.25 puts on every attention module): its type and settings are all it is
            settings = tuple((key, self.value(v, depth + 1)) for key, v in vars(value).items()
                             if key not in _module_internals())
            return ("free module", type(value), settings)
        if isinstance(value, (list, tuple)):
            return (type(value), tuple(self.value(v, depth + 1) for v in value))
        if isinstance(value, (set, frozenset)):
            described = [self.value(v, depth + 1) for v in value]
            return (type(value), tuple(sorted(described, key=repr)))
        if isinstance(value, dict):
            pairs = [(self.value(k, depth + 1), self.value(v, depth + 1)) for k, v in value.items()]
            return (type(value), tuple(pairs))  # insertion order kept: iteration order can matter
        if hasattr(value, "to_json_string") and hasattr(value, "to_dict"):  # a transformers config (may be a dataclass)
            return ("config", self.config(value, depth))
        if dataclasses.is_dataclass(value):
            fields = tuple((f.name, self.value(getattr(value, f.name), depth + 1))
                           for f in dataclasses.fields(value))
            return (type(value), fields)
        if isinstance(value, functools.partial):
            return ("partial", self.value(value.func, depth + 1), self.value(value.args, depth + 1),
                    self.value(value.keywords, depth + 1))
        if isinstance(value, _FUNCTIONS):
            try:
                hash(value)
            except TypeError:
                raise Uncacheable(f"an unhashable {type(value).__name__}") from None
            return ("callable", value)  # by identity; the key holds the reference
        raise Uncacheable(f"an attribute of type {type(value).__qualname__}")

    def config(self, config: Any, depth: int) -> int:
        """Index of *config*'s description: its JSON and the private attributes the JSON omits."""
        if (index := self.configs.get(id(config))) is not None:
            return index
        index = len(self.config_parts)
        self.configs[id(config)] = index
        self.config_refs.append(config)
        self.config_parts.append(None)  # reserved: a sub-config may point back at its parent
        try:
            text: str = config.to_json_string(use_diff=False)
        except Exception:  # noqa: BLE001 - an unserialisable config: its repr still tells builds apart
            text = repr(config)
        private: list[tuple[str, Hashable]] = []
        for name in ("_attn_implementation", "_experts_implementation"):
            try:
                resolved = getattr(config, name, None)
            except Exception:  # noqa: BLE001 - a property that cannot resolve yet
                resolved = "<unresolved>"
            private.append((name, self.value(resolved, depth + 1)))
        for name, attr in sorted(vars(config).items()):
            # every private attribute, and every sub-config (their private parts are not in the JSON)
            if name.startswith("_") or (hasattr(attr, "to_json_string") and hasattr(attr, "to_dict")):
                try:
                    private.append((name, self.value(attr, depth + 1)))
                except Uncacheable:  # the JSON holds the config's substance; a repr still tells builds apart
                    private.append((name, ("repr", type(attr), repr(attr))))
        self.config_parts[index] = (type(config), text, tuple(private))
        return index


@functools.cache
def _module_internals() -> frozenset[str]:
    """nn.Module's own attributes, which the key does not look at (the twin drops hooks; parameters, buffers and
    children are described on their own); the training flag stays: it decides counts (dropout, LayerDrop)."""
    from torch import nn

    return (frozenset(vars(nn.Module())) | {"_compiled_call_impl"}) - {"training"}


def structure(model: nn.Module) -> Hashable:
    """The module tree, attributes, configs and every tensor's shape; raises Uncacheable."""
    internals = _module_internals()
    named = list(model.named_modules(remove_duplicate=False))
    describe = _Describer({id(module): name for name, module in reversed(named)})  # a shared module: its first name
    parts: list[Any] = []
    for name, module in named:
        settings = tuple((key, describe.attribute(value)) for key, value in vars(module).items()
                         if key not in internals)
        tensors: list[tuple[Any, ...]] = [(key, t.shape, t.dtype, t.device.type, t.requires_grad, type(t))
                                          for key, t in module._parameters.items() if t is not None]
        tensors += [(key, t.shape, t.dtype, t.device.type) for key, t in module._buffers.items() if t is not None]
        parts.append((name, type(module), settings, tuple(tensors)))
    config = getattr(model, "config", None)  # also when it is a property, not an attribute
    if config is not None and hasattr(config, "to_json_string"):
        parts.append(("root config", describe.config(config, 0)))
    return (tuple(parts), tuple(describe.config_parts))


def _inputs_key(inputs: Any) -> Hashable:
    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten(inputs)
    return (str(spec), tuple(_Describer({}).attribute(leaf) for leaf in leaves))


class _Hashed:
    """A model's description, hashed once (a key is hashed at every lookup and store)."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: Hashable) -> None:
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Hashed) and self._hash == other._hash and self.value == other.value

    def __repr__(self) -> str:
        return repr(self.value)


def cache_key(target: nn.Module, request: Request) -> Hashable | None:
    """Everything that decides a count; None when the call cannot be cached (callable inputs, something the key
    cannot describe: docs/architecture.md, "The profile cache's key") or the cache is off."""
    return cache_keys(target, request)[0]


def cache_keys(target: nn.Module, request: Request) -> list[Hashable | None]:
    """:func:`cache_key` at each of the request's lengths (its n, or a sweep's lengths: the model described once)."""
    ns = request.lengths or (request.n,)
    if not enabled:
        return [None] * len(ns)
    import torch

    inputs, roles = request.inputs, request.roles
    if callable(inputs) and not isinstance(inputs, (torch.Tensor, torch.nn.Module)):
        return [None] * len(ns)
    try:
        inputs_key = None if inputs is None else _inputs_key(inputs)
        roles_key = None if roles is None else repr(sorted((k, tuple(v) if not isinstance(v, str) else v)
                                                           for k, v in dict(roles).items()))
        model_key = _Hashed(structure(target))
    except (Uncacheable, TypeError):  # TypeError: an unhashable leaf slipped through
        return [None] * len(ns)
    # global switches that change what runs: MHA's fast path, and how far a checkpoint recomputes in train mode
    early_stop = getattr(sys.modules.get("torch.utils.checkpoint"), "_enable_checkpoint_early_stop", None)
    asked = (request.batch, request.batch_given, inputs_key, roles_key, request.spec_read, request.spec, request.name,
             request.backend, request.mode, request.causal, request.fallback, request.new_tokens, request.m)
    return [_hashable((model_key, n, asked, torch.backends.mha.get_fastpath_enabled(), early_stop)) for n in ns]


def _hashable(key: Hashable) -> Hashable | None:
    try:
        hash(key)
    except TypeError:  # an unhashable leaf slipped through
        return None
    return key
