"""The RLHF loop inside real Megatron-LM (issue 30): code that owns its loop on Megatron-LM's
own training objects (`setup_model_and_optimizer`'s chunks, optimizer and scheduler, its
`train_step`) trains at A = tp2pp2dp1, switches the weights alone to G = tp2pp1dp2 (no
pipeline, two replicas), in bf16 (the weights at G in Megatron-LM's Float16Module, the
fp32 masters apart in the optimizer), generates with megatron-core's static engine and a
KV cache, switches back and trains on: the example examples/rlhf_megatron_lm.py (its
set-up and its rounds), run by tests/megatron_lm_rlhf_job.py beside a twin that never leaves A. One job on 4 gloo ranks
(about a minute on 2 cores); what it checks is in that script's docstring."""
import json

import pytest

from megatron_lm_runs import ROOT, CPU_FLAGS, TINY_GPT, layout_flags, run_megatron_lm
from megatron_lm_tree import copy_tree, require_snapshot

pytestmark = pytest.mark.multirank

A, G, ROUNDS, STEPS = "tp2pp2dp1", "tp2pp1dp2", 2, 1


@pytest.fixture(scope="module")
def rlhf(tmp_path_factory):
    require_snapshot()
    w = tmp_path_factory.mktemp("megatron-lm-rlhf")
    tree = copy_tree(w / "patched", patched=True)
    script = ROOT / "tests" / "megatron_lm_rlhf_job.py"
    result = w / "result.json"
    flags = CPU_FLAGS + TINY_GPT + layout_flags(2, 2) + [
        "--train-iters", "20", "--rlhf-generate", G, "--rlhf-rounds", str(ROUNDS),
        "--rlhf-train-steps", str(STEPS), "--rlhf-num-tokens", "4", "--rlhf-optimizer", "host",
        "--bf16"]
    log = run_megatron_lm(tree, 4, flags, w / "rlhf.log", script=script,
                          env={"RLHF_WORK": str(w), "RLHF_RESULT": str(result)})
    return dict(json.loads(result.read_text()), log=log)


def test_weights_at_g_alone_and_optimizer_parked_not_copied(rlhf):
    """At G every replica of every weight is A's, bit for bit, in bare chunks (no DDP, no
    optimizer); the optimizer state sits parked (its storages emptied, all of it parked):
    one copy of it exists meanwhile. Round 1 writes into round 0's kept chunks."""
    assert rlhf["twins_equal"] == []
    assert len(rlhf["at_g"]) == ROUNDS
    for r in rlhf["at_g"]:
        assert r["layout"] == G
        assert r["weights_equal"] and r["bare"] and r["emptied"] and r["parked_all"], r
        assert r["bytes_moved"] > 0
    assert rlhf["at_g"][0]["chunk"] == rlhf["at_g"][1]["chunk"]
    assert rlhf["at_g"][0]["bytes_moved"] == rlhf["at_g"][1]["bytes_moved"]
    assert rlhf["after_last_round"] == dict(state=[], rng=True, scalars=True)


def test_train_generate_train_equals_never_leaving_a(rlhf):
    """The full state (weights, fp32 masters, Adam moments), the optimizer step, the
    scheduler and the RNGs equal those of the twin that never left A, and so does every
    loss, bit for bit."""
    assert rlhf["losses"] == rlhf["ref_losses"]
    assert len(rlhf["losses"]) == ROUNDS * STEPS + 2
    assert rlhf["vs_never_left"] == []
    assert rlhf["rng_vs_never_left"] and rlhf["scalars_vs_never_left"]


def test_tokens_at_g_equal_megatron_core_from_a_checkpoint(rlhf):
    """Round 0's greedy tokens equal megatron-core's generation at G from a
    dist_checkpointing checkpoint of the same weights, loaded into chunks built at G."""
    assert rlhf["ckpt_missing"] == []
    assert rlhf["tokens"][0] == rlhf["ckpt_tokens"]
    assert all(len(t) == 4 for g in rlhf["tokens"] for t in g)


def test_elastic_job_refuses_missing_objects_and_provider():
    """Bad input: one-line errors before anything is read or built (no Megatron-LM run)."""
    from types import SimpleNamespace

    from dynatrain_megatron.api_types import ApiError
    from dynatrain_megatron.megatron_lm.job import elastic_job

    with pytest.raises(ApiError, match="model chunks, optimizer and scheduler"):
        elastic_job([], object(), object(), None, args=SimpleNamespace())
    with pytest.raises(ApiError, match="pass model_provider="):  # pytest has no provider
        elastic_job([object()], object(), object(), None, args=SimpleNamespace())
