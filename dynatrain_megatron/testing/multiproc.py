"""Run a function on N spawned torch.distributed ranks (gloo on CPU) and collect results.

Used by the tests and by `dynatrain bench-switch`. Ranks are forked from a fork server
that imported torch and megatron-core once per calling process, so a group does not pay
a fresh interpreter's imports per rank. Callers still run many cases inside one group:
each group pays its process-group setup and the first-use costs of megatron. A failing
rank's traceback is re-raised in the parent (the first failure wins), and a timeout names
the ranks that never reported and carries the stacks of all their threads (`faulthandler`,
written to a private file per rank on a signal): a hang in CI says where.
"""
from __future__ import annotations

import faulthandler
import os
import queue
import shutil
import signal
import tempfile
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import torch.multiprocessing as mp

from ..loop.launch import reserved_port


def _by_value(result: Any) -> bytes:
    """A rank's result as bytes. Tensors put on a torch.multiprocessing queue travel as
    shared-memory descriptors that the sending process must still serve when the parent
    unpickles them; a rank that has exited by then (it returns, then leaves) makes the
    parent fail with a connection reset. Bytes carry the values themselves."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(result, buf)
    return buf.getvalue()


def _from_value(data: bytes) -> Any:
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


class RankFailure(RuntimeError):
    """A spawned rank raised, died, or timed out."""


def _child(rank: int, world: int, port: int, fn: Callable, args: Sequence[Any],
           q, env: dict[str, str], cwd: str, stacks: str) -> None:
    # a rank forked from the fork server would otherwise see the server's environment and
    # directory (those of the first call), not the caller's at this call
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import warnings

    warnings.simplefilter("ignore")  # megatron warns per rank about apex/TE/CUDA tuning
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # `_dump_stacks`: the file stays open for the process's life (faulthandler writes to
    # its descriptor from the signal handler)
    # (a new file in the runner's private directory: no link followed, none replaced)
    _STACKS.append(os.open(stacks, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    faulthandler.register(_DUMP_SIGNAL, file=_STACKS[-1], all_threads=True)
    try:
        from ..mcore.session import init_distributed

        init_distributed(timeout_s=float(env.get("DYNATRAIN_PG_TIMEOUT", "300")))
        result = fn(*args)
        q.put((rank, "ok", _by_value(result)))
    except BaseException:  # noqa: BLE001 - surfaced to the parent verbatim
        q.put((rank, "error", traceback.format_exc()))
        q.close()
        q.join_thread()  # flush the traceback before the hard exit
        os._exit(1)  # do not hang in collectives other ranks will never join
    try:
        dist.destroy_process_group()
    except Exception:
        pass


_DUMP_SIGNAL = signal.SIGUSR1
_STACKS: list = []  # a rank's open stack file (its descriptor)


def _dump_stacks(procs, ranks: Sequence[int], files: Sequence[str]) -> str:
    """Ask each of `ranks` still alive to write every thread's stack (faulthandler) to its
    file, give them a moment, and return what they wrote."""
    alive = [r for r in ranks if procs[r].is_alive() and procs[r].pid is not None]
    for r in alive:
        try:
            os.kill(procs[r].pid, _DUMP_SIGNAL)
        except OSError:
            pass
    if alive:
        time.sleep(2.0)
    out = []
    for r in alive:
        try:
            fd = os.open(files[r], os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
                out.append(f"--- rank {r}:\n{f.read()[-6000:]}")
        except OSError as e:
            out.append(f"--- rank {r}: no stacks ({e})")
    return "\n".join(out)


# imported once by the fork server, so that every rank forked from it starts with them:
# besides megatron-core, what ranks import later inside functions (torch's dynamo at an
# optimizer's construction, TorchInductor's entry at the first call of a compiled MoE router
# function, `compat.cpu.defer_torch_compile`), then the objects frozen (`preload_done`)
PRELOAD = ("dynatrain_megatron.testing.preload", "torch", "torch.distributed", "megatron.core",
           "megatron.core.models.gpt",
           "megatron.core.optimizer", "megatron.core.distributed",
           "megatron.core.pipeline_parallel", "megatron.core.dist_checkpointing",
           "megatron.core.optimizer_param_scheduler", "dynatrain_megatron.mcore.builders",
           "dynatrain_megatron.mcore.session", "torch._dynamo", "torch._inductor.compile_fx",
           "dynatrain_megatron.testing.preload_done")


def _context():
    """`forkserver` (default): ranks are forked from one server process that imported
    torch and megatron-core once (`PRELOAD`), instead of each spawned rank importing them
    again (seconds of CPU per rank, which dominate a short test on few cores). The server
    runs nothing but imports, so forking it is safe (no threads, no CUDA context).
    `DYNATRAIN_START_METHOD=spawn` restores one fresh interpreter per rank."""
    method = os.environ.get("DYNATRAIN_START_METHOD", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        from multiprocessing import forkserver

        ctx.set_forkserver_preload(list(PRELOAD))
        # started here (once per process; a no-op after) with megatron's import-time
        # warnings about apex / Transformer Engine silenced, as they are in each rank
        saved = os.environ.get("PYTHONWARNINGS")
        os.environ["PYTHONWARNINGS"] = "ignore"
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                os.environ.pop("PYTHONWARNINGS")
            else:
                os.environ["PYTHONWARNINGS"] = saved
    return ctx


def run_on_ranks(fn: Callable, nproc: int, *args: Any, timeout: float = 600.0,
                 env: Optional[dict[str, str]] = None) -> list[Any]:
    """Run `fn(*args)` on `nproc` gloo ranks; return the per-rank results in rank order.
    The store's port is held here until the ranks ended (`reserved_port`)."""
    with reserved_port() as port:
        return _run_on_ranks(fn, nproc, args, timeout, env, port)


def _run_on_ranks(fn: Callable, nproc: int, args: Sequence[Any], timeout: float,
                  env: Optional[dict[str, str]], port: int) -> list[Any]:
    from .. import process_env

    process_env.apply()  # spawned children inherit it before they import torch
    ctx = _context()
    q = ctx.Queue()
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    stacks_dir = tempfile.mkdtemp(prefix="dynatrain-stacks-")  # private (0700), ours
    files = [os.path.join(stacks_dir, f"rank{r}") for r in range(nproc)]
    procs = [ctx.Process(target=_child, args=(r, nproc, port, fn, args, q, child_env, os.getcwd(),
                                              files[r]), daemon=False)
             for r in range(nproc)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failure: Optional[str] = None
    deadline = time.monotonic() + timeout
    try:
        while len(results) < nproc and failure is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(nproc)) - set(results))
                failure = (f"timeout after {timeout:.0f}s; ranks {missing} did not finish; "
                           f"their stacks:\n{_dump_stacks(procs, missing, files)}")
                break
            try:
                rank, status, payload = q.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and p.exitcode not in (0, None) and r not in results]
                # a rank that ended with exit code 0 and no result left on purpose (a test
                # of rank death ends a process abruptly with os._exit(0)): its result is None
                quit_ = [r for r, p in enumerate(procs)
                         if not p.is_alive() and p.exitcode == 0 and r not in results]
                if dead or quit_:
                    # give an ending rank a moment to deliver its traceback or result
                    try:
                        rank, status, payload = q.get(timeout=2.0)
                    except queue.Empty:
                        if dead:
                            failure = f"ranks {dead} died (exit codes " \
                                      f"{[procs[r].exitcode for r in dead]}) without a traceback"
                            break
                        for r in quit_:
                            results[r] = None
                        continue
                else:
                    continue
            if status == "ok":
                results[rank] = _from_value(payload)
            else:
                failure = f"rank {rank} failed:\n{payload}"
    finally:
        for p in procs:
            if failure is not None and p.is_alive():
                p.kill()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(stacks_dir, ignore_errors=True)
    if failure is not None:
        raise RankFailure(failure)
    return [results[r] for r in range(nproc)]
