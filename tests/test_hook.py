"""The training-step hook with a signal file, on 4 gloo ranks (issue: Elastic Device Manager,
controller and training-step hook)."""
import re

import pytest

from dynatrain_megatron.testing.multiproc import run_on_ranks
from rank_cases import hook_cases

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    return run_on_ranks(hook_cases, 4, str(tmp_path_factory.mktemp("hook")))[0]


def test_signal_file_switch_matches_checkpoint_path(res):
    r = res["switch"]
    # requested after iteration 2; B's groups and objects prepared in the background while
    # training went on; switched at the first boundary where every rank was ready
    it = r["iteration"]
    assert 3 <= it < 6 and r["layout"] == "tp1pp2dp2"
    records = [f for f in r["files"] if f != "a.json.job"]  # the job's presence file
    assert len(records) == 1 and records[0].startswith("a.json.applied."), records
    # training while B was prepared is the plain run's, and the steps after the switch
    # equal a dist_checkpointing save at A and load at B at that iteration
    assert r["losses"][:it] == r["ckpt_losses_before"]
    assert r["losses"][it:] == r["ckpt_losses"] and len(r["ckpt_losses"]) == 6 - it


def test_group_construction_is_not_in_the_pause(res):
    r = res["switch"]
    assert r["groups_bg"] > 0  # groups were built, before the switch started
    # ... and neither they nor B's objects, binding or plan are inside the pause
    assert not {"groups", "build", "plan", "placement"} & set(r["phases"]), r["phases"]
    assert {"transfer", "vote", "bind"} <= set(r["phases"])  # binding A is
    # side by side in the same run: the classic way pays the construction in its pause
    sync = res["sync"]
    assert sync["layout"] == "tp1pp2dp2" and sync["iteration"] == 2  # no wait for groups
    assert {"build", "plan"} <= set(sync["phases"])
    assert sync["groups_in_pause"] and sync["phases"]["groups"] == round(sync["groups_s"], 4)
    assert sync["pause"] >= sync["groups_s"] > 0
    print(f"pause with groups in the background {r['pause']:.3f} s (groups {r['groups_bg']:.3f} s "
          f"before it); with groups inside {sync['pause']:.3f} s (of which groups "
          f"{sync['groups_s']:.3f} s)")


def test_bad_requests_are_rejected_and_training_goes_on(res):
    """A corrupt file, a malformed layout, an impossible one, and a world-writable file."""
    r = res["rejects"]
    assert r["layout"] == "tp2pp2dp1"
    # records named after the requests' ids; the corrupt one (no id) and the world-writable
    # one (refused unread, kept beside its record) numbered
    files = [f for f in r["files"] if f != "b.json.job"]  # the job's presence file
    assert sorted(f for f in files if re.fullmatch(r"b\.json\.rejected\.\d+", f)) == [
        "b.json.rejected.0", "b.json.rejected.1"]
    assert "b.json.rejected.1.original" in files and len(files) == 5, files
    assert "not valid JSON" in r["rejected"][0]
    assert "malformed layout" in r["rejected"][1]
    assert "tp*pp*cp = 8 does not divide world size 4" in r["rejected"][2]
    assert "world-writable" in r["rejected"][3]  # a valid layout, but anyone could have sent it
    assert r["losses"] == r["plain_losses"]  # as if nothing had been requested
