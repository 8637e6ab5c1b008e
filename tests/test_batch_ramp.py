"""A batch-size ramp (`--rampup-batch-size`) across a switch: B's micro-batch calculator is
megatron-core's own, made at B's DP and at the ramp's position for the samples consumed,
which is what Megatron-LM's restart at B makes (its calculator at B's DP, updated to the
checkpoint's consumed samples); B's layout must split every batch of the ramp over DP.
With `--decrease-batch-size-if-needed` B's calculator rounds the batch down at B's DP, as
the restart's does, and a layout is refused only where that leaves no micro-batch."""
import pytest
import torch.distributed as dist

from dynatrain_megatron.mcore.train_config import TrainConfig
from dynatrain_megatron.mcore.training import num_micro_batches, set_num_microbatches_calculator
from dynatrain_megatron.vps.layout import Layout
from dynatrain_megatron.vps.model_spec import ModelSpec
from dynatrain_megatron.vps.validate import layout_errors

RAMP = TrainConfig(micro_batch_size=2, global_batch_size=16, rampup_batch_size=(4, 4, 48))


@pytest.fixture()
def calculator(tmp_path):
    from megatron.core import num_microbatches_calculator as nmc

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield nmc
    nmc.unset_num_microbatches_calculator()
    dist.destroy_process_group()


def test_the_ramp_lists_its_batch_sizes_and_is_checked_when_made():
    assert RAMP.batch_sizes() == (4, 8, 12, 16)
    assert TrainConfig(global_batch_size=16).batch_sizes() == (16,)
    with pytest.raises(ValueError, match="step from start to the global batch 16"):
        TrainConfig(micro_batch_size=2, global_batch_size=16, rampup_batch_size=(4, 5, 48))


@pytest.mark.parametrize("consumed", [0, 11, 12, 24, 36, 48, 49, 100])
def test_b_continues_the_ramp_as_a_restart_at_b(calculator, consumed):
    nmc = calculator
    set_num_microbatches_calculator(RAMP, 2, 0)  # A: dp2 at the start of the job
    nmc.update_num_microbatches(consumed, consistency_check=True)
    a_batch = nmc.get_current_global_batch_size()
    set_num_microbatches_calculator(RAMP, 1, consumed)  # the switch to dp1
    ours = (nmc.get_current_global_batch_size(), nmc.get_num_microbatches())
    # the restart at dp1: a calculator made there, updated to the consumed samples
    nmc.unset_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(0, [4, 4, 48], 16, 2, 1)
    nmc.update_num_microbatches(consumed, consistency_check=True)
    restart = (nmc.get_current_global_batch_size(), nmc.get_num_microbatches())
    assert ours == restart and ours[0] == a_batch  # the same batch, more micro-batches
    assert ours[1] == ours[0] // 2


def test_a_layout_that_cannot_split_a_ramp_batch_is_refused():
    spec = ModelSpec(name="t", num_layers=2, hidden_size=64, num_attention_heads=4,
                     ffn_hidden_size=128, vocab_size=1000, seq_length=32)
    ok = layout_errors(spec, Layout.parse("tp1pp1dp2", 2), global_batch_size=16,
                       micro_batch_size=2, ramp_batch_sizes=RAMP.batch_sizes()[:-1])
    assert ok == []
    errs = layout_errors(spec, Layout.parse("tp1pp1dp4", 4), global_batch_size=16,
                         micro_batch_size=2, ramp_batch_sizes=RAMP.batch_sizes()[:-1])
    assert errs == ["the batch-size ramp's global batch 4 is not divisible by micro batch 2 "
                    "* dp 4", "the batch-size ramp's global batch 12 is not divisible by "
                    "micro batch 2 * dp 4"]


DECREASE = TrainConfig(micro_batch_size=2, global_batch_size=12,
                       decrease_batch_size_if_needed=True)


def test_b_rounds_the_batch_down_at_its_dp_as_a_restart_at_b(calculator):
    nmc = calculator
    set_num_microbatches_calculator(DECREASE, 1)  # A: dp1, 6 micro-batches of 2
    assert (nmc.get_current_running_global_batch_size(), nmc.get_num_microbatches()) == (12, 6)
    set_num_microbatches_calculator(DECREASE, 4)  # the switch to dp4
    ours = (nmc.get_current_global_batch_size(), nmc.get_current_running_global_batch_size(),
            nmc.get_num_microbatches())
    nmc.unset_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(0, None, 12, 2, 4, True)  # the restart at dp4
    restart = (nmc.get_current_global_batch_size(),
               nmc.get_current_running_global_batch_size(), nmc.get_num_microbatches())
    assert ours == restart == (12, 8, 1)
    assert [num_micro_batches(DECREASE, dp) for dp in (1, 2, 4)] == [6, 3, 1]
    assert DECREASE.running_batch_size(12, 4) == 8
    with pytest.raises(ValueError, match="not divisible by micro_batch_size"):
        num_micro_batches(DECREASE, 8)  # rounds down to nothing


def test_a_decreased_batch_is_refused_only_where_it_leaves_no_micro_batch():
    spec = ModelSpec(name="t", num_layers=2, hidden_size=64, num_attention_heads=4,
                     ffn_hidden_size=128, vocab_size=1000, seq_length=32)
    kw = dict(global_batch_size=12, micro_batch_size=2)
    dp4, dp8 = Layout.parse("tp1pp1dp4", 4), Layout.parse("tp1pp1dp8", 8)
    assert layout_errors(spec, dp4, **kw) == [
        "global batch 12 is not divisible by micro batch 2 * dp 4"]
    assert layout_errors(spec, dp4, **kw, decrease_batch_size_if_needed=True) == []
    assert layout_errors(spec, dp8, **kw, decrease_batch_size_if_needed=True) == [
        "global batch 12 rounds down to no micro batch 2 * dp 8 "
        "(--decrease-batch-size-if-needed)"]
    # a ramp's batch that rounds down to none at B's DP
    assert layout_errors(spec, dp4, **kw, ramp_batch_sizes=(4, 8),
                         decrease_batch_size_if_needed=True) == [
        "the batch-size ramp's global batch 4 is not divisible by micro batch 2 * dp 4 "
        "(it rounds down to none)"]
