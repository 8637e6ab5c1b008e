"""Benchmark of the layout advisor on paper (issue 18), with the H100 defaults.

    PYTHONPATH=. python scripts/bench_suggest.py [--out docs/bench/suggest.md]

Llama-3-70B on 128 and 96 GPUs of 80 GB: the top suggestions beside the configuration
NVIDIA publishes for the model (NeMo's `llama3_70b` pre-training recipe on Megatron-core:
TP4 PP4 VPP5 CP2, sequence 8192, micro-batch 1, global batch 512), estimated with the same
model; Qwen3-235B-A22B on 256 and 4096 GPUs: time to enumerate and rank (one core).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from dynatrain_megatron.advisor import Calibration, SearchSpace, Workload, suggest
from dynatrain_megatron.advisor.enumerate import enumerate_layouts
from dynatrain_megatron.advisor.memory import memory_estimate
from dynatrain_megatron.advisor.step_time import step_estimate
from dynatrain_megatron.advisor.suggest import schedulable_microbatches
from dynatrain_megatron.configs import load_model as resolve_model
from dynatrain_megatron.vps.layout import Layout

MEM = 80 * 10 ** 9
PUBLISHED = "NeMo llama3_70b recipe (TP4 PP4 VPP5 CP2)"


def row(spec, lay: Layout, work: Workload, cal: Calibration, tag: str) -> str:
    m = schedulable_microbatches(work, lay)
    mem = memory_estimate(spec, lay, work, cal, m)
    st = step_estimate(spec, lay, work, cal, m)
    tok = work.global_batch_size * work.seq_length / st.step_seconds
    return (f"| {tag} | `{lay}` | {st.step_seconds:.2f} | {tok / lay.world_size:,.0f} | "
            f"{(mem.peak_bytes + cal.reserve_bytes) / 1e9:.1f} | {mem.state_bytes / 1e9:.1f} | "
            f"{mem.activation_bytes / 1e9:.1f} |")


def llama(world: int, gbs: int, cal: Calibration) -> list[str]:
    spec = resolve_model("llama3-70b")
    work = Workload(1, gbs, 8192)
    t0 = time.perf_counter()
    s = suggest(spec, world, work, cal, device_memory_bytes=MEM, top=5, transformer_engine=True)
    dt = time.perf_counter() - t0
    out = [f"### Llama-3-70B on {world} GPUs (80 GB), micro-batch 1, global batch {gbs}, "
           f"sequence 8192", "",
           f"{s.valid_layouts} valid layouts, {s.ranked_layouts} run the batch, ranked in "
           f"{dt:.2f} s.", "",
           "| | layout | step s | tokens/s/GPU | memory GB | state GB | activations GB |",
           "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(s.rows, 1):
        out.append(row(spec, r.layout, work, cal, f"#{i}"))
    pub = Layout(tp=4, pp=4, vpp=5, cp=2, dp=world // 32)
    out.append(row(spec, pub, work, cal, PUBLISHED))
    return out + [""]


def qwen(world: int, gbs: int, cal: Calibration) -> list[str]:
    spec = resolve_model("qwen3-235b-a22b")
    work = Workload(1, gbs, 4096)
    t0 = time.process_time()  # CPU time: the machine may be shared
    n = len(enumerate_layouts(spec, world, SearchSpace(), transformer_engine=True))
    t1 = time.process_time()
    s = suggest(spec, world, work, cal, device_memory_bytes=MEM, top=3, transformer_engine=True)
    t2 = time.process_time()
    best = "; ".join(f"`{r.layout}` {r.step_seconds:.2f} s, "
                     f"{r.memory_bytes_per_device / 1e9:.1f} GB" for r in s.rows)
    return [f"| {world} | {gbs} | {n:,} | {t1 - t0:.2f} | {t2 - t1:.2f} | {best} |"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="also write the Markdown here")
    args = ap.parse_args()
    cal = Calibration()
    lines = ["# `dynatrain suggest` on paper (H100 defaults)", ""]
    lines += llama(128, 512, cal)
    lines += llama(96, 480, cal)
    lines += ["### Qwen3-235B-A22B: enumeration and ranking time (CPU time, one core)", "",
              "| GPUs | global batch | valid layouts | enumerate s (CPU) | enumerate + rank s (CPU) "
              "| top 3 |",
              "|---|---|---|---|---|---|"]
    lines += qwen(256, 1024, cal)
    lines += qwen(4096, 8192, cal)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
