"""Megatron-core glue: what a job built on megatron-core needs around the switch.

    train_config  the training hyper-parameters (frozen)
    builders      model chunks, DDP, distributed optimizer, scheduler for a layout; the
                  `Builder` the switch calls to build layout B
    data          synthetic GPT batches, split into microbatches per model chunk
    training      one training step on the built objects (`Trainer`)
    dist_ckpt     save and load through megatron-core's dist_checkpointing
    session       the process-wide megatron state of a job: start, freeze, release
"""
