"""Hostile signal files, fuzzed through rank 0's request handling in-process (issue 14).

Every case goes through `Controller._decide_on_rank0`, the function rank 0 runs at each
poll: it must never raise, must reject the case with a reason, must file it under a fresh
`<path>.rejected.<n>` record, must clear the signal path, and must write nothing outside
the signal directory (a symlink's target is unchanged). The live job (one per suite)
is in test_hostile_live.py.
"""
from __future__ import annotations

import gc
import json
import os
import random
import stat
import threading
from pathlib import Path

import pytest

from dynatrain_megatron.elastic import controller as C
from dynatrain_megatron.elastic import signal_file as sf
from dynatrain_megatron.vps.model_spec import ModelSpec

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "models"
VALID = json.dumps({"layout": "tp2pp1dp2", "world": 4}).encode()


def _corpus(seed: int = 14) -> list[tuple[str, bytes, str]]:
    """(name, content, expected words in the reason) for a few hundred generated cases."""
    rng = random.Random(seed)
    out: list[tuple[str, bytes, str]] = []
    for i in range(60):
        out.append((f"bytes{i}", rng.randbytes(rng.randint(1, 300)), ""))
    for i in range(20):  # invalid UTF-8 inside otherwise valid JSON
        bad = bytes([rng.choice([0x80, 0xC0, 0xFF, 0xFE, 0xED])]) + rng.randbytes(3)
        out.append((f"enc{i}", b'{"layout": "tp2' + bad + b'"}', "not UTF-8"))
    for depth in (1000, 5000, 30000):
        out.append((f"deep{depth}", b'{"layout": ' + b"[" * depth + b"]" * depth + b"}",
                    "nested too deeply" if depth > 1000 else "layout"))
    for n in (20, 500, 5000):
        out.append((f"bigworld{n}", b'{"layout": "tp2", "world": ' + b"9" * n + b"}", "digits"))
        out.append((f"biglayout{n}", json.dumps({"layout": "tp" + "9" * n}).encode(),
                    "layout"))
    wrong = [{"layout": "tp2pp1dp4", "world": True}, {"layout": "tp2", "world": "4"},
             {"layout": "tp2", "world": 4.0}, {"layout": 4}, {"layout": ["tp2"]},
             {"layout": None}, {"layout": "tp2", "origin": 5},
             {"layout": "tp2", "requested_at": "now"}, {"layout": "tp2", "world": 0},
             {"layout": "tp2", "world": -3}, {"layout": "tp2\x00"}, {"layout": "tp２pp2"},
             {"layout": "tp2", "world": 10**12}, {"layout": " "}, {"world": 4}, [], "tp2",
             None, 4, {"layout": {"tp": 2}}]
    for i, obj in enumerate(wrong):
        out.append((f"type{i}", json.dumps(obj).encode(), ""))
    out.append(("nan", b'{"layout": "tp2", "requested_at": NaN}', "NaN"))
    for i in range(15):
        k = "".join(rng.choice("abcxyz_") for _ in range(rng.randint(1, 12)))
        out.append((f"unknown{i}", json.dumps({"layout": "tp2pp1", k + "_x": 1}).encode(),
                    "unknown fields"))
    out.append(("dup", b'{"layout": "tp1pp1", "layout": "tp2pp1"}', "given twice"))
    out.append(("dupworld", b'{"layout": "tp1", "world": 4, "world": 1}', "given twice"))
    out.append(("oversize", json.dumps({"layout": "tp2", "origin": "x" * 70_000}).encode(),
                "over the limit"))
    out.append(("huge", b" " * (1 << 20) + VALID, "over the limit"))
    alphabet = "tpvcedfloi0123456789 -_/xX"
    for i in range(80):  # layout strings: malformed, or valid ones megatron cannot build
        lay = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20)))
        out.append((f"layout{i}", json.dumps({"layout": lay}).encode(), ""))
    refused_layouts = [("tp1pp1etp2dp4", "needs an MoE model"), ("tp2cp2dp1", "Transformer Engine"),
                       ("tp1pp3ppf2ppl2", "at least one layer"), ("tp1ep2dp4", "needs an MoE"),
                       ("tp8pp1", "does not divide world"), ("tp1pp4vpp2", "num_layers"),
                       ("tp3pp1", "does not divide world"), ("tp1pp1dp2", "gives dp4")]
    for i, (lay, why) in enumerate(refused_layouts):
        world = 3 if "pp3" in lay else None
        body = {"layout": lay} if world is None else {"layout": lay, "world": world}
        out.append((f"refused{i}", json.dumps(body).encode(), why))
    return out


CORPUS = _corpus()


@pytest.fixture
def job(tmp_path, monkeypatch):
    """Rank 0 of a 4-process job training tiny-gpt, with its signal directory and a
    directory beside it the job must never write to."""
    monkeypatch.setattr(C.dist, "get_world_size", lambda *a: 4)
    monkeypatch.setattr(C.dist, "get_rank", lambda *a: 0)
    sig_dir = tmp_path / "signal"
    sig_dir.mkdir(mode=0o700)
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.json"
    victim.write_bytes(VALID)
    os.chmod(victim, 0o600)
    spec = ModelSpec.from_yaml(CONFIGS / "tiny-gpt.yaml")
    ctl = C.Controller(spec, str(sig_dir / "switch.json"))
    return ctl, sig_dir, outside, victim


def _snapshot(d: Path) -> dict:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in d.iterdir()}


def _records(sig_dir: Path) -> list[dict]:
    out = []
    files = [p for p in sig_dir.glob("switch.json.rejected.*") if p.name[-1].isdigit()]
    for p in sorted(files, key=lambda p: int(p.name.rsplit(".", 1)[1])):
        assert stat.S_IMODE(p.lstat().st_mode) == 0o600 and p.is_file() and not p.is_symlink()
        out.append(json.loads(p.read_text()))
    return out


def test_fuzz_corpus_every_case_rejected_with_a_reason_and_filed(job):
    ctl, sig_dir, outside, victim = job
    before = _snapshot(outside)
    path = sig_dir / "switch.json"
    assert len(CORPUS) >= 200
    for i, (name, data, why) in enumerate(CORPUS):
        path.write_bytes(data)
        os.chmod(path, 0o600)
        d = ctl._decide_on_rank0(1, 4)
        assert d.target is None and d.rejected, (name, d)
        assert why in d.rejected, (name, why, d.rejected)
        assert len(d.rejected) < 3000, (name, len(d.rejected))  # a bounded excerpt only
        assert not os.path.lexists(path), name
        recs = _records(sig_dir)
        assert len(recs) == i + 1, name
        assert recs[-1]["outcome"] == "rejected" and recs[-1]["reason"] == d.rejected
        assert len(json.dumps(recs[-1])) < 5 * sf.MAX_REQUEST_BYTES
    assert not list(sig_dir.glob("*.accepted.*"))
    assert _snapshot(outside) == before


def test_unsafe_objects_at_the_signal_path(job):
    """A symlink (to the test's own valid request, and to a file outside), a FIFO, a
    directory, group- and world-writable files, a foreign-owned file, an unsafe directory:
    each refused and filed, nothing followed, nothing outside written, no hang."""
    ctl, sig_dir, outside, victim = job
    before = _snapshot(outside)
    path = sig_dir / "switch.json"
    own = sig_dir / "own.json"
    own.write_bytes(VALID)
    os.chmod(own, 0o600)
    own_before = own.read_bytes()
    cases = [("link-own", lambda: os.symlink(own, path), "symbolic link"),
             ("link-out", lambda: os.symlink(victim, path), "symbolic link"),
             ("fifo", lambda: os.mkfifo(path, 0o600), "not a regular file"),
             ("dir", lambda: os.mkdir(path, 0o700), "not a regular file"),
             ("0660", lambda: (path.write_bytes(VALID), os.chmod(path, 0o660)), "group- or world"),
             ("0666", lambda: (path.write_bytes(VALID), os.chmod(path, 0o666)), "group- or world"),
             ("hardlink", lambda: os.link(own, path), "2 hard links")]
    if os.getuid() == 0:  # only root can make a file another user owns
        cases.append(("foreign", lambda: (path.write_bytes(VALID), os.chmod(path, 0o600),
                                          os.chown(path, 12345, 12345)), "owned by uid 12345"))
    for name, make, why in cases:
        make()
        done = []
        t = threading.Thread(target=lambda: done.append(ctl._decide_on_rank0(1, 4)), daemon=True)
        t.start()
        t.join(20)
        assert done, f"{name}: rank 0 hung"
        d = done[0]
        assert d.target is None and why in d.rejected, (name, d)
        assert not os.path.lexists(path), name
    recs = _records(sig_dir)
    assert len(recs) == len(cases) and all(r["reason"] for r in recs)
    # each refused object is kept beside its record, as it was (never read nor followed)
    kept = sorted(p.name for p in sig_dir.glob("*.original"))
    assert kept == sorted(f"switch.json.rejected.{i}.original" for i in range(len(cases)))
    assert os.readlink(sig_dir / "switch.json.rejected.1.original") == str(victim)
    assert own.read_bytes() == own_before and _snapshot(outside) == before
    # a directory others may write to (and not sticky): even a valid request is refused
    os.chmod(sig_dir, 0o770)
    path.write_bytes(VALID)
    os.chmod(path, 0o600)
    d = ctl._decide_on_rank0(1, 4)
    assert d.target is None and "writable by others" in d.rejected
    os.chmod(sig_dir, 0o1770)  # sticky: only the file's owner can move it: accepted
    path.write_bytes(VALID)
    os.chmod(path, 0o600)
    d = ctl._decide_on_rank0(1, 4)
    assert (d.target, d.world, d.rejected) == ("tp2pp1dp2", 4, None)


def test_partial_write_is_rejected_and_the_rest_never_reaches_the_record(job):
    ctl, sig_dir, outside, victim = job
    path = sig_dir / "switch.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, VALID[:10])
    d = ctl._decide_on_rank0(1, 4)
    assert d.target is None and "not valid JSON" in d.rejected
    os.write(fd, VALID[10:])  # the writer finishes: into the claimed (removed) file
    os.close(fd)
    rec = _records(sig_dir)
    assert len(rec) == 1 and rec[0]["request"] == VALID[:10].decode()
    assert sorted(p.name for p in sig_dir.iterdir()) == ["switch.json.rejected.0"]
    # a writer that renames into place, as `dynatrain request` does, is read whole
    sf.write_request(path, "tp2pp1dp2", 4)
    assert ctl._decide_on_rank0(2, 4).target == "tp2pp1dp2"


def test_foreign_file_that_cannot_be_moved_is_filed_once(job, monkeypatch):
    """In a sticky directory a non-root job cannot move another user's file: it is
    refused and filed once, then ignored until it changes (no log flood)."""
    ctl, sig_dir, outside, victim = job
    path = sig_dir / "switch.json"
    path.write_bytes(VALID)

    def refuse(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(sf.os, "rename", refuse)
    monkeypatch.setattr(sf.os, "unlink", lambda p: refuse(p, None))
    d = ctl._decide_on_rank0(1, 4)
    assert d.target is None and "cannot be claimed" in d.rejected
    assert ctl._decide_on_rank0(2, 4).rejected is None  # the same file: quiet
    assert len(_records(sig_dir)) == 1 and path.exists()


def test_filing_failure_never_raises_nor_hides_the_reason(job, monkeypatch, caplog):
    """A record that cannot be written (a full disk) is logged with the outcome's own
    reason; the decision keeps that reason, not the I/O error's."""
    ctl, sig_dir, outside, victim = job
    path = sig_dir / "switch.json"
    path.write_bytes(b"{broken")
    os.chmod(path, 0o600)

    def fail(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sf, "_create_record", fail)
    d = ctl._decide_on_rank0(1, 4)
    assert d.target is None and "not valid JSON" in d.rejected
    assert "No space left" not in d.rejected
    assert "No space left" in caplog.text and "not valid JSON" in caplog.text
    sf.write_request(path, "tp2pp1dp2", 4)
    monkeypatch.undo()
    monkeypatch.setattr(C.dist, "get_world_size", lambda *a: 4)
    monkeypatch.setattr(C.dist, "get_rank", lambda *a: 0)
    ok = ctl._decide_on_rank0(2, 4)
    assert ok.target == "tp2pp1dp2"
    monkeypatch.setattr(sf, "_create_record", fail)
    ctl.done(ok, "applied", "switched")  # logged, not raised


def test_request_cli_bounds_and_validates(tmp_path, capsys):
    from dynatrain_megatron.cli import main as cli

    p = tmp_path / "s.json"
    assert cli(["request", "--signal-file", str(p), "--layout", "tp" + "9" * 5000]) == 2
    err = capsys.readouterr().err
    assert "at most 64 ASCII characters" in err and len(err) < 400
    model = str(CONFIGS / "tiny-gpt.yaml")
    assert cli(["request", "--signal-file", str(p), "--layout", "tp1etp2pp1", "--world", "4",
                "--model", model]) == 2
    assert "needs an MoE model" in capsys.readouterr().err and not p.exists()
    assert cli(["request", "--signal-file", str(p), "--layout", "tp2pp2", "--world", "4",
                "--model", model]) == 0
    assert sf.read_request(p).layout == "tp2pp2"


def test_placement_failure_fails_the_switch_and_keeps_a(job, monkeypatch):
    """A layout the validator let through but the placement choice cannot handle (it raises
    on every rank alike): chosen in the background, it is a failed request at the switch;
    chosen at the decision (B built in the pause), a rejected one. Either way the hook
    keeps layout A, files the request under its id, never raising into training."""
    from dynatrain_megatron.loop import hook as H
    from dynatrain_megatron.mcore.train_config import TrainConfig
    from dynatrain_megatron.vps.layout import Layout
    from dynatrain_megatron.vps.placement import Placement

    ctl, sig_dir, outside, victim = job
    monkeypatch.setattr(H.dist, "get_rank", lambda *a: 0)

    def boom(*a, **k):
        raise sf.RequestError("no rank-ordered placement")  # any exception type

    monkeypatch.setattr(H, "choose_dst_placement", boom)
    a = Layout.parse("tp2pp2", 4)
    for background, outcome in ((True, "failed"), (False, "rejected")):
        hook = H.DynatrainHook(ctl.spec, TrainConfig(global_batch_size=8, micro_batch_size=2),
                               ctl, background_groups=background)
        hook.start(None, a, Placement((0, 1, 2, 3)))
        req = sf.write_request(sig_dir / "switch.json", "tp2pp1dp2", 4)
        d = ctl._decide_on_rank0(1, 4)
        assert d.target == "tp2pp1dp2"
        hook._on_decision(d, 1)
        if background:  # the preparation thread chose no placement: the switch fails
            hook.devices._thread.join()
            assert hook._switch("trainer at A") == "trainer at A"
            assert "no rank-ordered placement" in hook.failed[-1]
            assert gc.isenabled()  # a failed switch leaves no collection paused
        else:
            assert "no placement for tp2pp1dp2" in hook.rejected[-1]
        assert hook.layout == a and hook.decision is None and not hook.devices.pending
        rec = json.loads((sig_dir / f"switch.json.{outcome}.{req.id}").read_text())
        assert "no rank-ordered placement" in rec["reason"] and '"tp2pp1dp2"' in rec["request"]


def test_failed_background_preparation_is_a_failed_request_and_keeps_a(job, monkeypatch):
    """B's groups or preparation raising in the background thread surfaces at the switch
    as a failed request on every rank alike (agreed by the ready vote: no further
    collective), A untouched."""
    from dynatrain_megatron.loop import hook as H
    from dynatrain_megatron.mcore.train_config import TrainConfig
    from dynatrain_megatron.vps.layout import Layout
    from dynatrain_megatron.vps.placement import Placement

    ctl, sig_dir, outside, victim = job
    monkeypatch.setattr(H.dist, "get_rank", lambda *a: 0)
    collectives = []  # one rank stands for all here: it makes none at the switch
    for name in ("all_reduce", "broadcast", "all_gather_object", "broadcast_object_list"):
        monkeypatch.setattr(H.dist, name, lambda *a, name=name, **k: collectives.append(name))
    hook = H.DynatrainHook(ctl.spec, TrainConfig(global_batch_size=8, micro_batch_size=2), ctl)
    a = Layout.parse("tp2pp2", 4)
    hook.start(None, a, Placement((0, 1, 2, 3)))
    sf.write_request(sig_dir / "switch.json", "tp2pp1dp2", 4)
    hook.decision = ctl._decide_on_rank0(1, 4)
    b = Layout.parse("tp2pp1dp2", 4)
    hook.devices.target = (b, Placement((0, 1, 2, 3)))
    hook.devices._error = MemoryError("B does not fit")  # as the thread leaves it
    hook.devices.given_up = "preparing tp2pp1dp2 failed on some rank"  # the ready vote's
    assert hook._switch("trainer at A") == "trainer at A"
    assert gc.isenabled()  # a failed switch leaves no collection paused
    assert hook.layout == a and not hook.devices.pending and hook.decision is None
    assert "preparing tp2pp1dp2 failed: RuntimeError" in hook.failed[-1]
    assert "B does not fit" in hook.failed[-1]
    assert collectives == []
    (rec,) = [json.loads(p.read_text()) for p in sig_dir.glob("switch.json.failed.*")]
    assert rec["outcome"] == "failed" and "B does not fit" in rec["reason"]
