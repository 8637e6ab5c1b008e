"""`dynatrain suggest`: the fastest layouts of N devices for a model that fit a device.

    dynatrain suggest --model llama3-70b --world 128 --device-memory 80GB
    dynatrain suggest --model llama3-70b --world 96 --from tp8pp4dp3 --global-batch-size 480
    dynatrain suggest --model qwen3-235b-a22b --world 256 --measured-step tp4pp4ep8etp1dp16=9.1

Enumerates every layout of N devices the job's own validator accepts, keeps those whose
peak memory per device (exact training state + modelled activations + reserve) fits, and
ranks them by the estimated step time (dynatrain_megatron/advisor; README, "Choosing the
layout", states every constant and its source). With `--from`, each row adds the switch
cost from the current layout (planner bytes, estimated seconds) and the steps after which
the switch pays for itself. Self-contained: only `add_parser(sub)` is imported by the CLI.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Optional

from ..advisor.calibration import (GiB, Calibration, Measurement, Workload, describe,
                                   load_calibration)
from ..advisor.enumerate import SearchSpace
from ..advisor.suggest import Suggestion, suggest
from ..configs import load_model as resolve_model
from ..units import format_bytes, parse_bytes
from ..vps.errors import DynatrainError
from ..vps.layout import Layout
from .common import devices, finite_float, int_at_least, renamed, subcommand

# flag -> Calibration field (flags default to None: the file, then the dataclass default)
_POSITIVE = finite_float(0.0)
_CAL_FLAGS = {
    "achieved_tflops": ("--achieved-tflops", _POSITIVE, "TFLOP/S",
                        "achieved bf16 matmul TFLOP/s per device (400: ~40%% MFU of an "
                        "H100's 989)"),
    "intra_node_gbps": ("--intra-node-gbytes-per-s", _POSITIVE, "GB/S",
                        "NVLink bandwidth per device and direction, gigabytes/s (450)"),
    "inter_node_gbps": ("--inter-node-gbytes-per-s", _POSITIVE, "GB/S",
                        "NIC bandwidth per device and direction, gigabytes/s (50: a 400 Gb/s "
                        "NIC)"),
    "ranks_per_node": ("--ranks-per-node", devices(), "DEVICES", "devices per node (8)"),
    "collective_latency_us": ("--collective-latency-us", finite_float(0.0, inclusive=True),
                              "US", "fixed cost of one ring step of a collective, "
                                    "microseconds (10)"),
    "grad_bytes": ("--grad-bytes", int_at_least(1), "BYTES",
                   "bytes of a gradient element (4: fp32 main grads)"),
    "activation_bytes": ("--activation-bytes", int_at_least(1), "BYTES",
                         "bytes of an activation element (2: bf16)"),
    "reserve_bytes": ("--reserve-bytes", parse_bytes, "BYTES",
                      "memory kept free per device, e.g. 6GiB (6GiB)"),
    "dp_overlap": ("--dp-overlap", finite_float(0.0, inclusive=True, high=1.0), "FRACTION",
                   "fraction of DP grad reduce / param gather hidden by compute, 0..1 (0)"),
    "step_scale": ("--step-scale", _POSITIVE, "FACTOR",
                   "factor on every step time (1; fitted by --measured-step)"),
}


def add_parser(sub) -> argparse.ArgumentParser:
    p = subcommand(sub, "suggest", help="rank the layouts of N devices for a model",
                   description=__doc__.split("\n\n")[0],
                   examples=["dynatrain suggest --model llama3-70b --world 128 "
                             "--global-batch-size 512 --top 5",
                             "dynatrain suggest --model llama3-70b --world 96 --from tp8pp4dp3 "
                             "--global-batch-size 480 --top 5   # + switch cost",
                             "dynatrain suggest --model qwen3-235b-a22b --world 256 "
                             "--measured-step tp4pp4ep8etp1dp16=9.1"])
    p.add_argument("--model", required=True, metavar="NAME|YAML",
                   help="a name in configs/models or a YAML path")
    p.add_argument("--world", type=devices(), required=True, metavar="DEVICES",
                   help="number of devices")
    p.add_argument("--from", dest="current", default=None, metavar="LAYOUT",
                   help="current layout (with its dp axis, or of --world devices): adds the "
                        "switch cost and payback to every row")
    p.add_argument("--device-memory", type=parse_bytes, default=parse_bytes("80GB"),
                   metavar="BYTES", help="memory per device, e.g. 141GB (80GB: H100 SXM)")
    p.add_argument("--no-memory-limit", action="store_true",
                   help="rank every layout, whatever its memory")
    p.add_argument("--micro-batch-size", type=int_at_least(1), default=1, metavar="SEQUENCES",
                   help="sequences per micro-batch, as Megatron-LM's flag (1)")
    p.add_argument("--global-batch-size", type=int_at_least(1), default=1024,
                   metavar="SEQUENCES",
                   help="sequences per step, as Megatron-LM's flag; must split over DP (1024)")
    p.add_argument("--seq-length", type=int_at_least(1), default=None, metavar="TOKENS",
                   help="tokens per sequence (default: the model config's)")
    p.add_argument("--top", type=int_at_least(1), default=10, metavar="N",
                   help="rows shown (10)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="YAML/JSON file of model constants and `measured` step times")
    p.add_argument("--measured-step", action="append", default=[], metavar="LAYOUT=SECONDS",
                   help="a step time measured on your cluster, seconds (repeatable): scales "
                        "the model")
    for f, (flag, typ, metavar, hlp) in _CAL_FLAGS.items():
        p.add_argument(flag, dest=f, type=typ, default=None, metavar=metavar, help=hlp)
    for name in ("intra-node", "inter-node"):
        renamed(p, f"--{name}-gbps", f"--{name}-gbytes-per-s",
                "gigabytes per second; a 400 Gb/s NIC is 50")
    p.add_argument("--no-flash-attention", action="store_true",
                   help="attention scores are stored (unfused attention)")
    p.add_argument("--no-sequence-parallel", action="store_true",
                   help="TP without sequence parallelism")
    p.add_argument("--transformer-engine", action=argparse.BooleanOptionalAction, default=True,
                   help="the job uses Transformer Engine layers (default: yes, as on GPUs)")
    p.add_argument("--bucket-size", type=int_at_least(1), default=None, metavar="ELEMENTS",
                   help="resolved DDP bucket size in elements (default: one bucket)")
    p.add_argument("--max-stage-spread", type=int_at_least(-1), default=2, metavar="LAYERS",
                   help="uneven first/last stages: at most this many layers off the middle "
                        "stages (2); -1: any")
    for ax, d in (("tp", 8), ("cp", 8), ("etp", 8), ("vpp", 0)):
        p.add_argument(f"--max-{ax}", type=int_at_least(0), default=d, metavar="N",
                       help=f"largest {ax} considered ({d or 'any'}; 0: any)")
    p.add_argument("--optimizer-instances", action="store_true",
                   help="also consider doi > 1 (partial distributed optimizer)")
    p.set_defaults(func=run)
    return p


def describe_human(cal: Calibration) -> str:
    """The model's constants as a person reads them (units, GiB), one line."""
    d = describe(cal)
    reserve = d["reserve_bytes"]
    reserve_text = (f"{reserve // GiB} GiB" if reserve and reserve % GiB == 0
                    else format_bytes(reserve))
    on = {True: "on", False: "off"}
    return (f"{d['achieved_tflops']:g} TFLOP/s achieved, NVLink {d['intra_node_gbps']:g} GB/s, "
            f"NIC {d['inter_node_gbps']:g} GB/s, {d['ranks_per_node']} devices/node, "
            f"collective step {d['collective_latency_us']:g} us, grad {d['grad_bytes']} B, "
            f"activation {d['activation_bytes']} B, flash attention "
            f"{on[d['flash_attention']]}, sequence parallel {on[d['sequence_parallel']]}, "
            f"reserve {reserve_text}, DP overlap {d['dp_overlap']:g}, step scale "
            f"{d['step_scale']:g}")


def calibration_from_args(args: argparse.Namespace
                          ) -> tuple[Calibration, tuple[Measurement, ...]]:
    """Defaults, then the calibration file, then the flags given on the command line."""
    cal, meas = Calibration(), ()
    if args.calibration:
        cal, meas = load_calibration(args.calibration, cal)
    given = {f: getattr(args, f) for f in _CAL_FLAGS if getattr(args, f) is not None}
    if args.no_flash_attention:
        given["flash_attention"] = False
    if args.no_sequence_parallel:
        given["sequence_parallel"] = False
    cal = cal.replace(**given)
    meas = tuple(meas) + tuple(Measurement.parse(m) for m in args.measured_step)
    return cal, meas


def _space(args: argparse.Namespace) -> SearchSpace:
    def cap(v: int) -> Optional[int]:
        return None if v <= 0 else v
    spread = None if args.max_stage_spread < 0 else args.max_stage_spread
    return SearchSpace(max_stage_spread=spread,
                       optimizer_instances=args.optimizer_instances, max_tp=cap(args.max_tp),
                       max_cp=cap(args.max_cp), max_etp=cap(args.max_etp),
                       max_vpp=cap(args.max_vpp))


def suggestion_json(s: Suggestion, work: Workload, cal: Calibration) -> dict[str, Any]:
    return {"model": s.model, "world": s.world, "from": s.current,
            "from_step_seconds": s.current_step_seconds,
            "device_memory_bytes": s.device_memory_bytes,
            "workload": dataclasses.asdict(work), "valid_layouts": s.valid_layouts,
            "ranked_layouts": s.ranked_layouts, "seconds": s.seconds,
            "parameters": describe(cal), "layouts": [r.to_dict() for r in s.rows]}


def format_table(s: Suggestion, work: Workload, cal: Calibration) -> str:
    mem = "no limit" if s.device_memory_bytes is None else f"{s.device_memory_bytes / 1e9:g} GB"
    L = [f"dynatrain suggest: {s.model} on {s.world} devices ({mem} each), micro-batch "
         f"{work.micro_batch_size}, global batch {work.global_batch_size}, sequence "
         f"{work.seq_length}",
         f"{s.valid_layouts} valid layouts, {s.ranked_layouts} split the batch; ranked in "
         f"{s.seconds:.2f} s"]
    if s.current is not None:
        cur = ("n/a" if s.current_step_seconds is None
               else f"{s.current_step_seconds:.3f} s/step")
        L.append(f"current layout {s.current}: {cur}")
    head = f"{'#':>3} {'layout':32s} {'step s':>9} {'mem GB':>7} {'state GB':>9} {'act GB':>7}"
    if s.current is not None:
        head += f" {'switch GB':>10} {'switch s':>9} {'payback':>9}"
    L.append(head)
    for i, r in enumerate(s.rows, 1):
        line = (f"{i:>3} {str(r.layout):32s} {r.step_seconds:>9.3f} "
                f"{r.memory_bytes_per_device / 1e9:>7.1f} {r.state_bytes_per_device / 1e9:>9.1f} "
                f"{r.activation_bytes_per_device / 1e9:>7.1f}")
        if r.switch is not None:
            pay = ("never" if r.switch.payback_steps is None
                   else f"{r.switch.payback_steps:,.1f}")
            line += (f" {r.switch.bytes_moved / 1e9:>10.2f} {r.switch.seconds:>9.3f} "
                     f"{pay:>9}")
        L.append(line)
    L.append("model: " + describe_human(cal))
    return "\n".join(L)


def run(args: argparse.Namespace) -> int:
    """Entry point of `dynatrain suggest`; 2 and one line on bad input."""
    try:
        spec = resolve_model(args.model)
        cal, meas = calibration_from_args(args)
        work = Workload(args.micro_batch_size, args.global_batch_size,
                        args.seq_length if args.seq_length is not None else spec.seq_length)
        cur = None
        if args.current is not None:
            cur = Layout.parse(args.current, None if "dp" in args.current.lower() else args.world)
        s = suggest(spec, args.world, work, cal,
                    device_memory_bytes=None if args.no_memory_limit else args.device_memory,
                    top=args.top, space=_space(args), transformer_engine=args.transformer_engine,
                    bucket_size=args.bucket_size, current=cur, measured=meas)
    except DynatrainError as e:
        print(f"dynatrain suggest: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(suggestion_json(s, work, cal), indent=1) if args.json
          else format_table(s, work, cal))
    return 0
