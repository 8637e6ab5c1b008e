"""docs/bench/scale.md: the end-to-end budget of the 17 planned scenarios, the control
plane's per-rank counts, the transfer simulated on a fabric, its check against our gloo
runs and its sensitivity (written by scripts/bench_reshard.py)."""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Optional

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
    """Stall seconds by how they are known (terms that apply in every case)."""
    out = {"measured": 0.0, "modelled": 0.0, "simulated": 0.0}
    for t in r["budget"]["terms"]:
        if t["where"] == "stall" and not t.get("when"):
            out[t["how"]] += t["seconds"]
    return out


def _term(r: dict, name: str) -> float:
    return next((t["seconds"] for t in r["budget"]["terms"] if t["name"] == name), 0.0)


GLOO_TERMS = ("memory check", "ready votes while B is prepared",
              "votes (ready, preparation, prepare, commit)",
              "Megatron-LM's counters and the data iterators taken")


def budget_table(rows: list[dict]) -> str:
    h = ("| scenario | GPUs | transfer, ideal links (ms) | transfer, simulated (ms) | "
         "stall: measured + modelled + simulated (s) | stall total (s) | of which gloo votes, "
         "modelled (s) | of which first step at B, assumed (s) | background (s) / steps of A "
         "| after B's first steps (s) | checkpoint path, modelled (s) |")
    out = table_head(h)
    for r in rows:
        b, sp = r["budget"], _split(r)
        gloo = sum(_term(r, n) for n in GLOO_TERMS)
        out.append(f"| {r['scenario']} | {gpus(r)} | {ms(r['estimated_seconds'])} | "
                   f"{ms(r['simulated_transfer']['seconds'])} | {_s(sp['measured'])} + "
                   f"{_s(sp['modelled'])} + {_s(sp['simulated'])} | {_s(b['stall_seconds'])} "
                   f"| {_s(gloo)} | {_s(_term(r, 'first step at B (extra)'))} | "
                   f"{_s(b['background_seconds'])} / {b['background_steps_of_a']} | "
                   f"{_s(b.get('after_seconds', 0.0))} | "
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
    out = ["| term | seconds | where | how | basis | only when |", "|---|---|---|---|---|---|"]
    for t in r["budget"]["terms"]:
        out.append(f"| {t['name']} | {t['seconds']:.4f} | {t['where']} | {t['how']} | "
                   f"{t['basis']} | {t.get('when') or '-'} |")
    ck = r["budget"]["checkpoint_path"]
    out.append(f"| checkpoint path (for comparison) | {ck['total_seconds']:.1f} | - | modelled "
               f"| write {ck['write_seconds']:.1f} s + read {ck['read_seconds']:.1f} s + "
               f"restart {ck['restart_seconds']:.0f} s | - |")
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


def _range(v: list[float], fmt: str) -> str:
    lo, hi = min(v), max(v)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else \
        f"{format(lo, fmt)}-{format(hi, fmt)}"


def readme_lines(rows: list[dict]) -> list[str]:
    """The README's performance rows for these scenarios, from this table (each labelled)."""
    out = []
    for model, label in (("llama3-70b", "Llama-3-70B, 128 GPUs"),
                         ("qwen3-235b-a22b", "Qwen3-235B, 256-4096 GPUs")):
        rs = [r for r in rows if r.get("model") == model]
        if not rs:
            continue
        sim = [r["simulated_transfer"]["seconds"] * 1e3 for r in rs]
        ck = [r["checkpoint_estimate_seconds"] for r in rs]
        out.append(f"| {label} ({len(rs)} scenarios) | **simulated** transfer on a fat tree | "
                   f"{_range(sim, '.1f')} ms transfer | {_range(ck, '.0f')} s checkpoint path, "
                   f"**modelled** | - |")
    loop = [r for r in rows if set(r.get("kinds", ())) != {"param"}]
    if loop:
        st = [r["budget"]["stall_seconds"] for r in loop]
        fs = [_term(r, "first step at B (extra)") for r in loop]
        gl = [sum(_term(r, n) for n in GLOO_TERMS) for r in loop]
        bg = [r["budget"]["background_seconds"] for r in loop]
        out.append(f"| both, end to end (stall per training-loop switch) | **modelled** | "
                   f"{_range(st, '.1f')} s, of which {_range(fs, '.0f')} s an assumed first "
                   f"step at B and {_range(gl, '.2f')} s gloo votes; {_range(bg, '.1f')} s "
                   f"prepared in the background | - | - |")
    return out


def write_scale(rows: list[dict], out: Path, val=None, sens=None,
                timing: Optional[dict] = None) -> list[str]:
    """Write docs/bench/scale.md, scale.json and the plot; returns the files made.
    `val`, `sens`: the gloo validation and sensitivity grid, computed unless given;
    `timing`: a dedicated run of the largest emulation (scenario, seconds, load)."""
    val = validate_on_gloo() if val is None else val
    sens = sens if sens is not None else [
        sensitivity("llama3-70b", "tp8pp4dp4", "tp8pp8dp2", 128),
        sensitivity("qwen3-235b-a22b", "tp4pp2ep32etp1", "tp4pp2ep64etp1", 4096)]
    made = plot(rows, out)
    big = next((r for r in rows if r["world_from"] == 4096 and r["world_to"] == 4096), rows[-1])
    b0 = big["budget"]
    loads = [x for r in rows for x in r.get("emulation_load", [])]
    load = (f"1-minute load average {min(loads):.0f}-{max(loads):.0f} while the scenarios "
            "were emulated" if loads else
            f"1-minute load average {os.getloadavg()[0]:.0f} when the page was written")
    runs = [r.get("plan_seconds_runs") for r in rows if r.get("plan_seconds_runs")]
    plan_note = ("The placement-choice term is the best of two cold planning runs (this run's "
                 "and docs/bench/reshard.json's; both in scale.json as `plan_seconds_runs`). "
                 if runs else "")
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
        "(`dynatrain_megatron/bench/budget.py`) with every term marked measured (where), "
        "modelled (its formula and constants) or simulated, and placed in the stall, in the "
        "background or after B's first steps. `dynatrain plan --json` carries the same "
        "budget, counts and simulation per scenario. `--from-json reshard.json --rebudget "
        "OLD.json` recomputes the budget from a run's counts without emulating again.",
        "",
        f"Machine: {platform.machine()}, Python {platform.python_version()}; {load} (2 cores "
        "shared with other jobs: measured times here are upper figures)."
        + (f" The largest emulation ({timing['scenario']}) alone: "
           f"{timing['seconds']:.0f} s, load average {timing['load'][0]:.0f} at its start and "
           f"{timing['load'][1]:.0f} at its end." if timing else ""),
        "",
        "## Budget per scenario",
        "",
        "What is budgeted: a **requested** switch (signal file, automatic layout, growth) "
        "inside Megatron-LM's training loop on a **GPU job** (NCCL; its memory check is on "
        "by default, so B's placement is chosen on the training thread when the request is "
        "accepted). The **stall** is what the training thread waits for: at that decision "
        "step, at every step boundary while B is prepared (a ready vote), at the switch, and "
        "in B's first step. The **background** is the preparation thread "
        "(`elastic/device_manager.DeviceManager.prepare`) while A trains: B's placement where "
        "no memory check needs it first, B's groups and communicators, B's objects, **B's "
        "data iterators** (`megatron_lm/data_ahead.DataAhead.build`: built at the "
        "consumed-sample count of the last step boundary and advanced at the switch by what "
        "A consumed since, which is in the stall; a scheduled switch's are built at its own "
        "count), the binding and checks. A requested switch lands at the first step "
        "boundary after the background is done everywhere, so the background always fits: "
        "the column gives its time and the steps of A it spans (advisor step time, global "
        "batch 1024 of 4096 tokens); a scheduled switch announced fewer steps ahead waits "
        "for the rest (a conditional term). How much the background slows A's steps (host "
        "CPU and the interpreter lock; 1.95x on 2 CPU cores, docs/bench/stall.md) is not "
        "modelled. Conditional terms (an evaluation between the build and the switch makes "
        "B's data iterators built in the pause) are listed, not summed. **After B's first "
        "steps** the training thread finishes A's release (its groups' destroy; A's tensors "
        "were freed in the pause, in place). RLHF "
        "rows are weights-only switches (`api.ElasticJob.weights_to`), outside the training "
        "loop: its terms are none there. " + plan_note,
        "",
        "Fabric: NVLink 450 GB/s, NIC 50 GB/s per GPU and direction, 32 nodes per leaf, "
        "oversubscription 1x, efficiency 0.8, 50 us per round, 2 us per message. The votes "
        "run on the job's CPU control group (gloo, over the world): gloo's all-reduce is a "
        "ring, 2 (n - 1) hops one after the other, so each vote costs ~0.16 s at 4096 ranks "
        "(20 us a hop, assumed).",
        "",
        budget_table(rows),
        "",
        f"Every term of the largest ({big['scenario']}; step of A {b0['step_a_seconds']:.2f} s, "
        f"background over {b0['background_steps_of_a']} step(s), B's data iterators advanced "
        f"by {b0.get('skipped_steps', '?')} step(s)):",
        "",
        terms_table(big),
        "",
        "## The README's performance rows, from this table",
        "",
        "| job | where | in memory | Megatron-LM's way | |",
        "|---|---|---|---|---|",
        *readme_lines(rows),
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
        "world (tests/test_control_plane.py, 256 against 4096 ranks). One count still "
        "grows at job start: the job's CPU control group (elastic/communicators.py, a world "
        "gloo group) connects its full mesh eagerly. Not emulated: Megatron-LM's adapter "
        "(`megatron_lm/adapter.rebind_loop`: one more gloo vote, budgeted) and B's data "
        "iterators. 'emulation (s)': the wall time of the scenario's whole emulation "
        "(placement, every sampled rank; the first scenario also imports megatron-core) on "
        "this shared 2-core machine.",
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
    keys = ("scenario", "file", "model", "world_from", "world_to", "kinds", "estimated_seconds",
            "simulated_transfer", "control_plane", "budget", "checkpoint_estimate_seconds",
            "plan_seconds_runs", "emulation_load")
    slim = [{k: r[k] for k in keys if k in r} for r in rows]
    shared = {}
    for r in slim:  # the same constants and their sources in every row: kept once
        r["budget"] = {k: v for k, v in r["budget"].items()
                       if k not in ("constants", "sources") or shared.setdefault(k, v) != v}
    (out / "scale.json").write_text(json.dumps({"scenarios": slim, "validation": val,
                                                "sensitivity": sens, "timing": timing,
                                                "budget_constants": shared},
                                               indent=1,
                                               default=float) + "\n")
    return made + ["scale.md", "scale.json"]


__all__ = ["write_scale", "budget_table", "counts_table"]
