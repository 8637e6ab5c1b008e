"""The end-to-end budget of a switch: every term a real switch pays, each marked as
measured (where), modelled (formula and constants), or simulated, and placed where it
runs: in the stall (the training thread waits), in the background (the preparation
thread, while A trains), or after B's first steps.

The budget is that of a **requested** switch (signal file, automatic layout, growth) on a
**GPU job** (NCCL, with the memory check that is on by default there:
`loop/memory_check.from_args`), read against the code as it is now; each term's basis
names the function that does the work. A scheduled switch (`--dynatrain-schedule`) differs
in two terms, said where they are.

Inputs: the plan report of `dynatrain plan` (bytes, planning time, checkpoint model), the
emulated control plane (`bench.control_plane`: per-rank counts), the transfer simulated
on a fabric (`routing.fabric`), and `BudgetConstants`, whose every field says where its
value comes from (`SOURCES`). Terms with a `when` apply only in that case: they are listed
but not summed.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from ..advisor.calibration import Calibration, Workload
from ..advisor.step_time import step_estimate
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec

GB = 1e9
WHERE = ("stall", "background", "after B's first steps")
HOW = ("measured", "modelled", "simulated")

# where a constant comes from (printed with the budget)
SOURCES = {
    "non_member_new_group_s": "measured: torch 2.13 new_group as a non-member, 'fake' "
                              "backend at world 4096 on this 2-core machine: 22 us/call for "
                              "2-rank groups at load 15, 67-193 us under heavier load; 100 us "
                              "used (larger member lists cost more)",
    "nccl_comm_init_s": "assumed: ncclCommInitRank with its group, order of 0.1-1 s at "
                        "thousands of GPUs (NCCL 2.2x release notes on init at scale); "
                        "to measure on GPUs",
    "store_op_s": "assumed: one TCPStore round trip (~100 us) and a single-threaded "
                  "store server serving every rank's operations one after the other",
    "small_collective_step_s": "assumed: a 4-byte NCCL all-reduce or broadcast, 2 log2(n) "
                               "steps of 8 us (tree latency)",
    "gloo_hop_s": "assumed: one message between two ranks over gloo's TCP transport on the "
                  "data-centre network (~20 us); gloo's all-reduce is a ring "
                  "(gloo/allreduce.cc `ring`, torch's ProcessGroupGloo uses it): a 4-byte "
                  "value goes round it hop by hop, 2 (n - 1) messages one after the other",
    "b_objects_s": "assumed: B's model, DDP buffers and distributed optimizer built by "
                   "Megatron-LM's own provider without initialising weights "
                   "(megatron_lm/builder.MegatronLMBuilder.build_detached); measured on CPU "
                   "3.5 s for a 10M GPT on 2 loaded cores (docs/bench/stall.md: build 6.74 s "
                   "less B's data iterators 3.26 s); to measure on GPUs",
    "prepare_rest_s": "measured on CPU: bind 0.62 + check 0.05 + views 0.08 + A bound 0.10 s "
                      "(docs/bench/stall.md, 10M GPT, transition/switch.prepare_switch); it "
                      "grows with the tensors per rank, not their bytes",
    "data_iterator_s": "assumed: Megatron-LM's build_train_valid_test_data_iterators on cached "
                       "dataset indices (mmap) and its flag broadcast; measured on CPU 3.26 s "
                       "(docs/bench/stall.md, mock data with a --data-cache-path); seconds "
                       "for large blends",
    "skip_micro_batch_s": "assumed: one micro-batch drawn from Megatron-LM's GPT dataset "
                          "through its DataLoader workers and dropped (index look-ups, one "
                          "mmap read of seq+1 tokens, collate; more with an attention mask "
                          "built in the loader); to measure",
    "hbm_gbps": "assumed: a device-local copy at 2 TB/s (H100-class HBM, read + write)",
    "nccl_destroy_s": "assumed: destroying one NCCL communicator (ncclCommDestroy "
                      "synchronises the ranks of a node), ~5 ms; to measure on GPUs",
    "release_rebind_s": "measured on CPU: bench-switch gpt-50m, pause minus the switch "
                        "(releasing A and rebinding the trainer), docs/bench/switch.md",
    "first_step_extra_s": "assumed: the first step at B pays cold kernels, autotuning and "
                          "allocator growth (B's communicators are warm); measured on CPU "
                          "+3.6 s for a 10M GPT, of which ~1.9 s a restarted job's first "
                          "iteration pays as well (docs/bench/stall.md); to measure on GPUs",
    "deferred_collect_s": "measured on CPU: what is left of A's release after B's first "
                          "steps (A's groups' destroy, the allocator's trim), 0.03-0.045 s "
                          "per rank for a 10M GPT on 2 cores; A's tensors are freed in the "
                          "pause (mcore/held_memory.release_storages, 0.004 s) and no full "
                          "collection runs (docs/bench/stall.md); to measure on GPUs",
    "step_skew_fraction": "assumed: after the optimizer step's collectives ranks reach the "
                          "boundary within 0.1% of a step of each other",
    "storage_gbps": "the checkpoint model of `dynatrain plan` (routing/cost.py)",
}


@dataclass(frozen=True, slots=True)
class BudgetConstants:
    """Constants of the modelled terms (`SOURCES` says where each comes from)."""

    non_member_new_group_s: float = 100e-6
    nccl_comm_init_s: float = 0.3
    store_op_s: float = 100e-6
    store_server_ops_per_s: float = 50_000.0
    small_collective_step_s: float = 8e-6
    gloo_hop_s: float = 20e-6
    b_objects_s: float = 5.0
    prepare_rest_s: float = 0.85
    data_iterator_s: float = 2.0
    skip_micro_batch_s: float = 1e-3
    hbm_gbps: float = 2000.0
    nccl_destroy_s: float = 5e-3
    release_rebind_s: float = 0.055
    first_step_extra_s: float = 2.0
    deferred_collect_s: float = 0.05
    step_skew_fraction: float = 0.001
    nic_gbps: float = 50.0
    nvlink_gbps: float = 450.0
    efficiency: float = 0.8
    workload: Workload = field(default_factory=lambda: Workload(1, 1024, 4096))

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if k != "workload" and not (isinstance(v, (int, float)) and v >= 0
                                        and math.isfinite(v)):
                raise ValueError(f"budget constant {k} must be finite and >= 0, got {v}")
        for k in ("nic_gbps", "nvlink_gbps", "efficiency", "hbm_gbps"):
            if not getattr(self, k) > 0:
                raise ValueError(f"budget constant {k} must be > 0, got {getattr(self, k)}")

    def small_collective_s(self, n: int) -> float:
        """A 4-byte NCCL collective over `n` ranks (tree latency)."""
        return 2 * math.log2(max(n, 2)) * self.small_collective_step_s

    def gloo_vote_s(self, n: int) -> float:
        """A 4-byte gloo all-reduce over `n` ranks: 2 (n - 1) hops of the ring."""
        return 2 * max(n - 1, 0) * self.gloo_hop_s


@dataclass(frozen=True, slots=True)
class Term:
    """One line of the budget. `when`: the case it applies in (then not summed)."""

    name: str
    seconds: float
    where: str
    how: str
    basis: str  # where measured, or the formula with its constants
    when: str = ""

    def __post_init__(self) -> None:
        if self.where not in WHERE or self.how not in HOW:
            raise ValueError(f"budget term {self.name!r}: where {self.where!r} must be one "
                             f"of {WHERE}, how {self.how!r} one of {HOW}")
        if not (math.isfinite(self.seconds) and self.seconds >= 0) or not self.basis:
            raise ValueError(f"budget term {self.name!r} needs finite non-negative seconds "
                             f"and a basis, got {self.seconds!r}, {self.basis!r}")

    def as_dict(self) -> dict:
        return asdict(self)


def _steps(spec: ModelSpec, layout: Layout, c: BudgetConstants) -> float:
    """A step of `layout` (advisor.step_time) for the budget's workload."""
    w = c.workload
    m = max(1, w.global_batch_size // (w.micro_batch_size * layout.dp))
    cal = Calibration(intra_node_gbps=c.nvlink_gbps, inter_node_gbps=c.nic_gbps)
    return step_estimate(spec, layout, w, cal, m).step_seconds


def _background(k: dict, W: int, c: BudgetConstants) -> list[Term]:
    """The preparation thread (elastic/device_manager.DeviceManager.prepare), in its order:
    B's groups, B's objects, B's data iterators, the rest of the preparation."""
    t: list[Term] = []
    calls = k.get("switch_non_member_calls", 0)
    t.append(Term("new_group calls (non-member)", calls * c.non_member_new_group_s,
                  "background", "modelled",
                  f"{calls} calls (emulated, elastic/groups.build_groups) x "
                  f"{c.non_member_new_group_s * 1e6:.0f} us (per-call cost measured on CPU)"))
    comms = k.get("switch_communicators", 0)
    t.append(Term("communicators created", comms * c.nccl_comm_init_s, "background",
                  "modelled", f"{comms} NCCL communicators (emulated: new_group with a "
                  f"device_id, elastic/communicators.group_device) x {c.nccl_comm_init_s:g} s, "
                  f"one after the other"))
    ops = k.get("switch_store_sets", 0) + k.get("switch_store_gets", 0)
    server = ops * W / c.store_server_ops_per_s
    t.append(Term("store operations", max(ops * c.store_op_s, server), "background",
                  "modelled", f"{ops} per rank (emulated) x {W} ranks through one store "
                  f"server at {c.store_server_ops_per_s:,.0f} ops/s, or {ops} x "
                  f"{c.store_op_s * 1e6:.0f} us per rank, whichever is longer"))
    conns = k.get("switch_gloo_connections", 0)
    t.append(Term("gloo mesh set-up", conns * c.store_op_s, "background", "modelled",
                  f"{conns} eager connections per rank (emulated; B's CPU twin connects "
                  f"lazily, elastic/groups.build_groups) x {c.store_op_s * 1e6:.0f} us"))
    t.append(Term("B's objects built", c.b_objects_s, "background", "modelled",
                  SOURCES["b_objects_s"]))
    t.append(Term("B's data iterators built", c.data_iterator_s, "background", "modelled",
                  "megatron_lm/data_ahead.DataAhead.build, in the preparation thread before B's "
                  "objects, at the consumed-sample count noted at the last step boundary "
                  "(a scheduled switch: at its own count); " + SOURCES["data_iterator_s"]))
    t.append(Term("plan + schedule (preparation)", 0.0, "background", "measured",
                  "memoised: made with the placement choice, found made by "
                  "transition/switch.prepare_switch (tests/test_control_plane.py::"
                  "test_the_plan_is_made_once_per_rank)"))
    t.append(Term("bind, check and views of A and B", c.prepare_rest_s, "background",
                  "measured", SOURCES["prepare_rest_s"]))
    return t


# a weights-only switch (RLHF: api.ElasticJob.weights_to) is not made by Megatron-LM's
# training loop: none of these terms is paid
_LOOP_ONLY = ("B's data iterators built", "memory check", "ready votes while B is prepared",
              "Megatron-LM's counters and the data iterators taken",
              "data iterators advanced to the switch", "data iterators built at the switch",
              "wait for B (scheduled switch)", "first step at B (extra)",
              "A's memory collected (deferred)")


def _weights_only(x: Term, bg: float) -> Term:
    """`x` for a weights-only switch: the loop's terms are none; B's groups and chunks
    (the generation layout G) are built inside the first call, kept for the next ones."""
    if x.name in _LOOP_ONLY:
        return Term(x.name, 0.0, x.where, x.how, "none: a weights-only switch "
                    "(api.ElasticJob.weights_to) is not made by Megatron-LM's training loop")
    if x.where == "background":
        return Term(x.name, x.seconds, x.where, x.how, x.basis + "; G's groups and chunks "
                    "are built inside the first weights_to call (then in its stall) and "
                    "kept for the later ones (weights_back(keep=True)): none then")
    return x


def switch_budget(spec: ModelSpec, src: Layout, dst: Layout, report: dict[str, Any],
                  counts: Optional[dict[str, Any]], transfer: Optional[dict[str, Any]],
                  c: BudgetConstants = BudgetConstants()) -> dict[str, Any]:
    """The budget of the switch `report` describes (module doc). `counts`: the emulated
    control plane's summary (`Emulation.summary()`), `transfer`: the simulated transfer
    (`TransferSim.as_dict()`); without them those terms fall back to the ideal-link
    estimate and zero counts."""
    W, WB = max(src.world_size, dst.world_size), dst.world_size
    nic = c.nic_gbps * GB * c.efficiency
    step_a, step_b = _steps(spec, src, c), _steps(spec, dst, c)
    k = counts or {}
    weights_only = set(report.get("kinds", ())) == {"param"}
    t = _background(k, W, c)
    bg = sum(x.seconds for x in t)
    # the steps of A the preparation spans (the switch lands at the first boundary after
    # it); B's data iterators are built at the count of the last boundary before their
    # build starts, and advanced at the switch by what A consumed since
    spanned = max(1, math.ceil(bg / step_a)) if step_a > 0 else 1
    after_note = c.data_iterator_s + c.prepare_rest_s
    noted = math.floor(max(0.0, bg - after_note) / step_a) if step_a > 0 else 0
    skip_steps = max(1, spanned - noted)
    w = c.workload
    micro_b = max(1, w.global_batch_size // (w.micro_batch_size * dst.dp))
    vote = c.gloo_vote_s(W)
    # -- the decision step: the request accepted on the training thread
    plan_s = report.get("plan_seconds", 0.0)
    t.append(Term("placement choice (with its plans)", plan_s, "stall", "measured",
                  "transition/switch.choose_dst_placement on the training thread when the "
                  "request is accepted: a GPU job's memory check needs B's placement "
                  "(loop/hook._on_decision; chosen in the background where the check is off, "
                  "as on the CPU); cold, one core of this machine (dynatrain plan's planning "
                  "time)"))
    t.append(Term("memory check", vote, "stall", "modelled",
                  f"loop/memory_check.SwitchMemoryCheck.plan: arithmetic and one MAX all-reduce "
                  f"on the CPU control group (gloo, {W} ranks): 2 x {W - 1} hops x "
                  f"{c.gloo_hop_s * 1e6:.0f} us"))
    t.append(Term("ready votes while B is prepared", (spanned - 1) * vote, "stall",
                  "modelled", f"one gloo vote over {W} ranks at each of the {spanned - 1} step "
                  f"boundaries before the background ends (elastic/device_manager."
                  f"DeviceManager.vote; the last, 'ready', is the switch's first vote), in "
                  f"place of the controller's NCCL broadcast (not subtracted)"))
    # -- the switch step
    t.append(Term("step skew", c.step_skew_fraction * step_a, "stall", "modelled",
                  f"{c.step_skew_fraction:g} x step of A ({step_a:.2f} s, advisor.step_time)"))
    t.append(Term("votes (ready, preparation, prepare, commit)", 4 * vote, "stall",
                  "modelled", f"4 gloo all-reduces of 4 B on the CPU control group over {W} "
                  f"ranks (device_manager._least, hook._switch_now, switch._agree twice): "
                  f"4 x 2 x {W - 1} hops x {c.gloo_hop_s * 1e6:.0f} us"))
    colls = k.get("switch_collectives", {}).get("all_reduce", 4)
    warm = max(0, colls - 4)  # the emulation's all-reduces: the 4 votes and the warm-ups
    t.append(Term("communicator warm-up", warm * c.small_collective_s(W), "stall",
                  "modelled", f"{warm} NCCL all-reduces, one per group of B's "
                  f"(emulated; elastic/communicators.warm_up_groups at DeviceManager.take) x "
                  f"{c.small_collective_s(W) * 1e6:.0f} us"))
    if transfer is not None:
        t.append(Term("transfer (data)", transfer["data_seconds"], "stall", "simulated",
                      f"the executor's messages (transition/executor.Executor, emulated) as "
                      f"max-min fair flows on a rail-optimised fat tree "
                      f"(oversubscription {transfer['fabric']['oversubscription']:g}, "
                      f"efficiency {transfer['fabric']['efficiency']:g}), "
                      f"{transfer['rounds']} round(s)"))
        t.append(Term("transfer (checksum phase)", transfer["checksum_seconds"], "stall",
                      "simulated", "transition/executor.Executor with checksums on (as "
                      "always): the receivers' pass + one exchange of the sums per round"))
    else:
        t.append(Term("transfer", report["estimated_seconds"], "stall", "modelled",
                      "ideal links (routing.cost.estimate)"))
    gather = k.get("switch_world_collective_bytes", {}).get("all_gather_object", 0)
    p2p = k.get("p2p_padding_bytes", 0)
    t.append(Term("vocab-padding exchange", max(gather, p2p) / nic
                  + (c.small_collective_s(2) if p2p else 0.0), "stall", "modelled",
                  (f"{gather / 1e9:.2f} GB received per rank by a world all_gather_object"
                   if gather else f"{p2p / 1e6:.2f} MB sent + received point to point by the "
                   f"busiest sampled rank (emulated, transition/vocab_padding."
                   f"carry_vocab_padding)") + f" / NIC {nic / 1e9:.0f} GB/s"))
    t.append(Term("scalars broadcast", 2 * c.small_collective_s(W), "stall", "modelled",
                  f"transition/switch.switch_layout: broadcast_object_list over the world "
                  f"(NCCL): its size and its payload, 2 x {c.small_collective_s(W) * 1e6:.0f} us"))
    from ..routing.cost import state_bytes
    masters = state_bytes(spec, ("main_param",)) / WB  # sharded over every rank of B
    wbytes = state_bytes(spec, ("param",)) / (dst.tp * dst.pp * dst.cp)
    t.append(Term("weights from the fp32 masters (local copy)",
                  (masters + masters / 2) / (c.hbm_gbps * GB), "stall", "modelled",
                  f"transition/switch.rebuild_weights_from_masters: {masters / 1e9:.2f} GB of "
                  f"this rank's masters (the state over B's {WB} ranks) read, half as much "
                  f"written in 16 bits / HBM {c.hbm_gbps:g} GB/s"))
    dp = dst.dp * dst.cp
    if "param" in report.get("kinds", ()):
        t.append(Term("DP all-gather of weights (rebuild from masters)", 0.0, "stall",
                      "modelled", "none: the weights are moved by the transfer"))
    else:
        ag = wbytes * (dp - 1) / dp / nic if dp > 1 else 0.0
        t.append(Term("DP all-gather of weights (rebuild from masters)", ag, "stall",
                      "modelled", f"megatron's param sync (start_param_sync): {wbytes / 1e9:.2f} "
                      f"GB weight shard x (dp-1)/dp over NIC {nic / 1e9:.0f} GB/s"))
    t.append(Term("release of A + rebind", c.release_rebind_s, "stall", "measured",
                  SOURCES["release_rebind_s"] + " (loop/switching.switch_trainer: "
                  "mcore/session.release with its collection deferred, Trainer.rebind)"))
    destroyed = k.get("switch_destroyed", 0)
    t.append(Term("NCCL communicators destroyed", destroyed * c.nccl_destroy_s, "stall",
                  "modelled", f"{destroyed} groups destroyed (emulated: B's transfer group, "
                  f"switch._release_transfer, and A's, elastic/groups.ParallelGroups.destroy "
                  f"from mcore/session.release) x {c.nccl_destroy_s * 1e3:g} ms; not in the "
                  f"CPU figure above (gloo)"))
    t.append(Term("Megatron-LM's counters and the data iterators taken", c.gloo_vote_s(WB),
                  "stall", "modelled",
                  f"megatron_lm/adapter.rebind_loop: DataAhead.take agrees the counters and "
                  f"whether the iterators built ahead fit in one MAX all-reduce, gloo over B's "
                  f"{WB} ranks (B's CPU twin): 2 x {WB - 1} hops x "
                  f"{c.gloo_hop_s * 1e6:.0f} us"))
    t.append(Term("data iterators advanced to the switch",
                  skip_steps * micro_b * c.skip_micro_batch_s, "stall", "modelled",
                  f"data_ahead.advance: {skip_steps} step(s) of A since the boundary before "
                  f"their build (the last {c.data_iterator_s:g} + {c.prepare_rest_s:g} s of "
                  f"the {bg:.2f} s background, steps of {step_a:.2f} s; at least 1) x {micro_b} micro-batches per step per data-parallel rank at B "
                  f"(global batch {w.global_batch_size} / micro-batch {w.micro_batch_size} / "
                  f"dp {dst.dp}) x {c.skip_micro_batch_s * 1e3:g} ms; none for a scheduled "
                  f"switch (built at its exact count)"))
    t.append(Term("first step at B (extra)", c.first_step_extra_s, "stall", "modelled",
                  SOURCES["first_step_extra_s"]))
    t.append(Term("data iterators built at the switch", c.data_iterator_s, "stall",
                  "modelled", "adapter.rebind_loop builds them in the pause when "
                  "DataAhead.take finds none for this switch; " + SOURCES["data_iterator_s"],
                  when="an evaluation ran between the build and the switch (the consumed "
                       "validation samples differ), a requested switch with a "
                       "--dataloader-type other than single, --phase-transition-iterations, "
                       "or the background build failed"))
    t.append(Term("wait for B (scheduled switch)", max(0.0, bg - step_a), "stall", "modelled",
                  f"loop/hook._switch_when_due: a schedule lands exactly after its iteration "
                  f"and waits there for what is left of the {bg:.2f} s background",
                  when="a scheduled switch announced less than the background's "
                       f"{spanned} step(s) of A ahead (this figure: announced one step ahead)"))
    # -- after B's first steps
    t.append(Term("A's memory collected (deferred)", c.deferred_collect_s,
                  "after B's first steps", "measured",
                  "loop/stall_tracker.StallTracker.finish -> mcore/session.collect_released, "
                  "on the training thread once B's first steps are measured; "
                  + SOURCES["deferred_collect_s"]))
    if weights_only:
        t = [_weights_only(x, bg) for x in t]
        bg = sum(x.seconds for x in t if x.where == "background" and not x.when)
    summed = [x for x in t if not x.when]
    stall = sum(x.seconds for x in summed if x.where == "stall")
    after = sum(x.seconds for x in summed if x.where == "after B's first steps")
    ck = {"write_seconds": report["checkpoint_write_seconds"],
          "read_seconds": report["checkpoint_read_seconds"],
          "restart_seconds": report["checkpoint_restart_seconds"],
          "total_seconds": report["checkpoint_estimate_seconds"], "how": "modelled",
          "basis": "write + read of the full state at the storage bandwidth + restart "
                   "(routing/cost.py CheckpointModel)"}
    return {"terms": [x.as_dict() for x in t], "stall_seconds": stall,
            "background_seconds": bg, "after_seconds": after,
            "step_a_seconds": step_a, "step_b_seconds": step_b,
            "background_steps_of_a": spanned, "skipped_steps": skip_steps,
            "background_fits": (f"a requested switch: yes, it lands at the first step "
                                f"boundary after the background's {spanned} step(s) of A; a "
                                f"scheduled one if announced at least {spanned} step(s) "
                                f"ahead, else it waits (the conditional term); the "
                                f"background's share of the host beside A's steps is not "
                                f"modelled"),
            "checkpoint_path": ck, "constants": asdict(c),
            "sources": SOURCES}


__all__ = ["BudgetConstants", "Term", "switch_budget", "SOURCES", "WHERE", "HOW"]
