"""Baseline planners, same inputs, outputs and slot budget as ForeMoE.

* ``plan_static``: the identity placement (plain EP; redundant slots idle).
* ``plan_eplb_step``: DeepSeek-EPLB style from step-level history: a moving
  average of past steps' loads, one hierarchical placement per step, tokens
  split evenly over replicas. This is what step-level balancers can do.
* ``plan_eplb_microstep``: the same hierarchical placement recomputed from
  each micro-step's exact loads, with ForeMoE's token split: an ablation of
  ForeMoE without transfer awareness (it re-packs from scratch every time).

The exact MILP, for the optimality gap, is in ``planner.milp``.
"""
from __future__ import annotations

import numpy as np

from foremoe_jax import placement as placement_lib
from foremoe_jax.planner import packing, split
from foremoe_jax.planner.plan import StepPlan, assemble_plan
from foremoe_jax.planner.topology import CostModel, Topology


def _dims(loads_MLDE, topo: Topology):
  num_micro, num_layers, num_devices, num_experts = np.shape(loads_MLDE)
  if num_devices != topo.num_devices:
    raise ValueError(f'loads have {num_devices} source devices, topology '
                     f'{topo.num_devices}.')
  topo.check_experts(num_experts)
  return num_micro, num_layers, num_experts


def plan_static(loads_MLDE, topo: Topology, cost: CostModel,
                current: placement_lib.Placement | None = None) -> StepPlan:
  """Identity placement for every micro-step; tokens go to the first copy."""
  num_micro, num_layers, num_experts = _dims(loads_MLDE, topo)
  ident = placement_lib.identity_placement(
      num_layers, num_experts, topo.num_devices, topo.slots_per_device)
  se_LS = ident.slot_expert.astype(np.int64)
  # Each device's first E/D slots (its home experts' first copies), not the
  # first E slots overall: with more slots a device than E/D those were
  # redundant copies, and some home slots were left without tokens.
  first_S = np.asarray(ident.slot_share[0, 0]) > 0
  w_MLE = np.asarray(loads_MLDE).sum(axis=2).astype(np.float64)
  x_MLS = np.stack([np.take_along_axis(w_MLE[m], se_LS, 1) * first_S
                    for m in range(num_micro)])
  prev = ident.slot_expert if current is None else current.slot_expert
  return assemble_plan(loads_MLDE, np.broadcast_to(se_LS, x_MLS.shape),
                       x_MLS, topo, cost, prev, prefer_local=False)


def update_history(history_LE, loads_MLDE, decay: float):
  """Exponential moving average of step-level loads per expert: [L, E]."""
  w_LE = np.asarray(loads_MLDE).sum(axis=(0, 2)).astype(np.float64)
  if history_LE is None:
    return w_LE
  return decay * np.asarray(history_LE) + (1.0 - decay) * w_LE


def _pack(w_LE, topo: Topology, cost: CostModel, home_anchor: bool,
          max_rounds: int | None) -> np.ndarray:
  if home_anchor:
    return packing.home_anchored_placement(w_LE, topo, cost,
                                           max_rounds).astype(np.int64)
  return packing.hierarchical_placement(w_LE, topo).astype(np.int64)


def plan_eplb_step(loads_MLDE, topo: Topology, cost: CostModel,
                   current: placement_lib.Placement,
                   history_LE: np.ndarray | None,
                   home_anchor: bool = False,
                   max_rounds: int | None = None) -> StepPlan:
  """One placement for the whole step from past steps' average loads.

  home_anchor: pack with `packing.home_anchored_placement` (experts stay
  home, replicas in redundant slots), as for a transfer engine that
  refills slots from home every step; else EPLB's free packing. Anchored,
  the packing also knows the engine's rounds (`cost`, `max_rounds`: see
  `packing.home_anchored_placement`), as ForeMoE's anchor does.

  With no history yet the current placement is kept. The caller folds the
  step's loads into the history afterwards (``update_history``): the planner
  must not see the step it plans.
  """
  num_micro, _, _ = _dims(loads_MLDE, topo)
  cur_LS = np.asarray(current.slot_expert, np.int64)
  if history_LE is None:
    se_LS = cur_LS
  else:
    se_LS = _pack(history_LE, topo, cost, home_anchor, max_rounds)
  w_MLE = np.asarray(loads_MLDE).sum(axis=2).astype(np.float64)
  x_MLS = np.stack([split.uniform_flows(se_LS, w_MLE[m],
                                        topo.slots_per_device)
                    for m in range(num_micro)])
  return assemble_plan(loads_MLDE, np.broadcast_to(se_LS, x_MLS.shape), x_MLS,
                       topo, cost, cur_LS, prefer_local=False)


def plan_eplb_microstep(loads_MLDE, topo: Topology, cost: CostModel,
                        current: placement_lib.Placement,
                        sweeps: int = 4, prefer_local: bool = True,
                        home_anchor: bool = False,
                        max_rounds: int | None = None) -> StepPlan:
  """A fresh hierarchical placement per micro-step from its exact loads
  (home_anchor, max_rounds: as in `plan_eplb_step`)."""
  pack = lambda w_LE, topo: _pack(w_LE, topo, cost, home_anchor, max_rounds)
  num_micro, _, _ = _dims(loads_MLDE, topo)
  w_MLE = np.asarray(loads_MLDE).sum(axis=2).astype(np.float64)
  se_list, x_list = [], []
  for m in range(num_micro):
    se_LS = pack(w_MLE[m], topo).astype(np.int64)
    x_LS, _ = split.balanced_flows(se_LS, w_MLE[m], topo, sweeps=sweeps)
    se_list.append(se_LS)
    x_list.append(x_LS)
  return assemble_plan(loads_MLDE, np.stack(se_list), np.stack(x_list), topo,
                       cost, current.slot_expert, prefer_local)
