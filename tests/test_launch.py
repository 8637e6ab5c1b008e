"""`dynatrain launch`: workers get torchrun's environment, and a worker that dies does not
stop the others; the job's status says whether the job completed."""
import sys

import pytest

from dynatrain_megatron.loop.launch import WorkerExit, job_status, launch

# worker 1 fails at once; worker 0 (a "survivor") checks its environment, finishes training
# (it reports so) and ends later; worker 2 leaves without training state (status 0)
SCRIPT = """
import os, sys, time
from dynatrain_megatron.loop.launch import report_completed
r = int(os.environ["RANK"])
assert os.environ["WORLD_SIZE"] == "3" and os.environ["LOCAL_RANK"] == str(r)
assert os.environ["MASTER_ADDR"] == "127.0.0.1" and int(os.environ["MASTER_PORT"]) > 0
if r == 1:
    sys.exit(7)
time.sleep(1.0 if r == 0 else 0.5)
if r == 0 and sys.argv[2] == "completes":
    report_completed()
sys.exit(int(sys.argv[1]) if r == 0 else 0)
"""


def test_a_dead_worker_leaves_the_others_running(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    status, exits = launch(3, [sys.executable, str(script), "0", "completes"])
    codes = {e.rank: e.code for e in exits}
    assert codes == {0: 0, 1: 7, 2: 0}  # 0 and 2 ran to their end after 1 died
    assert [e.rank for e in exits][0] == 1
    assert status == 0  # a survivor finished training


def test_no_worker_finished_fails_the_job(tmp_path):
    """Issue 24 item 5: one worker crashed, the others exited 0 without finishing training
    (left as "not needed", or woke from SIGSTOP and left): not a success."""
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    status, exits = launch(3, [sys.executable, str(script), "0", "leaves"])
    assert {e.rank: e.code for e in exits} == {0: 0, 1: 7, 2: 0}
    assert status == 7


def test_survivors_that_fail_fail_the_job(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    status, exits = launch(3, [sys.executable, str(script), "5", "completes"])
    assert status == 7 and {e.rank: e.code for e in exits}[0] == 5


def test_job_status_rules():
    ok = WorkerExit(0, 0, 2.0)
    assert job_status([ok, WorkerExit(1, 0, 3.0)]) == 0  # no failure: nothing to prove
    assert job_status([WorkerExit(1, 9, 1.0), ok], completed={0}) == 0  # recovered
    assert job_status([WorkerExit(1, 9, 1.0), ok]) == 9  # nobody finished training
    assert job_status([ok, WorkerExit(1, 9, 3.0)], completed={0}) == 9  # a failure at the end
    # a worker that finished training, then failed (its final save): not a success
    assert job_status([WorkerExit(2, 9, 1.0), WorkerExit(0, 3, 2.0), WorkerExit(1, 0, 4.0)],
                      completed={0, 1}) == 9
    # ... unless the survivors finished the job after that failure and said so again
    assert job_status([WorkerExit(2, 9, 1.0), WorkerExit(0, 3, 2.0), WorkerExit(1, 0, 4.0)],
                      completed={0: 0.5, 1: 3.0}) == 0
    assert job_status([WorkerExit(2, 9, 1.0), WorkerExit(0, 3, 2.0), WorkerExit(1, 0, 4.0)],
                      completed={0: 0.5, 1: 1.5}) == 9  # its report came before the failure
    assert job_status([WorkerExit(1, -9, 1.0)]) == 1  # killed by a signal
    with pytest.raises(ValueError, match="--nproc"):
        launch(0, ["true"])


def test_the_store_port_is_held_until_rank_0_binds_it():
    """The port handed to the workers (`MASTER_PORT`) stays bound by the launcher: no other
    process can bind it, nor get it from the OS, in the seconds before rank 0's store binds
    it; rank 0's TCPStore binds it all the same, and clients reach that store."""
    import datetime
    import errno
    import socket

    import torch.distributed as dist

    from dynatrain_megatron.loop.launch import reserved_port

    with reserved_port() as port:
        with socket.socket() as other:  # another job's bind of this very port
            with pytest.raises(OSError) as e:
                other.bind(("127.0.0.1", port))
            assert e.value.errno == errno.EADDRINUSE
        given = []  # what the OS hands out meanwhile: never this port
        for _ in range(200):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            given.append(s)
        assert port not in {s.getsockname()[1] for s in given}
        for s in given:
            s.close()
        t = datetime.timedelta(seconds=10)
        master = dist.TCPStore("127.0.0.1", port, 1, True, timeout=t, wait_for_workers=False)
        client = dist.TCPStore("127.0.0.1", port, 1, False, timeout=t)
        client.set("k", "v")
        assert master.get("k") == b"v"
