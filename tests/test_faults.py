"""Transactional switching under injected faults (issue: Transactional switching): the job
either completes the switch bit-exactly or rolls back to exactly the state it had, and
training goes on with the losses of a run that never attempted the switch. Also: many
switches in a row keep memory and process groups flat. `pytest -m faults` runs these."""
import pytest

from dynatrain_megatron.testing.multiproc import run_on_ranks
from rank_cases import fault_cases, repeated_switch_case

pytestmark = [pytest.mark.multirank, pytest.mark.faults]

A, B = "tp2pp2dp1", "tp1pp2dp2"
TIMEOUT = 3.0
FAULTS = [
    {},  # control: no fault, the switch commits
    {"corrupt_rank": 1},  # one received piece corrupted on the wire
    {"fail_rank": 2, "fail_phase": "prepare"},  # a rank fails before anything moves
    {"fail_rank": 3, "fail_phase": "round"},  # a rank fails in a transfer round
    {"fail_rank": 0, "fail_phase": "commit"},  # a rank fails after the transfer
    {"delay_rank": 1, "delay_seconds": 2 * TIMEOUT},  # a rank late past the timeout
]


@pytest.fixture(scope="module")
def res():
    return run_on_ranks(fault_cases, 4, "tiny-gpt", A, B, FAULTS, TIMEOUT)[0]


def _ids():
    return [",".join(f"{k}={v}" for k, v in f.items()) or "none" for f in FAULTS]


@pytest.mark.parametrize("i", range(len(FAULTS)), ids=_ids())
def test_fault_commits_exactly_or_rolls_back_exactly(res, i):
    r = res[i]
    assert r["diff"] == [], f"state differs after the attempt: {r['diff'][:5]}"
    # B's transfer group serves only the switch into B (destroyed after it); a committed
    # switch also released A, whose own transfer group start_job had made: one fewer
    assert r["groups_leaked"] == (-1 if not FAULTS[i] else 0)
    if not FAULTS[i]:
        assert r["aborted"] is None and r["layout"] == B
        assert r["checksummed"] > 0  # every message was checked on arrival
        return
    assert r["aborted"] is not None and r["layout"] == A
    # training goes on as if the switch had never been attempted
    assert r["losses"] == r["plain"], (r["losses"], r["plain"])


def test_each_fault_is_named_in_the_abort_reason(res):
    reasons = [r["aborted"] for r in res[1:]]
    assert "checksum mismatch" in reasons[0] and "from rank" in reasons[0]
    assert "injected failure of rank 2 in phase prepare" in reasons[1] and "in prepare" in reasons[1]
    assert "injected failure of rank 3 in phase round" in reasons[2]
    assert "injected failure of rank 0 in phase commit" in reasons[3]
    assert "within 3.0 s" in reasons[4]


@pytest.fixture(scope="module")
def repeated():
    return run_on_ranks(repeated_switch_case, 4, "tiny-gpt",
                        ["tp2pp2dp1", "tp1pp2dp2", "tp4pp1dp1", "tp1pp4dp1"], 52)


def test_fifty_switches_keep_memory_and_groups_flat_and_state_exact(repeated):
    for r in repeated:
        assert r["groups"][-1] == r["groups"][3], r["groups"]  # same layout, same count
        assert len(set(r["groups"][3::4])) == 1
        # RSS after switch 12 vs after switch 52 (same layout): no growth per switch
        growth = r["rss"][-1] - r["rss"][11]
        assert growth < 24 * 2**20, [x // 2**20 for x in r["rss"]]
    assert repeated[0]["diff"] == []
