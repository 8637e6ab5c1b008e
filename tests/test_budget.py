"""The end-to-end budget of a switch (bench.budget) and `dynatrain plan --json`, which
carries it with the emulated control plane's counts and the simulated transfer."""
from __future__ import annotations

import json

import pytest

from dynatrain_megatron import cli
from dynatrain_megatron.bench.budget import WHERE, BudgetConstants, switch_budget

REQUIRED = ("new_group calls (non-member)", "communicators created", "store operations",
            "gloo mesh set-up", "B's objects built", "B's data iterators built",
            "placement choice (with its plans)", "memory check",
            "ready votes while B is prepared", "step skew",
            "votes (ready, preparation, prepare, commit)", "communicator warm-up",
            "transfer (data)", "transfer (checksum phase)", "vocab-padding exchange",
            "DP all-gather of weights (rebuild from masters)", "release of A + rebind",
            "Megatron-LM's counters and the data iterators taken",
            "data iterators advanced to the switch", "first step at B (extra)",
            "data iterators built at the switch", "A's memory collected (deferred)")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["plan", "--model", "gpt-50m", "--from", "tp2pp2", "--to", "tp1pp4",
                       "--world", "4", "--kinds", "optimizer", "--json"])
    assert rc == 0
    return json.loads(buf.getvalue())


def test_plan_json_carries_budget_counts_and_simulated_transfer(report):
    b, c, s = report["budget"], report["control_plane"], report["simulated_transfer"]
    names = [t["name"] for t in b["terms"]]
    assert list(REQUIRED) == [n for n in names if n in REQUIRED]
    for t in b["terms"]:
        assert t["how"] in ("measured", "modelled", "simulated") and t["basis"], t
        assert t["where"] in WHERE and t["seconds"] >= 0, t
    # conditional terms are listed, not summed
    assert b["stall_seconds"] == pytest.approx(
        sum(t["seconds"] for t in b["terms"] if t["where"] == "stall" and not t["when"]))
    assert b["background_seconds"] == pytest.approx(
        sum(t["seconds"] for t in b["terms"] if t["where"] == "background" and not t["when"]))
    sim = next(t for t in b["terms"] if t["name"] == "transfer (data)")
    assert sim["seconds"] == pytest.approx(s["data_seconds"]) and s["rounds"] == 1
    # the counts are the emulation's: 4 ranks, one gloo twin created lazily
    assert c["world"] == 4 and c["switch_gloo_connections"] == 0
    assert c["switch_communicators"] >= 1 and c["p2p_batched_exchanges"] == 2
    ck = b["checkpoint_path"]
    assert ck["how"] == "modelled" and ck["total_seconds"] == pytest.approx(
        ck["write_seconds"] + ck["read_seconds"] + ck["restart_seconds"])


def test_weights_moved_by_the_transfer_need_no_all_gather(report):
    from dynatrain_megatron.configs import load_model
    from dynatrain_megatron.vps.layout import Layout

    spec = load_model("gpt-50m")
    r = dict(report, kinds=["param"])
    b = switch_budget(spec, Layout.parse("tp2pp2", 4), Layout.parse("tp1pp4", 4), r,
                      report["control_plane"], report["simulated_transfer"])
    ag = next(t for t in b["terms"] if t["name"].startswith("DP all-gather"))
    assert ag["seconds"] == 0.0


def test_padding_gather_is_priced_from_the_counted_bytes(report):
    from dynatrain_megatron.configs import load_model
    from dynatrain_megatron.vps.layout import Layout

    spec = load_model("gpt-50m")
    counts = dict(report["control_plane"],
                  switch_world_collective_bytes={"all_gather_object": 40e9})
    c = BudgetConstants(nic_gbps=50, efficiency=0.8)
    b = switch_budget(spec, Layout.parse("tp2pp2", 4), Layout.parse("tp1pp4", 4), report,
                      counts, report["simulated_transfer"], c)
    pad = next(t for t in b["terms"] if t["name"] == "vocab-padding exchange")
    assert pad["seconds"] == pytest.approx(1.0)


def _term(b, name):
    return next(t for t in b["terms"] if t["name"] == name)


def test_data_iterators_are_built_in_the_background_and_advanced_at_the_switch(report):
    """megatron_lm/data_ahead.py: B's data iterators are built by the preparation thread;
    the stall holds their advance by the steps A took since the build's count, and their
    build only where DataAhead.take finds none (listed, not summed)."""
    from dynatrain_megatron.configs import load_model
    from dynatrain_megatron.vps.layout import Layout

    spec = load_model("gpt-50m")
    src, dst = Layout.parse("tp2pp2", 4), Layout.parse("tp1pp4", 4)
    args = (spec, src, dst, report, report["control_plane"], report["simulated_transfer"])
    base = switch_budget(*args)
    slow = switch_budget(*args, BudgetConstants(data_iterator_s=30.0))
    assert _term(base, "B's data iterators built")["where"] == "background"
    rebuilt = _term(slow, "data iterators built at the switch")
    assert rebuilt["seconds"] == 30.0 and "evaluation" in rebuilt["when"]
    # a longer build moves only the background, and the steps A takes meanwhile
    assert slow["background_seconds"] == pytest.approx(base["background_seconds"] + 28.0)
    assert slow["skipped_steps"] > base["skipped_steps"] >= 1
    adv = _term(slow, "data iterators advanced to the switch")
    w = BudgetConstants().workload
    micro = w.global_batch_size // (w.micro_batch_size * dst.dp)
    assert adv["seconds"] == pytest.approx(slow["skipped_steps"] * micro * 1e-3)
    assert slow["stall_seconds"] - base["stall_seconds"] == pytest.approx(
        adv["seconds"] - _term(base, "data iterators advanced to the switch")["seconds"]
        + _term(slow, "ready votes while B is prepared")["seconds"]
        - _term(base, "ready votes while B is prepared")["seconds"])


def test_votes_are_gloo_rings_over_the_world(report):
    """The votes run on the CPU control group (gloo): a ring, 2 (n - 1) hops each."""
    from dynatrain_megatron.configs import load_model
    from dynatrain_megatron.vps.layout import Layout

    spec = load_model("gpt-50m")
    c = BudgetConstants(gloo_hop_s=1e-3)
    b = switch_budget(spec, Layout.parse("tp2pp2", 4), Layout.parse("tp1pp4", 4), report,
                      report["control_plane"], report["simulated_transfer"], c)
    assert _term(b, "votes (ready, preparation, prepare, commit)")["seconds"] == \
        pytest.approx(4 * 2 * 3 * 1e-3)
    assert _term(b, "Megatron-LM's counters and the data iterators taken")["seconds"] == \
        pytest.approx(2 * 3 * 1e-3)  # one all-reduce agrees both


def test_a_weights_only_switch_pays_no_training_loop_term(report):
    from dynatrain_megatron.configs import load_model
    from dynatrain_megatron.vps.layout import Layout

    spec = load_model("gpt-50m")
    r = dict(report, kinds=["param"])
    b = switch_budget(spec, Layout.parse("tp2pp2", 4), Layout.parse("tp1pp4", 4), r,
                      report["control_plane"], report["simulated_transfer"])
    for name in ("B's data iterators built", "data iterators advanced to the switch",
                 "first step at B (extra)", "A's memory collected (deferred)"):
        assert _term(b, name)["seconds"] == 0.0 and "weights_to" in _term(b, name)["basis"]


def test_bad_constants_are_refused():
    with pytest.raises(ValueError, match="data_iterator_s"):
        BudgetConstants(data_iterator_s=-1)
    with pytest.raises(ValueError, match="efficiency"):
        BudgetConstants(efficiency=0)
