#!/usr/bin/env python
"""RLHF's train -> generate move inside real Megatron-LM, side by side in one job: our
weights-only switch (`ElasticJob.weights_to`, attached with `megatron_lm.job.elastic_job`)
against megatron-core's own refit (`megatron.core.resharding.swap_model_weights(src, dst,
"gloo")`, the snapshot's own megatron-core), on Megatron-LM's training objects
(`setup_model_and_optimizer`'s, one `train_step` taken), into the same generation layout;
both targets are built by Megatron-LM's model provider at G, without DDP or optimizer
(`dynatrain_megatron.bench.rlhf` runs and prints the comparison).

Copies Megatron-LM (default: the latest release, ../shared/megatron-lm/core_v0.19.0;
`MEGATRON_LM=DIR` another supported checkout), patches the copy and runs this file in it
as a Megatron-LM job on gloo ranks (the tests' CPU flags and tiny GPT, or `--hidden-size`
/ `--num-layers` for a larger one):

    python scripts/bench_rlhf_megatron_lm.py [--train-tp 2 --train-pp 2] [--generate tp2pp1dp2]
        [--nproc 4] [--repeat 3] [--hidden-size 64 --num-layers 4] [--experts 4 --train-ep 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _in_job() -> int:
    """A rank of the Megatron-LM job."""
    sys.path.insert(0, str(ROOT / "examples"))
    import torch.distributed as dist
    from megatron.training import get_args

    import rlhf_megatron_lm as ex
    from dynatrain_megatron.bench.rlhf import compare_with_refit, report_lines
    from dynatrain_megatron.megatron_lm.job import elastic_job
    from dynatrain_megatron.transition.switch_types import SwitchOptions

    def add_args(parser):
        ex.add_rlhf_args(parser)
        parser.add_argument("--bench-repeat", type=int, default=3)
        return parser

    gpt = ex.start_megatron_lm(add_args)
    args = get_args()
    training = ex.MegatronLMTraining(gpt)
    training.step()
    # the default placement on both sides: the refit knows no other
    job = elastic_job(training.model, training.optimizer, training.scheduler, training.config,
                      model_provider=training.model_provider,
                      options=SwitchOptions(placement="default"))
    r = compare_with_refit(job, args.rlhf_generate, args.bench_repeat)
    if dist.get_rank() == 0:
        a = job.current().layout
        print(f"BENCH train {a} -> generate {args.rlhf_generate}, Megatron-LM GPT "
              f"(hidden {args.hidden_size}, {args.num_layers} layers), "
              f"{dist.get_world_size()} gloo ranks, median of {args.bench_repeat}", flush=True)
        for line in report_lines(r, args.rlhf_generate):
            print("BENCH" + line, flush=True)
    dist.barrier()
    return 0 if r["ours_correct"] else 1  # the refit's own errors are findings, printed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-tp", type=int, default=2)
    p.add_argument("--train-pp", type=int, default=2)
    p.add_argument("--generate", default="tp2pp1dp2")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=0,
                   help="an MoE model with this many experts (SequentialMLP, top-2)")
    p.add_argument("--train-ep", type=int, default=1)
    p.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))  # the helpers the tests launch Megatron-LM with
    if os.environ.get("MEGATRON_LM"):
        os.environ["DYNATRAIN_MEGATRON_LM"] = os.environ["MEGATRON_LM"]
    from megatron_lm_runs import CPU_FLAGS, TINY_GPT, layout_flags, run_megatron_lm
    from megatron_lm_tree import copy_tree

    work = Path(a.work or tempfile.mkdtemp(prefix="bench-rlhf-megatron-lm-"))
    tree = copy_tree(work / "megatron-lm", patched=True)
    size = {"--hidden-size": str(a.hidden_size), "--num-layers": str(a.num_layers)}
    model = [size.get(f, f) if i and TINY_GPT[i - 1] in size else f
             for i, f in enumerate(TINY_GPT)]
    moe = (["--num-experts", str(a.experts), "--moe-router-topk", "2",
            "--moe-ffn-hidden-size", str(a.hidden_size)] if a.experts else [])
    ep = {"expert_model_parallel_size": a.train_ep} if a.train_ep > 1 else {}
    flags = CPU_FLAGS + model + moe + layout_flags(a.train_tp, a.train_pp, **ep) + [
        "--train-iters", "10", "--rlhf-generate", a.generate, "--bench-repeat", str(a.repeat)]
    t0 = time.perf_counter()
    log = run_megatron_lm(tree, a.nproc, flags, work / "bench.log", script=Path(__file__))
    for line in log.splitlines():
        if line.startswith("BENCH"):
            print(line[len("BENCH"):])
    print(f"  wall {time.perf_counter() - t0:.0f} s (log {work / 'bench.log'})")
    return 0


if __name__ == "__main__":
    sys.exit(_in_job() if "LOCAL_RANK" in os.environ else main())
