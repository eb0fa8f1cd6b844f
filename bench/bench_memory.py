"""The memory model's forecast against the measured peak, per layout and pipeline rank: the
table of tests/test_memory_measured.py (same layouts, same runs), printed as markdown.

    python bench/bench_memory.py            # 2- and 4-rank layouts, about a minute on 2 cores
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastpar.testing import run_ranks  # noqa: E402
from tests.test_memory_measured import BASE, BENCH_ONLY, LAYOUTS, _measure  # noqa: E402

EVERY = {w: {**LAYOUTS.get(w, {}), **BENCH_ONLY.get(w, {})} for w in {*LAYOUTS, *BENCH_ONLY}}


def main():
    print(f"model {BASE['model']}, seq {BASE['seq_len']}, micro-batch "
          f"{BASE['micro_batch_size']}, global batch {BASE['global_batch_size']}, fp32 unless "
          f"named; GB = 1e9 bytes\n")
    print("| layout | rank | forecast GB | measured GB | error |")
    print("|---|---|---|---|---|")
    for world in sorted(EVERY):
        ranks = run_ranks(_measure, world, EVERY, timeout=600)
        for name in EVERY[world]:
            seen = set()
            for rank, per_layout in enumerate(ranks):
                peak, model, _ = per_layout[name]
                key = (round(peak, 4), round(model, 4))
                if key in seen:            # ranks of one role measure the same
                    continue
                seen.add(key)
                print(f"| {name} | {rank} | {model:.4f} | {peak:.4f} | "
                      f"{(model - peak) / peak:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
