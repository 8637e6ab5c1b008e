"""Command-line arguments: Megatron-LM-style training flags and the `--dynatrain` group.

`add_dynatrain_args(parser)` has the signature of Megatron-LM's `extra_args_provider`, so
the same function registers our flags in Megatron-LM's own parser (see patches/) and in our
entry point, `scripts/pretrain_gpt.py`. A value that would be ignored or silently changed
is an argument error, one line, when the arguments are parsed: a poll interval below 1, a
recovery checkpoint that is not a directory, and inside Megatron-LM (`host="megatron-lm"`)
the flags its loop has no use for (standby ranks, our recovery checkpoint).
"""
from __future__ import annotations

import argparse
import os

from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..mcore.train_config import TrainConfig


HOSTS = ("dynatrain", "megatron-lm")  # our entry point, Megatron-LM's pretrain_gpt.py


def positive_int(text: str) -> int:
    """An argparse type: an int of at least 1 (never clamped to one silently)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def existing_directory(text: str) -> str:
    """An argparse type: a directory that exists now (checked at start-up, not when a rank
    dies and the job needs it)."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a directory: name an existing dist_checkpointing directory")
    return text


def _megatron_lm_standby(text: str) -> int:
    """`--dynatrain-standby-ranks` inside Megatron-LM: only 0 (its loop starts every
    process training)."""
    if text.strip() in ("0", "+0", "-0"):
        return 0
    raise argparse.ArgumentTypeError(
        f"{text!r}: not supported inside Megatron-LM, where every process trains from the "
        f"start; scale in later with `dynatrain request --world N`")


def _megatron_lm_recovery_checkpoint(text: str) -> str:
    """`--dynatrain-recovery-checkpoint` inside Megatron-LM: never used there."""
    raise argparse.ArgumentTypeError(
        "not used inside Megatron-LM: a death that loses state resumes from Megatron-LM's "
        "own last --save")


def directory_path(text: str) -> str:
    """An argparse type for a directory the job uses or creates: refused at parsing, with
    one line, when the path exists and is not a directory (else every rank fails later)."""
    if not text:
        raise argparse.ArgumentTypeError("empty path")
    if os.path.lexists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    return text


def add_dynatrain_args(parser: argparse.ArgumentParser,
                       host: str = "dynatrain") -> argparse.ArgumentParser:
    """Register the `--dynatrain*` flags. `host`: whose training loop runs ("dynatrain",
    our entry point, or "megatron-lm", where the flags its loop has no use for are
    refused at parsing)."""
    if host not in HOSTS:
        raise ValueError(f"host {host!r}: one of {HOSTS}")
    megatron = host == "megatron-lm"
    g = parser.add_argument_group("dynatrain", "online switching of the parallel layout")
    g.add_argument("--dynatrain", action="store_true", help="enable online layout switching")
    g.add_argument("--dynatrain-signal-file", default=None,
                   help="path polled for switch requests (write it with `dynatrain request`)")
    g.add_argument("--dynatrain-poll-interval", type=positive_int, default=1,
                   help="poll the signal file every N iterations")
    g.add_argument("--dynatrain-memory-budget", type=int, default=None,
                   help="max staging bytes per rank and round during a switch")
    g.add_argument("--dynatrain-ranks-per-node", type=int, default=8,
                   help="ranks per node, for placement and source choice")
    g.add_argument("--dynatrain-schedule", default=None,
                   help="YAML list of {iteration, layout} switches to run")
    g.add_argument("--dynatrain-log-dir", default=None, help="where switch reports are written")
    g.add_argument("--dynatrain-log-all-ranks", action="store_true",
                   help="every rank prints its dynatrain lines (debugging); by default rank 0 "
                        "prints one line per event and the others only warnings and errors")
    g.add_argument("--dynatrain-default-placement", action="store_true",
                   help="pin Megatron's default rank order instead of the chosen placement")
    g.add_argument("--dynatrain-device-memory", type=int, default=None,
                   help="bytes per device; a target whose state would not fit is refused, "
                        "and a switch whose A and B do not fit together is prepared in a "
                        "degraded way (loop/memory_check.py). On a GPU the check is on "
                        "without it (the device is measured); this caps the device's size")
    g.add_argument("--dynatrain-activation-reserve", type=int, default=0,
                   help="bytes of A's activations per device where they cannot be measured "
                        "(CPU); on a GPU the allocator's peak is measured")
    g.add_argument("--dynatrain-memory-reserve", type=int, default=0,
                   help="bytes per device kept free during a switch (NCCL buffers, "
                        "fragmentation)")
    g.add_argument("--dynatrain-auto-layout", action="store_true",
                   help="when the device count changes (standby ranks, an admitted joiner, "
                        "the survivors of a rank death), move to the layout advisor's best "
                        "layout for it (`dynatrain suggest`); the log and switches.jsonl say why")
    g.add_argument("--dynatrain-compare-checkpoint", action="store_true",
                   help="at the end, time the dist_checkpointing save+load path for the summary")
    g.add_argument("--dynatrain-standby-ranks", default=0,
                   type=_megatron_lm_standby if megatron else int,
                   help="processes that start on standby (no training state) for a later "
                        "scale-out; the layout uses the others")
    g.add_argument("--dynatrain-timeout", type=float, default=300.0,
                   help="seconds before a switch is aborted and rolled back")
    g.add_argument("--dynatrain-recovery-checkpoint", default=None,
                   type=_megatron_lm_recovery_checkpoint if megatron else existing_directory,
                   help="the dist_checkpointing directory to resume from when a rank dies "
                        "holding the only copy of some state (with --dynatrain-rendezvous-dir; "
                        "nothing is needed when every shard is replicated, doi > 1)")
    g.add_argument("--dynatrain-join", action="store_true",
                   help="this process asks the job running in --dynatrain-rendezvous-dir to "
                        "take it in (proving the job's secret: --dynatrain-secret-file or "
                        "$DYNATRAIN_JOB_SECRET) and waits on standby for a scale-out")
    g.add_argument("--dynatrain-rendezvous-dir", type=directory_path, default=None,
                   help="shared directory of the FileStore the job's processes (and processes "
                        "asking to join, `dynatrain join`) meet in; torchrun's agent store is "
                        "used instead when the job runs under torchrun with one")
    g.add_argument("--dynatrain-secret-file", default=None,
                   help="the job's secret (mode 0600, owned by you), which a process asking to "
                        "join must prove it holds; created at launch when missing (default: "
                        "$DYNATRAIN_JOB_SECRET, else job_secret in the rendezvous dir)")
    return parser


def add_training_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The Megatron-LM flags our entry point understands (same names and meaning)."""
    g = parser.add_argument_group("training")
    g.add_argument("--model-config", required=True,
                   help="model config: a name in configs/models or a YAML path")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="accepted for compatibility; the distributed optimizer is always used")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="optimizer state replicated this many times (layout axis doi): a dead "
                        "rank's shards survive on the other instances")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=16)
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=1e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=2)
    g.add_argument("--lr-decay-style", default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--ddp-bucket-size", type=int, default=None)
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--bf16", action="store_true", help="override the config's params_dtype")
    g.add_argument("--log-interval", type=int, default=1)
    return parser


def layout_from_args(args: argparse.Namespace, spec: ModelSpec, world_size: int) -> Layout:
    """Megatron-LM's flags -> Layout (DP from the world size), checked against the model."""
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    vpp = 1
    if args.num_layers_per_virtual_pipeline_stage:
        per = args.num_layers_per_virtual_pipeline_stage
        if spec.num_layers % (pp * per):
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per}: num_layers "
                             f"{spec.num_layers} % (pp*{per}) != 0")
        vpp = spec.num_layers // (pp * per)
    text = f"tp{tp}pp{pp}cp{cp}ep{args.expert_model_parallel_size}"
    if vpp > 1:
        text += f"vpp{vpp}"
    if args.expert_tensor_parallel_size:
        text += f"etp{args.expert_tensor_parallel_size}"
    if args.num_distributed_optimizer_instances > 1:
        text += f"doi{args.num_distributed_optimizer_instances}"
    layout = Layout.parse(text, world_size)
    layout.check_model(spec)
    return layout


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        train_iters=args.train_iters, lr=args.lr, min_lr=args.min_lr,
        lr_warmup_iters=args.lr_warmup_iters, lr_decay_style=args.lr_decay_style,
        weight_decay=args.weight_decay, clip_grad=args.clip_grad, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, seed=args.seed, ddp_bucket_size=args.ddp_bucket_size,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather)
