"""`dynatrain request --wait`: waits for the record named after its request and exits with
what the job answered (0 applied, 3 rejected, 4 failed, 5 no answer), `--json` prints it.
The job's side is played by a thread with the job's own functions: it announces itself
(`job_presence`), claims the request and files the outcome (`signal_file`)."""
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from dynatrain_megatron.cli import main as cli
from dynatrain_megatron.elastic import job_presence
from dynatrain_megatron.elastic import signal_file as sf


def _job(signal, outcome: str, reason: str, stop: threading.Event) -> threading.Thread:
    """A job that answers the next request at `signal` with `outcome`."""
    def run():
        while not stop.is_set():
            claimed = sf.claim(signal)
            if claimed is not None:
                time.sleep(0.3)  # the switch takes a while
                sf.archive(signal, outcome, reason, request_file=claimed)
                return
            time.sleep(0.05)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("outcome,code", [("applied", 0), ("rejected", 3), ("failed", 4)])
def test_wait_exits_with_the_jobs_answer(tmp_path, capsys, outcome, code):
    signal = tmp_path / "switch.json"
    job_presence.announce(signal)
    stop = threading.Event()
    job = _job(signal, outcome, f"the job says {outcome}", stop)
    try:
        rc = cli(["request", "--signal-file", str(signal), "--layout", "tp2pp2", "--world", "4",
                  "--wait", "--json", "--timeout", "60"])
    finally:
        stop.set()
        job.join()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == code and out["outcome"] == outcome
    assert out["reason"] == f"the job says {outcome}" and out["request"]["layout"] == "tp2pp2"
    # the record answering it is named after it
    assert (tmp_path / f"switch.json.{outcome}.{out['id']}").is_file()


def test_wait_without_a_job_says_so_and_withdraws_the_request(tmp_path, capsys):
    signal = tmp_path / "switch.json"
    rc = cli(["request", "--signal-file", str(signal), "--layout", "tp2pp2", "--wait"])
    text = capsys.readouterr().out
    assert rc == 5 and "gone: no job polls" in text and "withdrawn" in text
    assert not signal.exists()  # never applied later by surprise


def test_wait_when_the_job_died_or_never_answers(tmp_path, capsys):
    signal = tmp_path / "switch.json"
    # a job file left by a process of this host that is gone
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    job_presence.job_file(signal).write_text(json.dumps(dict(host=os.uname().nodename,
                                                             pid=dead.pid, started=0)))
    os.chmod(job_presence.job_file(signal), 0o600)
    rc = cli(["request", "--signal-file", str(signal), "--layout", "tp2pp2", "--wait", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 5 and out["outcome"] == "gone" and f"process {dead.pid}" in out["reason"]
    # a live job that does not answer in time
    job_presence.announce(signal)
    rc = cli(["request", "--signal-file", str(signal), "--layout", "tp2pp2", "--wait",
              "--timeout", "0.5"])
    assert rc == 5 and "no answer within 0.5 s" in capsys.readouterr().out
    job_presence.withdraw(signal)
    assert not job_presence.job_file(signal).exists()
