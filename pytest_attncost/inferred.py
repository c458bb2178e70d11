"""A :class:`~pytest_attncost.formulas.ModelSpec` read from the trace, for a model no config describes.

A hand-written Transformer (nanoGPT, a model of one's own) has no ``config`` to read its shape from,
yet its count holds every figure of one: the structure (:mod:`~pytest_attncost.roles`) found its
layers and each layer's attention call, and the products' shapes give the rest:

* **heads** ``h`` and **head size** ``d`` from the core's operands (``QKᵀ`` of ``[..., h, n, d]`` by
  ``[..., h, d, n]``, or a fused kernel's q, k, v); **K/V heads** ``g`` from the projections that feed
  the cores, whose outputs are ``hd + 2gd`` wide together (one fused QKV or three separate);
* **hidden size** ``D`` from the projections' inputs, **layers** ``L`` from the layers found;
* **FFN width** ``f`` and **gating** from the FFN's products: the one back to ``D`` reads ``f``; those
  from ``D`` write ``f`` (plain) or ``2f`` together (gated: gate and up, or one fused matrix).

The spec is inferred only where every layer shows the same figures and one self-attention call; the
profile's notes say it was inferred (:data:`INFERRED_NOTE`), and its deviation then says how far the
count is from the formula for that shape. Where the trace does not tell (cross-attention, experts,
low-rank projections, layers that differ), there is no spec, as before: pass ``spec=``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .flow import rows, width_of
from .formulas import ModelSpec
from .ops import OpRecord
from .roles import Structure

__all__ = ["INFERRED_NOTE", "NOT_INFERRED", "infer_spec", "is_inferred", "spec_keywords"]

NOT_INFERRED = ("no config describes the model, and its trace shows no one shape to read: {why}; "
                "pass spec=ModelSpec(...)")
INFERRED_NOTE = ("spec inferred from the trace (no config describes the model): {spec}; the formulas and the "
                 "deviation use it; pass spec=ModelSpec(...) to set it")


def is_inferred(notes: Sequence[str]) -> bool:
    """Whether a profile's spec was read from its trace (its notes say so)."""
    head = INFERRED_NOTE.split("{", 1)[0]
    return any(note.startswith(head) for note in notes)


def spec_keywords(spec: ModelSpec) -> str:
    """``ModelSpec(hidden=64, heads=4, ...)``: the spec as the keywords that make it (defaults left out)."""
    defaults = ModelSpec(1, 1, 1, 1, 0).to_dict()
    fields = {k: v for k, v in spec.to_dict().items() if k in ("hidden", "heads", "head_dim", "layers", "ffn_dim")
              or v != defaults[k]}
    return f"ModelSpec({', '.join(f'{k}={v!r}' for k, v in fields.items())})"


def _layer_figures(records: Sequence[OpRecord], structure: Structure, mine: list[int],
                   cores: tuple[int, ...]) -> tuple[int, ...] | str:
    """(hidden, heads, head_dim, kv_heads, ffn_dim, gated) of one layer (*mine*: its forward parameter products),
    or why the trace does not tell."""
    first = records[cores[0]]
    if len(first.shapes) < 2 or len(first.shapes[0]) < 3:
        return "its attention's operands show no heads"
    head_dim = first.shapes[0][-1]
    fused = "attention" in first.op  # q, k, v of a fused kernel
    queries, keys = (first.shapes[0][-2], first.shapes[1][-2]) if fused else first.out_shape[-2:]
    if queries != keys:
        return "not every query meets every key (windows, low-rank keys): not the formulas' core"
    heads = first.shapes[0][-3] if len(first.shapes[0]) >= 4 else None
    core_inputs = {s for c in cores for source in records[c].sources for s in source}
    entry = [i for i in mine if structure.parts[i] == "attention_proj" and i in core_inputs]
    ffn = [i for i in mine if structure.parts[i] == "ffn"]
    if not entry or not all(records[i].shapes and records[i].out_shape for i in entry + ffn):
        return "no projection feeds its cores"
    hidden = {width_of(records[i]) for i in entry}
    if len(hidden) != 1:
        return "its projections read inputs of different widths (low-rank or cross projections)"
    width = sum(records[i].out_shape[-1] for i in entry)
    if heads is None:
        heads = width // (3 * head_dim) if width % (3 * head_dim) == 0 else None
    if heads is None or fused and len(first.shapes) < 3:
        return "its projections' widths give no number of heads"
    if {rows(records[i]) for i in entry} != {math.prod(first.shapes[0][:-2]) // heads * queries}:
        return "its cores run over other rows than the tokens projected (a linear attention's d x d context)"
    rest = width - heads * head_dim
    if rest <= 0 or rest % (2 * head_dim):
        return "its projections' widths give no keys and values beside the queries"
    (model_width,) = hidden
    down = [i for i in ffn if records[i].out_shape[-1] == model_width and width_of(records[i]) != model_width]
    up = [i for i in ffn if width_of(records[i]) == model_width]
    if not ffn:
        return (model_width, heads, head_dim, rest // (2 * head_dim), 0, 0)
    if len(down) != 1 or len(up) + 1 != len(ffn):
        return "its FFN's products are not one back to the hidden size and the rest from it"
    ffn_dim = width_of(records[down[0]])
    wide = sum(records[i].out_shape[-1] for i in up)
    if wide not in (ffn_dim, 2 * ffn_dim):
        return "its FFN's widths are neither plain nor gated"
    return (model_width, heads, head_dim, rest // (2 * head_dim), ffn_dim, int(wide == 2 * ffn_dim))


def infer_spec(records: Sequence[OpRecord], structure: Structure) -> ModelSpec | str:
    """The spec every layer of the trace shows alike (one self-attention call each), or why there is none."""
    why = ("no repeated layers run attention" if not structure.layers else
           "attention runs outside the repeated layers" if structure.outside else
           "its layers hold experts" if structure.experts else
           "layers without attention run beside those with it" if structure.bare else
           "a product is split by its columns (Flux's proj_out, a fused Q/K/V and MLP input)"
           if structure.columns else None)
    if why is not None:
        return why
    calls = {}
    for module, cores in structure.groups:
        layer = structure.layer_of(module)
        if layer is None or layer in calls:
            return "a layer runs two attention calls (cross-attention)"
        calls[layer] = cores
    if set(calls) != set(structure.layers):
        return "a layer runs no attention call"
    mine: dict[str | None, list[int]] = {}  # per layer, its forward parameter products (one pass over the records)
    for i, record in enumerate(records):
        if record.origin == "param" and record.backward_of is None:
            mine.setdefault(structure.layer_of(record.scope), []).append(i)
    figures = [_layer_figures(records, structure, mine.get(layer, []), cores) for layer, cores in calls.items()]
    untold = next((f for f in figures if isinstance(f, str)), None)
    if untold is not None:
        return untold
    if len(set(figures)) != 1:
        return "its layers differ in shape"
    found = figures[0]
    assert not isinstance(found, str)
    hidden, heads, head_dim, kv_heads, ffn_dim, gated = found
    return ModelSpec(hidden=hidden, heads=heads, head_dim=head_dim, layers=len(structure.layers), ffn_dim=ffn_dim,
                     kv_heads=None if kv_heads == heads else kv_heads, gated=bool(gated))
