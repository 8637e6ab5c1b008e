"""Any placement, live (issue 17): a switch onto the planner's best placement, whose order
of global ranks is not megatron's, keeps every bit of state, trains on exactly as the
checkpoint path at the default order, and leaves a world that saves, switches, scales
in and switches again like any other. One spawned group of 8 gloo ranks checks it all."""
import pytest

from dynatrain_megatron.testing.multiproc import run_on_ranks
from placement_cases import permuted_switch_cases

pytestmark = pytest.mark.multirank

LEAK_SWITCHES = 20


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_on_ranks(permuted_switch_cases, 8, str(tmp_path_factory.mktemp("perm")), 3,
                        LEAK_SWITCHES)[0]


def _exact(rec):
    assert rec["aborted"] is None, rec["aborted"]
    assert rec["diff"] == [], f"{rec['a']} -> {rec['b']}: state changed: {rec['diff'][:5]}"
    assert rec.get("replica_mismatches", []) == [], rec["replica_mismatches"]
    assert rec["moved"] == rec["lower"], (rec["moved"], rec["lower"])


@pytest.mark.parametrize("tag", ["dense_pp", "dense_dp", "moe"])
def test_switch_onto_best_placement_moves_planner_bytes_and_trains_as_checkpoint_path(runs, tag):
    rec = runs[tag]
    _exact(rec)
    p = rec["planner"]
    # the planner's best placement is not rank-ordered, and the live switch used it
    assert not p["best_is_rank_ordered"] and tuple(rec["devices"]) == tuple(p["best_devices"])
    assert list(rec["devices"]) != sorted(rec["devices"])
    # exactly the planner's bytes for it, strictly fewer than the best rank-ordered one
    assert rec["moved"] == p["best"] < p["rank_ordered"] <= p["default"], p
    # B prepared in the background for the first (as the hook does): groups off the pause
    if tag == "dense_pp":
        assert "build" in rec["background"] and "build" not in rec["phases"]
    # 3 steps after the switch == dist_checkpointing save at A, load at B (default order)
    assert rec["losses"] == rec["ckpt_losses"], (rec["losses"], rec["ckpt_losses"])


def test_planner_figures_of_the_issue(runs):
    assert runs["dense_pp"]["planner"]["best"] == 0
    assert runs["dense_pp"]["moved"] == 0
    assert runs["dense_dp"]["planner"]["best"] < runs["dense_dp"]["planner"]["default"] // 1000


def test_second_switch_from_a_permuted_world(runs):
    rec = runs["second"]
    _exact(rec)
    assert list(rec["src_devices"]) != sorted(rec["src_devices"])
    assert list(rec["devices"]) != sorted(rec["devices"])  # permuted into permuted
    assert rec["moved"] == rec["planner"]["best"]


def test_scale_in_from_a_permuted_world(runs):
    rec = runs["scale_in"]
    assert rec["aborted"] is None
    assert rec["diff"] == [], rec["diff"][:5]
    assert rec["moved"] == rec["lower"]
    assert list(rec["src_devices"]) != sorted(rec["src_devices"])
    assert rec["members"] == [True] * 4 + [False] * 4


def test_scale_out_from_the_permuted_smaller_world(runs):
    rec = runs["scale_out"]
    _exact(rec)
    assert list(rec["src_devices"]) != sorted(rec["src_devices"])
    assert rec["members"] == [True] * 8


def test_checkpoint_saved_in_permuted_world_loads_at_default_order(runs):
    # saved right after the switch in the permuted world; a fresh job at the default order
    # loads it and trains the same 3 steps as the permuted world did
    assert runs["permuted_save_losses"] == runs["dense_pp"]["losses"]


def test_permuted_switches_leak_no_groups_or_memory(runs):
    r = runs["leak"]
    assert r["diff"] == [], r["diff"][:5]
    assert len(r["devices"]) == LEAK_SWITCHES
    assert sum(list(d) != sorted(d) for d in r["devices"]) >= LEAK_SWITCHES // 2
    # same layout, same count of live groups; no growth over the loop
    assert r["groups"][-1] == r["groups"][1] and r["groups"][-2] == r["groups"][0], r["groups"]
    growth = r["rss"][-1] - r["rss"][3]
    assert growth < 24 * 2**20, [x // 2**20 for x in r["rss"]]
    # the first layout's weights, grads and optimizer state, still referenced (as
    # Megatron-LM's pretrain() references them), are freed by the first switch
    before, after = r["held"]
    assert before > 0 and after == 0, r["held"]
