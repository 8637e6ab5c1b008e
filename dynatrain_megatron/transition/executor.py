"""Executor: run a scheduled transition plan on this rank.

For each round: pack every box this rank sends to a peer into one byte buffer (pieces in
plan order, 8-byte aligned so each can be viewed with its dtype), exchange all buffers of
the round in one batched call, and unpack what arrived into the destination views.
Rank-local pieces are plain copies, no communication. Sources are views into the old
layout's live state, destinations views into the new one (adapters/live.py), so nothing is
materialised beyond one round's staging buffers, whose peak is measured and reported.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch

from .transport import Transport

log = logging.getLogger(__name__)


_ALIGN = 8


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass
class ExecStats:
    """What this rank did during a transition."""

    local_bytes: int = 0
    sent_bytes: int = 0
    recv_bytes: int = 0
    rounds: int = 0
    peak_staging_bytes: int = 0
    seconds: float = 0.0
    round_seconds: list = field(default_factory=list)


class Executor:
    """Moves pieces from source views to destination views on this rank.

    `src_view(piece)` / `dst_view(piece)` return the tensor view of a piece on the sending /
    receiving side (only called for pieces this rank sends / receives). `device` is where
    staging buffers live (the CUDA device with NCCL).
    """

    def __init__(self, rank: int, transport: Transport,
                 src_view: Callable[[object], torch.Tensor],
                 dst_view: Callable[[object], torch.Tensor],
                 device: Optional[torch.device] = None) -> None:
        self.rank = rank
        self.transport = transport
        self.src_view = src_view
        self.dst_view = dst_view
        self.device = device or torch.device("cpu")
        self.stats = ExecStats()

    @torch.no_grad()
    def run_local(self, pieces: Iterable) -> None:
        for p in pieces:
            dst = self.dst_view(p)
            dst.copy_(self.src_view(p))
            self.stats.local_bytes += dst.numel() * dst.element_size()

    @torch.no_grad()
    def run_round(self, pieces: Sequence) -> None:
        """One batched exchange: `pieces` are this round's pieces that involve this rank."""
        t0 = time.perf_counter()
        out: dict[int, list] = {}
        inc: dict[int, list] = {}
        for p in pieces:
            if p.src_device == self.rank and p.dst_device != self.rank:
                out.setdefault(p.dst_device, []).append(p)
            elif p.dst_device == self.rank and p.src_device != self.rank:
                inc.setdefault(p.src_device, []).append(p)
        sends = {peer: self._pack(ps) for peer, ps in out.items()}
        recv_views = {peer: [self.dst_view(p) for p in ps] for peer, ps in inc.items()}
        recvs = {peer: torch.empty(sum(_aligned(v.numel() * v.element_size()) for v in views),
                                   dtype=torch.uint8, device=self.device)
                 for peer, views in recv_views.items()}
        staging = sum(b.numel() for b in sends.values()) + sum(b.numel() for b in recvs.values())
        self.stats.peak_staging_bytes = max(self.stats.peak_staging_bytes, staging)
        self.transport.exchange(sends, recvs)
        for peer, views in recv_views.items():
            self._unpack(recvs[peer], views)
        self.stats.sent_bytes += sum(b.numel() for b in sends.values())
        self.stats.recv_bytes += sum(b.numel() for b in recvs.values())
        self.stats.rounds += 1
        self.stats.round_seconds.append(time.perf_counter() - t0)

    def _pack(self, pieces: Sequence) -> torch.Tensor:
        views = [self.src_view(p) for p in pieces]
        buf = torch.empty(sum(_aligned(v.numel() * v.element_size()) for v in views),
                          dtype=torch.uint8, device=self.device)
        o = 0
        for v in views:
            n = v.numel() * v.element_size()
            buf[o:o + n].view(v.dtype).view(v.shape).copy_(v)
            o += _aligned(n)
        return buf

    @staticmethod
    def _unpack(buf: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
        o = 0
        for v in views:
            n = v.numel() * v.element_size()
            v.copy_(buf[o:o + n].view(v.dtype).view(v.shape))
            o += _aligned(n)
