"""The tests' launcher for Megatron-LM jobs: torchrun's single-node environment, with every
worker forked from one process that imported torch and Megatron-LM once.

A tiny Megatron-LM job on the CPU spends most of its start-up importing torch,
megatron-core and Megatron-LM in each of its workers (tens of seconds of CPU each); on a
2-core machine four workers pay it four times over, and the suite starts ~40 such jobs.
Here the parent prepares the runtime the patched `pretrain_gpt.py` (or, for an unpatched
tree, the tests' `sitecustomize`) would prepare (`compat.megatron_lm.prepare_megatron_lm`),
imports the script's own top-level imports, and only then forks the workers. Each worker
gets the environment torchrun gives it (`loop.launch.worker_env`: RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT, ...) and runs the script as `__main__`; rank 0 hosts the
store, as under `dynatrain launch`. As torchrun does, the first worker to fail ends the
others and its status is the job's. Forking after the imports is safe here: no CUDA, no
thread and no process group exists yet in the parent.

    python -m dynatrain_megatron.testing.forked_launch --nproc-per-node N script.py [args]

With `--survivors` it watches the workers as `dynatrain launch` does (`loop.launch.supervise`:
a worker that dies ends none of the others, the status is the job's completion, each exit
is logged as `[launch] worker R exited with S after T s`): the tests' rank-death jobs get the
same supervision without starting an interpreter per rank.

Not for GPUs (a CUDA context must not cross a fork) and not a user-facing launcher:
`torchrun` and `dynatrain launch` are those. The README's own commands still run torchrun.
"""
from __future__ import annotations

import argparse
import ast
import atexit
import ctypes
import gc
import importlib
import importlib.util
import os
import runpy
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from ..loop.launch import reserved_port, worker_env


def script_imports(script: Path) -> list[str]:
    """The modules `script` imports at its top level, in order (its `import x` and
    `from x import y` statements outside functions; relative imports left out)."""
    tree = ast.parse(script.read_text(), filename=str(script))
    out: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append(node.module)
    return out


def preload(script: Path, args: Sequence[str] = ()) -> None:
    """Import in this process what every worker of `script` imports first (after the
    Megatron-LM runtime, where Megatron-LM is importable), then what its workers import
    later (`LATER_IMPORTS`; TorchInductor's entry for a job with experts, whose router
    functions are compiled at their first call), and move it all out of the garbage
    collector's generations (`gc.freeze`, kept across `fork`): the workers' collections
    then scan what they made, not the ~400k objects every worker starts with."""
    sys.path.insert(0, str(script.parent))  # as `python script.py` would have it
    later: list[str] = []
    if importlib.util.find_spec("megatron") and importlib.util.find_spec("megatron.training"):
        from ..compat.megatron_lm import prepare_megatron_lm

        prepare_megatron_lm()
        later = list(LATER_IMPORTS)  # a Megatron-LM job's (another script: only its own)
        if "--num-experts" in args:
            later.append("torch._inductor.compile_fx")
    for name in script_imports(script) + later:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the worker imports it again and says why
            pass
    _share_argument_docstrings()
    gc.collect()
    gc.freeze()


# modules every worker imports later, inside functions: torch's dynamo (its optimizers'
# first step), Megatron-LM's text tokenizers, and the plugin's seam into a patched tree
LATER_IMPORTS = (
    "torch._dynamo", "megatron.core.tokenizers.text",
    "dynatrain_megatron.megatron_lm.adapter", "dynatrain_megatron.megatron_lm.seam",
    "dynatrain_megatron.megatron_lm.rank_death", "dynatrain_megatron.megatron_lm.builder",
    "dynatrain_megatron.megatron_lm.data_ahead", "dynatrain_megatron.loop.hook",
)


def _share_argument_docstrings() -> None:
    """Megatron-LM's argument parser reads the help text of each config dataclass from its
    module's source (`ArgumentGroupFactory._get_field_docstrings`: `inspect.getsource` and
    `ast.parse` of the whole module, per class, per parse): seconds of CPU per worker.
    Here it is computed once, by building the parser in this process, and kept per class,
    so the forked workers read the same text from memory. The parser is unchanged."""
    try:
        from megatron.training import argument_utils, arguments
    except Exception:  # noqa: BLE001 - not a Megatron-LM tree: nothing to share
        return
    factory = getattr(argument_utils, "ArgumentGroupFactory", None)
    original = getattr(factory, "_get_field_docstrings", None)
    if original is None or getattr(original, "_shared", False):
        return
    cache: dict[type, dict[str, str]] = {}

    def field_docstrings(self, src_cfg_class: type) -> dict[str, str]:
        if src_cfg_class not in cache:
            cache[src_cfg_class] = original(self, src_cfg_class)
        return dict(cache[src_cfg_class])

    field_docstrings._shared = True  # type: ignore[attr-defined]
    factory._get_field_docstrings = field_docstrings
    try:
        arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    except Exception:  # noqa: BLE001 - the workers build it themselves and say why
        pass


def _die_with_parent() -> None:
    """Linux: this worker is killed when the launcher dies (a test's timeout kills it)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker(env: dict, script: Path, args: Sequence[str]) -> None:
    """In the forked child: become the worker of environment `env` (torchrun's, its rank's)
    and run the script; never returns."""
    _die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [str(script), *args]
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as a worker's interpreter would
        sys.excepthook(*sys.exc_info())  # (a hook the script installed included)
        code = 1
    try:
        atexit._run_exitfuncs()  # what a worker's own interpreter would run at its exit
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(nproc: int, script: Path, args: Sequence[str], grace_s: float = 10.0) -> int:
    """Fork `nproc` workers of `script` after preloading it; wait for them. Returns 0 when
    all exited 0, else the first failure's status (the others are ended)."""
    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {nproc}")
    preload(script, args)
    return launch_preloaded(nproc, script, args, grace_s=grace_s)


def launch_preloaded(nproc: int, script: Path, args: Sequence[str],
                     watch: Optional[socket.socket] = None, grace_s: float = 10.0) -> int:
    """`run` in a process that has preloaded `script` already (`run` itself, or
    `launch_server`'s launcher); with `watch` (a job's client), the workers are killed, and
    this process ends, when it closes."""
    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {nproc}")
    with reserved_port() as port:  # held until the workers ended (`loop.launch`)
        return _fork_and_wait(nproc, port, script, args, grace_s, watch)


def _watch_client(conn: socket.socket, pids: dict[int, int]) -> None:
    """Until the client's socket closes (it was killed): then end the job at once."""
    try:
        while conn.recv(64):
            pass
    except OSError:
        pass
    for p in list(pids):
        _kill(p, signal.SIGKILL)
    os._exit(137)


def _fork_and_wait(nproc: int, port: int, script: Path, args: Sequence[str],
                   grace_s: float, watch: Optional[socket.socket] = None) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _worker(worker_env(dict(os.environ), rank, nproc, port), script, args)
        pids[pid] = rank
    if watch is not None:  # started after the forks: no worker inherits the thread
        threading.Thread(target=_watch_client, args=(watch, dict(pids)), daemon=True).start()

    def forward(signum, _frame):
        for p in pids:
            _kill(p, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status = 0
    while pids:
        pid, raw = os.wait()
        if pid not in pids:
            continue
        del pids[pid]
        code = os.waitstatus_to_exitcode(raw)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code  # killed by a signal: 128 + signum
            print(f"forked_launch: worker {pid} exited {code}; ending the others",
                  file=sys.stderr, flush=True)
            _end(pids, grace_s)
    return status


class _Forked:
    """A forked worker as `loop.launch.supervise` watches it (Popen's poll/send_signal)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.code: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.code is None:
            pid, raw = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.code = os.waitstatus_to_exitcode(raw)
        return self.code

    def send_signal(self, signum: int) -> None:
        _kill(self.pid, signum)


def run_survivors(nproc: int, script: Path, args: Sequence[str]) -> int:
    """Fork `nproc` workers of `script` after preloading it and supervise them as
    `dynatrain launch` does (module doc); the job's status."""
    import logging

    from ..loop.launch import supervise

    logging.basicConfig(level=logging.INFO, format="[launch] %(message)s", stream=sys.stderr)
    log = logging.getLogger("dynatrain.launch")
    preload(script, args)

    def start(_rank: int, env: dict, _report_fd: int) -> _Forked:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for handler in logging.root.handlers[:]:  # the launcher's, not the worker's
                logging.root.removeHandler(handler)
            _worker(env, script, args)
        return _Forked(pid)

    status, exits = supervise(nproc, start)
    for e in exits:
        log.info("worker %d exited with %d after %.1f s", e.rank, e.code, e.seconds)
    return status


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _end(pids: dict[int, int], grace_s: float) -> None:
    """SIGTERM every live worker, SIGKILL what is left after `grace_s` (as torchrun)."""
    for p in pids:
        _kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            pids.pop(pid, None)
        else:
            time.sleep(0.1)
    for p in pids:
        _kill(p, signal.SIGKILL)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dynatrain_megatron.testing.forked_launch",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", type=int, required=True, metavar="N",
                   help="workers (ranks) to fork on this machine")
    p.add_argument("--survivors", action="store_true",
                   help="a worker's failure ends none of the others (as `dynatrain launch`)")
    p.add_argument("script", type=Path, help="the training script (pretrain_gpt.py)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    a = p.parse_args(argv)
    if a.survivors:
        return run_survivors(a.nproc_per_node, a.script.resolve(), a.args)
    return run(a.nproc_per_node, a.script.resolve(), a.args)


if __name__ == "__main__":
    sys.exit(main())
