"""The end-to-end budget of a switch (bench.budget) and `dynatrain plan --json`, which
carries it with the emulated control plane's counts and the simulated transfer."""
from __future__ import annotations

import json

import pytest

from dynatrain_megatron import cli
from dynatrain_megatron.bench.budget import BudgetConstants, switch_budget

REQUIRED = ("new_group calls (non-member)", "communicators created", "store operations",
            "gloo mesh set-up", "placement choice (with its plans)", "step skew",
            "votes (ready, preparation, prepare, commit)", "communicator warm-up",
            "transfer (data)", "transfer (checksum phase)", "vocab-padding exchange",
            "DP all-gather of weights (rebuild from masters)", "release of A + rebind",
            "data-iterator rebuild", "first step at B (extra)")


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
        assert t["where"] in ("stall", "background") and t["seconds"] >= 0, t
    assert b["stall_seconds"] == pytest.approx(
        sum(t["seconds"] for t in b["terms"] if t["where"] == "stall"))
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


def test_bad_constants_are_refused():
    with pytest.raises(ValueError, match="data_iterator_s"):
        BudgetConstants(data_iterator_s=-1)
