"""Sharded objects (a module's `_extra_state`) carried as dist_checkpointing would: the plan
(main replica as the source, a key B asks for that A lacks refused as the load would fail),
the carry over an in-memory transport (two ranks as threads: two batched exchanges, the
values deserialised, never shared with A) and the setting on a torch module through
`load_state_dict` (its `set_extra_state`, parameters untouched). The end-to-end carry
inside Megatron-LM: tests/test_megatron_lm_recipes.py (llama)."""
from __future__ import annotations

import threading

import pytest
import torch

from dynatrain_megatron.adapters.sharded_objects import (ObjectCarryError, ObjectSlot,
                                                         deserialize, serialize, set_objects)
from dynatrain_megatron.transition.object_carry import (ObjectPlan, ObjectRoute,
                                                        carry_objects, object_plan)
from memory_transport import Mailboxes, MemoryTransport

L0, L1 = "decoder.layers.input_layernorm._extra_state/shard_0_2", \
    "decoder.layers.input_layernorm._extra_state/shard_1_2"


def test_each_key_comes_from_its_main_replica():
    # A: tp2 holds both layers on devices 0-3 (main: tp0 dp0 = device 0 for layer 0, 2 for 1)
    src = [(L0, 0, True), (L0, 1, False), (L1, 2, True), (L1, 3, False)]
    dst = [(L0, 1), (L0, 3), (L1, 0), (L1, 2)]
    plan = object_plan(src, dst)
    assert plan.routes == (ObjectRoute(0, 1, L0), ObjectRoute(0, 3, L0),
                           ObjectRoute(2, 0, L1), ObjectRoute(2, 2, L1))
    assert plan.sends(0) == {1: [L0], 3: [L0]} and plan.recvs(0) == {2: [L1]}
    assert plan.sends(2) == {0: [L1], 2: [L1]} and plan.recvs(2) == {2: [L1]}
    # A's objects that B does not ask for are left, as a load leaves them
    assert object_plan(src + [("extra/shard_0_1", 1, True)], dst) == plan


def test_a_key_b_asks_for_that_a_lacks_is_refused_naming_it():
    # B's layer object sharded differently (a layer axis of 3, not 2): the load would fail
    other = "decoder.layers.input_layernorm._extra_state/shard_1_3"
    with pytest.raises(ObjectCarryError, match=r"1 sharded object\(s\) of B are not held at A "
                       r".*dist_checkpointing's load would fail\): " + other.replace(".", r"\.")):
        object_plan([(L0, 0, True), (L1, 0, True)], [(L0, 1), (other, 1)])
    # a key A holds only as non-main replicas was never saved: refused too ...
    with pytest.raises(ObjectCarryError, match="not held at A"):
        object_plan([(L0, 1, False)], [(L0, 0)])
    # ... unless the main replica's device died: a surviving replica (the lowest) serves
    assert object_plan([(L0, 0, True), (L0, 3, False), (L0, 1, False)], [(L0, 2)],
                       unavailable=[0]).routes == (ObjectRoute(1, 2, L0),)


def test_plan_and_slot_validate_themselves():
    with pytest.raises(ObjectCarryError, match="sorted and distinct"):
        ObjectPlan((ObjectRoute(2, 0, L0), ObjectRoute(0, 1, L0)))
    with pytest.raises(ObjectCarryError, match="malformed object slot"):
        ObjectSlot("no-shard-suffix", 0, "x._extra_state", True)


class _Counting(torch.nn.Linear):
    """A module with an extra state (a counter and a tensor), as a user's or TE's."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.state = {"calls": 0, "amax": torch.zeros(())}

    def get_extra_state(self):
        return self.state

    def set_extra_state(self, state) -> None:
        self.state = state


def test_set_objects_calls_set_extra_state_and_leaves_the_parameters():
    chunk = torch.nn.Sequential(_Counting(), _Counting())
    before = {k: v.clone() for k, v in chunk.state_dict().items() if torch.is_tensor(v)}
    value = {"calls": 7, "amax": torch.tensor(2.5)}
    set_objects(chunk, {"1._extra_state": deserialize(serialize(value))})
    assert chunk[1].state["calls"] == 7 and torch.equal(chunk[1].state["amax"], value["amax"])
    assert chunk[1].state["amax"] is not value["amax"]  # a load's copy, never A's object
    assert chunk[0].state["calls"] == 0  # not named: untouched
    after = chunk.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


class _Side:
    """A rank's binding as the carry uses it: objects read at A, written at B."""

    def __init__(self, values=None, fail: bool = False) -> None:
        self.values, self.fail, self.written = values or {}, fail, None

    def read_objects(self, keys):
        if self.fail:
            raise RuntimeError("injected")
        return {k: serialize(v) for k, v in self.values.items() if k in keys}

    def write_objects(self, values) -> None:
        self.written = values


def _carry(plan, sides):
    box, out = Mailboxes(), {}

    def run(me):
        src, dst = sides[me]
        out[me] = carry_objects(plan, me, src, dst, MemoryTransport(box, me, tag=3),
                                device=torch.device("cpu"), tag=3, timeout=30)

    threads = [threading.Thread(target=run, args=(me,)) for me in sides]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    return out, box


def test_carry_sends_each_destination_its_objects_in_two_messages():
    a0 = {L0: {"calls": 3, "amax": torch.tensor(1.5)}, L1: {"calls": 3, "amax": torch.tensor(4.0)}}
    plan = object_plan([(L0, 0, True), (L1, 0, True)], [(L0, 0), (L0, 1), (L1, 1)])
    sides = {0: (_Side(a0), _Side()), 1: (None, _Side())}
    out, box = _carry(plan, sides)
    assert out[0][1] == [] and out[1][1] == []
    got0, got1 = sides[0][1].written, sides[1][1].written
    assert set(got0) == {L0} and set(got1) == {L0, L1}
    for got in (got0, got1):
        for k, v in got.items():
            assert v["calls"] == 3 and torch.equal(v["amax"], a0[k]["amax"])
            assert v["amax"] is not a0[k]["amax"]
    # rank 0 -> 1: one message of sizes, then one of bytes; nothing to itself on the wire
    stats = out[0][0]
    sizes, data = [(torch.int64, 2)], [(torch.uint8, stats.sent_bytes)]
    assert box.posted[0] == [({1: sizes}, {}), ({1: data}, {})]
    assert box.posted[1] == [({}, {0: sizes}), ({}, {0: data})]
    assert stats.sent == 2 and stats.sent_bytes == len(serialize(a0[L0])) + len(serialize(a0[L1]))
    assert out[1][0].received == 2 and out[1][0].recv_bytes == stats.sent_bytes


def test_a_source_that_cannot_read_still_posts_and_both_sides_report():
    plan = object_plan([(L0, 0, True)], [(L0, 1)])
    sides = {0: (_Side(fail=True), None), 1: (None, _Side())}
    out, _ = _carry(plan, sides)  # no hang: the failed source sent "no value" sizes
    assert "reading the sharded objects: RuntimeError: injected" in out[0][1][0]
    assert "no value arrived for" in out[1][1][0] and sides[1][1].written is None


class _Bound:
    """A rank's binding as the preparation reads it: its object slots."""

    def __init__(self, slots) -> None:
        self.objects = list(slots)


def _plans_on_two_ranks(case: str):
    """`plan_objects` on two gloo ranks (rank cases run in spawned processes)."""
    import torch.distributed as dist

    from dynatrain_megatron.transition.object_carry import join_failed, plan_objects

    me = dist.get_rank()
    stateful = case != "stateless"
    a = [ObjectSlot(L0, 0, "layers.0.norm._extra_state", me == 0, stateful),
         ObjectSlot(L1, 0, "layers.1.norm._extra_state", me == 0, stateful)]
    b = [ObjectSlot(L1 if me == 0 else L0, 0, "layers.0.norm._extra_state", True, stateful)]
    if case == "mismatch" and me == 1:  # B's object sharded differently (3 layers, not 2)
        b = [ObjectSlot(L0.replace("_2", "_3"), 0, "layers.0.norm._extra_state", True, True)]
    joined = [False]
    try:
        if case == "failed" and me == 1:  # its preparation failed before the objects
            join_failed(None, torch.device("cpu"))
            return "joined failed"
        plan = plan_objects(True, _Bound(a), None, _Bound(b), None, (), joined, "A -> B",
                            torch.device("cpu"))
    except ObjectCarryError as e:
        return f"raised: {e}"
    return None if plan is None else [str(r) for r in plan.routes]


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["stateless", "stateful", "mismatch", "failed"])
def test_an_analytic_plan_gathers_keys_only_where_objects_hold_state(case):
    from dynatrain_megatron.testing.multiproc import run_on_ranks

    got = run_on_ranks(_plans_on_two_ranks, 2, case, timeout=120)
    if case == "stateless":  # None everywhere: stays as built, nothing gathered
        assert got == [None, None]
    elif case == "stateful":  # rank 0 holds both main replicas
        assert got == [[f"{L1}: 0->0", f"{L0}: 0->1"]] * 2
    elif case == "mismatch":  # one line, from rank 0 only; rank 1 waits for the vote
        assert got[0].startswith("raised: 1 sharded object(s) of B are not held at A")
        assert "shard_0_3" in got[0] and got[1] is None
    else:  # rank 1 failed: rank 0 gathers nothing, and rank 1's vote refuses the switch
        assert got == [None, "joined failed"]
