"""The Megatron-LM adapter's runtime path, with Megatron-LM emulated where it meets the
adapter (scripts/check_megatron_lm_adapter.py): megatron-core's own groups, a signal-file
switch at the next step, args and data iterators following, and the losses after the
switch bit-identical to the dist_checkpointing path."""
import os
import sys
import tempfile

import pytest

from dynatrain_megatron.testing.multiproc import run_on_ranks

pytestmark = [
    pytest.mark.multirank,
    # this check stubs Megatron-LM's training modules; B is now built by Megatron-LM itself
    # (megatron_lm/builder.py: the script's model provider, get_model, its optimizer set-up),
    # which the stubs do not provide. The real loop is checked by test_megatron_lm_train.py
    # and the recipe tests; porting this check to the new builder is open (issue 23).
    pytest.mark.skip(reason="stubbed Megatron-LM cannot build B with Megatron-LM's builder"),
]

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


@pytest.fixture(scope="module")
def runs():
    sys.path.insert(0, SCRIPTS)  # spawned ranks inherit sys.path: they import it by name
    import check_megatron_lm_adapter as chk
    from rank_cases import checkpoint_path_case

    res = run_on_ranks(chk.case, 4, tempfile.mkdtemp())
    ref = run_on_ranks(checkpoint_path_case, 4, "tiny-gpt", "tp2pp2dp1", "tp1pp2dp2",
                       tempfile.mkdtemp(), 3, 3)[0]["losses"]
    return res, ref


def test_megatron_lm_loop_switches_like_the_checkpoint_path(runs):
    res, ref = runs
    r = res[0]
    assert all(x == r for x in res)  # every rank saw the same switch
    assert r["changed_at"] == [3] and r["layout"] == "tp1pp2dp2"
    assert (r["tp"], r["dp"]) == (1, 2)  # Megatron-LM's args follow the new layout
    assert [list(b) for b in r["built"]] == [[2, 1]]  # iterators rebuilt once, at dp 2 / tp 1
    assert r["same_model"]
    assert r["losses"][3:] == ref
