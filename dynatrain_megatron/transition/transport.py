"""Transport: one batched point-to-point exchange per round, over torch.distributed.

The executor posts every send and receive of a round at once (`start`), does its
rank-local work while the data is on the wire, then waits (`Pending.wait`). Because each
round is a single batched set of non-blocking operations that every participating rank
posts in the same round order, no rank waits on another's ordering: the schedule cannot
deadlock. Messages between a pair are matched in the order they are posted, which both
sides derive from the same plan. gloo on the CPU, NCCL on GPUs (tensors must then live on
the rank's CUDA device); the interface is the same.
"""
from __future__ import annotations

import datetime
import time
from abc import ABC, abstractmethod
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where tensors of a collective on `group` must live: the current CUDA device under
    NCCL, the CPU under gloo. Small control collectives (votes, flags, losses) use it so
    the same code runs on both."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Pending:
    """Operations of one round in flight."""

    def __init__(self, works: Sequence) -> None:
        self._works = list(works)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Wait for every operation; with `timeout` (seconds, for the whole round) raise
        `TimeoutError` when a peer does not show up in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for w in self._works:
            if deadline is None:
                w.wait()
                continue
            left = max(0.001, deadline - time.monotonic())
            try:
                done = w.wait(timeout=datetime.timedelta(seconds=left))
            except RuntimeError as e:  # gloo reports a timed-out wait as an error
                raise TimeoutError(f"peer did not complete the exchange within {timeout:.1f} s: "
                                   f"{str(e).splitlines()[0]}") from e
            if done is False:
                raise TimeoutError(f"peer did not complete the exchange within {timeout:.1f} s")
        self._works = []


class Transport(ABC):
    """Moves contiguous tensors between ranks; one `start` per round."""

    @abstractmethod
    def start(self, sends: Mapping[int, Sequence[torch.Tensor]],
              recvs: Mapping[int, Sequence[torch.Tensor]], tag: int = 0) -> Pending:
        """Post: send each tensor of `sends[peer]` to `peer`, in order, and fill each tensor
        of `recvs[peer]` from `peer`, in order. The tensors must stay alive until `wait`.
        `tag` keeps the messages of different switch attempts apart (a late message of an
        abandoned attempt must never land in a later one)."""

    def exchange(self, sends: Mapping[int, Sequence[torch.Tensor]],
                 recvs: Mapping[int, Sequence[torch.Tensor]], tag: int = 0) -> None:
        self.start(sends, recvs, tag).wait()


class TorchP2PTransport(Transport):
    """`batch_isend_irecv` on a group spanning old and new ranks (default: the world)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group

    def start(self, sends: Mapping[int, Sequence[torch.Tensor]],
              recvs: Mapping[int, Sequence[torch.Tensor]], tag: int = 0) -> Pending:
        ops = []
        # a fixed order (by peer, then message) on every rank; NCCL requires matching order
        for peer in sorted(set(sends) | set(recvs)):
            for t in sends.get(peer, ()):
                ops.append(dist.P2POp(dist.isend, t, peer, group=self.group, tag=tag))
            for t in recvs.get(peer, ()):
                ops.append(dist.P2POp(dist.irecv, t, peer, group=self.group, tag=tag))
        if not ops:
            return Pending(())
        return Pending(dist.batch_isend_irecv(ops))
