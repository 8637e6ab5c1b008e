"""A rank killed inside real Megatron-LM's own train() (the snapshot, patched), launched with
`dynatrain launch` so that the survivors live on: one job on 4 gloo ranks, tp2pp2 with
`--save-interval 2` and `--eval-interval 3`, rank 3 killed as the evaluation after iteration
3 starts (`DYNATRAIN_FAULTS` phase "eval"), after that step completed on every rank.

The survivors notice inside that evaluation (its pipeline's receives and tensor-parallel
reductions; a survivor blocked on another survivor learns of it only when that one lets go
of every copy of its sockets), hold the failure until the step boundary
(`megatron_lm/post_step.py`), all three meet in the rendezvous directory, and since the
distributed optimizer kept rank 3's optimizer shards nowhere else, the two that tp2pp1dp1
needs load Megatron-LM's checkpoint of iteration 2 at that layout in the same processes and
train on to 6; the third ends with status 0. Iteration 3 runs twice: at tp2pp2 before the
death and at tp2pp1 after it, from the same state and the same samples, so it must report
the same learning rate and loss (the same TP and DP: the same arithmetic; the grad norm is
not compared, its squares sum per pipeline stage, in another order at pp1). Every
iteration's consumed samples and learning rate are those of a job that never failed, and the checkpoints written after the recovery describe the new
world (Megatron-LM's `args`) and count every iteration's work once.
"""
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dynatrain_megatron.megatron_lm import adapter as mlm
from dynatrain_megatron.megatron_lm import rank_death
from megatron_lm_runs import (CPU_FLAGS, TINY_GPT, job_processes, layout_flags, load_common,
                              run_launched)
from megatron_lm_tree import copy_tree, require_snapshot



N = 6
LINE = re.compile(r"\] iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|.*?"
                  r"learning rate: ([0-9.E+-]+) \|.*?lm loss: ([0-9.E+-]+) \|.*?"
                  r"grad norm: ([0-9.]+) \|")


def cosine_lr(iteration: int, *, lr=1e-3, min_lr=1e-4, warmup=1, decay=N) -> float:
    """Megatron-LM's cosine schedule with linear warm-up (TINY_GPT's settings)."""
    if iteration <= warmup:
        return lr * iteration / warmup
    ratio = (iteration - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1) * (lr - min_lr)


def test_the_seam_hands_failures_of_train_step_to_rank_death(monkeypatch):
    # what every release's patch runs around train_step (megatron_lm/seam.py): a dead peer's
    # failure is recovered outside the handler and the loop gets a result of train_step's
    # size to unpack; anything else is Megatron-LM's own error
    from dynatrain_megatron.megatron_lm import seam

    seen = []
    monkeypatch.setattr(rank_death, "failure_of", lambda e: seen.append(e) or "dead peer")
    monkeypatch.setattr(rank_death, "recover",
                        lambda args, it, failure, ctx: seen.append((it, failure, ctx)) or "objs")
    loop = seam.LoopSeam(SimpleNamespace(), {"ctx": 1})
    ok = loop.guard(lambda *a, **k: tuple(range(8)))
    assert ok(1, iteration=5) == tuple(range(8)) and loop.recovered is None
    dead = RuntimeError("Connection closed by peer")

    def dies(*a, **k):
        raise dead

    assert loop.guard(dies)(1, iteration=5) == (None,) * 8
    assert loop.recovered == "objs" and seen == [dead, (5, "dead peer", {"ctx": 1})]
    # a death in the very first step: the size comes from train_step's own return tuples
    def first_dies(*a, **k):
        if k:
            raise dead
        return (1, 2, 3)

    assert seam.LoopSeam(SimpleNamespace(), None).guard(first_dies)(iteration=1) == (None,) * 3
    bug = ValueError("a bug")
    monkeypatch.setattr(rank_death, "failure_of", lambda e: (_ for _ in ()).throw(e))

    def buggy(*a, **k):
        raise bug

    with pytest.raises(ValueError, match="a bug"):
        loop.guard(buggy)(iteration=6)


def test_a_death_seen_after_the_step_is_held_until_the_boundary(monkeypatch):
    # a dead peer first seen in the rest of an iteration (its log line's reductions, an
    # evaluation, a --save): the call returns as when idle, the iteration's other calls are
    # skipped, the boundary recovers from the completed step (megatron_lm/post_step.py)
    from dynatrain_megatron.megatron_lm import seam

    dead, bug, calls, faults = RuntimeError("Connection closed by peer"), ValueError("bug"), [], []
    models = []

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                     report_memory_flag, *rest, **kw):
        calls.append(("log", iteration))
        if iteration in (4, 5):
            raise dead
        if iteration == 9:
            raise bug
        return False

    def evaluate_and_print_results(prefix, forward_step_func, data_iterator, model, iteration,
                                   *rest, **kw):
        calls.append(("eval", iteration))
        models.append((model, data_iterator))

    def save_checkpoint_and_time(iteration, model, optimizer, *rest, **kw):
        calls.append(("save", iteration))

    def checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, iteration, *rest):
        calls.append(("exit?", iteration))
        module.save_checkpoint_and_time(iteration, model, optimizer)
        return True

    def post_training_step_callbacks(model, optimizer, opt_param_scheduler, iteration, prof,
                                     num_floating_point_operations_since_last_log_event, *r):
        return 0

    module = SimpleNamespace(**{f.__name__: f for f in (
        training_log, evaluate_and_print_results, save_checkpoint_and_time,
        checkpoint_and_decide_exit, post_training_step_callbacks)})
    own = dict(vars(module))
    monkeypatch.setattr(seam, "_fault_after_step", lambda phase, it: faults.append((phase, it)))
    monkeypatch.setattr(rank_death, "failure_of", lambda e: (_ for _ in ()).throw(e)
                        if e is bug else "dead peer")
    # in memory at the iteration (4), or from an older checkpoint (5 -> 3)
    monkeypatch.setattr(rank_death, "recover_at_boundary",
                        lambda args, it, failure, ctx: calls.append(("recover", it, failure))
                        or mlm.LoopObjects(["m2"], None, None, None, "v2", None,
                                           iteration=it if it == 4 else it - 2))

    import torch.distributed as dist

    barriers = []

    class Timer:  # megatron-core's Timer: start/stop(barrier=...)
        def __init__(self, group):
            self.group = group

        def start(self, barrier=False):
            if barrier:
                barriers.append(self.group)

        def stop(self, barrier=False):
            if barrier:
                barriers.append(-self.group)

    own_timer = dict(vars(Timer))
    torch_barrier = dist.barrier
    loop = seam.LoopSeam(SimpleNamespace(), None, training_module=module, timer_class=Timer)
    assert all(vars(module)[n] is not f for n, f in own.items())  # wrapped for the loop
    # torch's barrier is not replaced: our own (background threads, votes) stay torch's
    assert dist.barrier is torch_barrier

    def iteration(i):  # the calls of one iteration after train_step, as train() makes them
        flag = module.training_log({}, {}, 1e-3, i, 1.0, True, 0, None, None, None, None)
        module.evaluate_and_print_results(f"iteration {i}", None, None, [], i)
        Timer(i).start(barrier=True)  # the loop's interval timer after an evaluation
        Timer(i).stop(barrier=True)
        flops = module.post_training_step_callbacks([], None, None, i, None, 123.0)
        return flag, flops, module.checkpoint_and_decide_exit([], None, None, i, 0.0, {}, None)

    assert iteration(3) == (False, 0, True) and loop.post_step.pending is None
    assert iteration(4) == (True, 123.0, False)  # as when idle: no exit decided on it
    assert calls[-1] == ("log", 4) and loop.post_step.pending == "dead peer"
    assert barriers == [3, -3]  # skipped on the broken world while the failure is held
    v = (4, 0.0, [], None, None, None, None, None, None, 1, None)
    assert loop.at_step_end(False, *v).iteration == 4
    assert loop.post_step.pending is None
    # in memory at 4: its evaluation and its save + exit checks run again, with the
    # survivors' objects (the exit they decide ends the loop)
    assert calls[-4:] == [("recover", 4, "dead peer"), ("eval", 4), ("exit?", 4), ("save", 4)]
    assert models[-1] == (["m2"], "v2") and loop.stop
    assert faults == [("log", 3), ("eval", 3), ("save", 3), ("log", 4), ("save", 4)]
    loop.stop = False
    iteration(5)
    loop.at_step_end(False, 5, *v[1:])
    assert calls[-1] == ("recover", 5, "dead peer")  # from a checkpoint: nothing again
    assert not loop.stop
    with pytest.raises(ValueError, match="bug"):  # anything else: Megatron-LM's own error
        iteration(9)
    seam.finish([], None, None, None, None, None, None)
    assert vars(module) == own  # Megatron-LM's own functions again after train()
    assert dict(vars(Timer)) == own_timer and dist.barrier is torch_barrier


def test_a_failed_step_leaves_timers_and_rerun_mode_as_at_the_boundary(monkeypatch):
    # an evaluation stops the interval timer, starts its own and disables megatron-core's
    # rerun state machine until it ends: after a failure inside it, the boundary's state
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    from dynatrain_megatron.megatron_lm import step_guard

    class Timer:
        def __init__(self, started):
            self._started = started

        def start(self, barrier=False):
            self._started = True

        def reset(self):
            self._started = False

    timers = {"interval-time": Timer(True), "eval-time": Timer(False)}
    monkeypatch.setattr(step_guard, "_timers", lambda: timers)
    m = get_rerun_state_machine()
    monkeypatch.setattr(m, "mode", RerunMode.VALIDATE_RESULTS)  # as Megatron-LM trains
    boundary = (step_guard._rerun_snapshot(), step_guard._running_timers())
    assert boundary[1] == {"interval-time"}
    timers["interval-time"]._started, timers["eval-time"]._started = False, True
    m.set_mode(RerunMode.DISABLED)
    step_guard._rerun_restore(*boundary[0])
    step_guard._reset_timers_except(boundary[1])
    assert m.get_mode() == boundary[0][2] == RerunMode.VALIDATE_RESULTS
    assert (timers["interval-time"]._started, timers["eval-time"]._started) == (True, False)


def test_only_a_dead_peer_with_a_rendezvous_directory_is_recovered(monkeypatch, caplog):
    dead = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234. More\nlines")
    bug = ValueError("a bug of the model")
    monkeypatch.setattr(mlm, "_SESSION", None)
    with pytest.raises(RuntimeError) as e:  # no session yet: Megatron-LM's own error
        rank_death.failure_of(dead)
    assert e.value is dead

    def session(rendezvous_dir):
        hook = SimpleNamespace(layout="tp2pp2dp1", rendezvous_dir=rendezvous_dir,
                               can_recover=lambda err: rendezvous_dir is not None
                               and isinstance(err, RuntimeError))
        return SimpleNamespace(trainer=object(), hook=hook)

    monkeypatch.setattr(mlm, "_SESSION", session("/shared/rdv"))
    assert rank_death.failure_of(dead) == ("RuntimeError: [pair.cc:553] Connection closed by "
                                           "peer [127.0.0.1]:1234. More")
    with pytest.raises(ValueError) as e:
        rank_death.failure_of(bug)
    assert e.value is bug
    monkeypatch.setattr(mlm, "_SESSION", session(None))  # torchrun: no rendezvous directory
    with pytest.raises(RuntimeError) as e:
        rank_death.failure_of(dead)
    assert e.value is dead
    assert "cannot recover: restart it from the last --save" in caplog.text


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    require_snapshot()
    w = tmp_path_factory.mktemp("megatron-lm-death")
    w.chmod(0o700)
    tree = copy_tree(w / "patched", patched=True)
    faults = ('{"fail_rank": 3, "fail_phase": "eval", "iteration": 3, "kill": true, '
              '"exit_code": 1}')
    status, text = run_launched(
        tree, 4, CPU_FLAGS + TINY_GPT + layout_flags(2, 2) + [
            "--train-iters", str(N), "--save", str(w / "ckpt"), "--save-interval", "2",
            "--eval-interval", "3",
            "--distributed-timeout-minutes", "3",
            "--dynatrain", "--dynatrain-rendezvous-dir", str(w / "rdv")],
        w / "job.log", env={"DYNATRAIN_FAULTS": faults}, forked=False)  # dynatrain launch
    return dict(w=w, status=status, text=text, left=job_processes(tree))


@pytest.mark.multirank
@pytest.mark.faults
def test_survivors_recover_inside_megatron_lm(run):
    text = run["text"]
    assert run["status"] == 0, text[-4000:]  # the last workers to end exited 0
    exits = dict(re.findall(r"\[launch\] worker (\d) exited with (-?\d+) after", text))
    assert exits == {"3": "1", "0": "0", "1": "0", "2": "0"}
    # every survivor noticed in time and is in the one roster (none kept a socket of the
    # broken world open: rank 2 would otherwise wake only when ranks 0 and 1 exit)
    rosters = re.findall(r"world re-formed \(generation 1\): survivors (\[[0-9, ]*\]) of 4 "
                         r"ranks, (\d) kept", text)
    assert rosters == [("[0, 1, 2]", "2")] * 3
    assert text.count("this survivor is not needed by the new layout: the process ends") == 1
    # first seen inside the evaluation, held until the boundary (no Megatron-LM error)
    assert "fault injection: rank 3 dies in phase eval" in text
    assert re.search(r"a peer died during Megatron-LM's evaluate_and_print_results", text)
    assert "Traceback" not in text
    loaded = re.findall(r"loaded Megatron-LM's checkpoint of iteration (\d+) \((\d+) samples "
                        r"consumed\) from \S+ at (\S+) on (\d) ranks", text)
    assert loaded == [("2", "16", "tp2pp1dp1", "2")] * 2
    assert "recovered from the death of ranks [3]: tp2pp2dp1 -> tp2pp1dp1 (from the checkpoint)" \
        in text
    # nothing of the job outlives it: rank 3, killed after its save at 2 without its exit
    # handlers, once left its forked checkpoint manager running
    assert not run["left"], run["left"]


@pytest.mark.multirank
@pytest.mark.faults
def test_replayed_iteration_and_schedule_continue_exactly(run):
    lines = [(int(i), int(c), lr, loss, gn) for i, c, lr, loss, gn in LINE.findall(run["text"])]
    assert [i for i, *_ in lines] == [1, 2, 3, 3, 4, 5, 6]  # 3 before the death and again after
    for i, consumed, lr, _, _ in lines:
        assert consumed == 8 * i, (i, consumed)
        # as printed (7 digits): Megatron-LM's own arithmetic may round the last one apart
        assert float(lr) == pytest.approx(cosine_lr(i), rel=1e-6), (i, lr)
    before, after = [ln[2:4] for ln in lines if ln[0] == 3]
    # the same learning rate and loss: the same state and the same samples (module doc)
    assert before == after


@pytest.mark.multirank
@pytest.mark.faults
def test_checkpoints_after_the_recovery_describe_the_new_world(run):
    ckpt = run["w"] / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(N)
    common = {i: load_common(ckpt / f"iter_{i:07d}")
              for i in (2, 4, 6)}
    assert vars(common[2]["args"])["world_size"] == 4
    for i in (4, 6):
        a = common[i]["args"]
        assert (a.world_size, a.data_parallel_size, a.tensor_model_parallel_size,
                a.pipeline_model_parallel_size) == (2, 1, 2, 1)
        assert a.consumed_train_samples == 8 * i
        assert common[i]["opt_param_scheduler"]["num_steps"] == 8 * i
        # the work of the iteration lost with the dead rank (3) is not counted twice
        flops = common[i]["num_floating_point_operations_so_far"]
        assert flops == common[2]["num_floating_point_operations_so_far"] * i / 2


def test_the_first_train_step_begins_the_session_at_the_loops_start(monkeypatch):
    # a peer that dies inside the loop's first step (before any step boundary) is recovered
    # from the state the loop started with: the session begins before that step runs, on
    # the objects train_step is given, at the loop's starting iteration (once)
    from dynatrain_megatron.megatron_lm import seam

    begun = []

    def begin_session(args, iteration, model, optimizer, scheduler, config):
        begun.append((iteration, model, optimizer, scheduler, config))
        monkeypatch.setattr(mlm, "_SESSION", "session")

    monkeypatch.setattr(mlm, "_SESSION", None)
    monkeypatch.setattr(mlm, "begin_session", begin_session)

    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                   config, forward_backward_func, iteration=None):
        return (mlm.current_session(),)

    loop = seam.LoopSeam(SimpleNamespace(), None)
    assert loop.guard(train_step)("f", "it", ["m"], "o", "s", "c", "fb", iteration=4) == (
        "session",)  # begun before the step ran
    assert loop.guard(train_step)("f", "it", ["m2"], "o", "s", "c", "fb", iteration=5)
    assert begun == [(4, ["m"], "o", "s", "c")]


def test_survivors_resume_from_the_save_else_the_load_the_job_started_from(monkeypatch):
    # with no replica, the survivors load the last checkpoint: this job's --save, or before
    # its first save the --load it started from (a death in its first steps), never a
    # --load it took only in part; with none, one line naming both
    import sys
    import types

    from dynatrain_megatron.vps.errors import DynatrainError

    present = set()
    fake = types.ModuleType("megatron.training.checkpointing")
    fake.checkpoint_exists = lambda d: d in present
    monkeypatch.setitem(sys.modules, "megatron.training.checkpointing", fake)

    def args(**kw):
        return SimpleNamespace(**dict(dict(save="/s", load="/l", finetune=False,
                                           no_load_optim=False, no_load_rng=False), **kw))

    present |= {"/s", "/l"}
    assert rank_death._last_checkpoint(args()) == "save"
    present.discard("/s")
    assert rank_death._last_checkpoint(args()) == "load"
    with pytest.raises(DynatrainError, match=r"loaded only in part \(--no-load-optim\)"):
        rank_death._last_checkpoint(args(no_load_optim=True))
    present.clear()
    with pytest.raises(DynatrainError) as e:
        rank_death._last_checkpoint(args())
    assert "nothing yet in --save /s, nor --load /l" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_death_after_train_is_recovered_and_the_call_runs_again(monkeypatch):
    # pretrain()'s final save / validation / test after train(): a dead peer's failure is
    # recovered from the final state, the failed call runs again with the survivors'
    # objects and so do the later calls; no replica: one line and status 1; a survivor
    # kept on standby leaves with 0; anything else is Megatron-LM's own error
    from dynatrain_megatron.megatron_lm.after_train import AfterTrain
    from dynatrain_megatron.vps.errors import DynatrainError

    calls, faults, dead = [], [], RuntimeError("Connection closed by peer")

    def save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler,
                                 num_floating_point_operations_so_far, checkpointing_context,
                                 non_persistent_ckpt=False, train_data_iterator=None):
        calls.append(("save", iteration, model, optimizer, train_data_iterator))
        if model == "m":
            raise dead

    def evaluate_and_print_results(prefix, forward_step_func, data_iterator, model, iteration,
                                   process_non_loss_data_func, config, verbose=False):
        calls.append((prefix, data_iterator, model, config))

    module = SimpleNamespace(save_checkpoint_and_time=save_checkpoint_and_time,
                             evaluate_and_print_results=evaluate_and_print_results)
    own = dict(vars(module))
    survivors = mlm.LoopObjects(["m2"], "o2", "s2", "t2", "v2", "c2", "test2")
    recovered = []

    def recover(iteration, failure, context):
        recovered.append((iteration, failure, context))
        return survivors

    def failure_of(error):
        if error is not dead:
            raise error
        return "dead peer"

    after = AfterTrain(recover, failure_of, lambda phase, it: faults.append((phase, it)))
    after.install(module)
    module.save_checkpoint_and_time(6, "m", "o", "s", 1.0, {"ctx": 1}, train_data_iterator="t")
    assert recovered == [(6, "dead peer", {"ctx": 1})]
    assert calls == [("save", 6, "m", "o", "t"), ("save", 6, ["m2"], "o2", "t2")]
    module.evaluate_and_print_results("iteration 6 on validation set", None, "v", "m", 6, None,
                                      "c")
    module.evaluate_and_print_results("iteration 6 on test set", None, "x", "m", 6, None, "c")
    assert calls[2:] == [("iteration 6 on validation set", "v2", ["m2"], "c2"),
                         ("iteration 6 on test set", "test2", ["m2"], "c2")]
    assert faults == [("save", 6), ("eval", 6), ("eval", 6)]
    after.remove()
    assert vars(module) == own

    def ends(outcome):  # a second job's final save, recovered to `outcome`
        after = AfterTrain(outcome, failure_of, lambda *a: None)
        after.install(module)
        try:
            with pytest.raises(SystemExit) as e:
                module.save_checkpoint_and_time(6, "m", "o", "s", 1.0, {})
            return e.value.code
        finally:
            after.remove()

    def no_replica(*a):
        raise DynatrainError("no replica: the job ends")

    assert ends(no_replica) == 1
    assert ends(lambda *a: mlm.LoopObjects([], None, None, None, None, None, stop=True)) == 0
    bug = ValueError("a bug")
    after = AfterTrain(recover, failure_of, lambda *a: None)
    after.install(SimpleNamespace(save_checkpoint_and_time=lambda *a, **k: (_ for _ in ()).throw(bug)))
    with pytest.raises(ValueError, match="a bug"):
        after._module.save_checkpoint_and_time(6)


def test_a_death_in_megatron_lms_start_up_ends_each_survivor_in_one_line(monkeypatch, capsys):
    # between start() and the loop (no training state yet): the uncaught dead-peer error is
    # one line on stderr (status 1 as for any uncaught error); anything else as before; the
    # loop's start removes the hook (from there on deaths are recovered)
    import sys

    from dynatrain_megatron.megatron_lm import seam
    from dynatrain_megatron.megatron_lm.startup_death import StartupDeath

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append(a[1]))
    StartupDeath.install()
    dead = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234\nmore")
    sys.excepthook(RuntimeError, dead, None)
    err = capsys.readouterr().err
    assert err == ("dynatrain: a peer died during Megatron-LM's start-up, before the training "
                   "loop ([pair.cc:553] Connection closed by peer [127.0.0.1]:1234): there is "
                   "no training state to recover yet; the job ends: restart it\n")
    bug = ValueError("a bug")
    sys.excepthook(ValueError, bug, None)
    assert seen == [bug]
    seam.LoopSeam(SimpleNamespace(), None, training_module=SimpleNamespace(),
                  timer_class=type("T", (), {}))
    assert sys.excepthook is not StartupDeath.hook and StartupDeath.previous is None
