"""A rank that dies (its process gone) during training (issue: Transactional switching):
the survivors notice, re-form the world among themselves through a store, name exactly the
state that died with it, and, since the distributed optimizer keeps no replica of it,
resume from the last checkpoint at a layout that fits them, never with wrong state."""
import pytest

from dynatrain_megatron.integration.multiproc import run_on_ranks
from rank_cases import death_case, resume_case

pytestmark = [pytest.mark.multirank, pytest.mark.faults]


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    store, ckpt = tmp_path_factory.mktemp("store"), tmp_path_factory.mktemp("ckpt")
    out = run_on_ranks(death_case, 4, str(store), str(ckpt / "last"),
                       env={"DYNATRAIN_PG_TIMEOUT": "60"})
    ref = run_on_ranks(resume_case, 2, str(ckpt / "last"), "tp2pp1dp1")[0]
    return out, ref


def test_survivors_reform_and_resume_from_the_checkpoint(res):
    out, ref = res
    assert out[3] is None  # the dead rank left no result
    survivors = [r for r in (0, 1, 2)]
    members = out[0]["members"]
    assert all(out[r]["members"] == members for r in survivors)  # one roster for everyone
    assert len(members) == 2 and 3 not in members
    for r in survivors:
        assert 3 in out[r]["dead"]
        assert out[r]["detected"]  # each survivor saw a collective fail
        if r not in members:
            assert out[r]["new_rank"] is None  # not needed by the 2-rank layout: it leaves
            continue
        assert out[r]["new_rank"] == members.index(r)
        assert out[r]["layout"] == "tp2pp1dp1" and out[r]["world"] == 2
        assert out[r]["iteration"] == 2 == ref["iteration"]  # the checkpoint, not iteration 3
        assert out[r]["losses"] == ref["losses"]


def test_the_lost_state_is_named(res):
    out, _ = res
    lost = out[0]["lost"]
    assert "3] hold the only copy of" in lost
    assert "exp_avg" in lost and "main_param" in lost
    assert ", param:" not in lost and "of param:" not in lost  # the weights survive on DP replicas
