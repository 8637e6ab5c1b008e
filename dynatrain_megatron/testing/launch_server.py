"""A preloaded launcher kept for a test session: `forked_launch` without its start-up per job.

`forked_launch` imports torch, megatron-core and Megatron-LM once per job, then forks the
workers; that import is single-threaded (one core of two idle) and the suite runs ~50 jobs.
Here the first job of a given script, environment and kind starts a server that does the
import once and stays; each job is then a light client that hands the server its argv,
directory, environment and standard streams (passed as file descriptors over a unix
socket). The server forks a launcher per job, which forks the job's workers exactly as
`forked_launch` does and reports their status back; the client exits with it.

A server is reused only by a job with the same script, the same environment (every
variable: anything read at import time is the same) and the same preload (with or without
the MoE compiler entry); any other job gets its own. The client forwards SIGTERM/SIGINT to
its launcher; if the client itself is killed, the launcher notices the closed socket and
kills its workers. A server ends with the process that owns the session (its pid is given),
or five minutes after its last job began.

    python -m dynatrain_megatron.testing.launch_server --server-dir D --owner-pid P \\
        --nproc-per-node N script.py [args]

Test-only, CPU-only (nothing CUDA may cross a fork), as `forked_launch`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

IDLE_S = 300.0  # a server ends this long after its last job began
_VOLATILE = ("PYTEST_CURRENT_TEST",)  # differs per test, read by no import


def server_key(script: Path, env: dict[str, str], moe: bool) -> str:
    """Which server may run a job: the script, its whole environment, and the preload."""
    fixed = {k: v for k, v in env.items() if k not in _VOLATILE}
    text = json.dumps([str(script), sys.executable, sorted(fixed.items()), moe])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def server_pids(server_dir: Path) -> set[int]:
    """The pids of the servers started under `server_dir` (their command lines name the
    script they preloaded, as their jobs' processes do: a search for a job's leftover
    processes leaves these out)."""
    out = set()
    for f in Path(server_dir).glob("*.pid"):
        try:
            out.add(int(f.read_text()))
        except (OSError, ValueError):
            pass
    return out


def _recv_line(conn: socket.socket) -> Optional[str]:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            return None
        buf += chunk
    return buf.decode()


# ------------------------------------------------------------------------------ the server
def serve(sock_path: Path, script: Path, moe: bool, owner: int) -> None:
    """Preload, then fork a launcher per connection until `owner` is gone or idle."""
    from .forked_launch import preload

    preload(script, ["--num-experts"] if moe else [])
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # launchers are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = sock_path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    listener.bind(str(tmp))
    listener.listen(8)
    sock_path.with_suffix(".pid").write_text(str(os.getpid()))  # `server_pids`
    os.replace(tmp, sock_path)  # clients connect only once the preload is done
    mine = os.stat(sock_path).st_ino
    last, jobs = time.monotonic(), 0
    try:
        while _alive(owner) and time.monotonic() - last < IDLE_S:
            ready, _, _ = select.select([listener], [], [], 1.0)
            if not ready:
                continue
            conn, _ = listener.accept()
            last = time.monotonic()
            jobs += 1
            print(f"launch_server: job {jobs}", file=sys.stderr, flush=True)
            _accept(listener, conn, script)
    finally:
        listener.close()
        try:
            if os.stat(sock_path).st_ino == mine:  # not a successor's
                sock_path.unlink()
        except FileNotFoundError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _accept(listener: socket.socket, conn: socket.socket, script: Path) -> None:
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while msg and not msg.endswith(b"\n"):  # the rest of a long request
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        msg += chunk
    if len(fds) != 3 or not msg.endswith(b"\n"):
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    listener.close()
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        req = json.loads(msg.decode())
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
        from .forked_launch import launch_preloaded

        code = launch_preloaded(int(req["nproc"]), script, req["args"], watch=conn)
    except BaseException:  # noqa: BLE001 - reported on the job's own stderr
        import traceback

        traceback.print_exc()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        conn.sendall(json.dumps({"code": code}).encode() + b"\n")
    finally:
        os._exit(code)


# ------------------------------------------------------------------------------ the client
def _start_server(server_dir: Path, key: str, script: Path, moe: bool, owner: int) -> Path:
    sock_path = server_dir / f"{key}.sock"
    server_dir.mkdir(parents=True, exist_ok=True)
    sock_path.unlink(missing_ok=True)
    with open(server_dir / f"{key}.log", "ab") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "dynatrain_megatron.testing.launch_server", "--serve",
             str(sock_path), "--owner-pid", str(owner), *(["--moe"] if moe else []),
             str(script)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 600
    while not sock_path.exists():
        if server.poll() is not None:  # it failed in its preload: say so now, not in 600 s
            raise RuntimeError(f"launch server for {script} exited {server.returncode} "
                               f"before it listened; see {log.name}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"launch server {sock_path} did not start: {log.name}")
        time.sleep(0.05)
    return sock_path


def _submit(sock_path: Path, req: bytes) -> Optional[tuple[socket.socket, int]]:
    """Hand the job to the server at `sock_path`: (connection, launcher pid), or None when
    no server answers there (gone, or ending as it was reached)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(sock_path))
        socket.send_fds(conn, [req], [0, 1, 2])
        first = _recv_line(conn)
    except OSError:
        first = None
    if first is None:
        conn.close()
        return None
    return conn, int(json.loads(first)["pid"])


def run_client(server_dir: Path, owner: int, nproc: int, script: Path,
               args: Sequence[str]) -> int:
    """Run one job through the session's server for it (started if there is none); its
    exit status."""
    moe = "--num-experts" in args
    key = server_key(script, dict(os.environ), moe)
    req = json.dumps({"nproc": nproc, "args": list(args), "cwd": os.getcwd(),
                      "env": dict(os.environ)}).encode() + b"\n"
    sock_path = server_dir / f"{key}.sock"
    got = _submit(sock_path, req) if sock_path.exists() else None
    if got is None:
        got = _submit(_start_server(server_dir, key, script, moe, owner), req)
    if got is None:
        print(f"launch_server: no server answers at {sock_path}", file=sys.stderr)
        return 1
    conn, launcher = got

    def forward(signum, _frame):
        try:
            os.kill(launcher, signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    last = _recv_line(conn)
    if last is None:
        print("launch_server: the job's launcher ended without a status", file=sys.stderr)
        return 1
    return int(json.loads(last)["code"])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dynatrain_megatron.testing.launch_server")
    p.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--moe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--server-dir", type=Path)
    p.add_argument("--owner-pid", type=int, required=True)
    p.add_argument("--nproc-per-node", type=int)
    p.add_argument("script", type=Path)
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.serve is not None:
        serve(a.serve, a.script, a.moe, a.owner_pid)
        return 0
    if a.server_dir is None or a.nproc_per_node is None:
        p.error("--server-dir and --nproc-per-node are required")
    return run_client(a.server_dir, a.owner_pid, a.nproc_per_node, a.script.resolve(), a.args)


if __name__ == "__main__":
    sys.exit(main())
