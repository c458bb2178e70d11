"""What a forward pass takes, built once, and what n and batch it saw (docs/architecture.md, "Inputs")."""

from __future__ import annotations

import collections
import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import families
from .errors import ProfileError
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .formulas import ModelSpec
from .parts import Split
from .request import Request

__all__ = ["Built", "Ran", "build", "cache_bytes", "decode_lengths", "folded_sequences", "fresh",
           "one_sequence_per_row", "read_lengths", "to_meta", "to_real", "token_shape", "user_inputs"]

Call = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class Built:
    """The inputs of one count: what the twin is called with (meta tensors)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    given: Call | None = None  # the user's own inputs with their values, as given (None for default inputs)
    decoding: bool = False  # a decode step: every count gets a fresh copy of the cache

    def call(self) -> Call:
        """The inputs for one count (a decode step's cache copied afresh)."""
        return fresh(self.args, self.kwargs) if self.decoding else (self.args, self.kwargs)

    def real_call(self) -> Call | None:
        """The user's inputs with their values for a count on real tensors (the user's cache left as it was)."""
        if self.given is None or not self.decoding:
            return self.given
        return fresh(*self.given, meta=False)


@dataclass(frozen=True)
class Ran:
    """What one count ran and saw, which the lengths are read back from: the model, its inputs, the spec it is
    compared with, and the split (the lengths the layers' attention saw)."""

    target: nn.Module
    built: Built
    spec: ModelSpec | None
    parts: Split


NESTED_INPUTS = ("inputs= hold a nested (jagged) tensor of {count} sequences: neither counter can trace one on the "
                 "meta device or on fake tensors. Count each length as its own dense batch, e.g. "
                 "sum(profile(model, inputs=(seq.unsqueeze(0),)).total for seq in x.unbind()), or pass "
                 "x.to_padded_tensor(0.0) to count the padded batch the kernel would run")


def build(target: nn.Module, request: Request) -> Built:
    """The inputs of a count of *target* for *request* (docs/architecture.md, "Inputs").

    Raises:
        ProfileError: the inputs cannot be built or are not of a form profile() takes.
    """
    n, batch, inputs = request.n, request.batch, request.inputs
    if request.mode == "decode":
        if inputs is None:
            args, kwargs = families.decode_inputs(target, n, request.new_tokens, batch)  # type: ignore[arg-type]
            return Built(args, kwargs, decoding=True)
        given = user_inputs(inputs, n, batch)
        return Built(*fresh(*given), given, decoding=True)  # the cache's tensors too, not only pytree leaves
    if inputs is None:
        return Built(*families.default_inputs(target, n, batch, request.m))
    given = user_inputs(inputs, n, batch)
    args, kwargs = to_meta(given)
    return Built(args, kwargs, given)


@contextlib.contextmanager
def one_sequence_per_row(target: nn.Module, given: Call | None) -> Iterator[None]:
    """While the plugin runs *target*, positions the user did not give hold one sequence per row.

    Where no attention mask is given, transformers looks for packed sequences in the position ids (a new sequence
    wherever they do not step by one). Fake tensors and traces have no values, so it takes them as packed and builds
    a ``[b, 1, n, n]`` mask that a real run of the same call skips (a LLaMA's own positions, 0 .. n-1), and the
    plugin's stand-in positions (zeros, which reach past max_position_embeddings) read as packed on real tensors
    too. Unless the user's inputs (*given*; None: the plugin's own) carry position ids, the search finds none."""
    with contextlib.nullcontext() if _gives_positions(target, given) else families.no_packed_sequences():
        yield


def _gives_positions(target: nn.Module, given: Call | None) -> bool:
    if given is None:
        return False
    args, kwargs = given
    params = list(families.forward_params(target))
    return "position_ids" in kwargs or ("position_ids" in params and params.index("position_ids") < len(args))


def to_real(value: Any) -> Any:
    """Zero-filled CPU tensors of the same shapes and dtypes (meta tensors have no values to run on)."""
    return pytree.tree_map_only(torch.Tensor, lambda leaf: torch.zeros(leaf.shape, dtype=leaf.dtype), value)


def to_meta(value: Any) -> Any:
    """Inputs as meta tensors of the same shape and dtype (nothing is computed on them)."""
    return pytree.tree_map_only(torch.Tensor, lambda leaf: torch.empty_like(leaf, device="meta"), value)


def user_inputs(inputs: Any, n: int | None, batch: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if callable(inputs) and not isinstance(inputs, (nn.Module, torch.Tensor)):
        if n is None:
            raise ProfileError("inputs= is a callable (n, batch) -> ..., so n is needed: pass n= (or mark the test)")
        try:
            inputs = inputs(n, batch)
        except Exception as exc:  # noqa: BLE001 - the callable is the user's code
            raise ProfileError(f"inputs(n={n}, batch={batch}) raised {type(exc).__name__}: {exc}") from exc
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if isinstance(inputs, (tuple, list)):
        given: tuple[tuple[Any, ...], dict[str, Any]] = tuple(inputs), {}
    elif isinstance(inputs, Mapping):
        if not all(isinstance(k, str) for k in inputs):
            raise ProfileError("an inputs= dict maps keyword-argument names (str) to values")
        given = (), dict(inputs)
    else:
        raise ProfileError(f"inputs= got {type(inputs).__name__}; {families.INPUTS_HINT}")
    found: dict[int, torch.Tensor] = {}
    _tensors_in(given, found)
    if (nested := next((t for t in found.values() if t.is_nested), None)) is not None:
        raise ProfileError(NESTED_INPUTS.format(count=nested.size(0)))
    return given


def read_lengths(ran: Ran, request: Request) -> tuple[int, int]:
    """n and batch from the inputs: default inputs were built for n; the user's hold their own (the main input's
    token dimension, else the queries the layers' attention saw). Attention run on fewer rows (block-sparse,
    chunked, pooled) is not a different n."""
    n, batch = request.n, request.batch
    shape = token_shape(ran.target, ran.built.args, ran.built.kwargs)
    tokens = None if shape is None else shape[1]
    seen = _common_queries(ran.parts)
    if ran.built.given is None and tokens is not None and n is not None:
        return n, batch  # built for n
    measured = tokens if tokens is not None else seen
    if measured is None:
        if n is None:
            raise ProfileError("no attention ran, so n cannot be read from the inputs; pass n=")
        measured = n
    if measured == 0:
        raise ProfileError("the attention ran on 0 tokens (inputs trimmed to nothing?); "
                           "a profile of nothing cannot stand for the model: check the inputs")
    if n is not None and measured != n:
        raise ProfileError(f"n={n} was asked for, but the attention saw {measured} tokens; "
                           "drop n= to use the inputs' length, or make the inputs match")
    if seen == 0:
        raise ProfileError(f"n={measured} was asked for, but the attention ran on 0 tokens "
                           "(the model trims its inputs?); check the inputs")
    if ran.built.given is not None:
        batch = _held_batch(ran, request, shape, measured)
    return measured, batch


def second_length(ran: Ran, n: int, m: int | None) -> int | None:
    """m: the second sequence's length (an encoder-decoder's target, a decoder's memory, the keys of a
    cross-attention module), None for a model that reads one; *m*, if asked for, must be it.

    Raises:
        ProfileError: *m* was asked for and the inputs hold another length, or none.
    """
    target, args, kwargs, parts = ran.target, ran.built.args, ran.built.kwargs, ran.parts
    second: Any = None
    if isinstance(target, families.TWO_SEQUENCES):
        names = ("key", "memory", "tgt")
        second = args[1] if len(args) > 1 else next((kwargs[k] for k in names if k in kwargs), None)
        if isinstance(second, torch.Tensor) and second.dim() == 3:
            second = int(second.shape[1] if families.batch_first(target) else second.shape[0])
    elif isinstance(kwargs.get("decoder_input_ids"), torch.Tensor) and kwargs["decoder_input_ids"].dim() == 2:
        second = int(kwargs["decoder_input_ids"].shape[1])
    if not isinstance(second, int) and ran.spec is not None and ran.spec.cross_attention:
        second = next((keys for queries, keys, _ in parts.lengths if keys != n), n)  # what the memory was
    if not isinstance(second, int):  # cross-attention outside the layers (a Perceiver's latents read the inputs)
        second = next((keys for queries, keys, _ in parts.outside_lengths if queries == n and keys != n), None)
    found = second if isinstance(second, int) else None
    if m is not None and found != m:
        raise ProfileError(f"m={m} was asked for, but the inputs' second sequence is {found} tokens long; drop m= to "
                           "use the inputs' length, or make the inputs match" if found is not None else
                           ONE_SEQUENCE_READ.format(m=m, model=type(target).__name__))
    return found


ONE_SEQUENCE_READ = ("m={m} was asked for, but {model}'s inputs hold no second sequence it can be read from (an "
                     "encoder-decoder's decoder_input_ids, a decoder's memory); drop m=")


def folded_sequences(ran: Ran, batch: int) -> int | None:
    """The sequences the first attention ran, where they are a multiple of the batch (TimeSformer and other
    video models fold frames into their attention's batch); None for token-id models and one sequence
    per input."""
    spec, lengths = ran.spec, ran.parts.lengths
    shape = token_shape(ran.target, ran.built.args, ran.built.kwargs)
    if spec is None or not spec.heads or not lengths or shape is not None:
        return None
    sequences, rest = divmod(lengths[0][2], spec.heads)
    return sequences if not rest and sequences != batch and sequences % batch == 0 else None


def _held_batch(ran: Ran, request: Request, shape: tuple[int, int] | None, n: int | None = None) -> int:
    """With the user's inputs the batch is what they hold: the main input's first dimension, else the
    attention's leading dimensions [b, h, n, d] or [b*h, n, d] over the spec's heads, else the first
    dimension of the float inputs ``(b, n, ...)`` whose second is the n the attention saw."""
    args, kwargs, spec, parts = ran.built.args, ran.built.kwargs, ran.spec, ran.parts
    held = shape[0] if shape is not None else main_batch(ran.target, args, kwargs)
    if held is None and spec is not None and parts.lengths and parts.lengths[0][2] % spec.heads == 0:
        held = parts.lengths[0][2] // spec.heads
    if held is None and n is not None:
        firsts = {int(t.shape[0]) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                  and t.is_floating_point() and t.dim() >= 3 and t.shape[1] == n}
        if len(firsts) == 1 and (not parts.lengths or parts.lengths[0][2] % next(iter(firsts)) == 0):
            held = firsts.pop()
    if held is None:
        return request.batch
    if request.batch_given and held != request.batch:
        raise ProfileError(f"batch={request.batch} was asked for, but the inputs hold a batch of {held}")
    return held


def decode_lengths(ran: Ran, request: Request) -> tuple[int, int]:
    """A decode step's n (the cache's length, given) and batch, after checking that the step ran ``new_tokens``
    queries (the main input's token dimension, else the query length the layers' attention saw)."""
    n, new_tokens, parts = request.n, request.new_tokens, ran.parts
    shape = token_shape(ran.target, ran.built.args, ran.built.kwargs)
    queries = shape[1] if shape is not None else _common_queries(parts)
    if queries is not None and queries != new_tokens:
        raise ProfileError(f"a decode step of new_tokens={new_tokens} was asked for, but the step ran "
                           f"{queries} query tokens; make the inputs' new tokens match, or pass new_tokens={queries}")
    batch = _held_batch(ran, request, shape) if ran.built.given is not None else request.batch
    if n is None:  # pragma: no cover - profile() refuses a decode step without n
        raise ProfileError("mode='decode' needs n=")
    keys = {keys for _, keys, _ in parts.lengths}
    if n and keys and new_tokens and max(keys) <= new_tokens:
        raise ProfileError(NO_CACHE_SEEN.format(n=n, keys=max(keys), new_tokens=new_tokens))
    return n, batch


NO_CACHE_SEEN = ("a decode step against a cache of n={n} tokens was asked for, but the attention saw {keys} key(s), no "
                 "more than the step's own new_tokens={new_tokens}: the model never received the cache; pass it in "
                 "inputs= (a past_key_values= or a cache argument holding n tokens), or profile a prefill")


def _common_queries(parts: Split) -> int | None:
    """The query length most core groups of the layers saw (the first such on a tie)."""
    counts = collections.Counter(queries for queries, _, _ in parts.lengths)
    return counts.most_common(1)[0][0] if counts else None  # most_common keeps the first of a tie first


def token_shape(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[int, int] | None:
    """``(batch, n)`` of the main input without running the model: token ids (``main_input_name``, or the first
    integer tensor), or torch's Transformer modules' ``(batch, n, D)`` / ``(n, batch, D)``; else None."""
    main = kwargs.get(getattr(model, "main_input_name", "input_ids"))
    candidates = [main] if isinstance(main, torch.Tensor) else []
    candidates += [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    for tensor in candidates:
        if tensor.dim() == 2 and not tensor.is_floating_point() and tensor.dtype != torch.bool:
            return int(tensor.shape[0]), int(tensor.shape[1])
    if isinstance(model, families.TORCH_KINDS) and args and isinstance(args[0], torch.Tensor) and args[0].dim() == 3:
        first = args[0].shape
        return (int(first[0]), int(first[1])) if families.batch_first(model) else (int(first[1]), int(first[0]))
    return None


def main_batch(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    """The batch of a transformers model's main input (``pixel_values``, ``input_values``, ...): its
    first dimension, whatever the model folds into its attention's batch (TimeSformer: frames)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        return None
    name = getattr(model, "main_input_name", "input_ids")
    main = kwargs.get(name)
    if name not in kwargs and args and isinstance(args[0], torch.Tensor):
        main = args[0]  # passed by position
    return int(main.shape[0]) if isinstance(main, torch.Tensor) and main.dim() >= 2 else None


def _tensors_in(value: Any, found: dict[int, torch.Tensor], depth: int = 0, seen: set[int] | None = None) -> None:
    """Every tensor reachable from *value* through containers and object attributes (a cache's layers)."""
    seen = set() if seen is None else seen
    if depth > 8 or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        found[id(value)] = value
        return
    if isinstance(value, Mapping):
        items: Any = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    elif isinstance(value, (nn.Module, str, bytes, int, float, bool, type(None))) or not hasattr(value, "__dict__"):
        return
    else:
        items = vars(value).values()
    for item in items:
        _tensors_in(item, found, depth + 1, seen)


def fresh(args: tuple[Any, ...], kwargs: dict[str, Any], *, meta: bool = True) -> Call:
    """A copy of the step's inputs whose caches have not run yet: tensors on the meta device (or cloned). The
    forward appends to the cache: a second count (the fallback, a cross-check) must not see the first's keys."""
    return remade((args, kwargs), lambda tensor: torch.empty_like(tensor, device="meta") if meta else tensor.clone())[0]


def remade(call: Call, make: Callable[[torch.Tensor], Any]) -> tuple[Call, dict[int, Any]]:
    """A copy of the inputs, caches included, with every tensor replaced by ``make(tensor)``; and the made
    tensors by the id of the tensor each replaced (the memory estimate's fake and real copies)."""
    found: dict[int, torch.Tensor] = {}
    _tensors_in(call, found)
    made: dict[int, Any] = {key: make(tensor) for key, tensor in found.items()}
    return copy.deepcopy(call, dict(made)), made  # deepcopy adds to the memo it is given: a copy


def cache_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes of every tensor held by a cache object among the inputs (a ``Cache``'s layers, a custom cache's
    attributes, a ``past_key_values`` tuple), not the tensors passed directly (token ids, positions)."""
    held: dict[int, torch.Tensor] = {}
    for key, value in [*enumerate(args), *kwargs.items()]:
        if isinstance(value, torch.Tensor):
            continue
        if isinstance(value, (list, tuple, Mapping)) and key not in ("past_key_values", "cache"):
            continue
        layers = getattr(value, "layers", None)
        if isinstance(layers, list) and layers and all(hasattr(layer, "keys") for layer in layers):
            # a transformers Cache: its layers' keys and values (not the window-size scalars beside them)
            for layer in layers:
                _tensors_in([getattr(layer, "keys", None), getattr(layer, "values", None)], held)
        else:
            _tensors_in(value, held)
    # a view is counted as the tensor it shows: a sliding layer keeps a window-sized slice of a longer tensor
    return sum(t.numel() * t.element_size() for t in held.values() if t.dim() > 0)
