"""An in-memory `Transport` for tests: ranks as threads of one process, messages matched per
(sender, receiver) in posting order, every posting recorded per rank as
`({peer: [(dtype, numel), ...]}, {peer: [...]})` (sends, receives), so a test can assert
which messages went out per round and peer. No process group."""
from __future__ import annotations

import collections
import threading
from typing import Optional

import torch

from dynatrain_megatron.transition.transport import Pending, Transport


class Mailboxes:
    """The messages between ranks. `corrupt`: flip one bit of every packed (uint8) message
    over 64 bytes as it is posted, as a broken link would."""

    def __init__(self, corrupt: bool = False) -> None:
        self.cv = threading.Condition()
        self.queues: dict[tuple[int, int], collections.deque] = collections.defaultdict(
            collections.deque)
        self.posted: dict[int, list] = collections.defaultdict(list)  # rank -> [(sends, recvs)]
        self.corrupt = corrupt


class _Arrivals(Pending):
    def __init__(self, box: Mailboxes, me: int, recvs) -> None:
        super().__init__(())
        self.box, self.me, self.recvs = box, me, recvs

    def wait(self, timeout=None) -> None:
        for peer, bufs in self.recvs.items():
            for buf in bufs:
                with self.box.cv:
                    assert self.box.cv.wait_for(lambda: self.box.queues[(peer, self.me)], 30)
                    msg = self.box.queues[(peer, self.me)].popleft()
                assert msg.dtype == buf.dtype and msg.shape == buf.shape
                buf.copy_(msg)


class MemoryTransport(Transport):
    """Rank `me`'s end of `box`. `tag`: the tag every posting must carry (None: any)."""

    def __init__(self, box: Mailboxes, me: int, tag: Optional[int] = None) -> None:
        self.box, self.me, self.tag = box, me, tag

    def start(self, sends, recvs, tag=0) -> Pending:
        assert self.tag is None or tag == self.tag
        self.box.posted[self.me].append(
            ({p: [(m.dtype, m.numel()) for m in ms] for p, ms in sends.items()},
             {p: [(m.dtype, m.numel()) for m in ms] for p, ms in recvs.items()}))
        with self.box.cv:
            for peer, msgs in sends.items():
                for m in msgs:
                    m = m.clone()
                    if self.box.corrupt and m.dtype == torch.uint8 and m.numel() > 64:
                        m[3] ^= 1  # one bit of the packed message
                    self.box.queues[(self.me, peer)].append(m)
            self.box.cv.notify_all()
        return _Arrivals(self.box, self.me, recvs)
