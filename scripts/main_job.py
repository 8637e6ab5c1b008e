#!/usr/bin/env python
"""The README's main job: a multi-rank CPU training run of a real megatron-core GPT.

Launches `scripts/pretrain_gpt.py` under torchrun on N gloo ranks and streams its log.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from dynatrain_megatron.integration.multiproc import free_port

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--model-config", default=str(ROOT / "configs/models/tiny-gpt.yaml"))
    ap.add_argument("--train-iters", type=int, default=20)
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
           "--master_port", str(free_port()), str(ROOT / "scripts/pretrain_gpt.py"),
           "--model-config", args.model_config,
           "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
           "--use-distributed-optimizer", "--micro-batch-size", "2", "--global-batch-size", "16",
           "--train-iters", str(args.train_iters), "--lr", "1e-2", "--min-lr", "1e-3"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
