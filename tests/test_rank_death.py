"""A rank that dies (its process gone) during training (issue: Transactional switching):
the survivors notice, re-form the world among themselves through a store, name exactly the
state that died with it, and recover at a layout that fits them: from their own memory,
bit for bit and at the current iteration, when a partial distributed optimizer (doi2)
keeps a replica of every shard; else from the last checkpoint, never with wrong state."""
import pytest

from dynatrain_megatron.testing.multiproc import run_on_ranks
from rank_cases import death_case, death_in_switch_case, main_job_case, resume_case

pytestmark = [pytest.mark.multirank, pytest.mark.faults]


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    store, ckpt = tmp_path_factory.mktemp("store"), tmp_path_factory.mktemp("ckpt")
    out = run_on_ranks(death_case, 4, str(store), str(ckpt / "last"),
                       env={"DYNATRAIN_PG_TIMEOUT": "20"})
    ref = run_on_ranks(resume_case, 2, str(ckpt / "last"), "tp2pp1dp1")[0]
    return out, ref


def test_survivors_reform_and_resume_from_the_checkpoint(res):
    out, ref = res
    assert out[3] is None  # the dead rank left no result
    survivors = [r for r in (0, 1, 2)]
    members = out[0]["members"]
    assert all(out[r]["members"] == members for r in survivors)  # one roster for everyone
    assert len(members) == 2 and 3 not in members
    for r in survivors:
        # every survivor noticed in time (none left out: each lets go of every reference
        # to the broken communicators, so the others blocked on it wake at once)
        assert out[r]["dead"] == [3]
        assert out[r]["mode"] == "checkpoint"
        assert out[r]["detected"]  # each survivor saw a collective fail
        if r not in members:
            assert out[r]["new_rank"] is None  # not needed by the 2-rank layout: it leaves
            continue
        assert out[r]["new_rank"] == members.index(r)
        assert out[r]["layout"] == "tp2pp1dp1" and out[r]["world"] == 2
        assert out[r]["iteration"] == 2 == ref["iteration"]  # the checkpoint, not iteration 3
        assert out[r]["losses"] == ref["losses"]


def test_the_lost_state_is_named(res):
    out, _ = res
    lost = out[0]["lost"]
    assert "3] hold the only copy of" in lost
    assert "exp_avg" in lost and "main_param" in lost
    assert ", param:" not in lost and "of param:" not in lost  # the weights survive on DP replicas


@pytest.fixture(scope="module")
def in_memory(tmp_path_factory):
    store, ckpt = tmp_path_factory.mktemp("store2"), tmp_path_factory.mktemp("ckpt2")
    out = run_on_ranks(death_case, 4, str(store), str(ckpt / "last"), "tp1pp2doi2dp2", 3,
                       str(ckpt / "at-death"), env={"DYNATRAIN_PG_TIMEOUT": "20"})
    # the reference: a fresh job loading the state saved at the moment of the death
    ref = run_on_ranks(resume_case, 2, str(ckpt / "at-death"), "tp1pp2dp1")[0]
    return out, ref


def test_replicated_optimizer_state_is_recovered_in_memory_bit_for_bit(in_memory):
    out, ref = in_memory
    assert out[3] is None
    members = out[0]["members"]
    for r in (0, 1, 2):
        o = out[r]
        assert o["dead"] == [3] and o["members"] == members == [0, 1, 2]  # one roster
        assert o["mode"] == "memory" and o["target"] == "tp1pp2dp1"
        assert "hold no state that is not replicated" in o["lost"]
    trained = [o for o in out[:3] if "losses" in o]
    assert len(trained) == 2  # tp1pp2dp1; a third survivor in the roster is spare (standby)
    assert [o["state_diff"] for o in trained if "state_diff" in o] == [[]]  # all kinds, bit for bit
    for o in trained:
        # the current iteration (3), not the checkpoint's (2): nothing was lost
        assert o["iteration"] == 3 == ref["iteration"]
        assert o["losses"] == ref["losses"]


@pytest.fixture(scope="module")
def in_switch(tmp_path_factory):
    store, ckpt = tmp_path_factory.mktemp("store3"), tmp_path_factory.mktemp("ckpt3")
    out = run_on_ranks(death_in_switch_case, 4, str(store), str(ckpt / "at-switch"),
                       env={"DYNATRAIN_PG_TIMEOUT": "60"})
    ref = run_on_ranks(resume_case, 2, str(ckpt / "at-switch"), "tp1pp2dp1")[0]
    return out, ref


def test_rank_killed_in_a_transfer_round_leaves_a_and_is_recovered_in_memory(in_switch):
    """The issue's "rank killed in a transfer round": the switch cannot commit, A was only
    read, and the survivors recover it in memory, bit for bit, and train on with the losses
    of a run that never attempted the switch (a fresh job loading A's state)."""
    out, ref = in_switch
    assert out[3] is None  # the killed rank
    for r in (0, 1, 2):
        assert "tp1pp2doi2dp2 -> tp2pp1doi2dp2" in out[r]["broken"]
        assert 3 in out[r]["dead"] and out[r]["mode"] == "memory"
    trained = [o for o in out[:3] if "losses" in o]
    assert len(trained) == 2 and all(o["layout"] == "tp1pp2dp1" for o in trained)
    assert [o["state_diff"] for o in trained if "state_diff" in o] == [[]]
    for o in trained:
        assert o["iteration"] == 2 == ref["iteration"]
        assert o["losses"] == ref["losses"]


def _main_job_with_a_death(run, faults: dict, extra_argv: tuple[str, ...] = (),
                           dst: str = "tp1pp2dp1", src: str = "tp1pp2doi2dp2",
                           model: str = "tiny-gpt", pp: int = 2) -> tuple[list, dict]:
    """The training entry point on 4 ranks (`src`, by default tp1pp2doi2dp2: two optimizer
    instances, so a lost rank's state is replicated), a rendezvous directory, and `faults`
    (rank 3 killed);
    returns the per-rank results and the job's summary, after checking that the survivors
    recovered in memory at `dst` and finished every iteration."""
    import json
    from pathlib import Path

    cfg = Path(__file__).resolve().parent.parent / f"configs/models/{model}.yaml"
    argv = ["--model-config", str(cfg), "--tensor-model-parallel-size", "1",
            "--pipeline-model-parallel-size", str(pp), "--num-distributed-optimizer-instances", "2",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "8",
            "--lr", "1e-2", "--log-interval", "100", "--dynatrain",
            "--dynatrain-signal-file", str(run / "switch.json"), "--dynatrain-log-dir", str(run),
            "--dynatrain-rendezvous-dir", str(run / "rdv"), *extra_argv]
    out = run_on_ranks(main_job_case, 4, str(run), argv,
                       env={"DYNATRAIN_PG_TIMEOUT": "60", "DYNATRAIN_FAULTS": json.dumps(faults)})
    assert out[3] is None  # killed
    assert all(o["code"] == 0 for o in out[:3])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iteration"] == 8 and summary["layout"] == dst
    [rec] = summary["recoveries"]
    assert rec["mode"] == "memory" and 3 in rec["dead"]
    assert rec["src"] == src and rec["dst"] == dst
    return out, summary


def test_main_job_survives_a_killed_rank_and_finishes_in_memory(tmp_path):
    """The training entry point itself: with a rendezvous directory and two optimizer
    instances, a rank killed after step 4 (DYNATRAIN_FAULTS) is recovered in memory and
    the survivors finish every iteration; the summary says so."""
    _, summary = _main_job_with_a_death(tmp_path / "run", {
        "fail_rank": 3, "fail_phase": "step", "iteration": 4, "kill": True, "exit_code": 0})
    assert summary["recoveries"][0]["iteration"] == 4


def test_the_survivors_keep_the_jobs_virtual_stages(tmp_path):
    """The default rule keeps what of the job's layout fits the survivors: a job with two
    virtual stages per rank recovers in memory at tp1pp2vpp2 (it used to drop them)."""
    _main_job_with_a_death(tmp_path / "run", {
        "fail_rank": 3, "fail_phase": "step", "iteration": 4, "kill": True, "exit_code": 0},
        extra_argv=("--num-layers-per-virtual-pipeline-stage", "1"),
        src="tp1pp2vpp2doi2dp2", dst="tp1pp2vpp2dp1")


def test_an_moe_job_keeps_its_expert_parallelism(tmp_path):
    """An MoE job (tp1pp1ep2etp1doi2dp4) whose rank 3 dies recovers in memory at ep2 on
    two ranks (it used to drop to ep1: every expert on every rank) and trains to the end."""
    _main_job_with_a_death(tmp_path / "run", {
        "fail_rank": 3, "fail_phase": "step", "iteration": 4, "kill": True, "exit_code": 0},
        extra_argv=("--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"),
        model="tiny-moe", pp=1, src="tp1pp1ep2etp1doi2dp4", dst="tp1pp1ep2etp1dp2")


def test_with_auto_layout_the_survivors_move_to_the_advisors_layout(tmp_path):
    """--dynatrain-auto-layout: after rank 3 dies, the three survivors recover in memory at
    the layout advisor's best layout of at most 3 devices (here all three, where the
    default rule keeps tp1pp2 on 2), and the summary says why."""
    from dynatrain_megatron.configs import load_model
    from dynatrain_megatron.loop.auto_layout import LayoutAdvisor
    from dynatrain_megatron.mcore.train_config import TrainConfig
    from dynatrain_megatron.vps.layout import Layout

    advisor = LayoutAdvisor(load_model("tiny-gpt"),
                            TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=8))
    want = str(advisor.best_at_most(3, "test").layout)
    assert want != "tp1pp2dp1" and Layout.parse(want).world_size == 3
    _, summary = _main_job_with_a_death(tmp_path / "run", {
        "fail_rank": 3, "fail_phase": "step", "iteration": 4, "kill": True, "exit_code": 0},
        extra_argv=("--dynatrain-auto-layout",), dst=want)
    [rec] = summary["recoveries"]
    assert "auto-layout: 3 survivors after a rank death" in rec["reason"]
    assert want in rec["reason"]


def test_a_rank_killed_while_b_is_prepared_in_the_background_is_recovered(tmp_path):
    """A switch request is accepted and B (with A's binding) is being prepared in the
    background thread while A trains, when a rank dies at the end of its preparation (its
    process ends from that thread): the survivors drop the preparation, recover in memory
    and finish every iteration; the request is answered as failed, nothing was switched."""
    from dynatrain_megatron.elastic.signal_file import write_request

    run = tmp_path / "run"
    run.mkdir()
    write_request(run / "switch.json", "tp2pp2dp1", 4)  # read at the first poll
    _, summary = _main_job_with_a_death(run, {
        "fail_rank": 3, "fail_phase": "prepare", "kill": True, "exit_code": 0})
    assert summary["switches"] == 0
    answered = sorted(p.name for p in run.glob("switch.json.*"))
    assert answered and all(".failed." in n for n in answered), answered
