#!/usr/bin/env python
"""Check the Megatron-LM adapter's runtime path without Megatron-LM: 4 gloo ranks on the CPU.

Megatron-LM is emulated where the adapter meets it: process groups come from megatron-core's
own `initialize_model_parallel` (as Megatron-LM's `initialize_megatron` makes them), the
first layout's objects are built on those groups, and `megatron.training` is a stub with the
two functions the adapter imports (`get_tokenizer`, `build_train_valid_test_data_iterators`).
The loop then calls `dynatrain_step` after every step as the patched `train()` does, a
switch tp2pp2dp1 -> tp1pp2dp2 is requested through the signal file, and the losses after the
switch are compared with a dist_checkpointing save at A and load at B (must be identical).
What this does not cover: Megatron-LM's real model provider (TE layer spec), its
core_transformer_config_from_args, train_step, data loaders and checkpointing.

  python scripts/check_megatron_lm_adapter.py     # ~1-2 min on 2 cores
"""
import argparse
import json
import os
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def case(root):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from dynatrain_megatron.compat import prepare_runtime
    from dynatrain_megatron.megatron_lm import adapter as mlm
    from dynatrain_megatron.megatron_lm import arguments as mla
    from dynatrain_megatron.mcore.builders import build_training_objects, seed_rngs
    from dynatrain_megatron.mcore.training import Trainer
    from dynatrain_megatron.mcore.train_config import TrainConfig
    from dynatrain_megatron.vps.layout import Layout
    from dynatrain_megatron.vps.model_spec import ModelSpec
    from dynatrain_megatron.elastic.signal_file import write_request

    prepare_runtime()
    # fake Megatron-LM pieces the adapter imports lazily
    built = []
    mt = types.ModuleType("megatron.training")
    mt.get_tokenizer = lambda: types.SimpleNamespace(vocab_size=1000)
    mtt = types.ModuleType("megatron.training.training")
    def build_iters(provider):
        built.append((ps.get_data_parallel_world_size(), ps.get_tensor_model_parallel_world_size()))
        return provider(None)
    mtt.build_train_valid_test_data_iterators = build_iters
    # B's config: Megatron-LM's core_transformer_config_from_args, emulated by our own
    # config for the layout the args describe (tests/test_megatron_lm_config.py checks the
    # real one against a Megatron-LM launched at B)
    mta = types.ModuleType("megatron.training.arguments")
    def config_from_args(a):
        from dynatrain_megatron.mcore.builders import make_transformer_config
        lay = mla.layout_from_megatron_args(a, spec, dist.get_world_size())
        return make_transformer_config(spec, lay, init_weights=False)
    mta.core_transformer_config_from_args = config_from_args
    sys.modules["megatron.training"] = mt
    sys.modules["megatron.training.training"] = mtt
    sys.modules["megatron.training.arguments"] = mta

    # Megatron-LM's initialisation: megatron's own groups, default rank order
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    spec = ModelSpec.from_yaml(os.path.join(ROOT, "configs", "models", "tiny-gpt.yaml"))
    train = TrainConfig(global_batch_size=8, micro_batch_size=2, lr=1e-2, min_lr=1e-3,
                        lr_warmup_iters=1, train_iters=20)
    layout = Layout.parse("tp2pp2", 4)
    groups = mlm.wrap_megatron_groups(layout)  # checks megatron's groups == our Layout's
    seed_rngs(train.seed, groups)  # stands in for Megatron-LM's _set_random_seed
    objs = build_training_objects(spec, layout, groups, train)  # stands in for setup_model_and_optimizer
    runner = Trainer(spec, train, objs)  # stands in for train_step
    signal = os.path.join(root, "switch.json")
    args = argparse.Namespace(
        num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8,
        group_query_attention=True, num_query_groups=4, kv_channels=8, seq_length=32,
        max_position_embeddings=32, vocab_size=1000, padded_vocab_size=1024,
        make_vocab_size_divisible_by=128, swiglu=True, position_embedding_type="rope",
        untie_embeddings_and_output_weights=True, normalization="RMSNorm", add_bias_linear=False,
        bf16=False, fp16=False, hidden_dropout=0.0, attention_dropout=0.0, transformer_impl="local",
        use_distributed_optimizer=True, micro_batch_size=2, global_batch_size=8, train_iters=20,
        lr=1e-2, min_lr=1e-3, lr_warmup_iters=1, lr_decay_style="cosine", weight_decay=0.01,
        adam_beta1=0.9, adam_beta2=0.95, clip_grad=1.0, seed=1234,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=None, context_parallel_size=1,
        expert_model_parallel_size=1, expert_tensor_parallel_size=2, consumed_train_samples=0,
        overlap_grad_reduce=False, overlap_param_gather=False, data_parallel_size=1)
    mla.chain_extra_args_providers(None)(p := argparse.ArgumentParser())
    for k, v in vars(p.parse_args(["--dynatrain", "--dynatrain-signal-file", signal,
                                   "--dynatrain-ranks-per-node", "4"])).items():
        setattr(args, k, v)
    mlm.register_dataset_provider(lambda n: ("train_it", "valid_it", "test_it"), args)
    model, opt, sched, cfg = objs.model, objs.optimizer, objs.scheduler, objs.config
    tr_it, va_it = "orig_train", "orig_valid"
    losses, changed_at = [], []
    for it in range(1, 7):
        losses.append(runner.step().loss)
        args.consumed_train_samples += 8
        if dist.get_rank() == 0 and it == 2:
            write_request(signal, "tp1pp2dp2")
        dt = mlm.dynatrain_step(args, it, model, opt, sched, tr_it, va_it, cfg)
        if dt.changed:
            changed_at.append(it)
            model, opt, sched, cfg = dt.model, dt.optimizer, dt.opt_param_scheduler, dt.config
            tr_it, va_it = dt.train_data_iterator, dt.valid_data_iterator
            runner = mlm._SESSION.trainer
    final = mlm.finish_training(model, opt, sched, tr_it, va_it, "orig_test", cfg)
    return dict(losses=losses, changed_at=changed_at, built=built, tp=args.tensor_model_parallel_size,
                dp=args.data_parallel_size, padded=args.padded_vocab_size, iters=(tr_it, va_it),
                timers=cfg.timers, test_it=final[5], layout=str(mlm._SESSION.trainer.objs.layout),
                same_model=final[0] is model)


def reference(root):
    """The same job through the checkpoint path (dist_checkpointing save at A, load at B)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from rank_cases import checkpoint_path_case

    return checkpoint_path_case("tiny-gpt", "tp2pp2dp1", "tp1pp2dp2", root, steps_before=3,
                                steps_after=3)["losses"]


def main() -> int:
    from dynatrain_megatron.testing.multiproc import run_on_ranks

    env = {"PYTHONPATH": os.pathsep.join([HERE, os.path.join(ROOT, "tests")])}
    res = run_on_ranks(case, 4, tempfile.mkdtemp(), env=env)
    ref = run_on_ranks(reference, 4, tempfile.mkdtemp(), env=env)[0]
    r = res[0]
    ok = (all(x == r for x in res) and r["changed_at"] == [3] and r["layout"] == "tp1pp2dp2"
          and (r["tp"], r["dp"]) == (1, 2) and [list(b) for b in r["built"]] == [[2, 1]]
          and r["same_model"]
          and r["losses"][3:] == ref)
    sys.stdout.write(json.dumps(dict(result=r, checkpoint_path_losses=ref, ok=ok)) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
