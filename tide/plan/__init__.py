"""Planning: split a GPU inventory between serving and draft training (model in `planner`)."""

from tide.plan.planner import KNOWN, GpuClass, Inventory, Plan, load_inventory, parse_inventory, plan

__all__ = ["KNOWN", "GpuClass", "Inventory", "Plan", "load_inventory", "parse_inventory", "plan"]
