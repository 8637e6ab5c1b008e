"""Executor: run a scheduled transition plan on this rank.

Per round and peer, both sides derive the same sequence of messages from the plan alone:
first one packed buffer with every *small* piece (under `SMALL_PIECE_BYTES`, 8-byte
aligned so each can be viewed with its dtype), then one message per large piece, in plan
order. A large piece goes out of, and comes into, its live storage directly when that view
is contiguous (no staging copy); otherwise it is staged through a contiguous buffer. The
round is posted as one batched exchange; the rank-local copies of the plan run while the
first round is on the wire. Sources are views into the old layout's live state,
destinations views into the new one (adapters/live.py), so nothing is materialised beyond
the staging of one round, whose peak is measured and reported.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch

from .transport import Pending, Transport

log = logging.getLogger(__name__)


_ALIGN = 8
# below this a piece travels packed with the others of its peer: one message instead of
# many tiny ones (norm weights, biases, the cut ends of flat ranges)
SMALL_PIECE_BYTES = 1 << 16


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _nbytes(v: torch.Tensor) -> int:
    return v.numel() * v.element_size()


@dataclass
class ExecStats:
    """What this rank did during a transition."""

    local_bytes: int = 0
    sent_bytes: int = 0
    recv_bytes: int = 0
    rounds: int = 0
    peak_staging_bytes: int = 0
    zero_copy_bytes: int = 0  # network bytes sent or received straight from/into live storage
    seconds: float = 0.0
    round_seconds: list = field(default_factory=list)


@dataclass
class _Round:
    """One posted round: what to unpack once it has arrived."""

    pending: Pending
    packed: dict  # peer -> (buffer, [dst views])
    staged: list  # (temporary, dst view)
    keep: list  # send-side tensors that must outlive the exchange
    nbytes_sent: int
    nbytes_recv: int
    t0: float


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

    def run(self, local: Sequence, rounds: Iterable[Sequence]) -> None:
        """The whole transition: `local` pieces (copies on this rank) and, per round, the
        round's pieces that involve this rank. Local copies overlap the first round."""
        t0 = time.perf_counter()
        pending_local = list(local)
        for pieces in rounds:
            r = self._post(pieces)
            if pending_local:
                self.run_local(pending_local)
                pending_local = []
            self._finish(r)
        if pending_local:
            self.run_local(pending_local)
        self.stats.seconds += time.perf_counter() - t0

    @torch.no_grad()
    def run_local(self, pieces: Iterable) -> None:
        for p in pieces:
            dst = self.dst_view(p)
            dst.copy_(self.src_view(p))
            self.stats.local_bytes += _nbytes(dst)

    @torch.no_grad()
    def run_round(self, pieces: Sequence) -> None:
        """One batched exchange: `pieces` are this round's pieces that involve this rank."""
        self._finish(self._post(pieces))

    @torch.no_grad()
    def _post(self, pieces: Sequence) -> _Round:
        t0 = time.perf_counter()
        out: dict[int, list] = {}
        inc: dict[int, list] = {}
        for p in pieces:
            if p.src_device == self.rank and p.dst_device != self.rank:
                out.setdefault(p.dst_device, []).append(p)
            elif p.dst_device == self.rank and p.src_device != self.rank:
                inc.setdefault(p.src_device, []).append(p)
        sends: dict[int, list[torch.Tensor]] = {}
        staging = 0
        keep: list[torch.Tensor] = []
        for peer, ps in out.items():
            small = [p for p in ps if p.nbytes < SMALL_PIECE_BYTES]
            msgs = []
            if small:
                buf = self._pack([self.src_view(p) for p in small])
                staging += buf.numel()
                msgs.append(buf)
            for p in ps:
                if p.nbytes < SMALL_PIECE_BYTES:
                    continue
                v = self.src_view(p)
                if v.is_contiguous():
                    self.stats.zero_copy_bytes += _nbytes(v)
                else:
                    v = self._stage(v)
                    staging += _nbytes(v)
                msgs.append(v)
            sends[peer] = msgs
            keep += msgs
        recvs: dict[int, list[torch.Tensor]] = {}
        packed: dict[int, tuple] = {}
        staged: list[tuple] = []
        for peer, ps in inc.items():
            small = [p for p in ps if p.nbytes < SMALL_PIECE_BYTES]
            msgs = []
            if small:
                views = [self.dst_view(p) for p in small]
                buf = torch.empty(sum(_aligned(_nbytes(v)) for v in views), dtype=torch.uint8,
                                  device=self.device)
                staging += buf.numel()
                packed[peer] = (buf, views)
                msgs.append(buf)
            for p in ps:
                if p.nbytes < SMALL_PIECE_BYTES:
                    continue
                v = self.dst_view(p)
                if v.is_contiguous():
                    self.stats.zero_copy_bytes += _nbytes(v)
                    msgs.append(v)
                else:
                    tmp = torch.empty(v.shape, dtype=v.dtype, device=self.device)
                    staging += _nbytes(tmp)
                    staged.append((tmp, v))
                    msgs.append(tmp)
            recvs[peer] = msgs
        self.stats.peak_staging_bytes = max(self.stats.peak_staging_bytes, staging)
        pending = self.transport.start(sends, recvs)
        return _Round(pending, packed, staged, keep,
                      sum(p.nbytes for ps in out.values() for p in ps),
                      sum(p.nbytes for ps in inc.values() for p in ps), t0)

    @torch.no_grad()
    def _finish(self, r: _Round) -> None:
        self._wait(r.pending)
        for buf, views in r.packed.values():
            self._unpack(buf, views)
        for tmp, v in r.staged:
            self._unpack_staged(tmp, v)
        self.stats.sent_bytes += r.nbytes_sent
        self.stats.recv_bytes += r.nbytes_recv
        self.stats.rounds += 1
        self.stats.round_seconds.append(time.perf_counter() - r.t0)

    @staticmethod
    def _wait(pending: Pending) -> None:
        pending.wait()

    def _pack(self, views: Sequence[torch.Tensor]) -> torch.Tensor:
        buf = torch.empty(sum(_aligned(_nbytes(v)) for v in views), dtype=torch.uint8,
                          device=self.device)
        o = 0
        for v in views:
            n = _nbytes(v)
            buf[o:o + n].view(v.dtype).view(v.shape).copy_(v)
            o += _aligned(n)
        return buf

    def _stage(self, v: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of a strided source view (counted as packing)."""
        out = torch.empty(v.shape, dtype=v.dtype, device=self.device)
        out.copy_(v)
        return out

    @staticmethod
    def _unpack(buf: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
        o = 0
        for v in views:
            n = _nbytes(v)
            v.copy_(buf[o:o + n].view(v.dtype).view(v.shape))
            o += _aligned(n)

    @staticmethod
    def _unpack_staged(tmp: torch.Tensor, v: torch.Tensor) -> None:
        v.copy_(tmp)
