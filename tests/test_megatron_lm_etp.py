"""Real Megatron-LM switching the expert-tensor-parallel size of an MoE job, against its own
restart: tp1pp2ep2etp1dp2 -> tp2pp1ep2etp2dp2 (TP 1 -> 2 with sequence parallelism, PP
2 -> 1, and each expert's weights split over 2 ranks where they were whole), on both
releases. Two torchrun jobs on 4 gloo ranks (`switch_and_restart(own_save=True)`): the
switched run saves A's state at K itself and the restart `--load`s it at B. Every loss after
K equals the restart's, and the final checkpoints (experts included) are bit-identical as
logical tensors. Megatron-LM allows MoE biases only at ETP 1, so the job has none.
"""
import re

import pytest

from megatron_lm_runs import (CPU_FLAGS, MOCK_DATA, TINY_MODEL, assert_final_checkpoints_identical,
                              assert_losses_as_restart, assert_switched_as_scheduled,
                              layout_flags, switch_and_restart)
from megatron_lm_tree import require_snapshot

pytestmark = [pytest.mark.multirank, pytest.mark.every_release]

K, N = 3, 6
A, B = "tp1pp2ep2etp1dp2", "tp2pp1ep2etp2dp2"
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
       "--sequence-parallel", "--disable-bias-linear"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_snapshot()
    common = (CPU_FLAGS + TINY_MODEL + MOCK_DATA + MOE
              + ["--eval-interval", "1000", "--train-iters", str(N)])
    return switch_and_restart(
        tmp_path_factory.mktemp("megatron-lm-etp"), common,
        layout_flags(1, 2, expert_model_parallel_size=2),
        layout_flags(2, 1, expert_model_parallel_size=2, expert_tensor_parallel_size=2),
        B, K, own_save=True)


def _printed(text: str, name: str) -> str:
    return re.search(rf"^\s+{name} \.+ (.*)$", text, re.M).group(1)


def test_the_restart_ran_at_etp2_and_the_switch_landed_there(runs):
    assert _printed(runs["switched"], "expert_tensor_parallel_size") == "1"
    assert _printed(runs["resumed"], "expert_tensor_parallel_size") == "2"
    assert _printed(runs["resumed"], "sequence_parallel") == "True"
    assert_switched_as_scheduled(runs["switched"], K, A, B)


def test_losses_after_the_switch_are_the_restarts(runs):
    assert_losses_as_restart(runs, K, N)


def test_final_checkpoints_with_the_experts_are_bit_identical(runs):
    ours = assert_final_checkpoints_identical(runs, N)
    # the experts' weights and both Adam moments of them are among what was compared
    for prefix in ("decoder.layers.mlp.experts.", "optimizer.state.exp_avg.decoder.layers.mlp."
                   "experts.", "optimizer.state.exp_avg_sq.decoder.layers.mlp.experts."):
        assert any(k.startswith(prefix) and "weight" in k for k in ours), (prefix, sorted(ours))
