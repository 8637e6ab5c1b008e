"""The control plane of a switch emulated at 256 and 4096 ranks (bench.control_plane;
scripts/bench_reshard.py emulates every scenario): the project's own group construction,
preparation, votes and switch, against a recording stand-in for torch.distributed. What a
rank does must not grow with the world where a constant would do."""
from __future__ import annotations

import pytest

from dynatrain_megatron.bench.control_plane import emulate_switch, role_sample
from dynatrain_megatron.bench.fake_dist import RecordingDist
from dynatrain_megatron.configs import load_model
from dynatrain_megatron.vps.layout import Layout
from dynatrain_megatron.vps.placement import Placement

SPEC = "qwen3-235b-a22b"


@pytest.fixture(scope="module")
def emulations():
    spec = load_model(SPEC)
    out = {}
    for world in (256, 4096):
        src = Layout.parse("tp4pp2ep32etp1", world)
        dst = Layout.parse("tp4pp2ep64etp1", world)
        # the roles that differ in what they create: group rank 0 of everything, a rank
        # that is rank 0 of none of its groups, a last pipeline stage, the last world rank
        out[world] = emulate_switch(spec, src, dst, ranks=[0, 5, world // 2 + 3, world - 1])
    return out


def _per_rank(e, part):
    return [r.switch if part == "switch" else r.at_start for r in e.ranks]


CONSTANT = ("member_groups", "communicators", "gloo_groups", "gloo_connections", "destroyed")


def test_what_a_rank_creates_does_not_grow_with_the_world(emulations):
    small, large = emulations[256].summary(), emulations[4096].summary()
    for k in CONSTANT:
        assert large[f"switch_{k}"] == small[f"switch_{k}"], (k, small, large)
    # the world-sized gloo twin connects lazily: no full mesh at 4096; one store
    # operation per group the rank is in (the NCCL id written by group rank 0, read by
    # the others; a gloo member's address)
    assert large["switch_gloo_connections"] == 0
    for e in emulations.values():
        for r in e.ranks:
            s = r.switch
            assert s["store_sets"] + s["store_gets"] <= s["member_groups"], s
    # every collective moves a constant number of bytes
    assert large["switch_collective_bytes"] == small["switch_collective_bytes"]
    assert large["switch_collectives"] == small["switch_collectives"]
    # the transfer: a rank's peers and messages per round do not grow with the world
    assert large["p2p_peers"] <= small["p2p_peers"] + 8
    assert large["p2p_batched_exchanges"] == small["p2p_batched_exchanges"] == 2


def test_non_member_new_group_calls_are_the_one_linear_count(emulations):
    """torch names a group by a counter every rank advances, so every rank calls
    new_group for every group; the calls of a non-member create nothing and touch no
    store (counted apart, and budgeted as Python time)."""
    small, large = emulations[256], emulations[4096]
    for e in (small, large):
        for r in e.ranks:
            s = r.switch
            assert s["new_group_calls"] - s["non_member_calls"] == s["member_groups"]
    ratio = large.summary()["switch_non_member_calls"] / small.summary()["switch_non_member_calls"]
    assert 12 < ratio < 18  # ~ linear: 16x the world


def test_the_padding_rows_travel_point_to_point_not_in_a_world_gather(emulations):
    """transition.vocab_padding: only holders and needers exchange; no collective whose
    bytes grow with the world is left."""
    small, large = emulations[256].summary(), emulations[4096].summary()
    for s in (small, large):
        assert "all_gather_object" not in s["switch_collectives"]
        assert set(s["switch_world_collective_bytes"].values()) <= {4}
    assert large["p2p_padding_bytes"] <= small["p2p_padding_bytes"] + 1


def test_the_plan_is_made_once_per_rank():
    """The placement choice plans the chosen placement; the preparation finds it made."""
    from dynatrain_megatron.routing import planner
    from dynatrain_megatron.transition.switch import choose_dst_placement

    spec = load_model("llama3-70b")
    src, dst = Layout.parse("tp8pp4dp4"), Layout.parse("tp8pp8dp2")

    class B:
        def bucket_size(self, layout):
            return None

    planner.clear_caches()
    pl = choose_dst_placement(spec, B(), src, Placement.default(128), dst, tuple(range(128)))
    before = planner._build_plan.cache_info()
    from dynatrain_megatron.vps.fragment import OPT_KINDS
    planner.build_plan(spec, (src, Placement.default(128)), (dst, pl), kinds=OPT_KINDS,
                       bucket_size=(None, None))
    after = planner._build_plan.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses


def test_roles_cover_every_axis_value_class_and_membership():
    src, dst = Layout.parse("tp4pp2ep32etp1", 256), Layout.parse("tp4pp2ep32etp1", 192)
    roles = role_sample(src, Placement.default(256), dst, Placement.default(192), 256, extra=0)
    assert "A only" in roles.values()
    for lay, world in ((src, 256), (dst, 192)):
        coords = [lay.coords(r) for r in roles if r < world]
        for axis in ("tp", "pp", "dp", "ep", "edp"):
            size = lay.edp if axis == "edp" else getattr(lay, axis)
            assert {0, size - 1} <= {getattr(c, axis) for c in coords}, (lay, axis)


def test_recording_dist_counts_a_gloo_mesh_and_an_nccl_id():
    d = RecordingDist(3, 8, "nccl")
    d.new_group([0, 1, 2, 3], device_id="cuda:0")
    d.new_group([0, 1], device_id="cuda:0")  # not a member
    d.new_group(list(range(8)), backend="gloo")
    c = d.counts
    assert (c.new_group_calls, c.non_member_calls, c.communicators) == (3, 1, 1)
    assert (c.store_sets, c.store_gets, c.gloo_connections) == (1, 1 + 7, 7)
