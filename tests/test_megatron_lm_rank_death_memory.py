"""A rank killed inside real Megatron-LM's own train() with two distributed-optimizer
instances: every optimizer shard of the dead rank has a replica on the survivor, so the
survivor recovers in memory at the current iteration, in the same process, and trains on.
The reference is Megatron-LM's own restart, as in test_megatron_lm_train.py:

* switched (the death is the switch): patched, under `dynatrain launch` on 2 gloo ranks,
  tp1pp1doi2dp2, `--save-interval K`; rank 1 is killed as the `--save` of iteration K starts
  (`DYNATRAIN_FAULTS` phase "save"), after that step completed on both ranks; rank 0 sees it
  inside the save, holds the failure until the step boundary (`megatron_lm/post_step.py`),
  re-forms the world alone, switches from its own tensors of iteration K (rank 1's pieces
  taken from their replicas) to tp1pp1dp1, makes the `--save` of K again at that layout
  (with the exit checks of that iteration), trains to N, then `--save`s;
* saved: the UNPATCHED tree trains tp1pp1doi2dp2 to K on 2 ranks and saves;
* resumed: patched, without `--dynatrain`, loads that on 1 rank at tp1pp1dp1 and trains to N.

The model's layers come from a user's `--spec` module (megatron-core's local layer): the
recovery, a switch with rank 1 unavailable, is planned from the survivor's live metadata.
Its learned position table has 64 rows for a sequence of 32 (`--max-position-embeddings`).
The final checkpoints must be equal bit for bit as logical tensors, so must the survivor's
`--save` of K and the unpatched tree's, and the losses after K the restart's (its 2nd print
after `--load` is Megatron-LM's two-iteration mean).
"""
import json
import re

import pytest

from megatron_lm_runs import (CPU_FLAGS, TINY_GPT, assert_final_checkpoints_identical,
                              assert_losses_as_restart, checkpoint_tensors, differences,
                              layout_flags, run_launched, run_megatron_lm)
from megatron_lm_tree import copy_tree, require_snapshot

# also on every other release (make test): a rank death recovered in memory
pytestmark = [pytest.mark.multirank, pytest.mark.faults]

K, N = 3, 6
DOI2 = ["--num-distributed-optimizer-instances", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_snapshot()
    w = tmp_path_factory.mktemp("megatron-lm-death-memory")
    w.chmod(0o700)
    patched = copy_tree(w / "patched", patched=True)
    unpatched = copy_tree(w / "unpatched", patched=False)
    # a user's --spec module (the same layers): the recovery is planned from the live
    # metadata of the survivor alone
    common = CPU_FLAGS + TINY_GPT + layout_flags(1, 1) + [
        "--train-iters", str(N), "--spec", "tests.megatron_lm_user_spec", "gpt_layer",
        # a learned position table longer than the sequence (64 rows, sequence of 32)
        "--max-position-embeddings", "64"]
    kill = json.dumps({"fail_rank": 1, "fail_phase": "save", "iteration": K, "kill": True,
                       "exit_code": 1})
    status, switched = run_launched(
        patched, 2, common + DOI2 + [
            "--save", str(w / "switched"), "--save-interval", str(K),
            "--distributed-timeout-minutes", "3",
            "--dynatrain", "--dynatrain-rendezvous-dir", str(w / "rdv")],
        w / "switched.log", env={"DYNATRAIN_FAULTS": kill})
    saved = run_megatron_lm(
        unpatched, 2, common + DOI2 + ["--save", str(w / "saved"), "--save-interval", str(K),
                                       "--exit-interval", str(K)],
        w / "saved.log", patched=False)
    resumed = run_megatron_lm(
        patched, 1, common + ["--load", str(w / "saved"), "--save", str(w / "resumed"),
                              "--save-interval", "1000"],
        w / "resumed.log")
    # rank 1 dies in Megatron-LM's start-up (after the job registered, before the loop)
    startup = json.dumps({"fail_rank": 1, "fail_phase": "startup", "kill": True,
                          "exit_code": 1})
    early_status, early = run_launched(
        patched, 2, common + DOI2 + [
            "--distributed-timeout-minutes", "10",
            "--dynatrain", "--dynatrain-rendezvous-dir", str(w / "rdv-early")],
        w / "early.log", env={"DYNATRAIN_FAULTS": startup})
    return dict(w=w, status=status, switched=switched, saved=saved, resumed=resumed,
                early_status=early_status, early=early)


def test_the_survivor_recovers_in_memory_at_the_current_iteration(runs):
    text = runs["switched"]
    assert runs["status"] == 0, text[-4000:]
    exits = dict(re.findall(r"\[launch\] worker (\d) exited with (-?\d+) after", text))
    assert exits == {"1": "1", "0": "0"}
    assert "recovered in memory: tp1pp1doi2dp2 -> tp1pp1dp1 on 1 ranks" in text
    assert "loaded Megatron-LM's checkpoint" not in text  # nothing read from disk
    # planned from the survivor's live metadata (what the analytic layout cannot know)
    assert "--spec: switches are planned from every rank's live sharded metadata" in text
    assert re.search(r"rank 0: switch tp1pp1doi2dp2 -> tp1pp1dp1 planned from the live "
                     r"metadata", text), text[-3000:]
    # first seen inside the --save of K, held until the boundary after K
    assert "fault injection: rank 1 dies in phase save" in text
    assert "a peer died during Megatron-LM's checkpoint_and_decide_exit" in text
    assert f"training goes on at tp1pp1dp1 on 1 ranks after iteration {K}" in text
    # the --save of K cut by the death, made again at the survivor's layout
    assert (f"running iteration {K}'s checkpoint_and_decide_exit again at the survivors' "
            f"layout") in text
    assert "Traceback" not in text


def test_a_death_in_megatron_lms_start_up_ends_the_survivor_in_one_line_at_once(runs):
    # no training state exists before the loop: the survivor ends (status 1) with one line
    # saying why, as soon as it sees the death (not after the process-group timeout)
    text, status = runs["early"], runs["early_status"]
    assert status == 1, text[-4000:]
    assert "fault injection: rank 1 dies in phase startup" in text
    assert re.search(r"dynatrain: a peer died during Megatron-LM's start-up, before the "
                     r"training loop \(.*\): there is no training state to recover yet; the "
                     r"job ends: restart it", text), text[-3000:]
    assert "Traceback" not in text
    exits = {r: (c, float(t)) for r, c, t in re.findall(
        r"\[launch\] worker (\d) exited with (-?\d+) after ([0-9.]+) s$", text, re.M)}
    assert {r: c for r, (c, _) in exits.items()} == {"0": "1", "1": "1"}
    assert exits["0"][1] - exits["1"][1] < 120  # the timeout is 10 minutes


def test_the_save_cut_by_the_death_is_made_again_at_the_survivors_layout(runs):
    w = runs["w"]
    ours, theirs = checkpoint_tensors(w / "switched", K), checkpoint_tensors(w / "saved", K)
    # rng and rerun-state-machine entries are per rank: one writer against two
    diff = differences(ours, theirs, skip=lambda k: k.startswith(("rng_state",
                                                                 "rerun_state_machine_state")))
    assert not diff, diff[:10]
    assert any(k.startswith("optimizer.state.exp_avg") for k in ours)


def test_final_checkpoint_equals_megatron_lm_restart(runs):
    assert_final_checkpoints_identical(runs, N)


def test_losses_after_the_death_are_the_restarts(runs):
    assert_losses_as_restart(runs, K, N)  # as for a switch (test_megatron_lm_train.py)
