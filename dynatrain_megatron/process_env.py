"""Process environment a training rank should start with (torch-free: read before torch
is imported, because torch reads these variables once, at its first allocation).

`THP_MEM_ALLOC_ENABLE=1` makes torch's CPU allocator back large tensors with transparent
huge pages. A switch allocates the new layout's buffers (parameters, gradients, Adam
moments) and first-touches them; with 4 KiB pages that is one page fault per 4 KiB and
dominated the CPU switch (measured on the development machine: zero-filling 320 MB took
0.19-0.23 s with 4 KiB pages, 0.06-0.09 s with huge pages; copying into fresh memory 0.25
s vs 0.08-0.10 s). It only affects CPU memory; CUDA tensors come from torch's caching
allocator either way.

`MALLOC_MMAP_THRESHOLD_=1048576` fixes glibc's mmap threshold at 1 MiB. By default glibc
raises it (up to 32 MiB) each time a large block is freed, after which blocks of up to
that size come from its heaps and stay in the process once freed: every switch frees one
layout and allocates another, and the retained heap grew the RSS of each rank by ~0.1 GB
per round trip at 80M parameters and ~0.4 GB at 267M, until the checkpoint path that the
benchmark runs next was killed for memory. With the threshold fixed, the RSS after each
switch stays flat and the pause is unchanged (measured: 0.40 s either way at 80M). glibc
reads the variable at start-up, so `apply` also sets it in the running process
(`mallopt`), where it takes effect for later allocations.
"""
from __future__ import annotations

import os
from typing import MutableMapping, Optional

MMAP_THRESHOLD = 1 << 20
RANK_ENV: dict[str, str] = {"THP_MEM_ALLOC_ENABLE": "1",
                            "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
_M_MMAP_THRESHOLD = -3  # mallopt parameter number (malloc.h)


def apply(env: Optional[MutableMapping[str, str]] = None) -> MutableMapping[str, str]:
    """Set `RANK_ENV` in `env` (default: this process's environment, which also fixes
    this process's mmap threshold) unless the user already chose a value. Returns `env`."""
    own = env is None
    env = os.environ if env is None else env
    for k, v in RANK_ENV.items():
        env.setdefault(k, v)
    if own:
        set_mmap_threshold(int(env["MALLOC_MMAP_THRESHOLD_"]))
    return env


def set_mmap_threshold(nbytes: int) -> bool:
    """glibc's `mallopt(M_MMAP_THRESHOLD, nbytes)` in this process; False where there is
    no glibc (nothing to do there)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes)))
    except (OSError, AttributeError):
        return False
