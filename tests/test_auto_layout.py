"""The controller asks the layout advisor (issue 18): requests that name only a world size,
and --dynatrain-auto-layout when the number of processes changes (pure: one process, the
collectives faked)."""
import json
from pathlib import Path

from dynatrain_megatron.cli import main as cli
from dynatrain_megatron.elastic import controller as C
from dynatrain_megatron.elastic.signal_file import read_request, write_request
from dynatrain_megatron.loop.auto_layout import LayoutAdvisor
from dynatrain_megatron.mcore.train_config import TrainConfig
from dynatrain_megatron.vps.model_spec import ModelSpec

SPEC = ModelSpec.from_yaml(Path(__file__).parent.parent / "configs/models/tiny-gpt.yaml")
TRAIN = TrainConfig(micro_batch_size=2, global_batch_size=8)


def _advisor():
    return LayoutAdvisor(SPEC, TRAIN, transformer_engine=False)


def test_request_without_layout_moves_to_the_advisors_best(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(C.dist, "get_world_size", lambda *a: 4)
    monkeypatch.setattr(C.dist, "get_rank", lambda *a: 0)
    path = tmp_path / "s.json"
    assert cli(["request", "--signal-file", str(path), "--world", "2"]) == 0
    assert "advisor's best layout on 2 ranks" in capsys.readouterr().out
    req = read_request(path)
    assert (req.layout, req.world) == (None, 2)
    ctl = C.Controller(SPEC, str(path))
    adv = _advisor()
    ctl.advise = adv.advise
    d = ctl._decide_on_rank0(3, 4)
    best = adv.ranking(2).best
    assert (d.target, d.world, d.rejected) == (str(best), 2, None)
    assert "request for 2 ranks without a layout" in d.note and str(best) in d.note
    # without an advisor the same request is refused with the reason, training goes on
    req = write_request(path, None, 2)
    ctl.advise = None
    d = ctl._decide_on_rank0(4, 4)
    assert d.target is None and "no layout advisor" in d.rejected
    filed = json.loads((tmp_path / f"s.json.rejected.{req.id}").read_text())
    assert "no layout advisor" in filed["reason"]
    # a device count no layout serves is refused, naming the advisor's reason
    write_request(path, None, 3)
    ctl.advise = LayoutAdvisor(SPEC, TrainConfig(micro_batch_size=2, global_batch_size=8),
                               device_memory_bytes=1000, transformer_engine=False).advise
    d = ctl._decide_on_rank0(5, 4)
    assert d.target is None and "no layout of 3 devices fits" in d.rejected
    assert cli(["request", "--signal-file", str(path)]) == 2
    assert "give --layout, or --world N" in capsys.readouterr().err


def test_auto_layout_acts_once_per_process_count(tmp_path, monkeypatch):
    procs = {"n": 4}
    monkeypatch.setattr(C.dist, "get_world_size", lambda *a: procs["n"])
    monkeypatch.setattr(C.dist, "get_rank", lambda *a: 0)
    ctl = C.Controller(SPEC, None)
    adv = _advisor()
    ctl.advise = adv.advise
    # without --dynatrain-auto-layout, standby ranks stay on standby
    assert ctl._decide_on_rank0(1, 2).target is None
    ctl.auto_layout = True
    d = ctl._decide_on_rank0(2, 2)  # 2 of 4 processes in the layout: standby ranks at start
    assert (d.target, d.world, d.source) == (str(adv.ranking(4).best), 4, "auto")
    assert d.note.startswith("auto-layout: 4 processes, the layout uses 2")
    # a later scale-in by request is left alone: the process count did not change
    assert ctl._decide_on_rank0(3, 2).target is None
    procs["n"] = 8  # joiners admitted
    d = ctl._decide_on_rank0(4, 4)
    assert (d.target, d.world) == (str(adv.ranking(8).best), 8)


def test_best_at_most_skips_counts_without_a_layout():
    adv = LayoutAdvisor(SPEC, TrainConfig(micro_batch_size=2, global_batch_size=8),
                        transformer_engine=False)
    # 5 survivors: dp5 does not divide 8 / 2, tiny-gpt has no 5-way TP, PP or CP: 4 devices
    c = adv.best_at_most(5, "auto-layout: 5 survivors after a rank death")
    assert c.layout.world_size == 4 and c.layout == adv.ranking(4).best
    assert c.note.startswith("auto-layout: 5 survivors after a rank death: advisor's best")


def test_rank_death_recovery_asks_the_advisor_with_auto_layout():
    """With --dynatrain-auto-layout, the survivors' layout is the advisor's best of the
    most survivors it serves (recover_after_death's `choose`); without it, recovery keeps
    its own rule (None)."""
    from dynatrain_megatron.loop.hook import DynatrainHook

    adv = _advisor()
    hook = DynatrainHook(SPEC, TRAIN, C.Controller(SPEC, None), advisor=adv, auto_layout=True)
    assert hook.controller.advise == adv.advise and hook.controller.auto_layout
    layout, note = hook._survivor_layout()(5)
    assert layout == adv.ranking(4).best
    assert note.startswith("auto-layout: 5 survivors after a rank death: advisor's best of 4")
    plain = DynatrainHook(SPEC, TRAIN, C.Controller(SPEC, None), advisor=adv)
    assert plain._survivor_layout() is None and not plain.controller.auto_layout


def test_requests_for_an_interleaved_layout_the_batch_cannot_run_are_refused():
    """megatron-core's interleaved schedule raises at the first step when the micro-batches
    are not a multiple of pp (found by a live auto-layout job): the job's own check refuses
    such a request up front, as the advisor never suggests it."""
    import pytest

    from dynatrain_megatron.vps.errors import LayoutError
    from dynatrain_megatron.vps.layout import Layout
    from dynatrain_megatron.vps.validate import validate_layout

    def check(tr, text):
        validate_layout(SPEC, Layout.parse(text), global_batch_size=tr.global_batch_size,
                        micro_batch_size=tr.micro_batch_size)

    train = TrainConfig(micro_batch_size=2, global_batch_size=12)
    with pytest.raises(LayoutError, match="groups of pp 2; 3 micro-batches"):
        check(train, "tp1pp2vpp2dp2")
    check(train, "tp1pp2dp2")  # 1F1B runs 3 micro-batches
    check(TrainConfig(micro_batch_size=2, global_batch_size=8), "tp1pp2vpp2dp2")
    assert all(str(r.layout) != "tp1pp2vpp2dp2" for r in LayoutAdvisor(
        SPEC, train, transformer_engine=False, top=50).ranking(4).rows)
