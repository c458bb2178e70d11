"""The roofline's prediction beside measured time, per part, on this CPU (not a test: machines are noisy).

BERT-base's shape (12 layers, 12 heads of 64, FFN 3072; position table widened to 4096 so that it can run
4096 tokens) is counted on the meta device, its products' bytes read from the same trace; ``this CPU`` is
measured (a float32 matrix product and a copy); the roofline time of each part is the slower of its FLOPs at
that peak and its bytes at that bandwidth. Then ``measure()`` times the real forward and splits the time the
same way. Both are printed side by side, with the ratio measured / predicted. Usage:

    python benchmarks/roofline.py                 # n = 512 and 4096 (a few minutes on 2 cores)
    python benchmarks/roofline.py --lengths 128   # a smoke run
"""

from __future__ import annotations

import argparse

from pytest_attncost import devices, measure
from pytest_attncost.units import format_seconds


def bert_base():
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(max_position_embeddings=4096))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cpu = devices.this_cpu()
    print(f"{cpu.name}: {cpu.peak('fp32') / 1e9:.1f} GFLOP/s (float32 product), {cpu.bandwidth / 1e9:.1f} GB/s (copy); "
          f"ridge {cpu.ridge('fp32'):.1f} FLOP/B\n")
    print("| n | part | FLOP | bytes | FLOP/B | bound | predicted | measured | measured / predicted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.lengths:
        timing = measure(bert_base, n, repeats=args.repeats, warmup=1)
        for roof in timing.profile.roofline("cpu"):
            if roof.part == "other":
                continue
            seconds = timing.forward if roof.part == "total" else timing.median(roof.part)
            print(f"| {n} | {'forward' if roof.part == 'total' else roof.part} | {roof.flops / 1e9:.1f} G | "
                  f"{roof.bytes / 1e6:.0f} MB | {roof.intensity:.0f} | {roof.bound} | {format_seconds(roof.seconds)} | "
                  f"{format_seconds(seconds)} | {seconds / roof.seconds:.2f} |")


if __name__ == "__main__":
    main()
