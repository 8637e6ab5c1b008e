"""Real Megatron-LM switching two MoE variants against its own restart, on both releases.
Each case is two torchrun jobs on 4 gloo ranks (`switch_and_restart(own_save=True)`: the
switched run saves A's state at K itself and the restart `--load`s it at B); every loss
after K equals the restart's and the final checkpoints, experts included, are
bit-identical as logical tensors.

* etp: the expert-tensor-parallel size, tp1pp2ep2etp1dp2 -> tp2pp1ep2etp2dp2 (each expert's
  weights split over 2 ranks where they were whole; TP with sequence parallelism, PP
  2 -> 1). Megatron-LM allows MoE biases only at ETP 1, so the job has none.
* fp16: dynamic loss scaling, tp1pp2ep2dp2 -> tp1pp1ep4dp4. megatron-core's
  ChainedOptimizer holds two optimizers (dense and expert parameters), each with its own
  loss scaler. The scale starts at 4096 and doubles after every 2 steps without overflow
  (`--loss-scale-window 2`), so at the switch after iteration 3 each scaler is half-way
  through a window: B's first step doubles the scale only if the scale and the growth
  tracker were both carried (a fresh scaler starts over at 4096).
"""
import re

import pytest

from megatron_lm_runs import (CPU_FLAGS, MOCK_DATA, TINY_MODEL, assert_final_checkpoints_identical,
                              assert_losses_as_restart, assert_switched_as_scheduled,
                              layout_flags, switch_and_restart)
from megatron_lm_tree import require_snapshot

pytestmark = [pytest.mark.multirank, pytest.mark.every_release]

K, N = 3, 6
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64"]
CASES = {  # name: (flags, flags at A, flags at B, A, B)
    "etp": (MOE + ["--sequence-parallel", "--disable-bias-linear"],
            layout_flags(1, 2, expert_model_parallel_size=2),
            layout_flags(2, 1, expert_model_parallel_size=2, expert_tensor_parallel_size=2),
            "tp1pp2ep2etp1dp2", "tp2pp1ep2etp2dp2"),
    "fp16": (MOE + ["--fp16", "--initial-loss-scale", "4096", "--loss-scale-window", "2",
                    "--hysteresis", "2"],
             layout_flags(1, 2, expert_model_parallel_size=2),
             layout_flags(1, 1, expert_model_parallel_size=4),
             "tp1pp2ep2etp1dp2", "tp1pp1ep4etp1dp4"),
}
SCALE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?loss scale: ([0-9.]+)")


@pytest.fixture(scope="module", params=sorted(CASES))
def runs(request, tmp_path_factory):
    require_snapshot()
    flags, a, b, lay_a, lay_b = CASES[request.param]
    common = (CPU_FLAGS + TINY_MODEL + MOCK_DATA + flags
              + ["--eval-interval", "1000", "--train-iters", str(N)])
    out = switch_and_restart(tmp_path_factory.mktemp(f"megatron-lm-{request.param}"), common,
                             a, b, lay_b, K, own_save=True)
    return dict(out, case=request.param, A=lay_a, B=lay_b)


def _printed(text: str, name: str) -> str:
    return re.search(rf"^\s+{name} \.+ (.*)$", text, re.M).group(1)


def test_switch_lands_exactly_after_the_scheduled_iteration(runs):
    assert_switched_as_scheduled(runs["switched"], K, runs["A"], runs["B"])


def test_the_restart_ran_at_etp2(runs):
    if runs["case"] != "etp":
        pytest.skip("the etp case")
    assert _printed(runs["switched"], "expert_tensor_parallel_size") == "1"
    assert _printed(runs["resumed"], "expert_tensor_parallel_size") == "2"
    assert _printed(runs["resumed"], "sequence_parallel") == "True"


def test_the_loss_scale_after_the_switch_is_the_restarts(runs):
    if runs["case"] != "fp16":
        pytest.skip("the fp16 case")
    assert _printed(runs["switched"], "fp16") == "True"
    ours = {int(i): s for i, s in SCALE.findall(runs["switched"])}
    theirs = {int(i): s for i, s in SCALE.findall(runs["resumed"])}
    assert [ours[i] for i in range(1, K + 1)] == ["4096.0", "8192.0", "8192.0"]
    assert {i: ours[i] for i in theirs} == theirs
    assert theirs[K + 1] == "16384.0"  # the window A began, completed at B


def test_losses_after_the_switch_are_the_restarts(runs):
    assert_losses_as_restart(runs, K, N)


def test_final_checkpoints_with_the_experts_are_bit_identical(runs):
    # the common state (the optimizers' param groups and loss scalers) is compared too
    ours = assert_final_checkpoints_identical(runs, N)
    # the experts' weights and both Adam moments of them are among what was compared
    for prefix in ("decoder.layers.mlp.experts.", "optimizer.state.exp_avg.decoder.layers.mlp."
                   "experts.", "optimizer.state.exp_avg_sq.decoder.layers.mlp.experts."):
        assert any(k.startswith(prefix) and "weight" in k for k in ours), (prefix, sorted(ours))
