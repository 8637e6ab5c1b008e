"""The CPU runtime for megatron-core, on its own (issue: Foundation, item 3).

Run in a fresh interpreter: the runtime patches process-wide state, and we also want to see
that it does nothing when a CUDA device is reported."""
import subprocess
import sys
import textwrap


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
