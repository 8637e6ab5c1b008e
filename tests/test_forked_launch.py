"""The tests' Megatron-LM launcher (`dynatrain_megatron/testing/forked_launch.py`): workers
forked after the script's imports, in torchrun's environment; the first failure ends the
others and is the job's status. The same through the session's preloaded launch server
(`testing/launch_server.py`), which is shared by jobs of the same script and environment
only, and ends a job whose client is killed."""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dynatrain_megatron.testing.forked_launch import script_imports
from dynatrain_megatron.testing.launch_server import server_pids

SCRIPT = textwrap.dedent('''
    import os
    import sys
    PRELOADED = "colorsys" in sys.modules  # imported by the launcher before the fork
    import colorsys  # noqa: F401
    import json
    from pathlib import Path

    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT")
    (out / f"r{rank}.json").write_text(json.dumps(dict(
        {k: os.environ[k] for k in keys}, preloaded=PRELOADED, argv=sys.argv[1:],
        name=__name__, pid=os.getpid())))
    if sys.argv[2] == "fail" and rank == 1:
        sys.exit(3)
    if sys.argv[2] in ("fail", "sleep"):
        import time
        time.sleep(120)  # ended by the launcher when rank 1 fails, or with its client
''')


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The script, and the servers its jobs share (each ended after the module)."""
    d = tmp_path_factory.mktemp("launch")
    (d / "job.py").write_text(SCRIPT)
    yield d
    for pid in server_pids(d / "servers"):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _cmd(shared, out, mode, nproc, via, servers=None):
    script = shared / "job.py"
    if via == "server":
        head = ["dynatrain_megatron.testing.launch_server", "--server-dir",
                str(servers or shared / "servers"), "--owner-pid", str(os.getpid())]
    else:
        head = ["dynatrain_megatron.testing.forked_launch"]
    return [sys.executable, "-m", *head, "--nproc-per-node", str(nproc), str(script),
            str(out), mode]


def _launch(shared, out, mode, nproc, via="forked", env=None, servers=None):
    t0 = time.monotonic()
    proc = subprocess.run(_cmd(shared, out, mode, nproc, via, servers), capture_output=True,
                          text=True, timeout=300, env=env)
    return proc, time.monotonic() - t0


VIA = pytest.mark.parametrize("via", ["forked", "server"])


@VIA
def test_workers_get_torchruns_environment_after_the_scripts_imports(shared, tmp_path, via):
    proc, _ = _launch(shared, tmp_path, "ok", 3, via)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(3)]
    assert [s["RANK"] for s in seen] == ["0", "1", "2"] == [s["LOCAL_RANK"] for s in seen]
    assert {(s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"], s["MASTER_ADDR"]) for s in seen} == {
        ("3", "3", "127.0.0.1")}
    assert len({s["MASTER_PORT"] for s in seen}) == 1 and len({s["pid"] for s in seen}) == 3
    assert all(s["preloaded"] and s["name"] == "__main__" for s in seen)
    assert all(s["argv"] == [str(tmp_path), "ok"] for s in seen)


@VIA
def test_the_first_failure_ends_the_others_and_is_the_jobs_status(shared, tmp_path, via):
    proc, seconds = _launch(shared, tmp_path, "fail", 2, via)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "exited 3; ending the others" in proc.stderr
    assert seconds < 100  # rank 0 would sleep 120 s


def test_script_imports_are_its_top_level_absolute_imports(tmp_path):
    p = tmp_path / "s.py"
    p.write_text("import os, json as j\nfrom a.b import c\nfrom . import d\n"
                 "def f():\n    import never\n")
    assert script_imports(p) == ["os", "json", "a.b"]


def test_a_server_runs_jobs_of_its_environment_only(shared, tmp_path):
    servers = tmp_path / "servers"
    try:
        for env in (None, None, dict(os.environ, DYNATRAIN_TEST_OTHER="1")):
            proc, _ = _launch(shared, tmp_path, "ok", 2, "server", env, servers)
            assert proc.returncode == 0, proc.stderr[-3000:]
        logs = sorted(servers.glob("*.log"))
        assert len(logs) == 2 and len(server_pids(servers)) == 2
        jobs = sorted(log.read_text().count("launch_server: job ") for log in logs)
        assert jobs == [1, 2]
    finally:
        for pid in server_pids(servers):
            os.kill(pid, signal.SIGKILL)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_killed_client_ends_its_jobs_workers(shared, tmp_path):
    client = subprocess.Popen(_cmd(shared, tmp_path, "sleep", 2, "server"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    files = [tmp_path / f"r{r}.json" for r in range(2)]
    deadline = time.monotonic() + 120
    while not all(f.exists() for f in files):
        assert time.monotonic() < deadline and client.poll() is None
        time.sleep(0.1)
    pids = [json.loads(f.read_text())["pid"] for f in files]
    client.kill()
    client.wait()
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"workers {pids} outlived their killed client"
        time.sleep(0.1)


def test_with_survivors_a_failure_ends_no_other_worker(tmp_path):
    """`--survivors`: supervised as under `dynatrain launch` (rank death tests): rank 1's
    failure leaves rank 0 running to its end, each exit is logged, and the status is the
    first failure's (no worker reported that it completed training)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent('''
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(2)
        open(sys.argv[1] + "/r0.done", "w").close()
    '''))
    proc = subprocess.run([sys.executable, "-m", "dynatrain_megatron.testing.forked_launch",
                           "--survivors", "--nproc-per-node", "2", str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert (tmp_path / "r0.done").exists()  # rank 0 was not ended by rank 1's failure
    exits = sorted(set(re.findall(r"\[launch\] worker (\d) exited with (-?\d+) after",
                                  proc.stderr)))
    assert exits == [("0", "0"), ("1", "3")], proc.stderr[-3000:]
