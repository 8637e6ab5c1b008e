"""Hostile input against one live 4-rank job, and the validator against what megatron-core
really builds (issue 14). One spawned group runs everything (see hostile_cases.py)."""
from __future__ import annotations

import json
import os
import random

import pytest

from dynatrain_megatron.testing.multiproc import run_on_ranks
from dynatrain_megatron.vps.errors import LayoutError
from dynatrain_megatron.vps.layout import Layout
from dynatrain_megatron.vps.validate import layout_errors

from hostile_cases import live_and_probe
from rank_cases import spec

pytestmark = pytest.mark.multirank

# built for real past the validator: refused classes (with the validator's reason) ...
REFUSED = [("tiny-gpt", "tp1pp3ppf2ppl2", 3, "at least one layer"),
           ("tiny-gpt", "tp1cp2pp1", 2, "Transformer Engine"),
           ("tiny-moe", "tp1pp1etp2", 4, "etp 2 must divide tp 1")]
# ... and one that megatron-core builds, but where etp would be silently ignored: the
# validator refuses it on purpose (a request for it would not do what it says)
STRICTER = [("tiny-gpt", "tp1etp2pp2", 4, "needs an MoE model")]


def _accepted_sample(n: int = 4, seed: int = 14) -> list[tuple[str, str, int]]:
    rng = random.Random(seed)
    pool = []
    for model in ("tiny-gpt", "tiny-moe"):
        for world in (1, 2, 4):
            for tp in (1, 2, 4):
                for pp in (1, 2, 4):
                    for ep in ((1, 2, 4) if model == "tiny-moe" else (1,)):
                        for vpp in (1, 2):
                            try:
                                lay = Layout.parse(f"tp{tp}pp{pp}ep{ep}vpp{vpp}", world)
                            except LayoutError:
                                continue
                            if not layout_errors(spec(model), lay, global_batch_size=8,
                                                 micro_batch_size=2):
                                pool.append((model, str(lay), world))
    multi = [c for c in pool if c[2] > 1]
    return rng.sample(multi, n)


ACCEPTED = _accepted_sample()


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    (root / "sig").mkdir(mode=0o700)
    (root / "outside").mkdir()
    victim = root / "outside" / "victim.json"
    victim.write_text(json.dumps({"layout": "tp1pp2dp2", "world": 4}))
    os.chmod(victim, 0o600)
    cases = [c[:3] for c in REFUSED + STRICTER] + ACCEPTED
    out = run_on_ranks(live_and_probe, 4, str(root), cases)[0]
    out["root"] = root
    return out


def test_every_hostile_request_filed_and_training_untouched(res):
    r, root = res["hostile"], res["root"]
    n = 14
    assert len(r["rejected"]) == n and r["history"] == 0 and r["layout"] == "tp2pp2dp1"
    assert r["losses"] == res["plain_losses"]  # as if nothing had been requested
    want = ["symbolic link", "not a regular file", "not a regular file", "group- or world",
            "not valid JSON", "not UTF-8", "nested too deeply", "digits", "positive int",
            "Transformer Engine", "at least one layer", "needs an MoE model", "given twice",
            "over the limit"]
    for got, w in zip(r["rejected"], want):
        assert w in got, (w, got)
    sig = root / "sig"
    records = [p for p in sig.iterdir() if p.name.startswith("switch.json.rejected.")
               and p.name[-1].isdigit()]
    assert len(records) == n and not (sig / "switch.json").exists()
    assert not list(sig.glob("*.accepted.*"))
    reasons = sorted(json.loads(p.read_text())["reason"] for p in records)
    assert reasons == sorted(r["rejected"])
    # the partial write: its record holds what was read, the rest went to the removed file
    partial = [json.loads(p.read_text()) for p in records
               if "not valid JSON" in json.loads(p.read_text())["reason"]]
    assert partial[0]["request"] == json.dumps({"layout": "tp1pp2dp2", "world": 4})[:12]
    outside = root / "outside"
    assert [p.name for p in outside.iterdir()] == ["victim.json"]
    assert json.loads((outside / "victim.json").read_text()) == {"layout": "tp1pp2dp2",
                                                                 "world": 4}


def test_schedule_entry_during_a_pending_switch_runs_after_it(res):
    r = res["schedule"]
    (i1, a1, b1), (i2, a2, b2) = r["switches"]
    assert (a1, b1, a2, b2) == ("tp2pp2dp1", "tp1pp2dp2", "tp1pp2dp2", "tp2pp1dp2")
    # a scheduled switch lands exactly after its iteration (never before it); the second
    # entry came due while the first was pending and runs after it
    assert 2 <= i1 < i2 and i2 >= 3 and r["layout"] == "tp2pp1dp2"


def test_validator_verdict_equals_what_megatron_core_builds(res):
    probe = {(p["model"], p["layout"], p["world"]): p for p in res["probe"]}
    for model, text, world, why in REFUSED:
        lay = Layout.parse(text, world)
        errs = layout_errors(spec(model), lay)
        assert errs and why in "; ".join(errs), (text, errs)
        assert not probe[(model, text, world)]["built"], probe[(model, text, world)]
    for model, text, world, why in STRICTER:
        assert why in "; ".join(layout_errors(spec(model), Layout.parse(text, world)))
        assert probe[(model, text, world)]["built"]
    for model, text, world in ACCEPTED:
        assert probe[(model, text, world)]["built"], probe[(model, text, world)]
