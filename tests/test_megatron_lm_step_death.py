"""Ranks killed *inside* real Megatron-LM's training steps (the snapshot, patched), under
`dynatrain launch`, at every fault point of `megatron_lm/step_guard.py`: the survivors
recover (in memory where the state allows, from the last `--save` where it does not) and
the result is Megatron-LM's own restart.

tp1pp2doi2dp2 on 4 gloo ranks, `--save-interval K`. Ranks 0 and 1 are pipeline stage 0
(of distributed-optimizer instances 0 and 1), ranks 2 and 3 stage 1; (0, 2) and (1, 3) are
the two pipelines, (0, 1) and (2, 3) the data-parallel groups whose gradients are reduced
across the instances. Each run kills up to two ranks (`DYNATRAIN_FAULTS`, one plan per
world generation), each inside the step after its iteration, the survivors blocked in
whatever that step's collectives were:

* the first death, in the step after K, at tp1pp2doi2dp2: every optimizer shard of the dead
  rank has a replica in the other instance, so the three survivors re-form the world,
  switch from their own tensors to tp1pp2dp1 on two of them (the third waits on standby)
  and go on from K. Except after the optimizer's vote (`optimizer_update`): some survivors
  may hold iteration K+1's state and others K's, so they resume from the last `--save`
  (iteration K) at tp1pp2dp1 instead, and the third leaves;
* the second, in the step after K+1, at tp1pp2dp1 (ranks renumbered by the recovery: 0 and
  1 the layout's stages, 2 on standby): one optimizer instance, the dead rank's shards are
  gone; the layout rank left and the standby rank resume from the last `--save` (K).

Either way every run ends at Megatron-LM's restart from K: the UNPATCHED tree trains
tp1pp2doi2dp2 to K and saves; the patched tree without --dynatrain loads that at tp1pp2dp1
on 2 ranks and trains to N. The final checkpoints must be equal bit for bit as logical
tensors, and the losses after K the restart's. No process of a job outlives it (a rank
killed without its exit handlers once left its forked checkpoint manager running).
"""
import json
import re
import time

import pytest

from megatron_lm_runs import (CPU_FLAGS, TINY_GPT, assert_losses_as_restart, checkpoint_tensors,
                              differences, job_processes, layout_flags, run_launched,
                              run_megatron_lm)
from megatron_lm_tree import copy_tree, require_snapshot

pytestmark = [pytest.mark.multirank, pytest.mark.faults]

K, N = 3, 6
DOI2 = ["--num-distributed-optimizer-instances", "2"]
COMMON = CPU_FLAGS + TINY_GPT + layout_flags(1, 2) + ["--train-iters", str(N)]
# name -> the deaths of one run: (phase, dead rank in its generation's numbering, iteration,
# generation, the launch rank of that process). The dead ranks' sides: stage 0 as it sends
# forward (pp_send) and before its first forward, stage 1 in its first backward, stage 0 as
# its gradients are reduced across the instances (grad_sync), stage 1 as the optimizer step
# starts and after the vote; the survivors wait in a pipeline receive, the gradient
# reduction, the vote or the optimizer's own collectives, or on standby.
DEATHS = {
    # survivors [0, 2, 3] -> new ranks 0, 1, 2: new 0 is launch rank 0
    "pp_send+forward": [("pp_send", 1, K, 0, 1), ("forward", 0, K + 1, 1, 0)],
    # survivors [0, 1, 2]: new 1 (stage 1) is launch rank 1
    "optimizer+backward": [("optimizer", 3, K, 0, 3), ("backward", 1, K + 1, 1, 1)],
    # survivors [1, 2, 3]: new 1 (stage 1) is launch rank 2
    "grad_sync+optimizer_update": [("grad_sync", 0, K, 0, 0),
                                   ("optimizer_update", 1, K + 1, 1, 2)],
    # in the optimizer's update: the survivors resume from the --save of K
    "optimizer_update": [("optimizer_update", 2, K, 0, 2)],
}


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


@pytest.fixture(scope="module", params=list(DEATHS))
def killed(request, trees):
    name, deaths = request.param, DEATHS[request.param]
    w = trees["w"] / name
    w.mkdir()
    plans = [{"fail_rank": rank, "fail_phase": phase, "iteration": it, "generation": gen,
              "kill": True, "exit_code": 1} for phase, rank, it, gen, _ in deaths]
    t0 = time.monotonic()
    status, text = run_launched(
        trees["patched"], 4, COMMON + DOI2 + [
            "--save", str(w / "switched"), "--save-interval", str(K),
            "--distributed-timeout-minutes", "3",
            "--dynatrain", "--dynatrain-rendezvous-dir", str(w / "rdv")],
        w / "switched.log", env={"DYNATRAIN_FAULTS": json.dumps(plans)}, timeout=1800)
    seconds = time.monotonic() - t0
    left = job_processes(trees["patched"])  # of this job: the tree is used by one at a time
    print(f"[{name}] the killed run took {seconds:.0f} s")
    return dict(w=w, name=name, deaths=deaths, status=status, switched=text, left=left)


def test_survivors_recover_from_each_death(killed):
    text, deaths = killed["switched"], killed["deaths"]
    assert killed["status"] == 0, text[-4000:]
    dead = {launch_rank for *_, launch_rank in deaths}
    exits = dict(re.findall(r"\[launch\] worker (\d) exited with (-?\d+) after", text))
    assert exits == {str(r): "1" if r in dead else "0" for r in range(4)}
    for phase, rank, _, _, _ in deaths:
        assert f"fault injection: rank {rank} dies in phase {phase}" in text
    # one roster per recovery for all; a survivor that noticed the death only after the
    # others' grace period (rejoin.reform_world) is left out of it and ends with status 0
    for generation in range(1, len(deaths) + 1):
        rosters = set(re.findall(rf"world re-formed \(generation {generation}\): survivors "
                                 rf"\[([0-9, ]*)\]", text))
        assert len(rosters) == 1, (generation, rosters)
    first = deaths[0][0]
    if first == "optimizer_update":  # past the vote: never from memory
        assert re.search(r"ranks \[[0-9, ]+\] were inside the optimizer update", text)
        assert "recovered in memory" not in text
    else:
        assert "recovered in memory: tp1pp2doi2dp2 -> tp1pp2dp1 on 2 ranks" in text
    loaded = re.findall(r"loaded Megatron-LM's checkpoint of iteration (\d+) .* at (\S+) on "
                        r"(\d+) ranks", text)
    from_save = first == "optimizer_update" or len(deaths) > 1
    assert set(loaded) == ({(str(K), "tp1pp2dp1", "2")} if from_save else set()), loaded
    assert "UnboundLocalError" not in text and "Traceback" not in text


def test_no_process_of_the_job_outlives_it(killed):
    assert not killed["left"], killed["left"]


def test_final_checkpoint_equals_megatron_lm_restart(killed, trees, restart):
    ours = checkpoint_tensors(killed["w"] / "switched", N)
    theirs = checkpoint_tensors(trees["w"] / "resumed", N)
    diff = differences(ours, theirs, skip=lambda k: k.startswith("rng_state"))
    assert not diff, diff[:10]
    kinds = {k.split(".")[2] for k in ours if k.startswith("optimizer.state.")}
    assert kinds == {"exp_avg", "exp_avg_sq", "param"}


def test_losses_after_the_deaths_are_the_restarts(killed, restart):
    # an iteration trained again after a recovery from the --save: its last print counts
    assert_losses_as_restart(dict(switched=killed["switched"], **restart), K, N)
