"""Weight transfer between placements (host-side schedule, numpy only).

Data flow: planner (StepPlan) -> transfer -> RL step. ``schedule`` turns
consecutive placements into the local copies and shift rounds the device
engine runs, fits a plan to the engine's static round budget, and counts
the weights moved. Nothing here imports jax.
"""
from foremoe_jax.transfer.schedule import BudgetExceeded
from foremoe_jax.transfer.schedule import StepTransfer
from foremoe_jax.transfer.schedule import Transition
from foremoe_jax.transfer.schedule import TransferBudget
from foremoe_jax.transfer.schedule import build_step_transfer
from foremoe_jax.transfer.schedule import fit_plan_to_budget
from foremoe_jax.transfer.schedule import rounds_needed
from foremoe_jax.transfer.schedule import transition
