"""ForeMoE planner: per-micro-step placements from exact loads (foresight).

Sits between foresight (loads [M, L, D, E] of the coming step, known because
routing is replayed) and the transfer engine / model (which read the
StepPlan). It follows the hierarchical decomposition of DESIGN.md §5:

* Step level (steps 1-3, ``step_anchor``): a hierarchical placement of the
  step's total loads (replica counts, node packing, device packing), relabelled
  to overlap the current placement. A layer adopts it only when the balance it
  gains over the step outweighs the copies it needs.
* Micro-step level (steps 4-5, ``refine_microstep``), starting from the
  previous micro-step's placement: the token split levels device loads over
  the replicas there are (``split.FlowGraph``); then, in a few vectorised
  rounds, each of the hottest devices may hand one expert to a cold device
  by copying it into a slot whose replica is least missed there. A move is
  taken only when the straggler time it saves exceeds the time the copy
  takes, and a device copies in only what hides under the overlap window of
  a micro-step's compute. Everything else stays where it is.

All layers are planned together (arrays over L); only the rounds and the
colours of the Gauss-Seidel split are Python loops.

Shape letters: M micro-steps, L layers, D devices, E experts, S slots,
P hot/cold device pairs, s slots per device (i on the hot device, k on the
cold one), R replicas of one expert.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from foremoe_jax import placement as placement_lib
from foremoe_jax.planner import packing, split
from foremoe_jax.planner.plan import StepPlan, assemble_plan
from foremoe_jax.planner.topology import CostModel, Topology


class PlanningTimeout(RuntimeError):
  """The planner ran past its deadline."""


@dataclasses.dataclass(frozen=True)
class ForeMoEConfig:
  """Knobs of the ForeMoE planner; the defaults are the benchmarked ones."""

  balance_tol: float = 0.01
  """A layer is balanced (no more moves) once max/mean <= 1 + balance_tol."""
  min_gain_frac: float = 0.002
  """Moves must save at least this fraction of the mean device load, even
  when copies are free (keeps free moves from chasing noise)."""
  max_rounds: int = 6
  """Rounds of moves per micro-step; each round moves at most one expert
  into each cold device."""
  pairs_per_round: int = 0
  """Hot/cold device pairs tried per round per layer (0: half the devices)."""
  sweeps: int = 2
  """Gauss-Seidel sweeps of the token split before the first round."""
  round_sweeps: int = 1
  """Sweeps after each round of moves."""
  final_sweeps: int = 2
  """Sweeps once the placement of the micro-step is fixed."""
  max_moves_per_device: int | None = None
  """Hard cap on copies into one device per layer and micro-step, on top of
  the overlap window (None: the window alone)."""
  prefer_local_node: bool = True
  """Sources send tokens to replicas on their own node first."""
  step_anchor: bool = True
  """Re-anchor layers on the step-level hierarchical placement when it pays."""
  warm_start: bool = True
  """Start each micro-step's split from the previous one's proportions."""


def _move_tokens(new_LS, prev_LS, topo: Topology, cost: CostModel):
  """Cost of going from prev to new, in token-assignments per layer: [L]."""
  intra_LD, inter_LD = packing.new_copies_by_link(new_LS, prev_LS, topo)
  return (intra_LD * cost.move_tokens(False)
          + inter_LD * cost.move_tokens(True)).sum(axis=1)


def step_anchor(w_LE, current_LS, topo: Topology, cost: CostModel,
                cfg: ForeMoEConfig):
  """Per layer, the current placement or the step-level hierarchical one.

  The hierarchical placement (steps 1-3) is adopted for a layer when the
  step's straggler load it removes is worth more than copying it in.
  """
  target_LS = packing.hierarchical_placement(w_LE, topo)
  target_LS = packing.align_to_current(target_LS, current_LS, topo)
  sweeps = cfg.sweeps + cfg.final_sweeps
  _, y_cur_LD = split.balanced_flows(current_LS, w_LE, topo, sweeps=sweeps)
  _, y_tgt_LD = split.balanced_flows(target_LS, w_LE, topo, sweeps=sweeps)
  gain_L = y_cur_LD.max(axis=1) - y_tgt_LD.max(axis=1)
  adopt_L = gain_L > _move_tokens(target_LS, current_LS, topo, cost)
  return np.where(adopt_L[:, None], target_LS, current_LS).astype(np.int64)


def _propose_moves(se_LS, x_LS, y_LD, graph: split.FlowGraph, budget_LD,
                   moves_LD, active_L, topo: Topology, cost: CostModel,
                   cfg: ForeMoEConfig):
  """One round of moves, at most one per cold device: accepted
  (layer, slot, expert, device, cost) arrays."""
  num_layers = se_LS.shape[0]
  num_devices, s = topo.num_devices, topo.slots_per_device
  mean_L = y_LD.mean(axis=1)
  # Only devices above the tolerance can give; pair no more than that.
  n_hot = int((active_L[:, None]
               & (y_LD > (mean_L * (1 + cfg.balance_tol))[:, None])
               ).sum(axis=1).max())
  n_pairs = min(cfg.pairs_per_round or num_devices // 2, num_devices // 2,
                n_hot)
  empty = (np.zeros(0, np.int64),) * 4 + (np.zeros(0),)
  if n_pairs < 1:
    return empty
  lk = np.arange(num_layers)[:, None]
  l3 = lk[:, :, None]
  count_LS = graph.count_LE[lk, se_LS]
  evictable_LS = count_LS >= 2
  cheapest = float(cost.move_tokens(False))
  cap = np.inf if cfg.max_moves_per_device is None else cfg.max_moves_per_device
  can_take_LD = (evictable_LS.reshape(num_layers, num_devices, s).any(axis=2)
                 & (budget_LD >= cheapest) & (moves_LD < cap))
  hot_LP = np.argsort(-y_LD, axis=1, kind='stable')[:, :n_pairs]
  cold_key_LD = np.where(can_take_LD, y_LD, np.inf)
  cold_LP = np.argsort(cold_key_LD, axis=1, kind='stable')[:, :n_pairs]
  y_hot_LP, y_cold_LP = y_LD[lk, hot_LP], y_LD[lk, cold_LP]
  pair_ok_LP = (active_L[:, None]
                & (y_hot_LP > (mean_L * (1 + cfg.balance_tol))[:, None])
                & np.isfinite(cold_key_LD[lk, cold_LP])
                & (y_cold_LP < y_hot_LP))
  slot_hot_LPi = hot_LP[..., None] * s + np.arange(s)
  slot_cold_LPk = cold_LP[..., None] * s + np.arange(s)
  e_hot_LPi, x_hot_LPi = se_LS[l3, slot_hot_LPi], x_LS[l3, slot_hot_LPi]
  e_cold_LPk, x_cold_LPk = se_LS[l3, slot_cold_LPk], x_LS[l3, slot_cold_LPk]
  on_cold_LPi = (e_hot_LPi[..., :, None] == e_cold_LPk[..., None, :]).any(-1)
  # Evicting a replica sends its flow to the expert's other replicas; the
  # level they reach is the damage the eviction does.
  l4 = l3[..., None]
  rep_LPkR = graph.table_LER[l3, e_cold_LPk]
  rep_ok_LPkR = graph.valid_LER[l3, e_cold_LPk] & (rep_LPkR != slot_cold_LPk[..., None])
  base_LPkR = y_LD[l4, np.maximum(rep_LPkR, 0) // s]
  level_LPk = split.fill_level(base_LPkR, x_cold_LPk, rep_ok_LPkR)
  level_LPk = np.where(x_cold_LPk > 0, level_LPk, -np.inf)
  y_after_LPk = y_cold_LP[..., None] - x_cold_LPk
  gap_LPik = y_hot_LP[..., None, None] - y_after_LPk[..., None, :]
  shift_LPik = np.minimum(x_hot_LPi[..., :, None], 0.5 * gap_LPik)
  new_max_LPik = np.maximum(
      np.maximum(y_hot_LP[..., None, None] - shift_LPik,
                 y_after_LPk[..., None, :] + shift_LPik),
      level_LPk[..., None, :])
  gain_LPik = y_hot_LP[..., None, None] - new_max_LPik
  if topo.num_nodes > 1:
    # The copy comes from a replica on the cold device's node if there is one.
    node_S = topo.node_of_device()[topo.device_of_slot()]
    rep_hot_LPiR = graph.table_LER[l3, e_hot_LPi]
    rep_node = np.where(rep_hot_LPiR >= 0, node_S[np.maximum(rep_hot_LPiR, 0)], -1)
    cold_node_LP = topo.node_of_device()[cold_LP]
    inter_LPi = ~(rep_node == cold_node_LP[..., None, None]).any(-1)
    cost_LPi = cost.move_tokens(inter_LPi)
  else:
    cost_LPi = np.full(e_hot_LPi.shape, cheapest)
  budget_LP = budget_LD[lk, cold_LP]
  ok = (pair_ok_LP[..., None, None]
        & ~on_cold_LPi[..., :, None]
        & evictable_LS[l3, slot_cold_LPk][..., None, :]
        & (e_hot_LPi[..., :, None] != e_cold_LPk[..., None, :])
        & (x_hot_LPi[..., :, None] > 0)
        & (cost_LPi <= budget_LP[..., None])[..., None]
        & (gain_LPik > cfg.min_gain_frac * mean_L[:, None, None, None]))
  net_LPik = np.where(ok, gain_LPik - cost_LPi[..., None], -np.inf)
  flat = net_LPik.reshape(num_layers, n_pairs, s * s)
  best_LP = np.argmax(flat, axis=2)
  best_net_LP = np.take_along_axis(flat, best_LP[..., None], 2)[..., 0]
  i_LP, k_LP = best_LP // s, best_LP % s
  accept_LP = best_net_LP > 0
  evict_LP = np.take_along_axis(e_cold_LPk, k_LP[..., None], 2)[..., 0]
  # One eviction per expert per round, so no expert loses its last replica.
  earlier_PP = np.tril(np.ones((n_pairs, n_pairs), bool), k=-1)
  same = ((evict_LP[:, :, None] == evict_LP[:, None, :])
          & accept_LP[:, None, :] & earlier_PP[None])
  accept_LP &= ~same.any(axis=2)
  layer, pair = np.nonzero(accept_LP)
  return (layer,
          slot_cold_LPk[layer, pair, k_LP[layer, pair]],
          e_hot_LPi[layer, pair, i_LP[layer, pair]],
          cold_LP[layer, pair],
          cost_LPi[layer, pair, i_LP[layer, pair]])


def _fractions(x_LS, se_LS, w_LE):
  w_LS = np.take_along_axis(w_LE, se_LS, 1)
  return np.where(w_LS > 0, x_LS / np.maximum(w_LS, 1e-300), 0.0)


def refine_microstep(graph: split.FlowGraph, w_LE, topo: Topology,
                     cost: CostModel, cfg: ForeMoEConfig, frac_LS=None,
                     window_L=None):
  """Transfer-aware placement of one micro-step from the previous one.

  Args:
    graph: the previous micro-step's placement as a FlowGraph (its colouring
      is reused when nothing moves).
    w_LE: this micro-step's loads per expert (summed over sources).
    frac_LS: the previous split's share of each slot in its expert's load,
      a warm start for the split (None: even).
    window_L: tokens of straggler compute the copies may hide under, per
      layer (None: overlap times this micro-step's straggler load before
      any move).
  Returns:
    (FlowGraph of the new placement, flows [L, S], device loads [L, D]).
  """
  w_LE = np.asarray(w_LE, np.float64)
  graph = graph.with_loads(w_LE)
  start_graph = graph
  se_LS = graph.slot_expert_LS.copy()
  num_layers = se_LS.shape[0]
  x_LS, y_LD = graph.sweep(graph.initial_flows(frac_LS), cfg.sweeps)
  if window_L is None:
    window_L = cost.overlap * y_LD.max(axis=1)
  budget_LD = np.repeat(np.asarray(window_L, np.float64)[:, None],
                        topo.num_devices, 1)
  moves_LD = np.zeros((num_layers, topo.num_devices), np.int64)
  active_L = np.ones(num_layers, bool)
  moved_LE = np.zeros(w_LE.shape, bool)
  for _ in range(cfg.max_rounds):
    active_L &= (placement_lib.max_over_mean(y_LD) > 1 + cfg.balance_tol)
    if not active_L.any():
      break
    layer, slot, expert, device, tokens = _propose_moves(
        se_LS, x_LS, y_LD, graph, budget_LD, moves_LD, active_L, topo, cost,
        cfg)
    moved_L = np.zeros(num_layers, bool)
    moved_L[layer] = True
    active_L &= moved_L
    if not len(layer):
      break
    evicted = se_LS[layer, slot]
    x_LS = x_LS.copy()
    x_LS[layer, slot] = 0.0
    se_LS[layer, slot] = expert
    np.add.at(moves_LD, (layer, device), 1)
    np.add.at(budget_LD, (layer, device), -tokens)
    # The copied and the evicted experts are water-filled over their new
    # replicas; everyone else is swept with the micro-step's first colouring,
    # which is still valid for experts whose replicas did not change.
    graph = split.FlowGraph(se_LS, w_LE, topo)
    pairs = np.unique(np.concatenate([
        np.stack([layer, expert], 1), np.stack([layer, evicted], 1)]), axis=0)
    moved_LE[pairs[:, 0], pairs[:, 1]] = True
    x_LS, y_LD = graph.refill(x_LS, pairs[:, 0], pairs[:, 1])
    x_LS, y_LD = start_graph.sweep(x_LS, cfg.round_sweeps, skip_LE=moved_LE)
  if moved_LE.any():
    x_LS, y_LD = graph.sweep(x_LS, cfg.final_sweeps)
  return graph, x_LS, y_LD


def plan_step(loads_MLDE, topo: Topology, cost: CostModel,
              current: placement_lib.Placement,
              config: ForeMoEConfig = ForeMoEConfig(),
              deadline: float | None = None) -> StepPlan:
  """Plans all M micro-steps of one RL step.

  Args:
    loads_MLDE: exact token-assignments per micro-step, layer, source device
      and expert (the foresight).
    topo, cost: the machine.
    current: the placement in use now (the previous step's last).
    config: planner knobs.
    deadline: a `time.perf_counter()` value; past it, PlanningTimeout is
      raised between micro-steps (see `planner.guard` for the fallback).
  Returns:
    The StepPlan: placements, predicted loads, moves and bytes.
  """
  loads_MLDE = np.asarray(loads_MLDE)
  num_micro, num_layers, num_devices, num_experts = loads_MLDE.shape
  if num_devices != topo.num_devices:
    raise ValueError(f'loads have {num_devices} source devices, topology '
                     f'{topo.num_devices}.')
  topo.check_experts(num_experts)
  cur_LS = np.asarray(current.slot_expert, np.int64)
  if cur_LS.shape != (num_layers, topo.num_slots):
    raise ValueError(f'current placement is {cur_LS.shape}, expected '
                     f'{(num_layers, topo.num_slots)}.')
  w_MLE = loads_MLDE.sum(axis=2).astype(np.float64)
  se_LS = cur_LS
  if config.step_anchor:
    se_LS = step_anchor(w_MLE.sum(axis=0), cur_LS, topo, cost, config)
  graph = split.FlowGraph(se_LS, w_MLE[0], topo)
  frac_LS, window_L = None, None
  se_list, x_list = [], []
  for m in range(num_micro):
    if deadline is not None and time.perf_counter() > deadline:
      raise PlanningTimeout(f'planning passed its deadline at micro-step {m}.')
    graph, x_LS, y_LD = refine_microstep(graph, w_MLE[m], topo, cost, config,
                                         frac_LS, window_L)
    se_list.append(graph.slot_expert_LS)
    x_list.append(x_LS)
    if config.warm_start:
      frac_LS = _fractions(x_LS, graph.slot_expert_LS, w_MLE[m])
    # Copies for micro-step m+1 hide under micro-step m's compute.
    window_L = cost.overlap * y_LD.max(axis=1)
  return assemble_plan(loads_MLDE, np.stack(se_list), np.stack(x_list), topo,
                       cost, cur_LS, config.prefer_local_node)
