"""plan.capacity_demand: the bucket's rows without recounting, where the
plan's own counts are the dispatch's (one data group, exact dispatch), and
the recount everywhere else; checked against placement.capacity_demand of
every micro-step's placement."""
import numpy as np
import pytest

from foremoe_jax import placement as placement_lib
from foremoe_jax.planner import foremoe, guard, plan as plan_lib
from foremoe_jax.transfer import schedule

import planner_testlib as lib


def _recount(loads_MGLDE, plan, dispatch):
  return max(placement_lib.capacity_demand(loads_MGLDE[m], plan.microstep(m),
                                           dispatch)
             for m in range(plan.num_microsteps))


def _plans(method):
  """The plans the trainer reads a bucket from: the micro-step plan fitted
  to a tight budget, the step-level plan, and the no-move fallback."""
  trace, topo = lib.two_nodes()
  loads = trace.step(1)
  current = lib.identity_for(trace, topo)
  planner = guard.StepPlanner(method, topo, lib.COST, current,
                              config=foremoe.ForeMoEConfig(),
                              carry_over=False)
  planner.history_LE = trace.step(0).sum(axis=(0, 2)).astype(float)
  try:
    fitted, _ = schedule.fit_plan_to_budget(
        planner.submit(loads).result(), loads, topo, lib.COST,
        schedule.TransferBudget(step_rounds=2, microstep_rounds=1))
    return loads, [fitted, planner.step_level_plan(loads),
                   plan_lib.fallback_plan(loads, fitted.last(), topo,
                                          lib.COST)]
  finally:
    planner.close()


@pytest.mark.parametrize('method', guard.METHODS)
def test_one_group_takes_the_plans_own_busiest_device(method):
  loads, plans = _plans(method)
  for plan in plans:
    for dispatch in ('exact', 'padded'):
      got = plan_lib.capacity_demand(loads[:, None], plan, dispatch)
      assert got == _recount(loads[:, None], plan, dispatch), dispatch
    # The exact dispatch's demand is the busiest device of the plan.
    assert plan_lib.capacity_demand(loads[:, None], plan, 'exact') == \
        plan.loads_MLD.max()


def test_several_groups_are_recounted_group_by_group():
  loads, plans = _plans('foremoe')
  rng = np.random.default_rng(0)
  # Two data groups whose loads sum to the planned ones.
  first = rng.binomial(loads, 0.3)
  loads_MGLDE = np.stack([first, loads - first], axis=1)
  for plan in plans:
    for dispatch in ('exact', 'padded'):
      got = plan_lib.capacity_demand(loads_MGLDE, plan, dispatch)
      assert got == _recount(loads_MGLDE, plan, dispatch)
      assert plan_lib.capacity_demand(loads_MGLDE, plan, dispatch,
                                      threads=3) == got
    # A group's device computes less than the sum of both groups'.
    assert (plan_lib.capacity_demand(loads_MGLDE, plan, 'exact')
            < plan.loads_MLD.max())


def test_loads_of_another_shape_are_refused():
  loads, plans = _plans('static')
  with pytest.raises(ValueError, match=r'\[M=4, G, L, D, E\]'):
    plan_lib.capacity_demand(loads, plans[0], 'exact')
  with pytest.raises(ValueError, match='dispatch'):
    plan_lib.capacity_demand(loads[:, None], plans[0], 'ragged')
