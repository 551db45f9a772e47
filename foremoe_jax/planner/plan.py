"""A planned RL step: one placement per micro-step plus what it will cost.

Every planner (ForeMoE and the baselines) ends here: it hands over, per
micro-step, slot_expert and per-slot flows, and ``assemble_plan`` turns them
into exact integer token counts per (source, slot), the Placement's shares,
and the predictions the transfer engine and the trainer read: per-device
and per-slot loads, the largest (source, slot) cell (the smallest capacity
bucket that drops nothing), experts newly copied into each device, bytes
moved. The model consumes ``StepPlan.placement`` (stacked over micro-steps).

Shape letters: M micro-steps, L layers, D devices, E experts, S slots.
"""
from __future__ import annotations

import concurrent.futures
from typing import NamedTuple

import numpy as np

from foremoe_jax import placement as placement_lib
from foremoe_jax.planner import packing, split
from foremoe_jax.planner.topology import CostModel, Topology


class StepPlan(NamedTuple):
  """Placements of one RL step and their predicted effects."""

  placement: placement_lib.Placement  # slot_expert [M, L, S], share [M, L, D, S]
  loads_MLD: np.ndarray  # int64: tokens each device computes
  slot_loads_MLS: np.ndarray  # int64: tokens each slot computes
  # int64: largest (source, slot) count. The EP layer pads (source,
  # destination device) cells of each data group: pick its bucket with
  # placement.max_cell of the per-group loads (the planner sees their sum).
  max_cell_ML: np.ndarray
  moves_MLD: np.ndarray  # int64: experts newly copied into each device
  bytes_moved_M: np.ndarray  # float64: bytes copied before each micro-step
  fell_back: bool = False  # True when the previous placement was reused
  # bool [L]: layers where ForeMoE kept the foresight_split plan (its own
  # moves did not pay, `foremoe.step_cost_s`); None: no such choice made.
  from_split_L: np.ndarray | None = None
  # bool [L]: layers taken from the fallback plan because their chunk of
  # layers missed the deadline or failed (`planner.layers`); None: none.
  fell_back_L: np.ndarray | None = None

  @property
  def num_microsteps(self) -> int:
    return int(self.loads_MLD.shape[0])

  def microstep(self, m: int) -> placement_lib.Placement:
    return placement_lib.Placement(self.placement.slot_expert[m],
                                   self.placement.slot_share[m])

  @property
  def layers_fell_back(self) -> int:
    """Layers taken from the fallback plan (all of them when the whole
    step fell back)."""
    if self.fell_back_L is not None:
      return int(np.sum(self.fell_back_L))
    return int(self.loads_MLD.shape[1]) if self.fell_back else 0

  @property
  def layers_from_split(self) -> int:
    """Layers that took the foresight_split plan (0 when none or no choice)."""
    return 0 if self.from_split_L is None else int(np.sum(self.from_split_L))

  def last(self) -> placement_lib.Placement:
    """The placement the next step starts from."""
    return self.microstep(self.num_microsteps - 1)


def _thread_map(fn, n: int, threads: int) -> list:
  """[fn(0), ..., fn(n - 1)], in up to `threads` threads (numpy's array work
  releases the GIL, so a planner's per-micro-step passes run side by side)."""
  threads = max(1, min(int(threads), n))
  if threads == 1:
    return [fn(i) for i in range(n)]
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    return list(pool.map(fn, range(n)))


def capacity_demand(loads_MGLDE, plan, dispatch: str, threads: int = 1) -> int:
  """Rows the dispatch's capacity must hold over a step's micro-steps
  (`placement.capacity_demand`, the largest over micro-steps and groups).

  loads_MGLDE: the per-group loads of the step. plan: its StepPlan (made
  for these loads summed over groups), or one Placement for every
  micro-step. For a StepPlan with one data group and the exact dispatch,
  the demand is the plan's own busiest device (`loads_MLD`:
  `assemble_plan`'s counts are the ones its shares give back, which
  `tests/planner` checks of every plan), so nothing is recounted; at 256
  devices the recount of [L, D, S] counts per micro-step cost seconds
  before the recompute. Otherwise each group's counts are recounted under
  each micro-step's placement, the micro-steps in `threads` threads.
  """
  loads_MGLDE = np.asarray(loads_MGLDE)
  num_micro = loads_MGLDE.shape[0]
  if isinstance(plan, StepPlan):
    if loads_MGLDE.ndim != 5 or num_micro != plan.num_microsteps:
      raise ValueError(f'loads must be [M={plan.num_microsteps}, G, L, D, E]; '
                       f'got {loads_MGLDE.shape}.')
    if dispatch == 'exact' and loads_MGLDE.shape[1] == 1:
      return int(plan.loads_MLD.max(initial=0))
    placement_of = plan.microstep
  else:
    placement_of = lambda m: plan
  return max(_thread_map(
      lambda m: placement_lib.capacity_demand(loads_MGLDE[m], placement_of(m),
                                              dispatch), num_micro, threads))


def _loads_by_device(slot_loads_MLS, topo: Topology):
  num_micro, num_layers = slot_loads_MLS.shape[:2]
  return slot_loads_MLS.reshape(num_micro, num_layers, topo.num_devices,
                                -1).sum(axis=3)


def assemble_plan(loads_MLDE, slot_expert_MLS, flows_MLS, topo: Topology,
                  cost: CostModel, current_LS,
                  prefer_local: bool = True, threads: int = 1) -> StepPlan:
  """Builds the StepPlan from per-micro-step slot_expert and flows.

  threads: micro-steps split at once (numpy releases the GIL in the
  split's array work: on 2 cores, 4 micro-steps of DeepSeek-V3-like at EP
  256 took 0.52-0.69 s in 2 threads against 0.89-0.97 s in one); the plan
  is the same whatever the count.
  """
  loads_MLDE = np.asarray(loads_MLDE)
  num_micro = loads_MLDE.shape[0]
  loads_MLED = split.slot_major(loads_MLDE)
  num_layers, num_slots = np.shape(slot_expert_MLS)[1:]
  share_MLDS = np.empty((num_micro, num_layers, topo.num_devices, num_slots),
                        np.float32)
  slot_loads = [None] * num_micro
  cells = [None] * num_micro

  def one(m):
    share_MLDS[m], slot_loads[m], cells[m] = split.split_tokens(
        loads_MLDE[m], slot_expert_MLS[m], flows_MLS[m], topo, prefer_local,
        loads_LED=loads_MLED[m])

  _thread_map(one, num_micro, threads)
  moves, prev_LS = [], np.asarray(current_LS)
  for m in range(num_micro):
    moves.append(packing.new_copies(slot_expert_MLS[m], prev_LS, topo))
    prev_LS = slot_expert_MLS[m]
  slot_loads_MLS = np.stack(slot_loads)
  moves_MLD = np.stack(moves).astype(np.int64)
  placement = placement_lib.Placement(
      np.asarray(slot_expert_MLS, np.int32), share_MLDS)
  return StepPlan(placement, _loads_by_device(slot_loads_MLS, topo),
                  slot_loads_MLS, np.stack(cells), moves_MLD,
                  moves_MLD.sum(axis=(1, 2)) * float(cost.bytes_per_expert))


def fallback_plan(loads_MLDE, current: placement_lib.Placement,
                  topo: Topology, cost: CostModel) -> StepPlan:
  """The previous placement for every micro-step: no expert moves.

  Its experts stay in their slots; each replica keeps its share of its
  expert's tokens (averaged over sources), re-applied to these loads as
  exact counts. Re-deriving the shares costs one split per micro-step and
  keeps the predictions exact (a source that sent an expert nothing before
  would otherwise send it all to the first replica now).
  """
  del cost  # Nothing is copied.
  loads_MLDE = np.asarray(loads_MLDE)
  num_micro = loads_MLDE.shape[0]
  se_LS = np.asarray(current.slot_expert, np.int64)
  frac_LS = np.asarray(current.slot_share, np.float64).mean(axis=1)
  w_MLE = loads_MLDE.sum(axis=2).astype(np.float64)
  x_MLS = np.stack([frac_LS * np.take_along_axis(w_MLE[m], se_LS, 1)
                    for m in range(num_micro)])
  plan = assemble_plan(loads_MLDE, np.broadcast_to(se_LS, x_MLS.shape), x_MLS,
                       topo, CostModel(), se_LS, prefer_local=False)
  return plan._replace(fell_back=True)
