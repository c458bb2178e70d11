"""What a memory estimate costs: LLaMA-2-7B's training step at 4096 tokens on meta, beside its MAC profile.

Not a test (machines are noisy). Each measurement runs in a fresh child process, so its peak RSS is its own, and
the ratio compares two numbers taken in this one run. Usage::

    python benchmarks/memory.py            # LLaMA-2-7B, n=4096, batch 1, AdamW
    python benchmarks/memory.py --quick    # a 4-layer LLaMA of the same width, for a smoke run

Prints the seconds and peak RSS of each, the ratio, and whether the targets hold (memory at most a few times the
MAC profile, under 1 GB of RSS); exit status 1 if one does not.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RATIO_TARGET, RSS_TARGET_MB = 5.0, 1000.0


def _llama(layers: int):  # noqa: ANN202 - a factory for profile()
    from transformers import LlamaConfig, LlamaForCausalLM

    return lambda: LlamaForCausalLM(LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                                                num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                                attn_implementation="sdpa"))


def child(memory: bool, layers: int, n: int) -> None:
    import pytest_attncost

    factory = _llama(layers)
    pytest_attncost.profile(factory, 16, mode="train")  # imports and first-call costs outside the timing
    pytest_attncost.clear_cache()
    start = time.perf_counter()
    result = pytest_attncost.profile(factory, n, mode="train", memory=memory)
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peak = result.memory.peak if result.memory else None
    print(json.dumps({"seconds": seconds, "rss_mb": rss, "peak": peak,
                      "phase": result.memory.phase if result.memory else None}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", choices=["macs", "memory"])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--n", type=int, default=4096)
    args = parser.parse_args()
    if args.quick:
        args.layers = 4
    if args.child:
        child(args.child == "memory", args.layers, args.n)
        return 0
    found = {}
    for kind in ("macs", "memory"):
        out = subprocess.run([sys.executable, __file__, "--child", kind, "--layers", str(args.layers), "--n",
                              str(args.n)], capture_output=True, text=True, check=True, cwd=ROOT).stdout
        found[kind] = json.loads(out.strip().splitlines()[-1])
    macs, memory = found["macs"], found["memory"]
    # the memory profile counts the MACs too: the estimate alone costs the difference
    ratio = (memory["seconds"] - macs["seconds"]) / macs["seconds"]
    print(f"LLaMA-2-7B shape, {args.layers} layers, n={args.n}, training step with AdamW:")
    print(f"  MAC profile      {macs['seconds']:7.2f} s   peak RSS {macs['rss_mb']:7.1f} MB")
    print(f"  + memory=True    {memory['seconds']:7.2f} s   peak RSS {memory['rss_mb']:7.1f} MB   "
          f"estimated peak {memory['peak'] / 1e9:,.1f} GB in {memory['phase']}")
    ok = ratio <= RATIO_TARGET and memory["rss_mb"] < RSS_TARGET_MB
    print(f"  the estimate alone: {ratio:.2f}x the MAC profile (target <= {RATIO_TARGET:g}x), "
          f"RSS target < {RSS_TARGET_MB:g} MB: "
          f"{'holds' if ok else 'DOES NOT HOLD'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
