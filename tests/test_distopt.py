"""Distributed-optimizer ownership (megatron-core 0.16.1's buffer and bucket rules), on
hand-worked examples (pure)."""
import pytest

from dynatrain_megatron.vps.distopt import (Bucket, build_buffer_layout, effective_bucket_size,
                                            resolve_bucket_size)
from dynatrain_megatron.vps.errors import LayoutError

# named_parameters() order; the buffer holds them reversed: c, b, a
PARAMS = [("a", 100, False), ("b", 30, False), ("c", 200, False)]


def test_one_bucket_params_reversed_and_padded():
    buf = build_buffer_layout(PARAMS, shard_size=2, bucket_size=None)
    # starts padded to 64: c [0, 200), b [256, 286), a [320, 420); end padded to lcm(2, 128)
    assert [(p.local_name, p.start, p.end) for p in buf.params] == \
        [("c", 0, 200), ("b", 256, 286), ("a", 320, 420)]
    assert buf.buckets == (Bucket(0, 0, 512, 420),)
    assert (buf.numel, buf.numel_unpadded) == (512, 420)
    assert buf.buckets[0].shard(1, 2) == (256, 512)
    assert buf.owned_param_ranges(0) == [("c", 0, 200)]
    assert buf.owned_param_ranges(1) == [("b", 0, 30), ("a", 0, 100)]
    elems, cnt = buf.owned_prefix_counts([200, 30, 100])
    assert elems.tolist() == [200, 130] and cnt.tolist() == [1, 2]
    elems, _ = buf.owned_prefix_counts([150, 30, 100])  # only c's first 150 in the VPS
    assert elems.tolist() == [150, 130]
    with pytest.raises(LayoutError, match="shard index 2 outside group of size 2"):
        buf.owned_param_ranges(2)


def test_bucket_closes_once_its_unpadded_size_reaches_bucket_size():
    buf = build_buffer_layout(PARAMS, shard_size=2, bucket_size=250)
    # c (200) stays open, b ends at 286 >= 250: close, padded to 384; a opens bucket 1
    assert buf.buckets == (Bucket(0, 0, 384, 286), Bucket(1, 384, 128, 100))
    assert [(p.local_name, p.start, p.bucket) for p in buf.params] == \
        [("c", 0, 0), ("b", 256, 0), ("a", 384, 1)]


def test_shared_embedding_gets_a_bucket_of_its_own():
    buf = build_buffer_layout([("emb", 50, True), ("x", 10, False)], shard_size=1,
                              bucket_size=None)
    assert buf.buckets == (Bucket(0, 0, 128, 64), Bucket(1, 128, 128, 50))
    assert [(p.local_name, p.start, p.bucket) for p in buf.params] == \
        [("x", 0, 0), ("emb", 128, 1)]


def test_high_nccl_busbw_padding():
    buf = build_buffer_layout(PARAMS, shard_size=2, bucket_size=None,
                              pad_buckets_for_high_nccl_busbw=True)
    assert buf.buckets == (Bucket(0, 0, 1 << 16, 420),)


def test_bucket_size_rules():
    assert resolve_bucket_size(None, False, 8) is None
    assert resolve_bucket_size(None, True, 8) == 40_000_000
    assert resolve_bucket_size(None, True, 64) == 64_000_000
    assert resolve_bucket_size(123, True, 1) == 123
    assert effective_bucket_size(100, 0, 0) == 100
    assert effective_bucket_size(100, 1, 0) is None  # DDP drops it on pp ranks > 0
    assert effective_bucket_size(100, 0, 1) is None  # Megatron-LM: chunks > 0
    assert effective_bucket_size(100, 0, 1, bucket_chunks_after_first=True) == 100
    with pytest.raises(LayoutError, match="bucket_size must be >= 1"):
        effective_bucket_size(0, 0, 0)
    with pytest.raises(LayoutError, match="shard group size must be >= 1"):
        build_buffer_layout(PARAMS, shard_size=0, bucket_size=None)
