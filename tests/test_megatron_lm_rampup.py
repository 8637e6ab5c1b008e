"""A batch-size ramp switches inside real Megatron-LM, as its own restart continues it: one
job of 4 gloo ranks trained by samples (`--train-samples 40`) with `--rampup-batch-size 4 4
16` to a global batch of 8 (iterations 1-4 at 4 samples, 5-7 at 8), switched after
iteration 3, in the ramp, from tp1pp2dp2 to tp2pp2dp1 (one micro-batch of 2 per DP rank and
step becomes two), against Megatron-LM's own `--save` at 3 and `--load` at tp2pp2dp1.

Only core_v0.16.1's Megatron-LM runs the ramp (core_v0.19.0 parses the flag but builds its
micro-batch calculator without it), so the test runs there (`DYNATRAIN_MEGATRON_LM=
core_v0.16.1`, `make test`'s every-release pass). Checked: every iteration's global batch
as Megatron-LM printed it is the restart's (the ramp continues at B from its position, not
from its start nor at its end), the switch lands after 3, the final checkpoints are
bit-identical and every loss after 3 is the restart's.
"""
import re

import pytest

from megatron_lm_runs import (CPU_FLAGS, MOCK_DATA, TINY_MODEL, assert_final_checkpoints_identical,
                              assert_losses_as_restart, assert_switched_as_scheduled,
                              layout_flags, switch_and_restart)
from megatron_lm_tree import release_name, require_snapshot

pytestmark = [pytest.mark.multirank, pytest.mark.every_release]

K, N = 3, 7
BATCH = re.compile(r"\] iteration\s+(\d+)/\s*\d+ \|.*?global batch size:\s+(\d+) \|")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_snapshot()
    if release_name() != "core_v0.16.1":
        pytest.skip(f"{release_name()}'s Megatron-LM builds no batch-size ramp")
    model = list(TINY_MODEL)
    i = model.index("--lr-warmup-iters")
    model[i:i + 2] = ["--lr-warmup-samples", "4"]  # trained by samples: warm-up in samples
    common = CPU_FLAGS + model + MOCK_DATA + [
        "--eval-interval", "1000", "--train-samples", "40",
        "--rampup-batch-size", "4", "4", "16"]
    return switch_and_restart(tmp_path_factory.mktemp("rampup"), common, layout_flags(1, 2),
                              layout_flags(2, 2), "tp2pp2dp1", K, own_save=True)


def test_the_ramp_continues_at_b_as_after_megatron_lm_restart(runs):
    ours = dict(BATCH.findall(runs["switched"]))
    theirs = dict(BATCH.findall(runs["resumed"]))
    assert ours == {str(i): "4" if i <= 4 else "8" for i in range(1, N + 1)}, ours
    assert theirs == {k: v for k, v in ours.items() if int(k) > K}, theirs
    assert_switched_as_scheduled(runs["switched"], K, "tp1pp2dp2", "tp2pp2dp1")


def test_final_checkpoints_are_bit_identical(runs):
    assert_final_checkpoints_identical(runs, N)


def test_losses_match_megatron_lm_restart(runs):
    assert_losses_as_restart(runs, K, N)
