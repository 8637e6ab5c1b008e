"""Checksums of the messages of a switch, computed on both sides of the wire.

An additive checksum over 64-bit words (bytes at unaligned ends): any single changed word
or byte changes it, and it runs at memory bandwidth, because it is computed on every byte
a switch moves while training is paused. Sender and receiver hold the same bytes at
different addresses (a message may be a view into live storage), so the sum is of the
bytes' values alone: the 8-byte words are those of the message, not of memory.

A message that starts at an address that is not a multiple of 8 (a view into live
storage at an odd fp32 element, common) cannot be viewed as int64 by torch. On the CPU
numpy sums it in place as unaligned int64 words, which costs about what an aligned sum
does, where an aligned copy first would cost several times more (docs/bench/notes.md);
on a GPU a device copy is cheap next to the link.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def _device_sum(t: torch.Tensor) -> torch.Tensor:
    """The (unwrapped) checksum of a contiguous device tensor as a 0-dim int64 tensor on
    that device: no host synchronisation."""
    flat = t.reshape(-1).view(torch.uint8)
    n = flat.numel()
    n8 = n // 8 * 8
    s = torch.zeros((), dtype=torch.int64, device=flat.device)
    if n8:
        body = flat[:n8]
        if body.data_ptr() % 8:
            body = body.clone()  # a device copy is cheap next to the link
        s = s + body.view(torch.int64).sum()
    if n > n8:
        s = s + flat[n8:].to(torch.int64).sum()
    return s


def checksums(ts: Sequence[torch.Tensor]) -> list[int]:
    """`checksum` of each tensor, with one device-to-host transfer for all the device
    tensors among them (a round's messages: one synchronisation per round, not one per
    message). The same values as `checksum`."""
    out: list[int] = [0] * len(ts)
    on_device = [i for i, t in enumerate(ts) if t.device.type != "cpu"]
    for i, t in enumerate(ts):
        if t.device.type == "cpu":
            out[i] = checksum(t)
    if on_device:
        sums = torch.stack([_device_sum(ts[i]) for i in on_device]).tolist()
        for i, v in zip(on_device, sums):
            out[i] = v & 0xFFFFFFFFFFFFFFFF
    return out


def checksum(t: torch.Tensor) -> int:
    """Checksum of a contiguous tensor's bytes (wrapping 64-bit sum)."""
    flat = t.reshape(-1).view(torch.uint8)
    n = flat.numel()
    n8 = n // 8 * 8
    s = 0
    if n8:
        body = flat[:n8]
        if body.data_ptr() % 8 == 0:
            s += int(body.view(torch.int64).sum())
        elif body.device.type == "cpu":  # numpy views unaligned memory as int64 words
            s += int(body.numpy().view(np.int64).sum())
        else:
            s += int(body.clone().view(torch.int64).sum())
    if n > n8:
        s += int(flat[n8:].to(torch.int64).sum())
    return s & 0xFFFFFFFFFFFFFFFF
