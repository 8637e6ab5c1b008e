"""A rank killed *inside* one of real Megatron-LM's training steps (the snapshot, patched),
under `dynatrain launch`, with two distributed-optimizer instances: the survivors recover in
memory from the last step boundary and train on, and the result is Megatron-LM's own
restart from that boundary.

tp1pp2doi2dp2 on 4 gloo ranks; rank `dead` is killed during the step after iteration K
(`DYNATRAIN_FAULTS`, the fault points of `megatron_lm/step_guard.py`), where the survivors
are blocked in whatever that step's collectives were (a pipeline receive, the data-parallel
gradient reduction, the optimizer's vote). Every optimizer shard of the dead rank has a
replica in the other instance, so the three survivors re-form the world, switch from their
own tensors to tp1pp2dp1 on two of them (the third waits on standby) and train to N. Before
this was handled, the next train_step failed (`UnboundLocalError: losses_reduced`: the failed
forward-backward left megatron-core's rerun state machine mid-run).

The reference, shared by every kill point: the UNPATCHED tree trains tp1pp2doi2dp2 to K and
saves; the patched tree without --dynatrain loads that at tp1pp2dp1 on 2 ranks and trains to
N. The final checkpoints must be equal bit for bit as logical tensors, and the losses after K
the restart's.
"""
import json
import re

import pytest

from megatron_lm_runs import (CPU_FLAGS, TINY_GPT, assert_losses_as_restart, checkpoint_tensors,
                              differences, layout_flags, run_launched, run_megatron_lm)
from megatron_lm_tree import copy_tree, require_snapshot

pytestmark = [pytest.mark.multirank, pytest.mark.faults]

K, N = 3, 6
DOI2 = ["--num-distributed-optimizer-instances", "2"]
COMMON = CPU_FLAGS + TINY_GPT + layout_flags(1, 2) + ["--train-iters", str(N)]
# (phase, dead rank): rank 1 is pp stage 0 of instance 1 (it sends activations forward),
# rank 3 its last stage (it sends gradients back)
KILLS = [("pp_send", 1), ("optimizer", 3)]


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    require_snapshot()
    w = tmp_path_factory.mktemp("megatron-lm-step-death")
    w.chmod(0o700)
    return dict(w=w, patched=copy_tree(w / "patched", patched=True),
                unpatched=copy_tree(w / "unpatched", patched=False))


@pytest.fixture(scope="module")
def restart(trees):
    w = trees["w"]
    saved = run_megatron_lm(
        trees["unpatched"], 4, COMMON + DOI2 + ["--save", str(w / "saved"), "--save-interval",
                                                str(K), "--exit-interval", str(K)],
        w / "saved.log", patched=False)
    resumed = run_megatron_lm(
        trees["patched"], 2, COMMON + ["--load", str(w / "saved"), "--save", str(w / "resumed"),
                                       "--save-interval", "1000"],
        w / "resumed.log")
    return dict(saved=saved, resumed=resumed)


@pytest.fixture(scope="module", params=KILLS, ids=[f"{p}-rank{r}" for p, r in KILLS])
def killed(request, trees):
    phase, dead = request.param
    w = trees["w"] / phase
    w.mkdir()
    kill = json.dumps({"fail_rank": dead, "fail_phase": phase, "iteration": K, "kill": True,
                       "exit_code": 1})
    status, text = run_launched(
        trees["patched"], 4, COMMON + DOI2 + [
            "--save", str(w / "switched"), "--save-interval", "1000",
            "--distributed-timeout-minutes", "3",
            "--dynatrain", "--dynatrain-rendezvous-dir", str(w / "rdv")],
        w / "switched.log", env={"DYNATRAIN_FAULTS": kill}, timeout=1800)
    return dict(w=w, phase=phase, dead=dead, status=status, switched=text)


def test_survivors_recover_in_memory_from_the_last_boundary(killed):
    text = killed["switched"]
    assert killed["status"] == 0, text[-4000:]
    exits = dict(re.findall(r"\[launch\] worker (\d) exited with (-?\d+) after", text))
    assert exits == {str(r): "1" if r == killed["dead"] else "0" for r in range(4)}
    assert f"fault injection: rank {killed['dead']} dies in phase {killed['phase']}" in text
    # one roster for all; a survivor that noticed the death only after the others' grace
    # period (rejoin.reform_world) is left out of it and ends with status 0
    rosters = set(re.findall(r"world re-formed \(generation 1\): survivors \[([0-9, ]*)\]",
                             text))
    assert len(rosters) == 1
    roster = [int(r) for r in rosters.pop().split(",")]
    assert killed["dead"] not in roster and len(roster) >= 2
    assert "recovered in memory: tp1pp2doi2dp2 -> tp1pp2dp1 on 2 ranks" in text
    assert "loaded Megatron-LM's checkpoint" not in text  # nothing read from disk
    assert "UnboundLocalError" not in text and "Traceback" not in text


def test_final_checkpoint_equals_megatron_lm_restart(killed, trees, restart):
    ours = checkpoint_tensors(killed["w"] / "switched", N)
    theirs = checkpoint_tensors(trees["w"] / "resumed", N)
    diff = differences(ours, theirs, skip=lambda k: k.startswith("rng_state"))
    assert not diff, diff[:10]
    kinds = {k.split(".")[2] for k in ours if k.startswith("optimizer.state.")}
    assert kinds == {"exp_avg", "exp_avg_sq", "param"}


def test_losses_after_the_death_are_the_restarts(killed, restart):
    assert_losses_as_restart(dict(switched=killed["switched"], **restart), K, N)
