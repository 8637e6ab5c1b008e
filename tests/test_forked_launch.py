"""The tests' Megatron-LM launcher (`dynatrain_megatron/testing/forked_launch.py`): workers
forked after the script's imports, in torchrun's environment; the first failure ends the
others and is the job's status."""
import json
import re
import subprocess
import sys
import textwrap
import time

from dynatrain_megatron.testing.forked_launch import script_imports

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
    if sys.argv[2] == "fail":
        import time
        time.sleep(120)  # ended by the launcher when rank 1 fails
''')


def _launch(tmp_path, mode, nproc):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "dynatrain_megatron.testing.forked_launch",
                           "--nproc-per-node", str(nproc), str(script), str(tmp_path), mode],
                          capture_output=True, text=True, timeout=300)
    return proc, time.monotonic() - t0


def test_workers_get_torchruns_environment_after_the_scripts_imports(tmp_path):
    proc, _ = _launch(tmp_path, "ok", 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(3)]
    assert [s["RANK"] for s in seen] == ["0", "1", "2"] == [s["LOCAL_RANK"] for s in seen]
    assert {(s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"], s["MASTER_ADDR"]) for s in seen} == {
        ("3", "3", "127.0.0.1")}
    assert len({s["MASTER_PORT"] for s in seen}) == 1 and len({s["pid"] for s in seen}) == 3
    assert all(s["preloaded"] and s["name"] == "__main__" for s in seen)
    assert all(s["argv"] == [str(tmp_path), "ok"] for s in seen)


def test_the_first_failure_ends_the_others_and_is_the_jobs_status(tmp_path):
    proc, seconds = _launch(tmp_path, "fail", 2)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "exited 3; ending the others" in proc.stderr
    assert seconds < 100  # rank 0 would sleep 120 s


def test_script_imports_are_its_top_level_absolute_imports(tmp_path):
    p = tmp_path / "s.py"
    p.write_text("import os, json as j\nfrom a.b import c\nfrom . import d\n"
                 "def f():\n    import never\n")
    assert script_imports(p) == ["os", "json", "a.b"]


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
