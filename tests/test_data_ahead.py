"""B's data iterators built ahead of a scheduled switch (megatron_lm/data_ahead.py): the
consumed-sample count they start at, who builds them, and when the switch takes them.
One process, a 1-rank gloo group; Megatron-LM's own build is stood in for (the real one
runs in tests/test_megatron_lm_train.py, whose losses after the switch equal a restart's
and whose switch line says the iterators were prepared in the background)."""
import argparse
import threading
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from dynatrain_megatron.megatron_lm.data_ahead import DataAhead, StepNote
from dynatrain_megatron.vps.layout import Layout


@pytest.fixture()
def world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    group = dist.new_group([0])
    yield SimpleNamespace(layout_group=group, layout_group_cpu=group, background=group,
                          transfer=dist.new_group([0]))
    dist.destroy_process_group()


def _ahead(decision, built, train="train", **args):
    args = argparse.Namespace(**{**dict(consumed_train_samples=24, consumed_valid_samples=8,
                                        global_batch_size=8, do_train=0, micro_batch_size=2),
                                 **args})
    ahead = DataAhead(args, spec=None, sequence_parallel=False, decision=lambda: decision,
                      rebuild=None)

    def fake_build(layout, groups, num_chunks, consumed, note):
        built.append(consumed)
        return (train(consumed) if callable(train) else train, "valid", "test"), {"do_train": 1}

    ahead._build = fake_build
    return ahead


def _take(ahead, groups, consumed_train, consumed_valid):
    """`DataAhead.take`'s iterators (the counters it agrees are checked: one rank agrees
    with itself)."""
    counters = {"consumed_valid_samples": consumed_valid, "skipped_train_samples": 5}
    iterators, agreed = ahead.take(groups, consumed_train, counters)
    assert agreed == counters
    return iterators


def _in_thread(fn, *a):
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*a)))
    t.start()
    t.join()
    return out[0] if out else None


def test_built_ahead_at_the_scheduled_switch_count_and_taken_only_when_it_fits(world):
    lay = Layout.parse("tp1pp1dp1", 1)
    built = []
    ahead = _ahead(SimpleNamespace(at=7), built)
    ahead.note_step(3)  # 24 samples after iteration 3: 4 more steps of 8 until the switch
    _in_thread(ahead.build, lay, world, 1)
    assert built == [24 + 4 * 8]
    assert _take(ahead, world, 56, 8) == ("train", "valid", "test")
    assert ahead.args.do_train == 1  # what Megatron-LM's build set reaches the live args
    assert _take(ahead, world, 56, 8) is None  # taken once
    # an evaluation ran in between (validation samples moved): built again at the switch
    _in_thread(ahead.build, lay, world, 1)
    assert _take(ahead, world, 56, 16) is None
    # for other groups (a recovery re-formed the world): not taken (counters still agreed)
    _in_thread(ahead.build, lay, world, 1)
    assert _take(ahead, SimpleNamespace(background=None), 56, 8) is None
    # --decrease-batch-size-if-needed: A trains 12 rounded down to 8 at its DP of 4
    built.clear()
    ahead = _ahead(SimpleNamespace(at=7), built, global_batch_size=12, data_parallel_size=4,
                   decrease_batch_size_if_needed=True)
    ahead.note_step(3)
    _in_thread(ahead.build, lay, world, 1)
    assert built == [24 + 4 * 8]


def test_a_requested_switch_builds_at_the_count_now_and_advances_to_where_it_lands(world):
    """The landing iteration of a requested switch is not known when B is built: its
    iterators start at the count noted then and are advanced at the switch, one micro-batch
    of every data-parallel rank (micro-batch size x B's dp samples) at a time."""
    lay = Layout.parse("tp1pp1dp1", 1)
    built = []

    def train(consumed):  # one per virtual stage; a stage that reads no data has None
        return [iter(range(consumed // 2, 1000)), None]

    ahead = _ahead(SimpleNamespace(at=None), built, train=train)
    ahead.note_step(3)
    assert _in_thread(ahead.target, lay, world) == (24, "")
    _in_thread(ahead.build, lay, world, 1)
    assert built == [24]
    it = _take(ahead, world, 40, 8)[0]  # two steps of 8 samples later: 8 micro-batches of 2
    assert next(it[0]) == 40 // 2 and it[1] is None
    for consumed in (41, 20):  # not a whole micro-batch ahead; behind: built again
        _in_thread(ahead.build, lay, world, 1)
        assert _take(ahead, world, consumed, 8) is None
    # a shuffled sampler cannot be advanced: built at the switch
    cyclic = _ahead(SimpleNamespace(at=None), built, dataloader_type="cyclic")
    cyclic.note_step(3)
    assert "--dataloader-type cyclic cannot be advanced" in _in_thread(
        cyclic.target, lay, world)[1]


def test_not_built_ahead_in_the_pause_or_behind_the_loop(world):
    lay = Layout.parse("tp1pp1dp1", 1)
    built = []
    request = _ahead(SimpleNamespace(at=None), built, dataloader_type="cyclic")
    request.note_step(3)
    assert _in_thread(request.target, lay, world)[1].startswith("a requested switch")
    _in_thread(request.build, lay, world, 1)
    late = _ahead(SimpleNamespace(at=2), built)
    late.note_step(3)
    assert "behind the loop" in _in_thread(late.target, lay, world)[1]
    sched = _ahead(SimpleNamespace(at=5), built)
    sched.note_step(3)
    assert sched.target(lay, world) == (-1, "B is built in the pause")  # the main thread
    sched.build(lay, world, 1)
    assert built == [] and _take(request, world, 24, 8) is None


def test_every_switch_kind_needs_a_rank_of_b_and_a_stand_in_world(world):
    """A requested switch goes through the same checks as a scheduled one: not on a rank
    outside B, not where B's ranks are not the job's first ones (the build's collectives
    would run on the real world), not with --phase-transition-iterations; nothing is built
    and nothing is voted on for them."""
    built = []
    for at in (None, 7):
        ahead = _ahead(SimpleNamespace(at=at), built)
        ahead.note_step(3)
        # B of 2 ranks whose preparation group is not ranks 0..1 (here: rank 0 alone)
        two = Layout.parse("tp1pp1dp2", 2)
        assert _in_thread(ahead.target, two, world) == (
            -1, "B's ranks are not the job's first ranks")
        assert _in_thread(ahead.target, two, SimpleNamespace(background=None)) == (
            -1, "this rank is not in B")
        lay = Layout.parse("tp1pp1dp1", 1)
        phased = _ahead(SimpleNamespace(at=at), built, phase_transition_iterations="1,2")
        phased.note_step(3)
        assert _in_thread(phased.target, lay, world) == (-1, "--phase-transition-iterations")
        _in_thread(ahead.build, two, world, 1)
        _in_thread(phased.build, lay, world, 1)
        assert _take(ahead, world, 24, 8) is None and _take(phased, world, 24, 8) is None
    assert built == []


def test_b_prepares_on_a_group_the_training_thread_never_uses(world):
    """Under NCCL B's CPU twin is the control group where B spans the world (the training
    thread's per-step ready votes run on it) and A's twin where A is on the same devices.
    Set up that topology with gloo (the backend reported as NCCL while the groups are
    made): the group B's data build votes on and stands in for the world with, and that
    B's construction gathers on, is none of those, nor any of A's."""
    import pytest as _pytest

    from dynatrain_megatron.elastic import communicators as cm
    from dynatrain_megatron.elastic import groups as G
    from dynatrain_megatron.megatron_lm.data_ahead import _group_of, _stand_in_of
    from dynatrain_megatron.transition.transport import control_group

    lay = Layout.parse("tp1pp1dp1", 1)
    with _pytest.MonkeyPatch.context() as m:
        m.setattr(G.dist, "get_backend", lambda group=None: "nccl")
        cm.create_control_group()
        control = control_group()
        a, b = G.build_groups(lay), G.build_groups(lay)
    try:
        assert control is not None and b.layout_group_cpu is control  # the NCCL topology
        assert a.layout_group_cpu is b.layout_group_cpu
        training = [control, a.layout_group, a.layout_group_cpu, *a.created]
        for used in (_group_of(b), _stand_in_of(b, lay), getattr(b, "background", None)):
            assert used is not None and not any(used is g for g in training)
        assert b.background in b.created  # destroyed with B's groups
        assert dist.get_process_group_ranks(b.background) == [0]
    finally:
        a.destroy()
        b.destroy()
        cm.forget_control_group()


def _build_beside_votes_case() -> dict:
    """One rank of 2 in the NCCL group topology (as in the test above): B's data build,
    in the background with Megatron-LM's build stood in for by what it runs on the
    default group (barriers, a flag broadcast), while this thread votes on the control
    group as the hook does every step. Every collective's result is checked."""
    import torch

    from dynatrain_megatron.elastic import communicators as cm
    from dynatrain_megatron.elastic import groups as G
    from dynatrain_megatron.elastic.communicators import everyone_ok
    from dynatrain_megatron.transition.transport import control_group
    from dynatrain_megatron.vps.model_spec import ModelSpec

    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"
    try:
        cm.create_control_group()
        lay = Layout.parse("tp1pp1dp2", 2)
        b = G.build_groups(lay)
    finally:
        dist.get_backend = real
    rank = dist.get_rank()

    def rebuild(args, num_chunks):
        for i in range(20):
            dist.barrier()
            flags = torch.tensor([i + 1 if dist.get_rank() == 0 else 0], dtype=torch.int64)
            dist.broadcast(flags, 0)
            assert int(flags.item()) == i + 1, (i, flags)
        return ["train"], None, None

    args = argparse.Namespace(consumed_train_samples=24, consumed_valid_samples=8,
                              global_batch_size=8, micro_batch_size=2, seq_length=32)
    spec = ModelSpec(name="t", num_layers=2, hidden_size=64, num_attention_heads=8,
                     num_query_groups=4, ffn_hidden_size=128, vocab_size=1000, seq_length=32)
    ahead = DataAhead(args, spec=spec, sequence_parallel=False,
                      decision=lambda: SimpleNamespace(at=7), rebuild=rebuild)
    ahead.note_step(3)
    t = threading.Thread(target=ahead.build, args=(lay, b, 1))
    t.start()
    votes = overlapped = 0
    # the hook's ready vote, every rank the same number of times (until all are done)
    while not everyone_ok(votes >= 20 and not t.is_alive(), control_group()):
        assert not everyone_ok(rank == 0, control_group())  # and one that is not all-true
        votes += 1
        overlapped += t.is_alive()
    t.join()
    # validation counts agreed (equal here), skipped samples as the largest (rank 1's)
    taken, agreed = ahead.take(b, 56, {"consumed_valid_samples": 8,
                                       "skipped_train_samples": 3 * rank})
    assert agreed == {"consumed_valid_samples": 8, "skipped_train_samples": 3}
    b.destroy()
    cm.forget_control_group()
    return dict(taken=taken, votes=votes, overlapped=overlapped)


@pytest.mark.multirank
def test_the_build_runs_beside_the_training_threads_votes():
    from dynatrain_megatron.testing.multiproc import run_on_ranks

    res = run_on_ranks(_build_beside_votes_case, 2, timeout=180)
    assert [r["taken"] for r in res] == [(["train"], None, None)] * 2
    assert all(r["votes"] >= 20 and r["overlapped"] > 0 for r in res)


def test_step_note_refuses_negative_counts():
    with pytest.raises(ValueError, match="non-negative"):
        StepNote(3, -8, 0)


def test_a_switched_out_layouts_loader_workers_stop_in_a_thread_of_their_own():
    import torch
    from torch.utils.data import DataLoader

    from dynatrain_megatron.megatron_lm.data_ahead import retire_in_background

    def loader():
        return DataLoader(torch.arange(16.0), batch_size=2, num_workers=1,
                          persistent_workers=True)

    def cyclic(dl):  # as Megatron-LM's cyclic_iter
        while True:
            for x in dl:
                yield x

    single = SimpleNamespace(iterable=iter(loader()))  # as megatron's RerunDataIterator
    cyc = cyclic(loader())
    next(single.iterable), next(cyc)  # workers running
    workers = [w for it in (single.iterable, cyc.gi_frame.f_locals["dl"]._iterator)
               for w in it._workers]
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    t = retire_in_background([single], cyc, None)
    t.join(timeout=60)
    assert not t.is_alive() and not any(w.is_alive() for w in workers)
    assert retire_in_background(None, [], SimpleNamespace(iterable=iter(range(3)))) is None
