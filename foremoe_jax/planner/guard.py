"""The trainer's handle on the planner: method choice, deadline, fallback.

Sits between foresight and the RL step. Once per RL step the trainer hands
over the step's loads; ``StepPlanner.plan`` returns a StepPlan no later than
the deadline. Planning runs off the trainer's thread: `submit` starts it
and returns at once, so the trainer dispatches the recompute phase to the
device and collects the plan with `result()` when the update needs it.
With `workers` > 1 the layers are cut into chunks planned side by side in
worker processes (`planner.layers`); a chunk that fails or misses the
deadline is replaced by the fallback plan's same layers
(`StepPlan.fell_back_L`), so a late planner costs only its late layers.
ForeMoE also checks the deadline between micro-steps and gives up early.
When the planning thread itself fails or misses the deadline, the whole
step falls back, and the event is counted: planning never blocks or
breaks training. The fallback is the
method's step-level plan (`step_level_plan`: one placement for the whole
step, made in milliseconds; for the foresight methods the step's exact
loads with a per-micro-step token split, which is the `foresight_split`
method itself), or one the caller already made and handed over
(`PlanTicket.fallback`: the trainer's recompute plan); only static EP, or a
step-level plan that fails too, reuses the previous placement for every
micro-step (``plan.fallback_plan``: no expert moves). A plan abandoned
past its deadline never holds up the next step: that step gets a fresh
worker. Each fallback says why on its ticket (`PlanTicket.fallback_reason`,
e.g. "deadline 120 ms missed -> step-level plan"), which the trainer puts
on the step's log line and in its metrics record.

State (the current placement, EPLB's load history, the counters) lives on
the instance, never in the module.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import time

import numpy as np

from foremoe_jax import placement as placement_lib
from foremoe_jax.planner import baselines, foremoe, split
from foremoe_jax.planner import layers as layers_lib
from foremoe_jax.planner.plan import StepPlan, assemble_plan, fallback_plan
from foremoe_jax.planner.topology import CostModel, Topology

# foresight_split: the simplest use of the foresight, what moving experts
# between micro-steps must beat: the step-level placement from the step's
# exact loads and a per-micro-step token split over its replicas, no moves
# (ForeMoE with no rounds of moves).
METHODS = ('static', 'eplb_step', 'eplb_microstep', 'foresight_split',
           'foremoe')


def default_workers(num_layers: int | None = None) -> int:
  """Planner processes when the config says 0 (auto): a quarter of this
  host's cores, at most 8 and at most one per layer; 1 (plan in the
  trainer's planning thread, no processes) on hosts of fewer than 8 cores,
  where the processes would take the cores the trainer's own work needs."""
  n = min(8, (os.cpu_count() or 1) // 4)
  if num_layers is not None:
    n = min(n, num_layers)
  return n if n >= 2 else 1


def run_method(method: str, topo: Topology, cost: CostModel,
               config: foremoe.ForeMoEConfig, loads_MLDE, current, history_LE,
               deadline):
  """Plans one step (or one chunk of its layers: `planner.layers`) with
  `method`; module-level so a worker process can run it."""
  if method == 'static':
    return baselines.plan_static(loads_MLDE, topo, cost, current)
  if method == 'eplb_step':
    return baselines.plan_eplb_step(loads_MLDE, topo, cost, current,
                                    history_LE, home_anchor=config.home_anchor,
                                    max_rounds=config.anchor_rounds)
  if method == 'eplb_microstep':
    return baselines.plan_eplb_microstep(
        loads_MLDE, topo, cost, current, home_anchor=config.home_anchor,
        max_rounds=config.anchor_rounds)
  if method == 'foresight_split':
    config = dataclasses.replace(config, max_rounds=0)
  return foremoe.plan_step(loads_MLDE, topo, cost, current, config,
                           deadline=deadline)


def step_level(method: str, topo: Topology, cost: CostModel,
               config: foremoe.ForeMoEConfig, loads_MLDE, current,
               history_LE, threads: int = 1) -> StepPlan:
  """`StepPlanner.step_level_plan` of one step (or of some of its
  layers, for a per-layer fallback); threads: `assemble_plan`'s."""
  loads_MLDE = np.asarray(loads_MLDE)
  num_micro = loads_MLDE.shape[0]
  step_1LDE = loads_MLDE.sum(axis=0, keepdims=True)
  if method == 'static':
    plan = baselines.plan_static(step_1LDE, topo, cost, current)
  elif method == 'eplb_step':
    # Its update's own plan: the placement packed from the history, each
    # micro-step's tokens split evenly over the replicas. Splitting them by
    # the step's exact loads instead would hand EPLB-step's recompute the
    # foresight it does not have, and that its update does not use.
    return run_method(method, topo, cost, config, loads_MLDE, current,
                      history_LE, deadline=None)
  else:
    plan = foremoe.plan_step(step_1LDE, topo, cost, current,
                             dataclasses.replace(config, max_rounds=0,
                                                 node_split_slack=None))
  one = plan.microstep(0)
  tile = lambda x: np.repeat(np.asarray(x)[None], num_micro, axis=0)
  return assemble_plan(
      loads_MLDE, tile(one.slot_expert),
      np.stack([split.balanced_flows(one.slot_expert, loads_MLDE[m].sum(1),
                                     topo)[0]
                for m in range(num_micro)]),
      topo, cost, np.asarray(current.slot_expert), threads=threads)


def _one_line(err: BaseException, limit: int = 80) -> str:
  """'Type: message' on one line, cut to `limit` characters (a log line's
  note, not the traceback: `StepPlanner.last_error` keeps the exception)."""
  text = ' '.join(f'{type(err).__name__}: {err}'.split())
  return text if len(text) <= limit else text[:limit - 3] + '...'


class PlanTicket:
  """A plan being made in the worker thread; `result()` waits for it.

  `result()` returns no later than the ticket's deadline (plus the
  hand-over); past it, or when planning failed, the fallback (the previous
  placement for every micro-step) is returned instead and counted.
  `fallback_reason` is then why, and what was used instead (None until
  `result()` returns, and when the plan was made in time).
  """

  def __init__(self, planner: 'StepPlanner', loads_MLDE, future, deadline,
               finalize, t_submit: float):
    self._planner, self._loads, self._future = planner, loads_MLDE, future
    self._deadline, self._finalize = deadline, finalize
    self.t_submit = t_submit
    # Seconds the planner had (None: no deadline), for the fallback reason.
    self.deadline_s = None if deadline is None else deadline - t_submit
    self._result = None
    self.fallback_reason: str | None = None
    # A StepPlan for these loads to fall back on (e.g. the recompute's
    # step-level plan, already made); None: `StepPlanner` makes one.
    self.fallback = None

  def result(self):
    if self._result is None:
      self._result = self._planner._collect(self)  # pylint: disable=protected-access
    return self._result


class StepPlanner:
  """Plans one RL step at a time with a fixed method, under a deadline.

  carry_over: plan each step from the previous step's last placement (True)
  or from `initial` every step (False: the transfer engine refills the slot
  buffers from the canonical experts at the start of every update, so the
  placement that costs nothing to install is always the home layout, and
  every method packs with experts kept home: `home_anchor`).
  anchor_rounds, moves_per_layer: the engine's round budgets (fill and
  flush; between micro-steps), which plans then respect
  (`ForeMoEConfig.anchor_rounds`; between micro-steps, for the ``exact``
  engine the degree of every device, `ForeMoEConfig.microstep_degree`,
  and for the ``rounds`` engine the copies per layer,
  `ForeMoEConfig.moves_per_layer`).
  budget: the transfer engine's `TransferBudget`, in their place: its step
  rounds as anchor_rounds, its micro-step rounds as moves_per_layer, and
  its mode, which prices the anchor's replicas and picks the bound
  between micro-steps (`ForeMoEConfig.transfer_mode`; without it, the
  config's).
  workers: processes planning layer chunks side by side (1: the planning
  thread plans every layer at once; `default_workers` picks for a host).
  chunks_per_worker: chunks per worker; more make a late planner cost
  fewer layers and balance the workers better, fewer batch more numpy work.
  layer_pool: worker processes to share (sets `workers`; not closed here).
  """

  def __init__(self, method: str, topo: Topology, cost: CostModel,
               initial: placement_lib.Placement, *,
               deadline_s: float | None = None,
               config: foremoe.ForeMoEConfig = foremoe.ForeMoEConfig(),
               history_decay: float = 0.5, validate: bool = False,
               carry_over: bool = True, anchor_rounds: int | None = None,
               moves_per_layer: int | None = None, budget=None,
               workers: int = 1,
               chunks_per_worker: int = 2,
               layer_pool: layers_lib.LayerPool | None = None):
    if method not in METHODS:
      raise ValueError(f'method must be one of {METHODS}, got {method!r}.')
    if not carry_over:
      config = dataclasses.replace(config, home_anchor=True)
    if budget is not None:
      if anchor_rounds is not None or moves_per_layer is not None:
        raise ValueError('give the budget or its rounds '
                         '(anchor_rounds, moves_per_layer), not both.')
      anchor_rounds, moves_per_layer = (budget.step_rounds,
                                        budget.microstep_rounds)
      config = dataclasses.replace(config, transfer_mode=budget.mode)
    if anchor_rounds is not None:
      config = dataclasses.replace(config, anchor_rounds=anchor_rounds)
    if moves_per_layer is not None:
      # The exact engine bounds each device's sends and receives, not the
      # layer's copies (a layer of D devices may take up to D x R).
      config = dataclasses.replace(
          config, **({'microstep_degree': moves_per_layer,
                      'moves_per_layer': None}
                     if config.transfer_mode == 'exact'
                     else {'moves_per_layer': moves_per_layer}))
    self.method, self.topo, self.cost, self.config = method, topo, cost, config
    self.deadline_s = deadline_s
    self.history_decay = history_decay
    self.validate = validate
    self.initial = initial
    self.carry_over = carry_over
    self.current = initial
    self.history_LE = None
    self.num_plans = 0
    self.num_fallbacks = 0
    self.num_timeouts = 0
    self.num_failures = 0
    self.last_error: BaseException | None = None
    self.last_latency_s = 0.0
    self.num_step_level_fallbacks = 0  # Fallbacks to the step-level plan.
    # Steps where some layer chunks fell back, and layers that did (whole
    # steps included).
    self.num_layer_fallbacks = 0
    self.num_layers_fallen_back = 0
    if workers < 1 or chunks_per_worker < 1:
      raise ValueError(f'workers and chunks_per_worker must be >= 1, got '
                       f'{workers} and {chunks_per_worker}.')
    if layer_pool is not None:
      workers = layer_pool.workers
    self.workers, self.chunks_per_worker = int(workers), int(chunks_per_worker)
    # Worker processes for layer chunks (None: plan in the thread); a pool
    # handed over is shared (e.g. by the simulator's methods), not closed.
    self._own_layers = layer_pool is None
    self._layers = layer_pool or (layers_lib.LayerPool(self.workers)
                                  if self.workers > 1 else None)
    self._chunk_futures: list[concurrent.futures.Future] = []
    self._finish_s = 0.0  # Joining + finalizing, last step (the reserve).
    self._pool = self._new_pool()
    self._busy: concurrent.futures.Future | None = None

  @staticmethod
  def _new_pool():
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix='foremoe-planner')

  def _call(self, fn):
    return functools.partial(fn, self.method, self.topo, self.cost,
                             self.config)

  def _run(self, loads_MLDE, current, history_LE, deadline):
    return self._call(run_method)(loads_MLDE, current, history_LE, deadline)

  def _chunks(self, num_layers: int) -> list[np.ndarray]:
    return layers_lib.chunks(num_layers,
                             self.workers * self.chunks_per_worker)

  def _submit_chunks(self, loads_MLDE, current, history_LE, deadline):
    """[(layers, future)] of the method's plan of each layer chunk, in
    the worker processes."""
    unix = (None if deadline is None
            else time.time() + (deadline - time.perf_counter()))
    out = []
    for ls in self._chunks(loads_MLDE.shape[1]):
      out.append((ls, self._layers.submit(
          layers_lib.plan_chunk, self._call(run_method), loads_MLDE[:, ls],
          layers_lib.take_placement(current, ls, axis=0),
          None if history_LE is None else np.asarray(history_LE)[ls], unix)))
    return out

  def step_level_plan(self, loads_MLDE, current=None) -> StepPlan:
    """One placement for every micro-step, at once, from what the method
    knows before the step (synchronous; the recompute's plan, so that
    forward runs balanced while the micro-step plan is made): static the
    home layout, EPLB-step its history (its update's plan, tokens split
    evenly over replicas), the foresight methods the step's exact loads
    (the refined anchor and one token split, no moves). Made in this
    thread even with workers: its output is mostly the shares of every
    micro-step, and copying them back from two processes made it slower
    than one thread (DeepSeek-V3-like, EP 256: 5.2 s vs 4.5 s, docs/
    results.md). Its micro-steps are split in `workers` threads instead
    (`assemble_plan`), which share them without a copy.
    """
    loads_MLDE = np.asarray(loads_MLDE)
    current = self.current if current is None else current
    return self._call(step_level)(loads_MLDE, current, self.history_LE,
                                  threads=self.workers)

  def _fallback_for(self, ticket: 'PlanTicket', loads_MLDE, current,
                    ls=None) -> tuple[StepPlan, str]:
    """What layers `ls` (None: all) fall back on, and which it is: the
    ticket's plan ('given'), else their step-level plan, made here in this
    thread, since the worker processes may be the ones stuck
    ('step-level'), else (static EP, or that fails) the previous placement
    ('previous')."""
    pick = lambda x: x if ls is None else np.asarray(x)[:, ls]
    if ticket.fallback is not None:
      return (ticket.fallback if ls is None else layers_lib.take(
          ticket.fallback, ls, self.cost.bytes_per_expert)), 'given'
    cur = current if ls is None else layers_lib.take_placement(current, ls,
                                                               axis=0)
    if self.method != 'static':
      history = self.history_LE
      if history is not None and ls is not None:
        history = np.asarray(history)[ls]
      try:
        return (self._call(step_level)(pick(loads_MLDE), cur, history,
                                       threads=self.workers), 'step-level')
      except Exception as err:  # pylint: disable=broad-except
        self.last_error = err
    return (fallback_plan(pick(loads_MLDE), cur, self.topo, self.cost),
            'previous')

  def _fallback_layers(self, ticket: 'PlanTicket', loads_MLDE, current,
                       ls) -> tuple[StepPlan, str]:
    """`_fallback_for` of layers `ls`, marked as fallen back."""
    plan, used = self._fallback_for(ticket, loads_MLDE, current, ls)
    return plan._replace(fell_back=True,
                         fell_back_L=np.ones(len(ls), bool)), used

  def _plan_by_chunks(self, ticket: 'PlanTicket', loads_MLDE, current,
                      history_LE, deadline) -> StepPlan:
    """The step planned chunk by chunk in the worker processes; chunks not
    done `reserve` before the deadline (1.5x what joining and finalizing
    took last time, at least a tenth of the deadline, so the plan is still
    handed over in time), or failed, take the fallback for their layers
    alone."""
    futures = self._submit_chunks(loads_MLDE, current, history_LE, deadline)
    self._chunk_futures = [f for _, f in futures]
    timeout = None
    if deadline is not None:
      reserve = max(1.5 * self._finish_s, 0.1 * (ticket.deadline_s or 0.0))
      timeout = max(0.0, deadline - reserve - time.perf_counter())
    concurrent.futures.wait(self._chunk_futures, timeout=timeout)
    t_join = time.perf_counter()
    parts, late, failed = [], [], []
    for ls, f in futures:
      err = f.exception(timeout=0) if f.done() else None
      if not f.done() or isinstance(err, foremoe.PlanningTimeout):
        late.append(ls)
      elif err is not None:
        self.last_error = err
        failed.append(ls)
      else:
        parts.append((ls, f.result()))
    num_layers = loads_MLDE.shape[1]
    missing = late + failed
    if missing:
      ls = np.sort(np.concatenate(missing))
      plan, used = self._fallback_layers(ticket, loads_MLDE, current, ls)
      parts.append((ls, plan))
      self.num_layer_fallbacks += 1
      self.num_layers_fallen_back += len(ls)
      why = []
      if late:
        why.append('deadline missed' if ticket.deadline_s is None else
                   f'deadline {ticket.deadline_s * 1e3:.0f} ms missed')
        self.num_timeouts += 1
      if failed:
        why.append(f'planner failed ({_one_line(self.last_error)})')
        self.num_failures += 1
      ticket.fallback_reason = (
          f"{' and '.join(why)} in {len(missing)} of {len(futures)} layer "
          f'chunks -> {used} plan for {len(ls)} of {num_layers} layers')
    plan = layers_lib.join(parts, num_layers)
    self._finish_s = time.perf_counter() - t_join
    return plan

  def _work(self, ticket, loads_MLDE, current, history_LE, deadline,
            finalize):
    if self._layers is None:
      plan = self._run(loads_MLDE, current, history_LE, deadline)
    else:
      plan = self._plan_by_chunks(ticket, loads_MLDE, current, history_LE,
                                  deadline)
    t_done = time.perf_counter()
    if self.validate:
      num_experts = loads_MLDE.shape[-1]
      for m in range(plan.num_microsteps):
        placement_lib.validate_placement(plan.microstep(m), num_experts,
                                         self.topo.slots_per_device)
    out = plan if finalize is None else finalize(plan, loads_MLDE)
    if self._layers is not None:
      self._finish_s += time.perf_counter() - t_done
    return out

  def submit(self, loads_MLDE, *, deadline_s: float | None = None,
             finalize=None, fallback: StepPlan | None = None) -> PlanTicket:
    """Starts planning the step with these loads off this thread.

    deadline_s: seconds from now (None: the planner's `deadline_s`).
    finalize(plan, loads) -> a StepPlan or any object whose `.plan` is the
    (possibly amended) StepPlan: runs in the worker after a plan is made
    (and on the fallback), e.g. fitting the plan to the transfer budget and
    building its moves; `result()` returns its output.
    fallback: a plan for these loads to fall back on, whole or per layer
    (e.g. the recompute's step-level plan, already made); None: made when
    needed. Also settable as `PlanTicket.fallback` until it is needed.
    """
    loads_MLDE = np.asarray(loads_MLDE)
    t0 = time.perf_counter()
    deadline_s = self.deadline_s if deadline_s is None else deadline_s
    deadline = None if deadline_s is None else t0 + deadline_s
    if self._busy is not None and not self._busy.done():
      # An abandoned step is still running: leave it its worker (it stops
      # at its own deadline or finishes) and plan this one on a new one.
      self._pool.shutdown(wait=False, cancel_futures=True)
      self._pool = self._new_pool()
    self._busy = None
    if self._layers is not None and not all(f.done()
                                            for f in self._chunk_futures):
      # Chunks of an abandoned step still hold workers: new workers.
      self._layers.restart()
    self._chunk_futures = []
    ticket = PlanTicket(self, loads_MLDE, None, deadline, finalize, t0)
    ticket.fallback = fallback
    ticket._future = self._pool.submit(  # pylint: disable=protected-access
        self._work, ticket, loads_MLDE, self.current, self.history_LE,
        deadline, finalize)
    return ticket

  def _fallback(self, ticket: PlanTicket) -> tuple[StepPlan, str]:
    """The step-level plan (the ticket's, else made now), or the previous
    placement for static EP and when that fails too; with its name."""
    loads_MLDE = ticket._loads  # pylint: disable=protected-access
    plan, used = self._fallback_for(ticket, loads_MLDE, self.current)
    if used == 'previous':
      return plan, 'previous placement'
    self.num_step_level_fallbacks += 1
    return plan._replace(fell_back=True), 'step-level plan'

  def _collect(self, ticket: PlanTicket):
    loads_MLDE, future = ticket._loads, ticket._future  # pylint: disable=protected-access
    out, why = None, 'no plan'
    if future is not None:
      timeout = (None if ticket._deadline is None  # pylint: disable=protected-access
                 else max(0.0, ticket._deadline - time.perf_counter()))  # pylint: disable=protected-access
      try:
        out = future.result(timeout=timeout)
      except (concurrent.futures.TimeoutError, foremoe.PlanningTimeout) as err:
        self.num_timeouts += 1
        self.last_error = err
        self._busy = future
        why = ('deadline missed' if ticket.deadline_s is None else
               f'deadline {ticket.deadline_s * 1e3:.0f} ms missed')
      except Exception as err:  # pylint: disable=broad-except
        # Any planner bug must cost balance, never the training run.
        self.num_failures += 1
        self.last_error = err
        why = f'planner failed ({_one_line(err)})'
    if out is None:
      self.num_fallbacks += 1
      self.num_layers_fallen_back += loads_MLDE.shape[1]
      plan, used = self._fallback(ticket)
      ticket.fallback_reason = f'{why} -> {used}'
      finalize = ticket._finalize  # pylint: disable=protected-access
      out = plan if finalize is None else finalize(plan, loads_MLDE)
    plan = out if isinstance(out, StepPlan) else out.plan
    self.num_plans += 1
    self.current = plan.last() if self.carry_over else self.initial
    self.history_LE = baselines.update_history(self.history_LE, loads_MLDE,
                                               self.history_decay)
    self.last_latency_s = time.perf_counter() - ticket.t_submit
    return out

  def adopt(self, plan: StepPlan):
    """Plan the next step from `plan` (another process's, in place of the
    one this instance just returned): what `_collect` does with its own."""
    self.current = plan.last() if self.carry_over else self.initial

  def plan(self, loads_MLDE) -> StepPlan:
    """Placements for the step with these loads; never waits past the
    deadline (plus thread hand-over)."""
    return self.submit(loads_MLDE).result()

  def stats(self) -> dict:
    return {'plans': self.num_plans, 'fallbacks': self.num_fallbacks,
            'step_level_fallbacks': self.num_step_level_fallbacks,
            'layer_fallbacks': self.num_layer_fallbacks,
            'layers_fallen_back': self.num_layers_fallen_back,
            'workers': self.workers,
            'timeouts': self.num_timeouts, 'failures': self.num_failures,
            'last_latency_s': self.last_latency_s}

  def state_dict(self) -> dict:
    """What the next plans depend on, as JSON-able lists (checkpointed so a
    resumed run plans exactly as the uninterrupted one would).

    Python floats round-trip through JSON exactly, so the EPLB history comes
    back bit for bit.
    """
    return dict(
        method=self.method,
        current=dict(slot_expert=np.asarray(self.current.slot_expert).tolist(),
                     slot_share=np.asarray(self.current.slot_share,
                                           np.float64).tolist()),
        history_LE=None if self.history_LE is None
        else np.asarray(self.history_LE, np.float64).tolist(),
        counters=dict(plans=self.num_plans, fallbacks=self.num_fallbacks,
                      timeouts=self.num_timeouts, failures=self.num_failures,
                      layer_fallbacks=self.num_layer_fallbacks,
                      layers_fallen_back=self.num_layers_fallen_back))

  def load_state_dict(self, state: dict) -> None:
    if state['method'] != self.method:
      raise ValueError(f"planner state is for method {state['method']!r}, "
                       f'this planner runs {self.method!r}')
    cur = state['current']
    self.current = placement_lib.Placement(
        np.asarray(cur['slot_expert'], self.initial.slot_expert.dtype),
        np.asarray(cur['slot_share'], self.initial.slot_share.dtype))
    if self.current.slot_expert.shape != self.initial.slot_expert.shape:
      raise ValueError(
          f'planner state has slot_expert {self.current.slot_expert.shape}, '
          f'this topology needs {self.initial.slot_expert.shape}')
    h = state['history_LE']
    self.history_LE = None if h is None else np.asarray(h, np.float64)
    c = state['counters']
    self.num_plans, self.num_fallbacks = c['plans'], c['fallbacks']
    self.num_timeouts, self.num_failures = c['timeouts'], c['failures']
    # Absent from checkpoints written before layers were planned apart.
    self.num_layer_fallbacks = c.get('layer_fallbacks', 0)
    self.num_layers_fallen_back = c.get('layers_fallen_back', 0)

  def close(self, wait: bool = False):
    """Stops planning. wait: first let an abandoned plan (one past its
    deadline, still running in this planner's thread or layer workers)
    end, so it takes no host time from what runs next (the simulator
    times the next method's plan); False: leave it to end on its own."""
    if wait:
      concurrent.futures.wait(self._chunk_futures)
    self._pool.shutdown(wait=wait, cancel_futures=True)
    if self._layers is not None and self._own_layers:
      self._layers.close()
