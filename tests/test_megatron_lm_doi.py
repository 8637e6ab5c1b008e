"""Real Megatron-LM with two distributed-optimizer instances
(`--num-distributed-optimizer-instances 2`) switching its layout in memory: one job
of the snapshot's own pretrain_gpt.py (copied and patched) on 4 gloo ranks.

The job starts at tp1pp1doi2dp4, built by Megatron-LM itself (its groups, its partial
distributed optimizer: each Adam shard held by two ranks), trains N iterations in bf16 and
then, as scheduled, switches after iteration N to tp2pp1dp2 (TP 1 -> 2, DP 4 -> 2, one
optimizer instance): the wrap has to check Megatron-LM's instance groups, read state it
sharded over two instances, and move it to a layout that shards it once over all ranks.

Why one run and what it compares. A reference as in `test_megatron_lm_train.py` (an
unpatched save at A, a patched load at B) costs two more runs. Instead the job saves twice
at iteration N, with Megatron-LM's own save code both times:
  * before the switch, `checkpoint_and_decide_exit` writes a non-persistent (global)
    checkpoint of Megatron-LM's own objects at A (the patch calls the switch after it);
  * after it, `pretrain()`'s final save writes the objects the switch built at B.
Both hold the same training state, so they must be equal entry for entry, bit for bit, as
logical tensors: the model, the fp32 main params and both Adam moments of every tensor,
the scheduler, the optimizer's param groups and step, the iteration. That checks the new
part exactly where it could go wrong (Megatron-LM's doi2 objects, read and moved, against
Megatron-LM's own view of them), at the cost of one run. What it leaves out: training on
after such a switch inside Megatron-LM's loop, which `test_megatron_lm_train.py` checks
against Megatron-LM's restart (one instance) and our own path checks for doi > 1
(`test_switch.py`). That the two checkpoints come from different layouts is asserted from
the `args` each saved, which also shows that Megatron-LM's `args` follow the switch
(`num_distributed_optimizer_instances` 2 -> 1).
"""
import re

import pytest
import torch

from megatron_lm_runs import (CPU_FLAGS, TINY_GPT, checkpoint_tensors, differences, layout_flags,
                              load_common, run_megatron_lm)
from megatron_lm_tree import copy_tree, require_snapshot

# also on every other release (make test): two optimizer instances
pytestmark = pytest.mark.multirank

N = 3
A, B = "tp1pp1doi2dp4", "tp2pp1dp2"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    require_snapshot()
    w = tmp_path_factory.mktemp("megatron-lm-doi")
    tree = copy_tree(w / "patched", patched=True)
    sched = w / "schedule.yaml"
    sched.write_text(f"- {{iteration: {N}, layout: {B}}}\n")
    flags = (CPU_FLAGS + TINY_GPT + ["--train-iters", str(N), "--bf16"]
             + layout_flags(1, 1, num_distributed_optimizer_instances=2)
             + ["--save", str(w / "ckpt"), "--save-interval", "1000",
                "--non-persistent-save-interval", str(N), "--non-persistent-ckpt-type", "global",
                "--dynatrain", "--dynatrain-schedule", str(sched)])
    log = run_megatron_lm(tree, 4, flags, w / "doi.log")
    return dict(w=w, log=log)


def _common(ckpt_dir):
    """The checkpoint's common (unsharded) part: args, iteration, scheduler, param groups."""
    return load_common(ckpt_dir / f"iter_{N:07d}")


def test_the_switch_lands_after_the_last_iteration(run):
    lines = re.findall(r"iteration (\d+): switched (\S+) -> (\S+) .*", run["log"])
    # one line for the switch (rank 0's), none rolled back
    assert lines == [(str(N), A, B)] and "rolled back" not in run["log"]
    assert "wrapping Megatron-LM's tp1pp1doi2dp4 job" in run["log"]


def test_checkpoints_before_and_after_the_switch_are_bit_identical(run):
    before, after = run["w"] / "ckpt" / "non_persistent", run["w"] / "ckpt"
    ours, theirs = checkpoint_tensors(after, N), checkpoint_tensors(before, N)
    # everything but the per-rank RNG states (keyed by rank coordinates; no dropout here)
    diff = differences(ours, theirs, skip=lambda k: k.startswith("rng_state"))
    assert not diff, diff[:10]
    kinds = {k.split(".")[2] for k in ours if k.startswith("optimizer.state.")}
    assert kinds == {"exp_avg", "exp_avg_sq", "param"}  # param: the fp32 main copy
    assert len(ours) > 60
    c_ours, c_theirs = _common(after), _common(before)
    assert "opt_param_scheduler" in c_ours and "optimizer" in c_ours
    assert not differences(c_ours, c_theirs, skip=lambda k: k == "args")
    # saved at A by Megatron-LM's objects and at B by the switched ones, with args to match
    layout = lambda a: (a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                        a.data_parallel_size, a.num_distributed_optimizer_instances)
    assert layout(c_theirs["args"]) == (1, 1, 4, 2) and layout(c_ours["args"]) == (2, 1, 2, 1)
