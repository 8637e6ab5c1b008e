"""Run by test_megatron_lm_config.py in a fresh interpreter with the Megatron-LM snapshot on
the path: for each case, Megatron-LM's own validated args for a job at A, the config our
factory makes from them for layout B, and the config Megatron-LM makes when launched at B
(`core_transformer_config_from_args` of its validated args); prints the differing fields
as JSON. Then (SAMPLER line) whether iterators advanced to a later count yield what
Megatron-LM's sampler yields from that count (`sampler_advanced_as_built_later`). argv: a JSON list of [flags at A, flags at B, B's layout]."""
import dataclasses
import functools
import json
import os
import sys

os.environ.setdefault("WORLD_SIZE", "4")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

from dynatrain_megatron.compat.megatron_lm import prepare_megatron_lm  # noqa: E402

prepare_megatron_lm()

from megatron.training.arguments import (core_transformer_config_from_args, parse_args,  # noqa: E402
                                         validate_args)

from dynatrain_megatron.megatron_lm.arguments import (chain_extra_args_providers,  # noqa: E402
                                                      spec_from_megatron_args)
from dynatrain_megatron.megatron_lm.transformer_config import (JobIntents,  # noqa: E402
                                                               megatron_lm_config_factory)
from dynatrain_megatron.vps.layout import Layout  # noqa: E402

# not compared: how weights are initialised (B's are filled by the switch, not drawn)
INIT_FIELDS = {"perform_initialization", "use_cpu_initialization"}


def megatron_args(flags: list[str], vocab_rows: int):
    sys.argv = ["pretrain_gpt.py", *flags]
    args = parse_args(extra_args_provider=chain_extra_args_providers())
    validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    args.padded_vocab_size = vocab_rows  # what Megatron-LM's tokenizer set-up computes
    return args


def same(x, y) -> bool:
    if isinstance(x, functools.partial) and isinstance(y, functools.partial):
        return (x.func, x.args, x.keywords) == (y.func, y.args, y.keywords)
    return x == y


def main() -> None:
    out = []
    for a_flags, b_flags, b_text in json.loads(sys.argv[1]):
        a = megatron_args(a_flags, 1024)
        spec = spec_from_megatron_args(a)
        layout = Layout.parse(b_text, int(os.environ["WORLD_SIZE"]))
        ours = megatron_lm_config_factory(a, spec, JobIntents.from_args(a))(layout, False)
        theirs = core_transformer_config_from_args(
            megatron_args(b_flags, spec.padded_vocab_size(layout.tp)))
        diff = [f.name for f in dataclasses.fields(ours) if f.name not in INIT_FIELDS
                and not same(getattr(ours, f.name), getattr(theirs, f.name))]
        ddp, optimizer = ddp_and_optimizer_differences(a, spec, layout, b_flags)
        out.append({"layout": b_text, "diff": diff, "sequence_parallel": ours.sequence_parallel,
                    "ddp_diff": ddp, "optimizer_diff": optimizer,
                    "overlap_p2p_comm": ours.overlap_p2p_comm,
                    "recompute": ours.recompute_granularity,
                    "perform_initialization": ours.perform_initialization})
    print("RESULT " + json.dumps(out))
    print("SAMPLER " + json.dumps(sampler_advanced_as_built_later()))


def fields_differing(x, y) -> list:
    return [f.name for f in dataclasses.fields(x) if not same(getattr(x, f.name),
                                                              getattr(y, f.name))]


def ddp_and_optimizer_differences(a, spec, layout: Layout, b_flags: list[str]):
    """B's DDP and optimizer configs as Megatron-LM's own functions make them from the args
    our builder gives B (`MegatronLMBuilder.args_for`, on NCCL), against those made from
    Megatron-LM's args at B: the differing fields (None: this release has no such function;
    core_v0.16.1 builds its DDP config inside get_model)."""
    import types

    import torch
    from megatron.training import training as lm_training

    from dynatrain_megatron.mcore.train_config import TrainConfig
    from dynatrain_megatron.megatron_lm.builder import MegatronLMBuilder

    builder = MegatronLMBuilder(spec, TrainConfig(), args=a, intents=JobIntents.from_args(a),
                                model_provider=lambda *x: None)
    backend = torch.distributed.get_backend
    torch.distributed.get_backend = lambda group=None: "nccl"
    try:
        ours = builder.args_for(layout, types.SimpleNamespace(rank=0), init_weights=False)
    finally:
        torch.distributed.get_backend = backend
    theirs = megatron_args(b_flags, spec.padded_vocab_size(layout.tp))
    ddp = getattr(lm_training, "get_megatron_ddp_config", None)
    ddp_diff = None if ddp is None else fields_differing(ddp(ours), ddp(theirs))
    made = [lm_training.get_megatron_optimizer_config(x) for x in (ours, theirs)]
    made = [m if isinstance(m, tuple) else (m, None) for m in made]
    opt_diff = fields_differing(made[0][0], made[1][0])
    if made[0][1] != made[1][1]:  # per-parameter overrides
        opt_diff.append("config_overrides")
    return ddp_diff, opt_diff


def sampler_advanced_as_built_later() -> list:
    """Megatron-LM's own sequential sampler through a DataLoader and megatron-core's replay
    wrapper: a loader started at c0 and advanced (`data_ahead.advance`) to c1 yields, on
    every data-parallel rank, what one started at c1 yields (the next micro-batches);
    returns the cases where it does not."""
    from torch.utils.data import DataLoader

    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    from dynatrain_megatron.megatron_lm.data_ahead import advance

    def loader(consumed, mbs, rank, dp):
        sampler = MegatronPretrainingSampler(400, consumed, mbs, rank, dp)
        return iter(DataLoader(list(range(400)), batch_sampler=sampler))

    wrong = []
    for mbs, dp, c0, c1 in ((2, 2, 24, 56), (1, 4, 0, 32), (4, 1, 8, 8), (2, 3, 12, 84)):
        for rank in range(dp):
            ahead = [RerunDataIterator(loader(c0, mbs, rank, dp)), None]  # VPP: 2 chunks
            advance(ahead, (c1 - c0) // (mbs * dp))
            later = loader(c1, mbs, rank, dp)
            got = [next(ahead[0]).tolist() for _ in range(4)]
            want = [next(later).tolist() for _ in range(4)]
            if got != want or ahead[0].saved_microbatches[:-4]:
                wrong.append([mbs, dp, c0, c1, rank, got, want])
    return wrong


if __name__ == "__main__":
    main()
