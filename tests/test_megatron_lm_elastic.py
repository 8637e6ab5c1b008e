"""Scale-in and scale-out inside real Megatron-LM's own train() (the snapshot, patched), and
a job that ends while ranks are on standby: one job on 4 gloo ranks, tp2pp2, asked
through its signal file for tp1pp2dp1 on 2 ranks (ranks 2 and 3 wait on standby inside
`dynatrain_step`), then for tp3pp1dp1 (refused: 4 heads), then for tp2pp2dp1 on all 4
again, then for tp1pp2dp1 on 2 ranks once more; it ends on those 2 ranks at iteration N.

While ranks are on standby, Megatron-LM's code on the layout's ranks has the layout as its
world (`compat/stand_in_world.py`): with `--log-interval 1`, `--eval-interval 5` and
`--save-interval 5` its timers, rerun state machine, data rebuild, evaluation and
`dist_checkpointing` saves run there at every step; had any of them used the real world, the
job would hang. Megatron-LM prints its lines on its world's last rank, so every iteration
line comes from a rank of the layout: learning rate and consumed samples must be those of a
job that never switched, including after the refused request and on the ranks back from
standby.

At the end the standby ranks leave `pretrain()` and the 2 layout ranks run the final
`--save`, validation and test. What is checked of that checkpoint, and why it is strong:
it is whole (every logical tensor with the shape and dtype of the checkpoint the full
world saved at iteration 10, whatever layout that was), consistent (each model weight
equals the optimizer's fp32 copy bit for bit, assembled from other shards), and it is the
state the layout's ranks held: Megatron-LM's own `--load` of it at tp2pp2 on 4 ranks (a
plain restart, one more job) saves it again bit-identical. Its validation and test
losses are not compared with the 2 ranks' own: computed at another TP size, they sum in
another order, and their last digits depend on the machine, not on the state. The
refused request has no reference run here: what is checked is the refusal (logged, filed
with its reason, in the summary), that the layout went on (the next switch starts from
tp1pp2dp1) and that data position and schedule went on as if it had not been asked.
"""
import json
import math
import re

import pytest
import torch

from megatron_lm_runs import (CPU_FLAGS, TINY_GPT, checkpoint_tensors, differences, layout_flags,
                              load_common, run_megatron_lm, run_operated)
from megatron_lm_tree import copy_tree, require_snapshot

# also on every other release (make test): scale-in with standby and scale-out
pytestmark = [pytest.mark.multirank, pytest.mark.every_release]

N = 16
IN, OUT = ("tp2pp2dp1", "tp1pp2dp1"), ("tp1pp2dp1", "tp2pp2dp1")
# after which iteration the operator writes each request (each once the previous is taken)
REQUESTS = {2: ("tp1pp2dp1", 2), 3: ("tp3pp1dp1", 3), 5: ("tp2pp2dp1", 4), 8: ("tp1pp2dp1", 2)}
LINE = re.compile(r"\] iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|.*?"
                  r"learning rate: ([0-9.E+-]+) \|.*?lm loss: ([0-9.E+-]+)")
EVAL = re.compile(r"validation loss at iteration (\d+)( on \w+ set)? \| lm loss value: "
                  r"([0-9.E+-]+)")
FLAGS = CPU_FLAGS + TINY_GPT + layout_flags(2, 2) + [
    "--train-iters", str(N), "--save-interval", "5", "--eval-interval", "5"]
# Megatron-LM's iteration line: when it was printed, and the elapsed time it reports
TIMED = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration\s+(\d+)/\s*\d+ \|.*?"
                   r"elapsed time per iteration \(ms\): ([0-9.]+)")


def per_rank(key) -> bool:
    """A checkpoint entry saved once per saving rank (keyed by that rank): its RNG states and,
    in core_v0.19.0 (not in core_v0.16.1, which saves it only while a step is to be rerun),
    its rerun state machine's; their number is the saving world's."""
    return str(key).startswith(("rng_state/", "rerun_state_machine_state/"))


def cosine_lr(iteration: int, *, lr=1e-3, min_lr=1e-4, batch=8, warmup=1, decay=N) -> float:
    """Megatron-LM's cosine schedule with linear warm-up (TINY_GPT's settings), in samples
    as its scheduler counts."""
    step, warmup, decay = batch * iteration, batch * warmup, batch * decay
    if step <= warmup:
        return lr * float(step) / float(warmup)
    coeff = 0.5 * (math.cos(math.pi * (float(step - warmup) / float(decay - warmup))) + 1.0)
    return min_lr + coeff * (lr - min_lr)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    require_snapshot()
    w = tmp_path_factory.mktemp("megatron-lm-elastic")
    w.chmod(0o700)
    tree = copy_tree(w / "patched", patched=True)
    signal = w / "switch.json"
    text = run_operated(
        tree, 4, FLAGS + ["--save", str(w / "ckpt"), "--dynatrain",
                          "--dynatrain-signal-file", str(signal),
                          "--dynatrain-log-dir", str(w / "logs")],
        w / "job.log", signal, REQUESTS)
    summary = re.findall(r"^\s+(\d+)\s+(tp\S+)\s+(tp\S+)\s+[0-9.]+\s", text, re.M)
    switches = sorted({(int(i), a, b) for i, a, b in summary})  # rank 0's summary
    return dict(w=w, tree=tree, text=text, switches=switches)


@pytest.fixture(scope="module")
def reloaded(run):
    """Megatron-LM's own restart from the final checkpoint at tp2pp2 on 4 ranks (no
    dynatrain): it loads iteration N, trains no step, saves again, validates and tests."""
    w = run["w"]
    text = run_megatron_lm(run["tree"], 4, FLAGS + ["--load", str(w / "ckpt"),
                                                     "--save", str(w / "reloaded")],
                           w / "reload.log")
    return dict(text=text)


def test_switches_and_standby_inside_megatron_lm(run):
    text, switches = run["text"], run["switches"]
    assert [(a, b) for _, a, b in switches] == [IN, OUT, IN], switches
    (inn, _, _), (out, _, _), (inn2, _, _) = switches
    assert 2 <= inn < out < inn2 < N
    # one line per switch, from rank 0, with the stall of the slowest rank (the ranks that
    # stood by only say so); no prefix twice, no unknown iteration
    assert [ln[0] for ln in re.findall(r"iteration (\d+): switched (\S+) -> (\S+) .* stall "
                                       r"[0-9.]+ s \[", text)] == [str(inn), str(out), str(inn2)]
    assert text.count("this rank is not in the new layout; on standby") == 4
    assert "dynatrain: dynatrain:" not in text and "iteration None" not in text
    # requested switches: B's data iterators were built in the background at the count of
    # the build's start and advanced at the switch (on a rank back from standby, from its
    # last step before it), not built again inside the stall (megatron_lm/data_ahead.py),
    # unless an evaluation ran between the build and the switch (validation samples moved)
    prepared = re.findall(r"iteration \d+: switched .*B prepared in the background \((.*)\)",
                          text)
    assert len(prepared) == 3 and any("data_iterators" in p for p in prepared), prepared
    again = re.findall(r"built ahead are for (\d+)/(\d+) consumed samples, the switch is at "
                       r"(\d+)/(\d+)", text)
    assert any(v0 != v1 for _, v0, _, v1 in again) or not again, again
    # every rank of B, those back from standby too, is at the job's counts at the switch
    # (train and validation samples: the stages' loaders start at the same sample); the
    # train count names the switch, several switches may each build again
    at_switch: dict[str, set[str]] = {}
    for _, _, t1, v1 in again:
        at_switch.setdefault(t1, set()).add(v1)
    assert all(len(v) == 1 for v in at_switch.values()), again
    gbs = int(FLAGS[FLAGS.index("--global-batch-size") + 1])
    assert {int(t1) for t1 in at_switch} <= {i * gbs for i, _, _ in switches}, again
    assert bool(again) == (not all("data_iterators" in p for p in prepared)), (again, prepared)
    # built ahead at one count on every rank of B, those back from standby too (the
    # largest any rank noted): each skips as many micro-batches at the switch
    skipped: dict[str, set[tuple[str, str]]] = {}
    for start, k, target in re.findall(r"B's data iterators built ahead at (\d+) consumed "
                                       r"samples, advanced by (\d+) micro-batches to (\d+)",
                                       text):
        skipped.setdefault(target, set()).add((start, k))
    assert all(len(v) == 1 for v in skipped.values()), skipped
    # rank 0 also reports the steps taken while the others were on standby
    assert {int(i) for i in re.findall(r"dynatrain: iteration (\d+) done at tp1pp2dp1 on 2 "
                                       r"of 4 ranks", text)} == (set(range(inn, out))
                                                                 | set(range(inn2, N + 1)))


def test_refused_request_leaves_training_as_it_was(run):
    text, w = run["text"], run["w"]
    refusal = "layout tp3pp1dp1 cannot hold model 'megatron-lm': num_attention_heads 4 % tp 3"
    assert text.count(f"switch request rejected: {refusal}") == 1  # rank 0 decides
    assert text.count(f"  - {refusal}") == 1  # in rank 0's summary at the end
    # switches.jsonl: every request's outcome with its wall-clock time, the switches' stalls
    # (a switch is recorded once its stall is known, stamped with the time it started)
    rows = sorted((json.loads(x) for x in (w / "logs" / "switches.jsonl").read_text()
                   .splitlines()), key=lambda r: r["time"])
    assert [r["kind"] for r in rows] == ["switch", "rejected", "switch", "switch"], rows
    assert refusal in rows[1]["reason"] and rows[1]["iteration"] is not None
    refused = json.loads((w / f"switch.json.rejected.{rows[1]['request']}").read_text())
    assert json.loads(refused["request"])["layout"] == "tp3pp1dp1"
    assert all(r["request"] and (w / f"switch.json.{'applied' if r['kind'] == 'switch' else 'rejected'}"
                                 f".{r['request']}").is_file() for r in rows)
    assert all(r["time_utc"].endswith("+00:00") for r in rows)
    filed = [json.loads(p.read_text()) for p in w.glob("switch.json.rejected.*")]
    assert len(filed) == 1 and filed[0]["outcome"] == "rejected"
    assert refusal in filed[0]["reason"] and "tp3pp1dp1" in filed[0]["request"]
    assert len(list(w.glob("switch.json.applied.*"))) == 3
    # the layout went on: the next switch left tp1pp2dp1 (IN, OUT, IN and nothing else)
    assert [a for _, a, _ in run["switches"]] == ["tp2pp2dp1", "tp1pp2dp1", "tp2pp2dp1"]


def test_every_iteration_continues_schedule_and_data(run):
    """Every iteration's line, printed by the layout's last rank (on 2 ranks: rank 1; after
    the scale-out: rank 3, back from standby), once, with the learning rate and consumed
    samples of a job that never switched, was never refused and never had ranks out."""
    found = LINE.findall(run["text"])
    assert [int(i) for i, *_ in found] == list(range(1, N + 1))
    for i, consumed, lr, loss in found:
        assert int(consumed) == 8 * int(i), (i, consumed)
        # the logged learning rate went through float32 (the last digit shows it)
        assert lr == f"{torch.tensor(cosine_lr(int(i)), dtype=torch.float32).item():.6E}", (i, lr)
        assert math.isfinite(float(loss))


def test_evaluation_and_saves_run_on_the_layout_ranks(run):
    text = run["text"]
    evals = [(int(i), where.strip()) for i, where, _ in EVAL.findall(text)]
    # in the loop every 5 iterations, then pretrain()'s own validation and test at the end
    assert evals == [(5, ""), (10, ""), (15, ""), (N, "on validation set"), (N, "on test set")]
    # Megatron-LM 0.19 also names the GTP weight-remat rank (`gtp_remat 1/1, `)
    saved = re.findall(r"successfully saved checkpoint from iteration\s+(\d+) .*?\[ t (\d)/(\d), "
                       r"(?:gtp_remat \d/\d, )?p (\d)/(\d) \]", text)
    assert [int(i) for i, *_ in saved] == [5, 10, 15, N]
    assert saved[-1][1:] == ("1", "1", "1", "2")  # the final one by tp1pp2dp1's ranks
    # the standby ranks were told at the last step and left; the layout's ranks said so
    assert text.count("the job ended while this rank was on standby") == 2
    assert text.count("the job ends at tp1pp2dp1 on ranks 0..1; the other 2 are on standby") == 2
    assert "Traceback" not in text


def test_final_checkpoint_is_whole_at_the_layout_that_saved_it(run):
    ckpt = run["w"] / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(N)
    common = load_common(ckpt / f"iter_{N:07d}")
    args = common["args"]
    assert common["iteration"] == N and args.consumed_train_samples == 8 * N
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 2)
    final, full = checkpoint_tensors(ckpt, N), checkpoint_tensors(ckpt, 10)
    assert {k for k in final if not per_rank(k)} == {k for k in full if not per_rank(k)}
    for k, v in final.items():
        if torch.is_tensor(v):
            assert (v.shape, v.dtype) == (full[k].shape, full[k].dtype), k
            assert torch.isfinite(v).all(), k
    assert tuple(final["embedding.word_embeddings.weight"].shape) == (1024, 64)  # padded vocab
    weights = [k for k in final if k.startswith("optimizer.state.param.")]
    assert len(weights) == 16
    for k in weights:  # the model's weights and the optimizer's fp32 copy: bit for bit
        assert differences({0: final[k[len("optimizer.state.param."):]]}, {0: final[k]}) == [], k


def test_final_checkpoint_loads_at_another_layout_as_it_was(run, reloaded):
    w = run["w"]
    assert "successfully loaded checkpoint" in reloaded["text"]
    ours, again = checkpoint_tensors(w / "ckpt", N), checkpoint_tensors(w / "reloaded", N)
    assert differences(ours, again, skip=per_rank) == []
    # core_v0.19.0 saves its rerun state machine's state once per saving rank (2 entries
    # here, 4 in the restart's; core_v0.16.1 none): the idle machine's, the same on each
    rerun = [v for ckpt in (ours, again) for k, v in ckpt.items()
             if k.startswith("rerun_state_machine_state/")]
    assert all(differences({0: rerun[0]}, {0: v}) == [] for v in rerun)
    # the restart evaluated and tested that state too; its losses, computed at tp2 where the
    # 2 ranks computed theirs at tp1, are not compared (module doc)
    final = [(i, where) for i, where, _ in EVAL.findall(reloaded["text"])]
    assert final == [(str(N), " on validation set"), (str(N), " on test set")]


def test_iteration_times_after_switches_and_standby(run):
    """Megatron-LM's own iteration time stays right: each line's elapsed time is at most the
    time since the previous line (plus print jitter), also for the first iteration after the
    scale-out, printed by rank 3, which stood by since the scale-in (its timer restarts when
    the switch that brings it back starts, not when it left); and the switching iterations
    count the stall the switch records say they had."""
    import datetime as dt

    lines = {int(i): (dt.datetime.strptime(ts, "%Y-%m-%d %H:%M:%S.%f").timestamp(),
                      float(ms) / 1000) for ts, i, ms in TIMED.findall(run["text"])}
    assert sorted(lines) == list(range(1, N + 1))
    _, out, _ = (i for i, _, _ in run["switches"])
    # Megatron-LM reads its timer, then stamps and prints the line: on 2 loaded cores a rank
    # can be descheduled between the two, so a line's stamp may lag its timer by a few tenths
    # of a second; the error this guards against (a standby rank's timer counting the whole
    # time it stood by) is several iterations and two switches long
    for i in range(2, N + 1):
        gap = lines[i][0] - lines[i - 1][0]
        assert lines[i][1] <= gap + 0.75, (i, lines[i][1], gap)
    rows = [json.loads(x) for x in (run["w"] / "logs" / "switches.jsonl").read_text().splitlines()]
    for r in (r for r in rows if r["kind"] == "switch"):
        # the stall and its parts, for every rank of B: they add up (a few percent of the
        # window is the timers, logging and records between them; on 2 loaded cores up to
        # ~8% on a rank that writes the records or comes back from standby)
        for rank in r["stall"]["ranks"]:
            assert abs(rank["unaccounted_s"]) <= 0.08 * rank["stall_s"] + 0.05, rank
            assert rank["transfer_s"] > 0 and rank["parts"]["transfer"] == rank["transfer_s"]
        assert r["stall"]["slowest"]["stall_s"] == max(x["stall_s"] for x in r["stall"]["ranks"])
        # the switching iteration's line holds the stall of the slowest rank
        it = r["iteration"] + 1
        assert lines[it][1] >= 0.9 * r["stall"]["slowest"]["window_s"] - 0.05, (it, lines[it], r)
    assert out + 1 in lines
