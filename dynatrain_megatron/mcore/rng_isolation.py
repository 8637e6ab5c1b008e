"""Layout B is built without touching the random generators layout A trains with.

B is built in a background thread while A's forward runs dropout on the training thread.
Transformer Engine's `reset_parameters` forks megatron's model-parallel RNG tracker
(`get_cuda_rng_tracker().fork()`), and a fork swaps the device's default generator state
and the tracker's own states for the duration of the block: both are process-wide, so a
fork in B's thread changes the masks A draws meanwhile (and TP ranks, which interleave
differently, diverge silently). B's weights are never drawn anyway (they are overwritten
by the transfer), so B's thread gets a tracker of its own that draws nothing:

`isolated_rng()` makes megatron's global tracker a thread-aware stand-in for the duration
of the block: the thread that entered the block sees an inert tracker (not initialised, so
megatron's TE wrappers hand TE no tracker; `fork` swaps nothing), every other thread the
real one, unchanged. The stand-in is an instance of a subclass of the real tracker's class,
so megatron's `isinstance` checks (its checkpoint RNG state) still hold on A's thread.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class InertTracker:
    """A model-parallel RNG tracker that holds no state and draws nothing."""

    def is_initialized(self) -> bool:
        return False

    def reset(self) -> None:
        pass

    def get_states(self) -> dict:
        return {}

    def set_states(self, states) -> None:
        pass

    def add(self, name, seed) -> None:
        pass

    @contextlib.contextmanager
    def fork(self, *args, **kwargs) -> Iterator[None]:
        yield


_LOCAL = threading.local()
_LOCK = threading.Lock()
_STATE: dict = {"proxy": None, "users": 0}


def _stand_in(real):
    """An instance of a subclass of `type(real)` that routes every attribute to the
    calling thread's tracker: `_LOCAL.tracker` where set, else `real`."""
    cls = type(real)

    class ThreadAwareTracker(cls):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:  # the real tracker keeps all state
            pass

        def __getattribute__(self, name: str):
            if name == "dt_real":
                return real
            return getattr(getattr(_LOCAL, "tracker", None) or real, name)

        def __setattr__(self, name: str, value) -> None:
            setattr(getattr(_LOCAL, "tracker", None) or real, name, value)

    return ThreadAwareTracker()


@contextlib.contextmanager
def isolated_rng() -> Iterator[InertTracker]:
    """Within the block, this thread's view of megatron's RNG tracker is an
    `InertTracker`; other threads keep theirs. Safe to nest and to use from one
    preparation thread while the training thread trains."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.get_cuda_rng_tracker()  # the real one exists before it is wrapped
    inert = InertTracker()
    with _LOCK:
        if _STATE["users"] == 0:
            _STATE["proxy"] = _stand_in(mrandom._CUDA_RNG_STATE_TRACKER)
            mrandom._CUDA_RNG_STATE_TRACKER = _STATE["proxy"]
        _STATE["users"] += 1
    previous = getattr(_LOCAL, "tracker", None)
    _LOCAL.tracker = inert
    try:
        yield inert
    finally:
        _LOCAL.tracker = previous
        with _LOCK:
            _STATE["users"] -= 1
            if _STATE["users"] == 0:
                proxy, _STATE["proxy"] = _STATE["proxy"], None
                # put the real tracker back unless someone replaced the global meanwhile
                # (a reseed at a commit makes a new tracker: keep that one)
                if mrandom._CUDA_RNG_STATE_TRACKER is proxy:
                    mrandom._CUDA_RNG_STATE_TRACKER = proxy.dt_real
