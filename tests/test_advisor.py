"""The layout advisor on paper: enumeration against a brute force over the grammar, the
memory model's bounds, the ranking, calibration and `dynatrain suggest` (issue 18)."""
import json
import math
import re

import pytest

from dynatrain_megatron.advisor import (AdvisorError, Calibration, Measurement, NoLayoutFits,
                                        SearchSpace, Workload, enumerate_layouts, suggest)
from dynatrain_megatron.advisor.calibration import load_calibration
from dynatrain_megatron.advisor.enumerate import canonical_key, stage_spread
from dynatrain_megatron.advisor.memory import (memory_estimate, state_bytes_by_stage,
                                               state_bytes_per_rank, state_lower_bound)
from dynatrain_megatron.advisor.step_time import step_estimate
from dynatrain_megatron.advisor.suggest import schedulable_microbatches
from dynatrain_megatron.cli import main as cli_main
from dynatrain_megatron.configs import load_model as resolve_model
from dynatrain_megatron.vps.errors import LayoutError
from dynatrain_megatron.vps.layout import Layout
from dynatrain_megatron.vps.validate import layout_errors

EVERYTHING = SearchSpace(max_stage_spread=None, optimizer_instances=True, max_tp=None,
                         max_cp=None, max_etp=None, max_vpp=None)


def brute_force(spec, world):
    """Every layout string of the grammar with `world` devices that the validator accepts,
    by nested loops over every axis value (only the grammar's own world rules prune)."""
    L = spec.num_layers
    out = set()
    rng = range(1, world + 1)
    for tp in rng:
        for pp in rng:
            for cp in rng:
                if world % (tp * pp * cp):
                    continue
                dp = world // (tp * pp * cp)
                for ep in rng:
                    for etp in rng:
                        if world % (etp * ep * pp):
                            continue
                        for doi in rng:
                            for vpp in range(1, L + 1):
                                for ppf in range(L + 1) if pp > 1 else (0,):
                                    for ppl in range(L + 1) if pp > 1 else (0,):
                                        try:
                                            lay = Layout(tp=tp, pp=pp, dp=dp, vpp=vpp, cp=cp,
                                                         ep=ep, etp=etp, ppf=ppf, ppl=ppl,
                                                         doi=doi)
                                        except LayoutError:
                                            continue
                                        if not layout_errors(spec, lay):
                                            out.add(canonical_key(lay, spec))
    return out


@pytest.mark.parametrize("model,world", [("tiny-gpt", 4), ("tiny-gpt", 8), ("tiny-moe", 4),
                                         ("tiny-moe", 8)])
def test_enumeration_equals_brute_force(model, world):
    spec = resolve_model(model)
    got = enumerate_layouts(spec, world, EVERYTHING)
    keys = [canonical_key(x, spec) for x in got]
    assert len(keys) == len(set(keys)), "one layout string per distinct job"
    assert set(keys) == brute_force(spec, world)
    # the default space: the full one without doi > 1 and with first/last stages at most
    # 2 layers off the middle ones (the caps of 8 do not bind here)
    default = {canonical_key(x, spec) for x in enumerate_layouts(spec, world)}
    assert default == {k for k in keys if k[7] == 1 and stage_spread(k[8]) <= 2}


def test_state_lower_bound_and_stage_maxima():
    for model, world in (("tiny-gpt", 8), ("tiny-moe", 8)):
        spec = resolve_model(model)
        for lay in enumerate_layouts(spec, world):
            try:
                exact = state_bytes_by_stage(spec, lay)
            except LayoutError:
                continue
            assert (state_lower_bound(spec, lay) <= exact).all(), lay
            per_rank = [s.total for s in state_bytes_per_rank(spec, lay)]
            assert int(exact.max()) == max(per_rank), lay


WORK70 = {128: Workload(1, 512, 8192), 96: Workload(1, 480, 8192)}
PUBLISHED70 = {128: "tp4pp4vpp5cp2dp4", 96: "tp4pp4vpp5cp2dp3"}  # NeMo llama3_70b recipe


@pytest.mark.parametrize("world", [128, 96])
def test_llama70b_top_suggestions_fit(world):
    spec = resolve_model("llama3-70b")
    mem = 80 * 10 ** 9
    cal = Calibration()
    s = suggest(spec, world, WORK70[world], cal, device_memory_bytes=mem, top=5,
                transformer_engine=True)
    steps = [r.step_seconds for r in s.rows]
    assert len(s.rows) == 5 and steps == sorted(steps)
    for r in s.rows:
        m = WORK70[world].num_microbatches(r.layout.dp)
        est = memory_estimate(spec, r.layout, WORK70[world], cal, m)
        assert r.memory_bytes_per_device == est.peak_bytes + cal.reserve_bytes <= mem
    # the published layout fits; nothing that fits is faster than the advisor's best
    pub = Layout.parse(PUBLISHED70[world])
    m = WORK70[world].num_microbatches(pub.dp)
    assert memory_estimate(spec, pub, WORK70[world], cal, m).peak_bytes + cal.reserve_bytes <= mem
    assert step_estimate(spec, pub, WORK70[world], cal, m).step_seconds >= steps[0]


def test_no_layout_fits_names_the_smallest():
    spec = resolve_model("tiny-gpt")
    work = Workload(2, 8, 32)
    cal = Calibration(reserve_bytes=0)
    with pytest.raises(NoLayoutFits) as ei:
        suggest(spec, 4, work, cal, device_memory_bytes=1000, space=SearchSpace(
            context_parallel=False))
    msg = str(ei.value)
    assert msg.startswith("no layout of 4 devices fits: the smallest needs ")
    need = float(re.search(r"needs ([\d.]+) GB", msg).group(1))
    best = math.inf
    for lay in enumerate_layouts(spec, 4, SearchSpace(context_parallel=False)):
        m = schedulable_microbatches(work, lay)
        if m:
            best = min(best, memory_estimate(spec, lay, work, cal, m).peak_bytes)
    assert need == round(best / 1e9, 1)
    with pytest.raises(NoLayoutFits, match="no layout of 8 devices fits: the smallest needs"):
        suggest(resolve_model("llama3-70b"), 8, Workload(1, 64, 8192),
                device_memory_bytes=80 * 10 ** 9)
    with pytest.raises(NoLayoutFits, match="no layout of 7 devices fits: no valid layout's "
                                           "data-parallel size divides the global batch 8"):
        suggest(spec, 7, work, space=SearchSpace(max_stage_spread=0))


def test_calibration_file_errors_name_the_field(tmp_path):
    f = tmp_path / "cal.yaml"
    f.write_text("achieved_tflops: 300\nbogus_field: 1\n")
    with pytest.raises(AdvisorError, match="bogus_field"):
        load_calibration(f)
    f.write_text("achieved_tflops: [1, 2\n")
    with pytest.raises(AdvisorError, match="is not readable YAML"):
        load_calibration(f)
    # read as every file of ours is: a planted link is refused, not followed
    link = tmp_path / "link.yaml"
    link.symlink_to(f)
    with pytest.raises(AdvisorError, match="calibration file .*link.yaml is a symbolic link"):
        load_calibration(link)
    f.write_text("inter_node_gbps: -3\n")
    with pytest.raises(AdvisorError, match="inter_node_gbps"):
        load_calibration(f)
    f.write_text("measured:\n  - {layout: tp1pp1dp4, seconds: 2}\n")
    with pytest.raises(AdvisorError, match=r"measured\[0\]"):
        load_calibration(f)
    f.write_text("achieved_tflops: 300\nmeasured:\n  - {layout: tp1pp1dp4, step_seconds: 2}\n")
    cal, meas = load_calibration(f)
    assert cal.achieved_tflops == 300 and meas == (Measurement("tp1pp1dp4", 2),)


def test_measured_step_scales_every_estimate():
    spec = resolve_model("tiny-gpt")
    work = Workload(2, 8, 32)
    sp = SearchSpace(context_parallel=False)
    base = suggest(spec, 4, work, space=sp, top=3)
    lay = base.rows[0].layout
    twice = suggest(spec, 4, work, space=sp, top=3,
                    measured=[Measurement(str(lay), 2 * base.rows[0].step_seconds)])
    assert [str(r.layout) for r in twice.rows] == [str(r.layout) for r in base.rows]
    for a, b in zip(base.rows, twice.rows):
        assert b.step_seconds == pytest.approx(2 * a.step_seconds, rel=1e-12)
    with pytest.raises(AdvisorError, match="LAYOUT=SECONDS"):
        Measurement.parse("tp1pp1dp4")


def test_cli_json_table_and_errors(capsys, tmp_path):
    args = ["suggest", "--model", "tiny-moe", "--world", "4", "--top", "3",
            "--no-transformer-engine", "--max-cp", "1", "--micro-batch-size", "2",
            "--global-batch-size", "8"]
    assert cli_main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["layouts"]
    assert len(rows) == 3 and [r["step_seconds"] for r in rows] == sorted(
        r["step_seconds"] for r in rows)
    for r in rows:
        assert {"layout", "memory_bytes_per_device", "step_seconds"} <= set(r)
        assert "switch_seconds" not in r
    assert cli_main(args + ["--json", "--from", "tp1pp1ep4etp1dp4"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    for r in rows:
        assert r["switch_bytes"] >= 0 and r["switch_seconds"] >= 0
    assert rows[0]["switch_bytes"] > 0 or rows[0]["layout"] == "tp1pp1ep4etp1dp4"
    assert cli_main(args) == 0
    assert "step s" in capsys.readouterr().out
    assert cli_main(args + ["--device-memory", "1kB"]) == 2
    assert "no layout of 4 devices fits: the smallest needs" in capsys.readouterr().err
    bad = tmp_path / "c.yaml"
    bad.write_text("ranks_per_node: eight\n")
    assert cli_main(args + ["--calibration", str(bad)]) == 2
    assert "ranks_per_node" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:
        cli_main(args + ["--link-speed", "3"])
    assert ei.value.code == 2
    assert "--link-speed" in capsys.readouterr().err
