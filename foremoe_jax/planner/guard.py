"""The trainer's handle on the planner: method choice, deadline, fallback.

Sits between foresight and the RL step. Once per RL step the trainer hands
over the step's loads; ``StepPlanner.plan`` returns a StepPlan no later than
the deadline. Planning runs in one worker thread (numpy releases the GIL in
its kernels, so it overlaps the recompute phase), and ForeMoE also checks
the deadline between micro-steps and gives up early. When the planner
fails, misses the deadline, or is still busy with an abandoned step, the
previous placement is reused for every micro-step (``plan.fallback_plan``:
no expert moves) and the event is counted: planning never blocks or breaks
training (issue 5, item 5).

State (the current placement, EPLB's load history, the counters) lives on
the instance, never in the module.
"""
from __future__ import annotations

import concurrent.futures
import time

import numpy as np

from foremoe_jax import placement as placement_lib
from foremoe_jax.planner import baselines, foremoe
from foremoe_jax.planner.plan import StepPlan, fallback_plan
from foremoe_jax.planner.topology import CostModel, Topology

METHODS = ('static', 'eplb_step', 'eplb_microstep', 'foremoe')


class StepPlanner:
  """Plans one RL step at a time with a fixed method, under a deadline."""

  def __init__(self, method: str, topo: Topology, cost: CostModel,
               initial: placement_lib.Placement, *,
               deadline_s: float | None = None,
               config: foremoe.ForeMoEConfig = foremoe.ForeMoEConfig(),
               history_decay: float = 0.5, validate: bool = False):
    if method not in METHODS:
      raise ValueError(f'method must be one of {METHODS}, got {method!r}.')
    self.method, self.topo, self.cost, self.config = method, topo, cost, config
    self.deadline_s = deadline_s
    self.history_decay = history_decay
    self.validate = validate
    self.current = initial
    self.history_LE = None
    self.num_plans = 0
    self.num_fallbacks = 0
    self.num_timeouts = 0
    self.num_failures = 0
    self.last_error: BaseException | None = None
    self.last_latency_s = 0.0
    self._pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix='foremoe-planner')
    self._busy: concurrent.futures.Future | None = None

  def _run(self, loads_MLDE, current, history_LE, deadline):
    if self.method == 'static':
      return baselines.plan_static(loads_MLDE, self.topo, self.cost, current)
    if self.method == 'eplb_step':
      return baselines.plan_eplb_step(loads_MLDE, self.topo, self.cost,
                                      current, history_LE)
    if self.method == 'eplb_microstep':
      return baselines.plan_eplb_microstep(loads_MLDE, self.topo, self.cost,
                                           current)
    return foremoe.plan_step(loads_MLDE, self.topo, self.cost, current,
                             self.config, deadline=deadline)

  def plan(self, loads_MLDE) -> StepPlan:
    """Placements for the step with these loads; never waits past the
    deadline (plus thread hand-over)."""
    loads_MLDE = np.asarray(loads_MLDE)
    t0 = time.perf_counter()
    deadline = None if self.deadline_s is None else t0 + self.deadline_s
    plan = None
    if self._busy is not None and not self._busy.done():
      # An abandoned step is still running: do not queue behind it.
      self.num_timeouts += 1
    else:
      future = self._pool.submit(self._run, loads_MLDE, self.current,
                                 self.history_LE, deadline)
      try:
        plan = future.result(timeout=self.deadline_s)
        if self.validate:
          num_experts = loads_MLDE.shape[-1]
          for m in range(plan.num_microsteps):
            placement_lib.validate_placement(plan.microstep(m), num_experts,
                                             self.topo.slots_per_device)
      except (concurrent.futures.TimeoutError, foremoe.PlanningTimeout) as err:
        self.num_timeouts += 1
        self.last_error = err
        self._busy = future
        plan = None
      except Exception as err:  # pylint: disable=broad-except
        # Any planner bug must cost balance, never the training run.
        self.num_failures += 1
        self.last_error = err
        plan = None
    if plan is None:
      self.num_fallbacks += 1
      plan = fallback_plan(loads_MLDE, self.current, self.topo, self.cost)
    self.num_plans += 1
    self.current = plan.last()
    self.history_LE = baselines.update_history(self.history_LE, loads_MLDE,
                                               self.history_decay)
    self.last_latency_s = time.perf_counter() - t0
    return plan

  def stats(self) -> dict:
    return {'plans': self.num_plans, 'fallbacks': self.num_fallbacks,
            'timeouts': self.num_timeouts, 'failures': self.num_failures,
            'last_latency_s': self.last_latency_s}

  def close(self):
    self._pool.shutdown(wait=False, cancel_futures=True)
