"""`Plan`: checked at construction; `device_plan_errors` (the check each rank runs on its
part of the plan before a switch) finds a wrong piece, and the devices' checks together
equal `validate_plan` on a correct plan (pure, small worlds)."""
from dataclasses import replace

import numpy as np
import pytest

from dynatrain_megatron.routing import (RoutingError, build_plan, device_plan_errors,
                                        validate_plan)
from dynatrain_megatron.routing.plan import Plan
from dynatrain_megatron.vps import Layout, Placement

from routing_cases import spec


def _plan():
    return build_plan(spec("tiny-gpt"), Layout.parse("tp2pp2", 4), Layout.parse("tp1pp4", 4))


def _rebuilt(plan: Plan, **changes) -> Plan:
    fields = {f: getattr(plan, f) for f in Plan.__dataclass_fields__ if f != "_cache"}
    fields.update(changes)
    return Plan(**fields)


def test_every_device_checks_its_part_and_together_they_check_the_plan():
    plan = _plan()
    assert validate_plan(plan) == []
    for d in plan.devices:
        assert device_plan_errors(plan, d) == []
        assert device_plan_errors(plan, d, plan.pieces_for(d)) == []


def test_a_wrong_piece_is_named_by_both_devices():
    plan = _plan()
    dst = 1
    pieces = plan.pieces_for(dst)
    i = next(i for i, p in enumerate(pieces) if not p.is_local and p.dst_device == dst)
    bad = replace(pieces[i], dst_local_offsets=tuple(o + 1 for o in
                                                     pieces[i].dst_local_offsets))
    errs = device_plan_errors(plan, dst, pieces[:i] + [bad] + pieces[i + 1:])
    assert any("not inside a layout-B fragment of device 1" in e for e in errs)
    src = bad.src_device
    moved = replace(bad, dst_local_offsets=pieces[i].dst_local_offsets,
                    src_local_offsets=tuple(o + 1 for o in pieces[i].src_local_offsets))
    errs = device_plan_errors(plan, src, plan.pieces_for(src) + [moved])
    assert any(f"source device {src} does not hold it in layout A" in e for e in errs)
    # a missing piece leaves a gap in the receiver's fragment
    errs = device_plan_errors(plan, dst, pieces[:i] + pieces[i + 1:])
    assert any(f"device {dst} {pieces[i].key}/{pieces[i].kind}: pieces cover" in e
               for e in errs)


def test_plan_refuses_inconsistent_rows_and_stats():
    plan = _plan()
    with pytest.raises(RoutingError, match="rows of different lengths"):
        _rebuilt(plan, rows_src=plan.rows_src[:-1])
    rows = plan.rows_dst.copy()
    rows[0] = 99
    with pytest.raises(RoutingError, match="destination is not a device of layout B"):
        _rebuilt(plan, rows_dst=rows)
    with pytest.raises(RoutingError, match="moves .* lower bound"):
        _rebuilt(plan, stats=replace(plan.stats, moved_bytes=plan.stats.moved_bytes + 1))
    with pytest.raises(RoutingError, match="dst placement has 3 devices"):
        _rebuilt(plan, dst_placement=Placement((0, 1, 2)))
    with pytest.raises(RoutingError, match="kinds must be"):
        _rebuilt(plan, kinds=("weights",))
    assert np.array_equal(_rebuilt(plan).rows_src, plan.rows_src)  # a copy is accepted
