"""A released layout's memory is freed in place, whoever still holds its objects
(mcore/held_memory.py); the model config's callbacks into it are cut."""
import functools

import pytest
import torch

from dynatrain_megatron.mcore.held_memory import (Freed, cut_callbacks, layout_tensors,
                                                  release_storages)
from rank_checks import storage_bytes


class _Buffer:
    """megatron-core's _ParamAndGradBuffer, as far as the release sees it."""

    def __init__(self, n: int) -> None:
        self.param_data = torch.randn(n)
        self.grad_data = torch.zeros(n)


class _Chunk(torch.nn.Module):
    """A DDP-wrapped chunk: parameters are views of one flat buffer, each has a
    `main_grad` view of the gradient buffer, and DDP's `buffers` attribute (a list)
    shadows Module.buffers()."""

    def __init__(self) -> None:
        super().__init__()
        flat = _Buffer(12)
        self.w = torch.nn.Parameter(flat.param_data[:8].view(2, 4))
        self.b = torch.nn.Parameter(flat.param_data[8:])
        self.w.main_grad = flat.grad_data[:8].view(2, 4)
        self.b.main_grad = flat.grad_data[8:]
        self.register_buffer("scale", torch.ones(3))
        self.buffers = [flat]
        self.expert_parallel_buffers = [_Buffer(5)]


def _adam_after_a_step(params):
    opt = torch.optim.Adam(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


class _Chained:
    """megatron-core's ChainedOptimizer over DistributedOptimizers (their `optimizer` is
    the torch optimizer holding the fp32 shards and the Adam state)."""

    def __init__(self, *inner) -> None:
        self.chained_optimizers = [type("Dist", (), {"optimizer": o})() for o in inner]


def test_every_storage_of_the_layout_is_freed_though_its_objects_are_still_held():
    chunk = _Chunk()
    shards = [torch.randn(6, requires_grad=True)]  # an fp32 shard, Adam state after a step
    opt = _Chained(_adam_after_a_step(shards))
    held = ([chunk], opt)  # as Megatron-LM's pretrain() holds the first layout's objects
    tensors = list(layout_tensors([chunk], opt))
    # flat param/grad buffers, the registered buffer, the expert buffers, the shard, its
    # grad and its two Adam moments (the step count is a tensor too)
    expected = storage_bytes(tensors)
    assert expected == 4 * (12 + 12 + 3 + 5 + 5 + 6 + 6 + 6 + 6) + storage_bytes(
        [opt.chained_optimizers[0].optimizer.state[shards[0]]["step"]])
    storages = len({t.untyped_storage()._cdata for t in tensors})
    freed = release_storages([chunk], opt)
    assert freed == Freed(expected, storages, 0)
    assert storage_bytes(tensors) == 0
    # empty shells: code still holding a tensor sees zero elements, never freed memory
    assert chunk.w.numel() == chunk.buffers[0].param_data.numel() == 0
    assert chunk.w.main_grad.numel() == 0 and chunk.w.requires_grad
    assert all(t.numel() == 0 for t in layout_tensors(*held))


def test_storages_the_next_layout_shares_are_kept_bit_for_bit():
    chunk = _Chunk()
    opt = _Chained(_adam_after_a_step([chunk.b]))
    shared = chunk.buffers[0].param_data  # B's tensor on A's storage
    before = shared.clone()
    everything = storage_bytes(layout_tensors([chunk], opt))
    freed = release_storages([chunk], opt, keep=[shared[:4]])
    assert torch.equal(shared, before)
    assert chunk.buffers[0].grad_data.untyped_storage().nbytes() == 0
    assert freed.bytes == everything - shared.untyped_storage().nbytes()
    assert storage_bytes(layout_tensors([chunk], opt)) == shared.untyped_storage().nbytes()
    # the second release finds nothing left to free
    assert release_storages([chunk], opt, keep=[shared]) == Freed(0, 0, 0)


def test_meta_tensors_are_left_alone():
    m = torch.nn.Linear(4, 4, device="meta")
    assert release_storages([m], None) == Freed(0, 0, 0)


def test_freed_counts_must_be_non_negative():
    with pytest.raises(ValueError, match="non-negative"):
        Freed(-1, 0, 0)


class _Optimizer:
    def scale_loss(self, loss):
        return loss

    @classmethod
    def make(cls):
        return cls()


def _plain_init(t):
    return t


def test_callbacks_into_live_objects_are_cut_and_plain_functions_kept():
    opt, ddp = _Optimizer(), torch.nn.Linear(2, 2)
    cfg = type("Config", (), {})()
    cfg.grad_scale_func = opt.scale_loss              # megatron-LM's train() sets it
    cfg.no_sync_func = [ddp.forward, ddp.forward]     # one per model chunk
    cfg.param_sync_func = functools.partial(ddp.zero_grad, set_to_none=True)
    cfg.finalize_model_grads_func = _plain_init       # a named callback: cut even if plain
    cfg.init_method = functools.partial(_plain_init)  # the job's own: kept
    cfg.factory = _Optimizer.make                     # bound to a class: kept
    cfg.hidden_size = 8
    assert sorted(cut_callbacks(cfg)) == ["finalize_model_grads_func", "grad_scale_func",
                                          "no_sync_func", "param_sync_func"]
    assert cfg.grad_scale_func is None and cfg.no_sync_func is None
    assert cfg.init_method.func is _plain_init and cfg.factory is not None
    assert cfg.hidden_size == 8
