#!/usr/bin/env python
"""An RLHF-style loop inside real Megatron-LM: code that owns its loop on top of
Megatron-LM's own training objects (its model chunks from `get_model`, its optimizer and
scheduler from `setup_model_and_optimizer`, its `train_step`) trains at layout A; switches
the weights alone to a generation layout G (no pipeline parallelism, more replicas);
generates greedily with megatron-core's own inference code (the static engine, a KV cache);
comes back to A and trains on, with the training state exactly as if it had never left.

Run from a Megatron-LM checkout (its `pretrain_gpt.py`, `model_provider.py` and
`gpt_builders.py` importable; no patch needed: this is not `pretrain()`'s loop), with
Megatron-LM's own flags plus `--rlhf-*` ones:

    cd <Megatron-LM checkout>
    PYTHONPATH=<this project>:. torchrun --nproc-per-node 4 <this project>/examples/rlhf_megatron_lm.py \\
        <model, data and optimizer flags as for pretrain_gpt.py> \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --rlhf-generate tp2pp1dp2 --rlhf-rounds 2 --rlhf-train-steps 3

On the CPU (gloo; the flags of README's quickstart) as on GPUs. The loop itself is
`examples/rlhf_loop.py`'s, the same as on our megatron-core stand-in job;
tests/megatron_lm_rlhf_job.py runs it in a test (tests/test_megatron_lm_rlhf.py).
"""
from __future__ import annotations

import importlib.util
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rlhf_loop.py beside this file

log = logging.getLogger("dynatrain.example")

PROMPTS = ("The quick brown fox", "Once upon a time")


def add_rlhf_args(parser: Any) -> Any:
    """The example's own flags, next to Megatron-LM's."""
    g = parser.add_argument_group("rlhf example")
    g.add_argument("--rlhf-generate", default="tp2pp1dp2", help="the generation layout G")
    g.add_argument("--rlhf-rounds", type=int, default=2)
    g.add_argument("--rlhf-train-steps", type=int, default=3, help="steps at A per round")
    g.add_argument("--rlhf-num-tokens", type=int, default=8, help="tokens generated per prompt")
    g.add_argument("--rlhf-optimizer", choices=("keep", "host"), default="host",
                   help="where the optimizer state waits during generation")
    return parser


def start_megatron_lm(extra_args_provider: Callable = add_rlhf_args) -> ModuleType:
    """Initialise Megatron-LM from the command line (its args, the world, its groups, the
    seeds) as `pretrain()` does, and return the checkout's `pretrain_gpt` module (its model
    provider, forward step and datasets). Releases differ in where the args are parsed
    (found by feature)."""
    from dynatrain_megatron.compat.megatron_lm import prepare_megatron_lm

    prepare_megatron_lm()  # the CPU runtime where there is no GPU
    import megatron.training
    from megatron.training import arguments
    from megatron.training.initialize import initialize_megatron

    defaults = {"tokenizer_type": "GPT2BPETokenizer"}
    if hasattr(arguments, "parse_and_validate_args"):  # core_v0.19: parsed before
        arguments.parse_and_validate_args(extra_args_provider=extra_args_provider,
                                          args_defaults=defaults)
        initialize_megatron()
    else:
        initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=defaults)
    # the checkout's own pretrain_gpt.py, beside the megatron/ it runs with
    checkout = Path(megatron.training.__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("pretrain_gpt", checkout / "pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["pretrain_gpt"] = module
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Step:
    """One training step: its iteration and its loss (the same on every rank)."""

    iteration: int
    loss: float


class MegatronLMTraining:
    """Megatron-LM's training objects and the loop's step: `setup_model_and_optimizer`'s
    model chunks, optimizer and scheduler, `pretrain_gpt`'s data and forward step, run by
    Megatron-LM's own `train_step`."""

    def __init__(self, gpt: ModuleType) -> None:
        import functools

        from megatron.core.distributed import finalize_model_grads
        from megatron.core.enums import ModelType
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.utils import get_model_config
        from megatron.training import get_timers
        from megatron.training.training import (build_train_valid_test_data_iterators,
                                                setup_model_and_optimizer)

        self.model_provider = functools.partial(gpt.model_provider, gpt.gpt_builder)
        self.model, self.optimizer, self.scheduler = setup_model_and_optimizer(
            model_provider_func=self.model_provider, model_type=ModelType.encoder_or_decoder)
        self.config = get_model_config(self.model[0])
        # what Megatron-LM's train() sets on the config before its loop
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.config.timers = get_timers()
        self.config.finalize_model_grads_func = finalize_model_grads
        provider = gpt.train_valid_test_datasets_provider
        provider.is_distributed = True
        self.data, _, _ = build_train_valid_test_data_iterators(provider)
        self.forward_step = gpt.forward_step
        self.forward_backward = get_forward_backward_func()
        self.iteration = 0

    def step(self) -> Step:
        """One step of Megatron-LM's `train_step` (every rank); the loss is the last
        pipeline stage's, given to every rank."""
        import torch
        import torch.distributed as dist
        from megatron.training.training import train_step

        for chunk in self.model:
            chunk.train()
        out = train_step(self.forward_step, self.data, self.model, self.optimizer,
                         self.scheduler, self.config, self.forward_backward,
                         iteration=self.iteration)
        losses = out[0]
        self.iteration += 1
        loss = torch.tensor([float(losses["lm loss"]) if losses else float("-inf")])
        dist.all_reduce(loss, op=dist.ReduceOp.MAX)
        return Step(self.iteration, float(loss.item()))


def elastic_job_of(training: MegatronLMTraining) -> Any:
    """The public API on these training objects (`megatron_lm.job.elastic_job`)."""
    from dynatrain_megatron.megatron_lm.job import elastic_job

    return elastic_job(training.model, training.optimizer, training.scheduler, training.config,
                       model_provider=training.model_provider)


def run_rounds(training: Any, job: Any, args: Any, **hooks: Any) -> list:
    """The RLHF rounds of the command line (`--rlhf-*`) on `training` and its `job`
    (`rlhf_loop`; `hooks`: its `at_generation`, `before_generation`). Returns each round's
    generation."""
    from rlhf_loop import rlhf_loop

    return rlhf_loop(training, job, rounds=args.rlhf_rounds, train_steps=args.rlhf_train_steps,
                     gen_layout=args.rlhf_generate, prompts=PROMPTS,
                     num_tokens=args.rlhf_num_tokens, optimizer=args.rlhf_optimizer, **hooks)


def main() -> int:
    gpt = start_megatron_lm()  # first: the CPU runtime precedes megatron's imports
    import torch.distributed as dist
    from megatron.training import get_args

    args = get_args()
    logging.basicConfig(format="%(asctime)s %(message)s")
    for name in ("dynatrain", "dynatrain.example"):  # one line per event, from rank 0
        logging.getLogger(name).setLevel(logging.INFO if dist.get_rank() == 0 else logging.WARNING)
    training = MegatronLMTraining(gpt)
    job = elastic_job_of(training)
    gens = run_rounds(training, job, args)
    if dist.get_rank() == 0:
        for r, g in enumerate(gens):
            for prompt, tokens in zip(g.prompts, g.tokens):
                print(f"round {r}: {prompt!r} -> {list(tokens)}", flush=True)
    step = training.step()  # training goes on at A
    log.info("after the rounds: iteration %d, loss %.6f", step.iteration, step.loss)
    dist.barrier()
    return 0


if __name__ == "__main__":
    from dynatrain_megatron import process_env

    process_env.apply()  # before torch is imported
    sys.exit(main())
