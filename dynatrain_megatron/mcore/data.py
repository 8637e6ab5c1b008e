"""A deterministic, learnable synthetic GPT dataset whose position is `consumed_samples`.

Sample i is an arithmetic token sequence `(start + step*t) mod A` over the first
A = min(V, 64) token ids, with (start, step) drawn from a generator seeded by (data_seed, i):
the model learns it quickly (first which tokens occur, then the progressions), so a few steps
show the loss going down, and it costs nothing to read. Like Megatron-LM's `MegatronPretrainingSampler`,
the global sample stream is cut into blocks of `mbs*DP` and DP rank d takes slice
[d*mbs, (d+1)*mbs) of each block, so the stream survives any change of DP: after a switch
at `consumed_samples`, the next global batch holds exactly the same samples.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch


@dataclass(frozen=True, slots=True)
class SyntheticGPTData:
    vocab_size: int
    seq_length: int
    data_seed: int = 0
    active_vocab: int = 64

    def sample(self, index: int) -> torch.Tensor:
        a = min(self.vocab_size, self.active_vocab)
        g = torch.Generator().manual_seed(self.data_seed * 1_000_003 + index)
        start = int(torch.randint(0, a, (1,), generator=g))
        step = int(torch.randint(1, 5, (1,), generator=g))
        t = torch.arange(self.seq_length + 1)
        return (start + step * t) % a

    def micro_batches(self, consumed_samples: int, num_micro_batches: int, micro_batch_size: int,
                      dp_size: int, dp_rank: int, device: Optional[torch.device] = None
                      ) -> list[dict[str, torch.Tensor]]:
        """This DP rank's micro-batches of the global batch that starts at `consumed_samples`,
        on `device` (the model's: the rank's GPU; default the CPU). Drawn on the CPU (the
        generator is seeded per sample) and copied over once per micro-batch."""
        out = []
        for m in range(num_micro_batches):
            base = consumed_samples + m * micro_batch_size * dp_size + dp_rank * micro_batch_size
            seq = torch.stack([self.sample(base + j) for j in range(micro_batch_size)])
            tokens = seq[:, :-1].contiguous()
            out.append({
                "tokens": tokens,
                "labels": seq[:, 1:].contiguous(),
                "loss_mask": torch.ones_like(tokens, dtype=torch.float32),
                "position_ids": torch.arange(self.seq_length).unsqueeze(0).expand_as(tokens).contiguous(),
            })
        if device is not None and device.type != "cpu":
            out = [{k: v.to(device, non_blocking=True) for k, v in b.items()} for b in out]
        return out


def iterators_for_chunks(batches: list[dict[str, torch.Tensor]], num_chunks: int) -> list[Iterator] | Iterator:
    """The schedule wants one iterator per virtual pipeline chunk (each reads the batch)."""
    if num_chunks == 1:
        return iter(batches)
    return [iter(batches) for _ in range(num_chunks)]
