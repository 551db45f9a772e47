"""Host-side planners: per-micro-step placements from the foresight (numpy only).

Data flow: foresight (exact loads [M, L, D, E] of the coming RL step) ->
planner -> StepPlan (one Placement per micro-step, plus predicted loads,
moves and bytes) -> transfer engine and model. Nothing here imports jax.

Modules, in the order of docs/design.md §5:
  topology   Topology (nodes x devices x slots) and CostModel (seconds).
  packing    steps 1-3: replica counts, node packing, device packing.
  split      step 4: token split across replicas (flows, exact counts).
  foremoe    step 5 and the planner itself: transfer-aware refinement.
  baselines  static, EPLB from step history, EPLB per micro-step.
  milp       exact MILP on small instances (optimality gap).
  plan       StepPlan and how every planner's output is assembled.
  guard      StepPlanner: method choice, deadline and fallback for training.
  evaluate, plots  benchmark library (not imported here: plots needs
             matplotlib).

To plan a step:
  plan = plan_step(loads_MLDE, Topology(1, 8, 18), CostModel(), current)
or, from the trainer, with a deadline and fallback:
  planner = StepPlanner('foremoe', topo, cost, current, deadline_s=0.5)
  plan = planner.plan(loads_MLDE)
"""
from foremoe_jax.planner.baselines import plan_eplb_microstep
from foremoe_jax.planner.baselines import plan_eplb_step
from foremoe_jax.planner.baselines import plan_static
from foremoe_jax.planner.baselines import update_history
from foremoe_jax.planner.foremoe import ForeMoEConfig
from foremoe_jax.planner.foremoe import PlanningTimeout
from foremoe_jax.planner.foremoe import plan_step
from foremoe_jax.planner.guard import StepPlanner
from foremoe_jax.planner.plan import StepPlan
from foremoe_jax.planner.plan import fallback_plan
from foremoe_jax.planner.topology import CostModel
from foremoe_jax.planner.topology import Topology
