"""How far ahead a scheduled switch is decided (loop/schedule_lead.py) and how the lead
reaches every rank (elastic/controller.py): pure logic, no process group."""
from pathlib import Path

import pytest

from dynatrain_megatron.elastic import controller as C
from dynatrain_megatron.loop.schedule_lead import MARGIN, ScheduleLead, process_age_s
from dynatrain_megatron.vps.model_spec import ModelSpec

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "models"


def _steps(lead: ScheduleLead, times: list[float]) -> None:
    for t in times:
        lead.step_boundary(t)


def test_lead_is_the_preparation_over_the_step_time():
    lead = ScheduleLead(start_estimate_s=10.0)
    assert lead.lead() == lead.max_lead  # first boundary: no step time yet, decide now
    _steps(lead, [0.0, 1.0, 2.0, 3.0])  # 1 s steps
    assert lead.lead() == 10  # the job's start-up (an upper bound of building B) / step
    lead.switched()  # the step across the switch is not timed
    _steps(lead, [100.0, 100.5])
    assert lead.lead() == 10  # median of 1, 1, 1, 0.5 s
    lead.prepared(4.0)
    assert lead.lead() == int(-(-4.0 * MARGIN // 1.0))  # measured, with the margin: 6


def test_switched_takes_the_preparation_the_device_manager_measured():
    class Devices:
        placement_seconds, build_seconds, prepare_seconds = 0.5, 1.0, 2.5

    lead = ScheduleLead(start_estimate_s=100.0)
    _steps(lead, [0.0, 2.0, 4.0])
    lead.switched(Devices())
    assert lead.lead() == 3  # 4 s x 1.5 over 2 s steps
    lead.switched(None)  # B built in the pause: nothing measured, the last estimate stays
    assert lead.lead() == 3


def test_lead_is_capped_and_bounded_below():
    lead = ScheduleLead(minimum=2, max_lead=5, start_estimate_s=1e6)
    _steps(lead, [0.0, 0.001])
    assert lead.lead() == 5
    fast = ScheduleLead(minimum=2, start_estimate_s=0.0)
    _steps(fast, [0.0, 10.0])
    assert fast.lead() == 2
    unknown = ScheduleLead()
    unknown._start_estimate = None
    assert unknown.lead() == unknown.minimum
    with pytest.raises(ValueError, match="minimum <= max_lead"):
        ScheduleLead(minimum=3, max_lead=2)


def test_process_age_is_this_process_age():
    age = process_age_s()
    assert age is not None and 0.0 <= age < 24 * 3600


def test_rank0s_lead_travels_with_the_decision(monkeypatch):
    """Rank 0 decides with its fresh lead and sends it; every rank gates its polls on the
    lead it received, so all agree which iterations poll (poll interval 5 here)."""
    monkeypatch.setattr(C.dist, "get_world_size", lambda *a: 4)
    monkeypatch.setattr(C.dist, "get_rank", lambda *a: 0)
    monkeypatch.setattr(C.dist, "broadcast_object_list", lambda box, src=0: None)
    spec = ModelSpec.from_yaml(CONFIGS / "tiny-gpt.yaml")
    sched = [(12, "tp2pp2")]
    ctl = C.Controller(spec, None, poll_interval=5, schedule=sched)
    ctl.lead_source = lambda: 8
    d = ctl.poll(5, 4)  # a poll iteration: 12 - 8 <= 5, decided now
    assert d.target == "tp2pp2dp1" and d.at == 12 and d.schedule_lead == 8
    other = C.Controller(spec, None, poll_interval=5, schedule=sched)
    assert not other._schedule_due(4)  # its own lead (1) until it hears rank 0's
    other._received(C.Decision(None, None, "signal", schedule_lead=8))
    assert other.schedule_lead == 8 and other._schedule_due(4)
