"""The Megatron-LM adapter's pure parts: Megatron-LM `args` -> ModelSpec / TrainConfig /
Layout, the options it refuses, the chained `extra_args_provider`, and the patch calling
only functions that exist. No process group, no Megatron-LM install (issue 5, item 5)."""
import argparse
import importlib
import re
import sys
from pathlib import Path

import pytest

from dynatrain_megatron.megatron_lm import adapter as mlm
from dynatrain_megatron.megatron_lm import arguments as mla
from dynatrain_megatron.megatron_lm.support import plans_from_metadata
from dynatrain_megatron.vps.errors import DynatrainError
from dynatrain_megatron.vps.layout import Layout

PATCHES = sorted((Path(__file__).resolve().parents[1] / "patches").glob("megatron-lm-*/dynatrain.patch"))


def megatron_args(**over) -> argparse.Namespace:
    """What Megatron-LM's validated args hold for a small Llama-style job we can switch."""
    a = dict(
        num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8,
        group_query_attention=True, num_query_groups=4, kv_channels=8, seq_length=32,
        max_position_embeddings=32, vocab_size=1000, padded_vocab_size=1024,
        make_vocab_size_divisible_by=128, swiglu=True, position_embedding_type="rope",
        untie_embeddings_and_output_weights=True, normalization="RMSNorm",
        add_bias_linear=False, qk_layernorm=False, init_method_std=0.02, bf16=True, fp16=False,
        num_experts=None, hidden_dropout=0.0, attention_dropout=0.0, transformer_impl="local",
        use_distributed_optimizer=True, optimizer="adam", micro_batch_size=2,
        global_batch_size=16, train_iters=100, lr=3e-4, min_lr=3e-5, lr_warmup_iters=10,
        lr_decay_style="cosine", weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
        adam_eps=1e-8, clip_grad=1.0, seed=1234, ddp_bucket_size=None,
        overlap_grad_reduce=False, overlap_param_gather=False, tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1, expert_model_parallel_size=1, expert_tensor_parallel_size=2,
        decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
        rampup_batch_size=None, cuda_graph_impl="none", rotary_base=10000, rotary_percent=1.0,
        norm_epsilon=1e-5,
    )
    a.update(over)
    return argparse.Namespace(**a)


def test_module_imports_without_megatron_lm(monkeypatch):
    # `import megatron.training` fails as on a machine with megatron-core only
    import dynatrain_megatron.megatron_lm as package

    monkeypatch.setitem(sys.modules, "megatron.training", None)
    monkeypatch.delitem(sys.modules, "dynatrain_megatron.megatron_lm.adapter")
    # the import below rebinds the package's attribute too: restored at teardown, so later
    # tests' `from . import adapter` finds the module they patch, not this fresh copy
    monkeypatch.setattr(package, "adapter", package.adapter)
    mod = importlib.import_module("dynatrain_megatron.megatron_lm.adapter")
    assert callable(mod.dynatrain_step) and callable(mla.chain_extra_args_providers)
    assert sys.modules["megatron.training"] is None  # nothing tried to replace it


def test_dense_gqa_spec():
    s = mla.spec_from_megatron_args(megatron_args())
    assert (s.num_layers, s.hidden_size, s.ffn_hidden_size) == (4, 64, 128)
    assert (s.num_attention_heads, s.num_query_groups, s.kv_channels) == (8, 4, 8)
    assert s.swiglu and s.position_embedding_type == "rope" and s.normalization == "RMSNorm"
    assert not s.tied and not s.add_bias_linear and not s.is_moe
    assert s.params_dtype == "bf16" and s.seq_length == 32
    # no tokenizer size given: the padded rows count as vocabulary (always consistent)
    assert s.vocab_size == 1024 and s.padded_vocab_size(2) == 1024


def test_query_groups_only_with_group_query_attention():
    s = mla.spec_from_megatron_args(megatron_args(group_query_attention=False, num_query_groups=1))
    assert s.num_query_groups == 8


def test_tokenizer_vocab_and_padding_check():
    # NullTokenizer of --vocab-size 1000 has 1001 ids; 1001 pads to 1024 at tp2 (m=128)
    assert mla.spec_from_megatron_args(megatron_args(), vocab_size=1001).vocab_size == 1001
    with pytest.raises(DynatrainError, match="padded_vocab_size=1280"):
        mla.spec_from_megatron_args(megatron_args(padded_vocab_size=1280), vocab_size=1001)


def test_fp32_and_fp16_dtypes():
    assert mla.spec_from_megatron_args(megatron_args(bf16=False)).params_dtype == "fp32"
    assert mla.spec_from_megatron_args(megatron_args(bf16=False, fp16=True)).params_dtype == "fp16"


def test_moe_spec():
    a = megatron_args(num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=2,
                      moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=[0.01],
                      moe_shared_expert_intermediate_size=None, expert_model_parallel_size=2)
    s = mla.spec_from_megatron_args(a)
    assert s.is_moe and s.num_moe_experts == 8 and s.moe_ffn_hidden_size == 32
    assert s.moe_aux_loss_coeff == 0.01 and s.moe_token_dispatcher_type == "alltoall"
    # several coefficients (one per load-balancing type): numerics B's own config carries
    assert mla.spec_from_megatron_args(megatron_args(
        num_experts=8, moe_aux_loss_coeff=[0.01, 0.1])).moe_aux_loss_coeff == 0.01


def test_train_config():
    t = mla.train_config_from_megatron_args(megatron_args())
    assert (t.micro_batch_size, t.global_batch_size, t.train_iters) == (2, 16, 100)
    assert (t.lr, t.min_lr, t.lr_warmup_iters, t.lr_decay_style) == (3e-4, 3e-5, 10, "cosine")
    assert (t.weight_decay, t.adam_beta2, t.clip_grad, t.seed) == (0.1, 0.95, 1.0, 1234)
    # sample-based training: iterations from the samples
    t = mla.train_config_from_megatron_args(megatron_args(train_iters=None, train_samples=320))
    assert t.train_iters == 20


def test_layout_from_args():
    spec = mla.spec_from_megatron_args(megatron_args())
    assert str(mla.layout_from_megatron_args(megatron_args(), spec, 8)) == "tp2pp2dp2"
    a = megatron_args(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    lay = mla.layout_from_megatron_args(a, spec, 4)
    assert (lay.tp, lay.pp, lay.vpp, lay.dp) == (2, 2, 2, 1)
    a = megatron_args(tensor_model_parallel_size=1, expert_tensor_parallel_size=1,
                      pipeline_model_parallel_size=3, decoder_first_pipeline_num_layers=1,
                      decoder_last_pipeline_num_layers=1)
    lay = mla.layout_from_megatron_args(a, mla.spec_from_megatron_args(a), 3)
    assert (lay.ppf, lay.ppl) == (1, 1)
    with pytest.raises(DynatrainError, match="not a multiple"):
        mla.layout_from_megatron_args(megatron_args(), spec, 6)


@pytest.mark.parametrize("text,world", [("tp2pp2dp2", 8), ("tp1pp2vpp2dp4", 8),
                                        ("tp4pp1dp2", 8), ("tp1pp4ppf1ppl1dp1", 4),
                                        ("tp1pp2doi2dp4", 8), ("tp2pp1doi4dp4", 8)])
@pytest.mark.parametrize("doi_before", [1, 2])
def test_args_for_layout_round_trip(text, world, doi_before):
    # from a job with one or two optimizer instances: the layout's doi replaces the old
    spec = mla.spec_from_megatron_args(megatron_args(num_layers=8))
    lay = Layout.parse(text, world)
    a = megatron_args(num_layers=8, num_distributed_optimizer_instances=doi_before)
    vars(a).update(mlm.args_for_layout(lay, spec))
    assert mla.layout_from_megatron_args(a, spec, world) == lay
    assert a.padded_vocab_size == spec.padded_vocab_size(lay.tp)
    assert a.data_parallel_size == lay.dp
    assert a.num_distributed_optimizer_instances == lay.doi


def test_optimizer_instances_are_accepted_and_read():
    a = megatron_args(tensor_model_parallel_size=1, expert_tensor_parallel_size=1,
                      pipeline_model_parallel_size=1, num_distributed_optimizer_instances=2)
    assert mlm.unsupported_args(a) == []
    lay = mla.layout_from_megatron_args(a, mla.spec_from_megatron_args(a), 4)
    assert str(lay) == "tp1pp1doi2dp4" and lay.dense_shards == 2
    with pytest.raises(DynatrainError, match="doi4"):  # megatron-core refuses it too
        mla.layout_from_megatron_args(megatron_args(num_distributed_optimizer_instances=4),
                                      mla.spec_from_megatron_args(a), 8)


class _Group:
    """A process group of the emulated world: its members, ascending (torch's numbering)."""

    def __init__(self, ranks):
        self.ranks = sorted(ranks)


def _megatron_core_groups(monkeypatch, lay: Layout, rank: int,
                          order: str = "tp-cp-ep-dp-pp") -> None:
    """megatron-core's own `initialize_model_parallel` (as Megatron-LM calls it, in rank
    `order`) on `rank` of an emulated world of `lay.world_size` processes."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: lay.world_size)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "new_group", lambda ranks=None, **kw: _Group(ranks))
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda g: list(g.ranks))
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        lay.tp, lay.pp, None, context_parallel_size=lay.cp, expert_model_parallel_size=lay.ep,
        expert_tensor_parallel_size=lay.etp, num_distributed_optimizer_instances=lay.doi,
        create_gloo_process_groups=False, order=order)


@pytest.mark.parametrize("text,world", [("tp1pp1doi2dp4", 4), ("tp1pp2cp2doi2dp2", 8),
                                        ("tp1pp2ep2etp1doi2dp4", 8), ("tp2pp1dp4", 8)])
def test_megatron_core_groups_are_wrapped_rank_for_rank(monkeypatch, text, world):
    """Every rank's Megatron-LM groups, made by megatron-core itself, pass the wrap's check
    against our `Layout`, the distributed-optimizer instance groups included (CP folds into
    them, expert parameters shard over expert-DP blocks); the layout's group is the default
    group, since an instance spans 1/doi of the job. A layout with other instances than
    megatron-core's is refused, naming the group."""
    import types

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    lay = Layout.parse(text, world)
    default_group = object()
    monkeypatch.setattr(dist, "group", types.SimpleNamespace(WORLD=default_group))
    try:
        for rank in range(world):
            _megatron_core_groups(monkeypatch, lay, rank)
            groups = mlm.wrap_megatron_groups(lay)
            assert groups.layout_group is default_group and groups.created == []
            own = {k: v for k, v in groups.group_ranks.items() if k not in ("embd", "pos_embd")}
            assert own["intra_dist_opt"] == [r for r in range(world)
                                             if lay.coords(r).edp // lay.expert_shards
                                             == lay.coords(rank).edp // lay.expert_shards]
            assert len(own["intra_dp_cp"]) == lay.dense_shards
            assert ("inter_dist_opt" in own) == (lay.doi > 1)
            other = Layout.parse(text.replace("doi2", "") if lay.doi > 1 else text + "doi2",
                                 world)
            with pytest.raises(DynatrainError, match="intra_dp_cp|intra_dist_opt"):
                mlm.wrap_megatron_groups(other)
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("text,world", [("tp1pp2dp2", 4), ("tp2pp2dp2", 8),
                                        ("tp2pp2ep2etp1dp2", 8), ("tp1pp2vpp2dp4", 8)])
def test_tp_pp_dp_rank_order_groups_are_wrapped_as_a_placement(monkeypatch, text, world):
    """--use-tp-pp-dp-mapping: megatron-core's groups in its tp-pp-dp order are A's layout
    on the placement `megatron_rank_order` gives (every group, every rank); read in the
    default order they are refused, naming the groups that differ."""
    import types

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from dynatrain_megatron.vps.placement import TP_PP_DP_ORDER, megatron_rank_order

    lay = Layout.parse(text, world)
    placement = megatron_rank_order(lay, TP_PP_DP_ORDER)
    assert not placement.is_default  # pp and dp > 1: the orders differ
    monkeypatch.setattr(dist, "group", types.SimpleNamespace(WORLD=object()))
    try:
        for rank in range(world):
            _megatron_core_groups(monkeypatch, lay, rank, TP_PP_DP_ORDER)
            groups = mlm.wrap_megatron_groups(lay, TP_PP_DP_ORDER)
            assert groups.placement == placement
            # this rank's place in megatron-core's groups is its virtual rank's coordinates
            c = lay.coords(placement.virtual_rank(rank))
            place = [dist.get_process_group_ranks(g).index(rank) for g in (
                ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group(),
                ps.get_tensor_model_parallel_group())]
            assert place == [c.pp, c.dp, c.tp]
            with pytest.raises(DynatrainError, match="in rank order tp-cp-ep-dp-pp"):
                mlm.wrap_megatron_groups(lay)
    finally:
        ps.destroy_model_parallel()


def test_supported_job_has_no_objection():
    assert mlm.unsupported_args(megatron_args()) == []
    # hierarchical CP sizes of 1 (CP 1) split nothing: Megatron-LM trains it on the CPU
    assert mlm.unsupported_args(megatron_args(hierarchical_context_parallel_sizes=[1])) == []
    assert mlm.unsupported_args(megatron_args(transformer_impl="transformer_engine")) == []


def test_megatron_lm_defaults_are_refused_with_reasons():
    a = megatron_args(hidden_dropout=0.1, attention_dropout=0.1, use_distributed_optimizer=False,
                      decrease_batch_size_if_needed=True, cuda_graph_impl="local",
                      optimizer="sgd", perform_rl_step=True)
    why = "\n".join(mlm.unsupported_args(a))
    for s in ("--perform-rl-step", "--cuda-graph-impl local", "--optimizer sgd"):
        assert s in why
    # B's micro-batch calculator rounds the batch at B's DP as a restart's does
    assert "decrease-batch-size" not in why
    # plain DDP switches: its replicated optimizer state is in the planning layout
    assert "distributed-optimizer" not in why
    assert mla.spec_from_megatron_args(a).distributed_optimizer is False
    assert mla.spec_from_megatron_args(megatron_args()).distributed_optimizer is True
    # Megatron-LM's default dropout is carried by B's config: accepted, with a warning
    assert "dropout" not in why
    assert any("--hidden-dropout 0.1" in n and "--attention-dropout 0.1" in n
               for n in mlm.performance_differences(a))


def test_options_carried_by_megatron_lm_building_b_are_accepted():
    # B is built by Megatron-LM from the job's args: what changes no state shape carries
    for over in (dict(norm_epsilon=1e-6), dict(apply_layernorm_1p=True), dict(squared_relu=True),
                 dict(openai_gelu=True), dict(rotary_base=500000, use_rope_scaling=True),
                 dict(rotary_percent=0.5), dict(position_embedding_type="yarn"),
                 dict(lr_decay_style="WSD", lr_wsd_decay_iters=10), dict(lr_warmup_init=1e-6),
                 dict(transformer_impl="transformer_engine"), dict(quick_geglu=True),
                 dict(fp16_lm_cross_entropy=True), dict(calculate_per_token_loss=True),
                 dict(num_experts=8, moe_aux_loss_coeff=[1e-2, 1e-3]),
                 dict(num_experts=8, moe_layer_freq=[0, 1, 1, 1]),
                 dict(num_experts=8, moe_grouped_gemm=True),  # local layers: GroupedMLP
                 dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16,
                      qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)):
        assert mlm.unsupported_args(megatron_args(**over)) == [], over


@pytest.mark.parametrize("over,needle", [
    (dict(num_experts=8, moe_grouped_gemm=True, transformer_impl="transformer_engine"),
     "--moe-grouped-gemm with --transformer-impl transformer_engine"),
    (dict(use_torch_fsdp2=True), "--use-torch-fsdp2"),
    (dict(optimizer="sgd"), "--optimizer sgd"),
    (dict(hybrid_context_parallel=True), "--hybrid-context-parallel"),
    (dict(hierarchical_context_parallel_sizes=[2, 2], context_parallel_size=4),
     "--hierarchical-context-parallel-sizes"),
    (dict(multi_latent_attention=True, transformer_impl="transformer_engine"),
     "--multi-latent-attention with --transformer-impl transformer_engine"),
    (dict(mtp_num_layers=1, untie_embeddings_and_output_weights=False), "--mtp-num-layers"),
    (dict(fp8="hybrid"), "--fp8-format"),
    (dict(use_legacy_models=True), "--use-legacy-models"),
])
def test_each_unreproducible_option_is_named_with_its_reason(over, needle):
    lines = [w for w in mlm.unsupported_args(megatron_args(**over)) if w.startswith(needle)]
    assert len(lines) == 1 and len(lines[0]) > len(needle) + 20, lines


def test_the_refusal_list_is_short_and_every_row_says_why():
    from dynatrain_megatron.megatron_lm import support

    assert len(support.REFUSALS) <= 10
    rows = mla.support_matrix()
    assert all(r["why"] for r in rows) and {r["status"] for r in rows} >= {
        "switches in memory", "refused (Megatron-LM's restart cannot either)"}
    assert support.support_markdown().count("\n") == len(rows) + 2


def test_refused_options_end_the_parse_with_one_line_each(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    provider = mla.chain_extra_args_providers(None)
    parser = provider(argparse.ArgumentParser())
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    assert parser.parse_args(["--optimizer", "sgd"]).optimizer == "sgd"  # no --dynatrain
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--dynatrain", "--optimizer", "sgd", "--use-distributed-optimizer"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dynatrain: cannot switch this job: "
                                               "--optimizer sgd: ")
    ns, _ = parser.parse_known_args(["--dynatrain", "--use-distributed-optimizer", "--x"])
    assert ns.dynatrain
    # a bad value on a --dynatrain command line: one line, not the host's whole usage
    for i in range(200):
        parser.add_argument(f"--host-option-{i}", type=int, default=0)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--dynatrain", "--use-distributed-optimizer", "--dynatrain-timeout", "soon"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert "--dynatrain-timeout" in err[0] and "error:" in err[0], err
    with pytest.raises(SystemExit):  # not ours: argparse's own error, usage and all
        parser.parse_args(["--host-option-1", "x"])
    assert "usage:" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "3")  # other ranks stay quiet
    with pytest.raises(SystemExit):
        parser.parse_args(["--dynatrain", "--use-distributed-optimizer", "--dynatrain-timeout", "soon"])
    assert capsys.readouterr().err == ""


def test_performance_only_differences_are_warnings():
    # carried by B's config (Megatron-LM's own, test_megatron_lm_config.py): no warning
    a = megatron_args(recompute_granularity="full", gradient_accumulation_fusion=True,
                      sequence_parallel=True)
    assert mlm.performance_differences(a) == []
    # B's DDP is Megatron-LM's own (get_model): its NaN check carries over, no warning
    assert mlm.performance_differences(megatron_args(check_for_nan_in_loss_and_grad=True)) == []
    # not carried: warned, still accepted
    a = megatron_args(tp_comm_overlap=True)
    notes = mlm.performance_differences(a)
    assert len(notes) == 1 and "--tp-comm-overlap" in notes[0]
    assert mlm.unsupported_args(a) == []


def test_sequence_parallel_follows_the_job_and_the_layout():
    dense = mla.spec_from_megatron_args(megatron_args())
    moe = mla.spec_from_megatron_args(megatron_args(num_experts=4, moe_ffn_hidden_size=64))
    at = lambda text, spec, sp: mla.args_for_layout(Layout.parse(text, 4), spec,  # noqa: E731
                                                    sequence_parallel=sp)["sequence_parallel"]
    assert at("tp2pp2", dense, True) and not at("tp1pp2dp2", dense, True)
    assert not at("tp2pp2", dense, False) and at("tp2pp2", moe, False)


def test_settings_the_launch_layout_turned_off_follow_the_command_line(monkeypatch):
    """Megatron-LM's validation turns --sequence-parallel off at TP 1, and the interleaved
    schedule's overlaps off without VPP; a restart at a layout that allows them, with the
    same command line, has them on. The `--dynatrain` parse notes what the command line
    set, and B's intents follow it (found by switching a tp1pp2 job with
    --sequence-parallel to tp2pp1dp2: without it B trained without SP and its state
    differed from the restart's)."""
    from dynatrain_megatron.megatron_lm.transformer_config import JobIntents

    monkeypatch.setenv("RANK", "0")
    parser = mla.chain_extra_args_providers(None)(argparse.ArgumentParser())
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--no-overlap-p2p-communication", action="store_false",
                        dest="overlap_p2p_comm")
    parser.add_argument("--no-align-param-gather", action="store_false",
                        dest="align_param_gather")
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    ns = parser.parse_args(["--dynatrain", "--use-distributed-optimizer",
                            "--sequence-parallel", "--no-overlap-p2p-communication"])
    assert ns.dynatrain_asked == dict(sequence_parallel=True, overlap_p2p_comm=False,
                                      align_param_gather=True)
    assert not hasattr(parser.parse_args(["--sequence-parallel"]), "dynatrain_asked")
    # Megatron-LM's validation at tp1pp2 (no VPP) turns all three off
    validated = megatron_args(tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                              sequence_parallel=False, overlap_p2p_comm=False,
                              align_param_gather=False, dynatrain_asked=ns.dynatrain_asked)
    assert JobIntents.from_args(validated) == JobIntents(sequence_parallel=True,
                                                         overlap_p2p_comm=False,
                                                         align_param_gather=True)
    # where the launch layout allows a setting, Megatron-LM's validated value stands
    tp2 = megatron_args(tensor_model_parallel_size=2, sequence_parallel=False,
                        dynatrain_asked=ns.dynatrain_asked)
    assert not JobIntents.from_args(tp2).sequence_parallel
    # args not parsed here (a job built by other code): Megatron-LM's defaults
    assert JobIntents.from_args(megatron_args(tensor_model_parallel_size=1)) == JobIntents(
        sequence_parallel=False, overlap_p2p_comm=True, align_param_gather=True)


def test_chained_extra_args_provider():
    def theirs(parser):
        parser.add_argument("--modelopt-thing", type=int, default=0)
        return parser

    parser = mla.chain_extra_args_providers(theirs, None)(argparse.ArgumentParser())
    a = parser.parse_args(["--modelopt-thing", "3", "--dynatrain",
                           "--dynatrain-signal-file", "/tmp/s.json"])
    assert a.modelopt_thing == 3 and a.dynatrain and a.dynatrain_signal_file == "/tmp/s.json"
    # with nothing to chain it is our provider alone
    a = mla.chain_extra_args_providers(None)(argparse.ArgumentParser()).parse_args([])
    assert a.dynatrain is False


def test_finish_training_without_a_session_returns_its_inputs():
    mlm.reset_session()
    objs = (["m"], "opt", "sched", "train_it", "valid_it", "test_it", "cfg")
    assert mlm.finish_training(*objs) == objs


def test_config_callbacks_as_megatron_lm_train_sets_them():
    class Chunk:
        def no_sync(self): ...
        def start_grad_sync(self): ...
        def start_param_sync(self): ...

    class Opt:
        def scale_loss(self, x): return x

    class Cfg:
        timers = "old-timers"

    chunk, new = Chunk(), Cfg()
    new.timers = None
    mlm._prepare_config(megatron_args(overlap_grad_reduce=True, overlap_param_gather=True),
                        [chunk], Opt(), new, Cfg())
    assert new.timers == "old-timers" and new.grad_scale_func.__name__ == "scale_loss"
    assert new.no_sync_func == chunk.no_sync and new.grad_sync_func == chunk.start_grad_sync
    assert new.param_sync_func == chunk.start_param_sync  # align_param_gather defaults on
    assert new.finalize_model_grads_func.__name__ == "finalize_model_grads"
    two = [Chunk(), Chunk()]
    mlm._prepare_config(megatron_args(), two, Opt(), new, Cfg())
    assert new.no_sync_func is None and new.grad_sync_func is None and new.param_sync_func is None


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.parent.name)
def test_patch_is_well_formed_and_calls_only_what_exists(patch):
    from dynatrain_megatron.megatron_lm import seam

    text = patch.read_text()
    # every hunk's line counts agree with its body (a hand-edited patch would not apply)
    files = re.findall(r"^\+\+\+ b/(\S+)$", text, re.M)
    assert files == ["megatron/training/training.py", "pretrain_gpt.py"]
    for m in re.finditer(r"^@@ -\d+,(\d+) \+\d+,(\d+) @@.*\n((?:[ +\-].*\n|\n)*)", text, re.M):
        old_n, new_n = int(m.group(1)), int(m.group(2))
        body = m.group(3).split("\n")[:-1]
        old = sum(1 for ln in body if ln[:1] in (" ", "-", ""))
        new = sum(1 for ln in body if ln[:1] in (" ", "+", ""))
        assert (old, new) == (old_n, new_n), m.group(0)[:80]
    # thin: the patch calls only the seam (and the start-up and argument helpers)
    added = "\n".join(ln[1:] for ln in text.splitlines() if ln.startswith("+") and
                      not ln.startswith("+++"))
    assert set(re.findall(r"dynatrain_seam\.(\w+)\(", added)) == {"start", "finish", "left_out"}
    assert set(re.findall(r"dynatrain_loop\.(\w+)\(", added)) == {
        "guard", "after_recovery", "at_step_end"}
    assert set(re.findall(r"dynatrain_loop\.(\w+)\b(?!\()", added)) == {"recovered", "stop"}
    for name in ("start", "finish", "left_out"):
        assert callable(getattr(seam, name))
    for name in ("guard", "after_recovery", "at_step_end"):
        assert callable(getattr(seam.LoopSeam, name))
    assert "try:" not in added and "except" not in added  # the handling is ours
    assert callable(mla.chain_extra_args_providers)  # pretrain_gpt.py imports it
    # what the loop rebinds: the seam's LoopValues, in its order, at both places
    rebinds = re.findall(r"\(([^()]*?),\s*\)\s*=\s*dynatrain_loop\.\w+\(", added)
    assert len(rebinds) == 2
    for r in rebinds:
        assert [x.strip() for x in r.split(",")] == list(seam.LoopValues._fields)


def test_unswitchable_job_is_refused_before_its_first_step():
    # the patched pretrain() registers its dataset provider before train(): the refusal
    # comes there, naming the flag, and nothing is registered
    mlm.reset_session()
    with pytest.raises(DynatrainError, match="--mtp-num-layers"):
        mlm.register_dataset_provider(lambda *a: None, megatron_args(
            mtp_num_layers=1, untie_embeddings_and_output_weights=False))
    assert mlm._DATASET_PROVIDER is None
    mlm.register_dataset_provider(print, megatron_args())
    assert mlm._DATASET_PROVIDER is print
    mlm.reset_session()


def test_softmax_precision_follows_megatron_lm():
    # Megatron-LM computes the attention softmax in the params dtype unless told otherwise
    # (megatron-core's default is fp32): B must do the same or bf16 drifts after a switch
    assert not mla.spec_from_megatron_args(megatron_args()).attention_softmax_in_fp32
    assert mla.spec_from_megatron_args(
        megatron_args(attention_softmax_in_fp32=True)).attention_softmax_in_fp32
    assert mla.spec_from_megatron_args(
        megatron_args(apply_query_key_layer_scaling=True)).attention_softmax_in_fp32


class _Hook:
    """What `MegatronLMSession.step` asks of the hook, recorded."""

    def __init__(self, layout):
        from types import SimpleNamespace

        self.layout, self.calls = layout, []
        self.stall = SimpleNamespace(switch_meter=None)  # no switch in flight

    def after_step(self, trainer):
        self.calls.append("after_step")
        return trainer

    def end_job(self, trainer):
        self.calls.append("end_job")


def _session(monkeypatch, layout: str, world: int):
    """A session of a rank of `layout` in a job of `world` processes, without any process
    group (torch.distributed's answers and the stand-in world are recorded fakes)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    worlds = []
    monkeypatch.setattr(mlm.stand_in_world, "use", worlds.append)
    lay = Layout.parse(layout, Layout.parse(layout).world_size)
    model = ["chunk"]
    objs = SimpleNamespace(model=model, config=None, layout=lay,
                           groups=SimpleNamespace(stand_in_world="first ranks"))
    s = object.__new__(mlm.MegatronLMSession)
    s.args = argparse.Namespace(train_iters=20, consumed_train_samples=64)
    s.trainer = SimpleNamespace(objs=objs, iteration=0, consumed_samples=0)
    s.hook = _Hook(lay)
    s.launch_layout = lay
    s.guard = SimpleNamespace(at_boundary=lambda iteration, objs: None)
    # B's data iterators built ahead (data_ahead.py): none in flight here
    s.data_ahead = SimpleNamespace(note_step=lambda iteration: None, drop=lambda: None)
    s.latest = mlm.LoopObjects(model, "opt", "sched", "train it", "valid it", None, "test it")
    s.test_data_iterator = "test it"
    loop = mlm.LoopObjects(model, "opt", "sched", "train it", "valid it", None)
    return s, loop, worlds


@pytest.mark.parametrize("ending,iteration,calls", [
    (False, 8, ["after_step"]),                    # a step: poll, standby ranks wait on
    (False, 20, ["after_step", "end_job"]),   # --train-iters reached
    (True, 8, ["end_job"]),                   # Megatron-LM exits: no poll, no switch
])
def test_standby_ranks_are_told_when_the_job_ends(monkeypatch, ending, iteration, calls):
    s, loop, worlds = _session(monkeypatch, "tp1pp2dp1", 4)
    assert s.step(iteration, loop, ending) is loop
    assert s.hook.calls == calls
    # the real world for the hook, then the layout's ranks as Megatron-LM's world
    assert worlds == [None, "first ranks"]
    kept = None if ending else "train it"  # at an exit the loop's frames own the iterators
    assert s.latest.train_data_iterator == kept and s.test_data_iterator == (kept and "test it")


def test_a_job_on_every_rank_keeps_the_real_world(monkeypatch):
    s, loop, worlds = _session(monkeypatch, "tp2pp2dp1", 4)
    assert s.step(20, loop, True) is loop
    # the end is told to the hook all the same (a preparation pending there is cancelled)
    assert s.hook.calls == ["end_job"] and worlds == [None, None]


def test_a_rank_on_standby_at_the_end_leaves_pretrain(monkeypatch):
    s, _, _ = _session(monkeypatch, "tp1pp2dp1", 4)
    monkeypatch.setattr(mlm, "_SESSION", s)
    assert not mlm.left_out()
    s.trainer = None  # what `step` leaves when the job ended while this rank was out
    assert mlm.left_out()
    assert mlm.finish_training(*"abcdefg") == tuple("abcdefg")  # nothing of ours to hand over


def test_rank_0_logs_the_layout_once_it_is_not_the_launch_one(monkeypatch, caplog):
    # Megatron-LM's iteration line names no layout: after a switch rank 0 says it
    s, loop, _ = _session(monkeypatch, "tp2pp2dp1", 4)
    s.args.log_interval = 2
    with caplog.at_level("INFO", logger="dynatrain"):
        s._log_layout(4, False, 4)  # still the launch layout: nothing
        s.hook.layout = Layout.parse("tp1pp2dp2", 4)
        s._log_layout(5, False, 4)  # not a log iteration
        s._log_layout(6, False, 4)
        s.hook.layout = Layout.parse("tp1pp2dp1", 2)
        s._log_layout(8, True, 4)
    assert [r.getMessage() for r in caplog.records] == [
        "dynatrain: iteration 6 done at tp1pp2dp2",
        "dynatrain: iteration 8 done at tp1pp2dp1 on 2 of 4 ranks (the others on standby)"]


def test_docs_recipes_table_is_the_generated_one():
    from dynatrain_megatron.megatron_lm.support import support_markdown

    doc = (Path(__file__).resolve().parents[1] / "docs" / "recipes.md").read_text()
    assert doc.endswith(support_markdown())


def test_mtp_is_planned_from_the_live_metadata_unless_tied():
    from dynatrain_megatron.megatron_lm.support import plans_from_metadata

    untied = megatron_args(mtp_num_layers=1, untie_embeddings_and_output_weights=True)
    assert mlm.unsupported_args(untied) == []
    assert plans_from_metadata(untied) == ["--mtp-num-layers"]
    assert plans_from_metadata(megatron_args()) == []
    tied = mlm.unsupported_args(megatron_args(mtp_num_layers=1,
                                              untie_embeddings_and_output_weights=False))
    assert len(tied) == 1 and tied[0].startswith(
        "--mtp-num-layers without --untie-embeddings-and-output-weights: Megatron-LM's own "
        "--save cannot write"), tied


def test_expert_bias_is_planned_from_the_live_metadata():
    from dynatrain_megatron.megatron_lm.support import plans_from_metadata

    args = megatron_args(num_experts=4, moe_router_score_function="sigmoid",
                         moe_router_enable_expert_bias=True)
    assert mlm.unsupported_args(args) == []
    assert plans_from_metadata(args) == ["--moe-router-enable-expert-bias"]


def test_heterogeneous_layers_switch_and_attention_variants_and_rl_need_cuda():
    from dynatrain_megatron.megatron_lm.support import plans_from_metadata, unlike_analytic

    hetero = megatron_args(heterogeneous_layers_config_path="nas.json")
    assert mlm.unsupported_args(hetero) == []
    assert plans_from_metadata(hetero) == ["--heterogeneous-layers-config-path"]
    assert unlike_analytic(hetero) == ("decoder.layers.",)
    assert unlike_analytic(megatron_args()) == ()
    for over, flag in ((dict(experimental_attention_variant="gated_delta_net"),
                        "--experimental-attention-variant gated_delta_net: Megatron-LM builds "
                        "these layers only with Transformer Engine"),
                       (dict(perform_rl_step=True), "--perform-rl-step: Megatron-LM's RL loop "
                        "generates with megatron-core's dynamic inference engine")):
        why = mlm.unsupported_args(megatron_args(**over))
        assert len(why) == 1 and why[0].startswith(flag), why


@pytest.mark.parametrize("flags,pp,split", [
    # L + the flags set, over pp stages; one less on the stage holding the embedding / loss
    (dict(account_for_embedding_in_pipeline_split=True), 2, (1, 0)),  # 3 layers: [1, 2]
    (dict(account_for_loss_in_pipeline_split=True), 2, (0, 1)),  # [2, 1]
    (dict(account_for_embedding_in_pipeline_split=True,
          account_for_loss_in_pipeline_split=True, num_layers=4), 2, (2, 2)),  # [2, 2]
    (dict(account_for_embedding_in_pipeline_split=True, num_layers=7), 4, (1, 0)),  # [1,2,2,2]
    (dict(account_for_embedding_in_pipeline_split=True), 1, (0, 0)),  # no split at pp1
])
def test_account_for_flags_are_the_layouts_uneven_stages(flags, pp, split):
    over = dict(num_layers=3, tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)
    over.update(flags)
    a = megatron_args(**over)
    assert mlm.unsupported_args(a) == [] and plans_from_metadata(a) == []
    spec = mla.spec_from_megatron_args(a)
    lay = mla.layout_from_megatron_args(a, spec, pp * 2)
    assert (lay.ppf, lay.ppl) == split
    # megatron-core's count: (L + flags) // pp per stage, one less where the flag's stage is
    per = (spec.num_layers + sum(k.startswith("account_for") for k in flags)) // pp
    counts = [per] * pp
    if flags.get("account_for_embedding_in_pipeline_split"):
        counts[0] -= 1
    if flags.get("account_for_loss_in_pipeline_split"):
        counts[-1] -= 1
    assert lay.stage_num_layers(spec.num_layers) == (counts if pp > 1 else [spec.num_layers])
    # B's args carry the split as ppf/ppl, without the flags (megatron-core refuses both)
    b = mla.args_for_layout(lay, spec)
    assert b["account_for_embedding_in_pipeline_split"] is False
    assert b["account_for_loss_in_pipeline_split"] is False
    assert (b["decoder_first_pipeline_num_layers"] or 0, b["decoder_last_pipeline_num_layers"]
            or 0) == split


def test_account_for_flags_that_leave_a_stage_empty_are_refused():
    a = megatron_args(num_layers=1, tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                      account_for_embedding_in_pipeline_split=True)
    with pytest.raises(DynatrainError, match="leave a stage without a layer"):
        mla.layout_from_megatron_args(a, mla.spec_from_megatron_args(a), 4)


def _megatron_core_split(args, pp: int, vpp: int) -> tuple[int, ...]:
    """megatron-core's own layer count of every chunk ((vp stage, pp rank), vp-major) for
    Megatron-LM's `args` at pp x vpp, and its offsets checked to run on without a gap."""
    import copy

    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    kw = dict(num_layers=args.num_layers, hidden_size=64, num_attention_heads=8,
              pipeline_model_parallel_size=pp, pipeline_dtype=None,
              virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
              account_for_embedding_in_pipeline_split=getattr(
                  args, "account_for_embedding_in_pipeline_split", False),
              account_for_loss_in_pipeline_split=getattr(
                  args, "account_for_loss_in_pipeline_split", False),
              pipeline_model_parallel_layout=copy.copy(
                  getattr(args, "pipeline_model_parallel_layout", None)))
    import torch

    kw["pipeline_dtype"] = torch.float32
    config = TransformerConfig(**kw)
    from megatron.core import parallel_state as ps

    out, start = [], 0
    for v in range(vpp):
        for p in range(pp):
            # megatron-core 0.16.1 reads the pipeline rank of a layout from its globals
            ps.get_pipeline_model_parallel_rank = lambda p=p: p
            n = get_num_layers_to_build(config, vp_stage=v if vpp > 1 else None, pp_rank=p)
            if n:
                assert get_transformer_layer_offset(config, vp_stage=v if vpp > 1 else None,
                                                    pp_rank=p) == start
            out.append(n)
            start += n
    return tuple(out)


@pytest.mark.parametrize("flags,num_layers,pp,vpp", [
    (dict(account_for_embedding_in_pipeline_split=True), 7, 2, 2),  # 1 2 | 2 2
    (dict(account_for_loss_in_pipeline_split=True), 7, 2, 2),
    (dict(account_for_embedding_in_pipeline_split=True,
          account_for_loss_in_pipeline_split=True), 6, 2, 2),  # 1 2 | 2 1
    (dict(account_for_embedding_in_pipeline_split=True,
          account_for_loss_in_pipeline_split=True), 10, 2, 3),
    (dict(pipeline_model_parallel_layout="Et|tt|t|tL"), 5, 2, 2),
    (dict(pipeline_model_parallel_layout="E|ttt|tt|L"), 5, 2, 2),  # chunks without layers
    (dict(pipeline_model_parallel_layout="Ettt|tL"), 4, 2, 1),
])
def test_a_split_megatron_lm_fixes_is_the_layouts_split(monkeypatch, flags, num_layers, pp, vpp):
    """With virtual stages the account-for flags, and a layout string, fix every chunk's
    layers: the Layout's `split`, as megatron-core itself counts and offsets them; B's args
    keep the job's own flags, and a split they do not make is written as a layout string
    that megatron-core reads back to the same split."""
    from megatron.core import parallel_state as ps

    from dynatrain_megatron.megatron_lm.pipeline_split import PipelineRule

    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: pp)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_rank", lambda: 0)  # restored after
    monkeypatch.setattr(ps, "get_virtual_pipeline_model_parallel_world_size",
                        lambda: vpp if vpp > 1 else None)
    a = megatron_args(num_layers=num_layers, tensor_model_parallel_size=1,
                      pipeline_model_parallel_size=pp,
                      virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, **flags)
    assert mlm.unsupported_args(a) == [] and plans_from_metadata(a) == []
    spec = mla.spec_from_megatron_args(a)
    lay = mla.layout_from_megatron_args(a, spec, pp * 2)
    assert lay.split == _megatron_core_split(a, pp, vpp) and (lay.ppf, lay.ppl) == (0, 0)
    assert Layout.parse(str(lay)) == lay
    b = mla.args_for_layout(lay, spec, like=a)
    for k, v in flags.items():
        assert b[k] == v
    assert b["virtual_pipeline_model_parallel_size"] == (vpp if vpp > 1 else None)
    assert b["num_layers_per_virtual_pipeline_stage"] is None
    # a request for the same PP x VPP gets the job's split; its own split is kept
    rule = PipelineRule.from_args(a)
    assert rule.complete(Layout(tp=2, pp=pp, vpp=vpp, dp=1), num_layers).split == lay.split
    other = tuple(reversed(lay.split))
    if other != lay.split:
        mine = Layout(pp=pp, vpp=vpp, dp=2, split=other)
        assert rule.complete(mine, num_layers) == mine
        b = mla.args_for_layout(mine, spec, like=a)
        assert not b["account_for_embedding_in_pipeline_split"]
        assert _megatron_core_split(argparse.Namespace(**b, num_layers=num_layers), pp,
                                    vpp) == other


def test_a_layout_string_job_refuses_another_pp_at_the_request():
    """A layout string fixes PP x VPP: a request for another is rejected by the controller
    (training goes on), naming the string and how to name B's split; with B's split named
    it is accepted, and an account-for job's request gets the split its flags make."""
    from dynatrain_megatron.elastic.controller import Controller
    from dynatrain_megatron.megatron_lm.builder import MegatronLMBuilder
    from dynatrain_megatron.megatron_lm.transformer_config import JobIntents

    def controller(a):
        spec = mla.spec_from_megatron_args(a)
        b = MegatronLMBuilder(spec, mla.train_config_from_megatron_args(a), args=a,
                              intents=JobIntents.from_args(a), model_provider=lambda: None)
        return Controller(spec, None, complete=b.complete_layout)

    a = megatron_args(num_layers=5, tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                      virtual_pipeline_model_parallel_size=2,
                      pipeline_model_parallel_layout="Et|tt|t|tL")
    ctl = controller(a)
    assert ctl.validate("tp2pp2vpp2", 4).split == (1, 2, 1, 1)
    with pytest.raises(DynatrainError, match="has 4 stages, pp1 vpp1 has 1: a switch to "
                                             "another PP x VPP needs B's split named"):
        ctl.validate("tp1pp1", 4)
    assert ctl.validate("tp1pp4split1-1-2-1", 4).split == (1, 1, 2, 1)
    emb = controller(megatron_args(num_layers=7, tensor_model_parallel_size=1,
                                   pipeline_model_parallel_size=2,
                                   virtual_pipeline_model_parallel_size=2,
                                   account_for_embedding_in_pipeline_split=True))
    assert emb.validate("tp2pp2vpp2", 4).split == (1, 2, 2, 2)
    assert str(emb.validate("tp2pp2", 4)) == "tp2pp2ppf3dp1"  # (7 + 1) / 2, less one
    with pytest.raises(DynatrainError, match="do not split evenly"):
        emb.validate("tp1pp4vpp4", 4)  # (7 + 1) / 4 = 2 layers per stage, 4 chunks


@pytest.mark.parametrize("source", ["heterogeneous_layers_config_path",
                                    "heterogeneous_layers_config_encoded_json"])
def test_heterogeneous_layers_refuse_virtual_stages_at_the_request(source):
    """Megatron-LM (core_v0.19.0) builds heterogeneous layers' specs without the virtual
    stage, which megatron-core asserts on: its restart at a vpp layout fails (seen with
    tests/megatron_lm_heterogeneous.json at tp1pp2vpp2dp2), so a request for one is
    rejected with the reason before anything is prepared, and a schedule naming one is
    refused at start-up; layouts without virtual stages are completed as before."""
    from dynatrain_megatron.elastic.controller import Controller
    from dynatrain_megatron.megatron_lm.pipeline_split import PipelineRule

    a = megatron_args(num_layers=4, tensor_model_parallel_size=4, pipeline_model_parallel_size=1)
    setattr(a, source, "tests/megatron_lm_heterogeneous.json")
    rule = PipelineRule.from_args(a)
    ctl = Controller(mla.spec_from_megatron_args(megatron_args(num_layers=4)), None,
                     complete=lambda lay: rule.complete(lay, 4))
    with pytest.raises(DynatrainError, match=r"^vpp2: heterogeneous layers .* have no virtual "
                                             r"pipeline stages in Megatron-LM"):
        ctl.validate("tp1pp2vpp2", 4)
    assert str(ctl.validate("tp1pp2", 4)) == "tp1pp2dp2"
    ctl.schedule = [(3, "tp1pp2vpp2split1-1-1-1dp2")]  # a named split is no way round it
    with pytest.raises(DynatrainError, match="schedule refused on 4 ranks: iteration 3: vpp2"):
        ctl.check_schedule(4)
    assert not PipelineRule.from_args(megatron_args(num_layers=4)).heterogeneous


@pytest.mark.parametrize("over,flags", [
    (dict(spec=["my_specs", "layer"]), ["--spec"]),
    (dict(add_qkv_bias=True, add_bias_linear=False), ["--add-qkv-bias"]),
    # Megatron-LM sets add_qkv_bias with --add-bias-linear: biases everywhere, described
    (dict(add_qkv_bias=True, add_bias_linear=True), []),
    (dict(ddp_num_buckets=2), ["--ddp-num-buckets"]),
    (dict(ddp_num_buckets=2, ddp_pad_buckets_for_high_nccl_busbw=True),
     ["--ddp-num-buckets", "--ddp-pad-buckets-for-high-nccl-busbw"]),
])
def test_what_the_analytic_layout_cannot_place_is_planned_from_the_live_metadata(over, flags):
    a = megatron_args(**over)
    assert mlm.unsupported_args(a) == []
    assert plans_from_metadata(a) == flags


@pytest.mark.parametrize("over", [
    dict(use_precision_aware_optimizer=True), dict(optimizer_cpu_offload=True),
    dict(num_experts=8, moe_grouped_gemm=True, transformer_impl="transformer_engine"),
    dict(multi_latent_attention=True, transformer_impl="transformer_engine"),
    # Megatron-LM's FSDP: NCCL stream options / cuda:<device> buffers (both releases)
    dict(use_torch_fsdp2=True), dict(use_megatron_fsdp=True),
])
def test_cuda_only_options_are_refused_as_hardware(over):
    from dynatrain_megatron.megatron_lm.support import REFUSALS

    hits = [r for r in REFUSALS if r.test(megatron_args(**over))]
    assert [r.cls for r in hits] == ["hardware"] and "needs CUDA" in hits[0].why, hits


def test_a_learned_position_table_longer_than_the_sequence_is_described():
    from dynatrain_megatron.vps.analytic import analytic_layout

    a = megatron_args(position_embedding_type="learned_absolute", max_position_embeddings=64)
    assert mlm.unsupported_args(a) == [] and plans_from_metadata(a) == []
    spec = mla.spec_from_megatron_args(a)
    assert spec.max_position_embeddings == 64
    assert mla.spec_from_megatron_args(megatron_args(
        position_embedding_type="learned_absolute")).max_position_embeddings is None
    al = analytic_layout(spec, Layout.parse("tp2pp2dp1", 4), None)
    rows = {f.box.shape for f in al.fragments(0, ("param",))
            if f.key == "embedding.position_embeddings.weight"}
    assert rows == {(64, 64)}, rows


def test_the_default_placement_of_a_tp_pp_dp_job_is_its_restarts():
    """--dynatrain-default-placement: B's devices in the order a restart at B numbers its
    ranks, tp-pp-dp for a job launched with --use-tp-pp-dp-mapping (the builder's order)."""
    from dynatrain_megatron.megatron_lm.builder import MegatronLMBuilder
    from dynatrain_megatron.megatron_lm.transformer_config import JobIntents
    from dynatrain_megatron.transition.switch import choose_dst_placement
    from dynatrain_megatron.vps.placement import TP_PP_DP_ORDER, Placement, megatron_rank_order

    a = megatron_args(use_tp_pp_dp_mapping=True, tensor_model_parallel_size=1,
                      expert_tensor_parallel_size=1)
    spec = mla.spec_from_megatron_args(a)
    b = MegatronLMBuilder(spec, mla.train_config_from_megatron_args(a), args=a,
                          intents=JobIntents.from_args(a), model_provider=lambda: None)
    assert b.rank_order == TP_PP_DP_ORDER
    src, dst = Layout.parse("tp1pp2", 8), Layout.parse("tp2pp2", 8)
    got = choose_dst_placement(spec, b, src, megatron_rank_order(src, TP_PP_DP_ORDER), dst,
                               tuple(range(8)), "default")
    assert got == megatron_rank_order(dst, TP_PP_DP_ORDER) and got != Placement.default(8)
    # on other devices (a scale-out's), the same order over them
    got = choose_dst_placement(spec, b, src, Placement.default(8), dst, tuple(range(8, 16)),
                               "default")
    assert got.devices == tuple(8 + d for d in megatron_rank_order(dst, TP_PP_DP_ORDER).devices)
