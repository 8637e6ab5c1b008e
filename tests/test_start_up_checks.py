"""Start-up checks of the operator's inputs (issue 14): the `--dynatrain-schedule` file and
`DYNATRAIN_FAULTS` are refused whole, with every defect named, before the first step."""
from __future__ import annotations

from pathlib import Path

import pytest

from dynatrain_megatron.elastic import controller as C
from dynatrain_megatron.elastic.schedule import ScheduleError, load_schedule
from dynatrain_megatron.transition.faults import FaultPlan, FaultSpecError, InjectedFault
from dynatrain_megatron.vps.model_spec import ModelSpec

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "models"


@pytest.mark.parametrize("text,match", [
    ("- {iteration: 3, layout: tp2pp2}\n- {iteration: 3, layout: tp1pp2}", "increasing order"),
    ("- {iteration: 5, layout: tp2pp2}\n- {iteration: 3, layout: tp1pp2}", "increasing order"),
    ("- {iteration: 0, layout: tp2pp2}", "outside 1..20"),
    ("- {iteration: -2, layout: tp2pp2}", "outside 1..20"),
    ("- {iteration: 21, layout: tp2pp2}", "outside 1..20"),
    ("- {iteration: 3, layout: tp2pp2, world: 4}", "unknown keys ['world']"),
    ("- {iteration: 3.7, layout: tp2pp2}", "iteration must be an int, got '3.7' (float)"),
    ("- {iteration: abc, layout: tp2pp2}", "iteration must be an int, got 'abc' (str)"),
    ("- {iteration: true, layout: tp2pp2}", "(bool)"),
    ("- {iteration: 3}", "lacks ['layout']"),
    ("- {iteration: 3, layout: 4}", "layout must be an ASCII string"),
    ("- {iteration: 3, layout: [tp2\n", "not valid YAML"),
    ("switches: []", "non-empty list"),
    ("{switches: [], extra: 1}", "exactly one key"),
    ("- tp2pp2", "must be a mapping"),
])
def test_schedule_defects_are_start_up_errors(tmp_path, text, match):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    with pytest.raises(ScheduleError, match=match.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)").replace("]", r"\]").replace(".", r"\.")):
        load_schedule(p, train_iters=20)


def test_schedule_lists_every_defect_at_once(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("- {iteration: 0, layout: tp2pp2}\n- {iteration: 4.5, layout: tp1pp2, x: 1}\n")
    with pytest.raises(ScheduleError) as e:
        load_schedule(p, train_iters=20)
    assert "entry 0: iteration 0" in str(e.value) and "entry 1: iteration must be" in str(e.value)
    assert "unknown keys ['x']" in str(e.value)


def test_schedule_layouts_checked_for_the_world_at_start_up(tmp_path, monkeypatch):
    p = tmp_path / "s.yaml"
    p.write_text("switches:\n- {iteration: 2, layout: tp2pp2}\n- {iteration: 4, layout: tp1cp2}\n"
                 "- {iteration: 6, layout: tp1etp2}\n- {iteration: 8, layout: tp3}\n")
    sched = load_schedule(p, train_iters=20)
    assert sched == [(2, "tp2pp2"), (4, "tp1cp2"), (6, "tp1etp2"), (8, "tp3")]
    spec = ModelSpec.from_yaml(CONFIGS / "tiny-gpt.yaml")
    ctl = C.Controller(spec, None, schedule=sched)
    with pytest.raises(C.DynatrainError) as e:
        ctl.check_schedule(4)
    msg = str(e.value)
    assert "iteration 4:" in msg and "Transformer Engine" in msg
    assert "iteration 6:" in msg and "needs an MoE model" in msg
    assert "iteration 8:" in msg and "does not divide world size 4" in msg
    assert "iteration 2:" not in msg


def test_schedule_entry_during_a_pending_switch_runs_after_it(monkeypatch, caplog):
    """Rank 0's side: the job does not poll while a switch is pending; the entries of those
    iterations run at the next polls, in order, and the log says so."""
    monkeypatch.setattr(C.dist, "get_world_size", lambda *a: 4)
    monkeypatch.setattr(C.dist, "get_rank", lambda *a: 0)
    monkeypatch.setattr(C.dist, "broadcast_object_list", lambda box, src=0: None)
    spec = ModelSpec.from_yaml(CONFIGS / "tiny-gpt.yaml")
    ctl = C.Controller(spec, None, poll_interval=5, schedule=[(2, "tp2pp2"), (3, "tp1pp2"),
                                                              (4, "tp2pp1")], schedule_lead=0)
    assert ctl.poll(1, 4).target is None
    assert ctl.poll(2, 4).target == "tp2pp2dp1"  # starts a switch; 3 and 4 are not polled
    d = ctl.poll(5, 4)
    assert d.target == "tp1pp2dp2" and "iteration 3 to tp1pp2 runs at iteration 5" in caplog.text
    assert ctl.poll(6, 4).target == "tp2pp1dp2"  # due, though 6 is not a poll iteration
    d = ctl.poll(10, 4)
    assert d.target is None and d.schedule_next == 3
    # a process that came in later (a joiner, on standby) takes rank 0's position from any
    # decision, so it agrees on which iterations poll once it trains
    late = C.Controller(spec, None, poll_interval=5, schedule=ctl.schedule, schedule_lead=0)
    assert late._schedule_due(11)
    late._received(d)
    assert not late._schedule_due(11) and not ctl._schedule_due(11)


@pytest.mark.parametrize("text,match", [
    ("{not json", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ('{"kill": "false"}', "kill must be bool, got 'false'"),
    ('{"fail_rank": "1", "fail_phase": "step"}', "fail_rank must be int"),
    ('{"fail_rank": 1, "fail_phase": "step", "iteration": 2.5}', "iteration must be int"),
    ('{"fail_rank": 1, "fail_phase": "stepp"}', "fail_phase 'stepp'"),
    ('{"fail_rank": 1}', "go together"),
    ('{"failrank": 1}', "unknown key 'failrank'"),
    ('{"delay_rank": true, "delay_seconds": 1}', "delay_rank must be int"),
    ('{"fail_rank": 1, "fail_phase": "prepare", "dst_layout": 4}', "dst_layout must be str"),
    ('{"delay_rank": 0, "delay_seconds": 1, "delay_phase": "commit"}', "delay_phase 'commit'"),
])
def test_faults_env_strict(monkeypatch, text, match):
    monkeypatch.setenv("DYNATRAIN_FAULTS", text)
    with pytest.raises(FaultSpecError, match=match):
        FaultPlan.from_env()


def test_faults_env_valid(monkeypatch):
    monkeypatch.setenv("DYNATRAIN_FAULTS", '{"fail_rank": 1, "fail_phase": "step", '
                                           '"iteration": 3, "kill": true, "delay_seconds": 0.5}')
    assert FaultPlan.from_env() == FaultPlan(fail_rank=1, fail_phase="step", iteration=3,
                                             kill=True, delay_seconds=0.5)
    monkeypatch.delenv("DYNATRAIN_FAULTS")
    assert FaultPlan.from_env() is None


@pytest.mark.parametrize("text,match", [
    ("[]", "an empty list"),
    ('[{"fail_rank": 1, "fail_phase": "forward"}, 3]', r"DYNATRAIN_FAULTS\[1\] must be a JSON object"),
    ('[{"fail_rank": 1, "fail_phase": "forward"}, {"fail_rank": 1, "fail_phase": "backward"}]',
     r"more than one plan for generation 0 .*\(1, 'forward'\), \(1, 'backward'\)"),
    ('[{"fail_rank": 1, "fail_phase": "forward"}, {"fail_rank": 0, "fail_phase": "step"}]',
     r"more than one plan for generation 0 \(several only as deaths inside a step"),
    ('[{"fail_rank": 1, "fail_phase": "forward", "generation": -1}]', "must be >= 0"),
    ('[{"fail_rank": 1, "fail_phase": "forward", "generation": "1"}]', "generation must be int"),
])
def test_faults_env_list_strict(monkeypatch, text, match):
    monkeypatch.setenv("DYNATRAIN_FAULTS", text)
    with pytest.raises(FaultSpecError, match=match):
        FaultPlan.plans_from_env()


def test_faults_env_one_plan_per_world_generation(monkeypatch):
    from dynatrain_megatron.transition.faults import plan_for

    monkeypatch.setenv("DYNATRAIN_FAULTS", '[{"fail_rank": 1, "fail_phase": "pp_send", '
                                           '"iteration": 3, "kill": true}, {"fail_rank": 0, '
                                           '"fail_phase": "forward", "iteration": 4, '
                                           '"generation": 1}]')
    plans = FaultPlan.plans_from_env()
    assert plans == (FaultPlan(fail_rank=1, fail_phase="pp_send", iteration=3, kill=True),
                     FaultPlan(fail_rank=0, fail_phase="forward", iteration=4, generation=1))
    assert FaultPlan.from_env() == plans[0]  # the launch world's
    assert plan_for(plans, 1) == plans[1] and plan_for(plans, 2) is None
    monkeypatch.setenv("DYNATRAIN_FAULTS", '[{"fail_rank": 0, "fail_phase": "forward", '
                                           '"generation": 1}]')
    assert FaultPlan.from_env() is None  # nothing for the launch world


def test_faults_inside_a_training_step_fire_once_in_the_step_after_their_iteration():
    from dynatrain_megatron.transition.faults import STEP_PHASES

    assert set(STEP_PHASES) == {"forward", "backward", "pp_send", "grad_sync", "optimizer",
                                "optimizer_update", "log", "eval", "save"}
    for phase in STEP_PHASES:
        plan = FaultPlan.from_json(f'{{"fail_rank": 2, "fail_phase": "{phase}", '
                                   f'"iteration": 3}}')
        plan.fail(2, phase, 2)  # the step after iteration 2: not this one
        plan.fail(1, phase, 3)  # another rank
        with pytest.raises(InjectedFault, match=f"rank 2 in phase {phase}"):
            plan.fail(2, phase, 3)


def test_fault_for_one_destination_layout_only():
    plan = FaultPlan.from_json('{"fail_rank": 1, "fail_phase": "prepare", '
                               '"dst_layout": "tp1pp1ep2etp1dp4"}')
    plan.fail(1, "prepare", dst="tp1pp1ep4etp1dp4")  # another B: goes through
    plan.fail(0, "prepare", dst="tp1pp1ep2etp1dp4")  # another rank
    with pytest.raises(InjectedFault, match="rank 1 in phase prepare"):
        plan.fail(1, "prepare", dst="tp1pp1ep2etp1dp4")
    with pytest.raises(InjectedFault):  # without a destination filter: every switch
        FaultPlan(fail_rank=1, fail_phase="prepare").fail(1, "prepare", dst="tp1pp1ep4etp1dp4")


def test_a_scheduled_switch_is_decided_its_lead_early_and_lands_after_its_iteration(monkeypatch):
    """With the default lead of one iteration the entry of iteration 3 is decided at 2 (B
    is prepared in the background meanwhile) and carries `at=3`, where the hook lands it."""
    monkeypatch.setattr(C.dist, "get_world_size", lambda *a: 4)
    monkeypatch.setattr(C.dist, "get_rank", lambda *a: 0)
    monkeypatch.setattr(C.dist, "broadcast_object_list", lambda box, src=0: None)
    spec = ModelSpec.from_yaml(CONFIGS / "tiny-gpt.yaml")
    ctl = C.Controller(spec, None, poll_interval=5, schedule=[(3, "tp2pp2")])
    assert ctl.poll(1, 4).target is None
    d = ctl.poll(2, 4)
    assert (d.target, d.at, d.schedule_next) == ("tp2pp2dp1", 3, 1)
    assert ctl.poll(3, 4).target is None  # taken once


def test_faults_env_several_step_deaths_in_one_generation(monkeypatch):
    from dynatrain_megatron.transition.faults import plans_for

    monkeypatch.setenv("DYNATRAIN_FAULTS", '[{"fail_rank": 0, "fail_phase": "forward", '
                                           '"iteration": 2}, {"fail_rank": 3, "fail_phase": '
                                           '"backward", "iteration": 2}, {"fail_rank": 1, '
                                           '"fail_phase": "backward", "generation": 1}]')
    plans = FaultPlan.plans_from_env()
    assert plans_for(plans, 0) == plans[:2] and plans_for(plans, 1) == plans[2:]
    assert plans_for(plans, 2) == ()
