"""Deadline and fallback (planner.guard): planning never blocks training."""
import numpy as np
import pytest

from foremoe_jax.planner import guard
from foremoe_jax.planner.plan import fallback_plan

import planner_testlib as lib


def test_plans_and_tracks_current():
  trace, topo = lib.one_node()
  planner = guard.StepPlanner('foremoe', topo, lib.COST,
                              lib.identity_for(trace, topo), deadline_s=30.0,
                              validate=True)
  for r in range(2):
    ticket = planner.submit(trace.step(r))
    plan = ticket.result()
    assert not plan.fell_back and ticket.fallback_reason is None
    lib.check_plan(plan, trace.step(r), topo)
    np.testing.assert_array_equal(planner.current.slot_expert,
                                  plan.placement.slot_expert[-1])
  assert planner.stats()['fallbacks'] == 0
  planner.close()


@pytest.mark.parametrize('method', guard.METHODS)
def test_missed_deadline_falls_back_to_the_step_level_plan(method):
  """A plan that misses its deadline is replaced by the method's step-level
  plan for these loads (static EP: the previous placement, no moves)."""
  trace, topo = lib.one_node()
  first = lib.identity_for(trace, topo)
  planner = guard.StepPlanner(method, topo, lib.COST, first, deadline_s=0.0)
  want = planner.step_level_plan(trace.step(1))
  ticket = planner.submit(trace.step(1))
  plan = ticket.result()
  assert (ticket.fallback_reason is not None) == plan.fell_back
  if plan.fell_back:  # A trivial planner may still beat a zero deadline.
    assert planner.num_fallbacks == 1 and planner.num_timeouts == 1
    # The step's log line says why, and what ran instead.
    assert ticket.fallback_reason == 'deadline 0 ms missed -> ' + (
        'previous placement' if method == 'static' else 'step-level plan')
    if method == 'static':
      np.testing.assert_array_equal(
          plan.placement.slot_expert,
          np.broadcast_to(first.slot_expert, plan.placement.slot_expert.shape))
      assert plan.moves_MLD.sum() == 0
    else:
      assert planner.num_step_level_fallbacks == 1
      np.testing.assert_array_equal(plan.placement.slot_expert,
                                    want.placement.slot_expert)
      np.testing.assert_array_equal(plan.loads_MLD, want.loads_MLD)
  lib.check_plan(plan, trace.step(1), topo)
  planner.close()


@pytest.mark.parametrize('method', ('eplb_step', 'foresight_split', 'foremoe'))
def test_failure_falls_back_to_step_level_plan_or_the_one_handed_over(method):
  """A failed plan costs the step its micro-step moves, not its balance: the
  fallback is the step-level plan (better balanced than the home layout on
  a skewed trace), or the plan the caller put on the ticket."""
  trace, topo = lib.one_node()
  first = lib.identity_for(trace, topo)
  planner = guard.StepPlanner(method, topo, lib.COST, first, deadline_s=30.0,
                              carry_over=False)
  loads = trace.step(1)
  planner.history_LE = loads.sum(axis=(0, 2)).astype(float)  # EPLB's.
  want = planner.step_level_plan(loads)

  def broken(*args):
    raise RuntimeError('planner bug')
  planner._run = broken  # pylint: disable=protected-access
  plan = planner.plan(loads)
  assert plan.fell_back and planner.num_step_level_fallbacks == 1
  np.testing.assert_array_equal(plan.placement.slot_share,
                                want.placement.slot_share)
  home = fallback_plan(loads, first, topo, lib.COST)
  assert plan.loads_MLD.max(axis=2).sum() < home.loads_MLD.max(axis=2).sum()
  # Handed over: used as is.
  ticket = planner.submit(loads)
  ticket.fallback = home._replace(fell_back=False)
  got = ticket.result()
  assert got.fell_back
  assert ticket.fallback_reason == (
      'planner failed (RuntimeError: planner bug) -> step-level plan')
  np.testing.assert_array_equal(got.loads_MLD, home.loads_MLD)
  assert planner.num_step_level_fallbacks == 2
  planner.close()


def test_an_abandoned_plan_does_not_hold_up_the_next_step():
  """Step 1's planner hangs past its deadline; step 2 still gets its own
  plan, on a fresh worker, without waiting for step 1's."""
  import threading  # pylint: disable=g-import-not-at-top
  trace, topo = lib.one_node()
  planner = guard.StepPlanner('foremoe', topo, lib.COST,
                              lib.identity_for(trace, topo), deadline_s=30.0,
                              carry_over=False)
  real_run = planner._run  # pylint: disable=protected-access
  release = threading.Event()

  def hang_once(*args):
    if not release.is_set():
      release.wait(10.0)
    return real_run(*args)
  planner._run = hang_once  # pylint: disable=protected-access
  hung = planner.submit(trace.step(0), deadline_s=0.05)
  first = hung.result()
  assert first.fell_back and planner.num_timeouts == 1
  assert hung.fallback_reason == 'deadline 50 ms missed -> step-level plan'
  planner._run = real_run  # pylint: disable=protected-access
  on_time = planner.submit(trace.step(1), deadline_s=30.0)
  second = on_time.result()
  assert not second.fell_back and on_time.fallback_reason is None
  assert planner.num_timeouts == 1 and planner.num_fallbacks == 1
  lib.check_plan(second, trace.step(1), topo)
  release.set()
  planner.close()


def test_failure_falls_back_and_is_counted():
  trace, topo = lib.one_node()
  planner = guard.StepPlanner('foremoe', topo, lib.COST,
                              lib.identity_for(trace, topo), deadline_s=30.0)

  def broken(*args):
    raise RuntimeError('planner bug')

  planner._run = broken  # pylint: disable=protected-access
  plan = planner.plan(trace.step(1))
  assert plan.fell_back
  assert planner.num_failures == 1 and planner.num_fallbacks == 1
  # A long or multi-line error stays one short line in the step's note.
  def wordy(*args):
    raise ValueError('bad\n' + 'x' * 200)
  planner._run = wordy  # pylint: disable=protected-access
  ticket = planner.submit(trace.step(1))
  ticket.result()
  reason = ticket.fallback_reason
  assert reason.startswith('planner failed (ValueError: bad xxx')
  assert reason.endswith('...) -> step-level plan') and '\n' not in reason
  assert len(reason) == len('planner failed () -> step-level plan') + 80
  lib.check_plan(plan, trace.step(1), topo)
  planner.close()


def test_fallback_predictions_match_the_placement():
  """The previous placement's shares (made for other loads) still give
  predictions equal to the placement's own split rule."""
  trace, topo = lib.two_nodes()
  planner = guard.StepPlanner('foremoe', topo, lib.COST,
                              lib.identity_for(trace, topo), deadline_s=30.0)
  planner.plan(trace.step(0))
  plan = fallback_plan(trace.step(1), planner.current, topo, lib.COST)
  assert plan.fell_back
  lib.check_plan(plan, trace.step(1), topo)
  planner.close()


def test_submit_returns_at_once_and_finalize_runs_in_the_worker():
  """The trainer dispatches the recompute between submit and result: submit
  must not wait for the planner; finalize's output is what result gives."""
  import threading  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  trace, topo = lib.one_node()
  first = lib.identity_for(trace, topo)
  planner = guard.StepPlanner('foremoe', topo, lib.COST, first,
                              deadline_s=30.0, carry_over=False)
  release = threading.Event()
  real_run = planner._run  # pylint: disable=protected-access

  def slow(*args):
    release.wait(5.0)
    return real_run(*args)

  planner._run = slow  # pylint: disable=protected-access
  seen = {}

  def finalize(plan, loads):
    seen['thread'] = threading.current_thread().name
    return (plan, loads.sum())

  class Out:
    def __init__(self, plan, total):
      self.plan, self.total = plan, total

  t0 = time.perf_counter()
  ticket = planner.submit(trace.step(1), finalize=lambda p, l: Out(
      *finalize(p, l)))
  assert time.perf_counter() - t0 < 0.5  # Planning is still blocked.
  release.set()
  out = ticket.result()
  assert out.total == trace.step(1).sum()
  assert seen['thread'].startswith('foremoe-planner')
  lib.check_plan(out.plan, trace.step(1), topo)
  # carry_over=False: every step starts again from the initial placement.
  np.testing.assert_array_equal(planner.current.slot_expert, first.slot_expert)
  assert planner.config.home_anchor
  planner.close()


def test_eplb_step_recompute_plan_is_its_update_plan():
  """EPLB-step plans from its history alone: its step-level plan (what the
  recompute runs on) is its update's plan, each expert's tokens split
  evenly over its replicas (counts within one of each other), not by the
  step's exact loads."""
  trace, topo = lib.one_node()
  planner = guard.StepPlanner('eplb_step', topo, lib.COST,
                              lib.identity_for(trace, topo), deadline_s=30.0)
  planner.history_LE = trace.step(0).sum(axis=(0, 2)).astype(np.float64)
  loads = trace.step(1)
  step_level = planner.step_level_plan(loads)
  update = planner.submit(loads).result()
  assert not update.fell_back
  np.testing.assert_array_equal(step_level.placement.slot_expert,
                                update.placement.slot_expert)
  np.testing.assert_array_equal(step_level.loads_MLD, update.loads_MLD)
  se_LS = step_level.placement.slot_expert[0]
  replicated = False
  for m in range(loads.shape[0]):
    slot_LS = np.asarray(step_level.slot_loads_MLS[m])
    for l, se_S in enumerate(se_LS):
      for e in np.unique(se_S):
        got = slot_LS[l, se_S == e]
        replicated |= len(got) > 1
        assert got.max() - got.min() <= loads.shape[2], (m, l, e, got)
  assert replicated  # The history makes EPLB replicate something.
  planner.close()


def test_eplb_step_in_training_does_not_split_onto_a_filler_copy():
  """EPLB-step as the trainer runs it (carry_over=False: home-anchored
  packing). Expert 0 is hot and wants more replicas than there are
  devices without it; the packing leaves device 0's redundant slot holding
  a second copy of expert 0. The even split must not count that copy:
  device 0 took two shares (loads 200 vs 120 elsewhere, max/mean 1.53)."""
  from foremoe_jax import placement as placement_lib  # pylint: disable=g-import-not-at-top
  from foremoe_jax.planner import split  # pylint: disable=g-import-not-at-top
  from foremoe_jax.planner.topology import CostModel, Topology  # pylint: disable=g-import-not-at-top
  from foremoe_jax.transfer import schedule  # pylint: disable=g-import-not-at-top
  topo, num_experts = Topology(1, 8, 5), 32
  w_E = np.full(num_experts, 10.0)
  w_E[0] = 800.0
  loads = np.zeros((2, 1, 8, num_experts), np.int64)
  loads[:, 0] = (np.tile(w_E, (8, 1)) / 8).astype(np.int64)
  home = placement_lib.identity_placement(1, num_experts, 8, 5)
  planner = guard.StepPlanner('eplb_step', topo, CostModel(), home,
                              carry_over=False,
                              budget=schedule.TransferBudget(8, 2))
  planner.plan(loads)  # The first step keeps the home layout (no history).
  plan = planner.plan(loads)
  planner.close()
  se_S = plan.placement.slot_expert[0, 0]
  dup_S = split.second_copies(se_S[None], 5)[0]
  assert dup_S.any() and (se_S[dup_S] == 0).all()  # The scenario holds.
  load_D = plan.loads_MLD[0, 0]
  assert load_D.max() / load_D.mean() < 1.05  # Integer rounding only.
