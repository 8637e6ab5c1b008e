"""The transfer checksum is a function of a message's bytes alone, wherever they lie."""
import torch

from dynatrain_megatron.transition.checksum import checksum


def _reference(data: bytes) -> int:
    """8-byte little-endian words from the message's first byte, then the tail bytes."""
    n8 = len(data) // 8 * 8
    s = sum(int.from_bytes(data[i:i + 8], "little", signed=True) for i in range(0, n8, 8))
    s += sum(data[n8:])  # the tail's bytes as unsigned values
    return s & 0xFFFFFFFFFFFFFFFF


def test_same_bytes_same_checksum_at_every_alignment():
    g = torch.Generator().manual_seed(0)
    for nbytes in (0, 1, 7, 8, 9, 64, 1001, 4096 + 4):
        msg = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        want = _reference(bytes(msg.tolist()))
        for off in range(8):  # unaligned starts take numpy's path, aligned ones torch's
            buf = torch.zeros(nbytes + 16, dtype=torch.uint8)
            buf[off:off + nbytes] = msg
            assert checksum(buf[off:off + nbytes]) == want, (nbytes, off)


def test_fp32_view_at_odd_element_equals_its_aligned_copy_and_catches_one_bit():
    x = torch.randn(10_001, generator=torch.Generator().manual_seed(1))
    view = x[1:]  # 4 bytes past an 8-byte boundary, as a zero-copy message often is
    assert view.data_ptr() % 8 == 4
    assert checksum(view) == checksum(view.clone()) == _reference(view.numpy().tobytes())
    bad = view.clone()
    bad.view(torch.int32)[5000] ^= 1  # one flipped bit
    assert checksum(bad) != checksum(view)
