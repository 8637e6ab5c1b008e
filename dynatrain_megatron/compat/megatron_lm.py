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
2. `megatron.training.initialize` imports `batch_invariant_kernels`, which imports `triton`
   at module level (about 1 GB on PyPI, useless without a GPU). When triton is not
   importable, that module is replaced by a stand-in whose `enable_batch_invariant_mode`
   refuses `--batch-invariant-mode` with a clear error. triton itself is not faked, so
   nothing else believes it is present.
3. `initialize_megatron` asserts CUDA: it is called with `allow_no_cuda=True`.
4. `_initialize_distributed` creates the model-parallel groups and `_set_random_seed` seeds
   the model-parallel RNG tracker only when `torch.cuda.device_count() > 0`: both run as if
   one device were present (`set_device` is a no-op; the tracker uses CPU generators).
   `validate_args` reads the device architecture: 0 (no device).
5. `_compile_dependencies` runs `make` for the dataset helpers and `nvcc` for fused
   kernels: the helpers come compiled in the megatron-core wheel (checked), the fused
   kernels are CUDA only, so it only checks the helpers import.
6. `_warmup_jit_function` compiles fused kernels on "cuda" tensors with torch.compile:
   skipped (the CPU launch uses the `--no-*-fusion` flags, which don't call them).
7. Memory reports read `torch.cuda` counters that `compat.cpu` does not stub: zeros.

On a GPU only the extra check and megatron-core's fixes apply: Megatron-LM runs as is.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import sys
import types
from typing import Any, Callable, Iterator

import torch

from ..vps.errors import DynatrainError

log = logging.getLogger("dynatrain")

# what Megatron-LM imports beyond megatron-core and this package (setup.py: extra "megatron-lm")
EXTRA_MODULES = ("six", "regex", "pydantic", "einops", "psutil")
_BATCH_INVARIANT = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
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


def _install_batch_invariant_stand_in() -> bool:
    """Item 2: returns True when the stand-in was installed (triton missing)."""
    if _BATCH_INVARIANT in sys.modules or importlib.util.find_spec("triton") is not None:
        return False
    mod = types.ModuleType(_BATCH_INVARIANT)
    mod.__doc__ = "Stand-in installed by dynatrain: triton is not installed on this machine."

    def enable_batch_invariant_mode(*a: Any, **k: Any) -> None:
        raise DynatrainError("--batch-invariant-mode needs triton, which is not installed "
                             "(dynatrain's CPU runtime keeps its import from failing)")

    def missing(name: str) -> Any:
        raise AttributeError(f"{_BATCH_INVARIANT}.{name}: triton is not installed, so this "
                             f"module is dynatrain's stand-in")

    mod.enable_batch_invariant_mode = enable_batch_invariant_mode  # type: ignore[attr-defined]
    mod.__getattr__ = missing  # type: ignore[attr-defined]
    sys.modules[_BATCH_INVARIANT] = mod
    return True


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
    init._warmup_jit_function = lambda: None
    for name in ("megatron.training.arguments", "megatron.training.utils"):
        module = importlib.import_module(name)
        if hasattr(module, "get_device_arch_version"):
            module.get_device_arch_version = lambda: 0  # item 4b: no device, no architecture
    c = torch.cuda
    zero = lambda *a, **k: 0  # noqa: E731
    c.max_memory_reserved = zero
    c.device_memory_used = zero
    c.memory_stats = lambda *a, **k: {}


def prepare_megatron_lm() -> bool:
    """Make Megatron-LM importable and runnable here (see the module docstring); idempotent.
    Returns True when the CPU runtime is active."""
    if _state["prepared"]:
        return _state["cpu"]
    check_extra()
    from . import prepare_runtime

    cpu = prepare_runtime()
    if cpu:
        if _install_batch_invariant_stand_in():
            log.info("triton is not installed: %s is a stand-in", _BATCH_INVARIANT)
        _patch_megatron_training()
        log.info("Megatron-LM CPU runtime applied (no CUDA device)")
    _state.update(prepared=True, cpu=cpu)
    return cpu
