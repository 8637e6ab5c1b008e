"""Build modules in a thread without touching the process's random number generators.

Layout B is built in the background while A trains, and its weights are filled by the
switch, so nothing B draws at construction matters, but a draw from the process's
generators would change A's: `torch.nn.Embedding` (a learned-absolute position embedding)
initialises itself from the default generator whatever megatron's config says, and
megatron's RNG tracker `fork()` swaps the device generator's state in and out around every
weight initialisation, racing with A's dropout on the main thread.

`private_rng()` gives the calling thread, for the block:
* a private generator for every random torch call that does not name one (a
  `TorchFunctionMode`, which is per thread);
* megatron's RNG tracker with a `fork()` that swaps nothing (`get_cuda_rng_tracker` is made
  thread-aware once, process-wide, and its imported names rebound).
Other threads are untouched.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

from .parallel_state_view import rebind_everywhere

_local = threading.local()  # .quiet: True inside private_rng()
_lock = threading.Lock()
_installed = {"tracker": False}

_METHODS = {getattr(torch.Tensor, n) for n in (
    "normal_", "uniform_", "random_", "exponential_", "geometric_", "log_normal_",
    "cauchy_", "bernoulli_") if hasattr(torch.Tensor, n)}
_FUNCTIONS = {getattr(torch, n) for n in (
    "randn", "rand", "randint", "randperm", "normal", "bernoulli", "multinomial")
    if hasattr(torch, n)}
_INIT = {getattr(torch.nn.init, n) for n in (
    "uniform_", "normal_", "trunc_normal_", "xavier_uniform_", "xavier_normal_",
    "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
    if hasattr(torch.nn.init, n)}


class _PrivateGenerators(TorchFunctionMode):
    """Random calls without a generator draw from generators of this mode's own."""

    def __init__(self) -> None:
        super().__init__()
        self._gens: dict[str, torch.Generator] = {}

    def _gen(self, device: Any) -> torch.Generator:
        kind = torch.device(device).type if device is not None else "cpu"
        if kind != "cpu" and not torch.cuda.is_available():
            kind = "cpu"  # the CPU runtime moves "cuda" tensors to the CPU
        g = self._gens.get(kind)
        if g is None:
            g = torch.Generator(device=kind)
            g.manual_seed(0)  # values never matter: the switch overwrites them
            self._gens[kind] = g
        return g

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("generator") is None:
            if func in _METHODS or func in _INIT:
                t = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
                kwargs["generator"] = self._gen(t.device if torch.is_tensor(t) else None)
            elif func in _FUNCTIONS:
                kwargs["generator"] = self._gen(kwargs.get("device"))
        return func(*args, **kwargs)


class _NoForkTracker:
    """Megatron's RNG tracker whose `fork()` swaps no generator state."""

    def __init__(self, tracker: Any) -> None:
        self._tracker = tracker

    def fork(self, *args: Any, **kwargs: Any):
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tracker, name)


def _install_tracker() -> None:
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:
        return
    with _lock:
        if _installed["tracker"]:
            return
        original = mrandom.get_cuda_rng_tracker

        def get_cuda_rng_tracker(*a: Any, **k: Any) -> Any:
            tracker = original(*a, **k)
            return _NoForkTracker(tracker) if getattr(_local, "quiet", False) else tracker

        functools.update_wrapper(get_cuda_rng_tracker, original)
        mrandom.get_cuda_rng_tracker = get_cuda_rng_tracker
        rebind_everywhere({id(original): get_cuda_rng_tracker})
        _installed["tracker"] = True


@contextlib.contextmanager
def private_rng() -> Iterator[None]:
    """Within the block, this thread draws from no generator of the process (module doc)."""
    _install_tracker()
    previous = getattr(_local, "quiet", False)
    _local.quiet = True
    try:
        with _PrivateGenerators():
            yield
    finally:
        _local.quiet = previous


__all__ = ("private_rng",)
