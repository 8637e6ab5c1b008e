"""The spawned-rank runner the multi-rank tests stand on: a rank that never reports is
named, with the stacks of its threads taken before it is killed, so a hang in CI says
where it hung."""
import time

import pytest

from dynatrain_megatron.testing.multiproc import RankFailure, run_on_ranks


def _rank_one_is_stuck_here() -> str:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        while True:
            time.sleep(0.05)
    return "done"


@pytest.mark.multirank
def test_a_hung_rank_is_named_with_where_it_hung():
    # rank 0 may not have started within the limit on a loaded machine: then both named
    stuck = r"timeout after 15s; ranks \[(0, )?1\] did not finish"
    with pytest.raises(RankFailure, match=stuck) as failed:
        run_on_ranks(_rank_one_is_stuck_here, 2, timeout=15.0)
    text = str(failed.value)
    assert "--- rank 1:" in text and "in _rank_one_is_stuck_here" in text, text[-3000:]
