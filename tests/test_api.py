"""The public Python API (`dynatrain_megatron.api`, issue 30): every call on a live job,
each checked bit for bit against the state it must leave; one spawned group of 4 ranks."""
import pytest

from dynatrain_megatron.testing.multiproc import run_on_ranks
from api_cases import A, B, C, FAULTS, G, G2, api_cases

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    return run_on_ranks(api_cases, 4, str(tmp_path_factory.mktemp("api")),
                        env={"DYNATRAIN_FAULTS": FAULTS})[0]


def test_current(api):
    assert api["current"] == (A, (0, 1, 2, 3), True, None)


def test_bad_requests_change_nothing(api):
    e = api["errors"]
    assert e["layers"][0] == "LayoutError" and "tp1pp4vpp2dp1" in e["layers"][1], e["layers"]
    assert e["world"][0] == "LayoutError" and "world size 4" in e["world"][1], e["world"]
    assert e["place"][0] == "ApiError" and "'disk'" in e["place"][1]
    assert e["back"] == ("ApiError", "weights_back: no weights-only switch in progress")
    assert api["untouched_by_errors"] is True


@pytest.mark.parametrize("mode", ["keep", "host"])
def test_weights_to_and_back(api, mode):
    r = api[mode]
    assert r["layout"] == (G if mode == "keep" else G2)
    assert r["mismatches"] is True, "every replica at G holds A's weights bit for bit"
    assert r["wrapped"] is False  # bare chunks: no DDP, no optimizer at G
    assert r["state_diff"] == [], r["state_diff"][:5]
    assert r["scalars"] is True and r["rng"] is True
    if mode == "keep":
        assert r["parked"] == 0 and r["optimizer_untouched"] is True
        assert r["gen_freed"] is True  # freed by weights_back though `gen` holds them
        assert r["current"] == G
        assert "weights are at tp4pp1dp1" in r["switch_refused"]
        assert api["plan_w"][0] == ("param",)
        assert r["bytes_moved"] == api["plan_w"][1] == api["plan_w"][2] > 0
        assert api["plan_w"][3] is True
    else:
        assert r["emptied"] is True and r["parked_all"] is True and r["parked"] > 0


def test_training_after_weights_round_trips_equals_never_leaving(api):
    assert api["losses"] == api["ref_losses"]
    assert api["vs_never_left"] == []


def test_plan_then_switch(api):
    r = api["switch"]
    assert r["layout"] == r["current"] == B
    assert r["diff"] == [] and r["scalars"] is True and r["objects"] is True
    assert r["plan"][:3] == r["done"], (r["plan"], r["done"])  # the plan is what ran
    assert r["plan"][0] == r["plan"][1] > 0 and r["plan"][3] >= 1
    assert r["iteration"] == (5, 40) and r["background"] is False
    assert r["old_freed"] is True  # A's tensors freed though the caller still held them


def test_prepare_then_switch_and_cancel(api):
    r = api["prepared"]
    assert r["layout"] == C and r["steps"] >= 1 and r["background"] is True
    assert r["diff"] == [] and r["scalars"] is True
    assert api["cancelled"] == (C, True)


def test_generation_at_g_equals_megatron_core_from_a_checkpoint(api):
    """Greedy tokens from the weights switched to G equal megatron-core's own generation at
    G restarted from a checkpoint of the same weights; and at G2 (other TP, more replicas)
    through the example's loop, with the optimizer parked in host memory."""
    assert api["gen_keep"] == api["gen_ckpt"], (api["gen_keep"], api["gen_ckpt"])
    assert api["gen_host"] == [api["gen_keep"]] * 2
    assert all(len(t) == 4 for t in api["gen_keep"])
    assert api["gen_rng_kept"] is True


def test_a_failed_switch_rolls_back_everywhere(api):
    """One rank fails before the commit: every rank raises SwitchAborted naming it, and the
    job is at A with its state, scalars and RNG as before (the parked optimizer state of
    the weights-only attempt restored)."""
    r = api["aborted"]
    for name in ("switch", "weights"):
        assert r["reasons"][name] is not None and "rank 1: commit" in r["reasons"][name], r
    assert r["at"] == (A, None)
    assert r["diff"] == [] and r["scalars"] is True and r["rng"] is True


def test_weights_back_keep_reuses_the_target(api):
    """The example's loop keeps G2 between rounds: the second round writes into the same
    chunks (not rebuilt), every replica again bit for bit, the same bytes moved."""
    r = api["host_reused"]
    assert r["same_chunks"] is True and r["mismatches"] is True and r["emptied"] is True
    assert r["bytes_moved"][0] == r["bytes_moved"][1] > 0
