"""Exact MILP (planner.milp) and ForeMoE's optimality gap on small instances."""
import itertools

import numpy as np

from foremoe_jax.planner import evaluate, milp
from foremoe_jax.planner.topology import CostModel


def brute_force(w_E, prev_ED, s, move_tokens):
  """Enumerates every placement on 2 devices; experts held by both devices
  level the pair, so the best max load has a closed form."""
  num_experts, num_devices = prev_ED.shape
  best = np.inf
  options = [h for h in itertools.product([0, 1], repeat=num_devices) if any(h)]
  for holds in itertools.product(options, repeat=num_experts):
    z = np.array(holds, bool)
    if (z.sum(axis=0) > s).any():
      continue
    fixed = np.zeros(num_devices)
    flexible = 0.0
    for e in range(num_experts):
      if z[e].all():
        flexible += w_E[e]
      else:
        fixed[z[e]] += w_E[e]
    lo, hi = sorted(fixed)
    t = max(hi, (lo + hi + flexible) / 2)
    best = min(best, t + move_tokens * (z & ~prev_ED).sum())
  return best


def test_milp_matches_brute_force():
  rng = np.random.default_rng(0)
  for _ in range(3):
    w = rng.integers(10, 100, 4).astype(float)
    prev = np.array([[1, 0], [1, 0], [0, 1], [0, 1]], bool)
    sol = milp.solve_microstep(w, prev, 3, move_tokens=7.0)
    assert sol.optimal
    np.testing.assert_allclose(sol.objective, brute_force(w, prev, 3, 7.0),
                               rtol=1e-6)


def test_foremoe_gap_small():
  gap = evaluate.milp_gap(CostModel(), num_layers=2, num_microsteps=5,
                          num_steps=2)
  assert gap['instances'] == 2 * 4
  assert gap['all_optimal']
  assert gap['mean'] <= 0.02
  assert gap['mean'] >= -1e-6  # The MILP is a lower bound.
