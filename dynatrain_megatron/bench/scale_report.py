"""docs/bench/scale.md: the end-to-end budget of the 17 planned scenarios, the control
plane's per-rank counts, the transfer simulated on a fabric, its check against our gloo
runs and its sensitivity (written by scripts/bench_reshard.py)."""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from .fabric_check import sensitivity, validate_on_gloo

HOW_COLOURS = {"measured": "tab:green", "modelled": "tab:orange", "simulated": "tab:blue"}


def ms(t: float) -> str:
    """Seconds as milliseconds for a table cell."""
    return f"{t * 1e3:,.1f}"


def table_head(header: str) -> list[str]:
    """A markdown table's first two lines for a `| a | b |` header."""
    return [header, "|" + "---|" * (header.count("|") - 1)]


def gpus(r: dict) -> str:
    """A scenario's device count: `N`, or `N->M` when the switch changes it."""
    return (f"{r['world_from']}" if r["world_from"] == r["world_to"]
            else f"{r['world_from']}->{r['world_to']}")


def _s(t: float) -> str:
    return f"{t:,.2f}"


def _split(r: dict) -> dict:
    """Stall seconds by how they are known."""
    out = {"measured": 0.0, "modelled": 0.0, "simulated": 0.0}
    for t in r["budget"]["terms"]:
        if t["where"] == "stall":
            out[t["how"]] += t["seconds"]
    return out


def budget_table(rows: list[dict]) -> str:
    h = ("| scenario | GPUs | transfer, ideal links (ms) | transfer, simulated (ms) | "
         "stall: measured + modelled + simulated (s) | stall total (s) | of which modelled "
         "padding exchange (s) | background (s) | checkpoint path, modelled (s) |")
    out = table_head(h)
    for r in rows:
        b, sp = r["budget"], _split(r)
        pad = next(t["seconds"] for t in b["terms"] if t["name"] == "vocab-padding exchange")
        out.append(f"| {r['scenario']} | {gpus(r)} | {ms(r['estimated_seconds'])} | "
                   f"{ms(r['simulated_transfer']['seconds'])} | {_s(sp['measured'])} + "
                   f"{_s(sp['modelled'])} + {_s(sp['simulated'])} | {_s(b['stall_seconds'])} "
                   f"| {_s(pad)} | {_s(b['background_seconds'])} | "
                   f"{r['checkpoint_estimate_seconds']:.1f} |")
    return "\n".join(out)


def counts_table(rows: list[dict]) -> str:
    h = ("| scenario | world | new_group calls (non-member) | groups joined | NCCL "
         "communicators | gloo connections at creation | store ops | collectives (world) | "
         "padding exchange per rank (MB) | P2P peers / messages | gloo connections at job "
         "start | sampled ranks | emulation (s) |")
    out = table_head(h)
    for r in rows:
        c = r["control_plane"]
        world_colls = sum(1 for _ in c["switch_world_collective_bytes"])
        pad = (c["switch_world_collective_bytes"].get("all_gather_object", 0)
               or c.get("p2p_padding_bytes", 0))
        out.append(
            f"| {r['scenario']} | {c['world']} | {c['switch_new_group_calls']:,} "
            f"({c['switch_non_member_calls']:,}) | {c['switch_member_groups']} | "
            f"{c['switch_communicators']} | {c['switch_gloo_connections']} | "
            f"{c['switch_store_sets'] + c['switch_store_gets']} | "
            f"{sum(c['switch_collectives'].values())} ({world_colls} kinds) | "
            f"{pad / 1e6:,.2f} | {c['p2p_peers']} / {c['p2p_messages_sent']} | "
            f"{c['start_gloo_connections']:,} | {c['sampled_ranks']} | "
            f"{c['emulation_seconds']:.0f} |")
    return "\n".join(out)


def terms_table(r: dict) -> str:
    out = ["| term | seconds | where | how | basis |", "|---|---|---|---|---|"]
    for t in r["budget"]["terms"]:
        out.append(f"| {t['name']} | {t['seconds']:.4f} | {t['where']} | {t['how']} | "
                   f"{t['basis']} |")
    ck = r["budget"]["checkpoint_path"]
    out.append(f"| checkpoint path (for comparison) | {ck['total_seconds']:.1f} | - | modelled "
               f"| write {ck['write_seconds']:.1f} s + read {ck['read_seconds']:.1f} s + "
               f"restart {ck['restart_seconds']:.0f} s |")
    return "\n".join(out)


def plot(rows: list[dict], out: Path) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    import numpy as np

    names = [r["scenario"] for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(12, 5.5))
    bottom = np.zeros(len(rows))
    for how, col in HOW_COLOURS.items():
        v = np.array([_split(r)[how] for r in rows])
        ax.bar(x, v, 0.6, bottom=bottom, color=col, label=f"stall, {how}")
        bottom += v
    ax.scatter(x, [r["checkpoint_estimate_seconds"] for r in rows], marker="_", s=300,
               color="k", label="checkpoint path (modelled)")
    ax.set_yscale("log")
    ax.set_ylabel("seconds (log)")
    ax.set_xticks(x, names, rotation=35, ha="right", fontsize=8)
    ax.set_title("End-to-end stall of a switch per scenario: measured, modelled and simulated "
                 "parts apart", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    f = out / "scale_budget.png"
    fig.savefig(f, dpi=110)
    plt.close(fig)
    return [f.name]


def write_scale(rows: list[dict], out: Path, val=None, sens=None) -> list[str]:
    """Write docs/bench/scale.md, scale.json and the plot; returns the files made.
    `val`, `sens`: the gloo validation and sensitivity grid, computed unless given."""
    val = validate_on_gloo() if val is None else val
    sens = sens if sens is not None else [
        sensitivity("llama3-70b", "tp8pp4dp4", "tp8pp8dp2", 128),
        sensitivity("qwen3-235b-a22b", "tp4pp2ep32etp1", "tp4pp2ep64etp1", 4096)]
    made = plot(rows, out)
    big = next((r for r in rows if r["world_from"] == 4096 and r["world_to"] == 4096), rows[-1])
    load = os.getloadavg()[0]
    md = [
        "# 70B and 235B at 128-4096 GPUs: the end-to-end switch",
        "",
        "Generated by `python scripts/bench_reshard.py` with `docs/bench/reshard.md` (the "
        "plans). Per scenario: the control plane emulated at its world "
        "(`dynatrain_megatron/bench/control_plane.py`: the project's own group construction, "
        "preparation, votes, switch and release, for a sample of ranks covering every role, "
        "against a recording stand-in for torch.distributed), the transfer simulated on a "
        "fabric (`dynatrain_megatron/routing/fabric.py`: max-min fair flows over a "
        "rail-optimised fat tree, NVLink/NVSwitch in a node, 8 NIC rails, PXN for "
        "cross-rail flows, checksums as their own phase), and the budget "
        "(`dynatrain_megatron/bench/budget.py`) with every term marked measured, modelled or "
        "simulated, in the pause (stall) or in the background. `dynatrain plan --json` "
        "carries the same budget, counts and simulation per scenario.",
        "",
        f"Machine: {platform.machine()}, Python {platform.python_version()}; 1-minute load "
        f"average {load:.0f} when the page was written (the machine is shared: measured "
        "times here are upper figures).",
        "",
        "## Budget per scenario",
        "",
        "Fabric: NVLink 450 GB/s, NIC 50 GB/s per GPU and direction, 32 nodes per leaf, "
        "oversubscription 1x, efficiency 0.8, 50 us per round, 2 us per message. The "
        "'stall' is what the training loop waits for; the background runs while A trains "
        "(the switch lands at the first step boundary after every rank is ready, so it "
        "always fits; the column says how long it is).",
        "",
        budget_table(rows),
        "",
        f"Every term of the largest ({big['scenario']}):",
        "",
        terms_table(big),
        "",
        "## Control plane per rank (emulated)",
        "",
        "Largest value over the sampled ranks, for one switch (B's groups to A's release). "
        "Non-member `new_group` calls are the one count that grows with the world: torch "
        "names a group by a counter every rank advances, so every rank calls for every "
        "group; they create nothing and touch no store. Members: one store operation per "
        "group (the NCCL id written by group rank 0, read by the others). The world-sized "
        "gloo twin of an NCCL job is made once per device set and connects lazily (no "
        "full mesh). The vocab-padding rows travel point to point between their holders "
        "and needers (transition/vocab_padding.py): no collective's bytes grow with the "
        "world. One count still grows at job start: the job's CPU control group "
        "(elastic/communicators.py, a world gloo group) connects its full mesh eagerly. "
        " 'emulation (s)': "
        "the wall time of the scenario's whole emulation (placement, every sampled rank; "
        "the first scenario also imports megatron-core) on this shared 2-core machine.",
        "",
        counts_table(rows),
        "",
        "## The fabric simulation against our gloo runs",
        "",
        "docs/bench/switch.md's three runs re-planned and simulated with each run's own "
        "measured link, round latency and memcpy (`bench/fabric_check.py`):",
        "",
        "| model | rounds | max send / rank: plan vs run (MB) | simulated (ms) | measured "
        "transfer (ms) | measured / simulated | same bytes raw + checksums (ms) | raw / "
        "simulated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in val:
        md.append(f"| {v['model']} | {v['rounds']} | {v['max_send_bytes'] / 1e6:.2f} vs "
                  f"{v['measured_max_send_bytes'] / 1e6:.2f} | {ms(v['simulated_s'])} | "
                  f"{ms(v['measured_transfer_s'])} | {v['measured_over_simulated']:.2f} | "
                  f"{ms(v['measured_raw_checksummed_s'])} | {v['raw_over_simulated']:.2f} |")
    md += ["", "## Sensitivity of the simulated transfer", "",
           "The optimizer state (what a live switch moves), seconds per oversubscription / "
           "link efficiency (busiest link at the start). The time follows 1 / efficiency; "
           "oversubscription changes nothing here: the 70B switch (16 nodes) stays under one "
           "leaf of 32 nodes, and the 235B switch at 4096 is bound by the NVLink ports that "
           "carry cross-rail flows to their rail (PXN), not by the leaves.", ""]
    for s in sens:
        md.append(f"- {s['model']} {s['from']} -> {s['to']} on {s['world']}: " + "; ".join(
            f"{k} {v['seconds'] * 1e3:.1f} ms ({v['busiest_link'].split(' #')[0]})"
            for k, v in s["grid"].items()))
    md += [""] + [f"![{m}]({m})" for m in made]
    (out / "scale.md").write_text("\n".join(md) + "\n")
    slim = [{k: r[k] for k in ("scenario", "file", "world_from", "world_to", "kinds",
                               "estimated_seconds", "simulated_transfer", "control_plane",
                               "budget", "checkpoint_estimate_seconds")} for r in rows]
    (out / "scale.json").write_text(json.dumps({"scenarios": slim, "validation": val,
                                                "sensitivity": sens}, indent=1,
                                               default=float) + "\n")
    return made + ["scale.md", "scale.json"]


__all__ = ["write_scale", "budget_table", "counts_table"]
