"""Placement: the chosen layout-B placement keeps the most state where it is."""
import pytest

from dynatrain_megatron.routing import (RoutingError, build_plan, choose_placement,
                                        placement_choice, validate_plan)
from dynatrain_megatron.vps import OPT_KINDS, Placement

from routing_cases import brute_lower_bound, lay, spec


def test_tiny_pp2_to_pp4_chosen_moves_strictly_fewer_bytes_than_default():
    """The issue's 8-rank case: tp1pp2dp4 -> tp1pp4dp2."""
    s = spec("tiny-gpt")
    A, B = lay("tp1pp2", 8), lay("tp1pp4", 8)
    ch = placement_choice(s, A, None, B, range(8))
    assert ch.chosen != ch.default
    assert ch.chosen_stats.moved_bytes < ch.default_stats.moved_bytes
    plan = build_plan(s, A, (B, ch.chosen))
    assert validate_plan(plan) == []
    assert plan.stats.moved_bytes == brute_lower_bound(s, A, range(8), B, ch.chosen.devices,
                                                       ("param",) + OPT_KINDS)
    assert choose_placement(s, A, None, B, range(8)) == ch.chosen


@pytest.mark.parametrize("model,text,world", [("tiny-gpt", "tp2pp2", 8),
                                              ("tiny-moe", "tp2pp2ep2etp1", 8)])
def test_same_layout_keeps_the_identity(model, text, world):
    s = spec(model)
    ch = placement_choice(s, lay(text, world), None, lay(text, world))
    assert ch.chosen == Placement.default(world) and ch.chosen_stats.moved_bytes == 0


def test_same_layout_on_a_permuted_source_placement_follows_the_devices():
    s = spec("tiny-gpt")
    L = lay("tp2pp2", 8)
    pa = Placement((6, 7, 0, 1, 4, 5, 2, 3))
    ch = placement_choice(s, L, pa, L, range(8), ranks_per_node=2)
    assert ch.chosen == pa and ch.chosen_stats.moved_bytes == 0


def test_llama70b_pp4_to_pp8_moves_at_most_5_percent_of_optimizer_state():
    s = spec("llama3-70b")
    ch = placement_choice(s, lay("tp8pp4", 128), None, lay("tp8pp8", 128))
    assert ch.chosen_stats.moved_fraction(OPT_KINDS) <= 0.05
    assert ch.default_stats.moved_fraction(OPT_KINDS) >= 0.99
    assert ch.chosen_stats.moved["param"] == 0  # every device keeps its layers
    # TP groups stay inside a node, in their TP order
    d = ch.chosen.devices
    for u in range(16):
        grp = d[8 * u:8 * u + 8]
        assert len({x // 8 for x in grp}) == 1 and list(grp) == sorted(grp)


def test_llama70b_scale_in_128_to_96_moves_at_most_35_percent():
    s = spec("llama3-70b")
    A, B = lay("tp8pp4", 128), lay("tp8pp4", 96)
    ch = placement_choice(s, A, None, B, range(128))  # the planner picks who leaves
    assert ch.chosen_stats.moved_fraction(OPT_KINDS) <= 0.35
    assert ch.default_stats.moved_fraction(OPT_KINDS) > 0.8
    assert len(set(ch.chosen.devices)) == 96 and set(ch.chosen.devices) <= set(range(128))
    pinned = placement_choice(s, A, None, B, range(96))  # the last 32 must leave
    assert pinned.chosen_stats.moved_bytes <= pinned.default_stats.moved_bytes
    assert set(pinned.chosen.devices) == set(range(96))


def test_scale_out_uses_new_devices_and_validates():
    s = spec("tiny-gpt")
    A, B = lay("tp2pp2", 4), lay("tp2pp2", 8)
    ch = placement_choice(s, A, None, B, range(8), ranks_per_node=4)
    assert set(ch.chosen.devices) == set(range(8))
    assert ch.chosen_stats.moved_bytes <= ch.default_stats.moved_bytes
    assert validate_plan(ch.chosen_plan) == []


def test_weights_only_placement_for_rlhf_flip():
    s = spec("tiny-gpt")
    ch = placement_choice(s, lay("tp2pp2", 8), None, lay("tp2pp1", 8), kinds=("param",),
                          ranks_per_node=4)
    assert ch.chosen_plan.kinds == ("param",)
    assert validate_plan(ch.chosen_plan) == []


def test_deterministic_and_refuses_too_few_devices():
    s = spec("tiny-moe")
    A, B = lay("tp1pp2ep4", 8), lay("tp2pp2ep2etp1", 8)
    assert choose_placement(s, A, None, B) == choose_placement(s, A, None, B)
    with pytest.raises(RoutingError, match="needs 8 devices"):
        choose_placement(s, A, None, B, range(6))
    with pytest.raises(RoutingError, match="unit size 3"):
        choose_placement(s, A, None, B, unit_size=3)


def test_tp_change_refines_ranks_inside_nodes():
    """tp8 -> tp4: new tp rank j wants the device holding old TP block 2j or 2j+1; the
    within-node refinement finds it, and TP groups stay inside nodes."""
    s = spec("llama3-70b")
    ch = placement_choice(s, lay("tp8pp4", 128), None, lay("tp4pp4", 128))
    c, d = ch.chosen_stats, ch.default_stats
    assert c.moved_bytes < 0.6 * d.moved_bytes
    assert c.moved_fraction(OPT_KINDS) < 0.55 < d.moved_fraction(OPT_KINDS)
    dev = ch.chosen.devices
    assert all(len({x // 8 for x in dev[4 * u:4 * u + 4]}) == 1 for u in range(32))


@pytest.mark.parametrize("a,b", [("tp4pp1dp2", "tp4pp2dp1"), ("tp2pp1dp4", "tp2pp2dp2"),
                                 ("tp1pp2dp4", "tp1pp4dp2")])
def test_plan_reports_default_best_rank_ordered_and_best(a, b):
    """`dynatrain plan` shows the three orders side by side and which one a live switch
    uses; the best rank-ordered placement really is rank-ordered, and the best one (used
    live) moves strictly fewer bytes than it on these transitions."""
    from dynatrain_megatron.routing.placement_search import best_rank_ordered
    from dynatrain_megatron.cli.plan import plan_report
    from dynatrain_megatron.vps.placement import is_rank_ordered

    s = spec("tiny-gpt")
    A, B = lay(a, 8), lay(b, 8)
    r = plan_report(s, A, B)
    assert r["live_switch_placement"] == "best" and r["placement"] == "planner"
    assert r["bytes_moved"] == r["best_bytes_moved"] < r["best_rank_ordered_bytes_moved"]
    assert r["best_rank_ordered_bytes_moved"] <= r["default_bytes_moved"]
    assert not r["best_is_rank_ordered"]
    pinned = plan_report(s, A, B, default_placement=True)
    assert pinned["live_switch_placement"] == "default"
    assert pinned["bytes_moved"] == pinned["default_bytes_moved"]
    ro, plan = best_rank_ordered(placement_choice(s, A, None, B))
    assert is_rank_ordered(B, ro) and plan.dst_placement == ro
    assert plan.stats.moved_bytes == r["best_rank_ordered_bytes_moved"]


@pytest.mark.parametrize("text,world", [("tp2pp2", 8), ("tp1pp4", 8), ("tp1pp2cp2ep2etp1", 16),
                                        ("tp4pp2ep2etp2", 16), ("tp2pp2ep2etp1", 8),
                                        ("tp1pp2vpp2", 8), ("tp2pp1", 8)])
def test_megatron_rank_orders_are_megatron_cores(text, world):
    """`megatron_rank_order`: device of every virtual rank as megatron-core's own
    `RankGenerator` numbers ranks in each order, on the dense and the expert grid; every
    group's members ascend with their virtual rank (torch numbers them alike)."""
    from megatron.core.parallel_state import RankGenerator

    from dynatrain_megatron.vps.layout import GROUP_AXES
    from dynatrain_megatron.vps.placement import (DEFAULT_ORDER, RANK_ORDERS,
                                                  is_rank_ordered, megatron_rank_order)

    L = lay(text, world)
    assert megatron_rank_order(L, DEFAULT_ORDER) == Placement.default(world)
    names = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "ep": "ep", "etp": "tp",
             "edp": "dp"}
    for order in RANK_ORDERS:
        dev = megatron_rank_order(L, order).devices
        dense = RankGenerator(tp=L.tp, ep=1, dp=L.dp, pp=L.pp, cp=L.cp, order=order)
        expert = RankGenerator(tp=L.etp, ep=L.ep, dp=L.edp, pp=L.pp, cp=1, order=order)
        for axes in GROUP_AXES.values():
            gen = expert if set(axes) & {"ep", "etp", "edp"} else dense
            token = "-".join(names[a] for a in axes)
            theirs = sorted(gen.get_ranks(token))
            ours = sorted([dev[v] for v in g] for g in L.groups(axes))
            assert ours == theirs, (order, axes)
        assert is_rank_ordered(L, Placement(dev))


def test_tp_pp_dp_order_needs_equal_data_parallel_sizes():
    from dynatrain_megatron.vps import LayoutError
    from dynatrain_megatron.vps.placement import TP_PP_DP_ORDER, megatron_rank_order

    # dense dp 2, expert dp 1: megatron-core asserts the same ("the data parallel size of
    # the attention and moe layers must be the same")
    with pytest.raises(LayoutError, match=r"dp \(2\) must equal the expert dp \(1\)"):
        megatron_rank_order(lay("tp1pp2ep2etp1", 4), TP_PP_DP_ORDER)
    with pytest.raises(LayoutError, match="not one of megatron-core's"):
        megatron_rank_order(lay("tp1pp2", 4), "pp-dp-tp")
