"""The environment every training rank starts with (process_env): huge pages for torch's
CPU tensors, and a fixed glibc mmap threshold so that freed layouts leave the process."""
import ctypes
import ctypes.util

from dynatrain_megatron import process_env


def test_rank_env_is_set_unless_the_user_chose():
    env = process_env.apply({"MALLOC_MMAP_THRESHOLD_": "4096", "X": "1"})
    assert env["THP_MEM_ALLOC_ENABLE"] == "1"
    assert env["MALLOC_MMAP_THRESHOLD_"] == "4096"  # the user's value is kept
    assert env["X"] == "1"
    assert process_env.apply({})["MALLOC_MMAP_THRESHOLD_"] == str(1 << 20)


def test_mmap_threshold_is_fixed_in_this_process():
    # after it, a freed 2 MiB block goes back to the system: glibc's dynamic threshold
    # would otherwise have kept the next one of that size on its heap
    assert process_env.set_mmap_threshold(1 << 20)
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = MallInfo2
    before = libc.mallinfo2().hblks
    blocks = [libc.malloc(2 << 20) for _ in range(3)]
    assert libc.mallinfo2().hblks == before + 3  # each one an mmap of its own
    for b in blocks:
        libc.free(b)
    again = libc.malloc(2 << 20)  # not from the heap: glibc did not raise the threshold
    assert libc.mallinfo2().hblks == before + 1
    libc.free(again)
