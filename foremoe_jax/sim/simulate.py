"""Predicted RL-step times of each balancing method on a simulated cluster.

The host side is not simulated: each method's plan for the step is made by
the repository's own planner, fitted to the transfer budget and scheduled
into move rounds by the repository's own transfer schedule, and its wall
time is measured on this machine (`plan_methods`). Only the device side is
modelled (`time_step`, with `costs`): per micro-step the straggler's expert
compute, the token all-to-alls, the non-expert compute, and the expert
moves split into hidden and exposed; per step the recompute (forward only,
canonical layout, which the planner overlaps), the wait for the plan, the
fill and flush of the slot buffers, the gradient all-reduce and the
optimizer update. The rollout is the same for every method and is left out.

Shape letters: M micro-steps, L MoE layers, D EP devices, E experts.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from foremoe_jax import config as config_lib
from foremoe_jax import placement as placement_lib
from foremoe_jax.model import expert_parallel
from foremoe_jax.planner import baselines, foremoe
from foremoe_jax.planner.plan import StepPlan
from foremoe_jax.planner.topology import CostModel, Topology
from foremoe_jax.sim import costs
from foremoe_jax.sim.hardware import HardwareProfile
from foremoe_jax.sim.workload import ModelShape, Workload
from foremoe_jax.transfer import schedule

METHODS = ('static', 'eplb_step', 'eplb_microstep', 'foremoe')
# ForeMoE as it planned before the simulator (weight copies priced alone,
# shift rounds ignored): ask for it by name to see the fixes' effect.
ABLATIONS = ('foremoe_before_fixes',)
MODES = ('padded', 'ragged')
CAPACITY_FACTORS = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0)  # parallel_defaults().


@dataclasses.dataclass
class MethodPlan:
  """One method's host output for one step, as the trainer builds it."""

  plan: StepPlan
  transfer: schedule.StepTransfer
  capacity: int  # Padded layer's bucket for the update.
  static_capacity: int  # Bucket of the canonical layout (the recompute).
  reverted: int
  plan_s: float  # Planner + fit + move schedule, measured on this host.


def topology(model: ModelShape, work: Workload, hw: HardwareProfile) -> Topology:
  ep = work.ep_size(model)
  per_node = hw.node_size(ep)
  return Topology(ep // per_node, per_node, work.slots_per_device(model))


def cost_model(model: ModelShape, hw: HardwareProfile) -> CostModel:
  """The planner's cost model for this hardware (same constants)."""
  return CostModel.from_expert_shape(
      model.d_model, model.moe_d_ff, bytes_per_param=model.bytes_per_param,
      flops_per_s=hw.flops_per_s, intra_node_bw=hw.intra_bw,
      inter_node_bw=hw.inter_bw,
      overlap=0.5 * hw.transfer_overlap)  # The planner's default window.


def default_budget(topo: Topology) -> schedule.TransferBudget:
  """The trainer's defaults: the fill may take up to D rounds (every
  device's replicas from every home), 2 rounds between micro-steps."""
  return schedule.TransferBudget(step_rounds=topo.num_devices,
                                 microstep_rounds=2)


def _bucket(loads_MLDE, placements, buckets) -> int:
  cells = max(int(placement_lib.cell_counts(loads_MLDE[m], p).max())
              for m, p in enumerate(placements))
  return config_lib.pick_bucket(cells, buckets)


def plan_methods(loads_MLDE, history_LE, topo: Topology, cost: CostModel,
                 budget: schedule.TransferBudget, top_k: int,
                 tokens_per_device: int, methods=METHODS,
                 capacity_factors=CAPACITY_FACTORS,
                 config: foremoe.ForeMoEConfig = foremoe.ForeMoEConfig()
                 ) -> dict[str, MethodPlan]:
  """Each method's plan as the trainer makes it (`rl.trainer._finalize`):
  plan from the home layout, fit to the budget, schedule, pick the bucket.
  history_LE: EPLB-step's decayed past loads (None: none yet)."""
  loads_MLDE = np.asarray(loads_MLDE)
  num_micro, num_layers, _, num_experts = loads_MLDE.shape
  home = placement_lib.identity_placement(num_layers, num_experts,
                                          topo.num_devices, topo.slots_per_device)
  cfg = dataclasses.replace(config, home_anchor=True,
                            anchor_rounds=budget.step_rounds,
                            moves_per_layer=budget.microstep_rounds)
  rounds = budget.step_rounds
  buckets = config_lib.capacity_buckets(tokens_per_device, top_k,
                                        topo.num_devices, topo.slots_per_device,
                                        dispatch='padded',
                                        factors=capacity_factors)
  static_cap = _bucket(loads_MLDE, [home] * num_micro, buckets)
  out = {}
  for method in methods:
    t0 = time.perf_counter()
    if method == 'static':
      plan = baselines.plan_static(loads_MLDE, topo, cost, home)
    elif method == 'eplb_step':
      plan = baselines.plan_eplb_step(loads_MLDE, topo, cost, home, history_LE,
                                      home_anchor=True, max_rounds=rounds)
    elif method == 'eplb_microstep':
      plan = baselines.plan_eplb_microstep(loads_MLDE, topo, cost, home,
                                           home_anchor=True, max_rounds=rounds)
    elif method == 'foremoe':
      plan = foremoe.plan_step(loads_MLDE, topo, cost, home, cfg)
    elif method == 'foremoe_before_fixes':
      plan = foremoe.plan_step(loads_MLDE, topo, cost, home, dataclasses.replace(
          cfg, price_gradient_returns=False, anchor_rounds=None,
          moves_per_layer=None))
    else:
      raise ValueError(f'unknown method {method!r}; pick from '
                       f'{METHODS + ABLATIONS}.')
    plan, reverted = schedule.fit_plan_to_budget(plan, loads_MLDE, topo, cost,
                                                 budget)
    transfer = schedule.build_step_transfer(plan.placement.slot_expert,
                                            num_experts, topo, budget)
    cap = _bucket(loads_MLDE, [plan.microstep(m) for m in range(num_micro)],
                  buckets)
    out[method] = MethodPlan(plan, transfer, cap, static_cap, reverted,
                             time.perf_counter() - t0)
  return out


def _moe_and_a2a(loads_MLDE, placement_of, capacity, model: ModelShape,
                 hw: HardwareProfile, spd: int, mode: str, passes: int):
  """Per micro-step expert compute and all-to-all seconds: ([M], [M])."""
  num_micro, num_layers, num_dev, _ = np.shape(loads_MLDE)
  act_bytes = model.d_model * model.bytes_per_param
  num_a2a = 2 if passes == 1 else 4  # Forward: dispatch, combine.
  moe_M, a2a_M = np.zeros(num_micro), np.zeros(num_micro)
  if mode == 'padded':
    rows = costs.padded_rows(num_dev, capacity, spd, expert_parallel.default_tile(
        num_dev * capacity, spd))
    layer_moe = float(costs.expert_time(rows, spd, model, hw, passes))
    layer_a2a = costs.all_to_all_time(
        costs.padded_cells(num_dev, capacity) * act_bytes, hw)
    moe_M[:] = num_layers * layer_moe
    a2a_M[:] = num_layers * num_a2a * layer_a2a
    return moe_M, a2a_M
  if mode != 'ragged':
    raise ValueError(f'mode must be one of {MODES}, got {mode!r}.')
  for m in range(num_micro):
    p = placement_of(m)
    cells_LSD = placement_lib.cell_counts(loads_MLDE[m], p)
    loads_LD = cells_LSD.sum(axis=1)
    moe_M[m] = float(costs.expert_time(loads_LD.max(axis=1), spd, model, hw,
                                       passes).sum())
    a2a_M[m] = num_a2a * sum(costs.all_to_all_time(c * act_bytes, hw)
                             for c in cells_LSD)
  return moe_M, a2a_M


def _transition_s(t, model, hw, num_dev, lead=()) -> np.ndarray:
  """Seconds per layer of a Transition (lead: index of micro-step)."""
  num_layers = t.shift_LR[lead].shape[0]
  return np.array([costs.transition_time(t, lead + (l,), model, hw, num_dev,
                                         grad_bytes_per_param=4)
                   for l in range(num_layers)])


def time_step(mp: MethodPlan, loads_MLDE, model: ModelShape, work: Workload,
              hw: HardwareProfile, mode: str = 'padded') -> dict:
  """Predicted seconds of one RL step (update phase and whole step)."""
  loads_MLDE = np.asarray(loads_MLDE)
  num_micro, num_layers, num_dev, num_experts = loads_MLDE.shape
  spd = work.slots_per_device(model)
  plan = mp.plan
  tokens = work.tokens_per_device
  nonexpert = lambda passes: (
      tokens * model.nonexpert_flops_per_token(work.tokens_per_seq, passes)
      / hw.nonexpert_flops_per_s
      + model.num_layers * hw.layer_overhead_s * (1 + (passes > 1)))
  moe_M, a2a_M = _moe_and_a2a(loads_MLDE, plan.microstep, mp.capacity, model,
                              hw, spd, mode, passes=3)
  compute_M = moe_M + nonexpert(3)
  move_M = np.zeros(num_micro)  # Moves into micro-step m + 1.
  for m in range(num_micro - 1):
    move_M[m] = _transition_s(mp.transfer.steps, model, hw, num_dev,
                              (m,)).sum()
  hidden_M = np.minimum(move_M, hw.transfer_overlap * compute_M)
  exposed_M = move_M - hidden_M
  fill = mp.transfer.fill
  local_D = np.zeros(num_dev)
  for l in range(num_layers):
    local_D += (fill.local_src_LS[l].reshape(num_dev, spd) >= 0).sum(axis=1)
  fill_s = (_transition_s(fill, model, hw, num_dev).sum()
            + costs.local_copy_time(local_D, model, hw))
  flush_s = _transition_s(mp.transfer.flush, model, hw, num_dev).sum()
  groups = work.num_devices // num_dev
  expert_params = (model.num_moe_layers * model.params_per_expert
                   * num_experts / num_dev)
  optimizer_s = costs.optimizer_time(expert_params + model.nonexpert_params(),
                                     hw)
  # f32 gradients: non-expert ones over every device, expert ones over the
  # EP groups beside each other.
  sync_s = (costs.allreduce_time(4.0 * model.nonexpert_params(),
                                 work.num_devices, hw)
            + (costs.allreduce_time(4.0 * expert_params, groups, hw)
               if groups > 1 else 0.0))
  update_s = float(fill_s + (compute_M + a2a_M + exposed_M).sum() + flush_s
                   + optimizer_s + sync_s)
  home = placement_lib.identity_placement(num_layers, num_experts, num_dev, spd)
  rmoe_M, ra2a_M = _moe_and_a2a(loads_MLDE, lambda m: home, mp.static_capacity,
                                model, hw, spd, mode, passes=1)
  recompute_s = float((rmoe_M + ra2a_M + nonexpert(1)).sum()) * (
      1 + work.reference_forward)
  plan_wait_s = max(0.0, mp.plan_s - recompute_s)
  return dict(
      update_s=update_s, recompute_s=recompute_s, plan_s=mp.plan_s,
      plan_wait_s=plan_wait_s,
      step_s=recompute_s + plan_wait_s + update_s,
      moe_compute_s=float(moe_M.sum()), all_to_all_s=float(a2a_M.sum()),
      nonexpert_s=float(num_micro * nonexpert(3)),
      transfer_s=float(move_M.sum() + fill_s + flush_s),
      transfer_hidden_s=float(hidden_M.sum()),
      transfer_exposed_s=float(exposed_M.sum() + fill_s + flush_s),
      fill_s=float(fill_s), flush_s=float(flush_s),
      optimizer_s=optimizer_s, grad_sync_s=sync_s,
      capacity=mp.capacity, reverted_moves=mp.reverted,
      microstep_max_over_mean=float(placement_lib.max_over_mean(
          plan.loads_MLD).mean()))
