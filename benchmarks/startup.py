"""Where start-up time goes: the plugin's import, a pytest session with and without it, a first profile.

Every figure is the median of several fresh child processes, taken side by side in this one run (the
machine is shared and noisy: compare the ratios, not the seconds). Usage:

    python benchmarks/startup.py            # about a minute on 2 cores
    python benchmarks/startup.py --runs 3

Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIRST_PROFILE = """
import time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from transformers import BertConfig, BertModel
t2 = time.perf_counter()
import pytest_attncost
t3 = time.perf_counter()
pytest_attncost.profile(lambda: BertModel(BertConfig()), 512)
t4 = time.perf_counter()
pytest_attncost.clear_cache()
pytest_attncost.profile(lambda: BertModel(BertConfig()), 1024)
t5 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)
"""


def wall(argv: list[str], cwd: str | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=cwd, check=True, capture_output=True)
    return time.perf_counter() - start


def import_times() -> tuple[float, float, float, bool]:
    """(whole import of pytest_attncost.plugin, pytest's part, the plugin's own modules, torch imported?)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "import pytest_attncost.plugin"],
                          capture_output=True, text=True, check=True)
    rows = [re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)", line) for line in done.stderr.splitlines()]
    rows = [row for row in rows if row]
    cumulative = {row.group(4): int(row.group(2)) / 1e6 for row in rows}
    own = sum(int(row.group(1)) for row in rows if row.group(4).startswith("pytest_attncost")) / 1e6
    return cumulative["pytest_attncost.plugin"], cumulative.get("pytest", 0.0), own, "torch" in cumulative


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs

    imports = [import_times() for _ in range(runs)]
    whole, pytest_part, own = (statistics.median(i[k] for i in imports) for k in range(3))
    torch_imported = any(i[3] for i in imports)

    with tempfile.TemporaryDirectory() as empty:
        Path(empty, "test_nothing.py").write_text("def test_nothing():\n    pass\n")
        on, off = [], []
        for _ in range(runs):  # alternating, so that drift of the machine hits both alike
            on.append(wall([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=empty))
            off.append(wall([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:attncost"],
                            cwd=empty))
    session_on, session_off = statistics.median(on), statistics.median(off)

    firsts = []
    for _ in range(max(1, runs // 2)):
        done = subprocess.run([sys.executable, "-c", FIRST_PROFILE], capture_output=True, text=True, check=True)
        firsts.append([float(x) for x in done.stdout.split()])
    torch_s, transformers_s, plugin_s, first_s, second_s = (statistics.median(f[k] for f in firsts) for k in range(5))

    print("| what | seconds | note |")
    print("|---|---|---|")
    print(f"| `import pytest_attncost.plugin` | {whole:.3f} | pytest itself {pytest_part:.3f}; the plugin's own "
          f"modules {own:.3f}; torch imported: {'yes' if torch_imported else 'no'} |")
    print(f"| a pytest session of one empty test, plugin on | {session_on:.3f} | ratio to off: "
          f"{session_on / session_off:.2f} |")
    print(f"| the same, `-p no:attncost` | {session_off:.3f} | |")
    print(f"| `import torch` | {torch_s:.3f} | first profile, broken down: |")
    print(f"| `from transformers import BertModel` | {transformers_s:.3f} | |")
    print(f"| `import pytest_attncost` (after torch) | {plugin_s:.3f} | |")
    print(f"| first `profile(BertModel factory, 512)` | {first_s:.3f} | build on meta, trace, split |")
    print(f"| second profile (cache cleared, n=1024) | {second_s:.3f} | the one-time costs gone |")


if __name__ == "__main__":
    main()
