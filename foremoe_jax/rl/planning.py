"""The trainer's handle on the host-side planner: method choice, deadline, fallback.

Runs the planner in a worker thread and waits at most `deadline_ms`; on a
timeout or an error the previous step's placement is reused (repeated for
every micro-step) and the event is counted, so planning never blocks or
breaks training (issue 5, item 5).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses

import numpy as np

from foremoe_jax import placement as placement_lib
from foremoe_jax.planner.greedy import greedy_placement

METHODS = ('static', 'eplb_microstep', 'foremoe')


@dataclasses.dataclass
class HostPlan:
  placement: placement_lib.Placement  # [M, L, ...] arrays.
  moves: int  # Experts newly copied into a device over the step.

  def placement_m(self, m: int) -> placement_lib.Placement:
    return placement_lib.Placement(self.placement.slot_expert[m],
                                   self.placement.slot_share[m])


def _count_moves(prev_LS, new_MLS, num_devices):
  moves, prev = 0, prev_LS
  for new in new_MLS:
    for a, b in zip(prev, new):
      for d_a, d_b in zip(np.split(a, num_devices), np.split(b, num_devices)):
        moves += len(set(d_b.tolist()) - set(d_a.tolist()))
    prev = new
  return moves


class StepPlanner:

  def __init__(self, *, method: str, num_experts: int, num_devices: int,
               slots_per_device: int, num_moe_layers: int,
               bytes_per_expert: int, deadline_ms: float):
    if method not in METHODS:
      raise ValueError(f'planner.method must be one of {METHODS}, got {method!r}')
    self.method, self.deadline_s = method, deadline_ms / 1e3
    self.num_experts, self.num_devices = num_experts, num_devices
    self.spd, self.bytes_per_expert = slots_per_device, bytes_per_expert
    self.current = placement_lib.identity_placement(
        num_moe_layers, num_experts, num_devices, slots_per_device)
    self.fallbacks = 0
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

  def _plan(self, loads_MLDE) -> placement_lib.Placement:
    num_mb = loads_MLDE.shape[0]
    if self.method == 'static':
      return placement_lib.stack_placements([self.current] * num_mb)
    return placement_lib.stack_placements(
        [greedy_placement(loads_MLDE[m], self.spd) for m in range(num_mb)])

  def plan(self, loads_MLDE: np.ndarray) -> HostPlan:
    future = self._pool.submit(self._plan, loads_MLDE)
    try:
      stacked = future.result(timeout=self.deadline_s)
      for m in range(stacked.slot_expert.shape[0]):
        placement_lib.validate_placement(
            placement_lib.Placement(stacked.slot_expert[m],
                                    stacked.slot_share[m]),
            self.num_experts, self.spd)
    except Exception:  # pylint: disable=broad-except
      # Timeout or planner failure: keep the previous placement.
      self.fallbacks += 1
      stacked = placement_lib.stack_placements(
          [self.current] * loads_MLDE.shape[0])
    moves = _count_moves(self.current.slot_expert, stacked.slot_expert,
                         self.num_devices)
    self.current = placement_lib.Placement(stacked.slot_expert[-1],
                                           stacked.slot_share[-1])
    return HostPlan(stacked, moves)
