"""Routing: who sends which box of which tensor to whom, where, and in which round.

Pure Python/numpy (never imports torch, torch.distributed or megatron), so every rank
plans alone and 235B-parameter switches on thousands of ranks plan on a laptop.

    regions    region tables of a layout and the vectorised box join (the geometry)
    planner    build_plan: local copies, source choice, statistics      -> Plan
    plan       Piece, PlanStats, Plan (lazy per-device pieces), validate_plan
    placement  choose_placement: which device takes which rank of the new layout
    schedule   rounds under a staging-memory budget, deadlock-free by construction
    cost       link model, bandwidth lower bound, checkpoint-path estimate
    plan_cli   the `dynatrain plan` subcommand
"""
from .cost import (CheckpointEstimate, CheckpointModel, CostEstimate, LinkModel,
                   bandwidth_lower_bound, checkpoint_estimate, estimate)
from .placement import PlacementChoice, choose_placement, placement_choice
from .plan import DeviceTraffic, Piece, Plan, PlanStats, validate_plan
from .planner import build_plan, clear_caches, geometry, plan_for
from .regions import RoutingError
from .schedule import Round, Schedule, build_schedule, schedule

__all__ = ["CheckpointEstimate", "CheckpointModel", "CostEstimate", "LinkModel",
           "bandwidth_lower_bound", "checkpoint_estimate", "estimate", "PlacementChoice",
           "choose_placement", "placement_choice", "DeviceTraffic", "Piece", "Plan",
           "PlanStats", "validate_plan", "build_plan", "clear_caches", "geometry",
           "plan_for", "RoutingError", "Round", "Schedule", "build_schedule", "schedule"]
