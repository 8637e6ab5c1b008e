"""The benchmark's summary: the JSON object of `bench-switch --json` from rank 0's
figures, and its text form."""
from __future__ import annotations

import math
import os
from typing import Any, Optional

from ..units import format_bytes, format_seconds
from .config import BenchConfig
from .measure import median

def summarize(r: dict, cfg: BenchConfig,
              load_average_start: Optional[list[float]] = None) -> dict:
    """The JSON object of `bench-switch --json`, from rank 0's result (`bench_rank`)."""
    fwd, back = r["ours_fwd"], r["ours_back"]
    phases = {k: median([x["phases"][k] for x in fwd]) for k in fwd[0]["phases"]}
    parts = {k: median([x["transfer_parts"][k] for x in fwd]) for k in fwd[0]["transfer_parts"]}
    ours = median([x["pause"] for x in fwd])
    floor = r["max_rank_traffic_bytes"] / (r["link_gbps"] * 1e9)
    transfer = phases.get("transfer")
    s: dict[str, Any] = dict(
        model=cfg.model_name, nproc=cfg.nproc, src=cfg.src, dst=cfg.dst,
        params=r["params"], kinds=r["kinds"], placement=fwd[0]["placement"],
        iters_before=cfg.iters_before, repeat=cfg.repeat,
        memory_budget_bytes=cfg.memory_budget,
        dynatrain_seconds=ours,
        dynatrain_first_seconds=fwd[0]["pause"],
        dynatrain_wall_seconds=median([x["wall"] for x in fwd]),
        dynatrain_switch_seconds=median([x["switch"] for x in fwd]),
        dynatrain_back_seconds=median([x["pause"] for x in back]),
        dynatrain_phases=phases,
        dynatrain_transfer_seconds=transfer,
        dynatrain_transfer_parts=parts,
        dynatrain_pause_runs=[x["pause"] for x in fwd],
        bytes_moved=fwd[0]["bytes_moved"], lower_bound_bytes=fwd[0]["lower_bound"],
        local_copy_bytes=fwd[0]["local"],
        default_placement_bytes_moved=r["default_placement_bytes_moved"],
        best_rank_ordered_bytes_moved=r["best_rank_ordered_bytes_moved"],
        best_placement_bytes_moved=r["best_placement_bytes_moved"],
        state_bytes_moved_kinds=r["state_bytes_moved_kinds"],
        state_bytes_all_kinds=r["state_bytes_all_kinds"],
        max_rank_send_bytes=r["max_rank_send_bytes"], max_rank_recv_bytes=r["max_rank_recv_bytes"],
        per_rank_sent_recv_bytes=r["per_rank_sent_recv_bytes"],
        rounds=fwd[0]["rounds"], num_pieces=r["num_pieces"], num_local_pieces=r["num_local_pieces"],
        peak_extra_bytes=max(x["peak_staging"] for x in fwd + back),
        rss_peak_delta_bytes=(max(x["rss_peak_delta"] for x in fwd)
                              if fwd[0]["rss_peak_delta"] is not None else None),
        rss_after_steps_bytes=r["rss_after_steps_bytes"],
        rss_switch_peak_bytes=max(x["rss_peak"] for x in fwd + back),
        rss_left_by_switch_bytes=max(x["rss_before_gc"] - x["rss_after_gc"] for x in fwd + back),
        gc_after_switch_seconds=median([x["gc_seconds"] for x in fwd + back]),
        link_gbps=r["link_gbps"], link_buffer_bytes=r["link_buffer_bytes"],
        round_latency_seconds=r["round_latency_seconds"], memcpy_gbps=r["memcpy_gbps"],
        floor_seconds=floor,
        transfer_over_floor=_ratio(transfer, floor),
        pause_over_floor=_ratio(ours, floor),
        cost_model_seconds=r["cost_model_seconds"],
        cost_model_network_seconds=r["cost_model_network_seconds"],
        cost_model_lower_bound_seconds=r["cost_model_lower_bound_seconds"],
        raw_movement_seconds=r.get("raw_movement_seconds"),
        raw_movement_checksummed_seconds=r.get("raw_movement_checksummed_seconds"),
        transfer_over_raw=_ratio(transfer, r.get("raw_movement_checksummed_seconds")),
        pause_over_raw=_ratio(ours, r.get("raw_movement_checksummed_seconds")),
        dist_checkpoint_seconds=r.get("dist_checkpoint_seconds"),
        dist_checkpoint_save_seconds=r.get("dist_checkpoint_save_seconds"),
        dist_checkpoint_build_seconds=r.get("dist_checkpoint_build_seconds"),
        dist_checkpoint_load_seconds=r.get("dist_checkpoint_load_seconds"),
        dist_checkpoint_groups_seconds=r.get("dist_checkpoint_groups_seconds"),
        dist_checkpoint_bytes=r.get("checkpoint_bytes"),
        dist_checkpoint_dir=r.get("checkpoint_dir"),
        dist_checkpoint_runs=r.get("checkpoint_repeat"),
        refit_seconds=r.get("refit_seconds"),
        refit_first_seconds=r.get("refit_first_seconds"),
        refit_bytes_moved=r.get("refit_bytes_moved"),
        refit_max_rank_recv_bytes=r.get("refit_max_rank_recv_bytes"),
        losses_before=r["losses_before"], iteration=r["iteration"],
        job_start_seconds=r["job_start_seconds"], bench_seconds=r["bench_seconds"],
        load_average_start=load_average_start, load_average_end=load_average(),
        cpu_count=os.cpu_count(),
    )
    s["prepare"] = cfg.prepare
    if fwd[0]["prepare"]:
        bg = {k: median([x["background"].get(k, 0.0) for x in fwd]) for k in fwd[0]["background"]}
        pr = {k: median([x["prepare"][k] for x in fwd + back]) for k in fwd[0]["prepare"]}
        s.update(prepare_phases=bg, prepare_wall_seconds=pr["wall"],
                 prepare_placement_seconds=pr["placement"], prepare_groups_seconds=pr["groups"],
                 prepare_steps=pr["steps"], step_seconds_alone=pr["step_alone"],
                 step_seconds_during_prepare=pr["step_during"],
                 step_slowdown_during_prepare=_ratio(pr["step_during"], pr["step_alone"]))
    s["checkpoint_over_dynatrain"] = _ratio(s["dist_checkpoint_seconds"], ours)
    s["refit_over_dynatrain"] = _ratio(s["refit_seconds"], ours)
    if s["refit_max_rank_recv_bytes"] is not None:
        s["refit_floor_seconds"] = s["refit_max_rank_recv_bytes"] / (r["link_gbps"] * 1e9)
    return s


def load_average() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None:
        return None
    if b <= 0:
        return math.inf if a > 0 else 1.0
    return a / b


def _x(r) -> str:
    if r is None:
        return "-"
    return f"{r:,.2f}x" if r < 1 else f"{r:,.1f}x"


def format_summary(s: dict) -> str:
    """The summary as the lines `bench-switch` prints without --json."""
    ph = s["dynatrain_phases"]
    la = s.get("load_average_start"), s.get("load_average_end")
    L = [f"dynatrain bench-switch: {s['model']} ({s['params'] / 1e6:,.1f}M params), "
         f"{s['src']} -> {s['dst']} on {s['nproc']} gloo ranks; median of {s['repeat']}; "
         f"kinds moved {','.join(s['kinds'])}",
         f"machine                 {s.get('cpu_count')} CPUs; 1-min load average "
         f"{la[0][0] if la[0] else '-'} at start, {la[1][0] if la[1] else '-'} at end",
         f"link (pairwise P2P)     {s['link_gbps']:.2f} GB/s per rank ({format_bytes(s['link_buffer_bytes'])} "
         f"buffers); small-message round {format_seconds(s['round_latency_seconds'])}; memcpy "
         f"{s['memcpy_gbps']:.2f} GB/s",
         f"(a) dynatrain switch    {format_seconds(s['dynatrain_seconds'])} pause (first "
         f"{format_seconds(s['dynatrain_first_seconds'])}; back B->A {format_seconds(s['dynatrain_back_seconds'])}): "
         f"the switch {format_seconds(s.get('dynatrain_switch_seconds'))}, then releasing A and rebinding "
         f"the trainer",
         "    switch phases       " + ", ".join(f"{k} {format_seconds(v)}" for k, v in ph.items())
         + ("  (groups: built inside the call, not counted)" if "groups" in ph else ""),
         *([f"    prepared meanwhile  {format_seconds(s['prepare_wall_seconds'])} in the background "
            "(placement, groups, then " + ", ".join(f"{k} {format_seconds(v)}" for k, v in
                                                    s["prepare_phases"].items())
            + f") while A trained {s['prepare_steps']:g} step(s) of {format_seconds(s['step_seconds_during_prepare'])}"
            f" ({_x(s['step_slowdown_during_prepare'])} a step alone, {format_seconds(s['step_seconds_alone'])})"]
           if s.get("prepare_phases") is not None else []),
         "    transfer split      " + ", ".join(f"{k} {format_seconds(v)}" for k, v in
                                                s["dynatrain_transfer_parts"].items())
         + "  (each: max over ranks)",
         f"    bytes moved         {format_bytes(s['bytes_moved'])} (lower bound {format_bytes(s['lower_bound_bytes'])}; "
         f"default placement {format_bytes(s['default_placement_bytes_moved'])}; local copies "
         f"{format_bytes(s['local_copy_bytes'])}; placement {s['placement']})",
         f"    by placement        default {format_bytes(s['default_placement_bytes_moved'])} | best "
         f"rank-ordered {format_bytes(s['best_rank_ordered_bytes_moved'])} | best "
         f"{format_bytes(s['best_placement_bytes_moved'])}; this switch used "
         f"{'the default order' if s['placement'] == 'default' else 'the best placement'}",
         f"    max per rank        send {format_bytes(s['max_rank_send_bytes'])}, recv "
         f"{format_bytes(s['max_rank_recv_bytes'])}; {s['num_pieces']:,} network + "
         f"{s['num_local_pieces']:,} local pieces in {s['rounds']} round(s); peak extra (staging) "
         f"{format_bytes(s['peak_extra_bytes'])}"
         + (f" under a {format_bytes(s['memory_budget_bytes'])} budget" if s["memory_budget_bytes"] else "")
         + (f"; RSS per rank {format_bytes(s['rss_after_steps_bytes'])} before, peak delta "
            f"{format_bytes(s['rss_peak_delta_bytes'])} (B's state + staging)"
            if s["rss_peak_delta_bytes"] is not None else ""),
         f"    memory              largest rank RSS {format_bytes(s['rss_switch_peak_bytes'])} at peak; "
         f"{format_bytes(s['rss_left_by_switch_bytes'])} of the old layout still held after a switch until "
         f"gc.collect() ({format_seconds(s['gc_after_switch_seconds'])}, outside the pause)",
         f"    floor               {format_seconds(s['floor_seconds'])} (max per-rank bytes / link); transfer "
         f"{format_seconds(s['dynatrain_transfer_seconds'])} = {_x(s['transfer_over_floor'])} the floor, "
         f"pause {_x(s['pause_over_floor'])}",
         f"    cost model          {format_seconds(s['cost_model_seconds'])} predicted for the transfer "
         f"(link {s['link_gbps']:.2f} GB/s, round {format_seconds(s['round_latency_seconds'])}, memcpy "
         f"{s['memcpy_gbps']:.2f} GB/s; its lower bound {format_seconds(s['cost_model_lower_bound_seconds'])})"]
    if s.get("raw_movement_seconds") is not None:
        L.append(f"    same bytes, raw     {format_seconds(s['raw_movement_seconds'])} (one message per peer, "
                 f"the local bytes in one memcpy meanwhile), "
                 f"{format_seconds(s['raw_movement_checksummed_seconds'])} with checksums; transfer "
                 f"{_x(s['transfer_over_raw'])} that, pause {_x(s['pause_over_raw'])}")
    if s["dist_checkpoint_seconds"] is not None:
        L.append(f"(b) dist_checkpointing  {format_seconds(s['dist_checkpoint_seconds'])} = save "
                 f"{format_seconds(s['dist_checkpoint_save_seconds'])} + build B "
                 f"{format_seconds(s['dist_checkpoint_build_seconds'])} + load "
                 f"{format_seconds(s['dist_checkpoint_load_seconds'])} ({format_bytes(s['dist_checkpoint_bytes'])} in "
                 f"{s['dist_checkpoint_dir']}; B's groups {format_seconds(s['dist_checkpoint_groups_seconds'])} "
                 f"and process restart not counted; median of {s.get('dist_checkpoint_runs')} "
                 f"run(s))  = {_x(s['checkpoint_over_dynatrain'])} ours")
    else:
        L.append("(b) dist_checkpointing  skipped")
    if s["refit_seconds"] is not None:
        L.append(f"(c) megatron refit      {format_seconds(s['refit_seconds'])} weights only, cached plan "
                 f"(first call with planning {format_seconds(s['refit_first_seconds'])}); "
                 f"{format_bytes(s['refit_bytes_moved'])} moved, max {format_bytes(s['refit_max_rank_recv_bytes'])} "
                 f"per rank (floor {format_seconds(s.get('refit_floor_seconds'))})  = "
                 f"{_x(s['refit_over_dynatrain'])} ours")
    else:
        L.append("(c) megatron refit      skipped")
    return "\n".join(L)
