"""The executor over an in-memory transport, two ranks in one process (threads): which
messages go out per round and peer, how many bytes, the checksum exchange after each
round, and that every piece lands where the plan says (no process group)."""
from __future__ import annotations

import threading

import pytest
import torch

from dynatrain_megatron.routing.piece import Piece
from dynatrain_megatron.transition.executor import SMALL_PIECE_BYTES, Executor
from dynatrain_megatron.vps.box import Box
from memory_transport import Mailboxes, MemoryTransport


def _piece(src, dst, name, box, key=None):
    return Piece(src, dst, key or name, "main_param", box, 0, name, box.offsets, 0, name,
                 box.offsets, 4)


# rank 0 holds A, rank 1 and rank 0 hold parts of B: 1-D "a" (40 floats: small pieces) and
# 2-D "w" (384 x 128 floats): a contiguous block of 128 rows is exactly SMALL_PIECE_BYTES
# (a message of its own, straight from/into live storage), a column block is strided
# (staged on both sides)
SMALL_1 = _piece(0, 1, "a", Box((0,), (10,)))
SMALL_2 = _piece(0, 1, "a", Box((10,), (10,)))
BACK = _piece(1, 0, "b", Box((0,), (6,)))
ROWS = _piece(0, 1, "w", Box((0, 0), (128, 128)))
COLS = _piece(0, 1, "w", Box((128, 0), (256, 64)))
LOCAL = _piece(0, 0, "a", Box((20,), (20,)))
ROUNDS = [[SMALL_1, SMALL_2, BACK, ROWS], [COLS]]


def _run(corrupt=False):
    g = torch.Generator().manual_seed(0)
    src = {r: {"a": torch.randn(40, generator=g), "b": torch.randn(6, generator=g),
               "w": torch.randn(384, 128, generator=g)} for r in (0, 1)}
    dst = {r: {k: torch.zeros_like(v) for k, v in src[r].items()} for r in (0, 1)}
    box = Mailboxes(corrupt)
    execs, errors = {}, {}

    def rank(r):
        ex = execs[r] = Executor(
            r, MemoryTransport(box, r, tag=7), src_view=lambda p: src[r][p.src_local_name][
                p.src_local_box.slices()],
            dst_view=lambda p: dst[r][p.dst_local_name][p.dst_local_box.slices()], tag=7)
        local = [p for p in [LOCAL] if p.src_device == r]
        errors[r] = ex.run(local, [[p for p in rnd if r in (p.src_device, p.dst_device)]
                                   for rnd in ROUNDS])

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return src, dst, box, execs, errors


def test_messages_bytes_and_rounds():
    assert ROWS.nbytes == SMALL_PIECE_BYTES and COLS.nbytes == SMALL_PIECE_BYTES
    src, dst, box, execs, errors = _run()
    assert errors == {0: [], 1: []}
    u8, f32, i64 = torch.uint8, torch.float32, torch.int64
    # per round: the data exchange, then the checksums of every message (one int64 each)
    assert box.posted[0] == [
        ({1: [(u8, 80), (f32, 128 * 128)]}, {1: [(u8, 24)]}),  # 2 small packed (8-aligned)
        ({1: [(i64, 2)]}, {1: [(i64, 1)]}),
        ({1: [(f32, 256 * 64)]}, {}),  # the strided block, staged
        ({1: [(i64, 1)]}, {}),
    ]
    assert box.posted[1] == [
        ({0: [(u8, 24)]}, {0: [(u8, 80), (f32, 128 * 128)]}),
        ({0: [(i64, 1)]}, {0: [(i64, 2)]}),
        ({}, {0: [(f32, 256 * 64)]}),
        ({}, {0: [(i64, 1)]}),
    ]
    s0, s1 = execs[0].stats, execs[1].stats
    assert (s0.rounds, s1.rounds) == (2, 2)
    assert s0.sent_bytes == 80 + 2 * SMALL_PIECE_BYTES == s1.recv_bytes
    assert s0.recv_bytes == 24 == s1.sent_bytes
    assert s0.local_bytes == 80 and s1.local_bytes == 0
    assert s0.zero_copy_bytes == SMALL_PIECE_BYTES == s1.zero_copy_bytes  # ROWS only
    assert s0.checksummed_messages == 1 and s1.checksummed_messages == 3
    # staging: round 0 the packed buffers (80 out, 24 in), round 1 the strided block
    assert s0.peak_staging_bytes == SMALL_PIECE_BYTES and s1.peak_staging_bytes == \
        SMALL_PIECE_BYTES
    # every piece landed where the plan says, nothing else was written
    for p in (SMALL_1, SMALL_2, ROWS, COLS, BACK, LOCAL):
        sl = p.dst_local_box.slices()
        assert torch.equal(dst[p.dst_device][p.dst_local_name][sl],
                           src[p.src_device][p.src_local_name][p.src_local_box.slices()])
    assert int((dst[1]["a"] != 0).sum()) == 20 and int((dst[0]["a"] != 0).sum()) == 20
    assert int((dst[1]["w"][128:, 64:] != 0).sum()) == 0


def test_a_corrupted_message_is_caught_and_not_unpacked():
    src, dst, box, execs, errors = _run(corrupt=True)
    assert errors[0] == []
    assert len(errors[1]) == 1
    assert "round 0: message 0 from rank 0 (80 bytes) arrived corrupted" in errors[1][0]
    assert torch.count_nonzero(dst[1]["a"]) == 0  # the packed pieces were not unpacked
    assert torch.equal(dst[1]["w"][128:, :64], src[0]["w"][128:, :64])  # round 1 went on


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
