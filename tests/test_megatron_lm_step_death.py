"""Ranks killed *inside* real Megatron-LM's training steps (the snapshot, patched), under
`dynatrain launch`'s supervision (`forked_launch --survivors`), at every fault point of
`megatron_lm/step_guard.py`: the survivors recover (in memory where the state allows, from the last `--save` where it does not) and
the result is Megatron-LM's own restart.

tp1pp2doi2dp2 on 4 gloo ranks. Ranks 0 and 1 are pipeline stage 0 (of distributed-optimizer
instances 0 and 1), ranks 2 and 3 stage 1; (0, 2) and (1, 3) are the two pipelines, (0, 1)
and (2, 3) the data-parallel groups whose gradients are reduced across the instances. Each
run kills ranks inside the step after iteration K (`DYNATRAIN_FAULTS`, plans per world
generation; several plans of one generation kill several ranks in that same step), the
survivors blocked in whatever that step's collectives were:

* "forward+backward": rank 0 before its first forward and rank 3 in its first backward, in
  the same step: one rank of each stage and of each instance, so the two survivors hold a
  replica of every optimizer shard and recover **in memory** to tp1pp2dp1, which trains to
  the end. The survivors wait in a pipeline receive: rank 2 for the forward of its dead
  stage 0, rank 1 for the backward of its dead stage 1 (its own backward pending);
* "pp_send+grad_sync": rank 1 as it sends its first forward and rank 2 as its gradients are
  to be reduced across the instances: rank 3 waits in a pipeline receive, rank 0 in the
  gradient reduction; in memory, to the end. This run starts from the restart's checkpoint
  of K (`--load`), so the deaths come in the loop's FIRST step, before any step boundary:
  the survivors recover from the state the loop started with;
* "optimizer+log": rank 3 as the optimizer step starts (before the vote), the others in
  the vote or the gradient reduction; the three survivors recover in memory to tp1pp2dp1 on
  two (the third waits on standby), which train and `--save` at K+1. Then, at tp1pp2dp1
  (one optimizer instance: the dead rank's shards are gone), its stage 1 dies as iteration
  K+2's log line starts (`training_log`, after that step completed): the stage-0 survivor
  sees it in the log line's reductions and holds it to the boundary (`post_step.py`), and
  with the standby rank resumes from the `--save` of K+1, written by the world the in-memory
  recovery made, so the final state depends on both recoveries;
* "optimizer_update": rank 2 after the optimizer's vote: some survivors may hold iteration
  K+1's state and others K's, so they resume from a checkpoint at tp1pp2dp1, never from
  memory, and the third leaves. This run too starts from the checkpoint of K (`--load`)
  and dies in its first step, before its first `--save`: the survivors resume from the
  `--load` it started from;
* "final_save": rank 3 as Megatron-LM's final `--save` starts, after `train()` returned
  (`pretrain()`'s own save of N, not a multiple of `--save-interval`): the survivors, in that
  save's collectives, recover in memory to tp1pp2dp1 (the third leaves) and run the save
  again at that layout (`after_train.py`): it is the final checkpoint compared. This run
  too starts from the checkpoint of K.

Every run ends at Megatron-LM's restart from K: the UNPATCHED tree trains tp1pp2doi2dp2 to N
and saves every K iterations; the patched tree without --dynatrain loads its checkpoint of K
at tp1pp2dp1 on 2 ranks and trains to N ("final_save": the unpatched tree's own checkpoint of
N, the state its survivors hold). The final checkpoints must be equal bit for bit as logical
tensors, and every loss printed after K the restart's. No process of a job outlives it (a rank killed without
its exit handlers once left its forked checkpoint manager running).
"""
import json
import re
import time

import pytest

from megatron_lm_runs import (CPU_FLAGS, TINY_GPT, assert_losses_as_restart, checkpoint_tensors,
                              differences, job_processes, layout_flags, losses,
                              run_launched, run_megatron_lm, LOSS)
from megatron_lm_tree import copy_tree, require_snapshot

pytestmark = [pytest.mark.multirank, pytest.mark.faults]

K, N = 2, 6
DOI2 = ["--num-distributed-optimizer-instances", "2"]
COMMON = CPU_FLAGS + TINY_GPT + layout_flags(1, 2) + ["--train-iters", str(N)]
# name -> (the deaths of one run: (phase, dead rank in its generation's numbering, iteration,
# generation, the launch rank of that process), its --save-interval, whether it starts from
# the restart's checkpoint of K: its deaths come in its first step)
DEATHS = {
    # survivors [1, 2]: one replica of each stage's optimizer shards
    "forward+backward": ([("forward", 0, K, 0, 0), ("backward", 3, K, 0, 3)], 1000, False),
    # survivors [0, 3]
    "pp_send+grad_sync": ([("pp_send", 1, K, 0, 1), ("grad_sync", 2, K, 0, 2)], 1000, True),
    # survivors [0, 1, 2] -> new ranks 0, 1 (stage 1: launch rank 1), 2 on standby; then
    # rank 1 in K+2's log line: from the --save of K+1
    "optimizer+log": ([("optimizer", 3, K, 0, 3), ("log", 1, K + 2, 1, 1)], K + 1, False),
    # in the optimizer's update of the first step: the survivors resume from the --load of K
    "optimizer_update": ([("optimizer_update", 2, K, 0, 2)], K, True),
    # in Megatron-LM's final save after train() returned: in memory, the save runs again
    "final_save": ([("save", 3, N, 0, 3)], 1000, True),
}


def load_k(w) -> list[str]:
    """Megatron-LM's restart from the checkpoint of K (the saved run also saved later)."""
    return ["--load", str(w / "saved"), "--ckpt-step", str(K)]


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
    # trains on to N at the launch layout (its checkpoint of N: the reference of a death
    # after train(), whose survivors hold that layout's final state)
    saved = run_megatron_lm(
        trees["unpatched"], 4, COMMON + DOI2 + ["--save", str(w / "saved"), "--save-interval",
                                                str(K)],
        w / "saved.log", patched=False)
    resumed = run_megatron_lm(
        trees["patched"], 2, COMMON + load_k(w) + ["--save", str(w / "resumed"),
                                                "--save-interval", "1000"],
        w / "resumed.log")
    # the restart's final checkpoint as logical tensors, read once for every run's comparison
    return dict(saved=saved, resumed=resumed, final=checkpoint_tensors(w / "resumed", N),
                launch_final=lambda: checkpoint_tensors(w / "saved", N))


@pytest.fixture(scope="module", params=list(DEATHS))
def killed(request, trees, restart):
    name, (deaths, save_interval, loads) = request.param, DEATHS[request.param]
    w = trees["w"] / name
    w.mkdir()
    plans = [{"fail_rank": rank, "fail_phase": phase, "iteration": it, "generation": gen,
              "kill": True, "exit_code": 1} for phase, rank, it, gen, _ in deaths]
    t0 = time.monotonic()
    status, text = run_launched(
        trees["patched"], 4, COMMON + DOI2 + [
            "--save", str(w / "switched"), "--save-interval", str(save_interval),
            *(load_k(trees["w"]) if loads else []),
            "--distributed-timeout-minutes", "3",
            "--dynatrain", "--dynatrain-rendezvous-dir", str(w / "rdv")],
        w / "switched.log", env={"DYNATRAIN_FAULTS": json.dumps(plans)}, timeout=1800)
    seconds = time.monotonic() - t0
    left = job_processes(trees["patched"])  # of this job: the tree is used by one at a time
    print(f"[{name}] the killed run took {seconds:.0f} s")
    return dict(w=w, name=name, deaths=deaths, status=status, switched=text, left=left,
                loads=loads)


def test_survivors_recover_from_each_death(killed):
    text, deaths = killed["switched"], killed["deaths"]
    generations = sorted({gen for *_, gen, _ in deaths})
    assert killed["status"] == 0, text[-4000:]
    dead = {launch_rank for *_, launch_rank in deaths}
    exits = dict(re.findall(r"\[launch\] worker (\d) exited with (-?\d+) after", text))
    assert exits == {str(r): "1" if r in dead else "0" for r in range(4)}
    for phase, rank, _, _, _ in deaths:
        assert f"fault injection: rank {rank} dies in phase {phase}" in text
    # one roster per recovery for all; a survivor that noticed the death only after the
    # others' grace period (rejoin.reform_world) is left out of it and ends with status 0
    for generation in range(1, len(generations) + 1):
        rosters = set(re.findall(rf"world re-formed \(generation {generation}\): survivors "
                                 rf"\[([0-9, ]*)\]", text))
        assert len(rosters) == 1, (generation, rosters)
    first = deaths[0][0]
    if first == "optimizer_update":  # past the vote: never from memory
        assert re.search(r"ranks \[[0-9, ]+\] were inside the optimizer update", text)
        assert "recovered in memory" not in text
    else:
        memory = set(re.findall(r"recovered in memory: (\S+ -> \S+ on \d+ ranks)", text))
        assert memory == {"tp1pp2doi2dp2 -> tp1pp2dp1 on 2 ranks"}, memory
    loaded = re.findall(r"loaded Megatron-LM's checkpoint of iteration (\d+) .* at (\S+) on "
                        r"(\d+) ranks \(its (--\w+)\)", text)
    # the checkpoint the survivors resume from: in the update of the first step, the --load
    # of K it started from; on a second death, the --save of K+1 written after the in-memory
    # recovery; none after an in-memory recovery alone
    from_save = {(str(K), "tp1pp2dp1", "2", "--load")} if first == "optimizer_update" else (
        {(str(K + 1), "tp1pp2dp1", "2", "--save")} if len(generations) > 1 else set())
    assert set(loaded) == from_save, loaded
    if "log" in {phase for phase, *_ in deaths}:  # seen in the log line's collectives
        assert re.search(r"a peer died during Megatron-LM's training_log", text)
    if first == "save":  # after train(): the final save, again at the survivors' layout
        assert re.search(r"a peer died during Megatron-LM's save_checkpoint_and_time after "
                         r"train\(\)", text)
        assert re.search(rf"successfully saved checkpoint from iteration\s+{N} ", text)
    assert "UnboundLocalError" not in text and "Traceback" not in text


def test_no_process_of_the_job_outlives_it(killed):
    assert not killed["left"], killed["left"]


def test_final_checkpoint_equals_megatron_lm_restart(killed, restart):
    ours = checkpoint_tensors(killed["w"] / "switched", N)
    if killed["name"] == "final_save":  # trained to N at the launch layout, as the saved run
        # (rng and rerun-state entries are per rank: two writers against four)
        diff = differences(ours, restart["launch_final"](), skip=lambda k: k.startswith(
            ("rng_state", "rerun_state_machine_state")))
    else:
        diff = differences(ours, restart["final"], skip=lambda k: k.startswith("rng_state"))
    assert not diff, diff[:10]
    kinds = {k.split(".")[2] for k in ours if k.startswith("optimizer.state.")}
    assert kinds == {"exp_avg", "exp_avg_sq", "param"}


def test_losses_after_the_deaths_are_the_restarts(killed, restart):
    text = killed["switched"]
    printed = [int(it) for it, _ in LOSS.findall(text)]
    if killed["name"] == "final_save":  # trained at the launch layout, as the saved run
        assert_losses_as_restart(dict(switched=restart["saved"], resumed=text), K, N)
    elif killed["loads"]:  # started from the restart's own checkpoint of K: its every print
        assert losses(text) == losses(restart["resumed"])
    else:
        assert_losses_as_restart(dict(switched=text, saved=restart["saved"],
                                      resumed=restart["resumed"]), K, N)
    # no iteration was trained twice (each death came before that step's print, and the
    # checkpoint resumed from is of the last iteration printed): every print is checked
    assert printed == list(range(K + 1 if killed["loads"] else 1, N + 1)), printed
