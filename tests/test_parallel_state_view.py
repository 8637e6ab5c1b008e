"""A thread's own view of megatron-core's parallel_state and Megatron-LM's args, and a build
that draws from none of the process's generators (`compat/parallel_state_view.py`,
`compat/private_rng.py`): what lets Megatron-LM build layout B in the background while A
trains. In one process, no process group: a view is filled through megatron-core's own
setters, and what each thread reads is compared."""
import threading

import pytest
import torch

from dynatrain_megatron.compat import parallel_state_view as psv
from dynatrain_megatron.compat.private_rng import private_rng


def _fill_b(target):
    # megatron-core's own setters, run on the view's namespace: B is pp rank 1 of 2
    target.set_pipeline_model_parallel_world_size(2)
    target.set_pipeline_model_parallel_rank(1)
    target.set_tensor_model_parallel_world_size(4)


def _in_thread(fn):
    out, err = {}, []

    def run():
        try:
            out["v"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            err.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out["v"]


@pytest.fixture
def process_state():
    from megatron.core import parallel_state as ps

    ps.set_pipeline_model_parallel_world_size(4)
    ps.set_pipeline_model_parallel_rank(3)
    ps.set_tensor_model_parallel_world_size(1)
    yield ps
    ps.set_pipeline_model_parallel_world_size(None)
    ps.set_pipeline_model_parallel_rank(None)
    ps.set_tensor_model_parallel_world_size(None)


def test_a_view_is_seen_by_its_thread_only_and_by_every_imported_name(process_state):
    from megatron.core.tensor_parallel import layers  # imported get_tensor_model_parallel_*

    ps = process_state
    view = psv.ParallelStateView(_fill_b)

    def in_b():
        with psv.in_view(view):
            return (ps.get_pipeline_model_parallel_rank(),
                    ps.get_pipeline_model_parallel_world_size(),
                    ps.is_pipeline_last_stage(), layers.get_tensor_model_parallel_world_size())

    assert _in_thread(in_b) == (1, 2, True, 4)
    # the process's own state (A's) is untouched, on this thread and on others
    a = (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
         ps.is_pipeline_last_stage(), layers.get_tensor_model_parallel_world_size())
    assert a == (3, 4, True, 1)
    assert _in_thread(lambda: ps.get_pipeline_model_parallel_rank()) == 3
    # a setter run in the view writes the view (a builder's set_virtual_... stays in B)
    with psv.in_view(view):
        ps.set_pipeline_model_parallel_rank(0)
        assert not ps.is_pipeline_last_stage()
    assert ps.get_pipeline_model_parallel_rank() == 3
    assert view.functions["get_pipeline_model_parallel_rank"]() == 0


def test_a_module_built_in_a_view_reads_its_metadata_in_it(process_state):
    ps = process_state
    view = psv.ParallelStateView(_fill_b)
    chunk = torch.nn.Linear(2, 2)
    psv.register(chunk, view)
    with psv.view_of(chunk):
        assert ps.get_pipeline_model_parallel_rank() == 1
    with psv.view_of(torch.nn.Linear(2, 2)):  # not built in a view: the process's state
        assert ps.get_pipeline_model_parallel_rank() == 3


_THREAD_ARGS = """
import argparse, threading
from dynatrain_megatron.compat.megatron_lm import prepare_megatron_lm
prepare_megatron_lm()  # what pretrain_gpt.py does first (the patch): the CPU runtime
from megatron.training import global_vars, get_args
from dynatrain_megatron.compat import parallel_state_view as psv
global_vars._GLOBAL_ARGS = argparse.Namespace(x="A")
seen = {}
def in_b():
    with psv.thread_args(argparse.Namespace(x="B")):
        seen["b"] = (global_vars.get_args().x, get_args().x)
t = threading.Thread(target=in_b); t.start(); t.join()
print("RESULT", seen["b"], global_vars.get_args().x, get_args().x)
"""


def test_thread_args_answer_get_args_on_their_thread_only():
    """With Megatron-LM's own global_vars (the snapshot's, in its own interpreter): the
    thread's args through the module and through a name imported before the view."""
    import subprocess
    import sys

    from megatron_lm_runs import job_env
    from megatron_lm_tree import require_snapshot

    tree = require_snapshot()
    proc = subprocess.run([sys.executable, "-c", _THREAD_ARGS], env=job_env(tree), cwd=tree,
                          capture_output=True, text=True, timeout=600)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line == ["RESULT ('B', 'B') A A"], proc.stdout[-2000:] + proc.stderr[-2000:]


def test_a_private_rng_build_leaves_the_process_generators_alone():
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(7)
    before = torch.get_rng_state()

    def build():
        with private_rng():
            torch.nn.Embedding(16, 8)  # draws in its constructor, whatever megatron says
            torch.nn.init.kaiming_uniform_(torch.empty(4, 4))
            torch.randn(3)
            with mrandom.get_cuda_rng_tracker().fork():  # swaps nothing here
                pass
        return torch.get_rng_state()

    assert torch.equal(_in_thread(build), before)
    # without it, the same construction moves the process's generator
    torch.nn.Embedding(16, 8)
    assert not torch.equal(torch.get_rng_state(), before)
