#!/usr/bin/env python
"""How much a plan made from every rank's live metadata costs, beside the analytic plan.

Each rank's records are generated from the analytic layout (what megatron-core's sharded
metadata gives for a model the analytic layout describes), then planned by both planners
in one run, on one core: records per side, the pickled bytes one rank contributes to the
gather (largest rank), the metadata planner's time vs the analytic planner's (cold caches),
and both plans' bytes moved. This is what answers whether the metadata plan could be made
for every switch, or only where the analytic layout does not describe the model.

    python scripts/bench_metadata_plan.py [--model llama3-70b] [--a tp8pp4] [--b tp4pp8] [--world 64]
"""
from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynatrain_megatron.routing import build_plan, clear_caches  # noqa: E402
from dynatrain_megatron.routing.metadata_plan import StateRecord, metadata_plan  # noqa: E402
from dynatrain_megatron.vps import KINDS, OPT_KINDS, Layout, analytic_layout  # noqa: E402
from dynatrain_megatron.vps.model_spec import ModelSpec  # noqa: E402


def records(spec, layout, kinds):
    al = analytic_layout(spec, layout)
    out, biggest = [], 0
    for v in range(layout.world_size):
        mine = [StateRecord(f.key, f.kind, f.box, v, f.chunk, f.local_name, f.local_offsets)
                for f in al.fragments(v, kinds)]
        # what a rank sends: the optimizer kinds once (they share their boxes)
        sent = [r.as_tuple() for r in mine if r.kind in ("param", "main_param")]
        biggest = max(biggest, len(pickle.dumps(sent)))
        out += mine
    return out, biggest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-350m")
    p.add_argument("--a", default="tp2pp2")
    p.add_argument("--b", default="tp1pp4")
    p.add_argument("--world", type=int, default=16)
    p.add_argument("--weights", action="store_true", help="move the weights too")
    o = p.parse_args()
    spec = ModelSpec.from_yaml(ROOT / "configs" / "models" / f"{o.model}.yaml")
    A, B = Layout.parse(o.a, o.world), Layout.parse(o.b, o.world)
    kinds = KINDS if o.weights else OPT_KINDS
    clear_caches()
    t0 = time.perf_counter()
    ana = build_plan(spec, A, B, kinds=kinds)
    t_ana = time.perf_counter() - t0
    src, sa = records(spec, A, kinds)
    dst, sb = records(spec, B, kinds)
    t0 = time.perf_counter()
    meta = metadata_plan(src, dst, src_layout=A, dst_layout=B, src_devices=range(A.world_size),
                         dst_devices=range(B.world_size), kinds=kinds,
                         itemsize={k: (2 if spec.params_dtype != "fp32" and k == "param" else 4)
                                   for k in KINDS})
    t_meta = time.perf_counter() - t0
    print(f"{o.model} {A} -> {B} ({'all kinds' if o.weights else 'optimizer kinds'})")
    print(f"  records: A {len(src)}, B {len(dst)}; largest rank's gather payload "
          f"{max(sa, sb) / 1024:.1f} KiB")
    print(f"  analytic plan  {t_ana * 1e3:9.1f} ms   moved {ana.stats.moved_bytes / 2**20:10.1f} MiB")
    print(f"  metadata plan  {t_meta * 1e3:9.1f} ms   moved {meta.stats.moved_bytes / 2**20:10.1f} MiB")
    print(f"  ratio metadata/analytic time: {t_meta / t_ana:.1f}x; bytes equal: "
          f"{meta.stats.moved_bytes == ana.stats.moved_bytes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
