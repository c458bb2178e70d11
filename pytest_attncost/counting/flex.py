"""FlexAttention counted: stand-ins for ``flex_attention`` and ``create_block_mask`` while a count runs.

``torch.nn.attention.flex_attention`` refuses meta and fake tensors, the jit tracer cannot follow its
compiled kernel (nor ``create_block_mask``), and FlopCounterMode cannot run it eagerly on CPU. While a
count runs (:func:`standing_in`), every binding of the two functions that Python code reaches (module
globals, a ``torch.compile`` wrapper of them, the model's class and instance attributes, transformers'
``compile_friendly_flex_attention``) is a stand-in, and everything is put back afterwards:

* ``create_block_mask`` makes a :class:`StandInMask`: a ``BlockMask`` that holds the ``mask_mod`` and
  the sizes it was made for, and no tensors;
* ``flex_attention`` runs ``scaled_dot_product_attention`` on the same q, k, v (grouped-query heads
  included): the op both backends count as a fused attention core, ``B·Hq·L·S·(E+Ev)`` MAC, every
  query-key pair (what eager flex materialises and FlopCounterMode counts; a compiled kernel skips the
  mask's empty 128×128 blocks). A ``score_mod`` changes no MAC count.

Under ``causal="half"`` or ``"kept"`` the mask is evaluated: ``mask_mod`` is evaluated on real CPU index
tensors, a block of query rows at a time (memory stays bounded at long n), outside the tracer and the
fake-tensor mode, giving the positions it keeps of all it spans, per batch and head
(:attr:`~pytest_attncost.ops.OpRecord.keeps`). A mask that is exactly causal makes the core
``is_causal``; one that reads tensors without values (document ids made on the meta device) cannot be
evaluated: its core's mask is unknown, and a warning names the module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)

__all__ = ["FLEX_NOTES", "UNREAD_WARNING", "Keeps", "StandInMask", "into_records", "mask_keeps", "new_trace",
           "standing_in", "traced_keeps", "unread"]

Keeps = tuple[int, int]  # (kept, all): the (batch, head, query, key) positions a mask keeps of all it spans

#: Query rows x keys (x batch x heads) evaluated at once: 2**22 booleans, a few MiB.
_BLOCK = 1 << 22

#: How FlexAttention was counted, by causal accounting (the profile's note).
FLEX_NOTES = {
    "full": "FlexAttention counted as the dense n×m, every query-key pair (as eager flex_attention runs it and "
            "FlopCounterMode counts it; a compiled kernel skips its BlockMask's empty 128×128 blocks); causal='kept' "
            "counts the pairs its mask_mod keeps",
    "half": "FlexAttention counted as the dense n×m, halved where its mask_mod is exactly causal",
    "kept": "FlexAttention counted over the query-key pairs its mask_mod keeps, evaluated on index tensors per batch "
            "entry and head (the dense n×m under causal='full')",
}
UNREAD_WARNING = ("FlexAttention in {where}: its mask_mod could not be evaluated ({why}), so the query-key pairs it "
                  "keeps are unknown and its core is counted as a mask of unknown form; a mask that reads data "
                  "(document ids, padding) needs those tensors with values: build the BlockMask outside the model "
                  "from CPU tensors and pass it in")


def _flex_module() -> Any:
    return sys.modules.get("torch.nn.attention.flex_attention")


@dataclass
class _Session:
    """What one count's stand-ins share."""

    causal: str  # the causal accounting: masks are evaluated unless "full"
    inputs: Callable[[], Any]  # the user's own inputs, with their values (None for default inputs)
    calls: int = 0
    unread: dict[str, str] = field(default_factory=dict)  # module -> why its mask could not be evaluated
    traced: list[Keeps | None] = field(default_factory=list)  # jit: each core's keeps, in the order they ran
    records: list[Any] | None = None  # torch backend: the recorder's records
    memo: dict[Any, tuple[Keeps, bool] | str] = field(default_factory=dict)  # (id of mask_mod, sizes) -> keeps
    held: list[Any] = field(default_factory=list)  # the mask_mods memoised: alive, so that no other reuses an id


_SESSION: ContextVar[_Session | None] = ContextVar("attncost_flex", default=None)


class StandInMask:
    """Stands for a ``BlockMask`` while counting (a subclass of it is made once torch's is importable)."""


@functools.cache
def _stand_in_mask_type() -> type:
    from torch.nn.attention.flex_attention import BlockMask

    class _StandInMask(BlockMask, StandInMask):  # type: ignore[misc]
        """A BlockMask made by the stand-in create_block_mask: its mask_mod and sizes, no tensors."""

        def __init__(self, mask_mod: Callable[..., Any], shape: tuple[int, int, int, int],
                     block_size: Any = 128) -> None:  # noqa: D107 - BlockMask's tensors are not made
            self.mask_mod, self.batch, self.heads, self.seq_lengths = mask_mod, shape[0], shape[1], shape[2:]
            self.BLOCK_SIZE = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)

        @property
        def shape(self) -> tuple[int, ...]:
            return (self.batch, self.heads, *self.seq_lengths)

        def _adjust(self, new_q_len: int, new_kv_len: int) -> Any:
            return type(self)(self.mask_mod, (self.batch, self.heads, new_q_len, new_kv_len), self.BLOCK_SIZE)

        def to(self, device: Any) -> Any:
            return self

        def __repr__(self) -> str:
            return f"StandInMask(shape={self.shape})"

    return _StandInMask


def _create_block_mask(mask_mod: Callable[..., Any], B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,  # noqa: N803
                       device: Any = None, BLOCK_SIZE: Any = 128, *args: Any, **kwargs: Any) -> Any:
    return _stand_in_mask_type()(mask_mod, (B or 1, H or 1, Q_LEN, KV_LEN), BLOCK_SIZE)


def _sizes(block_mask: Any) -> tuple[int, int, int, int]:
    """(batch, heads, queries, keys) a BlockMask was made for."""
    if isinstance(block_mask, StandInMask):
        batch, heads, q_len, kv_len = block_mask.shape  # type: ignore[attr-defined]
    else:
        batch, heads = block_mask.kv_num_blocks.shape[:2]
        q_len, kv_len = block_mask.seq_lengths
    return int(batch), int(heads), int(q_len), int(kv_len)  # the tracer hands sizes as 0-d tensors


def _real(value: Any) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(value, torch.Tensor) and not value.is_meta and not is_fake(value)


@contextlib.contextmanager
def _outside_the_count() -> Iterator[None]:
    """No tracer, no dispatch mode: the mask is evaluated on real tensors, and nothing of it is counted."""
    from torch.utils._python_dispatch import _disable_current_modes

    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)  # type: ignore[attr-defined]  # in torch._C, not in its stubs
    try:
        with _disable_current_modes(), torch.no_grad():
            yield
    finally:
        torch._C._set_tracing_state(state)  # type: ignore[attr-defined]


def mask_keeps(mask_mod: Callable[..., Any], batch: int, heads: int, q_len: int, kv_len: int) -> tuple[Keeps, bool]:
    """``((kept, all), causal)``: the positions *mask_mod* keeps over a ``(batch, heads, q_len, kv_len)`` grid, and
    whether it is exactly the causal mask (query i sees keys j <= i), evaluated as flex_attention's ``create_mask``
    does (vmapped over batch, head, query and key), a block of query rows at a time.

    Raises:
        whatever *mask_mod* raises; ValueError where it gives no real boolean tensor (it reads meta or fake tensors).
    """
    from torch.nn.attention.flex_attention import create_mask

    why = _without_values(mask_mod)
    if why is not None:
        raise ValueError(why)
    rows = max(1, _BLOCK // max(1, batch * heads * kv_len))
    kept, causal = 0, q_len == kv_len
    keys = torch.arange(kv_len)
    for start in range(0, q_len, rows):
        count = min(rows, q_len - start)

        def shifted(b: Any, h: Any, q: Any, k: Any, start: int = start) -> Any:
            return mask_mod(b, h, q + start, k)

        block = create_mask(shifted, batch, heads, count, kv_len, device="cpu")
        if not _real(block):
            raise ValueError("it gives no tensor with values")
        block = block.to(torch.bool)
        kept += int(block.sum())
        if causal:
            queries = torch.arange(start, start + count).unsqueeze(-1)
            causal = bool(torch.equal(block, (keys <= queries).expand_as(block)))
    return (kept, batch * heads * q_len * kv_len), causal


def _captured(fn: Any, depth: int = 0) -> Iterator[Any]:
    """What a mask function closes over (a partial's arguments too), nested functions' captures included."""
    if depth > 8:
        return
    if isinstance(fn, functools.partial):
        values: list[Any] = [fn.func, *fn.args, *fn.keywords.values()]
    else:
        values = []
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                values.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
    for value in values:
        for item in value if isinstance(value, (tuple, list)) else (value,):
            yield item
            if callable(item) and not isinstance(item, (torch.Tensor, type)):
                yield from _captured(item, depth + 1)


def _code(fn: Any) -> Any:
    """What identifies a mask function whatever tensors it captures: its code, and that of the functions it closes
    over (or_masks, and_masks, transformers' offsets)."""
    inner = [item for item in _captured(fn) if callable(item) and not isinstance(item, (torch.Tensor, type))]
    return (getattr(getattr(fn, "func", fn), "__code__", None), tuple(getattr(i, "__code__", None) for i in inner))


def _without_values(fn: Any) -> str | None:
    """The first tensor *fn* captures that holds no values (meta or fake), described; None if none does."""
    for item in _captured(fn):
        if isinstance(item, torch.Tensor) and not _real(item):
            return f"it reads a tensor of shape {tuple(item.shape)} that holds no values (meta or fake)"
    return None


def _given_masks(given: Any) -> list[Any]:
    """The BlockMasks among the user's inputs."""
    from torch.nn.attention.flex_attention import BlockMask

    return [leaf for leaf in pytree.tree_leaves(given, is_leaf=lambda x: isinstance(x, BlockMask))
            if isinstance(leaf, BlockMask)]


def _evaluated(mask_mod: Callable[..., Any], sizes: tuple[int, int, int, int]) -> tuple[Keeps, bool] | str:
    try:
        with _outside_the_count():
            return mask_keeps(mask_mod, *sizes)
    except Exception as exc:  # noqa: BLE001 - the user's mask_mod: its failure is the reason given
        return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"[:200]


def _keeps(session: _Session, block_mask: Any) -> tuple[Keeps, bool] | str:
    """What *block_mask* keeps, or why it could not be evaluated."""
    sizes, mask_mod = _sizes(block_mask), block_mask.mask_mod
    key = (id(mask_mod), sizes)
    if key not in session.memo:
        session.held.append(mask_mod)
        found = _evaluated(mask_mod, sizes)
        if isinstance(found, str):  # the user's own BlockMask, as given (its tensors were converted for the count)
            same = [given for given in _given_masks(session.inputs())
                    if _sizes(given) == sizes and _code(given.mask_mod) == _code(mask_mod)]
            found = _evaluated(same[0].mask_mod, sizes) if len(same) == 1 else found
        session.memo[key] = found
    return session.memo[key]


def _flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Any = None,
                    block_mask: Any = None, scale: float | None = None, enable_gqa: bool = False,
                    return_lse: bool = False, kernel_options: Any = None, *, return_aux: Any = None) -> Any:
    """The stand-in: the fused attention core both backends count, on the same shapes (score_mod adds no MAC)."""
    session = _SESSION.get()
    if session is not None:
        session.calls += 1
    found: tuple[Keeps, bool] | None = None
    unread = None
    if session is not None and session.causal != "full":
        read = ((1, 1), False) if block_mask is None else _keeps(session, block_mask)  # no mask: every pair
        found, unread = (None, read) if isinstance(read, str) else (read, None)
    causal = found is not None and found[1] and query.shape[-2] == key.shape[-2]
    mask = None
    if unread or found is not None and not causal and found[0][0] != found[0][1]:
        # neither causal nor every pair: a mask of unknown form, as both backends read one (its keeps, if read, say)
        mask = torch.ones(query.shape[-2], key.shape[-2], device=query.device).ge(0)
    start = len(session.records) if session is not None and session.records is not None else 0
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal,
                                                           scale=scale, enable_gqa=enable_gqa)
    if session is not None:
        _mark(session, start, found[0] if found is not None else None)
    if session is not None and unread is not None:
        session.unread.setdefault(_scope(session, start), unread)
    if return_lse or return_aux is not None:
        lse = query.new_empty(query.shape[:-1], dtype=torch.float32)
        if return_aux is None:
            return out, lse
        from torch.nn.attention.flex_attention import AuxOutput

        return out, AuxOutput(lse=lse if getattr(return_aux, "lse", False) else None,
                              max_scores=lse if getattr(return_aux, "max_scores", False) else None)
    return out


def _mark(session: _Session, start: int, keeps: Keeps | None) -> None:
    """Tie *keeps* to the records of the core just run: the torch backend's (made since *start*); under the jit
    tracer, the next in the list the fvcore handles read after the trace (:func:`traced_keeps`)."""
    if session.records is not None:
        for index in range(start, len(session.records)):
            if keeps is not None and session.records[index].backward_of is None:
                session.records[index] = dataclasses.replace(session.records[index], keeps=keeps)
    elif torch._C._get_tracing_state() is not None:
        session.traced.append(keeps)


def _scope(session: _Session, start: int) -> str:
    """The module that ran the core just made (the torch backend's records; the tracer's scope)."""
    if session.records is not None:
        return str(session.records[start].scope) if start < len(session.records) else ""
    state = torch._C._get_tracing_state()
    name = state.current_scope().split("/")[-1] if state is not None else ""
    return "" if name == "model" else name.removeprefix("model.")


def _compile_friendly(query: Any, key: Any, value: Any, training: bool = False, **kwargs: Any) -> Any:
    """transformers' ``compile_friendly_flex_attention`` (its signature): the stand-in, uncompiled."""
    return _flex_attention(query, key, value, **kwargs)


#: The file of the stand-in: a traced fused attention node whose innermost frame is here is a FlexAttention core.
_HERE = __file__.replace("\\", "/").rsplit("/", 2)[-2:]


def new_trace() -> None:
    """A trace starts: the cores it runs are listed afresh (a trace tried again lists them again)."""
    session = _SESSION.get()
    if session is not None:
        session.traced.clear()


def traced_keeps(source: str) -> Keeps | None:
    """What the mask of the next FlexAttention core of the trace keeps, for a fused attention node whose source
    range is *source* (None: not a FlexAttention core, or its mask unread). The fvcore handles run in graph order,
    which is the order the stand-in ran."""
    session = _SESSION.get()
    innermost = source.replace("\\", "/").split("\n")[0]
    if session is None or "/".join(_HERE) not in innermost or not session.traced:
        return None
    return session.traced.pop(0)


@contextlib.contextmanager
def into_records(records: list[Any]) -> Iterator[None]:
    """The torch backend's records, where the stand-in ties each core's keeps to its records."""
    session = _SESSION.get()
    if session is None:
        yield
        return
    before = session.records
    session.records = records
    try:
        yield
    finally:
        session.records = before


_SEEN: dict[str, int] = {}  # module name -> id of the module object scanned
_BOUND: dict[str, list[str]] = {}  # module name -> the globals that held a flex function when scanned (only those)


def _originals() -> dict[int, Callable[..., Any]]:
    flex = _flex_module()
    return {id(flex.flex_attention): _flex_attention, id(flex.create_block_mask): _create_block_mask}


def _replacement(value: Any, originals: dict[int, Callable[..., Any]]) -> Callable[..., Any] | None:
    """The stand-in for *value*: one of the two functions, or a ``torch.compile`` wrapper of one."""
    if id(value) in originals:
        return originals[id(value)]
    if isinstance(value, types.FunctionType):
        wrapped = value.__dict__.get("_torchdynamo_orig_callable")
        if wrapped is not None and id(wrapped) in originals:
            return originals[id(wrapped)]
    return None


def _scan(originals: dict[int, Callable[..., Any]]) -> None:
    """Scan the modules imported since the last count for globals holding a flex function."""
    new = [(name, module) for name, module in list(sys.modules.items()) if _SEEN.get(name) != id(module)]
    for name, module in new:
        _SEEN[name] = id(module)
        namespace = getattr(module, "__dict__", None)
        keys = [] if not isinstance(namespace, dict) else [
            k for k, v in list(namespace.items()) if _replacement(v, originals) is not None]
        if keys:
            _BOUND[name] = keys
        else:
            _BOUND.pop(name, None)


def _module_bindings(originals: dict[int, Callable[..., Any]]) -> list[tuple[dict[str, Any], str, Any]]:
    """The module globals that hold a flex function (modules scanned once; those that held one, each time)."""
    with warnings.catch_warnings():  # a deprecated global warns when looked at (torch.distributed.reduce_op)
        warnings.simplefilter("ignore")
        _scan(originals)
    found = []
    for name, keys in _BOUND.items():
        namespace = getattr(sys.modules.get(name), "__dict__", None)
        if isinstance(namespace, dict):
            found += [(namespace, key, namespace[key]) for key in keys
                      if key in namespace and _replacement(namespace[key], originals) is not None]
    return found


def _swap(namespace: dict[str, Any], originals: dict[int, Callable[..., Any]], undo: list[Callable[[], None]],
          keys: Any = None) -> None:
    """Every flex function held in *namespace* (a module's globals, an instance's attributes) is its stand-in."""
    for key in list(namespace) if keys is None else keys:
        value = namespace.get(key)
        replacement = _replacement(value, originals)
        if replacement is not None:
            namespace[key] = replacement
            undo.append(functools.partial(namespace.__setitem__, key, value))


@contextlib.contextmanager
def _substituted(model: nn.Module) -> Iterator[None]:
    """Every binding of the two functions a forward reaches is the stand-in; all put back afterwards: module globals
    (those the model's own methods read too: exec'd code, a notebook's cell), the model's class and instance
    attributes, and transformers' compiled entry point."""
    originals = _originals()
    undo: list[Callable[[], None]] = []
    try:
        for namespace, key, _ in _module_bindings(originals):
            _swap(namespace, originals, undo, [key])
        classes = {klass for module in model.modules() for klass in type(module).__mro__[:-1]}
        spaces = {id(fn.__globals__): fn.__globals__ for klass in classes for fn in vars(klass).values()
                  if isinstance(fn, types.FunctionType)}
        for namespace in spaces.values():
            _swap(namespace, originals, undo)
        for module in model.modules():
            _swap(vars(module), originals, undo)
        for klass in classes:
            for key, value in list(vars(klass).items()):
                replacement = _replacement(value, originals)
                if replacement is not None:
                    setattr(klass, key, staticmethod(replacement))
                    undo.append(functools.partial(setattr, klass, key, value))
        helpers = getattr(sys.modules.get("transformers.integrations.flex_attention"), "__dict__", {})
        if "compile_friendly_flex_attention" in helpers:
            undo.append(functools.partial(helpers.__setitem__, "compile_friendly_flex_attention",
                                          helpers["compile_friendly_flex_attention"]))
            helpers["compile_friendly_flex_attention"] = _compile_friendly
        yield
    finally:
        for step in reversed(undo):
            step()


@contextlib.contextmanager
def standing_in(model: nn.Module, causal: str, given: Callable[[], Any] = lambda: None) -> Iterator[_Session | None]:
    """The stand-ins for one count of *model* (a twin): masks read unless *causal* is ``"full"``; *given* gives the
    user's own inputs (called only where a mask cannot be evaluated: their BlockMasks hold the values a converted
    copy lost). Yields None where torch has no FlexAttention loaded (nothing to stand in for)."""
    if _flex_module() is None or not hasattr(_flex_module(), "flex_attention"):
        yield None
        return
    session = _Session(causal=causal, inputs=given)
    token = _SESSION.set(session)
    try:
        with _substituted(model):
            yield session
    finally:
        _SESSION.reset(token)


def unread(session: _Session) -> tuple[tuple[str, str], ...]:
    """(module, warning) for each module whose FlexAttention mask could not be evaluated."""
    return tuple((scope, UNREAD_WARNING.format(where=scope or "the model", why=why))
                 for scope, why in session.unread.items())

