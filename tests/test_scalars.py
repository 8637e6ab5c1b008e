"""The loss scalers a switch carries (transition/scalars.py): one per optimizer inside
megatron-core's ChainedOptimizer, each to B's optimizer of the same position, copied to the
host and apart from A's. Stand-in optimizers and scheduler; the real ones are switched in
tests/test_megatron_lm_moe_variants.py::fp16 against Megatron-LM's restart."""
from types import SimpleNamespace

import pytest
import torch

from dynatrain_megatron.transition.scalars import read_scalars, write_scalars
from dynatrain_megatron.transition.switch_types import Scalars


class _Scaler:
    """The state a megatron-core DynamicGradScaler saves and loads."""

    def __init__(self, scale, growth=0):
        self.state = {"scale": torch.tensor([float(scale)]), "growth_tracker": growth,
                      "hysteresis_tracker": 2}

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


class _Scheduler:
    def __init__(self):
        self.loaded = None

    def state_dict(self):
        return {"num_steps": 24}

    def load_state_dict(self, state):
        self.loaded = state


def _objs(*scalers):
    """A ChainedOptimizer of one optimizer per scaler (None: one without, as in bf16)."""
    opts = [SimpleNamespace(grad_scaler=s, optimizer=SimpleNamespace(param_groups=[],
                                                                     state={}))
            for s in scalers]
    return SimpleNamespace(optimizer=SimpleNamespace(chained_optimizers=opts),
                           scheduler=_Scheduler())


def _scale(scaler):
    return (float(scaler.state["scale"][0]), scaler.state["growth_tracker"])


def test_each_optimizers_scaler_goes_to_bs_optimizer_of_its_place():
    dense, expert = _Scaler(8192, 1), _Scaler(2048, 0)  # expert grads overflowed once more
    s = read_scalars(_objs(dense, expert), iteration=3, consumed_samples=24)
    assert [st["growth_tracker"] for st in s.grad_scalers] == [1, 0]
    dense.state["scale"].mul_(2)  # A's scaler changes after the read (it is released)
    b = _objs(_Scaler(4096), _Scaler(4096))
    write_scalars(b, s)
    got = [sc.grad_scaler for sc in b.optimizer.chained_optimizers]
    assert [_scale(g) for g in got] == [(8192.0, 1), (2048.0, 0)]
    assert got[0].state["scale"] is not s.grad_scalers[0]["scale"]  # B's own copy
    assert b.scheduler.loaded == {"num_steps": 24}


def test_a_rank_without_as_second_optimizer_gives_bs_the_first_scalers_state():
    """A stage that held no expert at A holds some at B: its expert optimizer takes the
    state of the scaler it had (every rank agrees on each, the overflow check being
    reduced over them); bf16 and fp32 optimizers have none to write."""
    s = read_scalars(_objs(_Scaler(1024, 1)), 3, 24)
    b = _objs(_Scaler(4096), _Scaler(4096), None)
    write_scalars(b, s)
    assert [_scale(o.grad_scaler) for o in b.optimizer.chained_optimizers[:2]] == [
        (1024.0, 1), (1024.0, 1)]
    none = read_scalars(_objs(None), 3, 24)
    assert none.grad_scalers == (None,)
    b = _objs(_Scaler(4096))
    write_scalars(b, none)  # nothing to carry: B's scaler stays as built
    assert _scale(b.optimizer.chained_optimizers[0].grad_scaler) == (4096.0, 0)


def test_scalars_take_a_tuple_of_scaler_states():
    with pytest.raises(TypeError, match="grad_scalers must be a tuple"):
        Scalars(3, 24, 3.0, {}, [{"scale": 1.0}])
    with pytest.raises(TypeError, match="grad_scalers must be a tuple"):
        Scalars(3, 24, 3.0, {}, ("scale",))
