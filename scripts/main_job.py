#!/usr/bin/env python
"""The README's main job: a 4-rank CPU training run of a real megatron-core GPT that is
asked, through its signal file, to switch layout four times while it trains
(tp2pp2 -> tp1pp2dp2 -> tp4pp1dp1 -> tp2pp1dp1 on 2 ranks, the other 2 on standby ->
tp2pp1dp2 on all 4 again), plus one impossible request that must be refused while
training goes on. It ends with the job's summary table of the switches.

This script plays the operator: it launches `scripts/pretrain_gpt.py` under torchrun with
`--dynatrain` flags, watches the log, and writes requests with the same atomic helper as
`dynatrain request`.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from dynatrain_megatron import process_env
from dynatrain_megatron.elastic.signal_file import write_request
from dynatrain_megatron.loop.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
# iteration seen in the log -> (layout, ranks) to request (one impossible on purpose); the
# last two change the device count: 2 ranks go on standby, then come back
REQUESTS = {3: ("tp1pp2dp2", None), 6: ("tp3pp1", None), 8: ("tp4pp1dp1", None),
            11: ("tp2pp1dp1", 2), 14: ("tp2pp1dp2", 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--model-config", default=str(ROOT / "configs/models/tiny-gpt.yaml"))
    ap.add_argument("--train-iters", type=int, default=20)
    ap.add_argument("--run-dir", default=str(ROOT / "runs/main"))
    args = ap.parse_args()
    run = Path(args.run_dir)
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(mode=0o700, parents=True)  # the signal directory: only the job may write
    signal = run / "switch.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
           "--master_port", str(free_port()), str(ROOT / "scripts/pretrain_gpt.py"),
           "--model-config", args.model_config,
           "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
           "--use-distributed-optimizer", "--micro-batch-size", "2", "--global-batch-size", "16",
           "--train-iters", str(args.train_iters), "--lr", "1e-2", "--min-lr", "1e-3",
           "--dynatrain", "--dynatrain-signal-file", str(signal),
           "--dynatrain-log-dir", str(run), "--dynatrain-ranks-per-node", "4",
           "--dynatrain-compare-checkpoint"]
    env = process_env.apply(dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    pending = dict(REQUESTS)
    pat = re.compile(r"iteration\s+(\d+)/")
    for line in proc.stdout:
        if line.startswith("W") and "torch/distributed" in line:
            continue  # torchrun's OMP_NUM_THREADS notice
        sys.stdout.write(line)
        m = pat.search(line)
        if m and int(m.group(1)) in pending:
            layout, world = pending.pop(int(m.group(1)))
            write_request(signal, layout, world)
            print(f"[operator] requested layout {layout}"
                  + (f" on {world} ranks" if world else "") + f" via {signal}", flush=True)
    rc = proc.wait()
    outcomes = sorted(p.name for p in run.glob("switch.json.*"))
    print(f"[operator] signal files handled: {outcomes}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
