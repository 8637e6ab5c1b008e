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

The final checkpoints must be equal bit for bit as logical tensors, so must the survivor's
`--save` of K and the unpatched tree's, and the losses after K the restart's (its 2nd print after `--load` is Megatron-LM's two-iteration mean).
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
    common = CPU_FLAGS + TINY_GPT + layout_flags(1, 1) + ["--train-iters", str(N)]
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
    return dict(w=w, status=status, switched=switched, saved=saved, resumed=resumed)


def test_the_survivor_recovers_in_memory_at_the_current_iteration(runs):
    text = runs["switched"]
    assert runs["status"] == 0, text[-4000:]
    exits = dict(re.findall(r"\[launch\] worker (\d) exited with (-?\d+) after", text))
    assert exits == {"1": "1", "0": "0"}
    assert "recovered in memory: tp1pp1doi2dp2 -> tp1pp1dp1 on 1 ranks" in text
    assert "loaded Megatron-LM's checkpoint" not in text  # nothing read from disk
    # first seen inside the --save of K, held until the boundary after K
    assert "fault injection: rank 1 dies in phase save" in text
    assert "a peer died during Megatron-LM's checkpoint_and_decide_exit" in text
    assert f"training goes on at tp1pp1dp1 on 1 ranks after iteration {K}" in text
    # the --save of K cut by the death, made again at the survivor's layout
    assert (f"running iteration {K}'s checkpoint_and_decide_exit again at the survivors' "
            f"layout") in text
    assert "Traceback" not in text


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
