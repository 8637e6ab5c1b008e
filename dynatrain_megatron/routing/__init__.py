"""Routing: who sends which box of which tensor to whom, where, and in which round.

Pure Python/numpy (never imports torch, torch.distributed or megatron), so every rank
plans alone and 235B-parameter switches on thousands of ranks plan on a laptop.

    regions           region tables of a layout and the vectorised box join
    piece             Piece: one box of one tensor and kind, from a device to a device
    geometry          set pairs: A's and B's regions joined (placement independent)
    links             link model of a device, node-cut bound
    sources           source choice: local copies, the min-max local search
    plan              PlanStats, Plan (lazy per-device pieces), validate_plan
    plan_stats        byte counts of a plan and the bounds on its per-device traffic
    planner           build_plan / plan_for: the API                      -> Plan
    placement_search  choose_placement: which device takes which rank of the new layout
    schedule          rounds under a staging-memory budget, deadlock-free by construction
    cost              estimate of a schedule, bandwidth lower bound, checkpoint baseline
    lost_state        what the death of some devices loses of a layout's state
"""
from .cost import (CheckpointEstimate, CheckpointModel, CostEstimate, bandwidth_lower_bound,
                   checkpoint_estimate, estimate)
from .geometry import geometry
from .links import LinkModel
from .piece import Piece
from .placement_search import PlacementChoice, choose_placement, placement_choice
from .plan import DeviceTraffic, Plan, PlanStats, device_plan_errors, validate_plan
from .planner import build_plan, clear_caches, plan_for
from .regions import RoutingError
from .schedule import Round, Schedule, build_schedule, schedule

__all__ = ["CheckpointEstimate", "CheckpointModel", "CostEstimate", "LinkModel",
           "bandwidth_lower_bound", "checkpoint_estimate", "estimate", "PlacementChoice",
           "choose_placement", "placement_choice", "DeviceTraffic", "Piece", "Plan",
           "PlanStats", "validate_plan", "device_plan_errors", "build_plan", "clear_caches",
           "geometry", "plan_for", "RoutingError", "Round", "Schedule", "build_schedule", "schedule"]
