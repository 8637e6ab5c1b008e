"""On PYTHONPATH for the tests' runs of an *unpatched* Megatron-LM: every torchrun worker
(and every process it spawns, e.g. --save's writers) prepares the CPU runtime the patch
would prepare, at interpreter start. The reference for 'the patch changes nothing
without --dynatrain'."""
import os

if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
    from dynatrain_megatron.compat.megatron_lm import prepare_megatron_lm

    prepare_megatron_lm()
