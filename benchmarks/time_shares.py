"""Attention's share of BERT-base's MACs against its share of the time, on this machine.

The article's crossover, where attention costs as much as the FFN, is n = 2hd = 1536 tokens
for BERT-base, in MACs. Where does attention's *time* overtake the FFN's on a real machine?
This script measures BERT-base (random weights) at each length with
``pytest_attncost.measure()``, prints one row per length, then both crossovers: the measured
one (where the time share crosses 1/2, interpolated between the lengths around it) and the
formula's. Not a test: machines are noisy, and the answer is this machine's. Usage:

    python benchmarks/time_shares.py                      # n = 128 ... 4096 (minutes on 2 cores)
    python benchmarks/time_shares.py --ns 128,512 --repeats 3
    python benchmarks/time_shares.py --device cuda --dtype bfloat16 --json shares.json --plot plots/

Prints a Markdown table; ``--json`` writes the sweep (every timing, both crossovers),
``--plot`` the MAC share and time share against n (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))

DEFAULT_NS = (128, 256, 512, 1024, 2048, 4096)


def bert_base():  # type: ignore[no-untyped-def]
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig())


def _lengths(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected lengths such as 128,512,2048, got {text!r}") from None
    if not values or any(v <= 0 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct positive lengths, got {text!r}")
    return sorted(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", type=_lengths, default=list(DEFAULT_NS), help="lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per length (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed forwards first (default 1)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the model's float32)")
    parser.add_argument("--json", type=Path, default=None, help="write the sweep here")
    parser.add_argument("--plot", type=Path, default=None, help="write the time-share plot into this directory")
    args = parser.parse_args(argv)

    import torch

    from pytest_attncost import Timing, TimingSweep, measure
    from pytest_attncost.api import spec_of
    from pytest_attncost.plots import plot_time_shares
    from pytest_attncost.units import format_seconds

    dtype = getattr(torch, args.dtype) if args.dtype else None
    with torch.device("meta"):
        spec = spec_of(bert_base())
    print(f"BERT-base (h={spec.heads}, d={spec.head_dim}, hd={spec.hidden}, L={spec.layers}), batch 1, "
          f"{args.repeats} repeats per length, medians\n")
    header = ("| n | attention share of MACs | attention share of time | core share of time | forward "
              "| attributed | attention MAC/s | FFN MAC/s |")
    print(header)
    print("|---:" * (header.count("|") - 1) + "|")
    timings = []
    started = time.perf_counter()

    def rate(t: Timing, part: str) -> str:
        return f"{(t.macs_per_second(part) or 0) / 1e9:.1f} G"

    for n in args.ns:
        t = measure(bert_base, n, device=args.device, dtype=dtype, warmup=args.warmup, repeats=args.repeats,
                    threads=args.threads)
        timings.append(t)
        print(f"| {n:,} | {t.attention_mac_share:.3f} | {t.attention_time_share:.3f} "
              f"± {t.spread('attention_time_share'):.3f} | {t.quadratic_time_share:.3f} | {format_seconds(t.forward)} "
              f"| {t.attributed / t.traced:.1%} | {rate(t, 'attention')} | {rate(t, 'ffn')} |", flush=True)
    sweep = TimingSweep(timings, spec)
    where = timings[0].device_name
    measured, formula, counted = sweep.crossover(), sweep.formula_crossover(), sweep.mac_crossover()
    print()
    print(f"On {where} ({timings[0].dtype}):")
    if measured is not None:
        print(f"  attention's time overtakes the FFN's at n ≈ {measured:,.0f} (measured, interpolated)")
    else:
        above = timings[0].attention_time_share >= 0.5
        print(f"  attention's time does not overtake the FFN's within n = {args.ns[0]:,}…{args.ns[-1]:,} "
              f"({'already above' if above else 'below'} half at every length)")
    if formula is not None:
        print(f"  the formula says n = 2hd = {formula:,.0f} (in MACs)")
    if counted is not None:
        print(f"  the counted MACs cross at n ≈ {counted:,.0f} (interpolated between the lengths measured)")
    for t in timings:
        for note in t.notes:
            print(f"  note at n={t.n}: {note}")
    print(f"  ({time.perf_counter() - started:,.0f} s)")
    if args.json is not None:
        args.json.write_text(json.dumps(sweep.to_dict(), indent=1, sort_keys=True, allow_nan=False) + "\n")
    if args.plot is not None:
        args.plot.mkdir(parents=True, exist_ok=True)
        for path in plot_time_shares(sweep.to_dict(), args.plot, "bert-base"):
            print(f"  wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
