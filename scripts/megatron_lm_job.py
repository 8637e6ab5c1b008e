"""Real Megatron-LM, switched in memory, beside Megatron-LM's own save + restart + load.

Copies Megatron-LM (default `../shared/megatron-lm/core_v0.16.1`, or `MEGATRON_LM=DIR`, the
user's own checkout), patches the copy with `dynatrain megatron-lm patch`, and runs its own
`pretrain_gpt.py` with the plain torchrun command on gloo ranks (CPU flags):

1. switched: A trains, a `--dynatrain-schedule` switch lands after iteration K at B, the job
   trains on to N;
2. restart: A trains to K and `--save`s (fully reshardable), exits; a new job `--load`s at B
   and trains to N: what Megatron-LM users do today.

Printed: the losses of both, our pause (from the switch's log line) and, measured the same way
on both, the wall time from the end of iteration K at A to the end of iteration K+1 at B
(one step at B plus the switch, or plus save + exit + restart + load), and their ratio.

    python scripts/megatron_lm_job.py [--nproc 4] [--work DIR]
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the torchrun helpers the tests use

from megatron_lm_runs import CPU_FLAGS, TINY_GPT, layout_flags, losses, run_megatron_lm  # noqa: E402

STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration\s+(\d+)/")


def iteration_times(text: str) -> dict[int, float]:
    """iteration -> when Megatron-LM logged its end (epoch seconds)."""
    return {int(it): dt.datetime.strptime(ts, "%Y-%m-%d %H:%M:%S.%f").timestamp()
            for ts, it in STAMP.findall(text)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--switch-after", type=int, default=4)
    p.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    args = p.parse_args()
    src = Path(os.environ.get("MEGATRON_LM") or ROOT.parent / "shared/megatron-lm/core_v0.16.1")
    work = Path(args.work or tempfile.mkdtemp(prefix="dynatrain-mlm-"))
    tree = work / "Megatron-LM"
    if not tree.exists():
        shutil.copytree(src, tree)
    from dynatrain_megatron.megatron_lm.patch_tool import patch_checkout

    state, written = patch_checkout(tree)
    print(f"Megatron-LM {state.release.name} from {src}: "
          f"{'patched ' + ', '.join(written) if written else 'already patched'} in {tree}")
    k, n = args.switch_after, args.iters
    a, b = layout_flags(2, 2), layout_flags(1, 2)
    sched = work / "schedule.yaml"
    sched.write_text(f"- {{iteration: {k}, layout: tp1pp2dp2}}\n")
    common = CPU_FLAGS + TINY_GPT + ["--train-iters", str(n)]
    for d in ("saved", "resumed"):
        shutil.rmtree(work / d, ignore_errors=True)

    print(f"1. switched in memory: tp2pp2 -> tp1pp2dp2 after iteration {k} ({args.nproc} ranks)")
    sw = run_megatron_lm(tree, args.nproc, common + a + [
        "--dynatrain", "--dynatrain-schedule", str(sched)], work / "switched.log")
    print(f"2. Megatron-LM's restart: save at {k}, new job loads at tp1pp2dp2")
    t0 = time.time()
    saved = run_megatron_lm(tree, args.nproc, common + a + [
        "--save", str(work / "saved"), "--save-interval", str(k), "--exit-interval", str(k)],
        work / "saved.log")
    t1 = time.time()
    resumed = run_megatron_lm(tree, args.nproc, common + b + ["--load", str(work / "saved")],
                              work / "resumed.log")
    t2 = time.time()

    pause = [float(x) for x in re.findall(r"switched tp2pp2dp1 -> tp1pp2dp2 .*?pause ([0-9.]+) s",
                                          sw)]
    ts_sw, ts_saved, ts_res = (iteration_times(t) for t in (sw, saved, resumed))
    ours = ts_sw[k + 1] - ts_sw[k]
    theirs = ts_res[k + 1] - ts_saved[k]
    l_sw, l_ref = losses(sw), {**losses(saved), **losses(resumed)}
    print("\niteration  switched      restart")
    for i in sorted(l_sw):
        print(f"{i:>9}  {l_sw[i]:<12}  {l_ref.get(i, '-'):<12}{'  <- switch' if i == k else ''}")
    print(f"\nour pause (slowest rank, from the log): {max(pause):.3f} s")
    print(f"end of iteration {k} at A -> end of iteration {k + 1} at B:")
    print(f"  in memory:                       {ours:7.2f} s")
    print(f"  --save + restart + --load:       {theirs:7.2f} s "
          f"(save job {t1 - t0:.1f} s, load job {t2 - t1:.1f} s in all)")
    print(f"  ratio:                           {theirs / ours:7.1f}x")
    print(f"logs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
