"""Process environment a training rank should start with (torch-free: read before torch
is imported, because torch reads these variables once, at its first allocation).

`THP_MEM_ALLOC_ENABLE=1` makes torch's CPU allocator back large tensors with transparent
huge pages. A switch allocates the new layout's buffers (parameters, gradients, Adam
moments) and first-touches them; with 4 KiB pages that is one page fault per 4 KiB,
which dominates a CPU switch (docs/bench/notes.md). It only affects CPU memory; CUDA tensors come from torch's caching
allocator either way.

`TORCH_NCCL_ASYNC_ERROR_HANDLING=2` (torch's "CleanUpOnly"; read when an NCCL group is
made): when a collective times out or its communicator fails, the NCCL watchdog aborts that
communicator and the waiting thread gets an error, and the process lives on. torch 2.13's
default (3, "SkipCleanUp") tears the process down instead, which would turn a switch that
should roll back, or a dead peer that our recovery handles, into the end of the job.
Every way a rank starts applies it before its process groups exist: our launchers and
`mcore.session.init_distributed`, and, under plain `torchrun` with Megatron-LM's
`pretrain_gpt.py`, the patched script's argument parsing (`megatron_lm.arguments`), which
runs before Megatron-LM initialises torch.distributed. A value the user set is kept.
"""
from __future__ import annotations

import os
from typing import MutableMapping, Optional

RANK_ENV: dict[str, str] = {"THP_MEM_ALLOC_ENABLE": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def apply(env: Optional[MutableMapping[str, str]] = None) -> MutableMapping[str, str]:
    """Set `RANK_ENV` in `env` (default: this process's environment) unless the user
    already chose a value. Returns `env`."""
    env = os.environ if env is None else env
    for k, v in RANK_ENV.items():
        env.setdefault(k, v)
    return env


def release_free_memory() -> bool:
    """Give the memory the C allocator keeps after frees back to the system (glibc's
    `malloc_trim(0)`, every arena): called when a switch has freed a layout.

    glibc raises its mmap threshold (up to 32 MiB) each time a large block is freed; after
    that, blocks up to that size come from its heaps (and from a second arena for what the
    background preparation allocates) and stay in the process when freed. Every switch
    frees one layout and allocates another, so without this a rank's RSS grows with every
    round trip (docs/bench/notes.md). Fixing the threshold instead (no heap reuse) would
    slow every repeated allocation (training steps, checkpoint loads) by first-touch page
    faults. False where there is no glibc (nothing to do there)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)  # its result only says whether memory was released
        return True
    except (OSError, AttributeError):
        return False
