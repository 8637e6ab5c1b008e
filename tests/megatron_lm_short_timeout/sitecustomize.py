"""Test-only start-up code (on PYTHONPATH for the job of test_megatron_lm_standby_end.py):
once Megatron-LM's `train()` starts, the job's default process group gets a timeout of
$DYNATRAIN_TEST_PG_TIMEOUT_S seconds (on the ranks in $DYNATRAIN_TEST_PG_TIMEOUT_RANKS) instead of `--distributed-timeout-minutes` (whole
minutes, at least one), so that a wait longer than the process-group timeout costs seconds
of test time. Set when training starts, not at start-up, where the ranks arrive seconds
apart on a loaded machine. Megatron-LM's model-parallel groups keep their own timeout."""
import importlib.abc
import importlib.machinery
import os
import sys

_SECONDS = os.environ.get("DYNATRAIN_TEST_PG_TIMEOUT_S")
# only on these launch ranks (comma-separated; all when unset): a collective times out on
# the process whose own wait passes its timeout. Read when train() starts: the tests' launcher
# forks the workers from one process that imported Megatron-LM before any had a RANK
_RANKS = os.environ.get("DYNATRAIN_TEST_PG_TIMEOUT_RANKS")
_MODULE = "megatron.training.training"


def _shorten(train):
    import datetime
    import functools

    @functools.wraps(train)
    def shortened(*args, **kwargs):
        from torch.distributed import distributed_c10d

        if _RANKS is None or os.environ.get("RANK") in _RANKS.split(","):
            distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=float(_SECONDS)))
        return train(*args, **kwargs)

    return shortened


class _WrapTrain(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds megatron.training.training as usual, then wraps its `train` once executed."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        module.train = _shorten(module.train)


if _SECONDS:
    sys.meta_path.insert(0, _WrapTrain())
