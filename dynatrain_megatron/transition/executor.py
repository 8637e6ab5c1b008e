"""Executor: run a scheduled transition plan on this rank.

Per round and peer, both sides derive the same sequence of messages from the plan alone:
first one packed buffer with every *small* piece (under `SMALL_PIECE_BYTES`, 8-byte
aligned so each can be viewed with its dtype), then one message per large piece, in plan
order. A large piece goes out of, and comes into, its live storage directly when that view
is contiguous (no staging copy); otherwise it is staged through a contiguous buffer. The
round is posted as one batched exchange; the rank-local copies of the plan are spread over
the rounds, each share running while its round is on the wire. Sources are views into the
old layout's live state, destinations views into the new one (adapters/live.py), so
nothing is materialised beyond the staging of one round, whose peak is measured and
reported.

Transaction support (transition/switch.py commits or rolls back on what this records):
each message is checksummed on both sides (the sender's sums follow in a small second
exchange of the round) and a mismatch is recorded; a round whose peers do not show up
within `timeout` is recorded and the remaining rounds are skipped (peers then time out in
turn). An error on this rank never skips a message its peers expect: the message is sent
as zeros and the error recorded. `errors` is empty after a good transfer. The old state
is only ever read, so a failed transfer leaves it intact.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch

from ..routing.piece import Piece
from .checksum import checksums
from .faults import FaultPlan
from .transport import Pending, Transport

log = logging.getLogger("dynatrain")


PACK_ALIGN = 8  # elements: every piece starts at a multiple of this in a message
# below this a piece travels packed with the others of its peer: one message instead of
# many tiny ones (norm weights, biases, the cut ends of flat ranges)
SMALL_PIECE_BYTES = 1 << 16
_NO_FAULTS = FaultPlan()


def _aligned(n: int) -> int:
    return (n + PACK_ALIGN - 1) // PACK_ALIGN * PACK_ALIGN


def _nbytes(v: torch.Tensor) -> int:
    return v.numel() * v.element_size()


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _slots(buf: torch.Tensor, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The packed places of `views` in `buf`: each at an 8-byte aligned offset, in order,
    viewed with its dtype and shape."""
    out, o = [], 0
    for v in views:
        n = _nbytes(v)
        out.append(buf[o:o + n].view(v.dtype).view(v.shape))
        o += _aligned(n)
    return out


def _copy_all(dsts: list[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """dst_i <- src_i for every pair. On a GPU one multi-tensor copy (`_foreach_copy_`:
    one kernel launch for a peer's small pieces instead of one per piece); on the CPU a
    loop of memcpys, which is what that would do there anyway."""
    if dsts and dsts[0].device.type == "cuda":
        torch._foreach_copy_(dsts, list(srcs))
        return
    for d, s in zip(dsts, srcs):
        d.copy_(s)


def peer_pieces(pieces: Sequence[Piece], rank: int
                ) -> tuple[dict[int, list[Piece]], dict[int, list[Piece]]]:
    """A round's remote pieces of `rank`, grouped by peer: (sent to each peer, received from
    each peer); pieces local to `rank` and pieces it takes no part in are left out."""
    out: dict[int, list[Piece]] = {}
    inc: dict[int, list[Piece]] = {}
    for p in pieces:
        if p.src_device == rank and p.dst_device != rank:
            out.setdefault(p.dst_device, []).append(p)
        elif p.dst_device == rank and p.src_device != rank:
            inc.setdefault(p.src_device, []).append(p)
    return out, inc


def local_shares(local: Sequence[Piece], n_rounds: int) -> list[list[Piece]]:
    """`local` pieces cut, in order, into one share per round (at least one) of about equal
    bytes: share i is copied while round i is on the wire (routing.cost models the same)."""
    n = max(1, n_rounds)
    total = sum(p.nbytes for p in local)
    shares: list[list[Piece]] = [[] for _ in range(n)]
    done = 0
    for p in local:
        i = min(n - 1, done * n // total) if total else 0
        shares[i].append(p)
        done += p.nbytes
    return shares


@dataclass
class ExecStats:
    """What this rank did during a transition."""

    local_bytes: int = 0
    sent_bytes: int = 0
    recv_bytes: int = 0
    rounds: int = 0
    peak_staging_bytes: int = 0
    zero_copy_bytes: int = 0  # network bytes sent or received straight from/into live storage
    checksummed_messages: int = 0
    seconds: float = 0.0
    round_seconds: list = field(default_factory=list)


@dataclass
class _Round:
    """One posted round: what to check and unpack once it has arrived."""

    index: int
    pending: Optional[Pending]  # None: posting failed
    recv_msgs: dict  # peer -> [message tensors], in order
    send_sums: dict  # peer -> [checksums of the messages sent]
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
    staging buffers live (the CUDA device with NCCL). `tag`: this attempt's message tag.
    """

    def __init__(self, rank: int, transport: Transport,
                 src_view: Callable[[Piece], torch.Tensor],
                 dst_view: Callable[[Piece], torch.Tensor],
                 device: Optional[torch.device] = None, *, tag: int = 0,
                 timeout: Optional[float] = None, checksums: bool = True,
                 faults: Optional[FaultPlan] = None) -> None:
        self.rank = rank
        self.transport = transport
        self.src_view = src_view
        self.dst_view = dst_view
        self.device = device or torch.device("cpu")
        self.tag = tag
        self.timeout = timeout
        self.checksums = checksums
        self.faults = faults or _NO_FAULTS
        self.stats = ExecStats()
        self.errors: list[str] = []
        self._stalled = False  # a round timed out: post nothing more

    def run(self, local: Sequence[Piece], rounds: Sequence[Sequence[Piece]]) -> list[str]:
        """The whole transition: `local` pieces (copies on this rank) and, per round, the
        round's pieces that involve this rank. The local copies are spread over the rounds
        (`local_shares`), each share copied while its round is on the wire: under a
        memory budget (many rounds) they would otherwise all wait on the first.
        Returns `errors` (empty: every piece arrived and checked)."""
        t0 = time.perf_counter()
        rounds = list(rounds)
        shares = local_shares(local, len(rounds))
        for i, pieces in enumerate(rounds):
            if self._stalled:
                break
            r = self._post(pieces, i)
            if shares[i]:
                self._guard("local copies", self.run_local, shares[i])
                shares[i] = []
            self._finish(r)
        rest = [p for share in shares for p in share]
        if rest:  # no rounds, or a round stalled (the switch aborts; copied for simplicity)
            self._guard("local copies", self.run_local, rest)
        self.stats.seconds += time.perf_counter() - t0
        return self.errors

    def _record(self, what: str, e: BaseException) -> None:
        """An error on this rank: recorded (the switch rolls back on it), never raised
        mid-protocol, so peers still get every message they expect."""
        self.errors.append(f"rank {self.rank}: {what}: {type(e).__name__}: {e}")
        log.error("rank %d: %s failed: %s", self.rank, what, e)

    def _guard(self, what: str, fn, *a) -> None:
        try:
            fn(*a)
        except Exception as e:  # noqa: BLE001 - recorded; the switch rolls back on it
            self._record(what, e)

    @torch.no_grad()
    def run_local(self, pieces: Iterable[Piece]) -> None:
        for p in pieces:
            dst = self.dst_view(p)
            dst.copy_(self.src_view(p))
            self.stats.local_bytes += _nbytes(dst)

    def _placeholder(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    @torch.no_grad()
    def _post(self, pieces: Sequence[Piece], index: int) -> _Round:
        t0 = time.perf_counter()
        self.faults.delay(self.rank, index)
        out, inc = peer_pieces(pieces, self.rank)
        sends: dict[int, list[torch.Tensor]] = {}
        send_sums: dict[int, list[int]] = {}
        keep: list[torch.Tensor] = []
        recvs: dict[int, list[torch.Tensor]] = {}
        packed: dict[int, tuple] = {}
        staged: list[tuple] = []
        staging = 0
        for peer, ps in out.items():
            sends[peer], n = self._outgoing(peer, ps)
            staging += n
            keep += sends[peer]
        for peer, ps in inc.items():
            recvs[peer], n = self._incoming(peer, ps, packed, staged)
            staging += n
        self.stats.peak_staging_bytes = max(self.stats.peak_staging_bytes, staging)
        try:
            pending = self.transport.start(sends, recvs, self.tag)
        except Exception as e:  # noqa: BLE001 - a peer gave up on this round (timeout)
            self.errors.append(f"rank {self.rank}: round {index}: posting failed: "
                               f"{str(e).splitlines()[0]}")
            self._stalled = True
            pending = None
        if self.checksums:  # while the messages are on the wire (both only read them)
            peers = list(sends)
            flat = checksums([m for peer in peers for m in sends[peer]])
            o = 0
            for peer in peers:
                send_sums[peer] = flat[o:o + len(sends[peer])]
                o += len(sends[peer])
        return _Round(index, pending, recvs, send_sums, packed, staged, keep,
                      sum(p.nbytes for ps in out.values() for p in ps),
                      sum(p.nbytes for ps in inc.values() for p in ps), t0)

    @staticmethod
    def _split(ps: Sequence) -> tuple[list, list]:
        """A peer's pieces of a round: the small ones (one packed message, first) and the
        large ones (a message each, in plan order). Both sides split alike."""
        return ([p for p in ps if p.nbytes < SMALL_PIECE_BYTES],
                [p for p in ps if p.nbytes >= SMALL_PIECE_BYTES])

    def _outgoing(self, peer: int, ps: Sequence) -> tuple[list[torch.Tensor], int]:
        """The messages to `peer` and the staging bytes they took."""
        small, large = self._split(ps)
        msgs: list[torch.Tensor] = []
        staging = 0
        if small:
            try:
                buf = self._pack([self.src_view(p) for p in small])
            except Exception as e:  # noqa: BLE001
                self._record(f"packing for rank {peer}", e)
                buf = self._placeholder(sum(_aligned(p.nbytes) for p in small))
            staging += buf.numel()
            msgs.append(buf)
        for p in large:
            try:
                v = self.src_view(p)
                if v.is_contiguous():
                    self.stats.zero_copy_bytes += _nbytes(v)
                else:
                    v = self._stage(v)
                    staging += _nbytes(v)
            except Exception as e:  # noqa: BLE001
                self._record(f"reading {p.key}/{p.kind} for rank {peer}", e)
                v = self._placeholder(p.nbytes)
            msgs.append(v)
        return msgs, staging

    def _incoming(self, peer: int, ps: Sequence, packed: dict, staged: list
                  ) -> tuple[list[torch.Tensor], int]:
        """The buffers to receive `peer`'s messages into (live storage where contiguous)
        and the staging bytes they took; fills `packed` / `staged` for unpacking."""
        small, large = self._split(ps)
        msgs: list[torch.Tensor] = []
        staging = 0
        if small:
            buf = torch.empty(sum(_aligned(p.nbytes) for p in small), dtype=torch.uint8,
                              device=self.device)
            staging += buf.numel()
            try:
                packed[peer] = (buf, [self.dst_view(p) for p in small])
            except Exception as e:  # noqa: BLE001
                self._record(f"destination views from rank {peer}", e)
            msgs.append(buf)
        for p in large:
            try:
                v = self.dst_view(p)
            except Exception as e:  # noqa: BLE001
                self._record(f"destination of {p.key}/{p.kind} from rank {peer}", e)
                msgs.append(self._placeholder(p.nbytes))
                continue
            if v.is_contiguous():
                self.stats.zero_copy_bytes += _nbytes(v)
                msgs.append(v)
            else:
                tmp = torch.empty(v.shape, dtype=v.dtype, device=self.device)
                staging += _nbytes(tmp)
                staged.append((tmp, v))
                msgs.append(tmp)
        return msgs, staging

    @torch.no_grad()
    def _finish(self, r: _Round) -> None:
        if r.pending is None:
            return
        try:
            self._wait(r.pending, self.timeout)
        except TimeoutError as e:
            self.errors.append(f"rank {self.rank}: round {r.index}: {e}")
            log.error("rank %d: round %d timed out: %s", self.rank, r.index, e)
            self._stalled = True
            return
        self.faults.corrupt(self.rank, r.index, [m for ms in r.recv_msgs.values() for m in ms])
        ok = self._verify(r) if self.checksums else True
        if ok:
            for buf, views in r.packed.values():
                self._unpack(buf, views)
            for tmp, v in r.staged:
                self._unpack_staged(tmp, v)
        self._guard(f"round {r.index}", self.faults.fail, self.rank, "round", r.index)
        self.stats.sent_bytes += r.nbytes_sent
        self.stats.recv_bytes += r.nbytes_recv
        self.stats.rounds += 1
        self.stats.round_seconds.append(time.perf_counter() - r.t0)

    def _verify(self, r: _Round) -> bool:
        """The sender's checksums of each message against ours of what arrived."""
        sends = {peer: [torch.tensor([_signed(c) for c in sums], dtype=torch.int64,
                                     device=self.device)]
                 for peer, sums in r.send_sums.items()}
        recvs = {peer: [torch.empty(len(msgs), dtype=torch.int64, device=self.device)]
                 for peer, msgs in r.recv_msgs.items()}
        try:
            self._wait(self.transport.start(sends, recvs, self.tag), self.timeout)
        except (TimeoutError, RuntimeError) as e:
            self.errors.append(f"rank {self.rank}: round {r.index} checksums: {e}")
            self._stalled = True
            return False
        ok = True
        peers = list(r.recv_msgs)
        ours = iter(checksums([m for peer in peers for m in r.recv_msgs[peer]]))
        theirs_all = iter(torch.cat([recvs[peer][0] for peer in peers]).tolist()
                          if peers else [])
        for peer in peers:
            msgs = r.recv_msgs[peer]
            for j, m in enumerate(msgs):
                self.stats.checksummed_messages += 1
                if _signed(next(ours)) != next(theirs_all):
                    ok = False
                    self.errors.append(f"rank {self.rank}: round {r.index}: message {j} from "
                                       f"rank {peer} ({_nbytes(m)} bytes) arrived corrupted "
                                       f"(checksum mismatch)")
        return ok

    @staticmethod
    def _wait(pending: Pending, timeout: Optional[float] = None) -> None:
        pending.wait(timeout)

    def _pack(self, views: Sequence[torch.Tensor]) -> torch.Tensor:
        buf = torch.empty(sum(_aligned(_nbytes(v)) for v in views), dtype=torch.uint8,
                          device=self.device)
        _copy_all(_slots(buf, views), views)
        return buf

    def _stage(self, v: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of a strided source view (counted as packing)."""
        out = torch.empty(v.shape, dtype=v.dtype, device=self.device)
        out.copy_(v)
        return out

    @staticmethod
    def _unpack(buf: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
        _copy_all(list(views), _slots(buf, views))

    @staticmethod
    def _unpack_staged(tmp: torch.Tensor, v: torch.Tensor) -> None:
        v.copy_(tmp)

