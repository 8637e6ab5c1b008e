#!/usr/bin/env python
"""Benchmark the analytic Virtual Parameter Space on large models and worlds (one core).

Times, from cold caches: building the layout and the byte totals of every state kind for
every rank, then the fragments of single ranks on demand (first rank, last rank, and one
in the middle). Usage: python scripts/bench_vps.py [--repeat N]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from dynatrain_megatron.vps import analytic, naming
from dynatrain_megatron.vps.layout import Layout
from dynatrain_megatron.configs import load_model

ROOT = Path(__file__).resolve().parents[1]
CASES = [  # (model config, layout, world size, DDP bucket size)
    ("llama3-70b", "tp8pp4", 128, None),
    ("llama3-70b", "tp8pp4vpp5", 128, 40_000_000),
    # 94 layers: uniform PP needs pp | 94, so pp2 (megatron's uneven first/last stages
    # are not modelled by Layout yet)
    ("qwen3-235b-a22b", "tp4pp2ep32etp1", 4096, None),
    ("qwen3-235b-a22b", "tp2pp2ep64etp1", 4096, 40_000_000),
]


def _cold() -> None:
    naming.chunk_param_specs.cache_clear()
    naming.logical_tensors.cache_clear()
    analytic.analytic_layout.cache_clear()


def bench(model: str, layout_text: str, world: int, bucket, repeat: int) -> None:
    spec = load_model(model)
    lay = Layout.parse(layout_text, world)
    best_all, best_one, nfrag = float("inf"), float("inf"), 0
    for _ in range(repeat):
        _cold()
        t0 = time.perf_counter()
        al = analytic.analytic_layout(spec, lay, bucket)
        per_rank = al.bytes_per_rank()
        t1 = time.perf_counter()
        frs = [al.fragments(r) for r in (0, world // 2 + 3, world - 1)]
        t2 = time.perf_counter()
        best_all, best_one = min(best_all, t1 - t0), min(best_one, (t2 - t1) / 3)
        nfrag = max(len(f) for f in frs)
    tot = sum(int(v.sum()) for v in per_rank.values())
    mx = max(int(sum(v[r] for v in per_rank.values())) for r in range(0, world, max(1, world // 64)))
    print(f"{model:16s} {str(lay):24s} W={world:5d} bucket={str(bucket):9s} "
          f"all-ranks totals {best_all * 1e3:7.1f} ms | fragments of one rank "
          f"{best_one * 1e3:6.1f} ms (<= {nfrag} fragments) | state {tot / 2**40:.2f} TiB, "
          f"max/rank ~{mx / 2**30:.1f} GiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    for case in CASES:
        bench(*case, repeat=a.repeat)


if __name__ == "__main__":
    main()
