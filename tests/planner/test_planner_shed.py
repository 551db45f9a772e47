"""packing.shed_placement: a micro-step's redundant slots re-chosen so hot
devices shed their load, checked against a brute-force optimum, against
an independent count of the transition's transfers, and in the planner
(what the trainer runs) against the planner without it."""
import itertools

import numpy as np
import pytest
from scipy import optimize

from foremoe_jax import placement as placement_lib
from foremoe_jax.foresight import alt_traces
from foremoe_jax.planner import evaluate, foremoe, packing, split
from foremoe_jax.planner.topology import Topology

import planner_testlib as lib


def _min_max_load(se_S, w_E, num_devices):
  """The exact min over splits of the busiest device's load (an LP)."""
  se_S = np.asarray(se_S)
  s = len(se_S) // num_devices
  num_slots, num_experts = len(se_S), len(w_E)
  # Variables: tokens per slot [S], then T.
  c = np.r_[np.zeros(num_slots), 1.0]
  a_eq = np.zeros((num_experts, num_slots + 1))
  a_eq[se_S, np.arange(num_slots)] = 1.0
  a_ub = np.zeros((num_devices, num_slots + 1))
  a_ub[np.arange(num_slots) // s, np.arange(num_slots)] = 1.0
  a_ub[:, -1] = -1.0
  res = optimize.linprog(c, A_ub=a_ub, b_ub=np.zeros(num_devices),
                         A_eq=a_eq, b_eq=w_E, bounds=(0, None))
  assert res.status == 0
  return res.fun


def _home_layout(num_experts, num_devices, r):
  h = num_experts // num_devices
  return placement_lib.identity_placement(
      1, num_experts, num_devices, h + r).slot_expert.astype(np.int64)


def test_shed_is_near_the_brute_force_optimum():
  # 6 experts, 3 devices, 1 redundant slot each: every choice of the three
  # slots (a non-home expert, or nothing) is tried, each scored exactly.
  num_experts, num_devices, h = 6, 3, 2
  topo = Topology(1, num_devices, h + 1)
  home_LS = _home_layout(num_experts, num_devices, 1)
  rng = np.random.default_rng(0)
  options = [[d * h] + [e for e in range(num_experts) if e // h != d]
             for d in range(num_devices)]
  ratios, home_ratios = [], []
  for _ in range(40):
    w_E = np.round(rng.dirichlet(np.full(num_experts, 0.5)) * 6000)
    best = np.inf
    for pick in itertools.product(*options):
      se = home_LS[0].reshape(num_devices, -1).copy()
      se[:, h] = pick
      best = min(best, _min_max_load(se.ravel(), w_E, num_devices))
    got_LS = packing.shed_placement(w_E[None], home_LS, topo)
    # Every expert stays home; the redundant slot holds one expert.
    np.testing.assert_array_equal(got_LS.reshape(num_devices, -1)[:, :h],
                                  home_LS.reshape(num_devices, -1)[:, :h])
    got = _min_max_load(got_LS[0], w_E, num_devices)
    home = w_E.reshape(num_devices, h).sum(axis=1).max()
    assert got <= home + 1e-6
    ratios.append(got / best)
    home_ratios.append(home / best)
  ratios = np.array(ratios)
  # Near-optimal, far from the home layout it starts from.
  assert ratios.min() >= 1 - 1e-9
  assert np.mean(ratios) < 1.02 and ratios.max() < 1.15, ratios
  assert np.mean(home_ratios) > 1.3


def _transition_counts(prev_LS, next_LS, num_experts, num_devices):
  """Independently counted, per layer and device: new copies in, copies
  charged to their expert's home, gradients of evicted replicas home."""
  num_layers, num_slots = next_LS.shape
  s = num_slots // num_devices
  h = num_experts // num_devices
  copies = np.zeros((num_layers, num_devices), int)
  sends, returns = np.zeros_like(copies), np.zeros_like(copies)
  for l in range(num_layers):
    for d in range(num_devices):
      before = set(prev_LS[l, d * s:(d + 1) * s].tolist())
      after = set(next_LS[l, d * s:(d + 1) * s].tolist())
      for e in after - before:
        copies[l, d] += 1
        sends[l, e // h] += 1
      for e in before - after:
        if e // h != d:
          returns[l, e // h] += 1
  return copies, sends, returns


@pytest.mark.parametrize('degree', [1, 2])
def test_shed_transition_keeps_the_degree(degree):
  trace = alt_traces.zipf_dirichlet_trace(alt_traces.ZipfDirichletConfig(
      num_steps=1, num_microsteps=6, num_layers=3, num_experts=64, top_k=2,
      num_devices=8, tokens_per_device=2048, zipf_exponent=1.0,
      concentration=0.3, seed=1))
  num_devices, num_experts, r = 8, 64, 2
  topo = Topology(2, 4, num_experts // num_devices + r)
  prev_LS = np.repeat(_home_layout(num_experts, num_devices, r), 3, axis=0)
  w_MLE = trace.step(0).sum(axis=2).astype(float)
  changed = 0
  for m in range(w_MLE.shape[0]):
    next_LS = packing.shed_placement(w_MLE[m], prev_LS, topo, degree)
    # Every expert stays in its home slot.
    home_LDh = prev_LS.reshape(3, num_devices, -1)[:, :, :-r]
    np.testing.assert_array_equal(
        next_LS.reshape(3, num_devices, -1)[:, :, :-r], home_LDh)
    copies, sends, returns = _transition_counts(prev_LS, next_LS, num_experts,
                                                num_devices)
    assert copies.max() <= degree and sends.max() <= degree
    assert returns.max() <= degree
    changed += int((next_LS != prev_LS).sum())
    prev_LS = next_LS
  assert changed > 0


def test_shed_finds_the_chain():
  # One expert per device, one redundant slot each; mean load 10. Device 0
  # must shed 10 and device 1 4, but the two cold devices have room 9 and 5
  # and one slot each: the level 10 is reached only through a chain, device
  # 0's replicas on device 3 (9) and on device 1 (1), device 1's on
  # device 2 (5). Shedding just the excess would leave device 0 at 11.
  w_E = np.array([20.0, 14.0, 5.0, 1.0])
  topo = Topology(1, 4, 2)
  got_LS = packing.shed_placement(w_E[None], _home_layout(4, 4, 1), topo)
  assert _min_max_load(got_LS[0], w_E, 4) == pytest.approx(10.0)


def test_planner_with_shed_balances_alt_traces_better():
  tc = alt_traces.ZipfDirichletConfig(
      num_steps=2, num_microsteps=4, num_layers=3, num_experts=64, top_k=2,
      num_devices=8, tokens_per_device=2048, zipf_exponent=0.6,
      concentration=0.3, seed=0)
  trace = alt_traces.zipf_dirichlet_trace(tc)
  bc = [b for b in evaluate.alt_configs({'alt:t': tc})
        if b.redundant_slots_per_device == 1][0]
  topo, budget = bc.topology(), bc.transfer_budget()
  got = {}
  for shed in (False, True):
    fit_log = []
    out = evaluate.run_methods(
        trace, topo, lib.COST, foremoe.ForeMoEConfig(shed=shed),
        methods=(evaluate.CONSTRAINED,), budget=budget, fit_log=fit_log)
    plans = out[evaluate.CONSTRAINED][0]
    got[shed] = np.mean([placement_lib.max_over_mean(p.loads_MLD).mean()
                         for p in plans[1:]])
  assert got[True] < got[False] - 0.02, got


def test_shed_leaves_foresight_split_and_balanced_layers_alone():
  trace, topo = lib.small_trace(num_experts=32, num_devices=8), Topology(
      1, 8, 32 // 8 + 1)
  home = lib.identity_for(trace, topo)
  base = dict(home_anchor=True, microstep_degree=2)
  for extra in (dict(max_rounds=0), dict(shed_tol=1e9)):
    plans = [foremoe.plan_step(trace.step(1), topo, lib.COST, home,
                               foremoe.ForeMoEConfig(shed=shed, **base,
                                                     **extra))
             for shed in (False, True)]
    np.testing.assert_array_equal(plans[0].placement.slot_expert,
                                  plans[1].placement.slot_expert)
    np.testing.assert_array_equal(plans[0].loads_MLD, plans[1].loads_MLD)
  with pytest.raises(ValueError, match='shed_tol'):
    foremoe.ForeMoEConfig(shed_tol=-0.1)
