"""Predicted RL-step times of each balancing method on a simulated cluster.

The host side is not simulated: each method's plan for the step is made by
the repository's own planner (`planner.StepPlanner`, as the trainer makes
it), fitted to the transfer budget and scheduled into move rounds by the
repository's own transfer schedule, and its wall time is measured on this
machine (`plan_methods`); so is the step-level placement the recompute runs
on (`StepPlanner.step_level_plan`). Only the device side is modelled
(`time_step`, with `costs`): per micro-step the straggler's expert
compute, the token all-to-alls, the non-expert compute, and the expert
moves split into hidden and exposed; per step the recompute (the forwards
the step needs, on the method's step-level placement, filled first, with
the update's slots prefilled under it), the wait for the plan, the fill
(of what micro-step 0 changes, when prefilled) and flush of the slot
buffers (the flush inside the last micro-step's backward), the
gradient all-reduce (once per step) and the optimizer update; and the
per-device memory (`memory.update_memory`). The rollout is the same for
every method and is left out.

Dispatch modes model what the EP layer implements (`parallel.dispatch`):
'exact' (the default: a device computes the rows it receives) and
'padded' (every cell padded to the step's bucket).

Shape letters: M micro-steps, L MoE layers, D EP devices, E experts.
"""
from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import numpy as np

from foremoe_jax import config as config_lib
from foremoe_jax import placement as placement_lib
from foremoe_jax.model.grouped_swiglu import default_tile
from foremoe_jax.planner import foremoe, guard, layers
from foremoe_jax.planner import plan as plan_lib
from foremoe_jax.planner.plan import StepPlan
from foremoe_jax.planner.topology import CostModel, Topology
from foremoe_jax.sim import costs, memory
from foremoe_jax.sim.hardware import HardwareProfile
from foremoe_jax.sim.workload import ModelShape, Workload
from foremoe_jax.transfer import schedule

METHODS = guard.METHODS
# ForeMoE as it planned before the simulator (weight copies priced alone,
# shift rounds ignored), and ForeMoE whose anchor packs replicas on compute
# rows alone, blind to where the tokens come from
# (`ForeMoEConfig.anchor_inter_node_weight` = 0): ask for them by name to
# see what the fixes and the node-aware anchor add.
ABLATIONS = ('foremoe_before_fixes', 'foremoe_compute_anchor')
MODES = config_lib.DISPATCHES  # ('exact', 'padded'); exact is the default.
DEFAULT_MODE = 'exact'


@dataclasses.dataclass
class MethodPlan:
  """One method's host output for one step, as the trainer builds it."""

  plan: StepPlan
  transfer: schedule.StepTransfer
  capacity: dict  # Update bucket per dispatch mode.
  static_capacity: dict  # Home layout's bucket per dispatch mode.
  reverted: int
  # Planner + fit + move schedule, measured on this host; the bucket's
  # seconds are per dispatch mode (`bucket_s`), added by `time_step`.
  plan_s: float
  # The recompute's step-level placement (None: the home layout, no
  # transfer), its fill, its bucket per mode, and the host seconds to make
  # them (spent before the recompute is dispatched).
  recompute_plan: StepPlan | None = None
  recompute_transfer: schedule.StepTransfer | None = None
  recompute_capacity: dict | None = None
  recompute_plan_s: float = 0.0
  # Whether the recompute fills the policy's experts into its step-level
  # slots for the update (`transfer.prefill`): then `transfer`'s fill
  # starts from them and moves only micro-step 0's changes.
  prefilled: bool = False
  # Host seconds to pick the update's / the recompute's bucket, per mode
  # (the trainer picks one mode's; empty: counted in plan_s already).
  bucket_s: dict = dataclasses.field(default_factory=dict)
  recompute_bucket_s: dict = dataclasses.field(default_factory=dict)
  # Static EP's update on the canonical layout (`rl.step.CanonicalLayout`,
  # as the trainer runs it): no slots, fill, moves or returns; `transfer`
  # is then the home placement's, unused.
  canonical: bool = False
  # The deadline the update's plan ran under (None: none), and what missed
  # it: layers that took the recompute's step-level plan instead.
  deadline_s: float | None = None
  fell_back_layers: int = 0
  fallback_reason: str = ''


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
      overlap=0.5 * hw.transfer_overlap,  # The planner's default window.
      # The dispatch's rows, so ForeMoE's per-layer choice against
      # foresight_split sees the all-to-alls its moves change.
      row_bytes=float(model.d_model * model.bytes_per_param))


def default_budget(topo: Topology,
                   mode: str = 'exact') -> schedule.TransferBudget:
  """The trainer's defaults: the fill may take up to D rounds (every
  device's replicas from every home), 2 rounds between micro-steps."""
  return schedule.TransferBudget(step_rounds=topo.num_devices,
                                 microstep_rounds=2, mode=mode)


def _buckets(loads_MLDE, plan, buckets) -> tuple[dict, dict]:
  """(smallest bucket, host seconds to find it) per dispatch mode for
  these (one data group's) loads; plan: a StepPlan (as the trainer counts
  it, `plan.capacity_demand`) or one Placement for every micro-step."""
  loads_MGLDE = np.asarray(loads_MLDE)[:, None]
  out, seconds = {}, {}
  for mode in MODES:
    t0 = time.perf_counter()
    demand = plan_lib.capacity_demand(loads_MGLDE, plan, mode)
    out[mode] = config_lib.pick_bucket(demand, buckets[mode])
    seconds[mode] = time.perf_counter() - t0
    if demand > out[mode]:  # pick_bucket's last resort: it would drop.
      raise ValueError(f'{mode} dispatch: demand {demand} rows exceeds the '
                       f'largest bucket {out[mode]}; the buckets must come '
                       f'from the tokens the largest micro-batch holds '
                       f'(`shape_tokens`).')
  return out, seconds


def shape_tokens(loads_MLDE, top_k: int, nominal: int = 0) -> int:
  """Tokens per device the step's static shapes must hold: its largest
  micro-batch's (a device's loads sum to top_k rows per token), at least
  `nominal`. The capacity ladder's dropless bound is taken from it, as
  the trainer takes it from the batch it compiles for."""
  most = int(np.asarray(loads_MLDE).sum(axis=-1).max()) // top_k
  return max(int(nominal), most)


def _best_of(fn, repeats: int):
  """(fn()'s first result, the least wall seconds of `repeats` calls)."""
  out, best = None, float('inf')
  for i in range(max(1, repeats)):
    t0 = time.perf_counter()
    r = fn()
    best = min(best, time.perf_counter() - t0)
    if i == 0:
      out = r
  return out, best


def plan_methods(loads_MLDE, history_LE, topo: Topology, cost: CostModel,
                 budget: schedule.TransferBudget, top_k: int,
                 tokens_per_device: int, methods=METHODS,
                 config: foremoe.ForeMoEConfig = foremoe.ForeMoEConfig(),
                 workers: int = 1, prefill: bool = True,
                 timing_repeats: int = 2,
                 deadline_of=None) -> dict[str, MethodPlan]:
  """Each method's plans as the trainer makes them (`rl.trainer`): the
  update's plan from the home layout, fit to the budget, scheduled, its
  buckets; the recompute's step-level placement, fit and filled.
  history_LE: EPLB-step's decayed past loads (None: none yet).
  workers: planner processes (`StepPlanner`'s), started before any timing
  and shared by the methods; 1: one thread, as before.
  prefill: the recompute fills the update's slots for its step-level
  placement (`transfer.prefill`; the workload must run a recompute, with
  one update epoch), so the update's fill starts from them.
  timing_repeats: the recompute's plan, which the step waits for, is timed
  as the best of this many runs (the first run's plan is used).
  deadline_of(mp) -> seconds the update's plan gets, from the method's
  recompute (`plan_deadline`, as the trainer sets it); layers still
  planning then take the recompute's step-level plan. None: no deadline."""
  loads_MLDE = np.asarray(loads_MLDE)
  num_micro, num_layers, _, num_experts = loads_MLDE.shape
  home = placement_lib.identity_placement(num_layers, num_experts,
                                          topo.num_devices, topo.slots_per_device)
  tokens_per_device = shape_tokens(loads_MLDE, top_k, tokens_per_device)
  buckets = {mode: config_lib.capacity_buckets(
      tokens_per_device, top_k, topo.num_devices, topo.slots_per_device,
      dispatch=mode) for mode in MODES}
  static_cap, _ = _buckets(loads_MLDE, home, buckets)
  pool = layers.LayerPool(workers) if workers > 1 else None
  if pool is not None:
    pool.warm()
  try:
    return _plan_methods(loads_MLDE, history_LE, topo, cost, budget, methods,
                         config, home, buckets, static_cap, pool, prefill,
                         timing_repeats, deadline_of)
  finally:
    if pool is not None:
      pool.close()


def _plan_methods(loads_MLDE, history_LE, topo, cost, budget, methods, config,
                  home, buckets, static_cap, pool, prefill, timing_repeats,
                  deadline_of):
  num_experts = loads_MLDE.shape[-1]
  out = {}
  shared = {}  # The recompute's plan by what computes it (below).
  for method in methods:
    if method not in METHODS + ABLATIONS:
      raise ValueError(f'unknown method {method!r}; pick from '
                       f'{METHODS + ABLATIONS}.')
    planner = guard.StepPlanner(
        'foremoe' if method in ABLATIONS else method, topo, cost, home,
        config=(dataclasses.replace(config, anchor_inter_node_weight=0.0)
                if method == 'foremoe_compute_anchor' else config),
        carry_over=False, budget=budget, layer_pool=pool)
    planner.history_LE = history_LE
    try:
      mp = MethodPlan(None, None, None, static_cap, 0, 0.0,
                      recompute_capacity=static_cap,
                      canonical=method == 'static')
      start_LS = None
      # As the trainer orders it (`rl.trainer`): the recompute's step-level
      # plan first, then the update's plan, submitted under the deadline
      # the recompute sets, with the step-level plan as its fallback.
      if method != 'static':
        def recompute_plan():
          rplan = planner.step_level_plan(loads_MLDE)
          rplan, _ = schedule.fit_plan_to_budget(rplan, loads_MLDE, topo,
                                                 cost, budget)
          return rplan, schedule.build_step_transfer(
              rplan.placement.slot_expert, num_experts, topo, budget)
        # On the step's critical path (the recompute waits for it), so
        # timed as the best of `timing_repeats` runs, and measured once
        # for the methods that run the same code on the same inputs (the
        # foresight methods: `guard.step_level`), which are charged the
        # same seconds: one run's host noise (+-25% at DeepSeek-V3-like,
        # EP 256) exceeded every difference between them.
        key = (('eplb_step',) if method == 'eplb_step' else
               ('foresight', dataclasses.replace(planner.config,
                                                 max_rounds=0)))
        if key not in shared:
          (rplan, transfer), seconds = _best_of(recompute_plan,
                                                timing_repeats)
          shared[key] = (rplan, transfer, seconds,
                         *_buckets(loads_MLDE, rplan, buckets))
        (mp.recompute_plan, mp.recompute_transfer, mp.recompute_plan_s,
         mp.recompute_capacity, mp.recompute_bucket_s) = shared[key]
        if prefill:
          start_LS = mp.recompute_plan.placement.slot_expert[0]
          mp.prefilled = True
      mp.deadline_s = None if deadline_of is None else deadline_of(mp)

      def finalize(plan, loads, start_LS=start_LS):
        # The update's fit and moves, from what the recompute prefilled
        # (the fill that will run), made in the planner's thread after its
        # plan, inside the deadline, as the trainer's `_finalize` is.
        fitted, reverted = schedule.fit_plan_to_budget(
            plan, loads, topo, cost, budget, start_LS=start_LS)
        return _Finalized(fitted, reverted, schedule.build_step_transfer(
            fitted.placement.slot_expert, num_experts, topo, budget,
            start_LS=start_LS), plan.layers_fell_back)

      t0 = time.perf_counter()
      if method == 'foremoe_before_fixes':
        done = finalize(foremoe.plan_step(
            loads_MLDE, topo, cost, home, dataclasses.replace(
                planner.config, price_gradient_returns=False,
                anchor_rounds=None, moves_per_layer=None)), loads_MLDE)
      else:
        ticket = planner.submit(loads_MLDE, deadline_s=mp.deadline_s,
                                fallback=mp.recompute_plan, finalize=finalize)
        done = ticket.result()
        mp.fallback_reason = ticket.fallback_reason or ''
      mp.plan_s = time.perf_counter() - t0
      mp.plan, mp.reverted, mp.transfer, mp.fell_back_layers = done
      mp.capacity, mp.bucket_s = _buckets(loads_MLDE, mp.plan, buckets)
    finally:
      # A plan abandoned at its deadline keeps computing off this thread;
      # the next method's plan is timed only once it has ended.
      planner.close(wait=True)
    out[method] = mp
  return out


class _Finalized(NamedTuple):
  """A plan as `finalize` hands it over (`StepPlanner` reads `.plan`)."""
  plan: StepPlan
  reverted: int
  transfer: schedule.StepTransfer
  fell_back_layers: int


# What `_traffic_stats` reports (None in a row where it does not apply).
TRAFFIC_KEYS = ('inter_node_send_max_over_mean',
                'inter_node_recv_max_over_mean', 'on_node_row_fraction')


def update_passes(remat_policy: str) -> tuple[int, int]:
  """(compute passes, token all-to-alls) per layer of the update's forward
  + backward: 3 passes (forward, and backward's two) and 4 all-to-alls
  (dispatch and combine, each transposed); every remat policy re-runs the
  layer's forward exchange in the backward (+2; counted in the compiled
  step's HLO), and 'full' its compute too (+1 pass), where 'minimal' and
  'dots' keep the matmuls' outputs."""
  if remat_policy not in config_lib.REMAT_POLICIES:
    raise ValueError(f'remat_policy must be one of '
                     f'{config_lib.REMAT_POLICIES}, got {remat_policy!r}.')
  if remat_policy == 'none':
    return 3, 4
  return (4 if remat_policy == 'full' else 3), 6


def _moe_and_a2a(loads_MLDE, placement_of, capacity, model: ModelShape,
                 hw: HardwareProfile, spd: int, mode: str, passes: int,
                 tokens_per_device: int, traffic: bool = False,
                 num_a2a: int | None = None):
  """Per micro-step expert compute and all-to-all seconds, and with
  `traffic` where the dispatched rows go: ([M], [M], `_traffic_stats` of
  the exact dispatch's rows, or None: not asked, or the padded layer,
  whose cells are all C). num_a2a: token all-to-alls per layer (None: 2
  for a forward, passes = 1, else 4)."""
  num_micro, num_layers, num_dev, _ = np.shape(loads_MLDE)
  act_bytes = model.d_model * model.bytes_per_param
  if num_a2a is None:
    num_a2a = 2 if passes == 1 else 4  # Forward: dispatch, combine.
  moe_M, a2a_M = np.zeros(num_micro), np.zeros(num_micro)
  if mode == 'padded':
    tile = default_tile(num_dev * capacity, spd)
    rows = costs.padded_rows(num_dev, capacity, spd, tile)
    layer_moe = float(costs.expert_time(rows, spd, model, hw, passes)
                      + passes * hw.tile_overhead_s * -(-rows // tile))
    layer_a2a = costs.all_to_all_time(
        costs.padded_cells(num_dev, capacity) * act_bytes, hw)
    moe_M[:] = num_layers * layer_moe
    a2a_M[:] = num_layers * num_a2a * layer_a2a
    return moe_M, a2a_M, None
  if mode != 'exact':
    raise ValueError(f'mode must be one of {MODES}, got {mode!r}.')
  if hw.emulated_exchange:
    # Every pair moves one static chunk: the bucket of the step's largest
    # pair (`StepPlan.cell`, `config.cell_buckets`), within the bound that
    # holds whatever the routing (a token sends a device at most
    # min(top_k, s) rows) and the capacity.
    worst = max(placement_lib.max_cell(loads_MLDE[m][None], placement_of(m))
                for m in range(num_micro))
    cell = config_lib.pick_bucket(worst, config_lib.cell_buckets(
        tokens_per_device, model.top_k, num_dev, spd))
    chunk = costs.padded_cells(num_dev, min(
        tokens_per_device * min(model.top_k, spd), capacity, cell))
    layer_a2a = costs.all_to_all_time(chunk * act_bytes, hw)
  tile = default_tile(capacity, spd) if hw.tiled_gemm else 1
  by_node = []
  for m in range(num_micro):
    p = placement_of(m)
    cells_LSD = placement_lib.cell_counts(loads_MLDE[m], p)
    if traffic:
      by_node += [costs.node_traffic(c, hw) for c in cells_LSD]
    if hw.tiled_gemm:
      # Whole tiles per slot (`grouped_swiglu` 'tiles_lockstep').
      rows_LS = placement_lib.slot_counts(loads_MLDE[m], p).sum(axis=1)
      loads_LD = ((-(-rows_LS // tile) * tile)
                  .reshape(num_layers, num_dev, spd).sum(axis=2))
    else:
      loads_LD = cells_LSD.sum(axis=1)
    busiest_L = loads_LD.max(axis=1)
    moe_M[m] = float(costs.expert_time(busiest_L, spd, model, hw,
                                       passes).sum())
    if hw.tiled_gemm:  # The busiest device's tiles, each a fixed cost.
      moe_M[m] += passes * hw.tile_overhead_s * float(busiest_L.sum()) / tile
    if hw.emulated_exchange:
      a2a_M[m] = num_a2a * num_layers * layer_a2a
    else:
      a2a_M[m] = num_a2a * sum(costs.all_to_all_time(c * act_bytes, hw)
                               for c in cells_LSD)
  return moe_M, a2a_M, _traffic_stats(by_node) if traffic else None


def _traffic_stats(traffic) -> dict:
  """Means over (micro-step, layer) of `costs.node_traffic`'s parts: the
  busiest device's inter-node sends and receives over the mean (1.0 where
  no row crosses nodes), and the share of rows that stay in their node."""
  send = [placement_lib.max_over_mean(t[0]) for t in traffic]
  recv = [placement_lib.max_over_mean(t[1]) for t in traffic]
  total = [t[0].sum() + t[2] for t in traffic]
  on_node = [t[2] / n if n > 0 else 1.0 for t, n in zip(traffic, total)]
  return dict(zip(TRAFFIC_KEYS, (float(np.mean(send)), float(np.mean(recv)),
                                 float(np.mean(on_node)))))


def _transition_s(t, model, hw, num_dev, lead=(), fills=True,
                  returns=True) -> np.ndarray:
  """Seconds per layer of a Transition (lead: index of micro-step), its
  fills and returns or (`fills` / `returns`) one of them."""
  num_layers = t.local_src_LS[lead].shape[0]
  return np.array([costs.transition_time(t, lead + (l,), model, hw, num_dev,
                                         grad_bytes_per_param=4, fills=fills,
                                         returns=returns)
                   for l in range(num_layers)])


def _fill_s(transfer, model, hw, num_dev, num_layers, spd,
            layers_L=None) -> float:
  """Exposed seconds of a step's first fill (rounds + local copies), of
  the layers in `layers_L` (a bool mask; None: all)."""
  fill = transfer.fill
  if layers_L is None:
    layers_L = np.ones(num_layers, bool)
  local_D = np.zeros(num_dev)
  for l in np.flatnonzero(layers_L):
    local_D += (fill.local_src_LS[l].reshape(num_dev, spd) >= 0).sum(axis=1)
  return float(_transition_s(fill, model, hw, num_dev)[layers_L].sum()
               + costs.local_copy_time(local_D, model, hw))


def canonical_cast_s(model: ModelShape, hw: HardwareProfile,
                     num_layers: int, num_home: int) -> float:
  """Static EP on the canonical layout: its home experts cast once a step
  into their compute copies (`rl.step.update_grads`), a local copy each."""
  return costs.local_copy_time(np.array([num_layers * num_home]), model, hw)


def canonical_sum_s(model: ModelShape, hw: HardwareProfile, num_layers: int,
                    num_home: int) -> float:
  """Static EP on the canonical layout, per micro-step: the home experts'
  float32 gradient sums (read the sum and the new gradient, write the
  sum), its only bookkeeping (no slots to flush, nothing to return)."""
  return num_layers * num_home * 3 * model.params_per_expert * 4 / hw.hbm_bw


def empty_slots_s(model: ModelShape, hw: HardwareProfile, num_layers: int,
                  spd: int) -> float:
  """Writing a device's empty slot buffers (`engine.empty_slots`), which a
  fill from nothing starts from: every layer's s experts, once."""
  return num_layers * spd * model.bytes_per_expert / hw.hbm_bw


def chunk_slices_s(model: ModelShape, hw: HardwareProfile, num_layers: int,
                   num_micro: int, spd: int, num_home: int) -> float:
  """The prefill's per-iteration bookkeeping (`engine.fill_slots_local(
  chunk=)`): each of the M iterations slices its chunk's layers (the
  largest chunk's count, ceil(L / M), every iteration) out of the slot
  buffers and the canonical experts and writes the slots back, copies of
  2 s + h experts per layer."""
  per = -(-num_layers // num_micro)
  return (num_micro * per * (2 * spd + num_home) * 2 * model.bytes_per_expert
          / hw.hbm_bw)


def in_place(t, hw: HardwareProfile, returns: bool = False) -> bool:
  """Whether the engine applies transition `t`'s fills (or, `returns`,
  its returns) to the stacked slot buffers in place, item by item: on the
  CPU's emulated exchange, for a single-stage ``exact`` transition
  (`transfer.engine._fill_inplace`). It then touches only the items it
  moves: no layer slices, no receive buffer."""
  if not (hw.emulated_exchange and isinstance(t, schedule.ExactTransition)):
    return False
  return (t.ret_count_LPDD if returns else t.count_LPDD).shape[-3] == 1


def prefill_exposed(recompute_transfer, compute_M, model, hw, num_dev,
                    num_layers, spd, num_home: int) -> tuple[float, float]:
  """(seconds, exposed seconds) of the recompute's prefill of the update's
  slots (`rl.step.recompute_logps(prefill=True)`): the step-level
  placement's fill, one chunk of layers per micro-step of the recompute
  (`transfer.engine.layer_chunks`), each hidden under that micro-step's
  forward up to the overlap the engine's schedule allows
  (`move_overlap`)."""
  num_micro = len(compute_M)
  chunk_L = (np.arange(num_layers) * num_micro) // num_layers
  chunk_M = np.array([_fill_s(recompute_transfer, model, hw, num_dev,
                              num_layers, spd, chunk_L == m)
                      for m in range(num_micro)])
  hidden_M = np.minimum(chunk_M,
                        move_overlap(recompute_transfer, hw) * compute_M)
  # Zeroing the buffers and slicing the chunks is local memory work on the
  # compute's own stream: it hides under nothing. (A fill in place slices
  # nothing.)
  local_s = empty_slots_s(model, hw, num_layers, spd)
  if not in_place(recompute_transfer.fill, hw):
    local_s += chunk_slices_s(model, hw, num_layers, num_micro, spd,
                              num_home)
  return (float(chunk_M.sum() + local_s),
          float((chunk_M - hidden_M).sum() + local_s))


def layer_windows(compute_s, nonexpert_s, num_layers: int, passes: int = 3):
  """(forward, backward) seconds of one layer's step of a micro-step's
  scan over layers that a transfer issued there may hide under: a loop's
  collectives cannot leave its body, so a fill issued in layer l's
  forward step hides under that step only (the forward: a third of the
  fwd + bwd compute, per layer), and a return issued in layer l's
  backward step (once the layer's experts have their weights' gradient)
  under what that step runs after it, its non-expert part (attention sits
  before the MoE in the forward, so after it in the backward). compute_s,
  nonexpert_s: the micro-step's fwd + bwd compute and its non-expert
  part, in `passes` passes (3; 4 where the backward re-runs the forward,
  `update_passes`); arrays work elementwise."""
  return (np.asarray(compute_s) / (passes * num_layers),
          (passes - 1.0) * np.asarray(nonexpert_s) / (passes * num_layers))


def flush_exposed(flush_L, window_s: float,
                  overlap: float) -> tuple[float, float]:
  """(seconds, exposed seconds) of the flush of the replicas' gradients
  home, which the update issues layer by layer inside the last
  micro-step's backward (`transfer.engine.returns_in_backward`): layer l's
  return hides under the rest of its own backward step, `window_s`
  (`layer_windows`), up to the overlap the engine's schedule allows."""
  flush_L = np.asarray(flush_L, np.float64)
  total = float(flush_L.sum())
  if not total:
    return 0.0, 0.0
  return total, float(np.maximum(flush_L - overlap * window_s, 0.0).sum())


def _exchange_rows(transfer: schedule.StepTransfer) -> dict:
  """The budget the memory model sizes the exchange buffers by: ``exact``
  mode's degree bound R of the fill and flush and of the moves between
  micro-steps, and the fill's and flush's form (the transfer's own
  budget); one in ``rounds`` mode (a round sends one expert)."""
  if not isinstance(transfer.flush, schedule.ExactTransition):
    return dict(step_rounds=1, microstep_rounds=1)
  b = transfer.budget
  return dict(step_rounds=b.step_rounds, microstep_rounds=b.microstep_rounds,
              flush=b.flush)


def moves_in_layers(moves, hw: HardwareProfile) -> bool:
  """Whether, on `hw`, the moves between micro-steps run in the model's
  layer steps, their fills in each layer's forward and the evicted
  replicas' returns in its backward, in the flush's hook (the engine's
  `moves_in_layers`: the exact exchanges, GPU/TPU's ragged one), rather
  than in scans of their own after the micro-step (the CPU emulation, the
  rounds engine)."""
  return isinstance(moves, schedule.ExactTransition) and not (
      hw.emulated_exchange)


def flush_hook_time(flush, model: ModelShape, hw: HardwareProfile,
                    spd: int, num_home: int, moves=None) -> float:
  """Seconds per micro-step the flush's place in the backward costs when
  it sends nothing (every micro-step but the last runs it switched off):
  per layer, the slots' float32 gradient sum (read the accumulated and
  the new gradient, write the sum) and, in ``exact`` mode, per stage of
  its returns the gather of the send buffer's items and the zeroed
  receive buffer (`schedule.flush_form`). In place (`in_place`: the CPU's
  single-stage flush) the home experts' gradient sums only pass through
  as their own cotangent: priced as one write of them, the most XLA's
  copy of a loop carry costs.

  moves: the micro-step moves' transition ([M, L, ...]); where their
  returns run in the same hook (`moves_in_layers`), its send and
  receive buffers are gathered and zeroed there too, every micro-step
  (the last's is a no-op it still runs switched off), on the same
  gradient sum."""
  num_layers = flush.local_src_LS.shape[0]
  if in_place(flush, hw, returns=True):
    return num_layers * num_home * model.params_per_expert * 4 / hw.hbm_bw
  items = 3 * spd
  if isinstance(flush, schedule.ExactTransition):
    _, stages, _, send_w = flush.ret_send_LPDR.shape
    items += stages * (send_w + flush.ret_recv_LPDR.shape[-1])
  if moves is not None and moves_in_layers(moves, hw):
    *_, stages, _, send_w = moves.ret_send_LPDR.shape
    items += stages * (send_w + moves.ret_recv_LPDR.shape[-1])
  return num_layers * items * model.params_per_expert * 4 / hw.hbm_bw


def move_overlap(transfer: schedule.StepTransfer,
                 hw: HardwareProfile) -> float:
  """Share of the compute beside it that a transfer may hide under, from
  where the engine issues it (transfer/engine.py): in ``exact`` mode one
  collective per layer, outside any conditional, so the profile's
  asynchronous-collective overlap (of the compute of the computation it
  sits in: `layer_windows`, `prefill_exposed`); in ``rounds`` mode each
  round's permute sits in the `lax.switch` that picks its shift, and XLA
  schedules a conditional's collectives inside its branch, so nothing
  hides them."""
  if isinstance(transfer.steps, schedule.ExactTransition):
    return hw.transfer_overlap
  return 0.0


def _nonexpert_s(model: ModelShape, work: Workload, hw: HardwareProfile,
                 passes: int) -> float:
  """Seconds of one micro-step's non-expert work in `passes` passes."""
  return (work.tokens_per_device
          * model.nonexpert_flops_per_token(work.tokens_per_seq, passes)
          / hw.nonexpert_flops_per_s
          + model.num_layers * hw.layer_overhead_s * (1 + (passes > 1)))


def recompute_time(mp: MethodPlan, loads_MLDE, model: ModelShape,
                   work: Workload, hw: HardwareProfile,
                   mode: str = DEFAULT_MODE) -> dict:
  """The recompute's seconds (`recompute_s`) and its parts: the forwards
  the step needs, each on the method's step-level placement (its weights
  filled first) or on the home layout, and the exposed part of the
  prefill of the update's slots under the first one. The trainer's plan
  deadline is a multiple of it (`plan_deadline`)."""
  loads_MLDE = np.asarray(loads_MLDE)
  num_micro, num_layers, num_dev, num_experts = loads_MLDE.shape
  spd = work.slots_per_device(model)
  shape = shape_tokens(loads_MLDE, model.top_k, work.tokens_per_device)
  nonexpert = lambda passes, prof: _nonexpert_s(model, work, prof, passes)
  # The recompute: the forwards the step needs, each on the method's
  # step-level placement (its weights filled first), or on the home layout.
  passes = work.recompute_forward_passes
  if mp.prefilled and not passes:
    raise ValueError('the plan\'s fill starts from slots the recompute '
                     'prefills, but this workload runs no recompute: plan '
                     'it with plan_methods(prefill=False).')
  fwd = hw.forward_profile()
  recompute_s, recompute_fill_s = 0.0, 0.0
  prefill_s, prefill_exposed_s = 0.0, 0.0
  rec_parts = dict(moe=0.0, a2a=0.0, nonexpert=0.0)
  if passes:
    if mp.recompute_plan is None:
      home = placement_lib.identity_placement(num_layers, num_experts, num_dev,
                                              spd)
      placement_of = lambda m: home
    else:
      placement_of = mp.recompute_plan.microstep
      recompute_fill_s = (_fill_s(mp.recompute_transfer, model, hw, num_dev,
                                  num_layers, spd)
                          + empty_slots_s(model, hw, num_layers, spd))
    rmoe_M, ra2a_M, _ = _moe_and_a2a(loads_MLDE, placement_of,
                                     mp.recompute_capacity[mode], model,
                                     fwd, spd, mode, passes=1,
                                     tokens_per_device=shape)
    rec_parts = dict(moe=passes * float(rmoe_M.sum()),
                     a2a=passes * float(ra2a_M.sum()),
                     nonexpert=passes * num_micro * nonexpert(1, fwd))
    if mp.prefilled:
      # Under the first forward's compute (its expert GEMMs and the rest;
      # the token all-to-alls share the links, so they hide nothing).
      prefill_s, prefill_exposed_s = prefill_exposed(
          mp.recompute_transfer, rmoe_M + nonexpert(1, fwd), model, hw,
          num_dev, num_layers, spd, num_home=num_experts // num_dev)
    recompute_s = (passes * recompute_fill_s + sum(rec_parts.values())
                   + prefill_exposed_s)
  return dict(recompute_s=recompute_s, recompute_fill_s=recompute_fill_s,
              prefill_s=prefill_s, prefill_exposed_s=prefill_exposed_s,
              parts=rec_parts)


def plan_deadline(mp: MethodPlan, loads_MLDE, model: ModelShape,
                  work: Workload, hw: HardwareProfile, deadline_ms: float,
                  recompute_frac: float, mode: str = DEFAULT_MODE) -> float:
  """Seconds the trainer gives the update's plan (`rl.trainer.plan_async`
  after its first step): `recompute_frac` x the recompute it overlaps,
  never below `deadline_ms`. Layers whose plan is late take the
  recompute's step-level plan (`planner.guard`)."""
  return max(deadline_ms / 1e3, recompute_frac * recompute_time(
      mp, loads_MLDE, model, work, hw, mode)['recompute_s'])


def time_step(mp: MethodPlan, loads_MLDE, model: ModelShape, work: Workload,
              hw: HardwareProfile, mode: str = DEFAULT_MODE) -> dict:
  """Predicted seconds of one RL step (update phase and whole step) and
  the update's per-device memory."""
  loads_MLDE = np.asarray(loads_MLDE)
  num_micro, num_layers, num_dev, num_experts = loads_MLDE.shape
  spd = work.slots_per_device(model)
  plan = mp.plan
  tokens = work.tokens_per_device
  # The exchange's static bounds hold the largest micro-batch (as the
  # buckets do, `plan_methods`); compute counts the nominal tokens.
  shape = shape_tokens(loads_MLDE, model.top_k, tokens)
  nonexpert = lambda passes: _nonexpert_s(model, work, hw, passes)
  upd_passes, num_a2a = update_passes(work.remat_policy)
  moe_M, a2a_M, traffic = _moe_and_a2a(
      loads_MLDE, plan.microstep, mp.capacity[mode], model, hw, spd, mode,
      passes=upd_passes, tokens_per_device=shape, traffic=True,
      num_a2a=num_a2a)
  compute_M = moe_M + nonexpert(upd_passes)
  fwd_window_M, bwd_window_M = layer_windows(
      compute_M, np.full(num_micro, nonexpert(upd_passes)), model.num_layers,
      upd_passes)
  # Moves into micro-step m + 1: where they run in m's layer steps (fills
  # in its forward, the evicted replicas' returns in its backward), each
  # layer's hides under its own step; elsewhere nothing hides them.
  move_M = np.zeros(num_micro)
  hidden_M = np.zeros(num_micro)
  if mp.canonical:
    fill_s, flush_s, flush_exposed_s = canonical_cast_s(
        model, hw, num_layers, num_experts // num_dev), 0.0, 0.0
  else:
    steps = mp.transfer.steps
    in_layers = moves_in_layers(steps, hw)
    overlap = move_overlap(mp.transfer, hw)
    for m in range(num_micro - 1):
      fill_L = _transition_s(steps, model, hw, num_dev, (m,), returns=False)
      ret_L = _transition_s(steps, model, hw, num_dev, (m,), fills=False)
      move_M[m] = fill_L.sum() + ret_L.sum()
      if in_layers:
        hidden_M[m] = (np.minimum(fill_L, overlap * fwd_window_M[m]).sum()
                       + np.minimum(ret_L, overlap * bwd_window_M[m]).sum())
    fill_s = _fill_s(mp.transfer, model, hw, num_dev, num_layers, spd)
    if not mp.prefilled:  # The update's fill starts from empty buffers.
      fill_s += empty_slots_s(model, hw, num_layers, spd)
    flush_L = _transition_s(mp.transfer.flush, model, hw, num_dev)
    flush_s, flush_exposed_s = flush_exposed(flush_L, bwd_window_M[-1],
                                             overlap)
  exposed_M = move_M - hidden_M
  groups = work.num_devices // num_dev
  expert_params = (model.num_moe_layers * model.params_per_expert
                   * num_experts / num_dev)
  nonexp = model.nonexpert_params()
  shards = work.num_devices if work.fsdp_all else 1
  optimizer_s = costs.optimizer_time(expert_params + nonexp / shards, hw)
  # f32 gradients, reduced once per step (rl/step.py): non-expert ones over
  # every device, expert ones over the EP groups beside each other (a
  # device's peers an EP group apart, on other nodes once EP fills one). Split
  # non-expert weights are gathered (f32) once per step first: half the
  # bytes of an all-reduce.
  sync_s = (costs.allreduce_time(4.0 * nonexp, work.num_devices, hw)
            * (1.5 if shards > 1 else 1.0)
            + (costs.allreduce_time(4.0 * expert_params, groups, hw,
                                    stride=num_dev) if groups > 1 else 0.0))
  hook_s = num_micro * (
      canonical_sum_s(model, hw, num_layers, num_experts // num_dev)
      if mp.canonical else
      flush_hook_time(mp.transfer.flush, model, hw, spd,
                      num_experts // num_dev, moves=mp.transfer.steps))
  update_s = float(fill_s + (compute_M + a2a_M + exposed_M).sum()
                   + flush_exposed_s + hook_s + optimizer_s + sync_s)
  rec = recompute_time(mp, loads_MLDE, model, work, hw, mode)
  recompute_s, recompute_fill_s = rec['recompute_s'], rec['recompute_fill_s']
  prefill_s, prefill_exposed_s = rec['prefill_s'], rec['prefill_exposed_s']
  rec_parts = rec['parts']
  passes = work.recompute_forward_passes
  # As the trainer orders it: the step-level plan, then the recompute, the
  # micro-step plan made while it runs; the update waits for whichever
  # ends last.
  plan_s = mp.plan_s + mp.bucket_s.get(mode, 0.0)
  recompute_plan_s = mp.recompute_plan_s + mp.recompute_bucket_s.get(mode, 0.0)
  plan_wait_s = max(0.0, plan_s - recompute_s)
  mem = memory.update_memory(
      model, work, ep=num_dev, slots_per_device=spd,
      capacity_rows=(mp.capacity[mode] if mode == 'exact'
                     else num_dev * mp.capacity[mode]),
      remat_policy=work.remat_policy, fsdp_shards=shards,
      canonical=mp.canonical, **_exchange_rows(mp.transfer))
  return dict(
      update_s=update_s, recompute_s=recompute_s, plan_s=plan_s,
      recompute_plan_s=recompute_plan_s, plan_wait_s=plan_wait_s,
      step_s=recompute_plan_s + recompute_s + plan_wait_s + update_s,
      recompute_forward_passes=passes, recompute_fill_s=recompute_fill_s,
      recompute_moe_s=rec_parts['moe'], recompute_a2a_s=rec_parts['a2a'],
      recompute_nonexpert_s=rec_parts['nonexpert'],
      moe_compute_s=float(moe_M.sum()), all_to_all_s=float(a2a_M.sum()),
      nonexpert_s=float(num_micro * nonexpert(upd_passes)),
      # The update's transfers and the recompute's prefill of its slots
      # (whose exposed part lengthens the recompute).
      transfer_s=float(move_M.sum() + fill_s + flush_s + prefill_s),
      transfer_hidden_s=float(hidden_M.sum() + prefill_s - prefill_exposed_s
                              + flush_s - flush_exposed_s),
      transfer_exposed_s=float(exposed_M.sum() + fill_s + flush_exposed_s
                               + prefill_exposed_s),
      fill_s=float(fill_s), flush_s=float(flush_s),
      flush_exposed_s=float(flush_exposed_s),
      moves_s=float(move_M.sum()),  # Between micro-steps, hidden or not.
      flush_hook_s=float(hook_s),
      prefill_s=prefill_s, prefill_exposed_s=prefill_exposed_s,
      # Experts the transfer collectives carry over experts that moved.
      wire_bytes_over_useful=schedule.step_wire_over_useful(mp.transfer,
                                                            num_dev),
      optimizer_s=optimizer_s, grad_sync_s=sync_s,
      capacity=mp.capacity[mode], reverted_moves=mp.reverted,
      plan_deadline_s=mp.deadline_s, plan_layers_fell_back=mp.fell_back_layers,
      plan_fallback_reason=mp.fallback_reason,
      microstep_max_over_mean=float(placement_lib.max_over_mean(
          plan.loads_MLD).mean()),
      # Rows the busiest source device sends over the mean (a device sends
      # its own tokens' rows, whatever the placement): the all-to-alls'
      # floor, mean over micro-steps and layers.
      sender_max_over_mean=float(placement_lib.max_over_mean(
          loads_MLDE.sum(axis=3)).mean()),
      # The update's rows by node (exact dispatch; None for padded): on
      # several nodes the all-to-all follows the inter-node rows, which the
      # placement does move (a replica on a source's node keeps its rows
      # there, while an expert's only copy draws from every other node).
      **(traffic or dict.fromkeys(TRAFFIC_KEYS)),
      peak_bytes_per_device=mem.total, memory=mem.as_dict())
