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
    plan = planner.plan(trace.step(r))
    assert not plan.fell_back
    lib.check_plan(plan, trace.step(r), topo)
    np.testing.assert_array_equal(planner.current.slot_expert,
                                  plan.placement.slot_expert[-1])
  assert planner.stats()['fallbacks'] == 0
  planner.close()


@pytest.mark.parametrize('method', guard.METHODS)
def test_missed_deadline_reuses_previous_placement(method):
  trace, topo = lib.one_node()
  first = lib.identity_for(trace, topo)
  planner = guard.StepPlanner(method, topo, lib.COST, first, deadline_s=0.0)
  plan = planner.plan(trace.step(1))
  if plan.fell_back:  # A trivial planner may still beat a zero deadline.
    assert planner.num_fallbacks == 1 and planner.num_timeouts == 1
    np.testing.assert_array_equal(
        plan.placement.slot_expert,
        np.broadcast_to(first.slot_expert, plan.placement.slot_expert.shape))
    assert plan.moves_MLD.sum() == 0
  lib.check_plan(plan, trace.step(1), topo)
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
