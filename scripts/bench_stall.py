"""The stall a user sees, inside real Megatron-LM: a ~10M-parameter GPT (8 layers, hidden
256, sequence 128, vocabulary 8192) on 4 gloo CPU ranks, switched tp2pp2 -> tp1pp2dp2 by
`--dynatrain-schedule` exactly after iteration K, beside Megatron-LM's own `--save` at K,
exit, and a new job that `--load`s at tp1pp2dp2, in one run.

Printed, each from its own source:
* the stall: Megatron-LM's elapsed time of iteration K+1 (the switching one) minus the
  median of the steady iterations at B (K+2..N), from its own log lines;
* our accounting of it (`switches.jsonl`): the slowest rank's stall and the sum of its parts,
  the slowest rank's pause and transfer, the longest transfer over the ranks (the one the
  others wait for at the commit vote) and every rank's pause and transfer;
* the iteration after B's first steps were measured, where A's deferred release runs (its
  excess over a steady iteration, and our accounting of that release), and the job's loss
  in all: the stall plus that excess;
* the restart path's stall, measured the same way: from the end of iteration K at A (the
  saving job's line) to the end of iteration K+1 in the resuming job, minus its steady
  iteration;
and the goals' ratios: stall <= 1.25x the slowest pause, pause <= 2x its transfer, stall at
least 50x smaller than the restart's.

The mock data gets a `--data-cache-path` (every job of the run shares it), as real data has
its indices cached beside it: without one Megatron-LM rebuilds the mock indices of ~2M
samples per split at every data-iterator build, seconds on a CPU.

`DYNATRAIN_MEGATRON_LM` (a release name or a checkout, as the tests take it) or `MEGATRON_LM`
(a checkout) chooses Megatron-LM; default the latest supported release.

    python scripts/bench_stall.py [--work DIR] [--iters N] [--switch-after K] [--no-restart]
                                  [--repeat N]
                                  [--megatron-flag=--timing-log-level=2 ...]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the torchrun helpers the tests use

from megatron_lm_runs import CPU_FLAGS, layout_flags, run_megatron_lm  # noqa: E402

from dynatrain_megatron.loop.stall import STEADY_STEPS  # noqa: E402

MODEL = [
    "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8",
    "--seq-length", "128", "--max-position-embeddings", "128",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--use-distributed-optimizer",
    "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "1000",
    "--seed", "1234", "--ckpt-format", "torch_dist", "--dist-ckpt-optim-fully-reshardable",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8192",
    "--split", "99,1,0",
]
LINE = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration\s+(\d+)/\s*\d+ \|.*?"
                  r"elapsed time per iteration \(ms\): ([0-9.]+)")


def iterations(text: str) -> dict[int, tuple[float, float]]:
    """iteration -> (when Megatron-LM logged its end, epoch s; its elapsed time, s)."""
    return {int(it): (dt.datetime.strptime(ts, "%Y-%m-%d %H:%M:%S.%f").timestamp(),
                      float(ms) / 1000) for ts, it, ms in LINE.findall(text)}


def report_run(sw: str, logs: Path, k: int, n: int) -> tuple[float, float, float]:
    """Print one switched job's figures (Megatron-LM's log `sw`, our `logs`); returns its
    stall, slowest rank's pause and that rank's transfer."""
    it_sw = iterations(sw)
    steady = statistics.median(it_sw[i][1] for i in range(k + 2, n + 1))
    stall = it_sw[k + 1][1] - steady
    records = [json.loads(line) for line in (logs / "switches.jsonl").read_text()
               .splitlines()]
    rec = next(r for r in records if r.get("kind") == "switch")
    slow = rec["stall"]["slowest"]
    ranks = rec["stall"]["ranks"]
    pause = max(r["pause_s"] for r in ranks)
    pauser = max(ranks, key=lambda r: r["pause_s"])
    print(f"\nMegatron-LM's iteration times: steady at B {steady * 1000:.1f} ms (median of "
          f"{k + 2}..{n}); iteration {k + 1} (the switch) {it_sw[k + 1][1] * 1000:.1f} ms")
    print(f"stall (Megatron-LM's switching iteration - steady at B): {stall:7.3f} s")
    print(f"our accounting, slowest rank (r{slow['rank']}):               {slow['stall_s']:7.3f} s,"
          f" sum of parts {sum(slow['parts'].values()):.3f} s, other "
          f"{slow['unaccounted_s']:.3f} s")
    print("  parts: " + ", ".join(f"{n_} {v:.3f}" for n_, v in slow["parts"].items()))
    if slow.get("first_step_s") is not None:
        gc_first, gc_steady = (slow.get(k) or 0.0 for k in ("first_step_gc_s", "steady_step_gc_s"))
        faults = ""
        if slow.get("first_step_faults") is not None and slow.get("steady_step_faults") is not None:
            faults = (f"; minor page faults {slow['first_step_faults']} / "
                      f"{slow['steady_step_faults']}")
        print(f"  first step at B {slow['first_step_s']:.3f} s vs steady "
              f"{slow['steady_step_s']:.3f} s; garbage collection in them "
              f"{gc_first:.3f} s / {gc_steady:.3f} s{faults}")
    if rec.get("prepared"):
        print("  prepared in the background while A trained: " + ", ".join(
            f"{n_} {v:.3f}" for n_, v in rec["prepared"].items()))
    print(f"slowest rank's pause (r{pauser['rank']}):                  {pause:7.3f} s, "
          f"its transfer {pauser['transfer_s']:.3f} s")
    # a rank with a small share of the transfer waits for the others at the commit vote
    # (its `votes` part): its pause follows the longest transfer, not its own
    longest = max(ranks, key=lambda r: r["transfer_s"])
    print(f"longest transfer (r{longest['rank']}):                     "
          f"{longest['transfer_s']:7.3f} s; per rank pause/transfer: " + ", ".join(
              f"r{r['rank']} {r['pause_s']:.3f}/{r['transfer_s']:.3f}" for r in ranks))
    # A's release left to the step boundary after B's first steps are measured (its
    # groups' destroy, the allocator's trim) lands in that iteration's line
    after = k + 2 + STEADY_STEPS
    if after in it_sw:
        extra = it_sw[after][1] - steady
        deferred = max(r.get("release_a_deferred_s", 0.0) for r in ranks)
        print(f"after the switch: iteration {after} (A's deferred release, the stall's report) "
              f"{it_sw[after][1] * 1000:.1f} ms, {extra:+.3f} s over steady; our accounting "
              f"of the deferred release, slowest rank: {deferred:.3f} s")
        print(f"the job lost to the switch in all (stall + iteration {after}'s excess): "
              f"{stall + max(0.0, extra):7.3f} s")
    return stall, pause, pauser["transfer_s"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--switch-after", type=int, default=4)
    p.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the switched job this many times; the goals are judged on the "
                        "medians (one iteration's time jitters on a busy machine)")
    p.add_argument("--no-restart", action="store_true",
                   help="only the switched job (no restart path, no restart ratio)")
    p.add_argument("--megatron-flag", action="append", default=[], metavar="FLAG",
                   help="one more Megatron-LM flag for every job (repeatable; "
                        "--megatron-flag=--timing-log-level=2 splits each iteration)")
    args = p.parse_args()
    # the user's own launcher on both sides, as in scripts/megatron_lm_job.py
    os.environ.setdefault("DYNATRAIN_TEST_LAUNCHER", "torchrun")
    k, n = args.switch_after, args.iters
    if not 2 <= k <= n - 4:
        raise SystemExit("--switch-after K needs 2 <= K <= iters - 4 (steady steps at B)")
    from dynatrain_megatron.megatron_lm.patch_tool import default_release, identify

    choice = (os.environ.get("DYNATRAIN_MEGATRON_LM") or os.environ.get("MEGATRON_LM")
              or default_release().name)
    src = Path(choice) if "/" in choice else ROOT.parent / "shared/megatron-lm" / choice
    release = identify(src).release  # an unsupported checkout is refused here, by name
    work = Path(args.work or tempfile.mkdtemp(prefix="dynatrain-stall-"))
    work.mkdir(mode=0o700, parents=True, exist_ok=True)
    tree = work / "Megatron-LM"
    from dynatrain_megatron.megatron_lm.checkout import working_copy

    shutil.rmtree(tree, ignore_errors=True)
    working_copy(src, tree, patched=True)
    for d in ("saved", "logs", "data-cache"):
        shutil.rmtree(work / d, ignore_errors=True)
    common = CPU_FLAGS + MODEL + ["--train-iters", str(n),
                                  "--data-cache-path", str(work / "data-cache")]
    common += [x for f in args.megatron_flag for x in f.split("=", 1)]
    a, b = layout_flags(2, 2), layout_flags(1, 2)
    sched = work / "schedule.yaml"
    sched.write_text(f"- {{iteration: {k}, layout: tp1pp2dp2}}\n")

    print(f"Megatron-LM {release.name} from {src}", flush=True)
    print(f"1. switched in memory: tp2pp2 -> tp1pp2dp2 after iteration {k} (4 gloo ranks)",
          flush=True)
    if args.repeat < 1:
        raise SystemExit("--repeat N needs N >= 1")
    runs = []
    for i in range(args.repeat):
        logs = work / ("logs" if i == 0 else f"logs{i + 1}")
        shutil.rmtree(logs, ignore_errors=True)
        log_file = work / ("switched.log" if i == 0 else f"switched{i + 1}.log")
        runs.append((run_megatron_lm(tree, 4, common + a + [
            "--dynatrain", "--dynatrain-schedule", str(sched),
            "--dynatrain-log-dir", str(logs)], log_file), logs))
    restart = None
    if not args.no_restart:
        print(f"2. Megatron-LM's restart: --save at {k}, exit, --load at tp1pp2dp2", flush=True)
        saved = run_megatron_lm(tree, 4, common + a + [
            "--save", str(work / "saved"), "--save-interval", str(k),
            "--exit-interval", str(k)], work / "saved.log")
        resumed = run_megatron_lm(tree, 4, common + b + ["--load", str(work / "saved")],
                                  work / "resumed.log")
        it_saved, it_res = iterations(saved), iterations(resumed)
        steady_res = statistics.median(it_res[i][1] for i in range(k + 2, n + 1))
        restart = it_res[k + 1][0] - it_saved[k][0] - steady_res

    figures = []
    for i, (sw, logs) in enumerate(runs):
        if args.repeat > 1:
            print(f"\n== switched job, run {i + 1} of {args.repeat}")
        figures.append(report_run(sw, logs, k, n))
    stall, pause, transfer = (statistics.median(f[j] for f in figures) for j in range(3))
    if args.repeat > 1:
        print(f"\nover the {args.repeat} runs: stall " + ", ".join(
            f"{f[0]:.3f}" for f in figures) + f" s (median {stall:.3f}); slowest pause "
              + ", ".join(f"{f[1]:.3f}" for f in figures) + f" s (median {pause:.3f}); "
              f"its transfer median {transfer:.3f} s; stall / pause " + ", ".join(
                  f"{f[0] / f[1]:.2f}" for f in figures))
    goals = [("stall <= 1.25x the slowest pause", stall / pause, 1.25, stall <= 1.25 * pause),
             ("pause <= 2x its transfer", pause / max(transfer, 1e-9), 2.0,
              pause <= 2 * transfer)]
    if restart is not None:
        print(f"restart (--save, exit, new job, --load) stall:       {restart:7.3f} s")
        goals.append(("restart / stall >= 50", restart / max(stall, 1e-9), 50.0,
                      restart >= 50 * stall))
    print("\ngoal" + (" (medians)" if args.repeat > 1 else "          ")
          + "                       ratio    target  met")
    for what, ratio, target, ok in goals:
        print(f"{what:<36} {ratio:7.2f}  {target:7.2f}  {'yes' if ok else 'NO'}")
    print(f"\nlogs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
