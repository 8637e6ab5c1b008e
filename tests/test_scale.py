"""Scale-in 8 -> 4 ranks and scale-out 4 -> 8 during training (issue: Elastic Device
Manager): the full logical state is bit-identical across each change, ranks outside the
new layout hold no training state, and training continues with the losses of a job started
at the new layout from the same state."""
import pytest

from dynatrain_megatron.testing.multiproc import run_on_ranks
from rank_cases import scale_cases

pytestmark = pytest.mark.multirank

BIG, SMALL = "tp2pp2dp2", "tp1pp2dp2"  # 8 ranks <-> 4 ranks, TP changes on the way


@pytest.fixture(scope="module")
def scale(tmp_path_factory):
    return run_on_ranks(scale_cases, 8, "tiny-gpt", BIG, SMALL, 3,
                        str(tmp_path_factory.mktemp("scale")))[0]


def test_scale_in_8_to_4(scale):
    r = scale["in"]
    assert r["members"] == [True] * 4 + [False] * 4
    assert r["held"][4:] == [0] * 4 and all(h > 0 for h in r["held"][:4])
    assert r["diff"] == [], r["diff"][:5]
    assert r["moved"] == r["lower"] > 0
    assert r["iteration_after"] == r["iteration_before"] == 2
    assert r["losses"] == r["ref_losses"], (r["losses"], r["ref_losses"])


def test_scale_out_4_to_8(scale):
    r = scale["out"]
    assert r["members"] == [True] * 8  # the standby ranks joined
    assert all(h > 0 for h in r["held"])
    assert r["diff"] == [], r["diff"][:5]
    assert r["moved"] == r["lower"] > 0
    assert r["iteration_after"] == r["iteration_before"] == 5
    assert r["losses"] == r["ref_losses"], (r["losses"], r["ref_losses"])


def test_scale_in_and_out_through_the_signal_file(scale):
    """Requested with `dynatrain request --world N`; ranks 4-7 wait in the hook's standby
    loop in between; the losses equal the same switches called directly."""
    r = scale["hook"]
    assert r["layouts"] == [(BIG, SMALL), (SMALL, BIG)]
    # one record per request, named after it
    records = [f for f in r["files"] if f != "scale.json.job"]  # the job's presence file
    assert len(records) == 2 and all(f.startswith("scale.json.applied.") for f in records)
    assert len(r["switched_at"]) == 2
    assert r["losses"] == r["ref_losses"] and len(r["losses"]) == 9
