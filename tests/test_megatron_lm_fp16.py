"""Real Megatron-LM switching an fp16 job (dynamic loss scaling) against its own restart, on
both releases: an MoE job, so that megatron-core's ChainedOptimizer holds two optimizers
(dense and expert parameters), each with its own loss scaler; tp1pp2ep2dp2 ->
tp1pp1ep4dp4. The scale starts at 4096 and doubles after every 2 steps without overflow
(`--loss-scale-window 2`), so at the switch after iteration 3 each scaler is half-way
through a window: B's first step doubles the scale only if the scale and the growth
tracker were both carried (a fresh scaler, as B had before, starts over at 4096). Two
torchrun jobs on 4 gloo ranks (`switch_and_restart(own_save=True)`)."""
import re

import pytest

from megatron_lm_runs import (CPU_FLAGS, MOCK_DATA, TINY_MODEL, assert_final_checkpoints_identical,
                              assert_losses_as_restart, assert_switched_as_scheduled,
                              layout_flags, switch_and_restart)
from megatron_lm_tree import require_snapshot

pytestmark = [pytest.mark.multirank, pytest.mark.every_release]

K, N = 3, 6
A, B = "tp1pp2ep2etp1dp2", "tp1pp1ep4etp1dp4"
FP16 = ["--fp16", "--initial-loss-scale", "4096", "--loss-scale-window", "2",
        "--hysteresis", "2", "--num-experts", "4", "--moe-router-topk", "2",
        "--moe-ffn-hidden-size", "64"]
SCALE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?loss scale: ([0-9.]+)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_snapshot()
    common = (CPU_FLAGS + TINY_MODEL + MOCK_DATA + FP16
              + ["--eval-interval", "1000", "--train-iters", str(N)])
    return switch_and_restart(
        tmp_path_factory.mktemp("megatron-lm-fp16"), common,
        layout_flags(1, 2, expert_model_parallel_size=2),
        layout_flags(1, 1, expert_model_parallel_size=4), B, K, own_save=True)


def test_the_loss_scale_after_the_switch_is_the_restarts(runs):
    assert re.search(r"^\s+fp16 \.+ True$", runs["switched"], re.M)
    assert_switched_as_scheduled(runs["switched"], K, A, B)
    ours = {int(i): s for i, s in SCALE.findall(runs["switched"])}
    theirs = {int(i): s for i, s in SCALE.findall(runs["resumed"])}
    assert [ours[i] for i in range(1, K + 1)] == ["4096.0", "8192.0", "8192.0"]
    assert {i: ours[i] for i in theirs} == theirs
    assert theirs[K + 1] == "16384.0"  # the window A began, completed at B


def test_losses_after_the_switch_are_the_restarts(runs):
    assert_losses_as_restart(runs, K, N)


def test_final_checkpoints_with_both_scalers_are_bit_identical(runs):
    # the common state (both optimizers' param groups and loss scalers) is compared too
    assert_final_checkpoints_identical(runs, N)
