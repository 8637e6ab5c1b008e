"""Every file the job reads or writes, attacked (issue 24, items 4, 6, 7, 9, 10, 11).

Planted objects are real: symbolic links, FIFOs, hard links, directories, files of another
uid (os.chown, as root), a log directory that is a link or writable by others; a full disk
is a file-size limit (RLIMIT_FSIZE) in a child process. Each case goes through the
function the job runs (the hook's log line, the summary, the secret at launch, the
schedule at start-up, rank 0's handling of a request, the `dynatrain` command), and
asserts what must hold: nothing blocks, nothing is written through a link or into another
user's file, no half-written file, training is never ended by a write of ours, the
reason of an outcome is kept.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dynatrain_megatron.elastic import controller as C
from dynatrain_megatron.elastic import signal_file as sf
from dynatrain_megatron.elastic.job_secret import JobSecret, SecretError, establish, load_secret
from dynatrain_megatron.elastic.schedule import ScheduleError, load_schedule
from dynatrain_megatron.vps.model_spec import ModelSpec

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs" / "models"
OTHER_UID = 12345
root_only = pytest.mark.skipif(os.getuid() != 0, reason="changing a file's owner needs root")


def _finishes(fn, fifos=(), timeout: float = 10.0):
    """`fn()`'s result or exception, run in a thread; fails the test when it is still
    blocked after `timeout` s (then opens each FIFO for writing, which releases a reader
    blocked in open(), so no thread is left behind)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        for f in fifos:
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(5)
        pytest.fail(f"blocked for {timeout} s on a FIFO")
    return out


def _hook(log_dir: Path):
    """Rank 0's hook of a 4-process tiny-gpt job writing its log to `log_dir`."""
    from dynatrain_megatron.loop import hook as H
    from dynatrain_megatron.mcore.train_config import TrainConfig

    spec = ModelSpec.from_yaml(CONFIGS / "tiny-gpt.yaml")
    return H.DynatrainHook(spec, TrainConfig(global_batch_size=8, micro_batch_size=2),
                           C.Controller(spec, None), log_dir=str(log_dir))


@pytest.fixture
def rank0(monkeypatch):
    from dynatrain_megatron.loop import hook as H

    monkeypatch.setattr(H.dist, "get_rank", lambda *a: 0)
    monkeypatch.setattr(C.dist, "get_rank", lambda *a: 0)
    monkeypatch.setattr(C.dist, "get_world_size", lambda *a: 4)


def _summary(log_dir: Path, rejected: tuple = ("r",)) -> None:
    """The job's end-of-run summary (loop/main.py) for a stand-in trainer and hook (the
    caller stands in for `dist.get_world_size`)."""
    from dynatrain_megatron.loop import main as M

    trainer = SimpleNamespace(iteration=7, objs=SimpleNamespace(layout="tp2pp2dp1"))
    hook = SimpleNamespace(history=[1, 2], rejected=list(rejected), failed=[], recoveries=[],
                           admitted=[])
    M._write_summary(str(log_dir), trainer, hook)


# ------------------------------------------------------------------ item 6: reads never block
def test_fifo_planted_as_secret_schedule_or_secret_file_never_blocks(tmp_path):
    """A FIFO as `job_secret` in a sticky rendezvous directory (the job at launch), as
    `join --secret-file`, and as `--dynatrain-schedule`: each refused at once."""
    rdv = tmp_path / "rdv"
    rdv.mkdir()
    os.chmod(rdv, 0o1777)
    fifo = rdv / "job_secret"
    os.mkfifo(fifo, 0o600)
    r = _finishes(lambda: establish(None, str(rdv), env={}), [fifo])
    assert isinstance(r.get("error"), SecretError) and "not a regular file" in str(r["error"])
    r = _finishes(lambda: load_secret(str(fifo), env={}), [fifo])
    assert isinstance(r.get("error"), SecretError) and "not a regular file" in str(r["error"])

    from dynatrain_megatron.cli import main as cli

    r = _finishes(lambda: cli(["join", "--rendezvous-dir", str(rdv), "--secret-file",
                               str(fifo), "--timeout", "1"]), [fifo])
    assert r.get("value") == 2, r
    sched = tmp_path / "schedule.yaml"
    os.mkfifo(sched, 0o600)
    r = _finishes(lambda: load_schedule(sched, 20), [sched])
    assert isinstance(r.get("error"), ScheduleError) and "not a regular file" in str(r["error"])


def test_schedule_read_as_hostile_input(tmp_path):
    """A schedule that is a link, another user's, writable by others, or huge: refused
    with one line, before the first step."""
    good = tmp_path / "good.yaml"
    good.write_text("- {iteration: 3, layout: tp2pp2}\n")
    os.chmod(good, 0o644)
    assert load_schedule(good, 20) == [(3, "tp2pp2")]
    link = tmp_path / "link.yaml"
    link.symlink_to(good)
    with pytest.raises(ScheduleError, match="symbolic link"):
        load_schedule(link, 20)
    os.chmod(good, 0o666)
    with pytest.raises(ScheduleError, match="writable by others"):
        load_schedule(good, 20)
    big = tmp_path / "big.yaml"
    big.write_text("- {iteration: 3, layout: tp2pp2}\n" + "#" * (2 << 20))
    with pytest.raises(ScheduleError, match="over the limit"):
        load_schedule(big, 20)
    with pytest.raises(ScheduleError, match="no such file"):
        load_schedule(tmp_path / "missing.yaml", 20)
    if os.getuid() == 0:
        os.chmod(good, 0o644)
        os.chown(good, OTHER_UID, OTHER_UID)
        with pytest.raises(ScheduleError, match=f"owned by uid {OTHER_UID}"):
            load_schedule(good, 20)


def test_secret_is_never_written_into_an_unsafe_directory(tmp_path):
    """The secret generated at launch goes to a checked directory only: not one others may
    write to (not sticky), not a link."""
    rdv = tmp_path / "rdv"
    rdv.mkdir()
    os.chmod(rdv, 0o777)
    with pytest.raises(SecretError, match="writable by others"):
        establish(None, str(rdv), env={})
    link = tmp_path / "link"
    link.symlink_to(rdv, target_is_directory=True)
    os.chmod(rdv, 0o700)
    with pytest.raises(SecretError, match="symbolic link"):
        establish(None, str(link), env={})
    assert list(rdv.iterdir()) == []
    secret, where = establish(None, str(tmp_path / "new"), env={})
    assert oct((tmp_path / "new").stat().st_mode & 0o777) == "0o700"
    assert load_secret(str(tmp_path / "new" / "job_secret"), env={}) == secret


def test_oversize_secret_file_refused(tmp_path):
    p = tmp_path / "secret"
    p.write_text(JobSecret.generate().value.decode() + " " * 5000)
    os.chmod(p, 0o600)
    with pytest.raises(SecretError, match="over the limit"):
        load_secret(str(p), env={})


# ------------------------------------------------------------------ item 7: the log directory
def _plant(log_dir: Path, victim: Path) -> None:
    (log_dir / "switches.jsonl").symlink_to(victim)
    (log_dir / "summary.json").symlink_to(victim)


def test_links_planted_in_a_sticky_log_dir_are_never_written_through(tmp_path, rank0,
                                                                       monkeypatch, caplog):
    """Another user plants `summary.json` and `switches.jsonl` as links to the job user's
    file in a sticky log directory: the job never writes the target, the summary replaces
    the link, the JSON lines are refused (logged), training goes on."""
    from dynatrain_megatron.loop import main as M

    monkeypatch.setattr(M.dist, "get_world_size", lambda *a: 4)
    logs = tmp_path / "logs"
    logs.mkdir()
    os.chmod(logs, 0o1777)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    _plant(logs, victim)
    hook = _hook(logs)
    with caplog.at_level(logging.DEBUG, logger="dynatrain"):
        hook.stall.report.record("switch", {"iteration": 1})
        hook.stall.report.record("switch", {"iteration": 2})
        _summary(logs)
    assert victim.read_bytes() == b"precious\n"
    assert (logs / "switches.jsonl").is_symlink()
    summary = logs / "summary.json"
    assert not summary.is_symlink() and json.loads(summary.read_text())["iteration"] == 7
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "switches.jsonl" in errors[0].getMessage()
    assert "symbolic link" in errors[0].getMessage()


@root_only
def test_log_files_of_another_user_or_with_two_names_are_not_appended(tmp_path, rank0):
    logs = tmp_path / "logs"
    logs.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    os.link(victim, logs / "switches.jsonl")  # a hard link: another file's name
    _hook(logs).stall.report.record("switch", {"iteration": 1})
    assert victim.read_bytes() == b"precious\n"
    os.unlink(logs / "switches.jsonl")
    (logs / "switches.jsonl").write_text('{"planted": 1}\n')
    os.chown(logs / "switches.jsonl", OTHER_UID, OTHER_UID)
    _hook(logs).stall.report.record("switch", {"iteration": 1})
    assert (logs / "switches.jsonl").read_text() == '{"planted": 1}\n'


def test_unsafe_log_directory_is_refused(tmp_path, rank0, caplog):
    """A log directory that is a link, or that others may write to without the sticky bit,
    or (as root) another user's: named once when the hook starts (not at the first switch),
    nothing is written in it, training goes on."""
    real = tmp_path / "real"
    real.mkdir()
    cases = {"link": tmp_path / "link", "open": tmp_path / "open"}
    cases["link"].symlink_to(real, target_is_directory=True)
    cases["open"].mkdir()
    os.chmod(cases["open"], 0o777)
    if os.getuid() == 0:
        cases["foreign"] = tmp_path / "foreign"
        cases["foreign"].mkdir()
        os.chown(cases["foreign"], OTHER_UID, OTHER_UID)
    for name, d in cases.items():
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="dynatrain"):
            hook = _hook(d)
            started = caplog.text
            caplog.clear()
            assert hook.stall.report.record("switch", {"iteration": 1}) is None
        assert not (d / "switches.jsonl").exists(), name
        assert f"the log directory {d} cannot be used" in started, (name, started)
        assert len(started.strip().splitlines()) == 1, started
        assert caplog.text == "", name  # the refused directory is not reported per write
    assert list(real.iterdir()) == []
    good = tmp_path / "new" / "logs"  # created by the job: checked, then written
    _hook(good).stall.report.record("switch", {"iteration": 1})
    assert json.loads((good / "switches.jsonl").read_text())["iteration"] == 1


# ------------------------------------------------------------------ items 4 and 9: failed writes
def test_failed_log_writes_never_end_training(tmp_path, rank0, monkeypatch, caplog):
    """`switches.jsonl` a directory, then `summary.json` a directory: the hook's log line
    and the summary are skipped with one logged error each, never raised."""
    from dynatrain_megatron.loop import main as M

    monkeypatch.setattr(M.dist, "get_world_size", lambda *a: 4)
    logs = tmp_path / "logs"
    (logs / "switches.jsonl").mkdir(parents=True)
    (logs / "summary.json").mkdir()
    hook = _hook(logs)
    with caplog.at_level(logging.DEBUG, logger="dynatrain"):
        for i in range(3):
            hook.stall.report.record("switch", {"iteration": i})
        _summary(logs)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2, errors
    assert "switches.jsonl" in errors[0] and "summary.json" in errors[1]
    assert sorted(p.name for p in logs.iterdir()) == ["summary.json", "switches.jsonl"]


_FULL_DISK = r"""
import json, logging, os, resource, sys
from types import SimpleNamespace
logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
sys.path.insert(0, sys.argv[2])
from test_job_files import _hook, _summary
from dynatrain_megatron.elastic import controller as C
from dynatrain_megatron.loop import hook as H
from dynatrain_megatron.loop import main as M
from dynatrain_megatron.vps.model_spec import ModelSpec
H.dist.get_rank = C.dist.get_rank = lambda *a: 0
C.dist.get_world_size = M.dist.get_world_size = lambda *a: 4
root = sys.argv[1]
sig = os.path.join(root, "signal", "switch.json")
spec = ModelSpec.from_yaml(os.path.join(sys.argv[3], "tiny-gpt.yaml"))
ctl = C.Controller(spec, sig)
hook = _hook(os.path.join(root, "logs"))
hook.stall.report.record("switch", {"iteration": 0, "pad": "x" * 100})  # fits
# a bad request bigger than the limit: its record cannot be written whole
with open(sig + ".tmp", "wb") as f:
    f.write(b'{"layout": "' + b"y" * 1500)
os.chmod(sig + ".tmp", 0o600)
os.rename(sig + ".tmp", sig)
limit = 1200
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
out = {}
for i in range(1, 30):  # the disk fills: lines that do not fit are skipped
    hook.stall.report.record("switch", {"iteration": i, "pad": "x" * 100})
_summary(os.path.join(root, "logs"), rejected=("z" * 2000,))  # bigger than the limit
d = ctl._decide_on_rank0(1, 4)
out["rejected"] = d.rejected
out["target"] = d.target
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory):
    """One child process whose files may not grow past 1200 bytes (RLIMIT_FSIZE, as
    `prlimit --fsize` does): the hook logs 30 switches, writes the summary and rank 0
    rejects a long bad request."""
    root = tmp_path_factory.mktemp("fsize")
    (root / "signal").mkdir(mode=0o700)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _FULL_DISK, str(root), str(ROOT / "tests"),
                        str(CONFIGS)], capture_output=True, text=True, timeout=300)
    return root, p, time.perf_counter() - t0


def test_full_disk_never_ends_training_and_keeps_whole_lines(full_disk):
    root, p, _ = full_disk
    assert p.returncode == 0, p.stderr[-3000:]
    lines = (root / "logs" / "switches.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]  # every line whole
    assert [r["iteration"] for r in rows] == list(range(len(rows))) and 1 < len(rows) < 30
    assert not (root / "logs" / "summary.json").exists()  # whole or not at all
    assert p.stderr.count("could not write switches.jsonl") == 1  # logged once
    assert "could not write summary.json" in p.stderr
    assert not [f for f in os.listdir(root / "logs") if f.endswith(".tmp")]


def test_full_disk_keeps_the_reason_of_an_outcome_and_no_truncated_record(full_disk):
    root, p, _ = full_disk
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["target"] is None and "not valid JSON" in out["rejected"]
    assert "File too large" not in out["rejected"]
    sig = root / "signal"
    assert not list(sig.glob("switch.json.rejected.*"))  # no half record
    assert not [f for f in os.listdir(sig) if f.endswith(".tmp")]
    assert "could not file the request" in p.stderr and "not valid JSON" in p.stderr


# ------------------------------------------------------------------ item 10: pending requests
def test_request_while_one_is_pending_is_refused_and_the_first_kept(tmp_path, capsys):
    from dynatrain_megatron.cli import main as cli

    sig = tmp_path / "switch.json"
    assert cli(["request", "--signal-file", str(sig), "--layout", "tp2pp2"]) == 0
    assert cli(["request", "--signal-file", str(sig), "--layout", "tp1pp4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "already pending" in err and "tp2pp2" in err and len(err.splitlines()) == 1
    assert sf.read_request(sig).layout == "tp2pp2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["switch.json"]  # no temporary left
    # once the job has taken it, the next request goes in
    assert sf.claim(sig) is not None
    assert cli(["request", "--signal-file", str(sig), "--world", "2"]) == 0
    assert sf.read_request(sig).world == 2
    with pytest.raises(sf.RequestError, match="already pending"):
        sf.write_request(sig, "tp4", None)


def test_request_is_never_written_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    sig = tmp_path / "switch.json"
    sig.symlink_to(victim)
    with pytest.raises(sf.RequestError, match="already pending"):
        sf.write_request(sig, "tp2pp2", None)
    assert victim.read_bytes() == b"precious"


# ------------------------------------------------------------------ item 11: start-up errors
def _parse_error(argv, capsys, megatron: bool = False) -> str:
    from dynatrain_megatron.loop.arguments import add_dynatrain_args
    from dynatrain_megatron.megatron_lm.arguments import chain_extra_args_providers

    p = argparse.ArgumentParser(prog="pretrain_gpt.py")
    p = chain_extra_args_providers(None)(p) if megatron else add_dynatrain_args(p)
    with pytest.raises(SystemExit) as e:
        p.parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_poll_interval_below_one_is_an_error(value, capsys):
    for megatron in (False, True):
        line = _parse_error(["--dynatrain-poll-interval", value], capsys, megatron)
        assert "--dynatrain-poll-interval: must be a positive integer" in line


def test_recovery_checkpoint_must_exist_and_is_refused_in_megatron_lm(tmp_path, capsys):
    from dynatrain_megatron.loop.arguments import add_dynatrain_args

    line = _parse_error(["--dynatrain-recovery-checkpoint", str(tmp_path / "none")], capsys)
    assert "--dynatrain-recovery-checkpoint" in line and "is not a directory" in line
    ok = add_dynatrain_args(argparse.ArgumentParser()).parse_args(
        ["--dynatrain-recovery-checkpoint", str(tmp_path)])
    assert ok.dynatrain_recovery_checkpoint == str(tmp_path)
    line = _parse_error(["--dynatrain-recovery-checkpoint", str(tmp_path)], capsys, True)
    assert "not used inside Megatron-LM" in line


def test_standby_ranks_refused_in_megatron_lm(capsys):
    from dynatrain_megatron.megatron_lm.arguments import chain_extra_args_providers

    line = _parse_error(["--dynatrain-standby-ranks", "2"], capsys, megatron=True)
    assert "--dynatrain-standby-ranks" in line and "not supported inside Megatron-LM" in line
    p = chain_extra_args_providers(None)(argparse.ArgumentParser())
    assert p.parse_args(["--dynatrain-standby-ranks", "0"]).dynatrain_standby_ranks == 0
    assert p.parse_args([]).dynatrain_standby_ranks == 0


def test_duplicate_keys_in_a_schedule_entry_are_an_error(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("- {iteration: 3, layout: tp2pp2, iteration: 9}\n"
                 "- iteration: 12\n  layout: tp1pp2\n  layout: tp2pp1\n")
    with pytest.raises(ScheduleError) as e:
        load_schedule(p, train_iters=20)
    msg = str(e.value)
    assert "key 'iteration' given twice" in msg and "line 1" in msg
    assert "key 'layout' given twice" in msg and "line 4" in msg
    p.write_text("switches: [{iteration: 3, layout: tp2pp2}]\nswitches: []\n")
    with pytest.raises(ScheduleError, match="key 'switches' given twice"):
        load_schedule(p, train_iters=20)
