"""The training-step hook with a signal file, on 4 gloo ranks (issue: Elastic Device Manager,
controller and training-step hook)."""
import pytest

from dynatrain_megatron.integration.multiproc import run_on_ranks
from rank_cases import hook_cases

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    return run_on_ranks(hook_cases, 4, str(tmp_path_factory.mktemp("hook")))[0]


def test_signal_file_switch_matches_checkpoint_path(res):
    r = res["switch"]
    # requested after iteration 2, groups built in the background, switched at iteration 3
    assert r["iteration"] == 3 and r["layout"] == "tp1pp2dp2"
    assert r["files"] == ["a.json.applied.0"]
    # the three steps after the switch equal a dist_checkpointing save/load at iteration 3
    assert r["losses"][3:] == r["ckpt_losses"]


def test_group_construction_is_not_in_the_pause(res):
    r = res["switch"]
    assert r["groups_bg"] > 0  # groups were built, before the switch started
    assert r["groups_in_pause"] < 1e-3  # ... and not inside it
    # side by side in the same run: the classic way pays the construction in its pause
    sync = res["sync"]
    assert sync["layout"] == "tp1pp2dp2" and sync["iteration"] == 2  # no wait for groups
    assert sync["groups_in_pause"] and sync["phases"]["groups"] == round(sync["groups_s"], 4)
    assert sync["pause"] >= sync["groups_s"] > 0
    print(f"pause with groups in the background {r['pause']:.3f} s (groups {r['groups_bg']:.3f} s "
          f"before it); with groups inside {sync['pause']:.3f} s (of which groups "
          f"{sync['groups_s']:.3f} s)")


def test_bad_requests_are_rejected_and_training_goes_on(res):
    """A corrupt file, a malformed layout, an impossible one, and a world-writable file."""
    r = res["rejects"]
    assert r["layout"] == "tp2pp2dp1"
    assert r["files"] == ["b.json.rejected.0", "b.json.rejected.1", "b.json.rejected.2",
                          "b.json.rejected.3"]
    assert "not valid JSON" in r["rejected"][0]
    assert "malformed layout" in r["rejected"][1]
    assert "tp*pp*cp = 8 does not divide world size 4" in r["rejected"][2]
    assert "world-writable" in r["rejected"][3]  # a valid layout, but anyone could have sent it
    assert r["losses"] == r["plain_losses"]  # as if nothing had been requested
