"""Layout B's TransformerConfig inside a Megatron-LM job is the one Megatron-LM itself makes
when launched at B (`megatron_lm/transformer_config.py`): field for field, for a dense job
with sequence parallelism and activation recompute, for VPP on and off, and for MoE. So a
switch keeps recompute, fusions and sequence parallelism, and follows Megatron-LM's own
rules where they depend on the layout (SP only with TP, and always for MoE with TP; the
overlapped P2P exchange only for VPP). Megatron-LM's real argument parser and validation run
in a fresh interpreter with the snapshot on the path (`megatron_lm_config_probe.py`)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lm_runs import job_env
from megatron_lm_tree import require_snapshot

pytestmark = pytest.mark.every_release  # one interpreter, no ranks: cheap on every release

PROBE = Path(__file__).with_name("megatron_lm_config_probe.py")

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 "
        "--train-iters 10 --use-distributed-optimizer --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 1000 --transformer-impl local --bf16 --recompute-granularity full "
        "--recompute-method uniform --recompute-num-layers 1").split()
MOE = "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64".split()


def flags(tp, pp, *extra):
    return BASE + ["--tensor-model-parallel-size", str(tp),
                   "--pipeline-model-parallel-size", str(pp), *extra]


VPP = ("--num-layers-per-virtual-pipeline-stage", "1")
# DDP flags away from their defaults (what B must keep from the job)
DDP = ("--ddp-bucket-size", "4000", "--ddp-average-in-collective", "--check-for-large-grads",
       "--overlap-grad-reduce")
CASES = [  # (flags at A, flags Megatron-LM would be launched with at B, B)
    (flags(2, 2, "--sequence-parallel", *DDP), flags(1, 2, "--sequence-parallel", *DDP),
     "tp1pp2dp2"),
    (flags(2, 2, "--sequence-parallel"), flags(4, 1, "--sequence-parallel"), "tp4pp1dp1"),
    (flags(2, 2), flags(4, 1), "tp4pp1dp1"),  # no SP asked: none at B
    (flags(1, 4), flags(1, 2, *VPP), "tp1pp2vpp2dp2"),
    (flags(1, 2, *VPP), flags(2, 2), "tp2pp2dp1"),
    (flags(1, 2, "--expert-model-parallel-size", "2", *MOE),
     flags(2, 1, "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
           "--sequence-parallel", *MOE), "tp2pp1ep2etp1dp2"),
]


@pytest.fixture(scope="module")
def probe():
    snapshot = require_snapshot()
    env = job_env(snapshot)
    proc = subprocess.run([sys.executable, str(PROBE), json.dumps(CASES)], env=env,
                          capture_output=True, text=True, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    sampler = [ln for ln in proc.stdout.splitlines() if ln.startswith("SAMPLER ")]
    return dict(configs=json.loads(line[-1][len("RESULT "):]),
                sampler=json.loads(sampler[-1][len("SAMPLER "):]))


@pytest.fixture(scope="module")
def results(probe):
    return probe["configs"]


def test_b_config_is_megatron_lm_own_at_b(results):
    assert len(results) == len(CASES)
    for r in results:
        assert r["diff"] == [], r


def test_b_ddp_and_optimizer_configs_are_megatron_lm_own_at_b(results):
    """Issue 27, 9: B's DDP and optimizer configs, made by Megatron-LM's own functions from
    the args our builder gives B (on NCCL: gloo twins off), equal those Megatron-LM makes
    when launched at B, field for field: the job's gradient reduction dtype (bf16 here, not
    fp32) and NaN check (on), and in the first case its bucket size, averaging in the
    collective, large-gradient check and overlapped reduction, so a reset would show.
    core_v0.16.1 makes its DDP config inside get_model: there only the optimizer's."""
    from megatron_lm_tree import release_name

    for r in results:
        assert r["optimizer_diff"] == [], r
        if r["ddp_diff"] is None:
            assert release_name() == "core_v0.16.1", r
        else:
            assert r["ddp_diff"] == [], r


def test_iterators_built_ahead_advance_as_megatron_lm_samples(probe):
    """B's data iterators of a requested switch are built at the count when the build
    starts and advanced at the switch (megatron_lm/data_ahead.py): with Megatron-LM's own
    sequential sampler, its DataLoader and the replay wrapper, that gives every
    data-parallel rank the micro-batches a loader started at the switch's count gives."""
    assert probe["sampler"] == []


def test_layout_dependent_settings_follow_megatron_lm_rules(results):
    sp = [r["sequence_parallel"] for r in results]
    assert sp == [False, True, False, False, False, True]
    assert [r["overlap_p2p_comm"] for r in results] == [False, False, False, True, False, False]
    # kept from the job (our own builder has no recompute); B's weights are not drawn
    assert all(r["recompute"] == "full" and not r["perform_initialization"] for r in results)
