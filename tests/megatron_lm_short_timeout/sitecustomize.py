"""Test-only start-up code (on PYTHONPATH for the job of test_megatron_lm_standby_end.py):
the job's default process group gets a timeout of $DYNATRAIN_TEST_PG_TIMEOUT_S seconds
instead of Megatron-LM's `--distributed-timeout-minutes` (whole minutes, at least one), so
that a wait longer than the process-group timeout costs seconds of test time, not minutes.
Megatron-LM's own model-parallel groups keep their timeout (they are made with it)."""
import os

_SECONDS = os.environ.get("DYNATRAIN_TEST_PG_TIMEOUT_S")
if _SECONDS:
    import datetime
    import functools

    import torch.distributed as _dist

    _init = _dist.init_process_group

    @functools.wraps(_init)
    def _init_with_short_timeout(*args, **kwargs):
        kwargs["timeout"] = datetime.timedelta(seconds=float(_SECONDS))
        return _init(*args, **kwargs)

    _dist.init_process_group = _init_with_short_timeout
