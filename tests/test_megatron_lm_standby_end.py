"""Ranks on standby inside real Megatron-LM's train() (the snapshot, patched) while the
layout's ranks take longer than the process-group timeout between two polls, and a job that
ends with a switch still being prepared: one job on 4 gloo ranks, tp1pp2dp2.

* On ranks 2 and 3 the job's default group gets a 10 s timeout once training starts
  (`megatron_lm_short_timeout/sitecustomize.py`; the layout's ranks keep theirs:
  Megatron-LM's `--distributed-timeout-minutes` counts whole minutes). After a request for
  tp1pp2dp1 on 2 ranks, ranks 2 and 3 wait on standby while the 2 layout ranks run an
  evaluation (`--eval-iters 300`) and a `--save` (every 4 iterations), longer than that
  timeout (measured from Megatron-LM's own time stamps). Before the standby channel
  (`elastic/standby_channel.py`) the standby ranks waited on the default group and failed
  there (`Timed out waiting ... for recv`), and the job with them.
* A request for tp1pp2dp2 on all 4 is written after iteration 7, taken at a later poll; the
  preparation of B on rank 0 takes 60 s more (`DYNATRAIN_FAULTS` delay), so it is still
  pending when the job ends after iteration N. It is cancelled on every rank (the standby
  ranks hear it through the preparation's vote), its request is filed `not_applied` with
  the reason, no switch runs at the last step, and every process ends cleanly. Before, the
  layout's `stop` broadcast met the standby ranks' vote (a 300 s hang, then a crash) or B's
  background build ran into the destroyed world.
"""
import datetime
import json
import re
from pathlib import Path

import pytest

from megatron_lm_runs import CPU_FLAGS, TINY_GPT, layout_flags, run_operated
from megatron_lm_tree import copy_tree, require_snapshot

pytestmark = pytest.mark.multirank

N = 10
TIMEOUT_S = 10
SITE = Path(__file__).with_name("megatron_lm_short_timeout")
REQUESTS = {1: ("tp1pp2dp1", 2), 7: ("tp1pp2dp2", 4)}
STAMPED = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration\s+(\d+)/")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    require_snapshot()
    w = tmp_path_factory.mktemp("megatron-lm-standby-end")
    w.chmod(0o700)
    tree = copy_tree(w / "patched", patched=True)
    signal = w / "switch.json"
    slow = json.dumps({"delay_rank": 0, "delay_seconds": 60.0, "delay_phase": "prepare",
                       "dst_layout": "tp1pp2dp2"})
    flags = CPU_FLAGS + TINY_GPT + layout_flags(1, 2) + [
        "--train-iters", str(N), "--eval-interval", "4", "--eval-iters", "300",
        "--save", str(w / "ckpt"), "--save-interval", "4",
        "--dynatrain", "--dynatrain-signal-file", str(signal)]
    text = run_operated(tree, 4, flags, w / "job.log", signal, REQUESTS, site=SITE,
                        env={"DYNATRAIN_TEST_PG_TIMEOUT_S": str(TIMEOUT_S),
                             "DYNATRAIN_TEST_PG_TIMEOUT_RANKS": "2,3",
                             "DYNATRAIN_FAULTS": slow})
    return dict(w=w, text=text, signal=signal)


def test_standby_ranks_wait_through_an_evaluation_and_save_longer_than_the_timeout(run):
    text = run["text"]
    assert text.count("this rank is not in the new layout; on standby") == 2
    stamps = {int(i): datetime.datetime.fromisoformat(t) for t, i in STAMPED.findall(text)}
    assert sorted(stamps) == list(range(1, N + 1))
    (scale_in,) = {int(i) for i in re.findall(r"iteration (\d+): switched tp1pp2dp2 -> "
                                              r"tp1pp2dp1", text)}
    # the first evaluation and save on the 2 layout ranks with 2 on standby ran between the
    # lines of its iteration and the next
    e = min(int(i) for i in re.findall(r"validation loss at iteration (\d+) \|", text)
            if int(i) >= scale_in)
    assert e < N and (stamps[e + 1] - stamps[e]).total_seconds() > TIMEOUT_S
    assert "Timed out" not in text and "Traceback" not in text
    assert text.count("the job ended while this rank was on standby") == 2


def test_a_switch_pending_at_the_end_is_cancelled_and_filed(run):
    text = run["text"]
    assert "switched tp1pp2dp1 -> tp1pp2dp2" not in text
    reason = (f"not applied: the job ended after iteration {N}, before the switch was ready "
              f"(switch to tp1pp2dp2)")
    assert reason in text
    records = sorted(run["signal"].parent.glob("switch.json.not_applied.*"))
    assert len(records) == 1
    rec = json.loads(records[0].read_text())
    assert rec["outcome"] == "not_applied" and rec["reason"] == reason
    assert json.loads(rec["request"])["layout"] == "tp1pp2dp2"
    assert "is_initialized" not in text  # B's background build never outlived the world
