#!/usr/bin/env python
"""An RLHF-style loop on a megatron-core job: train at layout A; switch the weights alone
to a generation layout G (TP-heavy, no pipeline parallelism, more replicas); generate
greedily with megatron-core's own inference engine; come back to A and train on, with
the training state exactly as if the job had never left.

    torchrun --nproc_per_node 4 examples/rlhf_loop.py --train tp2pp2dp1 --generate tp2pp1dp2

On the CPU (gloo) as on GPUs. The tests run `rlhf_loop` inside their ranks (tests/api_cases.py).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

log = logging.getLogger("dynatrain.example")

PROMPTS = ("The quick brown fox", "Once upon a time")


def rlhf_loop(trainer, job, *, rounds: int, train_steps: int, gen_layout: str,
              prompts: Sequence[str], num_tokens: int, optimizer: str = "host",
              at_generation: Optional[Callable] = None,
              before_generation: Optional[Callable] = None) -> list:
    """`rounds` times: train `train_steps` steps at the job's layout, then generate at
    `gen_layout` from the weights just trained. `trainer` trains `job`'s objects (the
    stand-in job's `Trainer`, or Megatron-LM's in examples/rlhf_megatron_lm.py);
    `optimizer`: "keep" or "host" (where the optimizer state waits meanwhile). `before_generation(round)`, if given, is called at A before the
    weights leave, `at_generation(gen)` at G before generating. Returns each round's
    `GreedyGeneration`."""
    from dynatrain_megatron.generation import byte_tokenizer, generate_greedy

    tokenizer = byte_tokenizer()
    out = []
    try:
        for r in range(rounds):
            for _ in range(train_steps):
                step = trainer.step()
                log.info("round %d: iteration %d, loss %.4f", r, step.iteration, step.loss)
            if before_generation is not None:
                before_generation(r)
            # G's chunks and groups are built in the first round and kept for the next
            gen = job.weights_to(gen_layout, optimizer=optimizer)
            if at_generation is not None:
                at_generation(gen)
            try:
                out.append(generate_greedy(gen.model, gen.pg_collection, tokenizer, prompts,
                                           num_tokens))
            finally:
                job.weights_back(keep=True)
            log.info("round %d: weights %s -> %s and back (%d bytes moved, %.3f s, "
                     "optimizer %s); generated %s", r, job.current().layout, gen.layout,
                     gen.bytes_moved, gen.pause_seconds, optimizer, list(out[-1].tokens))
    finally:
        job.release_kept_weights()
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    from dynatrain_megatron import ElasticJob
    from dynatrain_megatron.mcore.builders import MegatronBuilder
    from dynatrain_megatron.mcore.session import release, start_job
    from dynatrain_megatron.mcore.train_config import TrainConfig
    from dynatrain_megatron.vps.model_spec import ModelSpec

    root = Path(__file__).resolve().parent.parent
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-config", default=str(root / "configs/models/tiny-gpt.yaml"))
    p.add_argument("--train", default="tp2pp2dp1", help="the training layout A")
    p.add_argument("--generate", default="tp2pp1dp2", help="the generation layout G")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=3)
    p.add_argument("--num-tokens", type=int, default=8)
    p.add_argument("--optimizer", choices=("keep", "host"), default="host")
    a = p.parse_args(argv)
    spec = ModelSpec.from_yaml(a.model_config)
    train = TrainConfig(global_batch_size=8, micro_batch_size=2, lr=1e-2, min_lr=1e-3,
                        lr_warmup_iters=1, train_iters=a.rounds * a.train_steps + 1)
    trainer = start_job(spec, a.train, train)
    import torch.distributed as dist

    logging.basicConfig(level=logging.INFO if dist.get_rank() == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    job = ElasticJob.from_objects(trainer.objs, MegatronBuilder(spec, train))
    gens = rlhf_loop(trainer, job, rounds=a.rounds, train_steps=a.train_steps,
                     gen_layout=a.generate, prompts=PROMPTS, num_tokens=a.num_tokens,
                     optimizer=a.optimizer)
    if dist.get_rank() == 0:
        for r, g in enumerate(gens):
            for prompt, text in zip(g.prompts, g.tokens):
                print(f"round {r}: {prompt!r} -> {list(text)}")
    trainer.step()  # training goes on at A
    release(trainer.objs)
    dist.barrier()
    dist.destroy_process_group()  # every communicator's threads end before the interpreter
    return 0


if __name__ == "__main__":
    from dynatrain_megatron import process_env

    process_env.apply()
    sys.exit(main())
