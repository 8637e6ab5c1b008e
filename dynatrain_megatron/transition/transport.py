"""Transport: one batched point-to-point exchange per round, over torch.distributed.

The executor only needs `exchange(sends, recvs)`: post every send and receive of a round at
once and wait for all of them. Because each round is a single batched set of non-blocking
operations that every participating rank posts in the same round order, no rank waits on
another's ordering: the schedule cannot deadlock. gloo on the CPU, NCCL on GPUs (tensors
must then live on the rank's CUDA device); the interface is the same.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping, Optional

import torch
import torch.distributed as dist


class Transport(ABC):
    """Moves flat buffers between ranks; one call per round."""

    @abstractmethod
    def exchange(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor]) -> None:
        """Send `sends[peer]` to each peer and fill `recvs[peer]` from each peer."""


class TorchP2PTransport(Transport):
    """`batch_isend_irecv` on a group spanning old and new ranks (default: the world)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group

    def exchange(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor]) -> None:
        ops = []
        # a fixed order (by peer) on every rank; NCCL requires matching order per pair
        for peer in sorted(set(sends) | set(recvs)):
            if peer in sends:
                ops.append(dist.P2POp(dist.isend, sends[peer], peer, group=self.group))
            if peer in recvs:
                ops.append(dist.P2POp(dist.irecv, recvs[peer], peer, group=self.group))
        if not ops:
            return
        for work in dist.batch_isend_irecv(ops):
            work.wait()
