"""Scale-in and scale-out inside real Megatron-LM's own train() (the snapshot, patched): one
torchrun job on 4 gloo ranks, tp2pp2, asked through its signal file for tp1pp2dp1 on 2 ranks
(ranks 2 and 3 wait on standby inside `dynatrain_step`) and then for tp2pp2 on all 4 again.

With `--log-interval 1`, the layout's ranks run Megatron-LM's world collectives between steps
(its timers' barrier and all-gather, the rerun state machine's all-reduce, the data rebuild)
at every step while two ranks are on standby: if any still used the world, the job would
hang. Megatron-LM prints its iteration line on the world's last rank, rank 3: the lines after
the scale-out come from a rank that was on standby, so their learning rate and consumed
samples (its scheduler and data position, restored by the switch) must be those of a job
that never stopped. The final `--save` runs at the full world again.
"""
import math
import re

import pytest

from megatron_lm_runs import CPU_FLAGS, TINY_GPT, checkpoint_tensors, layout_flags, run_operated
from megatron_lm_tree import copy_tree, require_snapshot

pytestmark = pytest.mark.multirank

N = 10
LINE = re.compile(r"\] iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|.*?"
                  r"learning rate: ([0-9.E+-]+) \|.*?lm loss: ([0-9.E+-]+)")


def cosine_lr(iteration: int, *, lr=1e-3, min_lr=1e-4, warmup=1, decay=N) -> float:
    """Megatron-LM's cosine schedule with linear warm-up (TINY_GPT's settings)."""
    if iteration <= warmup:
        return lr * iteration / warmup
    ratio = (iteration - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1) * (lr - min_lr)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    require_snapshot()
    w = tmp_path_factory.mktemp("megatron-lm-elastic")
    w.chmod(0o700)
    tree = copy_tree(w / "patched", patched=True)
    signal = w / "switch.json"
    text = run_operated(
        tree, 4, CPU_FLAGS + TINY_GPT + layout_flags(2, 2) + [
            "--train-iters", str(N), "--save", str(w / "ckpt"), "--save-interval", "1000",
            "--dynatrain", "--dynatrain-signal-file", str(signal)],
        w / "job.log", signal, {2: ("tp1pp2dp1", 2), 5: ("tp2pp2dp1", 4)})
    return dict(w=w, text=text)


def test_scale_in_and_out_inside_megatron_lm(run):
    text = run["text"]
    # the rows of every rank's switch summary (rank 0, never on standby, has both)
    summary = re.findall(r"^\s+(\d+)\s+(tp\S+)\s+(tp\S+)\s+[0-9.]+\s", text, re.M)
    assert ("tp2pp2dp1", "tp1pp2dp1") in {(a, b) for _, a, b in summary}
    assert ("tp1pp2dp1", "tp2pp2dp1") in {(a, b) for _, a, b in summary}
    inn = min(int(i) for i, a, b in summary if (a, b) == ("tp2pp2dp1", "tp1pp2dp1"))
    out = min(int(i) for i, a, b in summary if (a, b) == ("tp1pp2dp1", "tp2pp2dp1"))
    assert 2 <= inn < out < N
    # two ranks left and came back at the scale-out's iteration, in the loop's own count
    assert text.count("this rank is not in the new layout; on standby") == 2
    assert re.findall(r"back from standby at iteration (\d+)", text) == [str(out)] * 2
    # rank 0 reports the steps taken without Megatron-LM's printing rank
    assert {int(i) for i in re.findall(r"dynatrain: iteration (\d+) done at tp1pp2dp1 on 2 "
                                       r"of 4 ranks", text)} == set(range(inn, out))


def test_returned_rank_continues_schedule_and_data(run):
    lines = {int(i): (int(c), lr) for i, c, lr, _ in LINE.findall(run["text"])}
    out = max(int(i) for i in re.findall(r"back from standby at iteration (\d+)", run["text"]))
    after = [i for i in lines if i > out]
    assert after and max(after) == N
    for i, (consumed, lr) in lines.items():  # before the scale-in and after the scale-out
        assert consumed == 8 * i, (i, consumed)
        assert lr == f"{cosine_lr(i):.6E}", (i, lr)


def test_final_save_at_the_full_world(run):
    state = checkpoint_tensors(run["w"] / "ckpt", N)
    emb = [v for k, v in state.items() if k.endswith("embedding.word_embeddings.weight")
           and not k.startswith("optimizer")]
    assert emb and tuple(emb[0].shape) == (1024, 64)  # whole (padded vocab), at any layout
