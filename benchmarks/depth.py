"""How pytest-attncost's time grows with a model's depth, and what a decoder sweep costs, against torch's floor.

The floor is torch's ``FlopCounterMode`` alone on fake tensors (the nearest bare counter that runs a LLaMA-family
model: its mask creation calls ``.item()``, which bare meta tensors refuse), given the inputs ``profile()`` builds,
on the model already on the meta device. Each row compares numbers taken in this one run, interleaved, the best of
``--rounds`` (CPU seconds of this process: the machine may be shared). Usage:

    python benchmarks/depth.py                 # the whole table (minutes on 2 cores)
    python benchmarks/depth.py --quick         # 2 ... 32 layers, no 70B / 405B shapes, for a smoke run

Rows: a tiny LLaMA (hidden 256) at 2 ... 256 layers, LLaMA-2-7B, LLaMA-3-70B and LLaMA-3.1-405B shapes; each
``profile(backend="torch")`` / the floor, and 256 layers / 128 layers; then a one-run sweep of 8 lengths of the
LLaMA-2-7B shape / one profile (torch backend), its profiles checked against one profile per length. Prints a
Markdown table and whether each target holds; exit status 1 if one does not.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))

N = 1024
SWEEP = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4, vocab_size=1000)
SHAPES = {  # the published shapes (on meta: no weights)
    "LLaMA-2-7B": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_hidden_layers=32,
                       max_position_embeddings=4096),
    "LLaMA-3-70B": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                        num_hidden_layers=80, vocab_size=128256, max_position_embeddings=8192),
    "LLaMA-3.1-405B": dict(hidden_size=16384, intermediate_size=53248, num_attention_heads=128, num_key_value_heads=8,
                           num_hidden_layers=126, vocab_size=128256, max_position_embeddings=131072),
}


def _llama(**config: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaModel

    with torch.device("meta"):
        return LlamaModel(LlamaConfig(**config))


def _cpu(work: Callable[[], Any]) -> float:
    gc.collect()
    start = time.process_time()
    work()
    return time.process_time() - start


def against_floor(model: Any, rounds: int) -> tuple[float, float]:
    """(profile, floor) in CPU seconds, interleaved, best of *rounds*."""
    from bench import _bare_meta

    from pytest_attncost import clear_cache, profile

    best_profile, best_floor = float("inf"), float("inf")
    for _ in range(rounds):
        best_floor = min(best_floor, _cpu(lambda: _bare_meta(model, N, True)))
        clear_cache()
        best_profile = min(best_profile, _cpu(lambda: profile(model, N, backend="torch")))
    return best_profile, best_floor


def decoder_sweep(rounds: int) -> tuple[float, float, bool, bool]:
    """(sweep of 8 lengths, one profile at n=512) of the LLaMA-2-7B shape, whether the sweep was one run, and whether
    its profiles are those of one profile per length."""
    from pytest_attncost import clear_cache, profile
    from pytest_attncost.api import sweep

    model = _llama(**SHAPES["LLaMA-2-7B"])
    profile(model, 16, backend="torch")
    sweep(model, SWEEP[:3], backend="torch")
    one, many, swept = float("inf"), float("inf"), None
    for _ in range(rounds):
        clear_cache()
        one = min(one, _cpu(lambda: profile(model, 512, backend="torch")))
        clear_cache()
        start = time.process_time()
        swept = sweep(model, SWEEP, backend="torch")
        many = min(many, time.process_time() - start)
    clear_cache()
    alone = [profile(model, n, backend="torch").to_dict() for n in SWEEP]
    assert swept is not None
    return many, one, swept.one_run, [p.to_dict() for p in swept] == alone


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 ... 32 layers and the 7B shape only")
    parser.add_argument("--rounds", type=int, default=3, help="best of this many (the 70B and 405B shapes: 1)")
    args = parser.parse_args()
    from bench import _warm_up

    _warm_up()
    rows: list[tuple[str, str, str, bool]] = []

    def add(what: str, measured: str, target: str, ok: bool) -> None:
        rows.append((what, measured, target, ok))
        print(f"  {what}: {measured} (target {target}) {'ok' if ok else 'MISSED'}", file=sys.stderr, flush=True)

    depths = (2, 8, 32) if args.quick else (2, 8, 32, 64, 128, 256)
    seconds: dict[int, float] = {}
    against_floor(_llama(**TINY, num_hidden_layers=2), 1)  # first-use costs out of the first row
    for layers in depths:
        ours, floor = against_floor(_llama(**TINY, num_hidden_layers=layers), args.rounds)
        seconds[layers] = ours
        add(f"tiny LLaMA (hidden 256), {layers} layers: profile / floor", f"{ours:.3f} s / {floor:.3f} s = "
            f"{ours / floor:.2f}x ({ours / layers * 1000:.1f} ms a layer)", "report", True)
    if 256 in seconds:
        ratio = seconds[256] / seconds[128]
        add("tiny LLaMA: profile at 256 layers / at 128 layers", f"{ratio:.2f}x", "<= 2.5x (linear: 2x)", ratio <= 2.5)
    for name in ("LLaMA-2-7B",) if args.quick else tuple(SHAPES):
        ours, floor = against_floor(_llama(**SHAPES[name]), args.rounds if name == "LLaMA-2-7B" else 1)
        target, ok = ("<= 0.25x", ours / floor <= 0.25) if name == "LLaMA-3.1-405B" else ("report", True)
        add(f"{name} shape n={N}: profile / floor", f"{ours:.2f} s / {floor:.2f} s = {ours / floor:.2f}x",
            target, ok)
    many, one, one_run, same = decoder_sweep(args.rounds)
    add(f"LLaMA-2-7B shape: sweep of {len(SWEEP)} lengths (torch backend, one run: {one_run}) / one profile at n=512",
        f"{many:.3f} s / {one:.3f} s = {many / one:.2f}x; profiles equal to one per length: {same}", "<= 2x",
        many / one <= 2 and same and one_run)

    print("| measurement | CPU seconds | target | |")
    print("|---|---|---|---|")
    for what, measured, target, ok in rows:
        print(f"| {what} | {measured} | {target} | {'ok' if ok else '**missed**'} |")
    return 0 if all(ok for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
