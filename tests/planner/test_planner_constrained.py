"""The planner benchmark's 'foremoe_constrained': what the trainer runs.

Checked against a hand-rolled loop (plan_step with the trainer's kwargs,
then fit_plan_to_budget), against the trainer's own StepPlanner path, and
against an independent lower bound on the shift rounds each transition
needs.
"""
import dataclasses

import numpy as np
import pytest

from configs import tiny
from foremoe_jax import placement as placement_lib
from foremoe_jax.planner import evaluate, foremoe, guard
from foremoe_jax.transfer import schedule

import planner_testlib as lib

# E=64 top-2 on 8 devices: hot enough that the fit undoes moves.
BC = evaluate.BenchConfig('c', 64, 2, num_layers=3, num_microsteps=5,
                          num_steps=3, tokens_per_seq=2048)


def _rounds_lower_bound(prev_LS, next_LS, num_experts, s, mode='exact'):
  """Per layer, rounds the transition needs at least: the most remote
  fills into one device (a device receives one item per round; a fill is
  local when the device holds the expert at home or in a previous slot),
  and exactly the gradient returns' rounds, whose edges are fixed (evicted
  replica -> its home). ``rounds``: a round holds one shift
  k = (home - sender) % D and one edge per sender, so they take sum over k
  of max over senders; ``exact``: the most returns one device sends or
  receives. -1: empty / flushed."""
  num_layers, num_slots = next_LS.shape
  num_devices = num_slots // s
  h = num_experts // num_devices
  need_L = np.zeros(num_layers, np.int64)
  for l in range(num_layers):
    edges_CK = np.zeros((num_devices, num_devices), np.int64)
    for d in range(num_devices):
      prev, nxt = prev_LS[l, d * s:(d + 1) * s], next_LS[l, d * s:(d + 1) * s]
      fills = sum(1 for j in range(s) if nxt[j] >= 0 and nxt[j] != prev[j]
                  and nxt[j] // h != d and nxt[j] not in set(prev))
      need_L[l] = max(need_L[l], fills)
      for j in range(s):
        if prev[j] >= 0 and prev[j] != nxt[j] and prev[j] // h != d:
          edges_CK[d, (prev[j] // h - d) % num_devices] += 1
    if mode == 'rounds':
      need_L[l] = max(need_L[l], edges_CK.max(axis=0).sum())
    else:  # edges_CK[c, k]: c sends k = home - c devices on.
      recv_D = np.zeros(num_devices, np.int64)
      for k in range(num_devices):
        recv_D += np.roll(edges_CK[:, k], k)
      need_L[l] = max(need_L[l], edges_CK.sum(1).max(), recv_D.max())
  return need_L


def _assert_same_plan(a, b):
  np.testing.assert_array_equal(a.placement.slot_expert,
                                b.placement.slot_expert)
  np.testing.assert_array_equal(a.placement.slot_share, b.placement.slot_share)
  np.testing.assert_array_equal(a.loads_MLD, b.loads_MLD)
  np.testing.assert_array_equal(a.moves_MLD, b.moves_MLD)


@pytest.mark.parametrize('mode', schedule.MODES)
def test_constrained_equals_the_trainers_loop_and_fits_the_budget(mode):
  trace, topo = evaluate.config_trace(BC), BC.topology()
  budget = BC.transfer_budget()
  # configs/tiny.py's transfer section is the default rule on its devices.
  c = tiny.get_config()
  assert evaluate.trainer_budget(c.parallel.num_expert) == (
      schedule.TransferBudget(c.transfer.step_rounds,
                              c.transfer.microstep_rounds,
                              c.transfer.mode)) == budget
  budget = budget._replace(mode=mode)
  fit_log = []
  got, _ = evaluate.run_methods(trace, topo, lib.COST,
                                methods=(evaluate.CONSTRAINED,),
                                fit_log=fit_log, budget=budget
                                )[evaluate.CONSTRAINED]
  home = lib.identity_for(trace, topo)
  # The kwargs rl.trainer.make_rl_context gives its StepPlanner, spelled out.
  per_device = mode == 'exact'
  config = dataclasses.replace(
      foremoe.ForeMoEConfig(), home_anchor=True,
      anchor_rounds=budget.step_rounds, transfer_mode=budget.mode,
      moves_per_layer=None if per_device else budget.microstep_rounds,
      microstep_degree=budget.microstep_rounds if per_device else None)
  trainer = guard.StepPlanner('foremoe', topo, lib.COST, home,
                              carry_over=False, budget=budget)
  fit = lambda plan, loads: schedule.fit_plan_to_budget(
      plan, loads, topo, lib.COST, budget)[0]
  s, num_experts = topo.slots_per_device, BC.num_experts
  empty_LS = np.full(home.slot_expert.shape, -1)
  reverted, raw_over = 0, 0
  for r in range(trace.num_steps):
    loads = trace.step(r)
    # Every step from the home layout: the trainer's carry_over=False.
    raw = foremoe.plan_step(loads, topo, lib.COST, home, config)
    raw_over += (_rounds_lower_bound(raw.placement.slot_expert[-1], empty_LS,
                                     num_experts, s, mode)
                 > budget.step_rounds).sum()
    want, n = schedule.fit_plan_to_budget(raw, loads, topo, lib.COST, budget)
    _assert_same_plan(got[r], want)
    _assert_same_plan(got[r], trainer.submit(loads, finalize=fit).result())
    assert fit_log[r]['reverted_slots'] == n
    assert fit_log[r]['changed_layer_microsteps'] == int(
        (want.placement.slot_expert != raw.placement.slot_expert).any(-1).sum())
    reverted += n
    se = np.asarray(got[r].placement.slot_expert)
    for m in range(BC.num_microsteps):
      placement_lib.validate_placement(got[r].microstep(m), num_experts, s)
    # Fill, every transition between micro-steps, flush: within budget.
    assert (_rounds_lower_bound(empty_LS, se[0], num_experts, s, mode)
            <= budget.step_rounds).all()
    for m in range(1, BC.num_microsteps):
      assert (_rounds_lower_bound(se[m - 1], se[m], num_experts, s, mode)
              <= budget.microstep_rounds).all()
    assert (_rounds_lower_bound(se[-1], empty_LS, num_experts, s, mode)
            <= budget.step_rounds).all()
  trainer.close()
  # Here the planner alone leaves a flush over budget and the fit undoes
  # moves: the check and the fit are both exercised.
  if mode == 'rounds':
    assert raw_over > 0 and reverted > 0
  else:
    # The moves bound each device's degree as the schedule counts it, and
    # the shed (`packing.shed_placement`) charges each copy to its home,
    # while the schedule may pick another holder: the fit undoes at most a
    # few of the step's (micro-step, layer, slot) entries.
    entries = trace.num_steps * np.asarray(got[0].placement.slot_expert).size
    assert raw_over == 0 and reverted <= 0.005 * entries


def test_summary_reports_the_constraint_cost():
  bc = dataclasses.replace(BC, num_steps=2, num_layers=2, num_microsteps=3,
                           transfer_step_rounds=3, transfer_microstep_rounds=1)
  summary, series = evaluate.run_config(bc, lib.COST)
  assert summary['transfer_budget'] == {'step_rounds': 3,
                                        'microstep_rounds': 1,
                                        'mode': 'exact', 'flush': 'auto'}
  fm, con = (summary['methods'][m] for m in ('foremoe', evaluate.CONSTRAINED))
  assert set(fm) <= set(con) and evaluate.CONSTRAINED in series
  np.testing.assert_allclose(
      summary['constraint_cost'],
      con['mean_max_over_mean'] - fm['mean_max_over_mean'])
  assert summary['meets_target_constrained'] == (
      con['mean_max_over_mean'] <= summary['target_max_over_mean'])
  assert summary['meets_target'] == (
      fm['mean_max_over_mean'] <= summary['target_max_over_mean'])
  assert 0 <= con['fit_changed_layer_microstep_frac'] <= 1
