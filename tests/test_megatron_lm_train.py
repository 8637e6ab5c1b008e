"""Real Megatron-LM (the snapshot's own pretrain_gpt.py, copied and patched) switching its
layout in memory, against Megatron-LM's own restart. One group of three torchrun jobs on 4
gloo ranks checks many things:

* switched: patched, `--dynatrain`, a bf16 tp2pp2vpp2 job trains, a `--dynatrain-schedule`
  switch lands exactly after iteration K at tp1pp2vpp2dp2, training goes on to N and
  `--save`s there;
* saved: the UNPATCHED tree (the CPU runtime from a sitecustomize, as the patch would give
  it) trains tp2pp2vpp2 to K and saves (`--dist-ckpt-optim-fully-reshardable`);
* resumed: patched, without `--dynatrain`, `--load`s that at tp1pp2vpp2dp2 and trains to N.

The two final checkpoints must be equal entry for entry, bit for bit, as logical tensors
(read with torch.distributed.checkpoint, whatever layout wrote them); the switched run's
losses before K equal the unpatched tree's (a patched, switch-enabled run trains as
Megatron-LM does), and after K equal the restart's, iteration by iteration, once the
restart's second print is read as the two-iteration mean Megatron-LM prints there (see
`test_losses_match_megatron_lm_restart`).
"""
import re

import pytest

from megatron_lm_runs import (CPU_FLAGS, TINY_GPT, checkpoint_tensors, differences, layout_flags,
                              log_windows, losses, printable_means, run_megatron_lm)
from megatron_lm_tree import copy_tree, require_snapshot

pytestmark = pytest.mark.multirank

K, N = 3, 6
# both with virtual pipeline stages (2 per rank, one layer each): Megatron-LM then runs its
# interleaved schedule with overlapped P2P, our B our own (batched P2P)
A, B = "tp2pp2vpp2dp1", "tp1pp2vpp2dp2"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_snapshot()
    w = tmp_path_factory.mktemp("megatron-lm")
    patched = copy_tree(w / "patched", patched=True)
    unpatched = copy_tree(w / "unpatched", patched=False)
    sched = w / "schedule.yaml"
    sched.write_text(f"- {{iteration: {K}, layout: {B}}}\n")
    # bf16: the stricter case (an fp32 run hides numerics a rebuilt B could get wrong, e.g.
    # the attention softmax's precision); fp32 was checked the same way by hand
    vpp = dict(num_layers_per_virtual_pipeline_stage=1)
    a, b = layout_flags(2, 2, **vpp) + ["--bf16"], layout_flags(1, 2, **vpp) + ["--bf16"]
    common = CPU_FLAGS + TINY_GPT + ["--train-iters", str(N)]
    switched = run_megatron_lm(
        patched, 4, common + a + ["--save", str(w / "switched"), "--save-interval", "1000",
                                  "--dynatrain", "--dynatrain-schedule", str(sched)],
        w / "switched.log")
    saved = run_megatron_lm(
        unpatched, 4, common + a + ["--save", str(w / "saved"), "--save-interval", str(K),
                                    "--exit-interval", str(K)],
        w / "saved.log", patched=False)
    resumed = run_megatron_lm(
        patched, 4, common + b + ["--load", str(w / "saved"), "--save", str(w / "resumed"),
                                  "--save-interval", "1000"],
        w / "resumed.log")
    return dict(w=w, switched=switched, saved=saved, resumed=resumed)


def test_switch_lands_exactly_after_the_scheduled_iteration(runs):
    lines = re.findall(r"iteration (\d+): switched (\S+) -> (\S+) .*", runs["switched"])
    assert lines and all(ln[:3] == (str(K), A, B) for ln in lines)
    assert all("as scheduled" in m.group(0)
               for m in re.finditer(r"iteration \d+: switched .*", runs["switched"]))
    # every rank switched once (the log line is per rank), none rolled back
    assert len(lines) == 4 and "rolled back" not in runs["switched"]


def test_final_checkpoints_are_bit_identical(runs):
    w = runs["w"]
    ours = checkpoint_tensors(w / "switched", N)
    theirs = checkpoint_tensors(w / "resumed", N)
    # the model, fp32 main params and both Adam moments of every tensor, the scheduler,
    # the optimizer's param groups and step: everything but the per-rank RNG states
    # (no dropout here: no RNG is drawn in training; a switch does not carry them)
    diff = differences(ours, theirs, skip=lambda k: k.startswith("rng_state"))
    assert not diff, diff[:10]
    kinds = {k.split(".")[2] for k in ours if k.startswith("optimizer.state.")}
    assert kinds == {"exp_avg", "exp_avg_sq", "param"}  # param: the fp32 main copy
    assert len(ours) > 60


def test_losses_match_megatron_lm_restart(runs):
    sw, saved, resumed = (losses(runs[k]) for k in ("switched", "saved", "resumed"))
    assert sorted(sw) == list(range(1, N + 1)) and sorted(resumed) == list(range(K + 1, N + 1))
    # before the switch: the patched job trains exactly as the unpatched tree
    assert [sw[i] for i in range(1, K + 1)] == [saved[i] for i in range(1, K + 1)]
    # after it: as Megatron-LM's restart at B, every iteration. Each print is the mean over
    # its log window (`log_windows`): a Megatron-LM bug (NVIDIA/Megatron-LM#6237) makes the
    # second print of a process the mean of its first two iterations, so the restart prints
    # mean(K+1, K+2) at K+2, while the switched process, training since iteration 1, prints
    # K+2's own loss (its only mean is at iteration 2, as the unpatched tree's above).
    # The prints keep 7 digits, so the restart's mean is checked against every float32 sum
    # those digits allow (`printable_means`; a single iteration's set is its print alone).
    ours, theirs = log_windows(list(sw)), log_windows(list(resumed))
    assert theirs[K + 2] == [K + 1, K + 2]
    for i in range(K + 1, N + 1):
        assert all(ours[j] == [j] for j in theirs[i])
        window = [sw[j] for j in theirs[i]]
        assert resumed[i] in printable_means(window), (i, resumed[i], window)
