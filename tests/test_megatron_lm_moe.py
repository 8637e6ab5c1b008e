"""Real Megatron-LM switching an MoE job on a real indexed dataset, against Megatron-LM's own
restart. Three jobs of the snapshot's pretrain_gpt.py on 4 gloo ranks, as in
test_megatron_lm_train.py, check at once:

* MoE expert parallelism 2 -> 4 (`--num-experts 4 --expert-model-parallel-size 2`, then ep4);
* a data-parallel change on a real indexed dataset (dp2 -> dp4), made from a text corpus by
  the snapshot's own `tools/preprocess_data.py` (`megatron_lm_data.py`): after it the data
  order must continue as Megatron-LM's resume from a checkpoint continues it;
* uneven pipeline stages at A (`--decoder-first-pipeline-num-layers 1`: 1 + 3 layers), none
  at B (pp2 -> pp1). (Megatron-LM's own restart is exact here only with our fix of
  megatron-core's reshardable optimizer save, `compat/megatron_fixes.py` item 4: its
  checkpoint shifted the state of a parameter after a padded bucket end);
* `--eval-interval` evaluation before and after the switch, and after training;
* a switch whose B cannot be built: the schedule also asks for C after iteration 1, and a
  fault plan makes building C fail on rank 1 (`DYNATRAIN_FAULTS` with `dst_layout`). That
  switch is rolled back on every rank and training goes on at A; since the final state must
  still equal the restart's bit for bit, the attempt left nothing behind.

The runs: switched (patched, `--dynatrain-schedule` switches after K, trains to N, saves);
saved (the UNPATCHED tree trains A to K and saves); resumed (patched, no `--dynatrain`,
loads at B, trains to N, saves). The final checkpoints must be equal bit for bit as logical
tensors, and every loss Megatron-LM prints must agree with the run that trained that
iteration at the same layout history.
"""
import json
import re

import pytest

from megatron_lm_data import build_indexed_dataset
from megatron_lm_runs import (CPU_FLAGS, TINY_MODEL, assert_final_checkpoints_identical,
                              assert_losses_as_restart, assert_switched_as_scheduled,
                              layout_flags, switch_and_restart, validation_losses)
from megatron_lm_tree import require_snapshot

pytestmark = pytest.mark.multirank

K, N = 3, 6
A, B = "tp1pp2ep2etp1ppf1dp2", "tp1pp1ep4etp1dp4"
C = "tp1pp1ep2etp1dp4"  # a layout that fails to build (injected) after iteration 1
FAIL_C = {"DYNATRAIN_FAULTS": json.dumps({"fail_rank": 1, "fail_phase": "prepare",
                                          "dst_layout": C})}
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    snapshot = require_snapshot()
    w = tmp_path_factory.mktemp("megatron-lm-moe")
    data = build_indexed_dataset(snapshot, w / "data")
    a = layout_flags(1, 2, expert_model_parallel_size=2, decoder_first_pipeline_num_layers=1)
    b = layout_flags(1, 1, expert_model_parallel_size=4)
    common = (CPU_FLAGS + TINY_MODEL + MOE + data
              + ["--split", "90,10,0", "--eval-interval", "2", "--train-iters", str(N)])
    return switch_and_restart(w, common, a, b, B, K, before=[(1, C)], env=FAIL_C)


def test_trains_on_the_indexed_dataset(runs):
    for name in ("switched", "saved", "resumed"):  # Megatron-LM's own print of its args
        args = dict(re.findall(r"^\s+(\w+) \.+ (.*)$", runs[name], re.M))
        assert args["mock_data"] == "False" and "corpus_text_document" in args["data_path"]


def test_switch_lands_exactly_after_the_scheduled_iteration(runs):
    # every rank once (the log line is per rank), none rolled back
    assert_switched_as_scheduled(runs["switched"], K, A, B, rolled_back=True)


def test_a_switch_that_cannot_be_built_leaves_training_at_a(runs):
    text = runs["switched"]
    # rank 1's build of C failed; every rank learned it at the first vote and rolled back
    assert "fault injection: rank 1 fails in phase prepare" in text
    assert text.count("switch rolled back; training continues at " + A) == 4
    assert "switches rolled back: 1" in text
    # training went on at A: the losses up to K equal the unpatched tree's, and the final
    # state the restart's (test_losses_match_megatron_lm_restart, test_final_checkpoints_...)


def test_final_checkpoints_are_bit_identical(runs):
    ours = assert_final_checkpoints_identical(runs, N)
    experts = [k for k in ours if ".experts." in k and not k.startswith("optimizer")]
    assert experts  # the experts' weights are among them (whole, all 4 experts)


def test_losses_match_megatron_lm_restart(runs):
    assert_losses_as_restart(runs, K, N)  # as in test_megatron_lm_train.py


def test_evaluation_before_and_after_the_switch(runs):
    sw, saved, resumed = (validation_losses(runs[k]) for k in ("switched", "saved", "resumed"))
    # during training at 2 (at A), 4 and 6 (at B), and once more after training
    assert set(sw) == {(2, False), (4, False), (6, False), (N, True)}
    assert sw[(2, False)] == saved[(2, False)]
    for key in ((4, False), (6, False), (N, True)):
        assert sw[key] == resumed[key], key
