"""The CPU runtime for megatron-core, on its own (issue: Foundation, item 3).

Run in a fresh interpreter: the runtime patches process-wide state, and we also want to see
that it does nothing when a CUDA device is reported."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_cpu_runtime_redirects_cuda_and_is_idempotent():
    out = _run("""
        import torch
        from dynatrain_megatron.compat import cpu
        assert cpu.apply_if_needed() is True and cpu.apply_if_needed() is True
        t = torch.empty(3, device="cuda")
        u = torch.ones(2).cuda()
        v = torch.zeros(2, device=torch.cuda.current_device())
        torch.cuda.synchronize(); torch.cuda.current_stream().synchronize()
        print(t.device, u.device, v.device, torch.ones(1).type(), torch.cuda.device_count())
    """)
    assert out == "cpu cpu cpu torch.cuda.FloatTensor 0"


def test_rng_tracker_forks_cpu_states_per_tp_rank():
    out = _run("""
        import torch
        from dynatrain_megatron.compat import cpu
        cpu.apply_if_needed()
        from megatron.core.tensor_parallel import random as r
        draws = []
        for tp in (0, 1, 0):
            r.model_parallel_cuda_manual_seed(1234, tp_rank=tp, ep_rank=0, etp_rank=0,
                                              force_reset_rng=True)
            with r.get_cuda_rng_tracker().fork():
                draws.append(float(torch.rand(1)))
        print(draws[0] == draws[2], draws[0] != draws[1])
    """)
    assert out == "True True"


def test_nothing_is_patched_when_cuda_is_present():
    out = _run("""
        import torch
        torch.cuda.is_available = lambda: True
        original = torch.cuda.current_device
        from dynatrain_megatron.compat import cpu
        print(cpu.apply_if_needed(), torch.cuda.current_device is original)
    """)
    assert out == "False True"


STAND_IN_RANKS = """
    import threading
    import torch, torch.distributed as dist
    from dynatrain_megatron.compat import stand_in_world as S
    from dynatrain_megatron.vps.errors import DynatrainError
    dist.init_process_group("gloo")
    r = dist.get_rank()
    first, last = dist.new_group([0, 1]), dist.new_group([2, 3])
    if r < 2:
        try:
            S.use(last)  # not the job's first ranks: global ranks would be renumbered
            raise AssertionError("accepted")
        except DynatrainError:
            pass
        S.use(first)
        t = torch.tensor([r + 1.0]); dist.all_reduce(t)
        out = [None, None]; dist.all_gather_object(out, r); dist.barrier()
        seen = []  # another thread (a switch prepared in the background) sees the world
        th = threading.Thread(target=lambda: seen.append(dist.get_world_size()))
        th.start(); th.join()
        with S.real_world():
            u = torch.tensor([1.0]); dist.all_reduce(u)  # with ranks 2 and 3
            real = dist.get_world_size()
        print(r, dist.get_world_size(), dist.get_rank(), t.item(), out, seen, real, u.item(),
              dist.get_rank(last), flush=True)
        S.use(None)
    else:
        u = torch.tensor([1.0]); dist.all_reduce(u)
    dist.barrier()
"""


@pytest.mark.multirank
def test_stand_in_world_is_the_first_ranks_on_this_thread_only(tmp_path):
    """Ranks 0 and 1 of 4 make their group the world of their main thread: collectives with
    no group, rank and world size are theirs; ranks keep their global numbers in other
    groups; another thread, and the block in `real_world()`, see all 4."""
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(STAND_IN_RANKS))
    torchrun = Path(sys.executable).with_name("torchrun")
    out = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "4", str(script)],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = sorted(ln for ln in out.stdout.splitlines() if ln[:1].isdigit())
    assert lines == [f"{r} 2 {r} 3.0 [0, 1] [4] 4 4.0 -1" for r in (0, 1)]
