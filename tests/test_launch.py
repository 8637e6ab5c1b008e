"""`dynatrain launch`: workers get torchrun's environment, and a worker that dies does not
stop the others; the job's status says whether the survivors finished."""
import sys

import pytest

from dynatrain_megatron.loop.launch import WorkerExit, job_status, launch

# worker 1 fails at once; worker 0 (a "survivor") checks its environment and ends later
SCRIPT = """
import os, sys, time
r = int(os.environ["RANK"])
assert os.environ["WORLD_SIZE"] == "3" and os.environ["LOCAL_RANK"] == str(r)
assert os.environ["MASTER_ADDR"] == "127.0.0.1" and int(os.environ["MASTER_PORT"]) > 0
if r == 1:
    sys.exit(7)
time.sleep(1.0 if r == 0 else 0.5)
sys.exit(int(sys.argv[1]) if r == 0 else 0)
"""


def test_a_dead_worker_leaves_the_others_running(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    status, exits = launch(3, [sys.executable, str(script), "0"])
    codes = {e.rank: e.code for e in exits}
    assert codes == {0: 0, 1: 7, 2: 0}  # 0 and 2 ran to their end after 1 died
    assert [e.rank for e in exits][0] == 1
    assert status == 0  # the survivors finished


def test_survivors_that_fail_fail_the_job(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    status, exits = launch(3, [sys.executable, str(script), "5"])
    assert status == 7 and {e.rank: e.code for e in exits}[0] == 5


def test_job_status_rules():
    ok = WorkerExit(0, 0, 2.0)
    assert job_status([ok, WorkerExit(1, 0, 3.0)]) == 0
    assert job_status([WorkerExit(1, 9, 1.0), ok]) == 0  # recovered: last ones fine
    assert job_status([ok, WorkerExit(1, 9, 3.0)]) == 9  # a failure at the end
    assert job_status([WorkerExit(1, -9, 1.0)]) == 1  # killed by a signal
    with pytest.raises(ValueError, match="--nproc"):
        launch(0, ["true"])
