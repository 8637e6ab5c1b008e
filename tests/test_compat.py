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


SHAPE = (32, 2, 64)  # (sequence, micro-batch, hidden) of an activation between stages


def _activation(k: int, dtype_name: str):
    import torch

    g = torch.Generator().manual_seed(k)
    return torch.randn(SHAPE, generator=g).to(getattr(torch, dtype_name))


def overlapped_sends_then_deallocate(dtype_name: str, rounds: int) -> list:
    """Two pipeline stages driven as megatron's interleaved warm-up drives them with
    `overlap_p2p_comm`: stage 0 sends each activation with an unwaited isend, waits for the
    previous send only, then pseudo-frees the activation (`deallocate_output_tensor`) and
    goes on allocating; stage 1 receives. Returns stage 1's received activations."""
    import torch
    import torch.distributed as dist
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

    from dynatrain_megatron.compat import prepare_runtime

    prepare_runtime()
    dtype = getattr(torch, dtype_name)
    config = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=dtype,
                                 batch_p2p_comm=False, overlap_p2p_comm=True,
                                 deallocate_pipeline_outputs=True)
    comm = P2PCommunicator(dist.new_group([0, 1]), config)
    received, pending = [], None
    for k in range(rounds):
        if dist.get_rank() == 0:
            weight = torch.ones((), dtype=dtype, requires_grad=True)
            output = _activation(k, dtype_name) * weight  # has a grad_fn, as a stage's output
            _, handles = comm.send_forward_recv_forward(output, recv_prev=False,
                                                        tensor_shape=SHAPE, overlap_p2p_comm=True)
            if pending is not None:
                pending.wait()
            pending = handles.pop("send_next")
            deallocate_output_tensor(output, config.deallocate_pipeline_outputs)
            scratch = [torch.full(SHAPE, float("nan"), dtype=dtype) for _ in range(4)]
            dist.barrier()  # the receive is posted only now, after the memory was reused
            del scratch
        else:
            dist.barrier()
            tensor, handles = comm.send_forward_recv_forward(None, recv_prev=True,
                                                             tensor_shape=SHAPE,
                                                             overlap_p2p_comm=True)
            handles["recv_prev"].wait()
            received.append(tensor.detach().clone())
    if pending is not None:
        pending.wait()
    return received


def test_overlapped_p2p_send_survives_output_deallocation():
    """Megatron-LM's VPP schedule on gloo: an activation pseudo-freed while its isend is in
    flight still arrives bit-for-bit (compat.cpu item 7); without it the next stage got the
    freed memory's new contents (NaN losses in bf16)."""
    import torch

    from dynatrain_megatron.testing.multiproc import run_on_ranks

    for dtype_name in ("bfloat16", "float32"):
        rounds = 4
        got = run_on_ranks(overlapped_sends_then_deallocate, 2, dtype_name, rounds)[1]
        assert len(got) == rounds
        for k, t in enumerate(got):
            want = _activation(k, dtype_name)
            assert t.dtype == want.dtype and torch.equal(t.view(torch.uint8),
                                                         want.view(torch.uint8)), (dtype_name, k)


STAND_IN_RANKS = """
    import os, sys, threading
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
        row = (r, dist.get_world_size(), dist.get_rank(), t.item(), out, seen, real, u.item(),
               dist.get_rank(last))
        with open(os.path.join(sys.argv[1], f"rank{r}.txt"), "w") as f:  # not the shared stdout
            f.write(" ".join(map(str, row)))
        S.use(None)
    else:
        u = torch.tensor([1.0]); dist.all_reduce(u)
    dist.barrier()
    dist.destroy_process_group()  # gloo may abort in teardown at exit otherwise (any rank)
"""


@pytest.mark.multirank
def test_stand_in_world_is_the_first_ranks_on_this_thread_only(tmp_path):
    """Ranks 0 and 1 of 4 make their group the world of their main thread: collectives with
    no group, rank and world size are theirs; ranks keep their global numbers in other
    groups; another thread, and the block in `real_world()`, see all 4."""
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(STAND_IN_RANKS))
    torchrun = Path(sys.executable).with_name("torchrun")
    out = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "4", str(script),
                          str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert lines == [f"{r} 2 {r} 3.0 [0, 1] [4] 4 4.0 -1" for r in (0, 1)]


def test_torch_compile_of_a_function_is_deferred_to_its_first_call():
    """On the CPU, megatron-core's import-time `torch.compile` decorations no longer import
    TorchInductor; a decorated function still compiles (with its options) at its first
    call and returns what the compiled function returns; modules go to torch.compile."""
    out = _run("""
        import sys, torch
        from dynatrain_megatron.compat import cpu
        calls = []
        def fake(model, **options):
            calls.append((getattr(model, "__name__", type(model).__name__), options))
            return lambda *a, **k: ("compiled", model(*a, **k))
        torch.compile = fake
        assert cpu.defer_torch_compile() is True and cpu.defer_torch_compile() is True
        @torch.compile
        def f(x):
            return x + 1
        @torch.compile(fullgraph=True)
        def g(x):
            return x * 2
        assert calls == [] and f.__name__ == "f"
        assert f(1) == ("compiled", 2) and f(2) == ("compiled", 3) and g(3) == ("compiled", 6)
        assert calls == [("f", {}), ("g", {"fullgraph": True})], calls
        m = torch.nn.Linear(2, 2)
        assert torch.compile(m)(torch.ones(2))[0] == "compiled" and calls[-1][0] == "Linear"
        print("ok")
    """)
    assert out.splitlines()[-1] == "ok"
    out = _run("""
        import sys
        from dynatrain_megatron.compat import cpu
        cpu.defer_torch_compile()
        import megatron.core
        from megatron.core.models.gpt import GPTModel
        print("torch._inductor.compile_fx" in sys.modules)
    """)
    assert out.splitlines()[-1] == "False"


def test_the_forked_checkpoint_manager_holds_none_of_the_ranks_sockets():
    """`--save`'s results-queue manager is forked on the CPU (compat/megatron_lm.py): it must
    not keep the rank's sockets (its process groups' connections) open, or a rank that dies
    leaves its peers blocked until their collective timeout instead of failing at once."""
    out = _run("""
        import os, socket, stat
        from dynatrain_megatron.compat import megatron_lm as M
        a, b = socket.socketpair()
        mine = {os.fstat(s.fileno()).st_ino for s in (a, b)}
        m = M.forked_manager()
        q = m.Queue(); q.put(7)
        pid = m._process.pid
        theirs = set()
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                st = os.stat(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            if stat.S_ISSOCK(st.st_mode):
                theirs.add(st.st_ino)
        a.close()
        b.recv(1)  # EOF at once: the only other holder of `a` was this process
        print(q.get(), bool(mine & theirs), len(theirs) > 0)
        m.shutdown()
    """)
    assert out.splitlines()[-1] == "7 False True"  # the queue works on its own socket


def test_the_forked_checkpoint_manager_ends_with_a_rank_that_dies():
    """A rank killed without running its exit handlers (`os._exit`, as the fault plans and a
    crash end it) must not leave its forked results-queue manager running: before this,
    every rank-death test left one `pretrain_gpt.py` process behind."""
    import time

    from dynatrain_megatron.compat.megatron_lm import PARENT_POLL_SECONDS

    out = _run("""
        import os
        from dynatrain_megatron.compat import megatron_lm as M
        m = M.forked_manager()
        q = m.Queue(); q.put(7)
        print(q.get(), m._process.pid, flush=True)
        os._exit(0)  # no exit handlers: they would shut the manager down
    """)
    value, pid = out.splitlines()[-1].split()
    assert value == "7"
    deadline = time.monotonic() + 10 + 4 * PARENT_POLL_SECONDS
    while _alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(int(pid)), f"the manager {pid} outlived its rank"


def test_a_forked_checkpoint_manager_that_never_starts_is_killed_and_forked_again():
    """Forked mid-training beside gloo's threads, the manager's process can hang before it
    runs (fork_watch: CPython gh-112275), and its parent would wait for its address forever,
    at the job's first `--save`. Planted here: the first fork never starts."""
    out = _run("""
        from dynatrain_megatron import fork_watch
        from dynatrain_megatron.compat import megatron_lm as M
        fork_watch.START_TIMEOUT_S = 2.0
        watches, pids = [], []
        init, forked_pid = fork_watch.StartWatch.__init__, M._forked_pid
        def first_sticks(self, stick_first=False):
            watches.append(self)
            init(self, stick_first=len(watches) == 1)
        fork_watch.StartWatch.__init__ = first_sticks
        M._forked_pid = lambda *a: pids.append(forked_pid(*a)) or pids[-1]
        m = M.forked_manager()
        q = m.Queue(); q.put(7)
        print(q.get(), len(watches), pids[0] != pids[1], m._process.pid == pids[1], pids[0])
        m.shutdown()
    """)
    value, watches, differ, second, first = out.splitlines()[-1].split()
    assert (value, watches, differ, second) == ("7", "2", "True", "True")
    assert not _alive(int(first))  # the stuck one was killed


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (its parent, init, reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_grouped_gemm_stand_in_is_a_matmul_per_expert():
    """`grouped_gemm.ops.gmm` on the CPU: rows of each expert times its matrix (`trans_b`:
    its transpose), an expert with no rows gets none and a zero gradient; megatron-core's
    GroupedMLP finds it, and Megatron-LM's grouped-GEMM device check passes."""
    out = _run("""
        import torch
        from dynatrain_megatron.compat import cpu
        assert cpu.apply_if_needed()
        from megatron.core.transformer.moe import grouped_gemm_util as gg
        assert gg.grouped_gemm_is_available() and gg.ops.gmm is cpu.gmm
        assert torch.cuda.get_device_capability()[0] >= 8
        g = torch.Generator().manual_seed(0)
        a = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
        b = torch.randn(3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
        sizes = torch.tensor([2, 0, 5])
        out = gg.ops.gmm(a, b, sizes, trans_b=False)
        want = torch.cat([a[:2] @ b[0], a[2:] @ b[2]])
        assert torch.equal(out, want)
        out.sum().backward()
        assert torch.equal(b.grad[1], torch.zeros(4, 5))
        a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        torch.cat([a2[:2] @ b2[0], a2[2:] @ b2[2]]).sum().backward()
        assert torch.equal(a.grad, a2.grad) and torch.equal(b.grad, b2.grad)
        bt = b.detach().transpose(1, 2).contiguous()
        ad = a.detach()
        assert torch.equal(cpu.gmm(ad, bt, sizes, trans_b=True),
                           torch.cat([ad[:2] @ bt[0].t(), ad[2:] @ bt[2].t()]))
        try:
            cpu.gmm(a.detach(), b.detach(), torch.tensor([1, 1, 1]))
        except ValueError as e:
            print("refused:", e)
    """)
    assert out.startswith("refused: gmm: 3 batch sizes summing to 3 for 3 experts and 7 rows")


def test_seeding_a_layout_draws_as_torch_manual_seed_and_reads_no_source_file():
    """A switch seeds B's RNGs in its pause; `torch.manual_seed` would also queue lazy
    seeds for devices never used (XPU, MTIA), recording the caller's stack, which reads
    source files from disk: the pause must not, and the generators must end the same."""
    out = _run("""
        import traceback, types, torch
        from dynatrain_megatron.compat import cpu
        cpu.apply_if_needed()
        from megatron.core.tensor_parallel import random as r
        from dynatrain_megatron.mcore.builders import seed_rngs
        torch.manual_seed(1234 + 100)
        ref = torch.get_rng_state()
        torch.manual_seed(5)
        def captured(*a, **k):
            raise AssertionError("a stack was captured while seeding")
        traceback.format_stack = traceback.extract_stack = captured
        coords = types.SimpleNamespace(tp=1, pp=1, ep=0, etp=0)
        seed_rngs(1234, types.SimpleNamespace(coords=lambda: coords))
        print(torch.equal(torch.get_rng_state(), ref),
              sorted(r.get_cuda_rng_tracker().get_states()))
    """)
    assert out.startswith("True [") and "'model-parallel-rng'" in out, out
