#!/usr/bin/env python
"""RLHF's train -> generate move, side by side in one run: our weights-only switch
(`ElasticJob.weights_to`) against megatron-core's own weight refit
(`megatron.core.resharding.swap_model_weights(src, dst, "gloo")`, what RL frameworks use
today), on the same live job, into the same generation layout, both targets built as
model chunks only (no DDP, no optimizer) in megatron's default rank order.

Prints, per method (`dynatrain_megatron.bench.rlhf`): bytes moved between ranks, seconds
(first call and calls with the target kept / plan cached), whether the optimizer state was
touched, and whether both targets hold the same weights, bit for bit, rank by rank; with
the refit's known caveats. Inside Megatron-LM: scripts/bench_rlhf_megatron_lm.py.

    python scripts/bench_rlhf.py [--model-config configs/models/tiny-gpt.yaml]
        [--train tp2pp2dp1] [--generate tp4pp1dp1] [--nproc 4] [--repeat 3]

This benchmark uses a dense model and one layout of the training model, where the refit
is correct.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _bench(model_config: str, train_layout: str, gen_layout: str, repeat: int) -> dict:
    from dynatrain_megatron import ElasticJob
    from dynatrain_megatron.bench.rlhf import compare_with_refit
    from dynatrain_megatron.mcore.builders import MegatronBuilder
    from dynatrain_megatron.mcore.session import release, start_job
    from dynatrain_megatron.mcore.train_config import TrainConfig
    from dynatrain_megatron.transition.switch_types import SwitchOptions
    from dynatrain_megatron.vps.model_spec import ModelSpec

    spec = ModelSpec.from_yaml(model_config)
    train = TrainConfig(global_batch_size=8, micro_batch_size=2, train_iters=10)
    tr = start_job(spec, train_layout, train)
    tr.step()
    # the default placement on both sides: the refit knows no other
    job = ElasticJob.from_objects(tr.objs, MegatronBuilder(spec, train),
                                  SwitchOptions(placement="default"))
    r = compare_with_refit(job, gen_layout, repeat)
    release(tr.objs)
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-config", default=str(ROOT / "configs/models/tiny-gpt.yaml"))
    p.add_argument("--train", default="tp2pp2dp1")
    p.add_argument("--generate", default="tp4pp1dp1")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args(argv)
    from dynatrain_megatron.bench.rlhf import report_lines
    from dynatrain_megatron.testing.multiproc import run_on_ranks

    t0 = time.perf_counter()
    r = run_on_ranks(_bench, a.nproc, a.model_config, a.train, a.generate, a.repeat)[0]
    print(f"train {a.train} -> generate {a.generate}, {Path(a.model_config).stem}, "
          f"{a.nproc} gloo ranks, median of {a.repeat}")
    for line in report_lines(r, a.generate):
        print(line)
    print(f"  wall {time.perf_counter() - t0:.0f} s")
    return 0 if r["ours_correct"] else 1  # the refit's own errors are findings, printed


if __name__ == "__main__":
    sys.exit(main())
