"""Exact MILP for one micro-step and layer, to measure the planners' gap.

Off the training path: the benchmark and tests solve small instances (at
most 16 experts and 4 devices) with scipy's HiGHS and compare ForeMoE's
choice for the same micro-step, from the same previous placement, against
the optimum of the same objective:

  min   T + c_move * (experts newly copied into devices)
  s.t.  T >= tokens computed by each device,
        each expert's tokens split over devices holding it,
        each expert on >= 1 device, each device holds <= s experts,
        each device's copies fit its overlap window (time in tokens),

all in token-assignments of straggler compute (a copy costs
``CostModel.move_tokens``), which is the trade ForeMoE's refinement makes.
Token splits are continuous here (the planner's integer rounding moves a
load by at most a token or two).

Shape letters: E experts, D devices.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from scipy import optimize, sparse

MAX_EXPERTS = 16
MAX_DEVICES = 4


class MilpSolution(NamedTuple):
  objective: float  # T + c_move * moves, in tokens
  max_load: float  # T
  moves: int
  holds_ED: np.ndarray  # bool: expert e placed on device d
  optimal: bool


def solve_microstep(w_E, prev_holds_ED, slots_per_device: int,
                    move_tokens: float, window_tokens: float = np.inf,
                    time_limit: float = 20.0) -> MilpSolution:
  """Optimal placement and split of one micro-step's layer.

  Args:
    w_E: tokens per expert this micro-step.
    prev_holds_ED: bool, expert e held by device d in the previous placement.
    slots_per_device: s.
    move_tokens: cost of one copy, in token-assignments.
    window_tokens: per-device budget for copies, in the same unit.
  """
  w_E = np.asarray(w_E, np.float64)
  prev = np.asarray(prev_holds_ED, bool)
  num_experts, num_devices = prev.shape
  if num_experts > MAX_EXPERTS or num_devices > MAX_DEVICES:
    raise ValueError(f'MILP instances are limited to {MAX_EXPERTS} experts and '
                     f'{MAX_DEVICES} devices; got {num_experts} x {num_devices}.')
  ed = num_experts * num_devices
  # Variable layout: z [E*D] binary, x [E*D] tokens, n [E*D] copies, T.
  iz, ix, i_n, it = 0, ed, 2 * ed, 3 * ed
  nvar = 3 * ed + 1
  idx_ED = np.arange(ed).reshape(num_experts, num_devices)
  rows, cols, vals, lo, hi = [], [], [], [], []
  r = 0

  def add(row_cols, row_vals, lb, ub):
    nonlocal r
    rows.extend([r] * len(row_cols))
    cols.extend(row_cols)
    vals.extend(row_vals)
    lo.append(lb)
    hi.append(ub)
    r += 1

  for e in range(num_experts):
    add(list(ix + idx_ED[e]), [1.0] * num_devices, w_E[e], w_E[e])
    add(list(iz + idx_ED[e]), [1.0] * num_devices, 1.0, np.inf)
    for d in range(num_devices):
      k = idx_ED[e, d]
      add([ix + k, iz + k], [1.0, -max(w_E[e], 0.0)], -np.inf, 0.0)
      add([i_n + k, iz + k], [1.0, -1.0], -float(prev[e, d]), np.inf)
  for d in range(num_devices):
    add(list(iz + idx_ED[:, d]), [1.0] * num_experts, 0.0, slots_per_device)
    add(list(ix + idx_ED[:, d]) + [it], [1.0] * num_experts + [-1.0],
        -np.inf, 0.0)
    if np.isfinite(window_tokens):
      add(list(i_n + idx_ED[:, d]), [move_tokens] * num_experts, -np.inf,
          window_tokens)
  a = sparse.csr_array((vals, (rows, cols)), shape=(r, nvar))
  c = np.zeros(nvar)
  c[it] = 1.0
  c[i_n:i_n + ed] = move_tokens
  integrality = np.zeros(nvar)
  integrality[iz:iz + ed] = 1
  bounds = optimize.Bounds(np.zeros(nvar),
                           np.concatenate([np.ones(ed), np.full(ed, np.inf),
                                           np.ones(ed), [np.inf]]))
  res = optimize.milp(c, constraints=optimize.LinearConstraint(a, lo, hi),
                      integrality=integrality, bounds=bounds,
                      options={'time_limit': time_limit})
  if res.x is None:
    raise RuntimeError(f'MILP found no solution: {res.message}')
  z = res.x[iz:iz + ed].reshape(num_experts, num_devices) > 0.5
  moves = int((z & ~prev).sum())
  return MilpSolution(float(res.fun), float(res.x[it]), moves, z,
                      res.status == 0)


def holds_from_slots(slot_expert_S, num_experts: int, num_devices: int):
  """bool [E, D]: which devices hold each expert."""
  se = np.asarray(slot_expert_S).reshape(num_devices, -1)
  holds = np.zeros((num_experts, num_devices), bool)
  for d in range(num_devices):
    holds[se[d], d] = True
  return holds
