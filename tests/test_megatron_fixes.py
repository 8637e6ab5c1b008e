"""megatron-core 0.16.1 fixes (compat.megatron_fixes) seen through their effect: a
dist_checkpointing save and load at one layout restores every bit of the training state."""
import pytest

from dynatrain_megatron.testing.multiproc import run_on_ranks
from rank_cases import checkpoint_path_case

pytestmark = pytest.mark.multirank


def test_fully_reshardable_checkpoint_after_a_padded_bucket(tmp_path):
    # tied embeddings with PP > 1: the first stage's word embedding gets a bucket of its own
    # (megatron's `shared_embedding`); with LayerNorm, biases and one layer on the first
    # stage of TP 2, the bucket before it ends 64 elements short of its padded size
    # (vps.analytic shows 19008 of 19072), so its optimizer state lies after bucket padding
    layout = "tp2pp2ppf1ppl3dp1"
    rec = run_on_ranks(checkpoint_path_case, 4, "tiny-gpt+tied+ln", layout, layout,
                       str(tmp_path / "ck"), 2, 1)[0]
    assert rec["state_diff"] == [], rec["state_diff"]
