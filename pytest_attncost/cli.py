"""``python -m pytest_attncost``: the article's cost table for any shape, and two subcommands.

* ``python -m pytest_attncost --preset bert-base``: per-layer costs by the formulas of Su Jianlin,
  "Linear attention is probably not the model you are waiting for" (PaperWeekly / kexue.fm, 2021);
  no model needed.
* ``python -m pytest_attncost compare A.json B.json``: part-by-part differences of two JSON reports
  or baselines; exit 1 when a part grew beyond ``--max-increase``.
* ``python -m pytest_attncost profile MODULE:FACTORY --n 512 2048``: count a model of your own.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import importlib.util
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any, cast

from . import baseline, conventions, footprint, formulas, reporting
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)
from .formulas import ModelSpec
from .markers import GATED_PARTS
from .request import BACKENDS, COMPONENTS
from .series import as_float
from .units import format_bytes
from .units import table as text_table

__all__ = ["ARTICLE", "KV_DTYPES", "PRESETS", "SUBCOMMANDS", "compare_files", "decode_table", "load_factory", "main"]

#: The article whose cost model the formulas restate.
ARTICLE = ('Su Jianlin, "Linear attention is probably not the model you are waiting for" '
           "(PaperWeekly / kexue.fm, 2021)")

#: The subcommands, dispatched on the first argument; anything else is the formula table.
SUBCOMMANDS = ("compare", "profile")

#: Bytes per element of a KV cache.
KV_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "int8": 1}

#: Common shapes: (hidden, heads, head_dim, layers, ffn, kv_heads, gated)
PRESETS: dict[str, ModelSpec] = {
    "bert-base": ModelSpec(768, 12, 64, 12, 3072),
    "bert-large": ModelSpec(1024, 16, 64, 24, 4096),
    "gpt2": ModelSpec(768, 12, 64, 12, 3072),
    "gpt2-xl": ModelSpec(1600, 25, 64, 48, 6400),
    "t5-base": ModelSpec(768, 12, 64, 12, 3072),
    "llama-2-7b": ModelSpec(4096, 32, 128, 32, 11008, gated=True),
    "llama-2-13b": ModelSpec(5120, 40, 128, 40, 13824, gated=True),
    "llama-3-8b": ModelSpec(4096, 32, 128, 32, 14336, kv_heads=8, gated=True),
    "mistral-7b": ModelSpec(4096, 32, 128, 32, 14336, kv_heads=8, gated=True),
    "mixtral-8x7b": ModelSpec(4096, 32, 128, 32, 14336, kv_heads=8, gated=True, experts=8, top_k=2,
                              expert_ffn_dim=14336),
}


#: Shapes past this are no model anyone runs, and their costs overflow floating-point shares.
LARGEST = 2**48


def _integer(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    if value > LARGEST:
        raise argparse.ArgumentTypeError(f"{len(str(value))}-digit value: sizes above 2**48 describe no model; "
                                         "give a smaller one")
    return value


_positive = functools.partial(_integer, least=1, what="a positive integer")
_non_negative = functools.partial(_integer, least=0, what="an integer >= 0")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_attncost",
        description=f"Per-layer Transformer costs (MACs) by the formulas of {ARTICLE}: attention core 2n²hd, "
        "projections 4n(hd)², FFN 8n(hd)², generalised to GQA, gated FFNs and mixtures of experts. "
        "The subcommands compare two JSON reports and profile a model of your own.",
    )
    commands = parser.add_subparsers(title="subcommands (first argument)", dest="command",
                                     metavar="{compare,profile}")
    _compare_arguments(commands.add_parser("compare", help=_COMPARE_HELP, description=_COMPARE_HELP))
    _profile_arguments(commands.add_parser("profile", help=_PROFILE_HELP, description=_PROFILE_HELP))
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a common shape (other options override it)")
    parser.add_argument("--hidden", type=_positive, help="hidden size D")
    parser.add_argument("--heads", type=_positive, help="query heads h")
    parser.add_argument("--head-dim", type=_positive, help="head size d (default D / h)")
    parser.add_argument("--ffn", type=_non_negative, help="FFN width f (default 4D)")
    parser.add_argument("--kv-heads", type=_positive, help="key/value heads g (grouped-query attention)")
    parser.add_argument("--gated", action="store_true", default=None, help="gated FFN (SwiGLU/GeGLU, 3 matrices)")
    parser.add_argument("--layers", type=_positive, help="layers, for whole-model totals (default 12)")
    parser.add_argument("--experts", type=_non_negative,
                        help="routed experts E of a mixture-of-experts FFN (0: dense); the FFN counted is the "
                             "active one")
    parser.add_argument("--top-k", type=_positive, help="experts each token runs through (with --experts)")
    parser.add_argument("--expert-ffn", type=_positive, help="one expert's FFN width (default: --ffn)")
    parser.add_argument("--shared-ffn", type=_non_negative, help="width of the shared experts (default 0)")
    parser.add_argument("--n", type=_positive, nargs="+", action="extend", metavar="N",
                        help="lengths: --n 512 1024, or --n 512 --n 1024 (default 128, 512 and both thresholds)")
    parser.add_argument("--batch", type=_positive, default=1, help="batch size (default 1)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    published = parser.add_argument_group("published FLOP conventions")
    published.add_argument("--conventions", action="store_true",
                           help="also print each length in PaLM's, Megatron-LM's, Kaplan's, Chinchilla's and Hugging "
                                "Face's conventions, with the terms each differs by from the exact count")
    published.add_argument("--vocab", type=_non_negative, default=0,
                           help="the output head's vocabulary, for the conventions that count it (default 0: none)")
    published.add_argument("--causal", action="store_true",
                           help="causal self-attention: the conventions that halve it do")
    decode = parser.add_argument_group("decode (generation against a KV cache)")
    decode.add_argument("--decode", action="store_true",
                        help="also print the decode table: per new token, the core against a KV cache of n tokens, "
                             "projections, FFN, attention share and the cache's bytes")
    decode.add_argument("--sliding-window", type=_positive, metavar="W",
                        help="sliding-window attention: the cache keeps the last W-1 tokens (decode only)")
    decode.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default="float16",
                        help="element type of the KV cache (default float16)")
    decode.add_argument("--prompt", type=_positive, metavar="P",
                        help="with --new-tokens: the whole generation's cost (prefill + decode steps)")
    decode.add_argument("--new-tokens", type=_positive, metavar="T", help="tokens generated after the prompt")
    return parser


def resolve_spec(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ModelSpec:
    base = PRESETS.get(args.preset) if args.preset else None
    hidden = args.hidden or (base.hidden if base else None)
    heads = args.heads or (base.heads if base else None)
    if hidden is None or heads is None:
        parser.error("give --hidden and --heads, or a --preset")
    head_dim = args.head_dim or (base.head_dim if base and not args.hidden and not args.heads else None)
    if head_dim is None:
        if hidden % heads:
            parser.error(f"--hidden {hidden} is not divisible by --heads {heads}: give --head-dim")
        head_dim = hidden // heads
    ffn = args.ffn if args.ffn is not None else (base.ffn_dim if base else 4 * hidden)
    kv_heads = args.kv_heads or (base.kv_heads if base else None)
    if kv_heads is not None and heads % kv_heads:
        parser.error(f"--heads {heads} is not a multiple of --kv-heads {kv_heads}")
    gated = args.gated if args.gated is not None else (base.gated if base else False)
    layers = args.layers or (base.layers if base else 12)
    experts = args.experts if args.experts is not None else (base.experts if base else 0)
    moe: dict[str, Any] = {}
    if experts:
        top_k = args.top_k or (base.top_k if base and base.experts else None)
        if top_k is None:
            parser.error("--experts needs --top-k (experts each token runs through)")
        if top_k > experts:
            parser.error(f"--top-k {top_k} exceeds --experts {experts}")
        expert_ffn = args.expert_ffn or (base.expert_ffn_dim if base and base.experts and args.ffn is None else ffn)
        if not expert_ffn:
            parser.error("--experts needs an expert width: give --expert-ffn")
        shared = args.shared_ffn if args.shared_ffn is not None else (base.shared_ffn_dim if base else 0)
        moe = {"experts": experts, "top_k": top_k, "expert_ffn_dim": expert_ffn, "shared_ffn_dim": shared}
    elif args.top_k or args.expert_ffn or args.shared_ffn:
        parser.error("--top-k, --expert-ffn and --shared-ffn describe a mixture of experts: give --experts too")
    return ModelSpec(hidden, heads, head_dim, layers, ffn, kv_heads=kv_heads, gated=gated, **moe,
                     sliding_window=args.sliding_window)


def default_lengths(spec: ModelSpec) -> list[int]:
    thresholds = (formulas.crossover_n(spec), formulas.quadratic_n(spec))
    return sorted({128, 512, *(math.ceil(value) for value in thresholds if value is not None)})


def _thresholds(spec: ModelSpec, cross: Fraction | None, quad: Fraction | None) -> dict[str, Any]:
    return {"crossover_n": as_float(cross), "quadratic_n": as_float(quad),
            "memory_crossover_n": footprint.memory_crossovers(spec)}


def table(spec: ModelSpec, lengths: Sequence[int], batch: int) -> dict[str, Any]:
    rows = []
    memory = footprint.memory_crossovers(spec) is not None
    for n in lengths:
        costs = formulas.layer_costs(spec, n, batch)
        rows.append({"n": n, **{part: getattr(costs, part) for part in ("attention", *COMPONENTS)},
                     "layer": costs.total, "model": formulas.model_costs(spec, n, batch).total,
                     "attention_share": costs.attention / costs.total if costs.total else 0.0,
                     "quadratic_share": costs.attention_core / costs.total if costs.total else 0.0,
                     "linear_attention_saving": formulas.linear_attention_saving(spec, n, batch)})
        if memory:  # what a training layer keeps: fp32, CPU's float dropout masks
            rows[-1]["activation_bytes"] = footprint.activation_bytes(spec, n, batch)
    return {"spec": spec.to_dict(), "batch": batch, "unit": "MAC", "rows": rows,
            **_thresholds(spec, formulas.crossover_n(spec), formulas.quadratic_n(spec))}


def decode_lengths(spec: ModelSpec) -> list[int]:
    """128, 512, 4096 and the cache lengths where the decode thresholds are crossed."""
    thresholds = (formulas.decode_crossover_n(spec), formulas.decode_quadratic_n(spec))
    # the cache of the first step whose context reaches it
    return sorted({128, 512, 4096, *(max(1, math.ceil(value) - 1) for value in thresholds if value is not None)})


def decode_table(spec: ModelSpec, lengths: Sequence[int], batch: int = 1, bytes_per_element: int = 2) -> dict[str, Any]:
    """Per new token and layer, a one-token decode step against a cache of n tokens; the model's KV cache bytes."""
    rows = []
    sliding = spec.window_layers == spec.layers  # a layer's row: windowed when every layer is
    for n in lengths:
        core = formulas.decode_attention_core(spec, n, 1, batch, sliding=sliding)
        proj = formulas.decode_attention_proj(spec, 1, batch)
        ffn = formulas.decode_ffn(spec, 1, batch)
        whole = core + proj + ffn
        rows.append({"n": n, "attention_core": core, "attention_proj": proj, "ffn": ffn, "attention": core + proj,
                     "attention_share": (core + proj) / whole if whole else 0.0,
                     "core_share": core / whole if whole else 0.0,
                     "model": formulas.decode_costs(spec, n, 1, batch).total,
                     "kv_cache_bytes": formulas.kv_cache_bytes(spec, n, batch, bytes_per_element)})
    return {"attention_n": as_float(formulas.decode_attention_n(spec)), "batch": batch,
            "bytes_per_element": bytes_per_element, "unit": "MAC", "rows": rows,
            **_thresholds(spec, formulas.decode_crossover_n(spec), formulas.decode_quadratic_n(spec))}


def render_decode(data: dict[str, Any], spec: dict[str, Any]) -> str:
    window = f", sliding window {spec['sliding_window']}" if spec.get("sliding_window") else ""
    lines = [f"decode: one new token against a KV cache of n tokens{window}; per layer, batch {data['batch']}, "
             f"in MAC; KV cache of the whole model at {data['bytes_per_element']} bytes per element:"]
    headers = ["n", "core", "proj", "FFN", "SA/(SA+FFN)", "core/(SA+FFN)", "model total", "KV cache", "KV bytes"]
    body = [[f"{r['n']:,}", f"{r['attention_core']:,}", f"{r['attention_proj']:,}", f"{r['ffn']:,}",
             f"{r['attention_share']:.4f}", f"{r['core_share']:.4f}", f"{r['model']:,}",
             format_bytes(r["kv_cache_bytes"]), f"{r['kv_cache_bytes']:,}"] for r in data["rows"]]
    lines += text_table(headers, body, right=range(len(headers)), rule=False)
    cross, quad = data["crossover_n"], data["quadratic_n"]
    if cross is None:
        lines.append("the core never reaches the FFN")
    else:
        same = " = 4D" if cross == 4 * spec["hidden"] and not spec["gated"] else ""
        lines.append(f"the core overtakes the FFN at a context of {_tokens(cross)} tokens (F/2hd{same}; the cache "
                     f"holds {_tokens(cross - 1)} and the new token attends to itself)")
    if data["attention_n"] is not None:
        lines.append(f"attention (core + projections) overtakes the FFN at a context of {_tokens(data['attention_n'])} "
                     "tokens ((F-P)/2hd)")
    if quad is not None:
        lines.append(f"the core outweighs projections and FFN together at a context of {_tokens(quad)} tokens "
                     "((P+F)/2hd)")
    return "\n".join(lines)


def _tokens(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"


def render_generation(spec: ModelSpec, prompt: int, new_tokens: int, batch: int) -> tuple[dict[str, Any], str]:
    generation = formulas.generation_cost(spec, prompt, new_tokens, batch)
    total = generation.total
    text = (f"generation: prompt {prompt:,} + {new_tokens:,} new tokens (prefill + {generation.steps:,} decode steps), "
            f"batch {batch}: {total.total:,} MAC (core {total.attention_core:,}, proj {total.attention_proj:,}, "
            f"FFN {total.ffn:,}); attention share {generation.attention_share:.4f}, decode steps "
            f"{generation.decode_share:.2%} of it")
    return generation.to_dict(), text


def _threshold(value: float | None, multiple: int, hd: int, what: str) -> str:
    if value is None:  # no length where the linear terms are ahead: attention leads from the first token
        return f"{what} at every n (the FFN is no larger than the projections)"
    same = f" = {multiple}hd" if value == multiple * hd else ""
    return f"{what} at n = {_tokens(value)}{same}"


def render(data: dict[str, Any], name: str) -> str:
    spec = data["spec"]
    hd = spec["heads"] * spec["head_dim"]
    kv = f", {spec['kv_heads']} kv heads" if spec["kv_heads"] else ""
    gated = " gated" if spec["gated"] else ""
    if spec.get("experts"):
        shared = f" + shared {spec['shared_ffn_dim']}" if spec.get("shared_ffn_dim") else ""
        ffn = (f"ffn: {spec['experts']} experts of {spec['expert_ffn_dim']}{gated}, top-{spec['top_k']}{shared} "
               "(the active FFN, router included)")
    else:
        ffn = f"ffn {spec['ffn_dim']}{gated}"
    lines = [
        f"{name}: hidden {spec['hidden']}, {spec['heads']} heads x {spec['head_dim']}{kv}, "
        f"{ffn}, {spec['layers']} layers",
        f"per layer, batch {data['batch']}, in MAC (1 MAC = 2 FLOP):",
    ]
    headers = ["n", "SA", "FFN", "core", "proj", "SA/(SA+FFN)", "core/(SA+FFN)", "linear saving", "model total"]
    body = [[f"{r['n']:,}", f"{r['attention']:,}", f"{r['ffn']:,}", f"{r['attention_core']:,}",
             f"{r['attention_proj']:,}", f"{r['attention_share']:.4f}", f"{r['quadratic_share']:.4f}",
             f"{r['linear_attention_saving']:.2%}", f"{r['model']:,}"] for r in data["rows"]]
    lines += text_table(headers, body, right=range(len(headers)), rule=False)
    lines.append(_threshold(data["crossover_n"], 2, hd, "attention overtakes the FFN"))
    lines.append(_threshold(data["quadratic_n"], 6, hd, "the quadratic term dominates the layer"))
    if (memory := data.get("memory_crossover_n")) is not None:
        d = spec["head_dim"]
        lines.append(f"in training memory, the n×n activations pass the rest of a layer's at n = {memory['fp32']:,.0f}"
                     f" = {memory['fp32'] / d:.3g}d (fp32, float dropout masks: d·(16p + 2m)/(2p + m)), "
                     f"{memory['fp16']:,.1f} (fp16, bool masks), {memory['no_dropout']:,.0f} = 16d without dropout")
        kept = ", ".join(f"n={r['n']:,}: {format_bytes(r['activation_bytes'])}" for r in data["rows"])
        lines.append(f"saved for the backward per layer (s·b·H·(16p + 2m) + a·s²·b·(2p + m), fp32): {kept}; model "
                     "state at AdamW's step: 5x the parameter bytes (foreach), 4x fused, SGD 2x")
    return "\n".join(lines)


# --- compare: two JSON reports or baselines, part by part ------------------------------------------

_COMPARE_HELP = ("part-by-part differences of two JSON reports or baselines (--attncost-json, --attncost-save): "
                 "entries added, removed and changed; exit 1 when a part grew beyond --max-increase")
_PROFILE_HELP = ("count a model of your own: import MODULE (dotted, or a .py file), build FACTORY() on the meta "
                 "device and print its costs at each length")

#: Exit codes: 0 nothing grew too much, 1 a part grew beyond --max-increase, 2 a usage error.
GREW = 1


def _percent(text: str) -> float:
    try:
        value = float(text.strip().removesuffix("%"))
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a percentage >= 0 such as 2.5, got {text!r}")
    return value


def _compare_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("old", metavar="A.json", type=Path, help="the reference: a baseline or a JSON report")
    parser.add_argument("new", metavar="B.json", type=Path, help="the run to check against it")
    parser.add_argument("--max-increase", type=_percent, default=0.0, metavar="PCT",
                        help="allowed growth of any part, in percent (default 0)")
    return parser


def compare_files(old: Path, new: Path, max_increase: float = 0.0) -> tuple[list[str], int]:
    """The comparison's lines and exit code (0, or 1 when a part grew beyond *max_increase* percent).

    Raises:
        baseline.BaselineError: a file that is missing, corrupt or of another schema.
    """
    before, after = baseline.load(old)[0], baseline.load(new)[0]
    added = sorted(after.keys() - before.keys())
    removed = sorted(before.keys() - after.keys())
    pairs = [(key, key) for key in sorted(before.keys() & after.keys())] + _backend_moves(removed, added)
    changed = [(a, b) for a, b in pairs if a != b or any(int(before[a][p]) != int(after[b][p]) for p in GATED_PARTS)]
    unchanged = len(pairs) - len(changed)
    lines = [f"{old} ({baseline.entries(len(before))}) → {new} ({baseline.entries(len(after))}), counts in MAC:"]
    regressions: list[str] = []
    if changed:
        headers = ["test", "model", "n", "batch", "total before", "total after", *(f"Δ {p}" for p in GATED_PARTS)]
        body = []
        for key, new_key in changed:
            a, b = before[key], after[new_key]
            label = reporting.key_label(new_key if key == new_key else (*new_key[:-1], "fvcore"))
            if key != new_key:  # one entry, counted by the other backend now
                label[1] += f" (backend {key[-1]} → {new_key[-1]})"
            body.append([*label, f"{int(a['total']):,}", f"{int(b['total']):,}",
                         *(baseline.moved(int(a[p]), int(b[p])) for p in GATED_PARTS)])
            found, _cell = baseline.compare(a, b, max_increase)
            regressions += [f"{label[0]} [{label[1]} n={key[2]} batch={key[3]}]: {r}" for r in found]
        lines += ["", f"changed ({len(changed)}):", *text_table(headers, body, right=range(2, len(headers)))]
    for title, keys, source in (("added", added, after), ("removed", removed, before)):
        if keys:
            body = [[*reporting.key_label(key), f"{int(source[key]['total']):,}"] for key in keys]
            lines += ["", f"{title} ({len(keys)}):",
                      *text_table(["test", "model", "n", "batch", "total"], body, right=(2, 3, 4))]
    if regressions:
        lines += ["", f"grew beyond --max-increase {max_increase:g}% ({len(regressions)}):",
                  *(f"  {r}" for r in regressions)]
    lines += ["", f"{len(changed)} changed, {len(added)} added, {len(removed)} removed, {unchanged} unchanged; "
                  + (f"{len(regressions)} part{'s' if len(regressions) != 1 else ''} grew beyond "
                     f"{max_increase:g}%" if regressions else f"no part grew beyond {max_increase:g}%")]
    return lines, GREW if regressions else 0


def _backend_moves(removed: list[Any], added: list[Any]) -> list[tuple[Any, Any]]:
    """Entries that differ only in their backend, one on each side: the same entry, counted anew (taken out of
    *removed* and *added*)."""
    gone, new = (Counter(key[:-1] for key in keys) for keys in (removed, added))
    once = {key[:-1]: key for key in added if new[key[:-1]] == 1}
    moves = [(key, once[key[:-1]]) for key in removed if gone[key[:-1]] == 1 and key[:-1] in once]
    for a, b in moves:
        removed.remove(a)
        added.remove(b)
    return moves


def _compare(argv: Sequence[str]) -> int:
    parser = _compare_arguments(argparse.ArgumentParser(prog="python -m pytest_attncost compare",
                                                        description=_COMPARE_HELP))
    args = parser.parse_args(argv)
    try:
        lines, code = compare_files(args.old, args.new, args.max_increase)
    except (baseline.BaselineError, OSError) as exc:
        parser.error(str(exc))
    _print("\n".join(lines))
    return code


# --- profile: a model of the user's own, through pytest_attncost.profile -------------------------

#: Why MODULE:FACTORY could not be used; each message names the target and the fix.
NOT_A_TARGET = "expected MODULE:FACTORY (a dotted module or a .py file, a colon, a function), got {target!r}"
NO_FILE = "cannot import {target}: no file {path}; give an existing .py file or a dotted module"
NO_MODULE = ("cannot import {target}: {error}; give a dotted module importable from the current directory "
             "(e.g. mypkg.models:build) or a path to a .py file (e.g. models.py:build)")
IMPORT_FAILED = "cannot import {target}: importing {module} raised {error}; fix the module (it runs on import)"
NO_ATTRIBUTE = ("cannot use {target}: module {module} has no attribute {name!r}{hint}; after the colon, name "
                "{expect} defined in {module}")
NOT_CALLABLE = "cannot use {target}: {name} is not callable (it is {kind}); point at {expect}"
FACTORY = "a zero-argument function that returns the model (an nn.Module)"
INPUTS_FN = "a function (n, batch) -> tuple | dict that returns the forward's inputs"

EXITED = ("cannot use {target}: the factory called sys.exit({code!r}); a factory must return the model "
          "(an nn.Module), not end the program")

NO_INPUTS = ("; the command line builds default inputs for transformers models and torch's Transformer modules "
             "only: for others pass --inputs MODULE:FN, " + INPUTS_FN)


class TargetError(ValueError):
    """MODULE:FACTORY that cannot be imported or called; the message names it and the fix."""


def _profile_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("target", metavar="MODULE:FACTORY",
                        help="a zero-argument callable returning an nn.Module, e.g. mypkg.models:build_bert "
                             "or path/to/models.py:build_bert (built on the meta device: no weights allocated)")
    parser.add_argument("--n", type=_positive, nargs="+", action="extend", metavar="N", required=True,
                        help="lengths: --n 512 2048, or --n 512 --n 2048")
    parser.add_argument("--batch", type=_positive, default=1, help="batch size (default 1)")
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="counter: fvcore's jit trace (default) or torch's FlopCounterMode")
    parser.add_argument("--inputs", metavar="MODULE:FN",
                        help="the forward's inputs: FN(n, batch) returns a tuple of positional arguments or a dict "
                             "of keyword arguments (default: built for transformers models and torch's Transformer "
                             "modules)")
    parser.add_argument("--spec", type=_spec, metavar="KEY=VALUE,...",
                        help="the shape the formulas use, as ModelSpec's keywords: hidden=64,heads=4,head_dim=16,"
                             "layers=2,ffn_dim=256[,kv_heads=2,gated=true] (default: read from the config, else "
                             "from the trace)")
    parser.add_argument("--json", action="store_true",
                        help="print the JSON report (the --attncost-json schema: compare reads it)")
    return parser


def _spec(text: str) -> ModelSpec:
    """``--spec hidden=64,heads=4,...``: a ModelSpec from its keywords (:func:`formulas.parse_spec`)."""
    try:
        return formulas.parse_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _check_target(target: str) -> None:
    """MODULE:FACTORY's form and file, checked before anything is imported (the user's module imports torch)."""
    module, sep, attribute = target.rpartition(":")
    if not sep or not module or not attribute:
        raise TargetError(NOT_A_TARGET.format(target=target))
    if (module.endswith(".py") or os.sep in module or "/" in module) and not Path(module).is_file():
        raise TargetError(NO_FILE.format(target=target, path=Path(module)))


def _import_module(target: str, module: str) -> Any:
    if module.endswith(".py") or os.sep in module or "/" in module:
        path = Path(module)
        name = f"_attncost_cli_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:  # pragma: no cover - a .py file always has a loader
            raise TargetError(NO_FILE.format(target=target, path=path))
        loaded = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.resolve().parent))  # its sibling modules import as they would beside it
        sys.modules[name] = loaded
        try:
            spec.loader.exec_module(loaded)
        except Exception as exc:  # noqa: BLE001 - the module is the user's code
            sys.modules.pop(name, None)
            raise TargetError(IMPORT_FAILED.format(target=target, module=path, error=_error(exc))) from exc
        return loaded
    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` would see it
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - the module is the user's code
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        if missing and (module == missing or module.startswith(missing + ".")):  # not a module it imports
            raise TargetError(NO_MODULE.format(target=target, error=exc)) from exc
        raise TargetError(IMPORT_FAILED.format(target=target, module=module, error=_error(exc))) from exc


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def load_factory(target: str, expect: str = FACTORY) -> Callable[..., Any]:
    """The callable named by ``MODULE:FACTORY`` (``FACTORY`` may be dotted: ``Models.bert``); *expect* says
    what it should be, in the messages.

    Raises:
        TargetError: no colon, a module that cannot be imported, a missing or non-callable attribute.
    """
    _check_target(target)
    module, _, attribute = target.rpartition(":")
    path = list(sys.path)
    try:  # the module's siblings import while it loads; ones its factory imports later are the user's to reach
        value: Any = _import_module(target, module)
    finally:  # a sibling named like a dependency (fvcore.py) must not replace it for the rest of the process
        sys.path[:] = path
    for part in attribute.split("."):
        if not hasattr(value, part):
            names = [n for n in dir(value) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1)
            hint = (f" (did you mean {close[0]!r}?)" if close else
                    f"; it defines {', '.join(names[:12])}{' ...' if len(names) > 12 else ''}" if names else "")
            raise TargetError(NO_ATTRIBUTE.format(target=target, module=module, name=part, hint=hint, expect=expect))
        value = getattr(value, part)
    if not callable(value):
        kind = type(value).__name__
        raise TargetError(NOT_CALLABLE.format(target=target, name=attribute, expect=expect,
                                              kind=f"{'an' if kind[0] in 'aeiouAEIOU' else 'a'} {kind}"))
    return cast("Callable[..., Any]", value)


def _profile(argv: Sequence[str]) -> int:
    parser = _profile_arguments(argparse.ArgumentParser(prog="python -m pytest_attncost profile",
                                                        description=_PROFILE_HELP))
    args = parser.parse_args(argv)
    try:
        for target in (args.target, *([args.inputs] if args.inputs is not None else [])):
            _check_target(target)  # both, before the first import: an argument error costs no torch import
        factory = load_factory(args.target)
        inputs = None if args.inputs is None else load_factory(args.inputs, INPUTS_FN)
    except TargetError as exc:
        parser.error(str(exc))
    from .api import ProfileError, profile, sweep

    swept = None
    if args.backend == "torch" and len(set(args.n)) == len(args.n) > 1:
        try:  # the torch backend counts a sweep's lengths in one run; any trouble, and each n is counted alone
            swept = sweep(factory, args.n, batch=args.batch, backend="torch", inputs=inputs, spec=args.spec)
        except ProfileError:
            pass
        except SystemExit as exc:  # not KeyboardInterrupt: that one ends the command
            parser.error(EXITED.format(target=args.target, code=exc.code))
    by_n = {p.n: p for p in swept or ()}
    rows = [reporting.Row(args.target, by_n[n]) for n in args.n] if swept is not None else []
    for n in args.n if not rows else ():
        try:
            result = profile(factory, n, batch=args.batch, backend=args.backend, inputs=inputs, spec=args.spec)
        except ProfileError as exc:
            hint = NO_INPUTS if "inputs=" in str(exc) else ""
            parser.error(f"{args.target} at n={n}: {exc}{hint}")
        except SystemExit as exc:  # parser.error's own exit, from the clause above, is not caught here
            parser.error(EXITED.format(target=args.target, code=exc.code))
        rows.append(reporting.Row(args.target, result))
    if args.json:
        _print(reporting.render_json(rows).rstrip("\n"))
        return 0
    first = rows[0].profile
    headers = ["n", *GATED_PARTS, "attn share", "deviation", "warnings"]
    body = [[f"{p.n:,}", *(f"{getattr(p, part):,}" for part in GATED_PARTS), f"{p.attention_share:.4f}",
             reporting.deviation_cell(p.deviation), str(len(p.warnings))] for p in (r.profile for r in rows)]
    how = " (one run for all lengths)" if swept is not None and swept.one_run else ""
    lines = [f"{args.target}: {first.name}, batch {args.batch}, counted by {first.backend}{how}, "
             "whole model in MAC (1 MAC = 2 FLOP):",
             *text_table(headers, body, right=range(len(headers)), rule=False),
             "attn share is attention / (attention + FFN); deviation is the largest relative difference "
             "from the formula"]
    if warned := [f"  n={r.profile.n}: {w}" for r in rows for w in r.profile.warnings]:
        lines += ["warnings (these numbers may be wrong):", *warned]
    _print("\n".join(lines))
    return 0


def _print(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # piped into head: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return {"compare": _compare, "profile": _profile}[argv[0]](argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is not None:  # a subcommand after formula options
        parser.error(f"{args.command} goes first: python -m pytest_attncost {args.command} ... "
                     "(it takes none of the formula options)")
    spec = resolve_spec(parser, args)
    lengths = args.n or default_lengths(spec)
    data = table(spec, lengths, args.batch)
    extra: dict[str, Any] = {}
    texts = []
    if (args.prompt is None) != (args.new_tokens is None):
        parser.error("--prompt and --new-tokens go together: the generation's cost needs both")
    if args.decode or args.prompt is not None:
        decode = decode_table(spec, args.n or decode_lengths(spec), args.batch, KV_DTYPES[args.kv_dtype])
        extra["decode"] = {**decode, "kv_dtype": args.kv_dtype}
        texts.append(render_decode(decode, spec.to_dict()))
    if args.prompt is not None:
        extra["generation"], text = render_generation(spec, args.prompt, args.new_tokens, args.batch)
        texts.append(text)
    if args.conventions:
        counted = {n: conventions.conventions(spec, n, args.batch, vocab=args.vocab, causal=args.causal)
                   for n in lengths}
        extra["conventions"] = {str(n): [{"name": c.name, "macs": c.macs, "exact": c.exact, "differs": c.differs}
                                         for c in rows] for n, rows in counted.items()}
        body = [[f"{n:,}", c.name, f"{c.macs:,}", f"{c.relative:+.1%}", "; ".join(term for term, _ in c.differs)]
                for n, rows in counted.items() for c in rows]
        texts.append("\n".join(["published conventions (forward MACs; vs the exact count of the layers):",
                                 *text_table(["n", "convention", "MAC", "vs exact", "differs by"], body,
                                             right=[0, 2, 3])]))
    if args.json:
        text = json.dumps({"name": args.preset or "custom", **data, **extra}, indent=2, sort_keys=True)
    else:
        text = "\n\n".join([render(data, args.preset or "custom"), *texts])
    _print(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
