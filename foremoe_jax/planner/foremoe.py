"""ForeMoE planner: per-micro-step placements from exact loads (foresight).

Sits between foresight (loads [M, L, D, E] of the coming step, known because
routing is replayed) and the transfer engine / model (which read the
StepPlan). It follows the hierarchical decomposition of docs/design.md §5.2:

* Step level (steps 1-3, ``step_anchor``): a hierarchical placement of the
  step's total loads (replica counts, node packing, device packing), relabelled
  to overlap the current placement. A layer adopts it only when the balance it
  gains over the step outweighs the copies it needs. The anchor is then
  refined once on the step's totals (``anchor_refine_rounds`` rounds of
  the micro-step moves below), and that is the step-level placement.
* Micro-step level (steps 4-5, ``refine_microstep``), starting from the
  previous micro-step's placement: the token split levels device loads over
  the replicas there are (``split.FlowGraph``); then, in a few vectorised
  rounds, each hot device (those whose relief pays for the copies it needs,
  ``_target_level``) may copy one of its experts into a nearly cold device,
  over a slot whose replica is least missed there. A move is taken only
  when the straggler time it saves exceeds the time the copy takes, and a
  device copies in only what hides under the overlap window of the previous
  micro-step's compute. Everything else stays where it is.

Copies made by the step-level anchor happen between RL steps (under rollout
and recompute), so they are not held to a micro-step's window; they are
counted in micro-step 0's moves.

The moves are greedy, one micro-step at a time, so a layer's moves can
cost more over the step than they save (a copy made for one micro-step's
skew is in the wrong place for the next). ``plan_step`` therefore also
plans each layer as ``foresight_split`` does (the refined anchor held for
every micro-step, its tokens split per micro-step, no moves: ForeMoE with
``max_rounds=0``) and keeps, per layer, the cheaper of the two under one
cost (``step_cost_s``): ForeMoE is never worse than foresight_split.

All layers are planned together (arrays over L); only the rounds and the
colours of the Gauss-Seidel split are Python loops.

Shape letters: M micro-steps, L layers, D devices, E experts, S slots,
P hot devices, Q cold devices, s slots per device (i on the hot device, k
on the cold one), R replicas of one expert.
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
  max_rounds: int = 4
  """Rounds of moves per micro-step; each round moves at most one expert
  out of each hot device and into each cold device."""
  pairs_per_round: int = 0
  """Most hot devices served per round and layer (0: half the devices)."""
  sweeps: int = 3
  """Gauss-Seidel sweeps of the token split before the first round."""
  round_sweeps: int = 1
  """Sweeps after each round of moves."""
  final_sweeps: int = 2
  """Sweeps of the layers that moved, once their placement is final."""
  max_moves_per_device: int | None = None
  """Hard cap on copies into one device per layer and micro-step, on top of
  the overlap window (None: the window alone)."""
  microstep_degree: int | None = None
  """The ``exact`` engine's budget between micro-steps (its degree,
  `TransferBudget.microstep_rounds`): per layer and transition, a device
  takes at most this many copies, sends at most this many (each copy
  charged to the source the transfer schedule would pick,
  `_claim_sources`) and gets at most this many gradients of evicted
  replicas home. Bounds each device where `moves_per_layer` bounds the
  whole layer; `guard.StepPlanner` sets it for the ``exact`` engine (None:
  no bound)."""
  prefer_local_node: bool = True
  """Sources send tokens to replicas on their own node first."""
  step_anchor: bool = True
  """Re-anchor layers on the step-level hierarchical placement when it pays."""
  anchor_tol: float = 0.02
  """Layers whose step-level max/mean is within this are not re-anchored."""
  band_cost_scale: float = 0.5
  """Which devices count as hot: bringing the j hottest down to the next
  load is deemed worth it when the straggler time saved exceeds j copies
  times this scale (below 1: one copy often relieves several devices,
  since the split then spreads the slack)."""
  warm_start: bool = True
  """Start each micro-step's split from the previous one's proportions."""
  home_anchor: bool = False
  """Anchor on `packing.home_anchored_placement` (experts stay home,
  replicas go to redundant slots) instead of the free hierarchical packing:
  right when the slots are refilled from home every step (the transfer
  engine), where an expert away from home is a copy every step."""
  moves_per_layer: int | None = None
  """Most copies into one layer between two micro-steps: the engine's
  `TransferBudget.microstep_rounds`. A copy adds at most one fill round and
  its eviction at most one return round, so the plan then always fits the
  budget and the best moves are kept, instead of the fit undoing arbitrary
  ones (None: no limit)."""
  anchor_rounds: int | None = None
  """Home-anchored: the transfer engine's round budget for the fill and the
  flush (`TransferBudget.step_rounds`); the anchor never places a replica
  that would need more, and (``exact``) no micro-step's moves or shed
  leave a placement whose flush would (None: no limit)."""
  transfer_mode: str = 'exact'
  """How the engine carries a home-anchored layout's fills and gradient
  returns (`TransferBudget.mode`), which is what the anchor pays for them:
  'exact', one ragged all-to-all each way, as long as its busiest device
  takes; 'rounds', one expert per cyclic-shift round, however many devices
  use it (`packing.anchored_transfer_tokens`)."""
  price_gradient_returns: bool = True
  """Price a copy as its weights plus the gradient it later sends home
  (`CostModel.return_factor`), and a home-anchored layout as the fill and
  flush it costs every step (`packing.anchored_transfer_tokens`; the
  packing itself prefers shifts already in use). False prices
  the weight copy alone (the planner before the cluster simulator showed
  replicas of large experts costing more in fills and flushes than they
  saved, and round-hungry placements failing the round budget)."""

  shed_tol: float = 0.02
  """The shed is tried on layers whose planned max/mean exceeds 1 plus
  this on average over the micro-steps (the others have little to gain,
  and the shed costs planning time)."""
  anchor_inter_node_weight: float = 1.0
  """Home-anchored on several nodes: the anchor places each replica on the
  device least loaded in compute rows plus this times the rows its slots
  take from other nodes, from the foresight's per-node demand
  (`packing.home_anchored_placement`'s `node_demand_LNE`), where the cost
  model prices the all-to-alls (`CostModel.row_bytes` > 0, as the
  simulator's does); without that price, or at 0, it packs on compute
  rows alone, as EPLB-step does (it has no per-node demand). At
  Qwen3-30B-A3B on 64 H100s the update's all-to-alls are three quarters
  of it and bound by inter-node rows; 1.0 was the best of 0.3-30 there
  (`simulate_cluster`'s ``foremoe_compute_anchor`` ablation is 0)."""
  shed: bool = True
  """Home-anchored: also plan each layer by `packing.shed_placement` per
  micro-step (every redundant slot re-chosen for the micro-step's loads,
  hot devices shedding through best-fit replicas) and keep, per layer, the
  cheaper of it and the moves (`step_cost_s`). The moves change a few
  slots per round from the last placement and stall where relief needs a
  chain of replicas; the shed finds those chains. It keeps the ``exact``
  engine's degree (`microstep_degree`), so it runs only where that is set;
  the ``rounds`` engine's per-layer budget is one it cannot keep."""
  anchor_refine_rounds: int = 4
  """Rounds of moves that refine the step-level anchor on the step's
  total loads (`refine_microstep` once, before the first micro-step):
  the anchor packs replicas by per-replica load, blind to the split that
  follows and to homes that cannot shed (at the benchmark's shape it left
  two devices at 1.25x the mean, and a redundant slot copying its own home
  expert); a few hot-to-cold copies fix that. The refined placement is
  what foresight_split holds for the whole step, and so what the
  recompute runs on (`guard.step_level`), and where ForeMoE's moves start;
  like the anchor's, its copies happen between RL steps and count in
  micro-step 0's moves. 0 (or no `step_anchor`): the anchor alone."""
  node_split_slack: float | None = None
  """Opt-in (None: off). On several nodes, where the cost model prices the
  all-to-alls (`CostModel.row_bytes` > 0): a last pass re-spreads each
  replicated expert's tokens towards replicas its own node's sources can
  fill (`split.node_aware_flows`), letting a device compute up to this
  much over the busiest one's load (0.1 measured best); a layer keeps it
  only where its exact compute + all-to-all seconds drop (`_take_cheaper`),
  and foresight_split, split the same way, is offered again where the
  moves' plan won. The placement and its copies are unchanged: only which
  replica takes how many tokens. Off by default: in the simulator it took
  Qwen3-30B-A3B on 64 H100s from 1.31x to 1.35x over EPLB-step, but at
  DeepSeek-V3-like on 256 it slowed the step by 0.3% (the planner's
  all-to-all price and the simulator's disagree there) and took planning
  from 0.23 to 0.59 of the recompute, past the half it may take.
  The step-level plan (the recompute's, on its critical path) never runs
  it."""

  def copy_price(self, cost: CostModel) -> float:
    """What a copy costs over its weights alone: with
    `price_gradient_returns`, the gradient it later sends home too."""
    return cost.return_factor if self.price_gradient_returns else 1.0

  def __post_init__(self):
    if self.transfer_mode not in ('exact', 'rounds'):
      raise ValueError(f"transfer_mode must be 'exact' or 'rounds', got "
                       f'{self.transfer_mode!r}.')
    if not self.shed_tol >= 0:
      raise ValueError(f'shed_tol must be >= 0, got {self.shed_tol}.')
    if self.node_split_slack is not None and not self.node_split_slack >= 0:
      raise ValueError(f'node_split_slack must be None or >= 0, got '
                       f'{self.node_split_slack}.')
    if not self.anchor_inter_node_weight >= 0:
      raise ValueError(f'anchor_inter_node_weight must be >= 0, got '
                       f'{self.anchor_inter_node_weight}.')
    if not self.anchor_refine_rounds >= 0:
      raise ValueError(f'anchor_refine_rounds must be >= 0, got '
                       f'{self.anchor_refine_rounds}.')
    for name in ('microstep_degree', 'moves_per_layer', 'anchor_rounds',
                 'max_moves_per_device'):
      value = getattr(self, name)
      if value is not None and value < 1:
        raise ValueError(f'{name} must be None or >= 1, got {value}.')


def _move_tokens(new_LS, prev_LS, topo: Topology, cost: CostModel):
  """Cost of going from prev to new, in token-assignments per layer: [L]."""
  intra_LD, inter_LD = packing.new_copies_by_link(new_LS, prev_LS, topo)
  return (intra_LD * cost.move_tokens(False)
          + inter_LD * cost.move_tokens(True)).sum(axis=1)


def step_anchor(graph: split.FlowGraph, current_LS, topo: Topology,
                cost: CostModel, cfg: ForeMoEConfig, node_demand_LNE=None):
  """Per layer, the current placement or the step-level hierarchical one.

  `graph` holds the current placement with the step's total loads. Layers
  whose step-level balance (with the best split) is within `anchor_tol` keep
  their placement; for the others the hierarchical placement (steps 1-3) is
  adopted when the step's straggler load it removes is worth more than
  copying it in (home-anchored: more than filling and flushing its replicas,
  which happens every step). node_demand_LNE: the step's tokens per layer,
  source node and expert, which the home-anchored packing weighs
  (`ForeMoEConfig.anchor_inter_node_weight`; None: compute rows alone).
  Returns (slot_expert [L, S], changed layers [L]).
  """
  current_LS = np.asarray(current_LS, np.int64)
  changed_L = np.zeros(current_LS.shape[0], bool)
  sweeps = cfg.sweeps + cfg.final_sweeps
  _, y_cur_LD = graph.sweep(graph.initial_flows(), sweeps)
  bad = np.flatnonzero(placement_lib.max_over_mean(y_cur_LD)
                       > 1 + cfg.anchor_tol)
  if not len(bad):
    return current_LS, changed_L
  w_LE = graph.w_LE[bad]
  if cfg.home_anchor:
    target_LS = packing.home_anchored_placement(
        w_LE, topo, cost if cfg.price_gradient_returns else None,
        cfg.anchor_rounds,
        node_demand_LNE=(None if node_demand_LNE is None
                         else np.asarray(node_demand_LNE)[bad]),
        inter_node_weight=cfg.anchor_inter_node_weight)
  else:
    target_LS = packing.hierarchical_placement(w_LE, topo)
    target_LS = packing.align_to_current(target_LS, current_LS[bad], topo)
  _, y_tgt_LD = split.balanced_flows(target_LS, w_LE, topo, sweeps=sweeps)
  gain_L = y_cur_LD[bad].max(axis=1) - y_tgt_LD.max(axis=1)
  if cfg.home_anchor and cfg.price_gradient_returns:
    # The replicas are filled and flushed every step: the anchor pays for
    # those transfers in full, priced as the engine carries them
    # (`transfer_mode`). In full is conservative: the recompute's prefill
    # and the last backward hide some of them.
    def price(se_LS):
      fill_L, ret_L = packing.anchored_transfer_tokens(
          se_LS, graph.w_LE.shape[1], topo, cost, cfg.transfer_mode)
      return fill_L + ret_L

    price_L = price(target_LS) - price(current_LS[bad])
  else:
    price_L = _move_tokens(target_LS, current_LS[bad], topo, cost)
  adopt = gain_L > price_L
  out_LS = current_LS.copy()
  out_LS[bad[adopt]] = target_LS[adopt]
  changed_L[bad[adopt]] = True
  return out_LS, changed_L


def _target_level(y_LD, move_tokens: float, cfg: ForeMoEConfig):
  """Load level above which devices should shed load, per layer: [L].

  Bringing the j hottest devices down to the (j+1)-th load shortens the
  straggler by the gap at the cost of about j copies; the level is the one
  where that pays most (never below mean * (1 + balance_tol)). Many devices
  slightly above the rest are thus left alone: fixing all of them would
  cost more copies than the straggler time it saves.
  """
  num_devices = y_LD.shape[1]
  floor_L = y_LD.mean(axis=1) * (1 + cfg.balance_tol)
  if num_devices < 2:
    return np.maximum(y_LD[:, 0], floor_L)
  desc_LD = -np.sort(-y_LD, axis=1)
  j = np.arange(1, num_devices)
  net_LJ = (desc_LD[:, :1] - desc_LD[:, 1:]) - j * move_tokens
  best_L = np.argmax(net_LJ, axis=1)
  level_L = np.where(net_LJ[np.arange(len(y_LD)), best_L] > 0,
                     desc_LD[np.arange(len(y_LD)), best_L + 1], desc_LD[:, 0])
  return np.maximum(level_L, floor_L)


def _propose_moves(layers, se_LS, x_LS, y_LD, graph: split.FlowGraph,
                   budget_LD, moves_LD, topo: Topology, cost: CostModel,
                   cfg: ForeMoEConfig, returns_LD=None, away=None):
  """One round of moves in the given layers, at most one per cold device:
  accepted (layer, slot, expert, device, cost) arrays. returns_LD:
  gradients of evicted replicas each home gets this transition so far
  (`ForeMoEConfig.microstep_degree`); away: `_away_counts` of the
  placement, when the flush's degree is bounded (`anchor_rounds`)."""
  # Work on the active layers only (later rounds have few).
  se_LS, x_LS, y_LD = se_LS[layers], x_LS[layers], y_LD[layers]
  budget_LD, moves_LD = budget_LD[layers], moves_LD[layers]
  degree = cfg.microstep_degree
  if degree is not None:
    returns_LD = returns_LD[layers]
  count_LE = graph.count_LE[layers]
  table_LER, valid_LER = graph.table_LER[layers], graph.valid_LER[layers]
  num_layers = len(layers)
  num_devices, s = topo.num_devices, topo.slots_per_device
  mean_L = y_LD.mean(axis=1)
  cheapest = float(cost.move_tokens(False))
  hot_LD = y_LD > _target_level(y_LD, cfg.band_cost_scale * cheapest, cfg)[:, None]
  # Pairs per layer from its own hot devices; arrays are padded to the
  # largest, and a layer's padding is masked, so no layer's moves depend
  # on another's (`planner.layers` plans chunks of layers apart).
  max_pairs = min(cfg.pairs_per_round or num_devices // 2, num_devices // 2)
  n_pairs_L = np.minimum(hot_LD.sum(axis=1), max_pairs)
  n_pairs = int(n_pairs_L.max())
  empty = (np.zeros(0, np.int64),) * 4 + (np.zeros(0),)
  if n_pairs < 1:
    return empty
  lk = np.arange(num_layers)[:, None]
  l3 = lk[:, :, None]
  count_LS = count_LE[lk, se_LS]
  evictable_LS = count_LS >= 2
  cap = min(np.inf if cfg.max_moves_per_device is None
            else cfg.max_moves_per_device,
            np.inf if degree is None else degree)
  can_take_LD = (evictable_LS.reshape(num_layers, num_devices, s).any(axis=2)
                 & (budget_LD >= cheapest) & (moves_LD < cap) & ~hot_LD)
  hot_LP = np.argsort(-y_LD, axis=1, kind='stable')[:, :n_pairs]
  # Each hot device may pick among the few coldest devices that can take a
  # copy (the very coldest may only hold replicas whose eviction hurts).
  n_cold = min(n_pairs + 2, num_devices)
  cold_key_LD = np.where(can_take_LD, y_LD, np.inf)
  cold_LQ = np.argsort(cold_key_LD, axis=1, kind='stable')[:, :n_cold]
  hot_ok_LP = hot_LD[lk, hot_LP]
  cold_ok_LQ = (np.isfinite(cold_key_LD[lk, cold_LQ])
                & (np.arange(n_cold) < n_pairs_L[:, None] + 2))
  # Pair p may clash only with the hotter pairs before it.
  earlier_PP = np.tril(np.ones((n_pairs, n_pairs), bool), k=-1)
  if topo.num_nodes > 1:
    # And the coldest on each hot device's node: a copy over the node's own
    # link costs a fraction of one across nodes, so when the coldest devices
    # all sit on other nodes a near one a little warmer is the better buy.
    node_D = topo.node_of_device()
    near_key_LPD = np.where(node_D[None, None, :] == node_D[hot_LP][..., None],
                            cold_key_LD[:, None, :], np.inf)
    near_LP = np.argmin(near_key_LPD, axis=2)
    near_ok_LP = (np.isfinite(np.min(near_key_LPD, axis=2))
                  & (np.arange(n_pairs) < n_pairs_L[:, None])
                  & ~((near_LP[:, :, None] == cold_LQ[:, None, :])
                      & cold_ok_LQ[:, None, :]).any(axis=2)
                  & ~((near_LP[:, :, None] == near_LP[:, None, :])
                      & earlier_PP).any(axis=2))
    cold_LQ = np.concatenate([cold_LQ, near_LP], axis=1)
    cold_ok_LQ = np.concatenate([cold_ok_LQ, near_ok_LP], axis=1)
    n_cold = cold_LQ.shape[1]
  y_hot_LP, y_cold_LQ = y_LD[lk, hot_LP], y_LD[lk, cold_LQ]
  slot_hot_LPi = hot_LP[..., None] * s + np.arange(s)
  slot_cold_LQk = cold_LQ[..., None] * s + np.arange(s)
  e_hot_LPi, x_hot_LPi = se_LS[l3, slot_hot_LPi], x_LS[l3, slot_hot_LPi]
  e_cold_LQk, x_cold_LQk = se_LS[l3, slot_cold_LQk], x_LS[l3, slot_cold_LQk]
  # Evicting a replica sends its flow to the expert's other replicas; the
  # level they reach is the damage the eviction does.
  ev_ok_LQk = evictable_LS[l3, slot_cold_LQk] & cold_ok_LQ[..., None]
  h = count_LE.shape[1] // num_devices
  if degree is not None:
    # The evicted replica's gradient goes home, unless it is home already.
    home_LQk = e_cold_LQk // h
    ev_ok_LQk &= ((home_LQk == cold_LQ[..., None])
                  | (returns_LD[l3, home_LQk] < degree))
  rep_LQkR = table_LER[l3, e_cold_LQk]
  rep_ok_LQkR = (valid_LER[l3, e_cold_LQk] & ev_ok_LQk[..., None]
                 & (rep_LQkR != slot_cold_LQk[..., None]))
  base_LQkR = y_LD[l3[..., None], np.maximum(rep_LQkR, 0) // s]
  level_LQk = split.fill_level(base_LQkR, x_cold_LQk, rep_ok_LQkR)
  level_LQk = np.where(x_cold_LQk > 0, level_LQk, -np.inf)
  y_after_LQk = y_cold_LQ[..., None] - x_cold_LQk
  # Each cold device offers the slot whose eviction leaves the most room
  # without lifting the evicted expert's other replicas too high (judged
  # against the hottest device, for which it matters most).
  y_ref_L1 = y_hot_LP[:, :1]
  offer_LQk = np.where(ev_ok_LQk, np.maximum(
      level_LQk, 0.5 * (y_ref_L1[..., None] + y_after_LQk)), np.inf)
  k_LQ = np.argmin(offer_LQk, axis=2)
  offer_ok_LQ = np.isfinite(np.take_along_axis(offer_LQk, k_LQ[..., None], 2)
                            [..., 0])
  pick = lambda a_LQk: np.take_along_axis(a_LQk, k_LQ[..., None], 2)[..., 0]
  level_LQ, y_after_LQ = pick(level_LQk), pick(y_after_LQk)
  e_ev_LQ, slot_ev_LQ = pick(e_cold_LQk), pick(slot_cold_LQk)
  # Copy expert i of hot device p to cold device q: [L, P, Q, i].
  yh = y_hot_LP[:, :, None, None]
  shift = np.minimum(x_hot_LPi[:, :, None, :],
                     0.5 * (yh - y_after_LQ[:, None, :, None]))
  new_max = np.maximum(np.maximum(yh - shift, y_after_LQ[:, None, :, None]
                                  + shift), level_LQ[:, None, :, None])
  gain = yh - new_max
  holds_LDE = np.zeros((num_layers, num_devices, count_LE.shape[1]), bool)
  holds_LDE[lk, topo.device_of_slot()[None], se_LS] = True
  on_cold_LPQi = holds_LDE[l3[..., None], cold_LQ[:, None, :, None],
                           e_hot_LPi[:, :, None, :]]
  if topo.num_nodes > 1:
    # The copy comes from a replica on the cold device's node if there is one.
    node_of = topo.node_of_device()
    on_node_LNE = holds_LDE.reshape(num_layers, topo.num_nodes,
                                    topo.devices_per_node, -1).any(axis=2)
    inter_LPQi = ~on_node_LNE[l3[..., None], node_of[cold_LQ][:, None, :, None],
                              e_hot_LPi[:, :, None, :]]
    cost_LPQi = cost.move_tokens(inter_LPQi)
  else:
    cost_LPQi = np.full(on_cold_LPQi.shape, cheapest)
  budget_LQ = budget_LD[lk, cold_LQ]
  ok = (hot_ok_LP[:, :, None, None]
        & offer_ok_LQ[:, None, :, None]
        & ~on_cold_LPQi
        & (e_hot_LPi[:, :, None, :] != e_ev_LQ[:, None, :, None])
        & (x_hot_LPi[:, :, None, :] > 0)
        & (y_cold_LQ[:, None, :] < y_hot_LP[:, :, None])[..., None]
        & (cost_LPQi <= budget_LQ[:, None, :, None])
        & (gain > cfg.min_gain_frac * mean_L[:, None, None, None]))
  if away is not None:
    # The placement after the copy must still flush within the budget.
    ok &= _flush_fits(l3[..., None], e_hot_LPi[:, :, None, :],
                      e_ev_LQ[:, None, :, None], cold_LQ[:, None, :, None],
                      away[0][layers], away[1][layers], cfg.anchor_rounds, h)
  # The copy's bytes fit the window; its price also counts the gradient it
  # sends home later (at eviction or at the final flush).
  price = cfg.copy_price(cost)
  net = np.where(ok, gain - price * cost_LPQi, -np.inf)
  # Hottest device chooses first; a cold device takes one copy per round,
  # an expert loses one replica per round (so never its last).
  best_LPQ = np.argmax(net, axis=3)
  best_net_LPQ = np.take_along_axis(net, best_LPQ[..., None], 3)[..., 0]
  # Each hot device takes its best cold device; when several pick the same
  # cold device or evict the same expert, the hottest wins and the others
  # choose again among what is left (so an expert never loses its last
  # replica in one round).
  free_LPQ = np.ones(best_net_LPQ.shape, bool)
  done_LP = np.zeros((num_layers, n_pairs), bool)
  picks = []
  for _ in range(3):
    net_LPQ = np.where(free_LPQ & ~done_LP[..., None], best_net_LPQ, -np.inf)
    q_LP = np.argmax(net_LPQ, axis=2)
    take_LP = np.take_along_axis(net_LPQ, q_LP[..., None], 2)[..., 0] > 0
    if not take_LP.any():
      break
    ev_LP = np.take_along_axis(e_ev_LQ, q_LP, 1)
    same = ((q_LP[:, :, None] == q_LP[:, None, :])
            | (ev_LP[:, :, None] == ev_LP[:, None, :]))
    if degree is not None:
      # One remote return per home per round keeps homes within degree.
      home_LP = np.where(ev_LP // h != np.take_along_axis(cold_LQ, q_LP, 1),
                         ev_LP // h, -1 - np.arange(n_pairs))
      same |= home_LP[:, :, None] == home_LP[:, None, :]
    clash = same & take_LP[:, None, :] & earlier_PP
    take_LP &= ~clash.any(axis=2)
    layer, p = np.nonzero(take_LP)
    picks.append((layer, p, q_LP[layer, p]))
    done_LP[layer, p] = True
    # Cold devices taken and experts evicted are off the table for the rest.
    taken_LQ = np.zeros((num_layers, n_cold), bool)
    taken_LQ[layer, q_LP[layer, p]] = True
    evicted_LE = np.zeros(count_LE.shape, bool)
    evicted_LE[layer, ev_LP[layer, p]] = True
    free_LPQ &= ~(taken_LQ | evicted_LE[lk, e_ev_LQ])[:, None, :]
  if not picks:
    return empty
  layer, p, q = (np.concatenate(v) for v in zip(*picks))
  if not len(layer):
    return empty
  i = best_LPQ[layer, p, q]
  return (np.asarray(layers)[layer], slot_ev_LQ[layer, q],
          e_hot_LPi[layer, p, i], cold_LQ[layer, q], cost_LPQi[layer, p, q, i])


def _rank_in_layer(layer):
  """Each proposal's rank among its layer's, in proposal order: [N]."""
  order = np.argsort(layer, kind='stable')
  first = np.r_[True, layer[order][1:] != layer[order][:-1]]
  pos = np.arange(len(order))
  rank = np.empty_like(pos)
  rank[order] = pos - np.maximum.accumulate(np.where(first, pos, 0))
  return rank


def _claim_sources(layer, expert, device, held_LDE, sends_LD, degree: int,
                   topo: Topology):
  """Which proposed copies a source can still send within `degree`, as the
  ``exact`` schedule picks sources (`transfer.schedule`: the devices that
  held the expert before the transition and its home, those on the
  receiver's node if any, the one sending least so far); claims their
  sends in `sends_LD` (updated in place). Moves are taken in order, one
  per layer at a time (the schedule's waves). Returns a keep mask."""
  h = held_LDE.shape[2] // topo.num_devices
  node_D = topo.node_of_device()
  rank = _rank_in_layer(layer)
  keep = np.zeros(len(layer), bool)
  for wave in range(int(rank.max()) + 1):
    n = np.flatnonzero(rank == wave)
    cand_nD = held_LDE[layer[n], :, expert[n]]
    cand_nD[np.arange(len(n)), expert[n] // h] = True
    if topo.num_nodes > 1:
      near_nD = node_D[None, :] == node_D[device[n]][:, None]
      cand_nD &= near_nD | ~(cand_nD & near_nD).any(axis=1, keepdims=True)
    load_nD = np.where(cand_nD, sends_LD[layer[n]], np.iinfo(np.int64).max)
    c_n = load_nD.argmin(axis=1)
    ok = load_nD[np.arange(len(n)), c_n] < degree
    keep[n[ok]] = True
    sends_LD[layer[n[ok]], c_n[ok]] += 1
  return keep


def _fits_returns(layer, home, device, returns_LD, degree: int):
  """Which proposed copies' evictions can still send their gradient home
  within `degree` (a replica evicted on its home device sends nothing):
  `_propose_moves` checks each against the returns before the round, so
  two in one round may return to one home. Taken in order, one per layer
  at a time, as `_claim_sources` takes them; returns_LD is not changed
  (the caller counts the moves it keeps). Returns a keep mask."""
  returns_LD = returns_LD.copy()
  rank = _rank_in_layer(layer)
  keep = np.ones(len(layer), bool)
  remote = home != device
  for wave in range(int(rank.max()) + 1):
    n = np.flatnonzero((rank == wave) & remote)
    ok = returns_LD[layer[n], home[n]] < degree
    keep[n[~ok]] = False
    returns_LD[layer[n[ok]], home[n[ok]]] += 1
  return keep


def _away_counts(se_LS, topo: Topology, num_experts: int):
  """What the flush of a placement sends, per layer and device: (slots
  away from its home holding the device's experts [L, D], the gradients
  it gets home; the device's slots holding experts homed elsewhere [L, D],
  those it sends). Their max is the ``exact`` flush's degree, and that of
  a fill from empty buffers (`transfer.schedule`: every replica away from
  home straight from / to it)."""
  h = num_experts // topo.num_devices
  num_layers = se_LS.shape[0]
  dev_S = topo.device_of_slot()
  away_LS = se_LS // h != dev_S
  l_N, j_N = np.nonzero(away_LS)
  recv_LD = np.zeros((num_layers, topo.num_devices), np.int64)
  send_LD = np.zeros_like(recv_LD)
  np.add.at(recv_LD, (l_N, se_LS[l_N, j_N] // h), 1)
  np.add.at(send_LD, (l_N, dev_S[j_N]), 1)
  return recv_LD, send_LD


def _flush_fits(layer, expert, evicted, device, recv_LD, send_LD,
                cap: int, h: int):
  """Whether copying `expert` into `device` over a slot of `evicted`
  (arrays that broadcast together) leaves the flush within `cap`
  (`_away_counts` before it: the copy adds one away replica unless it is
  home, the eviction removes one unless it was)."""
  home_new, home_old = expert // h, evicted // h
  add, sub = home_new != device, home_old != device
  recv_new = (recv_LD[layer, home_new] + add
              - (sub & (home_old == home_new)))
  send_new = send_LD[layer, device] + add - sub
  return (recv_new <= cap) & (send_new <= cap)


def _fits_flush(layer, expert, evicted, device, away, cap: int, h: int):
  """Which proposed moves keep the flush within `cap` when taken in
  order, one per layer at a time (`_fits_returns`' waves; two moves of
  one round may add to one home). Returns a keep mask."""
  recv_LD, send_LD = (x.copy() for x in away)
  rank = _rank_in_layer(layer)
  keep = np.zeros(len(layer), bool)
  for wave in range(int(rank.max()) + 1):
    n = np.flatnonzero(rank == wave)
    l, e, v, d = layer[n], expert[n], evicted[n], device[n]
    ok = _flush_fits(l, e, v, d, recv_LD, send_LD, cap, h)
    keep[n[ok]] = True
    l, e, v, d = l[ok], e[ok], v[ok], d[ok]
    np.add.at(recv_LD, (l[e // h != d], e[e // h != d] // h), 1)
    np.add.at(recv_LD, (l[v // h != d], v[v // h != d] // h), -1)
    np.add.at(send_LD, (l, d), (e // h != d).astype(np.int64)
              - (v // h != d))
  return keep


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
  # Balanced layers stop sweeping early; the others get all `sweeps`.
  x_LS, y_LD = graph.sweep(graph.initial_flows(frac_LS), min(cfg.sweeps, 2))
  for _ in range(cfg.sweeps - 2):
    unbalanced = np.flatnonzero(placement_lib.max_over_mean(y_LD)
                                > 1 + cfg.balance_tol)
    if not len(unbalanced):
      break
    x_LS, y_LD = graph.sweep(x_LS, 1, layers=unbalanced)
  if window_L is None:
    window_L = cost.overlap * y_LD.max(axis=1)
  budget_LD = np.repeat(np.asarray(window_L, np.float64)[:, None],
                        topo.num_devices, 1)
  moves_LD = np.zeros((num_layers, topo.num_devices), np.int64)
  sends_LD, returns_LD = np.zeros_like(moves_LD), np.zeros_like(moves_LD)
  h = w_LE.shape[1] // topo.num_devices
  if cfg.microstep_degree is not None:
    # The transition's copies come from what devices held before it.
    held_LDE = np.zeros((num_layers, topo.num_devices, w_LE.shape[1]), bool)
    held_LDE[np.arange(num_layers)[:, None], topo.device_of_slot()[None],
             se_LS] = True
  active_L = np.ones(num_layers, bool)
  moved_LE = np.zeros(w_LE.shape, bool)
  for _ in range(cfg.max_rounds):
    active_L &= (placement_lib.max_over_mean(y_LD) > 1 + cfg.balance_tol)
    if not active_L.any():
      break
    away = (None if cfg.anchor_rounds is None or cfg.transfer_mode != 'exact'
            else _away_counts(se_LS, topo, w_LE.shape[1]))
    layer, slot, expert, device, tokens = _propose_moves(
        np.flatnonzero(active_L), se_LS, x_LS, y_LD, graph, budget_LD,
        moves_LD, topo, cost, cfg, returns_LD, away)
    if away is not None and len(layer):
      keep = _fits_flush(layer, expert, se_LS[layer, slot], device, away,
                         cfg.anchor_rounds, h)
      layer, slot, expert, device, tokens = (
          a[keep] for a in (layer, slot, expert, device, tokens))
    if cfg.moves_per_layer is not None and len(layer):
      # Keep each layer's first proposals (hottest devices first) up to its cap.
      keep = (_rank_in_layer(layer)
              < cfg.moves_per_layer - moves_LD[layer].sum(axis=1))
      layer, slot, expert, device, tokens = (
          a[keep] for a in (layer, slot, expert, device, tokens))
    if cfg.microstep_degree is not None and len(layer):
      keep = _fits_returns(layer, se_LS[layer, slot] // h, device, returns_LD,
                           cfg.microstep_degree)
      layer, slot, expert, device, tokens = (
          a[keep] for a in (layer, slot, expert, device, tokens))
      keep = _claim_sources(layer, expert, device, held_LDE, sends_LD,
                            cfg.microstep_degree, topo)
      layer, slot, expert, device, tokens = (
          a[keep] for a in (layer, slot, expert, device, tokens))
    moved_L = np.zeros(num_layers, bool)
    moved_L[layer] = True
    active_L &= moved_L
    if cfg.moves_per_layer is not None:
      full_L = moves_LD.sum(axis=1) + np.bincount(
          layer, minlength=num_layers) >= cfg.moves_per_layer
      active_L &= ~full_L
    if not len(layer):
      break
    evicted = se_LS[layer, slot]
    x_LS = x_LS.copy()
    x_LS[layer, slot] = 0.0
    se_LS[layer, slot] = expert
    np.add.at(moves_LD, (layer, device), 1)
    remote = evicted // h != device
    np.add.at(returns_LD, (layer[remote], evicted[remote] // h), 1)
    np.add.at(budget_LD, (layer, device), -tokens)
    # The copied and the evicted experts are water-filled over their new
    # replicas; everyone else is swept with the micro-step's first colouring,
    # which is still valid for experts whose replicas did not change.
    graph = split.FlowGraph(se_LS, w_LE, topo)
    pairs = np.unique(np.concatenate([
        np.stack([layer, expert], 1), np.stack([layer, evicted], 1)]), axis=0)
    moved_LE[pairs[:, 0], pairs[:, 1]] = True
    x_LS, y_LD = graph.refill(x_LS, pairs[:, 0], pairs[:, 1])
    x_LS, y_LD = start_graph.sweep(x_LS, cfg.round_sweeps, skip_LE=moved_LE,
                                   layers=np.unique(layer))
  if moved_LE.any():
    # Layers without moves keep their first sweeps' split.
    moved_L = moved_LE.any(axis=1)
    graph.colour_like(start_graph, moved_L)
    x_LS, y_LD = graph.sweep(x_LS, cfg.final_sweeps,
                             layers=np.flatnonzero(moved_L))
  return graph, x_LS, y_LD


def step_cost_s(loads_MLD, slot_expert_MLS, current_LS, topo: Topology,
                cost: CostModel, copy_price: float = 1.0) -> np.ndarray:
  """Seconds one layer's plan costs over the step: [L].

  What ForeMoE trades: per micro-step the straggler's expert compute
  (`token_time_s` times the busiest device's load), plus the copy time not
  hidden under the previous micro-step's compute (the busiest receiver's
  copies beyond `overlap` of that micro-step's straggler compute); plus
  micro-step 0's copies from `current_LS` in full (the step-level fill,
  which no compute of this step hides). A copy takes `move_time_s`
  (inter-node when no replica of its expert was on the receiver's node
  before) times `copy_price` (`CostModel.return_factor` when the gradient
  it later sends home is priced, as ForeMoE prices its moves).

  Args:
    loads_MLD: tokens each device computes (a StepPlan's, or flows' sums).
    slot_expert_MLS: the placement of each micro-step.
    current_LS: the placement before the step.
  """
  copy_ML = _copy_s(slot_expert_MLS, current_LS, topo, cost, copy_price)
  return _step_cost_s(loads_MLD, copy_ML, cost)


def _copy_s(slot_expert_MLS, current_LS, topo: Topology, cost: CostModel,
            copy_price: float) -> np.ndarray:
  """The busiest receiver's copy seconds before each micro-step: [M, L]."""
  se_MLS = np.asarray(slot_expert_MLS)
  copy_ML = np.zeros(se_MLS.shape[:2])
  prev_LS = np.asarray(current_LS)
  for m in range(se_MLS.shape[0]):
    # Only layers whose placement changed copy anything.
    ls = np.flatnonzero((se_MLS[m] != prev_LS).any(axis=1))
    if len(ls):
      intra_LD, inter_LD = packing.new_copies_by_link(se_MLS[m, ls],
                                                      prev_LS[ls], topo)
      copy_ML[m, ls] = copy_price * (
          intra_LD * cost.move_time_s(False)
          + inter_LD * cost.move_time_s(True)).max(axis=1)
    prev_LS = se_MLS[m]
  return copy_ML


def _step_cost_s(loads_MLD, copy_ML, cost: CostModel) -> np.ndarray:
  """`step_cost_s` from the copy seconds `_copy_s` gives: [L]."""
  compute_ML = cost.token_time_s * np.asarray(loads_MLD, np.float64).max(axis=2)
  exposed_ML = copy_ML.copy()
  exposed_ML[1:] = np.maximum(copy_ML[1:] - cost.overlap * compute_ML[:-1],
                              0.0)
  return (compute_ML + exposed_ML).sum(axis=0)


def _rounding_slack_s(slot_expert_MLS, num_experts: int, max_count: float,
                      topo: Topology, cost: CostModel) -> np.ndarray:
  """How far `step_cost_s` of a plan's exact counts can be from that of its
  flows: [L].

  `split_tokens` rounds each (source, replica) count of a replicated
  expert from its flow's share (cumulatively, so off by at most one token,
  plus a few float32 ulps of counts up to `max_count`); an expert with one
  slot takes its load exactly. A device's load is thus within D tokens per
  replicated slot it holds of its flows' sum, and so is each micro-step's
  straggler; the cost counts each straggler once and, through the overlap
  window, once more at `overlap` weight.
  """
  se_MLS = np.asarray(slot_expert_MLS, np.int64)
  num_micro, num_layers, num_slots = se_MLS.shape
  rows = np.arange(num_micro * num_layers)[:, None]
  flat = (rows * num_experts + se_MLS.reshape(-1, num_slots)).ravel()
  count_BS = np.bincount(flat, minlength=num_micro * num_layers * num_experts
                         )[flat].reshape(-1, num_slots)
  replicated_ML = (count_BS >= 2).reshape(
      num_micro, num_layers, topo.num_devices, -1).sum(axis=3).max(axis=2)
  per_count = 1.0 + 4.0 * max_count * 2.0 ** -24
  dev_ML = (per_count * topo.num_devices * replicated_ML
            * cost.token_time_s)
  return dev_ML.sum(axis=0) + cost.overlap * dev_ML[:-1].sum(axis=0)


def _a2a_s(loads_MLDE, slot_expert_MLS, slot_share_MLDS, topo: Topology,
           cost: CostModel) -> np.ndarray:
  """All-to-all seconds of each layer over the step (`CostModel.
  all_to_all_s` of the cells the placement's split makes): [L]."""
  node_D = topo.node_of_device()
  out = np.zeros(np.shape(loads_MLDE)[1])
  for m in range(np.shape(loads_MLDE)[0]):
    p = placement_lib.Placement(np.asarray(slot_expert_MLS[m]),
                                np.asarray(slot_share_MLDS[m]))
    out += cost.all_to_all_s(placement_lib.cell_counts(loads_MLDE[m], p),
                             node_D)
  return out


def _cheaper_per_layer(plan: StepPlan, loads_MLDE, flows_MLS, split_LS,
                       split_flows_MLS, current_LS, topo: Topology,
                       cost: CostModel, config: ForeMoEConfig) -> StepPlan:
  """`plan` with each layer replaced by the foresight_split plan (`split_LS`
  every micro-step, `split_flows_MLS`) where that costs less
  (`step_cost_s`); `from_split_L` records which layers were.

  Assembling the second plan's exact counts is the costly part, so layers
  whose flows already show ForeMoE cheaper by more than the counts'
  rounding can change (`_rounding_slack_s`, both plans) are decided on the
  flows; only the other layers are assembled and compared exactly.
  """
  num_micro, num_layers, num_slots = flows_MLS.shape
  se_MLS = np.asarray(plan.placement.slot_expert, np.int64)
  split_MLS = np.broadcast_to(split_LS, se_MLS.shape)
  from_split_L = np.zeros(num_layers, bool)
  differ_L = ((se_MLS != split_MLS) | (flows_MLS != split_flows_MLS)
              ).any(axis=(0, 2))
  if not differ_L.any():
    return plan._replace(from_split_L=from_split_L)
  price = config.copy_price(cost)
  cur_LS = np.asarray(current_LS)
  ours_copy_ML = _copy_s(se_MLS, cur_LS, topo, cost, price)
  theirs_copy_ML = _copy_s(split_MLS, cur_LS, topo, cost, price)
  by_device = lambda x_MLS: x_MLS.reshape(num_micro, num_layers,
                                          topo.num_devices, -1).sum(axis=3)
  num_experts, max_count = np.shape(loads_MLDE)[-1], float(loads_MLDE.max())
  slack_L = (_rounding_slack_s(se_MLS, num_experts, max_count, topo, cost)
             + _rounding_slack_s(split_MLS, num_experts, max_count, topo, cost))
  ours_L = _step_cost_s(by_device(flows_MLS), ours_copy_ML, cost)
  theirs_L = _step_cost_s(by_device(split_flows_MLS), theirs_copy_ML, cost)
  # With the all-to-all priced, compute alone decides nothing: every layer
  # whose plans differ is compared on exact counts.
  decided_L = ((ours_L + slack_L < theirs_L) if not cost.row_bytes
               else np.zeros(num_layers, bool))
  layers = np.flatnonzero(differ_L & ~decided_L)
  if not len(layers):
    return plan._replace(from_split_L=from_split_L)
  plan, taken = _take_cheaper(plan, loads_MLDE, layers, split_MLS[:, layers],
                              split_flows_MLS[:, layers], cur_LS[layers],
                              topo, cost, config, price)
  from_split_L[taken] = True
  return plan._replace(from_split_L=from_split_L)


def _take_cheaper(plan: StepPlan, loads_MLDE, layers, alt_MLS, alt_flows_MLS,
                  cur_LS, topo: Topology, cost: CostModel,
                  config: ForeMoEConfig, price: float
                  ) -> tuple[StepPlan, np.ndarray]:
  """(`plan` with layers `layers` replaced by another placement where its
  exact counts cost less, the layers replaced).

  alt_MLS, alt_flows_MLS, cur_LS: the other plan's placements and flows,
  and the placement before the step, of `layers` only. Both plans are
  priced on exact counts (`step_cost_s`, plus the all-to-alls when
  `row_bytes` is set); the other plan's are assembled here, the costly
  part, which is why callers pass only the layers worth it."""
  alt = assemble_plan(loads_MLDE[:, layers], alt_MLS, alt_flows_MLS, topo,
                      cost, cur_LS, config.prefer_local_node)

  def cost_L(p_MLS, loads_MLD, share_MLDS):
    out = step_cost_s(loads_MLD, p_MLS, cur_LS, topo, cost, price)
    if cost.row_bytes:
      out = out + _a2a_s(loads_MLDE[:, layers], p_MLS, share_MLDS, topo, cost)
    return out

  ours_L = cost_L(np.asarray(plan.placement.slot_expert)[:, layers],
                  plan.loads_MLD[:, layers],
                  np.asarray(plan.placement.slot_share)[:, layers])
  theirs_L = cost_L(np.asarray(alt.placement.slot_expert), alt.loads_MLD,
                    alt.placement.slot_share)
  take = theirs_L < ours_L
  if not take.any():
    return plan, layers[take]
  return _merged(plan, alt, layers[take], take, cost), layers[take]


def _merged(plan: StepPlan, alt: StepPlan, layers, take, cost: CostModel
            ) -> StepPlan:
  """`plan` with layers `layers` taken from `alt`, whose layer axis holds
  `take`'s True entries (alt may cover only some layers)."""

  def merged(ours, theirs):
    out = np.array(ours)
    out[:, layers] = np.asarray(theirs)[:, take]
    return out

  moves_MLD = merged(plan.moves_MLD, alt.moves_MLD)
  return plan._replace(
      placement=placement_lib.Placement(
          merged(plan.placement.slot_expert, alt.placement.slot_expert),
          merged(plan.placement.slot_share, alt.placement.slot_share)),
      loads_MLD=merged(plan.loads_MLD, alt.loads_MLD),
      slot_loads_MLS=merged(plan.slot_loads_MLS, alt.slot_loads_MLS),
      max_cell_ML=merged(plan.max_cell_ML, alt.max_cell_ML),
      moves_MLD=moves_MLD,
      bytes_moved_M=moves_MLD.sum(axis=(1, 2)) * float(cost.bytes_per_expert))


def _shed_per_layer(plan: StepPlan, loads_MLDE, w_MLE, start_LS, current_LS,
                    topo: Topology, cost: CostModel, config: ForeMoEConfig
                    ) -> StepPlan:
  """`plan` with each layer replaced by the shed plan where that costs
  less (`step_cost_s`, plus the all-to-alls when `row_bytes` is set): per
  micro-step, `packing.shed_placement` from the micro-step before (the
  step's anchor `start_LS` for the first) and its balanced split.
  Home-anchored planning only: the shed keeps every expert home."""
  # Only layers the moves left short of balance are tried.
  tried = np.flatnonzero(
      (placement_lib.max_over_mean(plan.loads_MLD) - 1.0).mean(axis=0)
      > config.shed_tol)
  if not len(tried):
    return plan
  num_micro = w_MLE.shape[0]
  sweeps = config.sweeps + config.final_sweeps
  # The shed charges each copy to its expert's home, but the schedule may
  # source it from another holder on the receiver's node, which can then
  # send more than the degree: such a layer's transition reverts its
  # least useful new slots to the micro-step before until it fits
  # (`schedule.fit_layers`), before the split and the costing, so what the
  # planner returns fits the engine's budget between micro-steps and the
  # next micro-step sheds from what is really there.
  # (Imported here: transfer.schedule imports the planner package.)
  from foremoe_jax.transfer import schedule  # pylint: disable=g-import-not-at-top
  num_experts = w_MLE.shape[2]
  # Each placement must also flush (and so fill from empty buffers) within
  # the step's budget; the anchor it starts from does.
  flush_rounds = config.anchor_rounds
  se_list, x_list, prev_LS = [], [], np.asarray(start_LS)[tried]
  for m in range(num_micro):
    se_LS = packing.shed_placement(w_MLE[m, tried], prev_LS, topo,
                                   config.microstep_degree).astype(np.int64)
    over_L = np.zeros(len(tried), bool)
    if m > 0:
      over_L |= schedule.rounds_needed(
          prev_LS, se_LS, num_experts, topo, config.transfer_mode
      ) > config.microstep_degree
    if flush_rounds is not None:
      over_L |= schedule.rounds_needed(
          se_LS, None, num_experts, topo, config.transfer_mode) > flush_rounds
    bad = np.flatnonzero(over_L)
    if len(bad):
      # Micro-step 0's transition is the fill, under the step's budget.
      se_LS[bad] = schedule.fit_layers(
          prev_LS[bad], se_LS[bad], prev_LS[bad],
          config.microstep_degree if m > 0 else np.inf, num_experts, topo,
          config.transfer_mode, flush_rounds)
    x_LS, _ = split.balanced_flows(se_LS, w_MLE[m, tried], topo,
                                   sweeps=sweeps)
    se_list.append(se_LS)
    x_list.append(x_LS)
    prev_LS = se_LS
  se_MLS, x_MLS = np.stack(se_list), np.stack(x_list)
  ours_MLS = np.asarray(plan.placement.slot_expert, np.int64)[:, tried]
  price = config.copy_price(cost)
  cur_LS = np.asarray(current_LS)[tried]
  # Assembling exact counts is the costly part: only layers whose flows
  # already beat ForeMoE's exact counts on compute and copies are.
  flows_L = _step_cost_s(
      x_MLS.reshape(*x_MLS.shape[:2], topo.num_devices, -1).sum(axis=3),
      _copy_s(se_MLS, cur_LS, topo, cost, price), cost)
  ours_all_L = _step_cost_s(plan.loads_MLD[:, tried],
                            _copy_s(ours_MLS, cur_LS, topo, cost, price), cost)
  sub = np.flatnonzero((se_MLS != ours_MLS).any(axis=(0, 2))
                       & (flows_L < ours_all_L))
  if not len(sub):
    return plan
  return _take_cheaper(plan, loads_MLDE, tried[sub], se_MLS[:, sub],
                       x_MLS[:, sub], cur_LS[sub], topo, cost, config,
                       price)[0]


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
    The StepPlan: placements, predicted loads, moves and bytes; per layer
    ForeMoE's own or, where that costs more (`step_cost_s`), the
    foresight_split plan (`StepPlan.from_split_L`; with `max_rounds=0`
    the two are the same and no choice is made).
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
  graph = split.FlowGraph(cur_LS, w_MLE.sum(axis=0), topo)
  if config.step_anchor:
    node_demand_LNE = None
    if (config.home_anchor and cost.row_bytes and topo.num_nodes > 1
        and config.anchor_inter_node_weight > 0):
      # Rows crossing nodes count where the all-to-alls are priced.
      node_demand_LNE = split.node_demand(
          loads_MLDE.sum(axis=0, dtype=np.float64), topo)
    se_LS, changed_L = step_anchor(graph, cur_LS, topo, cost, config,
                                   node_demand_LNE)
    if changed_L.any():
      anchored = split.FlowGraph(se_LS, w_MLE[0], topo)
      anchored.colour_like(graph, changed_L)
      graph = anchored
  if config.step_anchor and config.anchor_refine_rounds:
    graph = refine_microstep(
        graph, w_MLE.sum(axis=0), topo, cost,
        dataclasses.replace(config, max_rounds=config.anchor_refine_rounds))[0]
  start_LS = graph.slot_expert_LS
  # foresight_split, planned alongside: the same refined anchor, no moves.
  with_split = config.max_rounds > 0
  no_moves = dataclasses.replace(config, max_rounds=0)
  split_graph, split_frac_LS, split_x_list = graph, None, []
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
    if with_split:
      split_graph, x_LS, _ = refine_microstep(split_graph, w_MLE[m], topo, cost,
                                              no_moves, split_frac_LS)
      split_x_list.append(x_LS)
      if config.warm_start:
        split_frac_LS = _fractions(x_LS, split_graph.slot_expert_LS, w_MLE[m])
  flows_MLS = np.stack(x_list)
  plan = assemble_plan(loads_MLDE, np.stack(se_list), flows_MLS, topo, cost,
                       cur_LS, config.prefer_local_node)
  if (with_split and config.home_anchor and config.shed
      and config.microstep_degree is not None):
    # Moves allowed only: foresight_split (max_rounds=0) holds its anchor.
    plan = _shed_per_layer(plan, loads_MLDE, w_MLE, start_LS, cur_LS, topo,
                           cost, config)
  split_LS = split_flows_MLS = None
  if with_split:
    split_LS, split_flows_MLS = split_graph.slot_expert_LS, np.stack(
        split_x_list)
    plan = _cheaper_per_layer(plan, loads_MLDE, flows_MLS, split_LS,
                              split_flows_MLS, cur_LS, topo, cost, config)
  if (config.node_split_slack is not None and cost.row_bytes
      and topo.num_nodes > 1):
    plan = _node_split(plan, loads_MLDE, cur_LS, topo, cost, config,
                       split_LS, split_flows_MLS)
  return plan


def _node_split_flows(se_MLS, x_MLS, loads_MLDE, topo: Topology,
                      cost: CostModel, config: ForeMoEConfig):
  """`split.node_aware_flows` of every micro-step: (flows [M, L, S],
  changed [L]: layers whose flows changed in some micro-step)."""
  # A row received from another node, in rows of expert compute.
  remote_weight = (cost.a2a_passes * cost.row_bytes / cost.inter_node_bw
                   / cost.token_time_s)
  new_list, changed_L = [], np.zeros(np.shape(se_MLS)[1], bool)
  for m in range(np.shape(se_MLS)[0]):
    x_LS, kept_L = split.node_aware_flows(
        se_MLS[m], x_MLS[m], loads_MLDE[m], topo, remote_weight,
        config.node_split_slack)
    new_list.append(x_LS)
    changed_L |= ~kept_L
  return np.stack(new_list), changed_L


def _node_split(plan: StepPlan, loads_MLDE, cur_LS, topo: Topology,
                cost: CostModel, config: ForeMoEConfig, split_LS=None,
                split_flows_MLS=None) -> StepPlan:
  """`plan` with each layer's tokens re-spread over its replicas by
  `split.node_aware_flows` where that lowers its exact compute +
  all-to-all seconds over the step (same placements, same copies).

  With the foresight_split plan (`split_LS`, its flows), that plan, split
  the same way, is offered again on the layers where the moves' plan had
  won: the split changes what each layer costs, and ForeMoE stays never
  worse than foresight_split."""
  se_MLS = np.asarray(plan.placement.slot_expert, np.int64)
  new_MLS, changed_L = _node_split_flows(
      se_MLS, np.asarray(plan.slot_loads_MLS, np.float64), loads_MLDE, topo,
      cost, config)
  layers = np.flatnonzero(changed_L)
  price = config.copy_price(cost)
  if len(layers):
    plan = _take_cheaper(plan, loads_MLDE, layers, se_MLS[:, layers],
                         new_MLS[:, layers], cur_LS[layers], topo, cost,
                         config, price)[0]
  if split_LS is None or plan.from_split_L.all():
    return plan
  own = np.flatnonzero(~plan.from_split_L)
  split_MLS = np.broadcast_to(split_LS[own],
                              (se_MLS.shape[0], len(own), topo.num_slots))
  # Re-spread from the split plan's exact counts, as foresight_split's own
  # pass does (from its assembled plan): from the raw flows the result
  # differed, and ForeMoE came out a hair dearer than foresight_split in a
  # layer it took from it (4e-5 of the layer's seconds on one trace).
  split_counts_MLS = assemble_plan(
      loads_MLDE[:, own], split_MLS, split_flows_MLS[:, own], topo, cost,
      cur_LS[own], config.prefer_local_node).slot_loads_MLS
  alt_MLS = _node_split_flows(split_MLS,
                              np.asarray(split_counts_MLS, np.float64),
                              loads_MLDE[:, own], topo, cost, config)[0]
  plan, taken = _take_cheaper(plan, loads_MLDE, own, split_MLS, alt_MLS,
                              cur_LS[own], topo, cost, config, price)
  from_split_L = plan.from_split_L.copy()
  from_split_L[taken] = True
  return plan._replace(from_split_L=from_split_L)