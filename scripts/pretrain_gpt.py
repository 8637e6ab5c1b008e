#!/usr/bin/env python
"""Train a megatron-core GPT / MoE with Megatron-LM-style flags (the counterpart of
Megatron-LM's pretrain_gpt.py). Launch with torchrun, e.g.

  torchrun --nproc_per_node 4 scripts/pretrain_gpt.py --model-config configs/models/tiny-gpt.yaml \
      --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --train-iters 20
"""
import sys

from dynatrain_megatron import process_env

process_env.apply()  # before torch is imported (it reads THP_MEM_ALLOC_ENABLE once)

from dynatrain_megatron.loop.main import main  # noqa: E402

if __name__ == "__main__":  # guard needed: dist_checkpointing's helper re-imports __main__
    sys.exit(main())
