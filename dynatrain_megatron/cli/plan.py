"""`dynatrain plan`: plan a layout switch of a real model on a real cluster size, on a laptop.

    dynatrain plan --model llama3-70b --from tp8pp4dp4 --to tp8pp8dp2 --world 128
    dynatrain plan --model qwen3-235b-a22b --from tp4pp2ep32etp1 --to tp4pp2ep64etp1 \\
        --world 4096 --json
    dynatrain plan --scenario configs/scenarios/llama70b-scale-in-96.yaml

Builds both analytic layouts, chooses the placement of the new layout (unless
`--default-placement`), builds the plan for every rank, schedules it under
`--memory-budget`, and prints: planning time, state bytes per kind, bytes moved versus
the lower bound (chosen and default placement), the largest per-rank send/receive
(intra/inter node), the estimated transfer time under the link model, the bandwidth
lower bound, the peak extra (staging) memory per rank, and the checkpoint-based
estimate. Every model parameter is printed with the figures. Bad input exits with 2 and
one line naming the constraint.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional


from ..configs import load_model
from ..safe_files import read_yaml
from ..routing.fabric import Fabric, simulate_transfer
from ..routing.cost import (CheckpointModel, bandwidth_lower_bound, checkpoint_estimate,
                            describe, estimate)
from ..routing.links import LinkModel
from ..routing.placement_search import best_rank_ordered, placement_choice
from ..routing.plan import Plan
from ..routing.regions import RoutingError
from ..routing.schedule import build_schedule
from ..units import format_bytes, format_seconds, parse_bytes
from ..vps.analytic import analytic_layout
from ..vps.errors import DynatrainError, LayoutError
from ..vps.fragment import KINDS, OPT_KINDS
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..vps.placement import is_rank_ordered
from .common import devices, finite_float, int_at_least, renamed, subcommand

KIND_SETS = {"all": KINDS, "weights": ("param",), "optimizer": OPT_KINDS}


def parse_kinds(text: str) -> tuple[str, ...]:
    if text in KIND_SETS:
        return KIND_SETS[text]
    ks = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in ks if k not in KINDS]
    if bad or not ks:
        raise argparse.ArgumentTypeError(
            f"kinds: {text!r}; use all, weights, optimizer or a comma list of {KINDS}")
    return ks


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `plan` subcommand to an argparse subparsers object; returns its parser."""
    p = subcommand(
        subparsers, "plan", help="plan a layout switch (bytes, placement, time) without "
                                 "running it",
        description=__doc__.split("\n\n")[0],
        examples=["dynatrain plan --model llama3-70b --from tp8pp4dp4 --to tp8pp8dp2 "
                  "--world 128",
                  "dynatrain plan --model tiny-gpt --from tp2pp2 --to tp2pp2 --world-from 8 "
                  "--world-to 4   # scale-in",
                  "dynatrain plan --scenario configs/scenarios/llama70b-scale-in-96.yaml --json"])
    p.add_argument("--scenario", metavar="YAML",
                   help="YAML file with model/from/to/world_from/world_to (and optional kinds, "
                        "ranks_per_node, memory_budget); flags override it")
    p.add_argument("--model", metavar="NAME|YAML",
                   help="model config: a name in configs/models or a YAML path")
    p.add_argument("--from", dest="src", metavar="LAYOUT",
                   help="source layout, e.g. tp8pp4dp4")
    p.add_argument("--to", dest="dst", metavar="LAYOUT",
                   help="destination layout, e.g. tp8pp8dp2")
    p.add_argument("--world", type=devices(), metavar="DEVICES",
                   help="world size (devices) of both layouts")
    p.add_argument("--world-from", type=devices(), metavar="DEVICES",
                   help="world size (devices) of the source layout")
    p.add_argument("--world-to", type=devices(), metavar="DEVICES",
                   help="world size (devices) of the destination layout")
    p.add_argument("--ranks-per-node", type=devices(), default=None, metavar="DEVICES",
                   help="devices per node (8)")
    # (flag stem, destination, default, what the figure is), all in gigabytes per second
    rates = (
        ("intra-node", "intra_node_gbps", 450.0, "per-device NVLink bandwidth per direction"),
        ("inter-node", "inter_node_gbps", 50.0,
         "per-device NIC bandwidth per direction; a 400 Gb/s NIC is 50"),
        ("local-copy", "local_copy_gbps", 1000.0,
         "device-memory copy bandwidth for local pieces"),
        ("checksum", "checksum_gbps", 3000.0,
         "bandwidth of the checksum pass over sent/received bytes"),
        ("storage", "storage_gbps", 100.0,
         "aggregate storage bandwidth of the checkpoint path"),
    )
    for name, dest, default, what in rates:
        p.add_argument(f"--{name}-gbytes-per-s", dest=dest, type=finite_float(0.0),
                       default=default, metavar="GB/S",
                       help=f"{what}, gigabytes/s ({default:g})")
        renamed(p, f"--{name}-gbps", f"--{name}-gbytes-per-s",
                "gigabytes per second; a 400 Gb/s NIC is 50")
    p.add_argument("--round-latency-us", type=finite_float(0.0, inclusive=True), default=50.0,
                   metavar="US", help="fixed cost of one batched exchange, microseconds (50)")
    p.add_argument("--restart-seconds", type=finite_float(0.0, inclusive=True), default=60.0,
                   metavar="SECONDS", help="restart cost of the checkpoint path, seconds (60)")
    p.add_argument("--memory-budget", type=parse_bytes, default=None, metavar="BYTES",
                   help="staging bytes per rank and round (e.g. 2GiB); default: one round")
    p.add_argument("--kinds", type=parse_kinds, default=None, metavar="KINDS",
                   help="state kinds to move: all (default), weights, optimizer, or a "
                        "comma list of " + ",".join(KINDS))
    p.add_argument("--bucket-size", type=int_at_least(1), default=None, metavar="ELEMENTS",
                   help="resolved DDP bucket size in elements (default: one bucket per buffer)")
    p.add_argument("--unit-size", type=int_at_least(1), default=None, metavar="RANKS",
                   help="virtual ranks placed together (default tp*cp of the new layout)")
    p.add_argument("--default-placement", action="store_true",
                   help="pin Megatron's default rank order for the new layout")
    p.add_argument("--leaving", choices=("planner", "last"), default="planner",
                   help="scale-in: which devices leave: chosen by the planner (default) or "
                        "the highest-numbered ones")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_plan)
    return p


# scenario key -> what its value must be (checked before anything is computed from it)
_SCENARIO_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,), "description": (str,), "model": (str,), "from": (str,), "to": (str,),
    "world": (int,), "world_from": (int,), "world_to": (int,), "kinds": (str,),
    "ranks_per_node": (int,), "memory_budget": (str, int), "bucket_size": (int,),
    "leaving": (str,)}


def _load_scenario(path: str) -> dict[str, Any]:
    d = read_yaml(path, "scenario file", RoutingError)
    if not isinstance(d, dict):
        raise RoutingError(f"scenario {path!r} is not a mapping")
    bad = sorted(str(k) for k in set(d) - set(_SCENARIO_TYPES))
    if bad:
        raise RoutingError(f"scenario {path!r}: unknown keys {bad}; known: "
                           f"{sorted(_SCENARIO_TYPES)}")
    for key, value in d.items():
        types = _SCENARIO_TYPES[key]
        if value is None and key in ("memory_budget", "bucket_size", "description"):
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            raise RoutingError(f"scenario {path!r}: {key} must be "
                               f"{' or '.join(t.__name__ for t in types)}, got {value!r}")
        if types == (int,) and value < 1:
            raise RoutingError(f"scenario {path!r}: {key} must be >= 1, got {value}")
    if d.get("leaving", "planner") not in ("planner", "last"):
        raise RoutingError(f"scenario {path!r}: leaving must be planner or last, got "
                           f"{d['leaving']!r}")
    return d


def _resolve(args) -> dict[str, Any]:
    sc = _load_scenario(args.scenario) if args.scenario else {}
    model = args.model or sc.get("model")
    src, dst = args.src or sc.get("from"), args.dst or sc.get("to")
    if not model or not src or not dst:
        raise RoutingError("need --model, --from and --to (or a --scenario giving them)")
    world = args.world if args.world is not None else sc.get("world")
    wf = args.world_from if args.world_from is not None else sc.get("world_from", world)
    wt = args.world_to if args.world_to is not None else sc.get("world_to", world)
    if args.world is not None and (args.world_from is not None or args.world_to is not None):
        raise RoutingError("give either --world or --world-from/--world-to, not both")
    kinds = args.kinds or (parse_kinds(sc["kinds"]) if "kinds" in sc else KINDS)
    rpn = args.ranks_per_node or int(sc.get("ranks_per_node", 8))
    budget = args.memory_budget if args.memory_budget is not None else (
        parse_bytes(sc["memory_budget"]) if sc.get("memory_budget") is not None else None)
    bucket = args.bucket_size if args.bucket_size is not None else sc.get("bucket_size")
    leaving = sc.get("leaving", args.leaving) if args.leaving == "planner" else args.leaving
    return dict(name=sc.get("name", f"{model}: {src} -> {dst}"), model=model, src=src, dst=dst,
                world_from=wf, world_to=wt, kinds=kinds, rpn=rpn, budget=budget,
                bucket=bucket, leaving=leaving)


def _layout(text: str, world: Optional[int], which: str) -> Layout:
    lay = Layout.parse(text, world)
    if world is None and "dp" not in text.lower():
        raise LayoutError(f"{which} layout {text!r}: give its world size (--world, "
                          f"--world-{which}) or a dp axis")
    return lay


def plan_report(spec: ModelSpec, src: Layout, dst: Layout, *, kinds=KINDS, rpn: int = 8,
                budget: Optional[int] = None, bucket=None, unit_size=None,
                default_placement: bool = False, leaving: str = "planner",
                links: LinkModel = LinkModel(),
                ckpt: CheckpointModel = CheckpointModel(),
                fabric: Optional[Fabric] = None) -> dict[str, Any]:
    """Everything `dynatrain plan` prints, as a dict (JSON-ready). With `fabric`, also
    the transfer simulated on it (`routing.fabric`), as `simulated_transfer`."""
    t0 = time.perf_counter()
    Wa, Wb = src.world_size, dst.world_size
    if rpn < 1:
        raise RoutingError(f"ranks per node must be >= 1, got {rpn}")
    cand = range(max(Wa, Wb)) if leaving == "planner" else range(Wb)
    ch = placement_choice(spec, src, None, dst, cand, rpn, bucket, kinds, unit_size)
    plan: Plan = ch.default_plan if default_placement else ch.chosen_plan
    ro_placement, ro_plan = best_rank_ordered(ch, rpn)
    sched = build_schedule(plan, budget)
    dsched = build_schedule(ch.default_plan, budget)
    est, dest = estimate(sched, links), estimate(dsched, links)
    plan_seconds = time.perf_counter() - t0
    cp = checkpoint_estimate(spec, ckpt)
    st, ds = plan.stats, ch.default_plan.stats
    bpr = analytic_layout(spec, dst, plan.geometry.bucket_dst).bytes_per_rank()
    dst_state = int(sum(bpr[k] for k in kinds).max())
    out: dict[str, Any] = {
        "model": spec.name, "from": str(src), "to": str(dst), "world_from": Wa,
        "world_to": Wb, "ranks_per_node": rpn, "kinds": list(kinds),
        "placement": "default" if plan.dst_placement == ch.default else "planner",
        # a live switch uses the planner's best placement (any order of global ranks),
        # unless pinned to the default order (--dynatrain-default-placement)
        "live_switch_placement": "default" if default_placement else "best",
        "best_bytes_moved": ch.chosen_stats.moved_bytes,
        "best_rank_ordered_bytes_moved": ro_plan.stats.moved_bytes,
        "best_rank_ordered_is_default": ro_placement == ch.default,
        "best_is_rank_ordered": is_rank_ordered(dst, ch.chosen),
        "placement_devices": list(plan.dst_placement.devices) if Wb <= 64 else None,
        "plan_seconds": plan_seconds,
        "state_bytes_per_kind": {k: v for k, v in st.state_per_kind},
        "bytes_moved": st.moved_bytes, "lower_bound_bytes": st.lower_bound_bytes,
        "bytes_moved_per_kind": st.moved, "local_copy_bytes": st.local_bytes,
        "moved_fraction_optimizer": st.moved_fraction(OPT_KINDS),
        "moved_fraction": st.moved_fraction(kinds),
        "intra_node_bytes": st.intra_node_bytes, "inter_node_bytes": st.inter_node_bytes,
        "max_rank_send_bytes": st.max_send_bytes, "max_rank_recv_bytes": st.max_recv_bytes,
        "max_rank_send_intra_bytes": st.max_send_intra_bytes,
        "max_rank_send_inter_bytes": st.max_send_inter_bytes,
        "max_rank_recv_intra_bytes": st.max_recv_intra_bytes,
        "max_rank_recv_inter_bytes": st.max_recv_inter_bytes,
        "max_rank_traffic_bytes": st.max_traffic_bytes,
        "balance_bound_bytes": st.balance_bound_bytes,
        "num_pieces": st.num_pieces, "num_local_pieces": st.num_local_pieces,
        "rounds": sched.num_rounds, "memory_budget_bytes": budget,
        "peak_extra_bytes_per_rank": sched.max_peak_staging,
        "dst_state_bytes_per_rank": dst_state,
        "estimated_seconds": est.total_seconds,
        "local_copy_seconds": est.local_copy_seconds,
        "bandwidth_lower_bound_seconds": est.bandwidth_lower_bound_seconds,
        "estimated_over_lower_bound": est.ratio_to_lower_bound,
        "network_seconds": est.network_seconds,
        "network_over_lower_bound": est.network_ratio_to_lower_bound,
        "checkpoint_estimate_seconds": cp.total_seconds,
        "checkpoint_state_bytes": cp.state_bytes,
        "checkpoint_write_seconds": cp.write_seconds,
        "checkpoint_read_seconds": cp.read_seconds,
        "checkpoint_restart_seconds": cp.restart_seconds,
        "default_bytes_moved": ds.moved_bytes,
        "default_lower_bound_bytes": ds.lower_bound_bytes,
        "default_moved_fraction_optimizer": ds.moved_fraction(OPT_KINDS),
        "default_max_rank_send_bytes": ds.max_send_bytes,
        "default_max_rank_recv_bytes": ds.max_recv_bytes,
        "default_estimated_seconds": dest.total_seconds,
        "default_bandwidth_lower_bound_seconds": bandwidth_lower_bound(ch.default_plan, links),
        "default_peak_extra_bytes_per_rank": dsched.max_peak_staging,
        "parameters": describe(links, ckpt),
    }
    if fabric is not None:
        if fabric.ranks_per_node != rpn:
            fabric = replace(fabric, ranks_per_node=rpn)
        out["simulated_transfer"] = simulate_transfer(sched, fabric).as_dict()
    return out


def end_to_end(spec: ModelSpec, src: Layout, dst: Layout, r: dict[str, Any], *,
               rpn: int = 8, budget: Optional[int] = None) -> dict[str, Any]:
    """`r` (from `plan_report` with a fabric) with the control plane emulated at its
    world (`bench.control_plane`: per-rank counts of a sample covering every role) and
    the end-to-end budget (`bench.budget`) added, as `control_plane` and `budget`."""
    from ..bench.budget import switch_budget
    from ..bench.control_plane import emulate_switch

    emu = emulate_switch(spec, src, dst, ranks_per_node=rpn, memory_budget=budget, extra=0)
    r["control_plane"] = emu.summary()
    r["budget"] = switch_budget(spec, src, dst, r, r["control_plane"],
                                r.get("simulated_transfer"))
    return r


def format_report(r: dict[str, Any]) -> str:
    p = r["parameters"]
    L = [f"dynatrain plan: {r['model']}  {r['from']} ({r['world_from']} devices) -> "
         f"{r['to']} ({r['world_to']} devices), {r['ranks_per_node']} devices/node, "
         f"kinds {','.join(r['kinds'])}",
         f"planning time           {format_seconds(r['plan_seconds'])} (both layouts, placement, "
         f"plans of both placements, schedule; one core)",
         "state (one copy)        " + ", ".join(f"{k} {format_bytes(v)}" for k, v in
                                                r["state_bytes_per_kind"].items()),
         f"{'':24s}{'chosen placement (' + r['placement'] + ')':>30s}{'default placement':>22s}",
         f"{'bytes moved':24s}{format_bytes(r['bytes_moved']):>30s}{format_bytes(r['default_bytes_moved']):>22s}",
         f"{'lower bound':24s}{format_bytes(r['lower_bound_bytes']):>30s}"
         f"{format_bytes(r['default_lower_bound_bytes']):>22s}",
         f"{'optimizer state moved':24s}{100 * r['moved_fraction_optimizer']:>29.1f}%"
         f"{100 * r['default_moved_fraction_optimizer']:>21.1f}%",
         f"{'max send / rank':24s}{format_bytes(r['max_rank_send_bytes']):>30s}"
         f"{format_bytes(r['default_max_rank_send_bytes']):>22s}",
         f"{'max recv / rank':24s}{format_bytes(r['max_rank_recv_bytes']):>30s}"
         f"{format_bytes(r['default_max_rank_recv_bytes']):>22s}",
         f"{'estimated transfer':24s}{format_seconds(r['estimated_seconds']):>30s}"
         f"{format_seconds(r['default_estimated_seconds']):>22s}",
         f"{'bandwidth lower bound':24s}{format_seconds(r['bandwidth_lower_bound_seconds']):>30s}"
         f"{format_seconds(r['default_bandwidth_lower_bound_seconds']):>22s}",
         f"{'peak extra mem / rank':24s}{format_bytes(r['peak_extra_bytes_per_rank']):>30s}"
         f"{format_bytes(r['default_peak_extra_bytes_per_rank']):>22s}",
         f"bytes moved by order    default {format_bytes(r['default_bytes_moved'])} | best rank-ordered "
         f"{format_bytes(r['best_rank_ordered_bytes_moved'])} | best {format_bytes(r['best_bytes_moved'])}; "
         f"a live switch uses the {r['live_switch_placement']} placement",
         "moved per kind          " + ", ".join(f"{k} {format_bytes(v)}" for k, v in
                                                r["bytes_moved_per_kind"].items()),
         f"max per rank, chosen    send intra {format_bytes(r['max_rank_send_intra_bytes'])} | inter "
         f"{format_bytes(r['max_rank_send_inter_bytes'])};  recv intra "
         f"{format_bytes(r['max_rank_recv_intra_bytes'])} | inter {format_bytes(r['max_rank_recv_inter_bytes'])}",
         f"local copies            {format_bytes(r['local_copy_bytes'])} ({format_seconds(r['local_copy_seconds'])}); "
         f"{r['num_pieces']:,} network + {r['num_local_pieces']:,} local pieces; "
         f"{r['rounds']} round(s)"
         + (f" under a {format_bytes(r['memory_budget_bytes'])} budget" if r["memory_budget_bytes"]
            else ""),
         f"new-layout state / rank {format_bytes(r['dst_state_bytes_per_rank'])} (allocated by the "
         f"switch, not counted as staging)",
         f"estimate / lower bound  {r['estimated_over_lower_bound']:.2f}x (network rounds "
         f"alone: {format_seconds(r['network_seconds'])}, {r['network_over_lower_bound']:.2f}x)",
         f"checkpoint path         {format_seconds(r['checkpoint_estimate_seconds'])} = write "
         f"{format_seconds(r['checkpoint_write_seconds'])} + read {format_seconds(r['checkpoint_read_seconds'])} of "
         f"{format_bytes(r['checkpoint_state_bytes'])} at {p['checkpoint_storage_gbps']:g} GB/s + "
         f"restart {p['checkpoint_restart_seconds']:g} s",
         f"link model              NVLink {p['intra_node_gbps']:g} GB/s, NIC "
         f"{p['inter_node_gbps']:g} GB/s per device and direction (links concurrent), "
         f"{p['round_latency_s'] * 1e6:g} us per round, local copies "
         f"{p['local_copy_gbps']:g} GB/s (spread over the rounds), checksums "
         f"{p['checksum_gbps']:g} GB/s"]
    return "\n".join(L)


def run_plan(args: argparse.Namespace) -> int:
    """Entry point of `dynatrain plan`; returns the exit code (2 on bad input)."""
    try:
        c = _resolve(args)
        spec = load_model(c["model"])
        if c["world_from"] is None and c["world_to"] is not None:
            c["world_from"] = c["world_to"]
        src = _layout(c["src"], c["world_from"], "from")
        dst = _layout(c["dst"], c["world_to"] if c["world_to"] is not None
                      else (src.world_size if "dp" not in c["dst"].lower() else None), "to")
        links = LinkModel(args.intra_node_gbps, args.inter_node_gbps,
                          args.round_latency_us * 1e-6, args.local_copy_gbps,
                          args.checksum_gbps)
        ckpt = CheckpointModel(args.storage_gbps, args.restart_seconds)
        r = plan_report(spec, src, dst, kinds=c["kinds"], rpn=c["rpn"], budget=c["budget"],
                        bucket=c["bucket"], unit_size=args.unit_size,
                        default_placement=args.default_placement, leaving=c["leaving"],
                        links=links, ckpt=ckpt,
                        fabric=Fabric(ranks_per_node=c["rpn"]) if args.json else None)
        if args.json:  # the budget: control plane emulated, transfer simulated
            r = end_to_end(spec, src, dst, r, rpn=c["rpn"], budget=c["budget"])
    except (DynatrainError, argparse.ArgumentTypeError) as e:
        print(f"dynatrain plan: error: {e}", file=sys.stderr)
        return 2
    r["scenario"] = c["name"]
    print(json.dumps(r, indent=1) if args.json else format_report(r))
    return 0
