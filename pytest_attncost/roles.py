"""Split counted ops into attention_core, attention_proj, ffn and other.

By module scope first, then by operand:

* a fused attention op (``scaled_dot_product_attention`` and its kernels) is
  ``attention_core`` wherever it runs;
* a matrix product inside an attention module is ``attention_proj`` when an
  operand is a parameter (``x @ W``), ``other`` when it is a buffer (rotary
  tables), and ``attention_core`` when both operands are activations (QK^T, AV);
* a matrix product inside an FFN module is ``ffn``;
* everything else — norms, embeddings, poolers, heads, products outside the
  layers — is ``other``.

Attention and FFN modules are found by class for the transformers families and
torch's Transformer modules, or named by the user with
``roles={"attention": [globs], "ffn": [globs]}`` (fnmatch over dotted module names).
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .counting import ATTENTION_OPS, CONTRACTING_OPS, TORCH_ATTENTION_OPS, OpRecord

__all__ = ["ROLE_NAMES", "RoleError", "Split", "auto_roles", "explicit_roles", "split"]

ROLE_NAMES = ("attention", "ffn")

ROLES_HINT = (
    "pass roles={'attention': ['layers.*.attn'], 'ffn': ['layers.*.mlp']} "
    "with fnmatch globs over the module names"
)

_ATTENTION_CLASS = re.compile(r"Attention")
_FFN_CLASS = re.compile(r"(MLP|FeedForward|FFN|Intermediate|LayerFF|DenseActDense|DenseGatedActDense)$", re.IGNORECASE)
_TORCH_LAYERS = ("TransformerEncoderLayer", "TransformerDecoderLayer")


# torch's dispatcher names for products fvcore's table spells differently
_TORCH_PRODUCTS = frozenset({"aten::convolution", "aten::convolution_backward", "aten::_slow_conv2d_forward",
                             "aten::cudnn_convolution", "aten::convolution_overrideable", "aten::_scaled_mm"})


class RoleError(ValueError):
    """Roles could not be assigned; the message says how to pass ``roles=``."""


@dataclass
class Split:
    """Counted MACs by role, plus what the attention saw."""

    attention_core: int = 0
    attention_proj: int = 0
    ffn: int = 0
    other: int = 0
    attention_modules: list[str] = field(default_factory=list)
    # (queries, keys, batch x heads) per core op, in graph order
    lengths: list[tuple[int, int, int]] = field(default_factory=list)
    halved: bool = False  # causal self-attention was counted as a half triangle


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def auto_roles(classes: Mapping[str, str]) -> dict[str, str]:
    """Roles of modules found by class name; descendants inherit (see :func:`role_of`)."""
    roles: dict[str, str] = {}
    children: dict[str, list[str]] = {}
    for name in classes:
        if name:
            children.setdefault(_parent(name), []).append(name)
    for name, cls in classes.items():
        if name == "":
            continue
        parent_cls = classes.get(_parent(name), "")
        if _ATTENTION_CLASS.search(cls):
            roles[name] = "attention"
        elif _FFN_CLASS.search(cls):
            roles[name] = "ffn"
        elif parent_cls in _TORCH_LAYERS and name.rsplit(".", 1)[-1] in ("linear1", "linear2"):
            roles[name] = "ffn"
        elif cls.endswith("Output") and any(
            _FFN_CLASS.search(classes[s]) and "Intermediate" in classes[s] for s in children.get(_parent(name), [])
        ):
            roles[name] = "ffn"  # BERT/ViT layout: layer.intermediate + layer.output form the FFN
    # The root itself is a role only when nothing inside it is (a bare nn.MultiheadAttention);
    # otherwise a model class named "...Attention..." would swallow its own FFN.
    root = classes.get("", "")
    if not roles and _ATTENTION_CLASS.search(root):
        roles[""] = "attention"
    return roles


def explicit_roles(roles: Mapping[str, Iterable[str]], names: Sequence[str]) -> dict[str, str]:
    """Roles from the user's globs. Every glob must match at least one module."""
    if not isinstance(roles, Mapping):
        raise RoleError(f"roles must be a dict such as {{'attention': [...], 'ffn': [...]}}, got {roles!r}")
    unknown = sorted(set(roles) - set(ROLE_NAMES))
    if unknown:
        raise RoleError(f"unknown role {unknown[0]!r} in roles=; valid roles: {', '.join(ROLE_NAMES)}")
    assigned: dict[str, str] = {}
    for role in ROLE_NAMES:
        globs = roles.get(role, [])
        if isinstance(globs, str):
            globs = [globs]
        for glob in globs:
            if not isinstance(glob, str):
                raise RoleError(f"roles[{role!r}] must hold strings (module-name globs), got {glob!r}")
            matched = [name for name in names if fnmatch.fnmatchcase(name, glob)]
            if not matched:
                shown = ", ".join(repr(n) for n in names if n)[:400] or "(none)"
                raise RoleError(f"roles[{role!r}] glob {glob!r} matches no module; module names are: {shown}")
            for name in matched:
                assigned.setdefault(name, role)
    return assigned


def role_of(scope: str, roles: Mapping[str, str]) -> str | None:
    """The role of the nearest enclosing module that has one."""
    name = scope
    while True:
        role = roles.get(name)
        if role is not None:
            return role
        if name == "":
            return None
        name = _parent(name)


def _lengths(group: list[OpRecord]) -> tuple[int, int, int] | None:
    """(queries, keys, batch x heads) seen by one attention module's core ops.

    The last core product's output is ``[.., n, d]`` for softmax attention (AV),
    linear attention (Q (K^T V)) and fused attention alike; the keys are sdpa's
    ``k`` length, or the columns of the first product's output (QK^T: ``[.., n, m]``).
    """
    first, last = group[0], group[-1]
    if len(last.out_shape) < 2:
        return None
    queries, leading = last.out_shape[-2], math.prod(last.out_shape[:-2])
    if first.op in ATTENTION_OPS and len(first.shapes) >= 2 and len(first.shapes[1]) >= 2:
        keys = first.shapes[1][-2]
    elif len(first.out_shape) >= 2:
        keys = first.out_shape[-1]
    else:
        keys = queries
    return queries, keys, leading


def _causal(scope: str, causal_modules: frozenset[str]) -> bool:
    name = scope
    while True:
        if name in causal_modules:
            return True
        if name == "":
            return False
        name = _parent(name)


def _half(record: OpRecord) -> int:
    """The MACs of the n(n+1)/2 query-key pairs a causal mask keeps, for a self-attention core op."""
    if len(record.shapes) < 2 or any(len(s) < 2 for s in record.shapes[:2]):
        return record.macs
    first, second = record.shapes[0], record.shapes[1]
    n = first[-2]
    if record.op in ATTENTION_OPS:
        self_attention = second[-2] == n
    else:  # QK^T: [n, d] @ [d, n]; AV and the backward products: [n, n] @ [n, d]
        self_attention = second[-1] == n or first[-1] == n
    if not self_attention or record.macs % (n * n):
        return record.macs
    # every product over the n x n pairs is MACs = B * n * n * k; keep B * k * n(n+1)/2
    return record.macs // n * (n + 1) // 2


def split(
    records: Iterable[OpRecord], roles: Mapping[str, str], causal_modules: frozenset[str] = frozenset()
) -> Split:
    """Sum the records by role; core ops of the *causal_modules* count the half triangle."""
    result = Split()
    seen_modules: dict[str, None] = {}
    groups: list[tuple[str, list[OpRecord]]] = []
    for record in records:
        role = role_of(record.scope, roles)
        if record.op in ATTENTION_OPS or record.op in TORCH_ATTENTION_OPS:
            bucket = "attention_core"
        elif record.op in CONTRACTING_OPS or record.op in _TORCH_PRODUCTS:
            if role == "attention":
                bucket = {"param": "attention_proj", "buffer": "other"}.get(record.origin, "attention_core")
            elif role == "ffn":
                bucket = "ffn"
            else:
                bucket = "other"
        else:
            bucket = "other"
        macs = record.macs
        if bucket == "attention_core" and causal_modules and _causal(record.scope, causal_modules):
            halved = _half(record)
            if halved != macs:
                result.halved = True
            macs = halved
        setattr(result, bucket, getattr(result, bucket) + macs)
        root = _attention_root(record.scope, roles) if role == "attention" else record.scope
        if role == "attention":
            seen_modules.setdefault(root, None)
        if bucket == "attention_core":
            # consecutive core ops of one module call form a group (QK^T then AV)
            if groups and groups[-1][0] == root and record.op not in ATTENTION_OPS:
                groups[-1][1].append(record)
            else:
                groups.append((root, [record]))
    result.attention_modules = list(seen_modules)
    for _, group in groups:
        lengths = _lengths(group)
        if lengths is not None:
            result.lengths.append(lengths)
    return result


def _attention_root(scope: str, roles: Mapping[str, str]) -> str:
    """The outermost attention module enclosing *scope*."""
    found = scope
    name = scope
    while True:
        if roles.get(name) == "attention":
            found = name
        if name == "":
            return found
        name = _parent(name)
