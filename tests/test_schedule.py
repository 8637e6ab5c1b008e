"""Rounds under a staging budget: budget respected, chunking keeps exact coverage."""
import numpy as np
import pytest

from dynatrain_megatron.routing import RoutingError, build_plan, build_schedule, schedule

from routing_cases import element_cover, lay, spec


@pytest.fixture(scope="module")
def plan():
    return build_plan(spec("tiny-moe"), lay("tp2pp2ep2etp1", 8), lay("tp1pp4ep2", 8),
                      ranks_per_node=4)


def _all_round_pieces(rounds, devices):
    out = []
    for r in rounds:
        for d in devices:
            out += r.sends(d)
    return out


def test_no_budget_is_one_round_with_every_network_piece(plan):
    rounds = schedule(plan)
    assert len(rounds) == 1
    assert sorted(rounds[0].pieces) == sorted(plan.pieces(include_local=False))


@pytest.mark.parametrize("budget", [400_000, 60_000, 9_000])
def test_budget_respected_and_chunking_preserves_coverage(plan, budget):
    sch = build_schedule(plan, budget)
    lb = int(np.ceil(int((plan.traffic.send + plan.traffic.recv).max()) / budget))
    assert sch.num_rounds >= lb and sch.num_rounds > 1
    for r in sch.rounds:
        for d in plan.devices:
            assert r.staging_bytes(d) <= budget
            assert r.staging_bytes(d) <= sch.peak_staging[d]
    assert sch.peak_exact and sch.max_peak_staging <= budget
    got = element_cover(_all_round_pieces(sch.rounds, plan.devices), plan.spec)
    want = element_cover(plan.pieces(include_local=False), plan.spec)
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[k], want[k]) for k in want)
    # local copies are separate, never in a round
    assert all(not p.is_local for p in _all_round_pieces(sch.rounds, plan.devices))
    assert sum(p.nbytes for d in plan.devices for p in sch.local_pieces(d)) \
        == plan.stats.local_bytes


def test_smaller_budget_more_rounds(plan):
    n = [build_schedule(plan, b).num_rounds for b in (10**9, 400_000, 60_000, 9_000)]
    assert n == sorted(n) and n[0] == 1 and n[-1] > n[1]


def test_sender_and_receiver_agree_on_each_exchange(plan):
    """Both sides of every (src, dst) pair list the same pieces in the same order: one
    buffer is packed and unpacked without metadata."""
    for r in build_schedule(plan, 60_000).rounds:
        for s in plan.devices:
            for d in plan.devices:
                out = [p for p in r.sends(s) if p.dst_device == d]
                inn = [p for p in r.recvs(d) if p.src_device == s]
                assert out == inn


def test_budget_too_small_refused(plan):
    with pytest.raises(RoutingError, match="too small"):
        build_schedule(plan, 8)
    with pytest.raises(RoutingError, match="positive"):
        build_schedule(plan, 0)


def test_same_layout_has_nothing_to_schedule():
    p = build_plan(spec("tiny-gpt"), lay("tp2pp2", 8), lay("tp2pp2", 8))
    sch = build_schedule(p, 1000)
    assert sch.max_peak_staging == 0
    assert all(not r.pieces for r in sch.rounds)


def test_aligned_packing_stays_in_budget(plan):
    """An executor padding every packed piece to 8 bytes still fits the budget."""
    budget = 60_000
    sch = build_schedule(plan, budget, align=8)
    assert sch.num_rounds >= build_schedule(plan, budget).num_rounds
    for r in sch.rounds:
        for d in plan.devices:
            padded = sum(-(-p.nbytes // 8) * 8 for p in r.sends(d) + r.recvs(d))
            assert padded <= budget


@pytest.mark.parametrize("n_rounds", [0, 1, 3, 7])
def test_local_copies_spread_over_rounds_in_order_and_balanced(plan, n_rounds):
    """The executor copies share i of a rank's local pieces while round i is on the wire:
    every piece exactly once, in plan order, one share per round, shares of about equal
    bytes (off by less than one piece)."""
    from dynatrain_megatron.transition.executor import local_shares

    for dev in range(8):
        local = [p for p in plan.pieces_for(dev) if p.is_local]
        shares = local_shares(local, n_rounds)
        assert len(shares) == max(1, n_rounds)
        assert [p for s in shares for p in s] == local
        total = sum(p.nbytes for p in local)
        biggest = max((p.nbytes for p in local), default=0)
        for s in shares:
            assert abs(sum(p.nbytes for p in s) - total / len(shares)) <= biggest
