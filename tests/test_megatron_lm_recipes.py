"""Real recipes switch: jobs shaped as the models of our benchmarks, launched with their
recipes' own flags, switched in memory inside real Megatron-LM (the snapshot's
pretrain_gpt.py, patched) against Megatron-LM's own restart (the job's own `--save` at A,
made just before the switch, then `--load` at B by a new job). Layout B is built by Megatron-LM itself (`megatron_lm/builder.py`),
in the background while A trains.

One group of two jobs on 4 gloo ranks per recipe, each checking several things:

* llama: Llama-3.1-shaped: `--rotary-base 500000 --use-rope-scaling`, GQA, SwiGLU, RMSNorm,
  untied embeddings, bf16, biases on the query/key/value projection only (`--add-qkv-bias`,
  Qwen2's); the optimizer side `--lr-decay-style WSD` (decay
  within the run) and `--lr-warmup-init`; a TP *and* PP change, tp2pp1dp2 -> tp1pp2ppf1dp2:
  three layers with `--account-for-embedding-in-pipeline-split` (at pp2 the first stage
  holds one layer and the embedding), built from a user's `--spec` module (its norms keep
  an extra state that changes every step: ShardedObjects, carried; the pre-MLP norm's per
  data-parallel replica, so that a switch to tp1pp1dp4 scheduled after iteration 1 is
  refused, as dist_checkpointing's load would fail there), the distributed
  optimizer's buffers in `--ddp-num-buckets 2` padded buckets
  (`--ddp-pad-buckets-for-high-nccl-busbw`, `--overlap-grad-reduce`): planned from the live
  metadata.
* deepseek: DeepSeek-shaped attention: `--multi-latent-attention` with low-rank query and
  key-value projections (`--q-lora-rank 32 --kv-lora-rank 16`, split head sizes) and their
  norms (`--qk-layernorm`); aux-loss-free MoE (sigmoid scores, `--moe-router-enable-expert-bias`:
  a buffer each MoE layer's router trains), a dense first layer; one multi-token prediction
  layer (`--mtp-num-layers 1`, an MoE layer, beside a copy of the embedding on the last
  stage). Planned from every rank's live metadata (the analytic layout does not describe
  MTP or the bias). A TP, PP and DP change, tp2pp2dp1 -> tp1pp1dp4 (every column-parallel
  low-rank projection is re-split, experts' TP 2 -> 1). Without `--use-distributed-optimizer`
  (plain DDP: megatron-core's Float16OptimizerWithFloat16Params, every DP replica holding
  the fp32 main params and Adam moments of its shard): each of B's four replicas gets all
  of it.
* qwen_moe: Qwen3-MoE-shaped: `--qk-layernorm`, top-2 routing with the aux loss, a shared
  expert, `--moe-layer-freq [0,1,1]` (a dense first layer), `--rotary-base 1000000`,
  GQA, bf16, `--moe-grouped-gemm` (megatron-core 0.16's GroupedMLP: all local experts of a
  layer in two weights; on the CPU its kernel is `compat.cpu.gmm`, in both jobs); a PP, EP
  and DP change, tp1pp2ep2dp2 -> tp1pp1ep4dp4. Three layers with
  `--account-for-loss-in-pipeline-split`: at A the two pipeline stages have different layer
  counts and patterns (stage 0: dense + MoE, stage 1: MoE and the loss; the Layout's ppl1),
  which a B built with A's pipeline rank would get wrong. Trained by samples
  (`--train-samples 40`, micro-batches of 1) with `--rampup-batch-size 4 4 16` to a global
  batch of 8: core_v0.16.1 ramps (iterations 1-4 at 4, 5-7 at 8; the switch after 3 lands
  inside the ramp, B's DP 4 takes one micro-batch where A's DP 2 took two), and every
  iteration's global batch is the restart's; core_v0.19.0's Megatron-LM ignores the flag
  (5 iterations at 8).

Each: the switch lands after iteration K on every rank; the final checkpoints (model, fp32
main params, both Adam moments, scheduler, optimizer step) are bit-identical to the
restart's as logical tensors; every loss after K is the restart's.
"""
import re

import pytest
import torch

from megatron_lm_runs import (CPU_FLAGS, MOCK_DATA, TINY_MODEL, assert_final_checkpoints_identical,
                              assert_losses_as_restart, assert_switched_as_scheduled,
                              layout_flags, load_common, losses, switch_and_restart)
from megatron_lm_tree import release_name, require_snapshot

pytestmark = pytest.mark.multirank

K, N = 3, 6
LLAMA = ["--position-embedding-type", "rope", "--rotary-base", "500000", "--use-rope-scaling",
         "--group-query-attention", "--num-query-groups", "2", "--swiglu",
         "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear", "--bf16", "--ffn-hidden-size", "128",
         # WSD: warm-up 1, stable, then the last 2 iterations decay (after the switch)
         "--lr-decay-style", "WSD", "--lr-wsd-decay-style", "linear",
         "--lr-wsd-decay-iters", "2", "--lr-warmup-init", "1e-5",
         # a user's layer-spec module (planned from the live metadata: the analytic layout
         # cannot know what a user's module builds), whose input norms keep an extra state
         # (a ShardedObject, as Transformer Engine's FP8 state is)
         "--spec", "tests.megatron_lm_user_spec", "llama_layer_counting",
         # Qwen2's attention: biases on the query/key/value projection only (planned from
         # the live metadata: the analytic layout's biases are all or none)
         "--add-qkv-bias",
         # three layers, the embedding counted as a layer of the first stage: at pp2 stage 0
         # holds 1 layer, stage 1 holds 2 (the Layout's ppf1)
         "--num-layers", "3", "--account-for-embedding-in-pipeline-split",
         # the distributed optimizer's buffers padded for NCCL's bus bandwidth (to 2**16) and,
         # with --overlap-grad-reduce, cut into 2 buckets on the first stage (core_v0.16.1:
         # bucket size = parameters // 2; core_v0.19.0 hands num_buckets to Megatron-FSDP
         # only): its shards are read from its own bookkeeping
         "--ddp-num-buckets", "2", "--ddp-pad-buckets-for-high-nccl-busbw",
         "--overlap-grad-reduce"]
QWEN_MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
            "--moe-aux-loss-coeff", "1e-2", "--moe-shared-expert-intermediate-size", "32",
            "--moe-layer-freq", "[0,1,1]", "--moe-token-dispatcher-type", "alltoall",
            # three layers, the loss counted as a layer of the last stage: at pp2 stage 0
            # holds 2 (dense + MoE), stage 1 one MoE layer (the Layout's ppl1)
            "--num-layers", "3", "--account-for-loss-in-pipeline-split",
            "--moe-grouped-gemm",
            "--qk-layernorm", "--position-embedding-type", "rope", "--rotary-base", "1000000",
            "--group-query-attention", "--num-query-groups", "2", "--swiglu",
            "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights",
            "--disable-bias-linear", "--bf16", "--ffn-hidden-size", "96",
            # trained by samples with a batch-size ramp, micro-batches of 1 (so that every
            # batch of the ramp splits over B's DP 4): core_v0.16.1 ramps 4 -> 8 over the
            # first 16 samples (iterations 1-4 at 4, 5-7 at 8), core_v0.19.0 ignores the
            # flag (5 iterations at 8); the switch after 3 lands inside the ramp
            "--micro-batch-size", "1", "--lr-warmup-iters", "0", "--lr-warmup-samples", "4",
            "--train-samples", "40", "--rampup-batch-size", "4", "4", "16"]
# qwen_moe's iterations by release: core_v0.16.1's ramp (4 at 4 samples, 3 at 8) or 40 / 8
RAMPED = {"core_v0.16.1": {i: 4 if i <= 4 else 8 for i in range(1, 8)}}
BY_SAMPLES = {"qwen_moe"}
DEEPSEEK = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16",
            "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16",
            "--qk-layernorm", "--position-embedding-type", "rope", "--swiglu",
            "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights",
            "--disable-bias-linear", "--bf16", "--ffn-hidden-size", "128",
            # DeepSeek-V3's aux-loss-free MoE: sigmoid scores and a router expert bias (a
            # buffer), dense first layer; and multi-token prediction: planned from every
            # rank's live metadata, which the analytic layout does not describe
            "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
            "--moe-layer-freq", "[0,1,1,1]", "--moe-router-score-function", "sigmoid",
            "--moe-router-enable-expert-bias", "--mtp-num-layers", "1",
            "--sequence-parallel"]  # MoE with TP (at A) needs it
# recipes run as plain DDP: without the common --use-distributed-optimizer
PLAIN_DDP = {"deepseek"}
# a switch scheduled ahead of B's that must be refused: llama's pre-MLP norms keep one object
# per data-parallel replica, which DP 4 shards differently (dist_checkpointing's load fails)
REFUSED = {"llama": [(1, "tp1pp1dp4")]}
RECIPES = {  # name: (recipe flags, flags at A, flags at B, A, B)
    "llama": (LLAMA, layout_flags(2, 1), layout_flags(1, 2), "tp2pp1dp2", "tp1pp2ppf1dp2"),
    "qwen_moe": (QWEN_MOE, layout_flags(1, 2, expert_model_parallel_size=2),
                 layout_flags(1, 1, expert_model_parallel_size=4),
                 "tp1pp2ep2etp1ppl1dp2", "tp1pp1ep4etp1dp4"),
    "deepseek": (DEEPSEEK, layout_flags(2, 2), layout_flags(1, 1), "tp2pp2dp1", "tp1pp1dp4"),
}


# qwen_moe runs on every release: only core_v0.16.1's local spec builds GroupedMLP for
# --moe-grouped-gemm (core_v0.19.0's builds one module per expert whatever the flag)
@pytest.fixture(scope="module", params=[
    pytest.param(n, marks=pytest.mark.every_release) if n == "qwen_moe" else n
    for n in sorted(RECIPES)])
def runs(request, tmp_path_factory):
    require_snapshot()
    recipe, a, b, lay_a, lay_b = RECIPES[request.param]
    batches = ({} if request.param not in BY_SAMPLES else
               RAMPED.get(release_name(), {i: 8 for i in range(1, 6)}))
    n = len(batches) or N
    common = (CPU_FLAGS + TINY_MODEL + MOCK_DATA + recipe + ["--eval-interval", "1000"]
              + ([] if batches else ["--train-iters", str(N)]))
    if request.param in PLAIN_DDP:
        common = [f for f in common if f != "--use-distributed-optimizer"]
    # B takes the placement the planner chooses: Megatron-LM's loss line must still print
    # after the switch (from the device of B's last stage, `compat.megatron_lm.set_last_rank`)
    # the restart resumes the switched run's own --save at K (A's state): two jobs, not three
    out = switch_and_restart(tmp_path_factory.mktemp(f"recipe-{request.param}"), common, a, b,
                             lay_b, K, own_save=True, before=REFUSED.get(request.param, ()))
    return dict(out, A=lay_a, B=lay_b, recipe=request.param, N=n, batches=batches)


def _printed_args(text: str) -> dict[str, str]:
    """Megatron-LM's own print of its arguments at start-up."""
    return dict(re.findall(r"^\s+(\w+) \.+ (.*)$", text, re.M))


def test_the_recipe_is_what_megatron_lm_ran(runs):
    args = _printed_args(runs["switched"])
    assert args["bf16"] == "True" and args["position_embedding_type"] == "rope"
    if runs["recipe"] == "llama":
        assert (args["rotary_base"], args["use_rope_scaling"]) == ("500000", "True")
        assert (args["lr_decay_style"], args["lr_warmup_init"]) == ("WSD", "1e-05")
        assert args["num_query_groups"] == "2" and args["untie_embeddings_and_output_weights"] == "True"
        assert args["spec"] == "['tests.megatron_lm_user_spec', 'llama_layer_counting']"
        assert (args["num_layers"], args["account_for_embedding_in_pipeline_split"]) == ("3", "True")
        assert (args["ddp_num_buckets"], args["ddp_pad_buckets_for_high_nccl_busbw"],
                args["overlap_grad_reduce"]) == ("2", "True", "True")
        # the buffers' buckets are padded to 2**16 elements, in both jobs
        for run in ("switched", "resumed"):
            sizes = re.findall(r"Params for bucket \d+ \(\d+ elements, (\d+) padded size", runs[run])
            assert sizes and all(int(n) % 2**16 == 0 for n in sizes), (run, sizes)
        assert args["add_qkv_bias"] == "True" and args["add_bias_linear"] == "False"
        assert "planned from the live metadata" in runs["switched"]
    elif runs["recipe"] == "deepseek":
        assert args["multi_latent_attention"] == "True"
        assert args["use_distributed_optimizer"] == "False"
        assert (args["q_lora_rank"], args["kv_lora_rank"]) == ("32", "16")
        assert args["mtp_num_layers"] == "1"
        assert args["moe_router_enable_expert_bias"] == "True"
        assert args["moe_router_score_function"] == "sigmoid"
        # the switch was planned from the live metadata, gathered in the background
        assert "planned from the live metadata" in runs["switched"]
    else:
        assert args["rotary_base"] == "1000000" and args["qk_layernorm"] == "True"
        assert args["moe_layer_freq"] == "[0, 1, 1]"
        assert (args["num_layers"], args["account_for_loss_in_pipeline_split"]) == ("3", "True")
        # the analytic layout describes the split (ppl1): the switch is planned from it
        assert "planned from the live metadata" not in runs["switched"]
        assert args["moe_shared_expert_intermediate_size"] == "32"
        assert args["moe_grouped_gemm"] == "True"
        assert (args["train_samples"], args["rampup_batch_size"]) == ("40", "[4, 4, 16]")
        # every iteration's global batch as Megatron-LM printed it: the ramp (core_v0.16.1)
        # continues at B from its position, as after the restart's load
        batch = re.compile(r"\] iteration\s+(\d+)/\s*\d+ \|.*?global batch size:\s+(\d+) \|")
        ours = {int(i): int(b) for i, b in batch.findall(runs["switched"])}
        theirs = {int(i): int(b) for i, b in batch.findall(runs["resumed"])}
        assert ours == runs["batches"], ours
        assert theirs == {i: b for i, b in ours.items() if i > K}, theirs
        # megatron-core 0.16 builds GroupedMLP (its deprecation warning), in both jobs;
        # 0.19's local spec builds one module per expert whatever the flag
        legacy = release_name() == "core_v0.16.1"
        for run in ("switched", "resumed"):
            assert ("The legacy GroupedMLP will be deprecated" in runs[run]) == legacy, run


def test_switch_lands_exactly_after_the_scheduled_iteration(runs):
    assert_switched_as_scheduled(runs["switched"], K, runs["A"], runs["B"],
                                 rolled_back=runs["recipe"] in REFUSED)


def test_objects_sharded_differently_refuse_the_switch_before_anything_moves(runs):
    if runs["recipe"] not in REFUSED:
        pytest.skip("no refused switch in this recipe")
    text = runs["switched"]
    # refused in the preparation (while A trained), at the first vote: one reason, from
    # rank 0 (every rank logs the refusal line): the pre-MLP norms' objects B asks for (3
    # layers x 4 replicas; keyed as TE's fused norm); then A trained on to B's switch at K
    refusals = re.findall(r"switch tp2pp1dp2 -> tp1pp1dp4 aborted in prepare: (.*); every "
                          r"rank stays at tp2pp1dp2", text)
    assert len(refusals) == 4 and len(set(refusals)) == 1, refusals
    assert refusals[0].startswith("rank 0: prepare: ObjectCarryError: 12 sharded object(s) "
                                  "of B are not held at A"), refusals[0]
    assert "mlp.linear_fc1.layer_norm__extra_state/shard_0.0_3.4" in refusals[0]
    assert text.count("switch rolled back; training continues at tp2pp1dp2") == 4
    assert sorted(losses(text)) == list(range(1, runs["N"] + 1))


def test_final_checkpoints_are_bit_identical(runs):
    ours = assert_final_checkpoints_identical(runs, runs["N"])
    if runs["recipe"] == "llama":  # the query/key/value biases, and no other bias
        biases = {k for k in ours if k.endswith(".bias") and not k.startswith("optimizer.")}
        assert biases == {"decoder.layers.self_attention.linear_qkv.bias"}, biases
        assert ours["decoder.layers.self_attention.linear_qkv.bias"].shape[0] == 3  # layers
        # the input norms' extra state, one object per layer (compared above with the
        # restart's; keyed as TE's fused norm, the local spec's keys map): it counts every
        # forward since iteration 1, so B's main replica went on from A's, as the restart's
        # load sets it (a B that kept its own would count from the switch on)
        objs = {k: v for k, v in ours.items() if "linear_qkv.layer_norm__extra_state/" in k}
        assert len(objs) == 3, sorted(objs)
        args = _printed_args(runs["switched"])
        per_step = int(args["global_batch_size"]) // (int(args["micro_batch_size"]) * 2)  # DP 2
        # and the pre-MLP norms', one per layer and data-parallel replica: B's replica r went
        # on from A's replica r (their running maxima differ: each saw its own data)
        per_dp = {k: v for k, v in ours.items() if "linear_fc1.layer_norm__extra_state/" in k}
        assert sorted(k.rsplit("/", 1)[1] for k in per_dp) == [
            f"shard_{layer}.{r}_3.2" for layer in range(3) for r in range(2)], sorted(per_dp)
        for k, v in {**objs, **per_dp}.items():
            state = v[0] if isinstance(v, list) else v
            assert state["calls"] == runs["N"] * per_step and state["amax"] > 0, (k, state)
        amax = {k.rsplit("/", 1)[1]: (v[0] if isinstance(v, list) else v)["amax"]
                for k, v in per_dp.items()}
        assert any(not torch.equal(amax[f"shard_{layer}.0_3.2"], amax[f"shard_{layer}.1_3.2"])
                   for layer in range(3)), amax
    if runs["recipe"] == "qwen_moe":  # the dense layer and the experts both came across
        assert any("experts" in k for k in ours) and any("shared_experts" in k for k in ours)
        # layers keyed one by one (they differ): layer 0 is dense, 1..3 have experts
        assert any(k.startswith("decoder.layers.0.mlp.linear_fc1") for k in ours)
        assert not any(k.startswith("decoder.layers.0.mlp.experts") for k in ours)
    if runs["recipe"] == "deepseek":  # MLA's low-rank projections and their norms
        assert {"linear_q_down_proj", "linear_kv_up_proj", "kv_layernorm"} <= {
            part for k in ours for part in k.split(".")}
        # the multi-token prediction layer (its projection, norms and transformer layer)
        assert {"eh_proj", "enorm", "hnorm", "transformer_layer"} <= {
            part for k in ours if k.startswith("mtp.") for part in k.split(".")}
        # every MoE layer's router expert bias (a buffer, moved by the switch), trained
        # away from its zero start before the switch: a B that kept zeros would differ
        bias = [k for k in ours if k.endswith("router.expert_bias")]
        assert bias and all(ours[k].abs().max() > 0 for k in bias), bias
    if runs["recipe"] in PLAIN_DDP:
        # a plain optimizer's state: every weight's fp32 main copy and moments, whole; its
        # step (one for all parameters) in the common state
        weights = {k for k in ours if not k.startswith("optimizer.")
                   and k.endswith((".weight", ".bias"))}
        for kind in ("fp32_param", "exp_avg", "exp_avg_sq"):
            assert {k[len(f"optimizer.state.{kind}."):] for k in ours
                    if k.startswith(f"optimizer.state.{kind}.")} == weights
        steps = [load_common(runs["w"] / run / f"iter_{N:07d}")["optimizer"]["optimizer"]
                 ["state"]["common_step"] for run in ("switched", "resumed")]
        assert steps[0] == steps[1] == N, steps


def test_losses_match_megatron_lm_restart(runs):
    assert_losses_as_restart(runs, K, runs["N"])


def test_a_refused_option_ends_the_job_when_its_command_line_is_parsed(tmp_path):
    """Before Megatron-LM initialises anything (no process group, no model): one line on
    stderr naming the flag and why, exit status 2, nothing else of ours."""
    import subprocess
    import sys

    from megatron_lm_runs import job_env
    from megatron_lm_tree import copy_tree

    tree = copy_tree(tmp_path / "patched", patched=True)
    cmd = [sys.executable, str(tree / "pretrain_gpt.py"), *CPU_FLAGS, *TINY_MODEL, *MOCK_DATA,
           "--train-iters", "2", "--optimizer", "sgd", "--dynatrain"]
    proc = subprocess.run(cmd, cwd=tree, env=job_env(tree), capture_output=True, text=True,
                          timeout=900)
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("dynatrain:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(ours) == 1 and ours[0].startswith(
        "dynatrain: cannot switch this job: --optimizer sgd: Megatron-LM's own --load"), ours
    assert "building GPT model" not in proc.stdout and "Traceback" not in proc.stderr
