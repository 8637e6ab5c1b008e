"""The environment every training rank starts with, and giving freed memory back after a
switch (process_env)."""
import ctypes
import ctypes.util

from dynatrain_megatron import process_env


def test_rank_env_is_set_unless_the_user_chose():
    env = process_env.apply({"THP_MEM_ALLOC_ENABLE": "0", "X": "1"})
    assert env["THP_MEM_ALLOC_ENABLE"] == "0" and env["X"] == "1"  # the user's values kept
    assert process_env.apply({})["THP_MEM_ALLOC_ENABLE"] == "1"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_freed_heap_memory_goes_back_to_the_system():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    libc.free(libc.malloc(8 << 20))  # glibc now serves blocks up to 8 MiB from its heap
    blocks = [libc.malloc(2 << 20) for _ in range(64)]  # 128 MiB, touched
    for b in blocks:
        libc.memset(b, 1, 2 << 20)
    for b in blocks[::2]:  # holes between live blocks: no automatic trim of the top
        libc.free(b)
    held = _rss()
    assert process_env.release_free_memory()
    assert held - _rss() > (48 << 20), "freed heap memory stayed in the process"
    for b in blocks[1::2]:
        libc.free(b)
