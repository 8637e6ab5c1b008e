"""The transfer simulated on a fabric (routing.fabric): max-min sharing, the fat tree's
links, the rounds read from the schedule as the executor sends them, and the check
against our measured gloo runs."""
from __future__ import annotations

import numpy as np
import pytest

from dynatrain_megatron.configs import load_model
from dynatrain_megatron.routing.fabric import (Fabric, flows_of_round, max_min_rates,
                                               simulate_flows, simulate_transfer)
from dynatrain_megatron.routing.planner import build_plan
from dynatrain_megatron.routing.regions import RoutingError
from dynatrain_megatron.routing.schedule import build_schedule
from dynatrain_megatron.vps.fragment import OPT_KINDS
from dynatrain_megatron.vps.layout import Layout

GB = 1e9


def test_max_min_rates_of_the_textbook_example():
    # link 0 (cap 10): flows 0, 1; link 1 (cap 4): flows 1, 2 -> 1 and 2 get 2, 0 gets 8
    f = np.array([0, 1, 1, 2])
    link = np.array([0, 0, 1, 1])
    r = max_min_rates(f, link, np.array([10.0, 4.0]), 3, slack=0.0)
    assert np.allclose(r, [8.0, 2.0, 2.0])


def test_one_flow_in_a_node_runs_at_nvlink_times_efficiency():
    fab = Fabric(efficiency=0.5)
    t, _, busiest = simulate_flows(np.array([0]), np.array([1]), np.array([9e9]), fab, 8)
    assert t == pytest.approx(9e9 / (450 * GB * 0.5))
    assert busiest.startswith("NVLink")


def test_an_oversubscribed_leaf_binds_a_flow_between_leaves():
    fab = Fabric(nodes_per_leaf=1, oversubscription=4.0, efficiency=1.0)
    # GPU 0 of node 0 -> GPU 0 of node 1: same rail, different leaves
    t, _, busiest = simulate_flows(np.array([0]), np.array([8]), np.array([5e9]), fab, 16)
    assert t == pytest.approx(5e9 / (50 * GB / 4))
    assert busiest.startswith("leaf")
    # the same rail under one leaf: the NIC binds
    t1, _, _ = simulate_flows(np.array([0]), np.array([8]), np.array([5e9]),
                              Fabric(efficiency=1.0), 16)
    assert t1 == pytest.approx(5e9 / (50 * GB))


def test_cross_rail_flows_share_the_receivers_rail_nic_on_the_sending_node():
    """PXN: GPU 0 -> node 1's GPU 1 goes over NVLink to GPU 1 of node 0 and out of its
    NIC, which GPU 1's own flow to the same receiver uses too: half each."""
    fab = Fabric(efficiency=1.0)
    t, _, _ = simulate_flows(np.array([0, 1]), np.array([9, 9]), np.array([5e9, 5e9]),
                             fab, 16)
    assert t == pytest.approx(2 * 5e9 / (50 * GB), rel=1e-6)


def test_rounds_are_the_executors_messages_per_peer():
    spec = load_model("gpt-50m")
    plan = build_plan(spec, Layout.parse("tp2pp2", 4), Layout.parse("tp1pp4", 4),
                      kinds=OPT_KINDS)
    sched = build_schedule(plan, 64 * 2**20)
    assert sched.num_rounds > 1
    for r in range(sched.num_rounds):
        src, dst, b = flows_of_round(sched, r)
        got = {(int(s), int(d)): int(x) for s, d, x in zip(src, dst, b)}
        want: dict = {}
        for dev in plan.src_devices:
            for p in sched.rounds[r].sends(dev):
                if p.src_device != p.dst_device:
                    k = (p.src_device, p.dst_device)
                    want[k] = want.get(k, 0) + p.nbytes
        assert got == want


def test_the_simulation_against_the_measured_gloo_runs():
    """docs/bench/switch.md's gpt-50m and gpt-200m transfers (4 gloo ranks) against the
    simulation with each run's measured link: within 1.5x."""
    from dynatrain_megatron.bench.fabric_check import GLOO_RUNS, validate_on_gloo

    for v in validate_on_gloo(GLOO_RUNS[1:]):
        assert abs(v["max_send_bytes"] - v["measured_max_send_bytes"]) < 1e4
        assert 1 / 1.5 < v["measured_over_simulated"] < 1.5, v


def test_oversubscription_and_efficiency_slow_an_inter_node_transfer():
    spec = load_model("llama3-70b")
    plan = build_plan(spec, Layout.parse("tp8pp4dp4"), Layout.parse("tp8pp8dp2"))
    sched = build_schedule(plan)
    t = [simulate_transfer(sched, Fabric(oversubscription=o, efficiency=e)).seconds
         for o, e in ((1, 0.9), (1, 0.5), (4, 0.5))]
    assert t[0] < t[1] <= t[2]


def test_bad_fabric_is_refused_with_every_number():
    with pytest.raises(RoutingError, match="efficiency"):
        Fabric(efficiency=1.5)
    with pytest.raises(RoutingError, match="oversubscription"):
        Fabric(oversubscription=0.5)
