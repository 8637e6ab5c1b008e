"""The stall's accounting (loop/stall.py, loop/switch_log.py): the breakdown type refuses
parts that cannot add up, the meter measures the window and B's first step against the
steady ones, and the records carry wall-clock timestamps. Pure: no process group."""
import json
import os

import pytest

from dynatrain_megatron.loop.stall import (PART_NAMES, STEADY_STEPS, StallBreakdown, StallError,
                                           StallMeter, slowest, stall_parts)
from dynatrain_megatron.loop.switch_log import SwitchLog


def test_breakdown_refuses_unknown_repeated_unordered_or_negative_parts():
    ok = dict(iteration=3, rank=1, src="tp2pp2dp1", dst="tp1pp2dp2", window_s=0.5)
    with pytest.raises(StallError, match="unknown parts \\['coffee'\\]"):
        StallBreakdown(**ok, parts=(("coffee", 0.1),))
    with pytest.raises(StallError, match="unique and in PART_NAMES order"):
        StallBreakdown(**ok, parts=(("transfer", 0.1), ("bind", 0.1)))
    with pytest.raises(StallError, match="unique and in PART_NAMES order"):
        StallBreakdown(**ok, parts=(("bind", 0.1), ("bind", 0.1)))
    with pytest.raises(StallError, match="finite non-negative"):
        StallBreakdown(**ok, parts=(("transfer", -0.1),))
    with pytest.raises(StallError, match="window_s must be finite"):
        StallBreakdown(**{**ok, "window_s": float("nan")}, parts=())
    with pytest.raises(StallError, match="unknown stall part 'coffee'"):
        StallMeter(1, 0, "a", "b", started=0.0).add("coffee", 1.0)


def test_meter_measures_window_parts_and_first_step_over_steady():
    m = StallMeter(7, 2, "tp2pp2dp1", "tp1pp2dp2", started=100.0)
    m.add_all({"votes": 0.01, "transfer": 0.2}, {"transfer": 0.05, "rebuild": 0.1})
    m.resume(now=100.4)  # the loop's own work after the hook, then B's first step starts
    m.left(now=100.4)
    steps = [0.9, 0.5, 0.6, 0.4]  # first at B, then STEADY_STEPS steady ones
    t = 100.4
    for i, dt in enumerate(steps):
        t += dt
        done = m.step(t)
        m.left(now=t)
        assert done == (i == STEADY_STEPS)
    b = m.finish()
    assert b.window_s == pytest.approx(0.4)
    assert b.first_step_s == pytest.approx(0.9) and b.steady_step_s == pytest.approx(0.5)
    assert b.first_step_extra_s == pytest.approx(0.4)
    assert b.stall_s == pytest.approx(0.8)
    assert dict(b.parts) == pytest.approx({"votes": 0.01, "transfer": 0.25, "rebuild": 0.1,
                                           "first_step": 0.4})
    assert [n for n, _ in b.parts] == ["votes", "transfer", "rebuild", "first_step"]
    assert b.accounted_s == pytest.approx(0.76) and b.unaccounted_s == pytest.approx(0.04)
    assert str(b).startswith("stall 0.800 s [votes 0.010, transfer 0.250, rebuild 0.100, "
                             "first_step 0.400; other 0.040]")
    d = b.as_dict()
    assert d["stall_s"] == pytest.approx(0.8) and d["parts"]["first_step"] == pytest.approx(0.4)


def test_meter_splits_out_the_garbage_collection_of_each_step():
    gc_total = iter([1.0, 3.5, 3.5, 3.6, 3.6, 3.7, 3.7, 3.9, 3.9])  # cumulative, read in turn
    m = StallMeter(7, 2, "a", "b", started=0.0, gc_clock=lambda: next(gc_total))
    m.resume(now=1.0)  # reads 1.0
    t = 1.0
    for dt in (3.0, 1.0, 1.0, 1.0):  # step() then left() read the clock
        t += dt
        m.step(t)
        m.left(now=t)
    b = m.finish()
    assert b.first_step_gc_s == pytest.approx(2.5)  # a full collection in B's first step
    assert b.steady_step_gc_s == pytest.approx(0.1)
    assert b.as_dict()["first_step_gc_s"] == pytest.approx(2.5)
    with pytest.raises(StallError, match="first_step_gc_s must be finite"):
        StallBreakdown(iteration=1, rank=0, src="a", dst="b", window_s=0.1, parts=(),
                       first_step_gc_s=-1.0)


def test_meter_counts_the_page_faults_of_each_step():
    """B's first step touching memory for the first time shows as its page faults against
    a steady step's (the process's counter, read at each boundary)."""
    from dynatrain_megatron.loop.stall import minor_faults

    total = iter([100, 15100, 15100, 15300, 15300, 15450, 15450, 15700, 15700])
    m = StallMeter(7, 2, "a", "b", started=0.0, fault_clock=lambda: next(total))
    m.resume(now=1.0)
    t = 1.0
    for dt in (3.0, 1.0, 1.0, 1.0):
        t += dt
        m.step(t)
        m.left(now=t)
    b = m.finish()
    assert (b.first_step_faults, b.steady_step_faults) == (15000, 200)  # median of 3
    assert b.as_dict()["first_step_faults"] == 15000
    with pytest.raises(StallError, match="steady_step_faults must be a non-negative int"):
        StallBreakdown(iteration=1, rank=0, src="a", dst="b", window_s=0.1, parts=(),
                       steady_step_faults=-3)
    before = minor_faults()
    import numpy as np

    np.ones(8 << 20, dtype=np.uint8)  # 8 MiB touched for the first time
    assert minor_faults() > before  # (fewer faults than pages with huge pages)


def test_meter_without_steady_steps_leaves_the_first_step_unmeasured():
    m = StallMeter(7, 0, "a", "b", started=10.0)
    m.resume(now=10.3)
    b = m.finish()  # the job ended (or switched again) before B took a step
    assert b.first_step_s is None and b.first_step_extra_s == 0 and "first_step" not in dict(b.parts)
    assert b.stall_s == pytest.approx(0.3)


def test_slowest_rank_and_phase_mapping():
    mk = lambda r, w: StallBreakdown(1, r, "a", "b", w, ())  # noqa: E731
    assert slowest([mk(0, 0.2), mk(1, 0.5), mk(2, 0.5), mk(3, 0.1)]).rank == 1
    with pytest.raises(StallError):
        slowest([])
    parts = stall_parts({"bind": 0.1, "verify": 0.05, "vote": 0.02, "transfer": 0.3, "sync": 0.01,
                         "rebuild": 0.2}, {"scalars": 0.01, "release_a": 0.1, "rebind": 0.03})
    assert parts == pytest.approx({"bind": 0.15, "votes": 0.02, "transfer": 0.3, "scalars": 0.02,
                                   "rebuild": 0.2, "release_a": 0.1, "rebind": 0.03})
    assert set(parts) <= set(PART_NAMES)


def test_records_have_wall_clock_time_and_refuse_a_planted_link(tmp_path):
    from dynatrain_megatron.safe_files import OutputDir

    d = tmp_path / "logs"
    log = SwitchLog(OutputDir(d))
    rec = log.record("rejected", dict(iteration=4, reason="num_attention_heads 4 % tp 3"),
                     epoch=1_700_000_000.25)
    assert rec["time"] == 1_700_000_000.25 and rec["time_utc"] == "2023-11-14T22:13:20.250+00:00"
    log.record("switch", dict(iteration=5))
    rows = [json.loads(x) for x in (d / "switches.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["rejected", "switch"] and rows[0]["iteration"] == 4
    # a link planted where the records go is never written through
    victim = tmp_path / "victim"
    victim.write_text("keep")
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    os.symlink(victim, other / "switches.jsonl")
    assert SwitchLog(OutputDir(other)).record("switch", dict(iteration=1)) is None
    assert SwitchLog(None).record("switch", dict(iteration=1)) is None  # no log directory
    assert victim.read_text() == "keep"


def test_metrics_reach_megatron_writers_and_a_failing_sink_is_dropped(caplog):
    from dynatrain_megatron.loop.switch_log import layout_scalars
    from dynatrain_megatron.megatron_lm.metrics import MegatronWriters
    from dynatrain_megatron.vps.layout import Layout

    class Writer:  # TensorBoard's SummaryWriter / a W&B run, as far as we call them
        def __init__(self):
            self.calls = []

        def add_scalar(self, tag, value, step):
            self.calls.append(("scalar", tag, value, step))

        def add_text(self, tag, value, step):
            self.calls.append(("text", tag, value, step))

        def log(self, values, step):
            self.calls.append(("log", values, step))

    tb, wb = Writer(), Writer()
    report = SwitchLog(None)
    report.sinks.append(MegatronWriters(tb, wb))
    report.sinks.append(lambda it, s: 1 / 0)
    scalars = {"dynatrain/stall_s": 0.5, "dynatrain/placement": "0,2,1,3",
               **layout_scalars(Layout.parse("tp1pp2dp2", 4))}
    report.metrics(7, scalars)
    report.metrics(8, {"dynatrain/stall_s": 0.25})
    assert ("scalar", "dynatrain/stall_s", 0.5, 7) in tb.calls
    assert ("text", "dynatrain/placement", "0,2,1,3", 7) in tb.calls
    assert ("scalar", "dynatrain/layout/dp", 2, 7) in tb.calls
    assert ("scalar", "dynatrain/layout/tp", 1, 7) in tb.calls
    assert wb.calls == [("log", scalars, 7), ("log", {"dynatrain/stall_s": 0.25}, 8)]
    assert len(report.sinks) == 1  # the failing one was dropped, training went on


def test_one_logger_one_prefix_once_lines_on_rank_zero(capsys):
    import logging

    from dynatrain_megatron.loop.logs import ONCE, configure

    log = configure(rank=0)
    logging.getLogger("dynatrain").info("dynatrain: iteration 3: switched", extra=ONCE)
    logging.getLogger("dynatrain").info("iteration 4 done")
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("r0] dynatrain: iteration 3: switched")
    assert out[1].endswith("r0] dynatrain: iteration 4 done")
    configure(rank=1)
    log.info("the job's line is rank 0's", extra=ONCE)
    log.info("this rank's own state")
    log.warning("a warning about the job", extra=ONCE)
    assert [ln.split("] ", 1)[1] for ln in capsys.readouterr().out.splitlines()] == [
        "dynatrain: this rank's own state", "dynatrain: a warning about the job"]
    configure(rank=1, all_ranks=True)
    log.info("unless asked", extra=ONCE)
    assert "unless asked" in capsys.readouterr().out
    configure(rank=0)


def test_automatic_collections_wait_for_the_switch_and_a_job_that_disabled_them_keeps_that():
    import gc

    from dynatrain_megatron.loop.stall_tracker import StallTracker

    assert gc.isenabled()
    try:
        t = StallTracker(None)
        t.before_switch()  # a switch starts: no automatic collection inside its stall
        assert not gc.isenabled()
        t.left()  # it rolled back (no switch being measured): collections go on
        assert gc.isenabled()
        t.before_switch()
        t.attempt_ended()  # a switch that left this rank on standby: collections go on
        assert gc.isenabled()
        gc.disable()  # the job's own choice (Megatron-LM's --manual-gc)
        t.before_switch()
        t.left()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_weights_travel_with_the_transfer_only_where_b_would_gather_them_after():
    from dataclasses import replace

    from dynatrain_megatron.configs import load_model as model_spec
    from dynatrain_megatron.loop.switching import moves_weights
    from dynatrain_megatron.vps.layout import Layout

    dense, moe = model_spec("tiny-gpt"), model_spec("tiny-moe")
    assert dense.distributed_optimizer
    # B's masters sharded over 2 ranks: the rebuild would all-gather B's weights
    assert moves_weights(dense, Layout.parse("tp1pp2dp2"))
    assert moves_weights(dense, Layout.parse("tp1pp2dp2", 4))
    # one rank per shard (DP 1, or one optimizer instance per DP rank): nothing to gather
    assert not moves_weights(dense, Layout.parse("tp2pp2dp1"))
    assert not moves_weights(dense, Layout.parse("tp1pp1doi2dp2"))
    # a plain optimizer holds whole fp32 copies: the rebuild is a local copy
    assert not moves_weights(replace(dense, distributed_optimizer=False),
                             Layout.parse("tp1pp2dp2"))
    # the experts' masters sharded over their own data-parallel ranks (TP 2, expert TP 1:
    # expert DP 2), the dense ones not (DP 1)
    assert moves_weights(moe, Layout.parse("tp2pp1ep1etp1dp1"))
    assert not moves_weights(dense, Layout.parse("tp2pp1ep1etp1dp1"))


def test_retired_data_workers_take_the_lowest_priority_and_a_gone_one_is_skipped():
    import subprocess
    import sys
    from types import SimpleNamespace

    from dynatrain_megatron.megatron_lm.data_ahead import lower_priority

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        lower_priority([gone, SimpleNamespace(pid=None), proc])  # never raises
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == 19
    finally:
        proc.kill()
        proc.wait()


def test_a_released_layouts_groups_wait_for_the_deferred_collection():
    from types import SimpleNamespace

    from dynatrain_megatron.mcore import session

    class Groups:
        def __init__(self):
            self.destroyed, self.handles = [], [object()]

        def destroy(self, broken=False):
            self.destroyed.append(broken)

        def take_handles(self):
            out, self.handles = self.handles, []
            return out

    def layout():
        return SimpleNamespace(config=SimpleNamespace(), groups=Groups(), model=[object()],
                               optimizer=object(), scheduler=object())

    a, b, c = layout(), layout(), layout()
    session.release(a, collect_later=True, groups_later=True)
    session.release(b, collect_later=True)  # the groups go now, the memory later
    assert a.groups.destroyed == [] and a.groups.handles and a.model == []
    assert b.groups.destroyed == [False] and not b.groups.handles
    session.collect_released()
    assert a.groups.destroyed == [False] and not a.groups.handles
    session.release(c, collect_later=True, groups_later=True)
    session.collect_released(broken=True)  # a rank died meanwhile: aborted, not shut down
    assert c.groups.destroyed == [True]
    session.collect_released()
    assert c.groups.destroyed == [True]  # once


def test_a_release_that_can_wait_runs_once_bs_first_steps_are_measured(tmp_path):
    """`StallTracker.defer`: A's DataLoader workers retire once the switch's measurement
    ends (reported, or dropped: another switch, a death, the end), not beside its last
    agreement and B's first steps; at once when no switch is being measured."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from dynatrain_megatron.loop.stall_tracker import StallTracker

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        t, ran = StallTracker(None), []
        t.defer(lambda: ran.append("at once"))
        assert ran == ["at once"]
        for broken in (False, True):
            t.boundary()
            t.begin(SimpleNamespace(iteration=3, src="tp2pp2", dst="tp1pp2dp2"), {}, {}, {})
            t.defer(lambda: ran.append("A's workers"))
            t.left()
            t.next_step_boundary()  # after B's first step: still held
            assert ran == ["at once"] + ["A's workers"] * broken
            t.drop(broken=broken)
            assert ran == ["at once"] + ["A's workers"] * (1 + broken)
            t.drop()  # once
            assert len(ran) == 2 + broken
    finally:
        dist.destroy_process_group()
