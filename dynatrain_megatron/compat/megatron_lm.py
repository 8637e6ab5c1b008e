"""Megatron-LM (`megatron.training`) on a machine without CUDA, and its start-up checks.

The patched `pretrain_gpt.py` calls `prepare_megatron_lm()` in its first lines, before any
megatron import. Doing it there, rather than in a wrapper that runs the script, matters:
Megatron-LM's `--save` on the CPU starts worker processes (multiprocessing spawn) that
import the main script again, and they need the same runtime.

On every machine it checks that the `megatron-lm` extra is installed (Megatron-LM imports
`six`, `regex`, `pydantic` beyond megatron-core) and applies megatron-core's fixes
(`compat.megatron_fixes`, which Megatron-LM's own `--load` of a reshardable checkpoint needs
as much as we do). Without a CUDA device it also makes Megatron-LM's CUDA assumptions hold:

1. megatron-core's CPU runtime (`compat.cpu`: cuda devices rewritten to cpu, no-op streams).
2. megatron-core modules that import `triton` unguarded at their top level (about 1 GB on
   PyPI, useless without a GPU): `batch_invariant_kernels` (0.16.1, through Megatron-LM's
   `initialize`), `moe/ops/paged_stash.py` (0.18+, through `import megatron.core`). When
   triton is not importable, each such module of the megatron-core about to be imported
   is replaced by a stand-in whose functions refuse with a clear error
   (`compat.cpu.triton_stand_ins`: keyed by what the source does, not by a version).
   triton itself is not faked, so nothing else believes it is present.
3. `initialize_megatron` asserts CUDA: it is called with `allow_no_cuda=True`.
4. `_initialize_distributed` creates the model-parallel groups and `_set_random_seed` seeds
   the model-parallel RNG tracker only when `torch.cuda.device_count() > 0`: both run as if
   one device were present (`set_device` is a no-op; the tracker uses CPU generators).
   `validate_args` reads the device architecture: 0 (no device).
5. `_compile_dependencies` runs `make` for the dataset helpers and `nvcc` for fused
   kernels: the helpers come compiled in the megatron-core wheel (checked), the fused
   kernels are CUDA only, so it only checks the helpers import.
6. `_warmup_jit_function` compiles fused kernels on "cuda" tensors with torch.compile:
   skipped (the CPU launch uses the `--no-*-fusion` flags, which don't call them); the
   stand-in takes exactly the arguments the release's own takes (0.19 added `tp_size=`).
7. Memory reports read `torch.cuda` counters that `compat.cpu` does not stub: zeros.
8. `torch.compile` of a function compiles at its first call without importing TorchInductor
   when megatron decorates its fusions at import (`compat.cpu.defer_torch_compile`).
9. `dist_checkpointing`'s writer starts its results queue's manager by spawn (a fresh
   interpreter importing the script and megatron, per rank, at the first save): forked
   instead (`_fork_checkpoint_results_queue`); the files written are the same.

On a GPU only the extra check and megatron-core's fixes apply: Megatron-LM runs as is.

On every machine, before any megatron import: `typing.override` on Python 3.11 (megatron-core
0.17+ declares Python 3.12 and imports it), and the checkout check (`check_checkout`):
`megatron.core` must be the one the checkout's release runs with (its own `megatron/core`
where it has one, e.g. core_v0.19.0; a megatron-core of the release's version where it has
none, e.g. the core_v0.16.1 export): a wheel shadowing the checkout is named here, at
start-up, rather than failing somewhere in the training loop.

`release_refusals(args)` lists the options of newer releases a switch cannot carry (keyed
by whether the option exists in `args`): the patched `pretrain()` refuses them at start-up.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from ..vps.errors import DynatrainError

log = logging.getLogger("dynatrain")

# what Megatron-LM imports beyond megatron-core and this package (setup.py: extra "megatron-lm")
EXTRA_MODULES = ("six", "regex", "pydantic", "einops", "psutil")
_state = {"prepared": False, "cpu": False}


class MissingExtraError(DynatrainError):
    """Megatron-LM's extra dependencies are not installed."""


def missing_extra_modules() -> list[str]:
    """The modules of the `megatron-lm` extra that cannot be imported here."""
    return [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]


def check_extra() -> None:
    missing = missing_extra_modules()
    if missing:
        raise MissingExtraError(
            f"Megatron-LM needs modules that are not installed: {', '.join(missing)}; install "
            f"them with: pip install 'dynatrain_megatron[megatron-lm]' (or pip install "
            f"{' '.join(missing)})")


@contextlib.contextmanager
def _one_device() -> Iterator[None]:
    """`torch.cuda.device_count()` answers 1 inside (item 4)."""
    saved = torch.cuda.device_count
    torch.cuda.device_count = lambda: 1
    try:
        yield
    finally:
        torch.cuda.device_count = saved


def _as_if_one_device(fn: Callable) -> Callable:
    def wrapped(*a: Any, **k: Any) -> Any:
        with _one_device():
            return fn(*a, **k)

    wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapped


def _check_dataset_helpers() -> None:
    """Item 5: the compiled dataset helpers of the megatron-core wheel must import."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError as e:
        raise DynatrainError(f"megatron-core's compiled dataset helpers do not import ({e}); "
                             f"on the CPU they come from the megatron-core wheel") from e


def _skipped_like(fn: Callable) -> Callable:
    """A no-op that accepts exactly the arguments `fn` accepts (its signature differs
    between releases: 0.19 added `tp_size=`), so a call the release would refuse fails."""
    sig = inspect.signature(fn)

    def skipped(*a: Any, **k: Any) -> None:
        sig.bind(*a, **k)

    skipped.__wrapped__ = fn  # type: ignore[attr-defined]
    return skipped


def _patch_megatron_training() -> None:
    init = importlib.import_module("megatron.training.initialize")
    training = importlib.import_module("megatron.training.training")
    original_init = init.initialize_megatron

    def initialize_megatron(*a: Any, **k: Any) -> Any:
        k["allow_no_cuda"] = True
        return original_init(*a, **k)

    initialize_megatron.__wrapped__ = original_init  # type: ignore[attr-defined]
    for module in (init, training, importlib.import_module("megatron.training")):
        if getattr(module, "initialize_megatron", None) is original_init:
            module.initialize_megatron = initialize_megatron
    init._initialize_distributed = _as_if_one_device(init._initialize_distributed)
    init._set_random_seed = _as_if_one_device(init._set_random_seed)
    init._compile_dependencies = _check_dataset_helpers
    init._warmup_jit_function = _skipped_like(init._warmup_jit_function)
    for name in ("megatron.training.arguments", "megatron.training.utils"):
        module = importlib.import_module(name)
        if hasattr(module, "get_device_arch_version"):
            module.get_device_arch_version = lambda: 0  # item 4b: no device, no architecture
    _fork_checkpoint_results_queue()
    c = torch.cuda
    zero = lambda *a, **k: 0  # noqa: E731
    c.max_memory_reserved = zero
    c.device_memory_used = zero
    c.memory_stats = lambda *a, **k: {}


def _fork_checkpoint_results_queue() -> None:
    """`dist_checkpointing`'s file writer collects its results through a queue served by a
    `multiprocessing.Manager` that it starts with the *spawn* method, for CUDA's sake: a
    fresh interpreter that imports the job's script, torch and megatron again, on every
    rank at its first save (about 10 s of CPU each, most of a small job's save). Without a
    CUDA device there is nothing a fork could break, so on the CPU the manager is forked.
    Same queue, same results, same files; keyed by the function's name in each release
    (0.16: `_get_write_results_queue()`, 0.19: `get_write_results_queue(mp_mode)`)."""
    try:
        fs = importlib.import_module(
            "megatron.core.dist_checkpointing.strategies.filesystem_async")
    except ImportError:  # no such writer in this release: nothing to do
        return
    for name in ("_get_write_results_queue", "get_write_results_queue"):
        original = getattr(fs, name, None)
        if original is None or not hasattr(fs, "_results_queue"):
            continue

        def results_queue(*a: Any, _original: Callable = original, **k: Any) -> Any:
            if fs._results_queue is None:
                m = forked_manager()
                if m is None:  # its forks never started: the release's own (spawned)
                    return _original(*a, **k)
                fs._results_queue = m.Queue()
            return fs._results_queue

        results_queue.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(fs, name, results_queue)


_managers: list = []  # the forked managers, alive for the job (their queues' server)


def forked_manager(attempts: int = 3) -> Optional[Any]:
    """A `multiprocessing` manager forked from this process, holding none of its sockets,
    and ending with it; None when its process never started in `attempts` forks.

    A forked child inherits every descriptor, the process groups' TCP connections among
    them: were this long-lived child to keep them open after its rank died, the peers would
    never see the connection close and would learn of the death only at their collective
    timeout. Its first act (before its own listener exists) closes every inherited socket.
    A manager is shut down by its parent's exit handlers; a rank that dies without running
    them (killed, `os._exit`) would leave it running for good, so it also ends itself as
    soon as its parent is gone (`_end_with_parent`).

    It is forked beside the job's running threads (the first `--save`, mid-training), so
    it can hang before it runs (`fork_watch`), and `start` would wait for its address
    forever: it starts in a thread of its own under a `fork_watch.StartWatch`, and a
    process that never reports its start is killed and forked again."""
    import multiprocessing
    import os
    import signal
    import threading
    from multiprocessing.managers import SyncManager

    from ..fork_watch import START_TIMEOUT_S, StartWatch

    for attempt in range(1, attempts + 1):
        m = SyncManager(ctx=multiprocessing.get_context("fork"))
        failed: list = []
        parent = os.getpid()

        def start(m: Any = m, failed: list = failed) -> None:
            try:
                m.start(initializer=_start_manager, initargs=(parent,))
            except BaseException as e:  # noqa: BLE001 - raised by the caller
                failed.append(e)

        with StartWatch() as watch:
            t = threading.Thread(target=start, name="dynatrain-manager-start", daemon=True)
            t.start()
            pid = _forked_pid(m, t, START_TIMEOUT_S)
            stuck = watch.not_started([pid], START_TIMEOUT_S) if pid is not None else set()
        if stuck:  # its parent's wait for the address ends (EOF) when it is killed
            os.kill(pid, signal.SIGKILL)
            t.join()
            m._process.join(1.0)
            log.warning("the checkpoint writer's results-queue manager (pid %d) never "
                        "started (a fork beside running threads): killed, %s", pid,
                        "forked again" if attempt < attempts else "given up")
            continue
        t.join()
        if failed:
            raise failed[0]
        _managers.append(m)
        return m
    return None


def _forked_pid(m: Any, starting: Any, timeout: float) -> Optional[int]:
    """The pid of manager `m`'s process once forked by the thread `starting`, None if
    that thread ended without one (it failed) or none came within `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process = getattr(m, "_process", None)
        if process is not None and process.pid is not None:
            return process.pid
        if not starting.is_alive():
            return None
        time.sleep(0.001)
    return None


def _start_manager(parent: int) -> None:
    """A forked manager's first act (`forked_manager`)."""
    _close_inherited_sockets()
    _end_with_parent(parent)


PARENT_POLL_SECONDS = 0.5  # how soon a forked helper notices its parent is gone


def _end_with_parent(parent: int) -> None:
    """In a forked child: end this process once `parent` is no longer its parent (it
    died, however; the child was handed to another process). A thread polling
    `os.getppid()`, portable, where Linux's parent-death signal would follow the thread that
    forked rather than the process (a manager started from a thread that ends would go too)."""
    import os
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(0)

    if os.getppid() != parent:
        os._exit(0)
    threading.Thread(target=watch, name="dynatrain-parent-watch", daemon=True).start()


def _close_inherited_sockets() -> None:
    """In a forked child: close every socket descriptor inherited from the parent (Linux:
    /proc/self/fd; elsewhere nothing is closed)."""
    import os
    import stat

    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)
        except OSError:  # the directory's own descriptor, already gone
            pass


_printer: dict[str, Optional[int]] = {"rank": None}  # see `set_last_rank`


def set_last_rank(rank: Optional[int]) -> None:
    """The process whose `print_rank_last` lines Megatron-LM prints: `rank` (a global
    rank), or Megatron-LM's own rule (the world's last rank) with None.

    Megatron-LM prints its iteration line (the loss among it) on the world's last rank,
    which it takes to hold the last pipeline stage, the one that has the loss. That holds at
    its default rank order, not at every placement a switch may choose: after a switch the
    printing rank is the device that holds the layout's last virtual rank (on the last
    stage, as at the default order), so the line keeps its loss."""
    if rank is not None and (type(rank) is not int or rank < 0):
        raise ValueError(f"the printing rank must be a non-negative int, got {rank!r}")
    _printer["rank"] = rank


def _patch_last_rank() -> None:
    """`megatron.training.utils.is_last_rank`, which `print_rank_last` calls, follows
    `set_last_rank` (every machine: a placement is not a CPU matter)."""
    utils = importlib.import_module("megatron.training.utils")
    printer = getattr(utils, "print_rank_last", None)
    # where print_rank_last looks the name up: the module itself (0.16) or, once utils became
    # a package (0.19), the submodule that defines both
    home = importlib.import_module(printer.__module__) if printer is not None else utils
    original = getattr(home, "is_last_rank", None)
    if original is None or getattr(original, "__wrapped__", None) is not None:
        return

    def is_last_rank() -> bool:
        rank = _printer["rank"]
        if rank is None:
            return original()
        return torch.distributed.get_rank() == rank

    is_last_rank.__wrapped__ = original  # type: ignore[attr-defined]
    home.is_last_rank = is_last_rank
    if getattr(utils, "is_last_rank", None) is original:
        utils.is_last_rank = is_last_rank


def prepare_megatron_lm() -> bool:
    """Make Megatron-LM importable and runnable here (see the module docstring); idempotent.
    Returns True when the CPU runtime is active."""
    if _state["prepared"]:
        return _state["cpu"]
    check_extra()
    from . import cpu as cpu_runtime, prepare_runtime

    if cpu_runtime.typing_override():
        log.info("typing.override added (Python < 3.12)")
    cpu_runtime.defer_torch_compile()  # before megatron decorates its fusions (compat.cpu)
    check_checkout()
    for name in cpu_runtime.triton_stand_ins():
        log.info("triton is not installed: %s is a stand-in", name)
    cpu = prepare_runtime()
    _patch_last_rank()
    if cpu:
        _patch_megatron_training()
        log.info("Megatron-LM CPU runtime applied (no CUDA device)")
    _state.update(prepared=True, cpu=cpu)
    return cpu


# ---------------------------------------------------------------- the checkout and its core
class CheckoutMismatchError(DynatrainError):
    """The `megatron.core` Python would import is not the one the checkout runs with."""


def _megatron_dirs() -> tuple[Optional[Path], Optional[Path]]:
    """(the `megatron` directory `megatron.training` comes from, the one `megatron.core`
    comes from), as the import system will choose them, without importing either."""
    spec = importlib.util.find_spec("megatron")
    locs = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    training = next((p for p in locs if (p / "training" / "__init__.py").is_file()), None)
    core = next((p for p in locs if (p / "core" / "__init__.py").is_file()), None)
    return training, core


def check_checkout() -> None:
    """Raise naming both when the `megatron.core` about to be imported is not the
    checkout's: the checkout has its own `megatron/core` and another comes first (a
    megatron-core wheel shadowing it), or it has none and the one found is not of the
    version its release runs with (`patch_tool.Release.core_version`). Reads files only."""
    from ..megatron_lm.patch_tool import MegatronLMVersionError, core_version_of, identify

    training, core = _megatron_dirs()
    if training is None:  # megatron-core alone (our own jobs): nothing to compare with
        return
    if core is None:
        raise CheckoutMismatchError(f"no megatron.core to import beside the checkout's "
                                    f"megatron.training ({training}): install megatron-core "
                                    f"or use a checkout that has megatron/core")
    checkout = training.parent
    if (training / "core").is_dir() and core != training:
        raise CheckoutMismatchError(
            f"megatron.core would be imported from {core / 'core'}, not from the checkout "
            f"{checkout}'s own megatron/core (megatron-core {core_version_of(checkout)}): "
            f"put the checkout first on PYTHONPATH or uninstall that megatron-core "
            f"(megatron-core {core_version_of(core.parent)})")
    try:
        release = identify(checkout).release
    except MegatronLMVersionError:
        return  # not a release of ours (an unpatched tree): nothing to hold it to
    found = core_version_of(core.parent)
    if found is None:
        found = _installed_core_version(core)
    if found != release.core_version:
        raise CheckoutMismatchError(
            f"the checkout {checkout} is Megatron-LM {release.name}, which runs with "
            f"megatron-core {release.core_version}, but megatron.core would be imported from "
            f"{core / 'core'}, megatron-core {found}: install megatron-core=="
            f"{release.core_version} or put a checkout with its own megatron/core first")


def _installed_core_version(core: Path) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return None


# ---------------------------------------------------------------- options of newer releases
# (the `args` attribute, whether `(value, args)` sets it, why a switch cannot carry it).
# Keyed by the attribute: a release that lacks the option has nothing to refuse.
_NEWER_OPTIONS: tuple[tuple[str, Callable[[Any, Any], bool], str], ...] = (
    # the shard count is TP x GTP (validate_args derives gtp_weight_remat_size from it)
    ("gtp_weight_remat_size", lambda v, a: v not in (None, 0, 1),
     "--tensor-parallel-num-weight-shards above --tensor-model-parallel-size (GTP weight "
     "shards: a parameter's shards span GTP ranks our layouts do not describe)"),
    ("expert_gtp_weight_remat_size", lambda v, a: v not in (None, 0, 1),
     "--expert-tensor-parallel-num-weight-shards above --expert-tensor-parallel-size "
     "(expert GTP weight shards)"),
    ("step_batch_size_schedule", lambda v, a: v not in (None, "", [], ()),
     "--step-batch-size-schedule (the global batch changes with the step, which a switch "
     "does not carry)"),
    ("moe_paged_stash", lambda v, a: bool(v),
     "--moe-paged-stash (its stash buffers and CUDA graph are set up for the first layout)"),
    ("moe_expert_rank_capacity_factor", lambda v, a: v is not None,
     "--moe-expert-rank-capacity-factor (the loop wraps its schedule in a PagedStashRunner "
     "holding the first layout's model and optimizer)"),
    ("optimizer_cuda_graph", lambda v, a: bool(v),
     "--optimizer-cuda-graph (the loop captures the first layout's optimizer step)"),
    # on by default in 0.19, but it acts only with the layer-wise distributed optimizer
    ("use_layer_wise_param_layout",
     lambda v, a: bool(v) and bool(getattr(a, "use_layer_wise_distributed_optimizer", False)),
     "--use-layer-wise-param-layout with --use-layer-wise-distributed-optimizer (its "
     "precomputed parameter layout is not the buffers' layout our switch reads and writes)"),
)


def derived_layout_args(args: Any, values: dict) -> dict:
    """Options a release derives from the layout, for the layout `values` describe
    (`arguments.args_for_layout`), where `args` has them: 0.19's weight-shard counts are
    TP x GTP (GTP is 1: larger is refused), so they follow a switch's TP and expert TP."""
    out = {}
    if hasattr(args, "tensor_parallel_num_weight_shards"):
        out["tensor_parallel_num_weight_shards"] = values["tensor_model_parallel_size"]
        out["gtp_weight_remat_size"] = 1
    if hasattr(args, "expert_tensor_parallel_num_weight_shards"):
        out["expert_tensor_parallel_num_weight_shards"] = values["expert_tensor_parallel_size"]
        out["expert_gtp_weight_remat_size"] = 1
    return out


def release_refusals(args: Any) -> list[str]:
    """The options `args` sets that a switch cannot carry and that only newer releases
    have (the options of every release are `megatron_lm.arguments.unsupported_args`)."""
    return [why for name, is_set, why in _NEWER_OPTIONS
            if hasattr(args, name) and is_set(getattr(args, name), args)]


def local_spec_groups_experts() -> bool:
    """Whether megatron-core's local layer spec builds `GroupedMLP` (weights `weight1`,
    `weight2` holding all local experts) for `--moe-grouped-gemm`, rather than one module
    per expert. Found from the spec provider itself: megatron-core 0.16's
    `LocalSpecProvider.grouped_mlp_modules(grouped, legacy)` returns `(GroupedMLP, None)`;
    0.19's takes one argument and returns `SequentialMLP` whatever it is asked, so there the
    flag changes no state (and `vps.naming` describes the experts one by one)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.moe import experts

    grouped_cls = getattr(experts, "GroupedMLP", None)
    if grouped_cls is None:
        return False
    fn = LocalSpecProvider().grouped_mlp_modules
    got = fn(True, *[False] * (len(inspect.signature(fn).parameters) - 1))
    return any(getattr(x, "func", x) is grouped_cls
               for x in (got if isinstance(got, tuple) else (got,)))


def live_batch_ramp() -> Optional[tuple[int, int, int]]:
    """The batch-size ramp (start, increment, ramp samples) megatron-core's global
    micro-batch calculator runs with, None when it runs none. Read from the calculator
    itself, not from `--rampup-batch-size`: core_v0.16.1's Megatron-LM builds it with that
    flag; core_v0.19.0's megatron-core has no ramp calculator (its Megatron-LM parses the
    flag and ignores it)."""
    from megatron.core import num_microbatches_calculator as nmc

    ramp_cls = getattr(nmc, "RampupBatchsizeNumMicroBatchesCalculator", None)
    calc = nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR
    if ramp_cls is None or not isinstance(calc, ramp_cls):
        return None
    return (int(calc.start_global_batch_size), int(calc.batch_size_increment),
            int(calc.ramup_samples))

