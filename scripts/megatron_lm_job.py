"""The main job (`make run`): real Megatron-LM, switched in memory through the signal file,
beside Megatron-LM's own save + restart + load, timed.

Copies Megatron-LM (default: the latest release, the one the whole suite runs on,
`../shared/megatron-lm/core_v0.19.0`; `MEGATRON_LM=DIR` any supported checkout, the user's own), builds its dataset
helper where it has its own megatron-core, patches the copy with our patch
(`megatron_lm.checkout.working_copy`), and runs its own
`pretrain_gpt.py` with the plain torchrun command on gloo ranks (CPU flags):

1. switched: a tp2pp2 job on 4 ranks; `--dynatrain-schedule` switches it to tp1pp2dp2
   exactly after iteration K; then this script plays the operator and writes requests to
   its signal file as the log shows the iterations go by: an impossible tp3pp1 (refused, training goes on), a scale-in to tp1pp2dp1 on 2 ranks
   (the other 2 wait on standby inside Megatron-LM's loop), and a scale-out back to
   tp2pp2 on all 4; the job ends with its switch summary;
2. restart: A trains to K and `--save`s (fully reshardable), exits; a new job `--load`s at
   tp1pp2dp2 and trains on: what Megatron-LM users do today.

Printed: the switch summary, the losses of both up to the scale-in, the switch's stall
(what the job lost to it: the slowest rank's, from `switches.jsonl`) with its parts beside
the restart's, and, measured the same way on both, the wall time from the end of iteration
K at A to the end of iteration K+1 at B (one step at B plus the switch, or plus save + exit
+ restart + load), and their ratio.

    python scripts/megatron_lm_job.py [--nproc 4] [--work DIR]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the torchrun helpers the tests use

from megatron_lm_runs import (CPU_FLAGS, TINY_GPT, layout_flags, losses,  # noqa: E402
                              run_megatron_lm, run_operated)

STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration\s+(\d+)/")
SUMMARY = re.compile(r"dynatrain switches:.*?(?=\n\S*(?:INFO|WARNING|\[|>|\s*$))", re.S)


def iteration_times(text: str) -> dict[int, float]:
    """iteration -> when Megatron-LM logged its end (epoch seconds)."""
    return {int(it): dt.datetime.strptime(ts, "%Y-%m-%d %H:%M:%S.%f").timestamp()
            for ts, it in STAMP.findall(text)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--iters", type=int, default=18)
    p.add_argument("--switch-after", type=int, default=3)
    p.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    args = p.parse_args()
    # the user's own launcher on both sides (the tests' forked launcher would make the
    # restart's start-up, which every rank pays in a fresh interpreter, look cheaper)
    os.environ.setdefault("DYNATRAIN_TEST_LAUNCHER", "torchrun")
    if args.nproc != 4:
        raise SystemExit("--nproc: the operator's requests are written for 4 ranks")
    from dynatrain_megatron.megatron_lm.checkout import working_copy
    from dynatrain_megatron.megatron_lm.patch_tool import default_release, identify

    src = Path(os.environ.get("MEGATRON_LM")
               or ROOT.parent / "shared" / "megatron-lm" / default_release().name)
    work = Path(args.work or tempfile.mkdtemp(prefix="dynatrain-mlm-"))
    work.mkdir(mode=0o700, parents=True, exist_ok=True)  # the signal directory: the job's
    os.chmod(work, 0o700)
    tree = work / "Megatron-LM"
    release = identify(src).release  # an unsupported one is refused here, by name
    shutil.rmtree(tree, ignore_errors=True)  # a fresh copy: --work may hold another release's
    working_copy(src, tree, patched=True)
    print(f"Megatron-LM {release.name} from {src}: patched copy in {tree}")
    k, n = args.switch_after, args.iters
    a, b = layout_flags(2, 2), layout_flags(1, 2)
    # the mock data's sample indices cached as a real corpus's are by default (Megatron-LM
    # writes them beside the data): built once, loaded by every later build and job
    common = CPU_FLAGS + TINY_GPT + ["--train-iters", str(n),
                                     "--data-cache-path", str(work / "data-cache")]
    signal = work / "switch.json"
    for d in ("saved", "resumed"):
        shutil.rmtree(work / d, ignore_errors=True)
    signal.unlink(missing_ok=True)
    # after iteration -> (layout, ranks): one impossible, a scale-in and a scale-out
    # the first switch from the schedule (lands exactly after K, for the timing); then,
    # after iteration -> (layout, ranks): one impossible, a scale-in and a scale-out
    sched = work / "schedule.yaml"
    sched.write_text(f"- {{iteration: {k}, layout: tp1pp2dp2}}\n")
    requests = {k + 2: ("tp3pp1", None), k + 4: ("tp1pp2dp1", 2), k + 8: ("tp2pp2dp1", 4)}

    print(f"1. Megatron-LM switched in memory through its signal file ({args.nproc} ranks)")
    t0 = time.time()
    shutil.rmtree(work / "logs", ignore_errors=True)
    sw = run_operated(tree, args.nproc, common + a + [
        "--dynatrain", "--dynatrain-schedule", str(sched),
        "--dynatrain-signal-file", str(signal), "--dynatrain-log-dir", str(work / "logs")],
        work / "switched.log", signal, requests)
    t1 = time.time()
    print(f"2. Megatron-LM's restart: save at {k}, a new job loads at tp1pp2dp2")
    saved = run_megatron_lm(tree, args.nproc, common + a + [
        "--save", str(work / "saved"), "--save-interval", str(k), "--exit-interval", str(k)],
        work / "saved.log")
    t2 = time.time()
    resumed = run_megatron_lm(tree, args.nproc, common + b + [
        "--load", str(work / "saved"), "--exit-interval", str(k + 2)], work / "resumed.log")
    t3 = time.time()

    # every rank logs its summary; rank 0's (never on standby) has every switch
    summary = max(SUMMARY.findall(sw), key=len, default="(no switch summary in the log)")
    print("\n" + summary.strip())
    pause = [float(x) for x in re.findall(
        r"switched tp2pp2dp1 -> tp1pp2dp2 .*?pause ([0-9.]+) s", sw)]
    ts_sw, ts_saved, ts_res = (iteration_times(t) for t in (sw, saved, resumed))
    ours = ts_sw[k + 1] - ts_sw[k]
    theirs = ts_res[k + 1] - ts_saved[k]
    l_sw, l_ref = losses(sw), {**losses(saved), **losses(resumed)}
    print("\niteration  switched      restart")
    for i in sorted(l_sw):
        note = {k: "  <- switch to tp1pp2dp2",
                k + 2: f"  <- the restart prints the mean of {k + 1} and {k + 2} "
                       f"(Megatron-LM's log, NVIDIA/Megatron-LM#6237)"}.get(i, "")
        print(f"{i:>9}  {l_sw[i]:<12}  {l_ref.get(i, '-'):<12}{note}")
    rows = [json.loads(x) for x in (work / "logs" / "switches.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r["kind"] == "switch" and r["iteration"] == k)
    slow = first["stall"]["slowest"]
    print(f"\nthe tp2pp2 -> tp1pp2dp2 switch after iteration {k}: stall {slow['stall_s']:.3f} s "
          f"(slowest rank r{slow['rank']}), pause {max(pause):.3f} s (slowest rank)")
    print("  its parts: " + ", ".join(f"{n} {v:.3f}" for n, v in slow["parts"].items())
          + f"; other {slow['unaccounted_s']:.3f} (sum of parts "
          f"{sum(slow['parts'].values()):.3f} s)")
    print(f"  --save + restart + --load instead: {ts_res[k + 1] - ts_saved[k]:.2f} s from the "
          f"end of iteration {k} to the end of {k + 1} (the switch: {ours:.2f} s)")
    print(f"end of iteration {k} at A -> end of iteration {k + 1} at B:")
    print(f"  in memory:                       {ours:7.2f} s")
    print(f"  --save + restart + --load:       {theirs:7.2f} s "
          f"(save job {t2 - t1:.1f} s, load job {t3 - t2:.1f} s in all)")
    print(f"  ratio:                           {theirs / ours:7.1f}x")
    print(f"switched job {t1 - t0:.1f} s in all; logs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
