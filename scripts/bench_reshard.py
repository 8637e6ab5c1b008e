#!/usr/bin/env python
"""Resharding benchmark at 70B / 235B scale: every scenario of configs/scenarios, planned.

For each scenario (cold caches, one core): plan both layouts, choose the placement, plan
the default placement too, schedule, and estimate the switch under the link model next
to its bandwidth lower bound and the checkpoint path. Writes docs/bench/reshard.md (the
table), docs/bench/reshard.json (every figure), and, when matplotlib is importable,
docs/bench/reshard_times.png (estimate vs lower bound vs checkpoint, per scenario) and
docs/bench/reshard_heatmap.png (bytes between nodes, default vs chosen placement, for
one scenario).

    python scripts/bench_reshard.py [--scenarios GLOB] [--out docs/bench]
        [--heatmap llama70b-pp4-to-pp8] [--repeat 1]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynatrain_megatron.cli.plan import end_to_end, parse_kinds, plan_report  # noqa: E402
from dynatrain_megatron.routing.fabric import Fabric  # noqa: E402
from dynatrain_megatron.bench.scale_report import gpus, ms, table_head, write_scale  # noqa: E402
from dynatrain_megatron.configs import configs_dir, load_model  # noqa: E402
from dynatrain_megatron.routing import clear_caches, placement_choice  # noqa: E402
from dynatrain_megatron.routing.cost import CheckpointModel, estimate  # noqa: E402
from dynatrain_megatron.routing.links import LinkModel  # noqa: E402
from dynatrain_megatron.routing.schedule import build_schedule  # noqa: E402
from dynatrain_megatron.units import parse_bytes  # noqa: E402
from dynatrain_megatron.vps.fragment import KINDS  # noqa: E402
from dynatrain_megatron.vps.layout import Layout  # noqa: E402

import yaml  # noqa: E402


def load(path: Path) -> dict:
    d = yaml.safe_load(path.read_text())
    d["file"] = path.stem
    return d


def run(sc: dict, repeat: int, emulate: bool = True) -> dict:
    spec = load_model(sc["model"])
    wf = sc.get("world_from", sc.get("world"))
    wt = sc.get("world_to", sc.get("world"))
    src, dst = Layout.parse(sc["from"], wf), Layout.parse(sc["to"], wt)
    kinds = parse_kinds(sc["kinds"]) if "kinds" in sc else KINDS
    budget = parse_bytes(sc["memory_budget"]) if sc.get("memory_budget") else None
    best = None
    for _ in range(repeat):
        clear_caches()
        r = plan_report(spec, src, dst, kinds=kinds, rpn=int(sc.get("ranks_per_node", 8)),
                        budget=budget, bucket=sc.get("bucket_size"),
                        leaving=sc.get("leaving", "planner"),
                        fabric=Fabric(ranks_per_node=int(sc.get("ranks_per_node", 8))))
        if best is None or r["plan_seconds"] < best["plan_seconds"]:
            best = r
    best["scenario"], best["file"] = sc.get("name", sc["file"]), sc["file"]
    # balance: the rounds without checksums over the bandwidth lower bound (same plan;
    # not timed, the geometry is cached)
    wmax = max(src.world_size, dst.world_size)
    cand = range(wmax) if sc.get("leaving", "planner") == "planner" else range(dst.world_size)
    ch = placement_choice(spec, src, None, dst, cand, int(sc.get("ranks_per_node", 8)),
                          sc.get("bucket_size"), kinds)
    e = estimate(build_schedule(ch.chosen_plan, budget), LinkModel(), checksums=False)
    best["network_no_checksum_seconds"] = e.network_seconds
    best["balance"] = e.network_ratio_to_lower_bound
    if emulate:  # the control plane emulated at this world, and the end-to-end budget
        load0 = os.getloadavg()[0]
        end_to_end(spec, src, dst, best, rpn=int(sc.get("ranks_per_node", 8)), budget=budget)
        best["emulation_load"] = [load0, os.getloadavg()[0]]
    return best


def rebudget(rows: list[dict], scs: list[dict], reference: Optional[Path]) -> None:
    """The budget of every row again, with this code's `bench.budget`, from the row's own
    emulated counts and simulated transfer. The placement choice is the best cold planning
    time of the row's run and `reference`'s (a previous reshard.json), kept apart as
    `plan_seconds_runs`."""
    from dynatrain_megatron.bench.budget import switch_budget

    ref = ({r["file"]: r["plan_seconds"] for r in json.loads(reference.read_text())}
           if reference is not None and reference.is_file() else {})
    by_file = {s["file"]: s for s in scs}
    for r in rows:
        sc = by_file[r["file"]]
        wf, wt = sc.get("world_from", sc.get("world")), sc.get("world_to", sc.get("world"))
        runs = [r["plan_seconds"]] + ([ref[r["file"]]] if r["file"] in ref else [])
        r["plan_seconds_runs"] = runs
        best = dict(r, plan_seconds=min(runs))
        r["budget"] = switch_budget(load_model(sc["model"]), Layout.parse(sc["from"], wf),
                                    Layout.parse(sc["to"], wt), best, r.get("control_plane"),
                                    r.get("simulated_transfer"))


def _gb(b: float) -> str:
    return f"{b / 1e9:,.1f}"


def table(rows: list[dict]) -> str:
    h = ("| scenario | GPUs | kinds | plan (s) | moved (GB) | = lower bound | optimizer state "
         "moved: chosen / default | max send / recv per GPU (GB) | transfer, modelled (ms) | "
         "network (ms) | bandwidth LB (ms) | network / LB | transfer / LB | balance | "
         "checkpoint path, modelled (s) |")
    out = table_head(h)
    for r in rows:
        kinds = "all" if len(r["kinds"]) == 4 else ",".join(r["kinds"])
        eq = "yes" if r["bytes_moved"] == r["lower_bound_bytes"] else "NO"
        lb = r["bandwidth_lower_bound_seconds"]
        out.append(
            f"| {r['scenario']} | {gpus(r)} | {kinds} | {r['plan_seconds']:.3f} | "
            f"{_gb(r['bytes_moved'])} | {eq} | {100 * r['moved_fraction_optimizer']:.1f}% / "
            f"{100 * r['default_moved_fraction_optimizer']:.1f}% | "
            f"{_gb(r['max_rank_send_bytes'])} / {_gb(r['max_rank_recv_bytes'])} | "
            f"{ms(r['estimated_seconds'])} | {ms(r['network_seconds'])} | {ms(lb)} | "
            + (f"{r['network_over_lower_bound']:.2f} | {r['estimated_over_lower_bound']:.2f} | "
               f"{r['balance']:.3f}" if lb > 0 else "- | - | -")
            + f" | {r['checkpoint_estimate_seconds']:.1f} |")
    return "\n".join(out)


def node_matrix(plan) -> np.ndarray:
    src, dst, kind, el = plan.flows()
    isz = np.array([plan.itemsize(k) for k in KINDS])[kind]
    rpn = plan.ranks_per_node
    n = (max(max(plan.src_devices), max(plan.dst_devices)) // rpn) + 1
    m = np.zeros((n, n))
    np.add.at(m, (src // rpn, dst // rpn), el * isz)
    return m


def plots(rows: list[dict], heat: dict, out: Path) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm
    except ImportError:
        print("matplotlib not importable: no plots (pip install matplotlib)")
        return []
    made = []
    names = [r["scenario"] for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(12, 5.5))
    w = 0.27
    # nothing to move over the network: no lower-bound bar (log axis)
    est = [r["estimated_seconds"] or np.nan for r in rows]
    lb = [r["bandwidth_lower_bound_seconds"] or np.nan for r in rows]
    ck = [r["checkpoint_estimate_seconds"] for r in rows]
    ax.bar(x - w, est, w, label="dynatrain transfer, modelled (local copies + rounds)")
    ax.bar(x, lb, w, label="bandwidth lower bound (network)")
    ax.bar(x + w, ck, w, label="checkpoint path, modelled (write + read + assumed restart)")
    ax.set_yscale("log")
    ax.set_ylabel("seconds (log)")
    ax.set_xticks(x, names, rotation=35, ha="right", fontsize=8)
    p = rows[0]["parameters"]
    ax.set_title(f"Modelled transfer per scenario, no GPU measurement (NVLink {p['intra_node_gbps']:g} GB/s, "
                 f"NIC {p['inter_node_gbps']:g} GB/s per GPU; storage "
                 f"{p['checkpoint_storage_gbps']:g} GB/s, restart "
                 f"{p['checkpoint_restart_seconds']:g} s)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    f = out / "reshard_times.png"
    fig.savefig(f, dpi=110)
    plt.close(fig)
    made.append(f.name)
    if heat:
        fig, axs = plt.subplots(1, 2, figsize=(12, 5.4))
        mats = [heat["default"], heat["chosen"]]
        vmax = max(m.max() for m in mats)
        vmin = max(min(m[m > 0].min() for m in mats if (m > 0).any()), vmax * 1e-6) \
            if any((m > 0).any() for m in mats) else 1
        for a, m, t in zip(axs, mats, ("default placement", "chosen placement")):
            mm = np.where(m > 0, m, np.nan) / 1e9
            im = a.imshow(mm, norm=LogNorm(vmin=vmin / 1e9, vmax=vmax / 1e9), cmap="viridis")
            a.set_title(f"{t}: {np.nansum(mm):,.1f} GB over the network", fontsize=10)
            a.set_xlabel("destination node")
            a.set_ylabel("source node")
        fig.colorbar(im, ax=axs, label="GB from node to node")
        fig.suptitle(f"Bytes between nodes: {heat['name']}", fontsize=11)
        f = out / "reshard_heatmap.png"
        fig.savefig(f, dpi=110)
        plt.close(fig)
        made.append(f.name)
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default=str(configs_dir() / "scenarios" / "*.yaml"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    ap.add_argument("--heatmap", default="llama70b-pp4-to-pp8",
                    help="scenario file stem for the node heat map")
    ap.add_argument("--repeat", type=int, default=1, help="best of N cold runs")
    ap.add_argument("--no-emulation", action="store_true",
                    help="skip the control-plane emulation and budget (docs/bench/scale.md)")
    ap.add_argument("--from-json", default=None, metavar="FILE",
                    help="re-render the table and plots from a previous run's reshard.json "
                         "(no planning; the heat map's scenario is planned again)")
    ap.add_argument("--rebudget", default=None, metavar="FILE",
                    help="with --from-json: the budget again with this code, and only "
                         "docs/bench/scale.md written (the placement choice: the best of "
                         "the run's and FILE's planning time)")
    ap.add_argument("--timing", default=None, metavar="FILE",
                    help="with --rebudget: a dedicated run's reshard.json (one scenario, "
                         "emulated alone) whose emulation time and load the page reports")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(Path().glob(a.scenarios) if not Path(a.scenarios).is_absolute()
                   else Path("/").glob(a.scenarios.lstrip("/")))
    scs = [load(f) for f in files]
    scs.sort(key=lambda s: (s["model"], s["file"]))
    rows = json.loads(Path(a.from_json).read_text()) if a.from_json else []
    if a.rebudget:
        if not a.from_json:
            ap.error("--rebudget needs --from-json (a run with its control-plane counts)")
        rebudget(rows, scs, Path(a.rebudget))
        # the fabric's validation and sensitivity do not depend on the budget: the run's own
        prev = Path(a.from_json).with_name("scale.json")
        kept = json.loads(prev.read_text()) if prev.is_file() else {}
        timing = None
        if a.timing:
            t = json.loads(Path(a.timing).read_text())[0]
            timing = {"scenario": t["scenario"], "load": t["emulation_load"],
                      "seconds": t["control_plane"]["emulation_seconds"]}
        made = write_scale(rows, out, kept.get("validation"), kept.get("sensitivity"), timing)
        print("wrote " + ", ".join(str(out / m) for m in made))
        return
    for sc in ([] if a.from_json else scs):
        r = run(sc, a.repeat, not a.no_emulation)
        rows.append(r)
        print(f"{r['scenario']:42s} plan {r['plan_seconds']:.3f} s  est "
              f"{ms(r['estimated_seconds'])} ms  LB {ms(r['bandwidth_lower_bound_seconds'])} "
              f"ms  opt moved {100 * r['moved_fraction_optimizer']:.1f}% (default "
              f"{100 * r['default_moved_fraction_optimizer']:.1f}%)", flush=True)
    heat = {}
    hs = [s for s in scs if s["file"] == a.heatmap]
    if hs:
        sc = hs[0]
        spec = load_model(sc["model"])
        wf, wt = sc.get("world_from", sc.get("world")), sc.get("world_to", sc.get("world"))
        ch = placement_choice(spec, Layout.parse(sc["from"], wf), None,
                              Layout.parse(sc["to"], wt), range(max(wf, wt)))
        heat = {"name": sc.get("name", sc["file"]), "default": node_matrix(ch.default_plan),
                "chosen": node_matrix(ch.chosen_plan)}
    made = plots(rows, heat, out)
    p = rows[0]["parameters"] if rows else {}
    lm, cm = LinkModel(), CheckpointModel()
    md = [
        "# Resharding benchmark: planned switches at 70B and 235B scale",
        "",
        "Generated by `python scripts/bench_reshard.py` (scenarios: `configs/scenarios/`). "
        "**Modelled, not measured**: only the planning time and the bytes are computed; the "
        "transfer and checkpoint-path times come from the link and storage models below, "
        "and no GPU cluster has run these switches. 'transfer' is the data movement alone: "
        "a switch's pause also holds the votes and the commit, and its preparation (B's "
        "groups and objects) runs beside training. "
        "Planning time is measured cold (all caches cleared), on one core of "
        f"`{platform.processor() or platform.machine()}`, Python {platform.python_version()}; "
        "it covers both analytic layouts, the placement choice, the plans of the chosen and "
        "the default placement, and the schedule.",
        "",
        f"Link model: NVLink {p.get('intra_node_gbps', lm.intra_node_gbps):g} GB/s and NIC "
        f"{p.get('inter_node_gbps', lm.inter_node_gbps):g} GB/s per GPU and direction, the two "
        "links concurrent (a GPU's time is the max over its links of max(send, recv) / "
        f"bandwidth), a round takes its slowest GPU plus "
        f"{p.get('round_latency_s', lm.round_latency_s) * 1e6:g} us; local copies at "
        f"{p.get('local_copy_gbps', lm.local_copy_gbps):g} GB/s, spread over the rounds "
        "(each share while its round is on the wire); "
        f"every byte sent and received is checksummed at "
        f"{p.get('checksum_gbps', lm.checksum_gbps):g} GB/s. Checkpoint path: write + "
        f"read of the full state at {p.get('checkpoint_storage_gbps', cm.storage_gbps):g} GB/s "
        f"aggregate + an assumed {p.get('checkpoint_restart_seconds', cm.restart_seconds):g} "
        "s restart, a model with no measurement behind it. "
        "The bandwidth lower bound covers the network only (see "
        "`dynatrain_megatron/routing/cost.py`); `transfer / LB` includes the local copies and "
        "checksums, `network / LB` the rounds (with checksums) alone, `balance` the rounds "
        "without checksums (the source choice alone) over the bound. 'moved' counts network bytes; '= lower bound' says whether "
        "they equal the bytes whose destination GPU does not already hold them. The "
        "optimizer-state percentage is relative to one copy of main params + Adam moments "
        "(TP-replicated tensors keep one optimizer copy per TP rank, so it can exceed 100%).",
        "",
        table(rows),
        "",
    ]
    md += [f"![{m}]({m})" for m in made]
    (out / "reshard.md").write_text("\n".join(md) + "\n")
    (out / "reshard.json").write_text(json.dumps(rows, indent=1, default=float) + "\n")
    if not a.no_emulation and rows and all("budget" in r for r in rows):
        made += write_scale(rows, out)
    print(f"wrote {out / 'reshard.md'}, {out / 'reshard.json'}"
          + "".join(f", {out / m}" for m in made))


if __name__ == "__main__":
    main()
