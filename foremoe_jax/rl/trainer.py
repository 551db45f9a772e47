"""The main job's imperative shell: warm start, then GRPO with routing foresight.

One RL iteration reads as its data flow (docs/design.md §2), one named
function a phase:

  rollout -> compose -> foresight -> recompute (device, async)
          -> plan (async, host) || score (host) -> transfer + update
          -> record

`recompute` makes the step-level plan it runs on (one balanced placement
for the step, from the foresight, in milliseconds to seconds) and
dispatches the forwards to the device; `plan` then starts the micro-step
plan off the main thread (the planner's thread, and its worker processes
for chunks of layers) while the host scores the samples; the host collects
the plan only when the update needs it. Layers whose plan is late run the
step-level plan. How long the device waited for the plan is measured and
logged (`plan_wait_s`). Everything on device lives in rl/step.py,
rollout/sampler.py and transfer/engine.py; this module moves arrays between
them and the host-side planner and transfer schedule.

Warm start, the RL loop and checkpointing are separate pieces; `train` only
strings them together.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from foremoe_jax import config as config_lib
from foremoe_jax import hf
from foremoe_jax import placement as placement_lib
from foremoe_jax import planner as planner_lib
from foremoe_jax.planner import plan as plan_lib
from foremoe_jax.foresight import composition, expert_load, loads as loads_lib
from foremoe_jax.model import dispatch_exact, expert_parallel, sharding
from foremoe_jax.model import transformer
from foremoe_jax.rl import checkpoint, distill as distill_lib, step as step_lib
from foremoe_jax.rollout import sampler as sampler_lib
from foremoe_jax.tasks import task_from_config
from foremoe_jax.transfer import schedule
from foremoe_jax.utils import compiles as compiles_lib
from foremoe_jax.utils import distributed
from foremoe_jax.utils import metrics as metrics_lib
from foremoe_jax.utils import tensorboard


def rl_batch_from_rollout(rollout, rewards_B, microbatches) -> dict:
  """The RL batch (rl/step.py's layout) of a rollout: its samples grouped
  by micro-step, [M, b, ...], aligned with the step's T-1 input/target
  positions.

  rewards_B None leaves 'rewards_B' out: the recompute does not read it, so
  the verifier can run while the device recomputes (`rl_iteration`).
  """
  plen = rollout.prompt_len
  num, total = rollout.tokens_BT.shape
  mb_Mb = np.stack([np.asarray(m) for m in microbatches]).astype(np.int32)
  # Target position t predicts token t + 1: a completion token when t+1 >= P.
  target_pos = np.arange(1, total)
  loss_mask = rollout.valid_BT[:, 1:] & (target_pos >= plen)[None]
  rollout_logp = np.zeros((num, total - 1), np.float32)
  rollout_logp[:, plen - 1:] = rollout.logp_BC
  on_device = getattr(rollout, 'routes_device_LBTK', None)
  if on_device is not None:
    # The record never leaves the devices: gathered there into micro-batch
    # order (`device_batch` lays it out).
    routes_MLbTK = _routes_by_microbatch(on_device, jnp.asarray(mb_Mb))
  else:
    routes_MLbTK = np.moveaxis(
        np.asarray(rollout.routes_LBTK)[:, :, :-1][:, mb_Mb], 1, 0)
  batch = dict(
      tokens_MbT=rollout.tokens_BT.astype(np.int32)[mb_Mb],
      valid_MbT=rollout.valid_BT[mb_Mb],
      loss_mask_MbT=loss_mask.astype(np.float32)[mb_Mb],
      routes_MLbTK=routes_MLbTK,
      rollout_logp_MbT=rollout_logp[mb_Mb],
      microbatches_Mb=mb_Mb)
  if rewards_B is not None:
    batch['rewards_B'] = np.asarray(rewards_B, np.float32)
  return batch


def _routes_by_microbatch(routes_LBTK, mb_Mb):
  """[M, L, b, T-1, K] from the sampler's [L, Bp, T, K] record, laid out
  as `device_batch` lays it (each device its own rows of b) when the
  record is a sharded device array.

  Which samples a device needs is the host's choice (the composition), so
  the gather reads rows other devices hold. It runs one layer at a time
  (`lax.map`), each layer's result constrained to its final layout, so
  what any device holds beyond its own share is one layer's record at
  most, never the whole record replicated.
  """
  sharding_ = getattr(routes_LBTK, 'sharding', None)
  mesh = getattr(sharding_, 'mesh', None)
  return _routes_gather(mesh)(routes_LBTK, mb_Mb)


@functools.cache
def _routes_gather(mesh):
  rows = (expert_parallel.DATA, expert_parallel.EXPERT)

  def one_layer(r_BTK, mb_Mb):
    out = jnp.take(r_BTK[:, :-1], mb_Mb, axis=0)  # [M, b, T-1, K]
    if mesh is not None:
      out = jax.lax.with_sharding_constraint(
          out, NamedSharding(mesh, P(None, rows)))
    return out

  def gather(routes_LBTK, mb_Mb):
    per_layer = jax.lax.map(lambda r: one_layer(r, mb_Mb), routes_LBTK)
    return jnp.moveaxis(per_layer, 0, 1)  # [M, L, b, T-1, K]
  if mesh is None:
    return jax.jit(gather)
  return jax.jit(gather, out_shardings=NamedSharding(
      mesh, P(None, None, rows)))


def device_batch(batch: dict, mesh) -> dict:
  """The RL batch as global arrays: per-sample arrays split over every
  device along b (each device holds whole sequences), the rest
  replicated. Every process passes the same host batch."""
  rows = (expert_parallel.DATA, expert_parallel.EXPERT)
  specs = {k: (P(None, None, rows) if k == 'routes_MLbTK'
               else P(None, rows) if k.endswith('_MbT') else P())
           for k in batch}
  def put(k, v):
    sharding = NamedSharding(mesh, specs[k])
    if isinstance(v, jax.Array):  # Already on device: reshard there.
      return jax.device_put(v, sharding)
    return distributed.global_array(v, sharding)
  # The record's gather and reshard run on device before the recompute.
  return distributed.settle({k: put(k, v) for k, v in batch.items()})


def planner_setup(config):
  """(Topology, CostModel) of the EP group the config describes, the cost
  per token of the planner's loads (summed over the data groups)."""
  m, p = config.model, config.planner
  cost = planner_lib.CostModel.from_expert_shape(
      m.d_model, m.moe_d_ff, bytes_per_param=jnp.dtype(m.param_dtype).itemsize,
      flops_per_s=p.get('flops_per_s', 4e14),
      intra_node_bw=p.get('intra_node_bw', 3.5e11),
      inter_node_bw=p.get('inter_node_bw', 5e10),
      overlap=p.get('overlap', 0.5))
  # The planner balances loads summed over the data groups (planner_loads),
  # while a device computes only its own group's tokens, about 1 / num_data
  # of that sum; a copy takes as long on every data row (each row moves its
  # own slots over its own 'expert' ring, in parallel). Per summed token, a
  # device's compute time is therefore token_time_s / num_data.
  cost = dataclasses.replace(
      cost, token_time_s=cost.token_time_s / config.parallel.num_data)
  num_nodes = p.get('num_nodes', 1)
  topo = planner_lib.Topology(num_nodes, config.parallel.num_expert // num_nodes,
                              config_lib.slots_per_device(config))
  return topo, cost


def transfer_budget(config) -> schedule.TransferBudget:
  t = config.get('transfer', {})
  spd = config_lib.slots_per_device(config)
  return schedule.TransferBudget(
      step_rounds=int(t.get('step_rounds', config.parallel.num_expert)),
      microstep_rounds=int(t.get('microstep_rounds', 2)),
      mode=str(t.get('mode', 'exact')), flush=str(t.get('flush', 'auto')))


@dataclasses.dataclass
class RLContext:
  """Everything an RL iteration reads that does not change between steps."""

  config: Any
  task: Any
  mesh: Any
  sampler: sampler_lib.Sampler
  rl_step: step_lib.RLStep
  planner: planner_lib.StepPlanner
  topo: planner_lib.Topology
  cost: planner_lib.CostModel
  budget: schedule.TransferBudget
  identity: placement_lib.Placement
  buckets: tuple[int, ...]
  num_experts: int
  # With the CPU's emulated exchange, the buckets of the largest (source,
  # destination) pair it pads to (`StepPlan.cell`); None elsewhere.
  cell_buckets: tuple[int, ...] | None = None
  recompute_s: float | None = None  # Last measured, for the plan deadline.
  # Open while the RL loop runs: every XLA compile, so each new capacity
  # bucket's compile is logged (None: not watched).
  compile_log: compiles_lib.CompileLog | None = None


@dataclasses.dataclass
class PlannedStep:
  """The host's output for one update: the plan, its moves, its capacity."""

  plan: planner_lib.StepPlan
  transfer: schedule.StepTransfer
  capacity: int
  reverted: int  # Slot changes undone to fit the move budget.
  plan_s: float  # Planner wall time, fitting and move schedule included.
  cell: int | None = None  # `StepPlan.cell`.


def rl_optimizer(config):
  rl = config.rl
  return step_lib.make_optimizer(rl.learning_rate, rl.grad_clip,
                                 rl.weight_decay)


def make_rl_context(config, graphdef, mesh, task) -> RLContext:
  rl, mcfg, pcfg = config.rl, config.model, config.planner
  num_gen = rl.num_generations
  sp = sampler_lib.SamplingParams(
      max_new_tokens=task.completion_len, num_generations=num_gen,
      temperature=config.sampler.temperature, top_k=config.sampler.top_k,
      top_p=config.sampler.top_p, eos_id=task.eos_id, pad_id=task.pad_id,
      stop_ids=task.stop_ids)
  tx = rl_optimizer(config)
  rl_step = step_lib.make_rl_step(
      tx, num_generations=num_gen, eps_low=rl.eps_low, eps_high=rl.eps_high,
      beta=rl.beta, indexer_loss_coef=mcfg.msa_indexer_loss_coef,
      balance_loss_coef=mcfg.aux_loss_coef,
      num_update_epochs=rl.get('num_update_epochs', 1),
      old_logp_source=config_lib.old_logp_source(config),
      **step_lib.objective_options(rl, task.completion_len))
  topo, cost = planner_setup(config)
  d_ep, d_data = config.parallel.num_expert, config.parallel.num_data
  num_moe = config_lib.num_moe_layers(mcfg)
  identity = placement_lib.identity_placement(
      num_moe, mcfg.num_experts, d_ep, config_lib.slots_per_device(config))
  # The engine refills the slots from the canonical experts every step, so
  # the home layout (identity) is what every step's plan starts from.
  budget = transfer_budget(config)
  workers = pcfg.get('workers', 0) or planner_lib.guard.default_workers(
      num_moe)
  planner = planner_lib.StepPlanner(pcfg.method, topo, cost, identity,
                                    deadline_s=pcfg.deadline_ms / 1e3,
                                    carry_over=False, budget=budget,
                                    workers=workers)
  batch_size = rl.prompts_per_step * num_gen
  tokens_per_device = (batch_size // rl.num_microbatches
                       * (task.sequence_len - 1) // (d_ep * d_data))
  buckets = config_lib.buckets_from_config(config, tokens_per_device)
  cell_buckets = None
  if (config.parallel.get('dispatch', 'exact') == 'exact'
      and dispatch_exact.default_exchange() == 'emulated'):
    cell_buckets = config_lib.cell_buckets(
        tokens_per_device, mcfg.top_k, d_ep,
        config_lib.slots_per_device(config),
        growth=config.parallel.get('cell_growth', 2.0),
        factors=tuple(config.parallel.get('cell_factors', ())))
  sampler = sampler_lib.Sampler(graphdef, mcfg, mesh, sp,
                                config.parallel.dispatch)
  return RLContext(config, task, mesh, sampler, rl_step, planner, topo, cost,
                   budget, identity, buckets, mcfg.num_experts,
                   cell_buckets=cell_buckets)


# ----------------------------------------------------------------- phases


def rollout(ctx: RLContext, params, rng, key):
  """Prompts and their samples (routing record included)."""
  prompts = ctx.task.sample_prompts(rng, ctx.config.rl.prompts_per_step)
  return prompts, ctx.sampler(params, prompts, key)


def score(ctx: RLContext, prompts, ro) -> np.ndarray:
  """Verifier rewards, one per sample."""
  num_gen = ctx.config.rl.num_generations
  return ctx.task.reward(np.repeat(prompts, num_gen, axis=0), ro.completion_BC,
                         ro.lengths_B)


SAMPLES_FILE = 'samples.jsonl'
_SAMPLES_PER_LOG = 4


def samples_for_log(ctx: RLContext, prompts, ro, rewards) -> list[dict]:
  """The first sample of the first few prompts, decoded: what a researcher
  reads to see what the policy writes and how the verifier scored it."""
  num_gen, task = ctx.config.rl.num_generations, ctx.task
  n = min(_SAMPLES_PER_LOG, len(prompts))
  try:
    refs = task.references(prompts[:n])
  except NotImplementedError:  # A task that keeps no reference text.
    refs = [None] * n
  return [dict(prompt=task.decode(prompts[i]),
               completion=task.decode(
                   ro.completion_BC[i * num_gen, :ro.lengths_B[i * num_gen]]),
               reference=refs[i], reward=float(rewards[i * num_gen]),
               finished=bool(ro.done_B[i * num_gen]))
          for i in range(n)]


def compose(ctx: RLContext, ro, step: int):
  """Samples -> micro-batches (index arrays; chunk d of each is device d's
  sequences): which micro-step holds a sample (`rl.balance_microbatches`),
  then its device within it (`rl.balance_device_tokens`); or both at once
  for even device token counts over the step (`rl.balance_step_tokens`)."""
  rl = ctx.config.rl
  p = ctx.config.parallel
  if rl.get('balance_step_tokens', False):
    return composition.balance_step_tokens(
        _routed_tokens(ro), rl.num_microbatches, p.num_data * p.num_expert)
  if not rl.balance_microbatches:
    mbs = composition.compose_microbatches(ro.tokens_BT.shape[0],
                                           rl.num_microbatches)
  else:
    mbs = composition.compose_microbatches(
        ro.tokens_BT.shape[0], rl.num_microbatches,
        counts_BLE=_sample_counts(ctx, ro), num_experts=ctx.num_experts,
        balance=True, seed=ctx.config.seed + step)
  if rl.get('balance_device_tokens', False):
    mbs = composition.balance_device_tokens(mbs, _routed_tokens(ro),
                                            p.num_data * p.num_expert)
  return mbs


def _routed_tokens(ro) -> np.ndarray:
  """[B] positions of each sample that route: its valid input positions
  (the last token is never an input)."""
  return np.asarray(ro.valid_BT)[:, :-1].sum(axis=1)


def _device_tokens_imbalance(ctx: RLContext, ro, microbatches) -> float:
  p = ctx.config.parallel
  loads_MD = composition.device_token_loads(
      _routed_tokens(ro), microbatches, p.num_data * p.num_expert)
  return float(np.mean(loads_MD.max(1) / np.maximum(loads_MD.mean(1), 1)))


def _sample_counts(ctx: RLContext, ro) -> np.ndarray:
  """Per-sample loads [B, L, E]: the sampler's, counted on device; from the
  host record for a rollout that has none (tests, traces)."""
  counts = getattr(ro, 'counts_BLE', None)
  if counts is not None:
    return counts
  return loads_lib.sample_expert_counts(ro.routes_LBTK[:, :, :-1],
                                        ro.valid_BT[:, :-1], ctx.num_experts)


def foresight(ctx: RLContext, ro, microbatches) -> np.ndarray:
  """Exact loads [M, G, L, D, E] of the coming update, per data group G
  (each group's dispatch has its own cells), from the per-sample counts:
  each device holds whole sequences of every micro-batch."""
  p = ctx.config.parallel
  return loads_lib.loads_from_sample_counts(_sample_counts(ctx, ro),
                                            microbatches, p.num_data,
                                            p.num_expert)


def planner_loads(loads_MGLDE) -> np.ndarray:
  """loads_MLDE the planner balances: every data row holds the same
  placement, so an EP device's work is its load summed over the groups."""
  return np.asarray(loads_MGLDE).sum(axis=1)


def _capacity(ctx: RLContext, loads_MGLDE, plan) -> int:
  """Smallest dropless bucket over the micro-steps, for the dispatch in use
  (a device's received rows, or the largest cell), per data group.
  plan: a planner StepPlan, or one Placement for every micro-step."""
  demand = plan_lib.capacity_demand(
      loads_MGLDE, plan, ctx.config.parallel.get('dispatch', 'exact'),
      threads=ctx.planner.workers)
  return config_lib.pick_bucket(demand, ctx.buckets)


def cell_capacity(ctx: RLContext, loads_MGLDE, plan) -> int | None:
  """`StepPlan.cell`: the bucket of the largest (source, destination)
  pair of any micro-step and group (None without the emulated exchange)."""
  if ctx.cell_buckets is None:
    return None
  demand = plan_lib.capacity_demand(loads_MGLDE, plan, 'padded',
                                    threads=ctx.planner.workers)
  return config_lib.pick_bucket(demand, ctx.cell_buckets)


def _finalize(ctx: RLContext, t_submit: float, loads_MGLDE, start_LS=None):
  """Runs in the planner thread after planning: fit the plan to the move
  budget, build its move schedule and pick its capacity bucket (from the
  per-group loads: the planner only sees their sum). start_LS: the
  placement whose slots the recompute prefilled (None: none)."""
  def finalize(plan, loads_MLDE):
    plan, reverted = schedule.fit_plan_to_budget(plan, loads_MLDE, ctx.topo,
                                                 ctx.cost, ctx.budget,
                                                 start_LS=start_LS)
    transfer = schedule.build_step_transfer(
        plan.placement.slot_expert, ctx.num_experts, ctx.topo, ctx.budget,
        start_LS=start_LS)
    return PlannedStep(plan, transfer,
                       _capacity(ctx, loads_MGLDE, plan),
                       reverted, time.perf_counter() - t_submit,
                       cell_capacity(ctx, loads_MGLDE, plan))
  return finalize


def plan_async(ctx: RLContext, loads_MGLDE, fallback=None, start_LS=None
               ) -> planner_lib.guard.PlanTicket:
  """Starts planning off this thread; returns at once.

  Deadline: the plan should be ready when the recompute it overlaps ends,
  so it is `deadline_recompute_frac` times the last measured recompute time,
  never below `deadline_ms` (the whole deadline on the first step).
  fallback: what late layers (or a late step) use instead, the recompute's
  step-level plan (None: the planner makes one if needed).
  start_LS: the placement whose slots the recompute prefilled
  (`RecomputePlan.prefill_LS`): the update's fill starts from it.
  """
  pcfg = ctx.config.planner
  deadline_s = pcfg.deadline_ms / 1e3
  if ctx.recompute_s is not None:
    deadline_s = max(deadline_s, pcfg.get('deadline_recompute_frac', 1.0)
                     * ctx.recompute_s)
  t0 = time.perf_counter()
  loads_MGLDE = np.asarray(loads_MGLDE)
  return ctx.planner.submit(planner_loads(loads_MGLDE), deadline_s=deadline_s,
                            finalize=_finalize(ctx, t0, loads_MGLDE,
                                               start_LS),
                            fallback=fallback)


def static_capacity(ctx: RLContext, loads_MGLDE) -> int:
  """Bucket of the canonical layout (recompute) for these per-group loads."""
  return _capacity(ctx, np.asarray(loads_MGLDE), ctx.identity)


class _ReadyClock:
  """Records when device arrays become ready, without blocking the caller."""

  def __init__(self, tree):
    self.t_ready = None
    self._thread = threading.Thread(target=self._wait, args=(tree,),
                                    daemon=True)
    self._thread.start()

  def _wait(self, tree):
    jax.block_until_ready(tree)
    self.t_ready = time.perf_counter()

  def wait(self) -> float:
    self._thread.join()
    return self.t_ready


@dataclasses.dataclass
class RecomputePlan:
  """The recompute's plan: what the device reads, and how it was made."""

  device: Any  # step.StepPlan, step.CanonicalLayout, or None (no recompute).
  capacity: int  # Its bucket (0: no recompute).
  plan_s: float  # Host seconds, spent before the recompute is dispatched.
  # The host plan and its moves (None for the home layout).
  plan: planner_lib.StepPlan | None = None
  transfer: schedule.StepTransfer | None = None
  # The placement [L, S] whose slots the recompute fills with the policy's
  # weights for the update (`transfer.prefill`), None when it does not.
  prefill_LS: Any = None


def recompute_plan(ctx: RLContext, loads_MGLDE) -> RecomputePlan:
  """The recompute's plan, made at once on the host.

  The method's step-level placement (`StepPlanner.step_level_plan`: home
  for static, EPLB's history for EPLB-step, the step's exact loads for the
  foresight methods) for every micro-step, fitted to the fill budget; no
  moves between micro-steps. Static EP gets the canonical layout itself,
  with no transfer at all. No plan when the step needs no recompute.
  """
  if not ctx.rl_step.recompute_forward_passes(ctx.config.rl.beta > 0):
    return RecomputePlan(None, 0, 0.0)
  t0 = time.perf_counter()
  loads_MGLDE = np.asarray(loads_MGLDE)
  if ctx.planner.method == 'static':
    cap = static_capacity(ctx, loads_MGLDE)
    cell = cell_capacity(ctx, loads_MGLDE, ctx.identity)
    return RecomputePlan(step_lib.CanonicalLayout(cap, cell), cap,
                         time.perf_counter() - t0)
  loads_MLDE = planner_loads(loads_MGLDE)
  plan = ctx.planner.step_level_plan(loads_MLDE)
  plan, _ = schedule.fit_plan_to_budget(plan, loads_MLDE, ctx.topo, ctx.cost,
                                        ctx.budget)
  cap = _capacity(ctx, loads_MGLDE, plan)
  transfer = schedule.build_step_transfer(plan.placement.slot_expert,
                                          ctx.num_experts, ctx.topo,
                                          ctx.budget)
  device = step_lib.StepPlan(
      step_lib.device_placement(plan.placement, ctx.mesh),
      step_lib.device_transfer(transfer, ctx.mesh), cap,
      cell_capacity(ctx, loads_MGLDE, plan))
  return RecomputePlan(device, cap, time.perf_counter() - t0, plan, transfer)


def recompute(ctx: RLContext, state, batch, loads_MGLDE):
  """Dispatches the forwards the update needs besides its own (reference,
  and old at several update epochs) on the recompute plan; async. Returns
  (logps, RecomputePlan).

  With `transfer.prefill` (on by default) and where the step allows it
  (`RLStep.can_prefill`: a step-level plan, one update epoch), the
  recompute also fills the policy's experts into its placement's slots,
  one chunk of layers per micro-step under its forward: the update then
  moves only the slots its micro-step 0 changes, instead of opening with
  a whole fill that nothing hides.
  """
  rplan = recompute_plan(ctx, loads_MGLDE)
  prefill = (bool(ctx.config.get('transfer', {}).get('prefill', True))
             and ctx.rl_step.can_prefill(rplan.device,
                                         state.ref_params is not None))
  if prefill:
    rplan.prefill_LS = np.asarray(rplan.plan.placement.slot_expert[0])
  return ctx.rl_step.recompute(state, batch, rplan.device,
                               prefill=prefill), rplan


def update_plan(ctx: RLContext, planned: PlannedStep):
  """What the update reads on device: static EP's canonical layout (its
  experts compute at home: no slots, fill, moves or returns), else the
  planned placements and their moves."""
  if ctx.planner.method == 'static':
    return step_lib.CanonicalLayout(planned.capacity, planned.cell)
  return step_lib.StepPlan(
      step_lib.device_placement(planned.plan.placement, ctx.mesh),
      step_lib.device_transfer(planned.transfer, ctx.mesh),
      planned.capacity, planned.cell)


def update(ctx: RLContext, state, batch, logps, planned: PlannedStep):
  """Transfer + micro-steps + `rl.num_update_epochs` optimizer updates on
  device, all against the recompute's old log-probs and with the same plan
  (blocking)."""
  state, m = ctx.rl_step.update(state, batch, logps, update_plan(ctx, planned))
  return state, distributed.to_host(m)


class NonFiniteError(RuntimeError):
  """A step's loss or gradient was NaN or Inf; the run stops before that
  step's state is checkpointed."""


def check_finite(step: int, m) -> None:
  """Raises NonFiniteError naming the step and its bad micro-steps."""
  bad_M = np.flatnonzero(np.asarray(m['nonfinite_M']))
  if bad_M.size or not np.isfinite(float(m['grad_norm'])) or \
      not np.isfinite(float(m['loss'])):
    where = (f'micro-step(s) {bad_M.tolist()} of '
             f'{len(m["nonfinite_M"])}' if bad_M.size else 'the update')
    raise NonFiniteError(
        f'RL step {step}: non-finite loss or gradient in {where}; stopped '
        f'before checkpointing it (the last checkpoint is the latest good '
        f'state)')


def transfer_metrics(ctx: RLContext, planned: PlannedStep,
                     prefill: schedule.StepTransfer | None = None) -> dict:
  """Weights moved (useful fills across devices) and gradients returned.
  prefill: the recompute's transfer when it prefilled the update's slots
  (`RecomputePlan.transfer`): its fill counts as the step's first."""
  num_micro = planned.plan.num_microsteps
  d = ctx.topo.num_devices
  per_expert = ctx.cost.bytes_per_expert
  st = planned.transfer
  fills = np.array(st.remote_fills_M())
  extra = ()
  if prefill is not None:
    fills[0] += prefill.fill.remote_fills_L.sum()
    extra = (prefill.fill,)
  returns = (schedule.remote_returns(st.steps)
             + schedule.remote_returns(st.flush))
  return dict(
      weight_bytes_moved_per_device_per_microstep=float(
          fills.sum() * per_expert / (d * num_micro)),
      grad_bytes_returned_per_device_per_microstep=float(
          returns * per_expert / (d * num_micro)),
      remote_fills_M=fills.tolist(), reverted_moves=planned.reverted,
      # Experts on the wire over experts that had to move (1.0: exact;
      # the CPU emulation of the exact exchange pads, see transfer/engine).
      wire_bytes_over_useful=schedule.step_wire_over_useful(st, d,
                                                            extra=extra))


def load_metrics(ctx: RLContext, loads_MLDE, plan) -> dict:
  """Micro-step max/mean device load of the plan and of static EP, and the
  plan's load per micro-step and device, summed over MoE layers."""
  num_micro = loads_MLDE.shape[0]
  mom = lambda p: [float(placement_lib.max_over_mean(placement_lib.device_loads(
      loads_MLDE[i], p(i))).mean()) for i in range(num_micro)]
  device_load_MD = [placement_lib.device_loads(
      loads_MLDE[i], plan.microstep(i)).sum(axis=0).tolist()
                    for i in range(num_micro)]
  # ForeMoE's layers whose foresight_split candidate (no moves) was cheaper
  # (planner/foremoe.py); 0 for the other methods.
  return dict(microstep_max_over_mean=mom(plan.microstep),
              microstep_max_over_mean_static=mom(lambda i: ctx.identity),
              device_load_MD=device_load_MD,
              foremoe_layers_from_split=plan.layers_from_split)


# The RL step's jitted programs (rl/step.py); their compiles are logged by
# name, with the capacity bucket that caused them.
_STEP_PROGRAMS = ('update', 'recompute_logps')


def rl_iteration(ctx: RLContext, state, step: int, rng, key):
  """One RL step, phase by phase; returns (state, record)."""
  t_step = time.perf_counter()
  prompts, ro = rollout(ctx, state.params, rng, key)
  sample_s = time.perf_counter() - t_step
  microbatches = compose(ctx, ro, step)
  loads_MGLDE = foresight(ctx, ro, microbatches)
  loads_MLDE = planner_loads(loads_MGLDE)
  tokens_LE = expert_load.expert_tokens(loads_MGLDE)
  # Every process holds the same host batch and uploads its own devices'
  # share: each device gets whole sequences of every micro-batch.
  batch = device_batch(rl_batch_from_rollout(ro, None, microbatches),
                       ctx.mesh)
  t_rec = time.perf_counter()
  # The recompute's step-level plan first, then the micro-step plan, made
  # while the device recomputes. Layers whose plan is late run the
  # step-level plan instead of the home layout.
  logps, rplan = recompute(ctx, state, batch, loads_MGLDE)
  ticket = plan_async(ctx, loads_MGLDE, fallback=rplan.plan,
                      start_LS=rplan.prefill_LS)
  clock = _ReadyClock(logps)
  # The verifier runs on the host while the device recomputes and the
  # planner thread plans: only the update needs the rewards. A slow
  # verifier (math-verify on long answers) then costs the step only what
  # it takes beyond the recompute.
  t_score = time.perf_counter()
  rewards = score(ctx, prompts, ro)
  t_scored = time.perf_counter()
  score_s = t_scored - t_score
  reward_timeouts = ctx.task.last_reward_timeouts
  if reward_timeouts and distributed.is_primary():
    lo = ctx.task.reward_range[0]
    print(f'step {step + 1}: {reward_timeouts} verifier call(s) ran past '
          f'task_kwargs.reward_timeout_s and scored {lo:g}', flush=True)
  batch['rewards_B'] = distributed.global_array(
      np.asarray(rewards, np.float32), NamedSharding(ctx.mesh, P()))
  # Each process plans against its own clock: one that missed the deadline
  # would fall back where another did not, and their devices would run two
  # placements (jax refuses them). The job runs process 0's plan, and
  # every planner goes on from it (on process 0 a no-op).
  planned = distributed.from_process_0(ticket.result())
  ctx.planner.adopt(planned.plan)
  t_plan = time.perf_counter()
  t_rec_done = clock.wait()
  ctx.recompute_s = t_rec_done - t_rec
  state, m = update(ctx, state, batch, logps, planned)
  check_finite(step + 1, m)
  t_done = time.perf_counter()
  new_compiles = ctx.compile_log.take() if ctx.compile_log else []
  record = dict(
      phase='rl', reward_mean=float(rewards.mean()),
      reward_std=float(rewards.std()), kl=float(m['kl']),
      reward_count=int(rewards.size),  # n of reward.png's interval of the mean
      # Verifier calls stopped at the task's time limit (scored its lowest).
      reward_timeouts=int(reward_timeouts),
      loss=float(m['loss']), clip_frac=float(m['clip_frac']),
      # Share of tokens (sequences, for GSPO) the dual-clip capped; 0 when off.
      dual_clip_frac=float(m['dual_clip_frac']),
      clip_frac_per_epoch=[float(x) for x in m['clip_frac_U']],
      ratio_mean_per_epoch=[float(x) for x in m['ratio_mean_U']],
      indexer_loss=float(m['indexer_loss']),
      grad_norm=float(m['grad_norm']),
      completion_len=float(ro.lengths_B.mean()),
      # Tokens on the busiest device over the mean, per micro-step (what
      # rl.balance_device_tokens evens out): its mean over micro-steps.
      device_tokens_max_over_mean=_device_tokens_imbalance(ctx, ro,
                                                           microbatches),
      # Share of samples that ended with EOS (the rest hit completion_len).
      finished_frac=float(ro.done_B.mean()),
      **load_metrics(ctx, loads_MLDE, planned.plan),
      # Tokens per (MoE layer, expert), from the foresight: the compact form
      # here, the whole matrix to expert_load.jsonl (rl_loop pops it).
      **expert_load.summary(tokens_LE),
      expert_tokens_LE=tokens_LE,
      capacity=planned.capacity,
      # The emulated exchange's pair bucket (None: the ragged collective).
      capacity_cell=planned.cell,
      capacity_static=static_capacity(ctx, loads_MGLDE),
      # The recompute's forwards and its bucket (0 when it runs none).
      recompute_forward_passes=ctx.rl_step.recompute_forward_passes(
          state.ref_params is not None),
      capacity_recompute=rplan.capacity,
      dropped=int(m['dropped']), planner=ctx.config.planner.method,
      # Steps so far whose whole plan fell back / only some layers' did.
      plan_fallbacks=ctx.planner.num_fallbacks,
      plan_layer_fallbacks=ctx.planner.num_layer_fallbacks,
      # This step's plan missed its deadline or failed, and why ('' if not).
      plan_fallback=ticket.fallback_reason is not None,
      plan_fallback_reason=ticket.fallback_reason or '',
      # MoE layers that ran the step-level plan because their chunk of
      # layers was late or failed (all of them when the whole step was).
      plan_fallback_layers=planned.plan.layers_fell_back,
      moves_per_device_per_microstep=float(planned.plan.moves_MLD.mean()),
      **transfer_metrics(ctx, planned, rplan.transfer
                         if rplan.prefill_LS is not None else None),
      transfer_id_errors=int(m['transfer_id_errors']),
      # Largest |sampler log-prob - training log-prob| at the policy that
      # sampled, on completion tokens (routes replayed: rounding only).
      replay_logp_gap=float(m.get('rollout_vs_recompute_logp_max_abs',
                                  m['rollout_vs_update_logp_max_abs'])),
      sample_s=sample_s, score_s=score_s, plan_s=planned.plan_s,
      recompute_plan_s=rplan.plan_s,
      recompute_s=ctx.recompute_s,
      # The update waits for the recompute, the rewards and the plan; each
      # wait counts only beyond what came before it, so a slow verifier is
      # not billed to the planner.
      score_wait_s=max(0.0, t_scored - t_rec_done),
      plan_wait_s=max(0.0, t_plan - max(t_rec_done, t_scored)),
      update_s=t_done - max(t_plan, t_rec_done),
      step_s=t_done - t_step,
      # Seconds of XLA compiles in this step (a new capacity bucket, the
      # first step), which step_s includes; `compiled` names them for the
      # log (a fact of the process, not of the run: not written).
      compile_s=sum(c.seconds for c in new_compiles),
      compiled=[f'{c.fun_name} {c.seconds:.1f}s' for c in new_compiles
                if c.fun_name in _STEP_PROGRAMS or c.seconds >= 1.0])
  check_rollout_logps(ctx, record['replay_logp_gap'], step + 1)
  every = ctx.config.get('sample_log_every', 0)
  if every and (step + 1) % every == 0:
    record['samples'] = samples_for_log(ctx, prompts, ro, rewards)
  return state, record


def check_rollout_logps(ctx: RLContext, gap: float, step: int) -> None:
  """With several update epochs and the sampler's log-probs standing in for
  the old policy's: once a step's gap to the training forward exceeds
  `rl.old_logp_max_gap` (default 1e-3; float32 rounding stays below 2e-5),
  every later step recomputes them instead, and the log says so."""
  rl_step = ctx.rl_step
  limit = ctx.config.rl.get('old_logp_max_gap', 1e-3)
  if (rl_step.num_update_epochs > 1 and rl_step.old_logp_source == 'rollout'
      and gap > limit):
    rl_step.old_logp_source = 'recompute'
    if distributed.is_primary():
      print(f'step {step}: the sampler\'s log-probs differ from the training '
            f'forward\'s by {gap:.2e} > rl.old_logp_max_gap = {limit:g}; the '
            f'old log-probs are recomputed from now on', flush=True)


# ------------------------------------------------------- the job's pieces


def _clock(seconds: float) -> str:
  seconds = int(round(seconds))
  h, rem = divmod(seconds, 3600)
  return f'{h}:{rem // 60:02d}:{rem % 60:02d}' if h else \
      f'{rem // 60}:{rem % 60:02d}'


def _log_line(step, m, total_steps=None, elapsed_s=None, done_steps=None):
  """One line per RL step; elapsed time and ETA once `done_steps` ran; a
  step whose plan fell back says so, and why, at the end."""
  mom = np.mean(m['microstep_max_over_mean'])
  mom_s = np.mean(m['microstep_max_over_mean_static'])
  return (f"step {step:4d} | reward {m['reward_mean']:.3f} | kl {m['kl']:.4f} "
          f"| micro-step max/mean {mom:.3f} (static {mom_s:.3f}) | capacity "
          f"{m['capacity']} (static {m['capacity_static']}) | moved "
          f"{m['weight_bytes_moved_per_device_per_microstep'] / 1e3:.1f} kB/"
          f"dev/micro-step | plan wait {m['plan_wait_s'] * 1e3:.0f} ms | "
          f"{m['step_s']:.2f}s" + _progress(step, total_steps, elapsed_s,
                                            done_steps)
          + (f" [plan fell back: {m['plan_fallback_reason']}]"
             if m.get('plan_fallback_reason') else ''))


def _progress(step, total_steps, elapsed_s, done_steps) -> str:
  if total_steps is None or elapsed_s is None or not done_steps:
    return ''
  eta = elapsed_s / done_steps * (total_steps - step)
  return f' | {step}/{total_steps} elapsed {_clock(elapsed_s)} ETA {_clock(eta)}'


def stop_requested(guard) -> bool:
  """Whether a stop signal reached this or any other process of the job.

  Processes of one job may see a scheduler's SIGTERM at different step
  boundaries; if one checkpointed while another ran on, the next collective
  would hang. So they agree (one scalar all-gather per step, nothing when
  the job is one process), and a process that got no signal itself adopts
  the other's, for its exit status.
  """
  if guard is None:
    return False
  signum = distributed.max_over_processes(guard.signum or 0)
  if signum and not guard.requested:
    guard.signum = signum
  return bool(signum)


def host_state(rng, key, planner=None, task=None, prompts_drawn=0,
               rl_step=None) -> dict:
  """Everything besides the arrays that the next steps depend on (JSON).

  With it in the checkpoint, a resumed run draws the same prompts (numpy
  RNG), samples the same tokens (JAX key), plans from the same placement and
  EPLB history, and reads on from the same data position as the run that
  was interrupted: its later steps equal the uninterrupted run's exactly.
  """
  out = dict(numpy_rng=rng.bit_generator.state,
             jax_key=dict(impl=str(jax.random.key_impl(key)),
                          data=np.asarray(jax.random.key_data(key)).tolist()),
             data=dict(prompts_drawn=int(prompts_drawn),
                       task=task.data_state() if task is not None else {}))
  if planner is not None:
    out['planner'] = planner.state_dict()
  if rl_step is not None:
    out['old_logp_source'] = rl_step.old_logp_source
  return out


def restore_host_state(host: dict, rng, task=None):
  """Puts `host_state`'s RNG and data position back into rng and task (in
  place; the planner's part is loaded once the planner exists); returns the
  JAX key, or None when the record holds none."""
  if 'numpy_rng' in host:
    rng.bit_generator.state = host['numpy_rng']
  if task is not None and 'data' in host:
    task.load_data_state(host['data'].get('task', {}))
  if 'jax_key' not in host:
    return None
  k = host['jax_key']
  return jax.random.wrap_key_data(np.asarray(k['data'], np.uint32),
                                  impl=k['impl'])


def _phase_tb(workdir: str, phase: str, first_step: int
              ) -> tensorboard.TensorBoardWriter:
  """The TensorBoard run of one phase, hiding what an earlier attempt
  logged at `first_step` or later (utils/tensorboard.py)."""
  return tensorboard.TensorBoardWriter(
      workdir, tensorboard.phase_dir(phase), purge_step=first_step,
      warn=False)


def warm_start(config, task, graphdef, params, mesh, workdir, rng, key, ckpt,
               guard=None, tb=None):
  """Supervised warm start; writes warmstart.jsonl and a checkpoint.

  Returns None, with nothing saved, when `guard` asks to stop first: the
  warm start is short and a rerun starts it again.
  """
  mcfg = config.model
  if config.warmstart.steps == 0:
    # A pretrained checkpoint: no optimizer state to build (it would be
    # twice the parameters); the step-0 checkpoint is the weights as given.
    ckpt.save(0, params, phase='warmstart_done',
              host=host_state(rng, key, task=task))
    return params
  tx = step_lib.make_optimizer(config.warmstart.learning_rate, 1.0)
  state = step_lib.init_train_state(graphdef, params, tx, mesh, with_ref=False)
  sft_step = step_lib.make_sft_step(tx, mcfg.msa_indexer_loss_coef,
                                    mcfg.aux_loss_coef)
  t0 = time.perf_counter()
  # A warm start stopped or killed earlier reruns whole (its checkpoint is
  # written at its end): the earlier attempt's records go.
  metrics_lib.truncate_after(os.path.join(workdir, metrics_lib.WARMSTART_FILE),
                             0)
  with metrics_lib.MetricsWriter(workdir, metrics_lib.WARMSTART_FILE,
                                 mirror=tb) as writer:
    for i in range(config.warmstart.steps):
      if stop_requested(guard):
        return None
      tokens, mask = task.supervised_batch(rng, config.warmstart.batch_size)
      # A left-padded prompt's PADs are hidden, as the sampler hides them.
      valid = sampler_lib.prompt_valid(tokens, task.pad_id)
      state, m = distributed.settle(sft_step(state, *distributed.global_arrays(
          (tokens, mask, valid), mesh)))
      if (i + 1) % 50 == 0 or i + 1 == config.warmstart.steps:
        m = distributed.to_host(m)
        writer.write(i + 1, dict(phase='warmstart', sft_loss=m['loss'],
                                 elapsed_s=time.perf_counter() - t0))
        print(f"warm start {i + 1:4d}/{config.warmstart.steps} | loss "
              f"{m['loss']:.4f} | {time.perf_counter() - t0:.1f}s", flush=True)
  ckpt.save(0, state.params, phase='warmstart_done',
            host=host_state(rng, key, task=task))
  return state.params


def msa_distill(config, task, graphdef, params, mesh, workdir, rng, key,
                ckpt, guard=None, tb=None):
  """The MSA indexer distillation (rl/distill.py); writes distill.jsonl,
  msa_distill.json (recall and KL before and after) and the step-0
  checkpoint in place of the warm start's. None when `guard` stops it."""
  params, summary = distill_lib.run(
      config, task, graphdef, params, mesh, workdir, rng,
      guard_stop=lambda: stop_requested(guard), tb=tb)
  if params is None:
    return None
  if distributed.is_primary():
    with open(os.path.join(workdir, distill_lib.SUMMARY_FILE), 'w') as f:
      json.dump(summary, f, indent=1)
  ckpt.save(0, params, phase='distill_done',
            host=host_state(rng, key, task=task), replace=True)
  return params


def greedy_eval(config, task, graphdef, mesh):
  """A function params -> greedy reward on held-out prompts (or None)."""
  num_eval = config.get('eval_prompts', 256)
  if not num_eval:
    return lambda params: None
  sp = sampler_lib.SamplingParams(max_new_tokens=task.completion_len,
                                  num_generations=1, greedy=True,
                                  eos_id=task.eos_id, pad_id=task.pad_id,
                                  stop_ids=task.stop_ids)
  greedy = sampler_lib.Sampler(graphdef, config.model, mesh, sp,
                               config.parallel.dispatch)
  prompts = task.eval_prompts(num_eval, config.seed)

  def evaluate(params):
    r = greedy(params, prompts, jax.random.key(0))
    return float(task.reward(prompts, r.completion_BC, r.lengths_B).mean())
  return evaluate


def rl_loop(ctx: RLContext, state, start: int, rng, key, writer, ckpt,
            guard=None, samples_writer=None, load_writer=None):
  """RL steps start..rl.steps-1; checkpoints every `checkpoint_every`.

  Returns (state, last step done). When `guard` asks to stop, the step in
  flight finishes, is checkpointed, and the loop returns early. Steps in
  `profile_steps` (1-based, as logged) each write a jax.profiler trace under
  workdir/profile (TensorBoard's profile plugin or Perfetto reads it).
  `load_writer` gets every step's tokens per (MoE layer, expert).
  """
  config = ctx.config
  total = config.rl.steps
  profile = set(config_lib.profile_steps(config))
  t0 = time.perf_counter()
  for step in range(start, total):
    key, k_sample = jax.random.split(key)
    if step + 1 in profile:
      jax.profiler.start_trace(os.path.join(writer.workdir, 'profile'))
    state, record = rl_iteration(ctx, state, step, rng, k_sample)
    if step + 1 in profile:
      jax.block_until_ready(state)
      jax.profiler.stop_trace()
    samples = record.pop('samples', None)
    tokens_LE = record.pop(expert_load.TOKENS_KEY, None)
    if load_writer is not None and tokens_LE is not None:
      load_writer.write(step + 1, {'phase': 'rl',
                                   expert_load.TOKENS_KEY: tokens_LE})
    compiled = record.pop('compiled', [])
    if compiled and distributed.is_primary():
      print(f"  compiled {', '.join(compiled)} at step {step + 1} (capacity "
            f"{record['capacity']}, recompute "
            f"{record['capacity_recompute']})", flush=True)
    writer.write(step + 1, record)
    print(_log_line(step + 1, record, total, time.perf_counter() - t0,
                    step + 1 - start), flush=True)
    if samples:
      if samples_writer is not None:
        samples_writer.write(step + 1, dict(samples=samples))
      if distributed.is_primary():
        print(f'  sample | {samples[0]["prompt"]!r} -> '
              f'{samples[0]["completion"]!r} (reference '
              f'{samples[0]["reference"]!r}, reward '
              f'{samples[0]["reward"]:.2f})', flush=True)
    stop = stop_requested(guard)
    if ((step + 1) % config.get('checkpoint_every', 10) == 0
        or step + 1 == total or stop):
      ckpt.save(step + 1, state.params, phase='rl', opt_state=state.opt_state,
                ref_params=state.ref_params,
                host=host_state(rng, key, ctx.planner, ctx.task,
                                (step + 1) * config.rl.prompts_per_step,
                                ctx.rl_step))
    if stop:
      return state, step + 1
  return state, total


SUMMARY_FILE = 'summary.json'
EVAL_FILE = 'greedy_eval.json'
CONFIG_FILE = 'config.json'
# The config a run started with: what a rerun's differences are named against.
FIRST_CONFIG_FILE = 'config.first.json'
# Fields a rerun may change without changing the steps already run.
_RESUMABLE_CHANGES = ('rl.steps', 'checkpoint_every', 'profile_steps',
                      'eval_prompts', 'sample_log_every')


def _flat(d: dict, prefix: str = '') -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = v
  return out


def _record_config(workdir: str, config) -> None:
  """Writes workdir/config.json (what export and resume read back); on a
  rerun, names the fields that differ from the run's first config
  (config.first.json, kept from the first run), added and removed ones
  included, since resuming under another config no longer reproduces the
  run."""
  path = os.path.join(workdir, CONFIG_FILE)
  first_path = os.path.join(workdir, FIRST_CONFIG_FILE)
  now = json.loads(json.dumps(config.to_dict(), default=str))
  if not os.path.exists(first_path) and os.path.exists(path):
    shutil.copyfile(path, first_path)  # A run from before this file.
  if os.path.exists(first_path):
    with open(first_path) as f:
      before = _flat(json.load(f))
    after = _flat(now)
    missing = object()
    changed = sorted(k for k in set(before) | set(after)
                     if before.get(k, missing) != after.get(k, missing)
                     and k not in _RESUMABLE_CHANGES)
    if changed:
      print(f'warning: config differs from the run in {workdir} in '
            f'{", ".join(changed)} (against its first config, '
            f'{FIRST_CONFIG_FILE}); the resumed steps follow the new values',
            flush=True)
  for target in ((path,) if os.path.exists(first_path)
                 else (first_path, path)):
    with open(target + '.tmp', 'w') as f:
      json.dump(now, f, indent=1)
    os.replace(target + '.tmp', target)


def _complete(workdir: str, step: int, config) -> dict:
  """A finished run: say so and leave its files as they are."""
  print(f'the run in {workdir} is complete (step {step}, rl.steps = '
        f'{config.rl.steps}); its summary.json is left as it is. Pass a new '
        f'--workdir for a new run, or raise --config.rl.steps to train on.',
        flush=True)
  path = os.path.join(workdir, SUMMARY_FILE)
  summary = None
  if os.path.exists(path):
    with open(path) as f:
      summary = json.load(f)
  return dict(complete=True, step=step, workdir=workdir, summary=summary)


def _stopped(workdir: str, step: int, phase: str, guard) -> dict:
  """What `train` returns when a signal stopped it (see PreemptionGuard)."""
  return dict(preempted=True, phase=phase, step=step, workdir=workdir,
              checkpoint_dir=os.path.join(workdir, 'checkpoints'),
              signal=guard.signum, exit_code=guard.exit_code)


def _greedy_before_rl(workdir: str, evaluate, params, resumed: bool,
                      num_prompts: int | None = None):
  """Greedy reward of the warm-started policy, kept in greedy_eval.json so a
  resumed run reports the real before-RL value, not its restored policy's.

  num_prompts: the held-out prompts evaluated (config.eval_prompts). A
  resumed run whose count differs from the one the value was measured on
  reports None: its after-RL value will be measured on other prompts, and
  the warm-started policy is no longer at hand to measure again.
  """
  path = os.path.join(workdir, EVAL_FILE)
  if resumed and os.path.exists(path):
    with open(path) as f:
      saved = json.load(f)
    measured_on = saved.get('eval_prompts', num_prompts)
    if measured_on != num_prompts:
      print(f'greedy reward before RL was measured on {measured_on} '
            f'held-out prompts, this run evaluates {num_prompts}: not '
            'reported (the two would not compare)', flush=True)
      return None
    return saved.get('greedy_reward_before_rl')
  value = evaluate(params)
  if distributed.is_primary():
    with open(path, 'w') as f:
      json.dump({'greedy_reward_before_rl': value,
                 'eval_prompts': num_prompts}, f)
  return value


def _reward_summary(workdir: str) -> dict:
  """First and last mean rewards over the whole run (all of metrics.jsonl,
  so a resumed run counts the steps before its restart too)."""
  rewards = [r['reward_mean'] for r in metrics_lib.read_metrics(workdir)
             if r.get('phase') == 'rl' and 'reward_mean' in r]
  k = max(1, min(5, len(rewards) // 3))
  return dict(reward_first=float(np.mean(rewards[:k])) if rewards else None,
              reward_last=float(np.mean(rewards[-k:])) if rewards else None,
              rl_steps_logged=len(rewards))


def _distill_summary(workdir: str) -> dict:
  """The MSA distillation's recall and KL before and after ({} without
  one), from the file it wrote (a resumed run did not rerun it)."""
  path = os.path.join(workdir, distill_lib.SUMMARY_FILE)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def train(config, workdir: str, guard=None) -> dict:
  """Runs warm start + RL in `workdir`; returns the summary.

  Writes warmstart.jsonl (SFT loss), metrics.jsonl (one line per RL step),
  TensorBoard events (tensorboard/<phase>/), summary.json, PNG plots and orbax
  checkpoints; a rerun with the same workdir resumes from the latest
  checkpoint (metrics.jsonl is cut back to its step), and a rerun of a
  finished run changes nothing. With a
  `PreemptionGuard`, a signal stops the run at the next step boundary after
  a checkpoint, and the result says so (`preempted`).
  """
  config_lib.validate_config(config)
  os.makedirs(workdir, exist_ok=True)
  task = task_from_config(config)
  if task.describe() and distributed.is_primary():
    print(task.describe(), flush=True)
  mesh = expert_parallel.make_mesh(config.parallel.num_data,
                                   config.parallel.num_expert)
  rng = np.random.default_rng(config.seed)
  key = jax.random.key(config.seed)
  if config.get('init_from_hf'):
    # The checkpoint fixes the architecture; config.model keeps the rest.
    config.model = hf.model_config_from_hf(config.init_from_hf, config.model)
    config_lib.validate_config(config)
  model = transformer.Transformer(config.model, mesh,
                                  dispatch=config.parallel.dispatch,
                                  rngs=nnx.Rngs(config.seed))
  graphdef, params = sharding.split_model(
      model, mesh, **sharding.fsdp_options(config.parallel))
  # Training holds the float32 master copy (checkpoints included), whatever
  # model.param_dtype is; the model casts to model.dtype where it computes.
  params = step_lib.master_params(params)
  if config.get('init_from_hf'):
    fresh_index = hf.missing_index_layers(config.model, config.init_from_hf)
    params = hf.place_like(hf.load_into(config, config.init_from_hf), params)
    if fresh_index and distributed.is_primary():
      print(f'init_from_hf: MSA layers {fresh_index} have no index-branch '
            f"weights in the checkpoint: initialised from each layer's q/k "
            f'projections (docs/design.md §6.10)', flush=True)
    if distributed.is_primary():  # The one line that says the weights came.
      sizes = [x.size for x in jax.tree.leaves(params)]
      print(f'init_from_hf: loaded {sum(sizes):,} parameters '
            f'({len(sizes)} arrays) from {config.init_from_hf}', flush=True)
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'))
  if distributed.is_primary() and not tensorboard.available():
    print(tensorboard.MISSING, file=sys.stderr, flush=True)
  with contextlib.ExitStack() as stack:
    # A dataset task's reward workers end with the run; so does the RL
    # phase's TensorBoard writer, however the run ends.
    stack.enter_context(contextlib.closing(task))
    # Templates in the RL state's layout, so a restore lands on the same
    # shardings (the reference policy is laid out like the params).
    opt_template = step_lib.init_train_state(
        graphdef, params, rl_optimizer(config), mesh, with_ref=False).opt_state
    restored = ckpt.restore_latest(
        params, opt_state=opt_template,
        ref_params=params if config.rl.beta > 0 else None,
        log=lambda line: print(line, flush=True))
    del opt_template
    # After the restore: a rerun whose config cannot restore the run's
    # checkpoints must leave the config.json export reads as it was.
    if distributed.is_primary():  # One writer of the shared workdir.
      _record_config(workdir, config)
    resumed = restored is not None and restored['phase'] == 'rl'
    if resumed and restored['step'] >= config.rl.steps:
      if os.path.exists(os.path.join(workdir, SUMMARY_FILE)):
        return _complete(workdir, restored['step'], config)
      # The last step's checkpoint was written, the run's tail (the final
      # evaluation, summary.json, the plots) was not: run the tail now.
      print(f'the run in {workdir} trained to step {restored["step"]} but '
            f'has no {SUMMARY_FILE}: finishing its evaluation, summary and '
            f'plots', flush=True)
    if restored is not None and restored['phase'] in ('warmstart_done',
                                                      'distill_done', 'rl'):
      params = restored['params']
      print(f"restored the {restored['phase']} checkpoint at step "
            f"{restored['step']}", flush=True)
      restored_key = restore_host_state(restored['host'], rng, task=task)
      if restored_key is None:
        print('the checkpoint holds no RNG or planner state (written before '
              'exact resume): the resumed steps draw new samples', flush=True)
      else:
        key = restored_key
    else:
      # A warm start reruns whole: its run's earlier events are hidden.
      with contextlib.closing(_phase_tb(workdir, 'warmstart', 1)) as tb:
        params = warm_start(config, task, graphdef, params, mesh, workdir,
                            rng, key, ckpt, guard, tb)
      if params is None:
        return _stopped(workdir, 0, 'warmstart', guard)
    if (config.get('msa_distill') and config.msa_distill.steps
        and (restored is None or restored['phase'] == 'warmstart_done')):
      with contextlib.closing(_phase_tb(workdir, 'msa_distill', 1)) as tb:
        params = msa_distill(config, task, graphdef, params, mesh, workdir,
                             rng, key, ckpt, guard, tb)
      if params is None:
        return _stopped(workdir, 0, 'msa_distill', guard)

    evaluate = greedy_eval(config, task, graphdef, mesh)
    summary = {'greedy_reward_before_rl': _greedy_before_rl(
        workdir, evaluate, params, resumed,
        num_prompts=config.get('eval_prompts', 256))}
    if summary['greedy_reward_before_rl'] is not None:
      print(f"greedy reward after warm start: "
            f"{summary['greedy_reward_before_rl']:.3f}", flush=True)
    ctx = make_rl_context(config, graphdef, mesh, task)
    state = step_lib.init_train_state(graphdef, params, ctx.rl_step.tx, mesh,
                                      with_ref=config.rl.beta > 0)
    start = 0
    if resumed:
      # The KL anchor is the policy RL started from, not the restored one.
      ref = restored.get('ref_params', state.ref_params)
      # The fresh state's step as it is laid out (int32, replicated): a
      # weak-typed, uncommitted scalar would compile the update anew.
      state = dataclasses.replace(state, opt_state=restored['opt_state'],
                                  ref_params=ref,
                                  step=jax.device_put(
                                      jnp.asarray(restored['step'],
                                                  state.step.dtype),
                                      state.step.sharding))
      if 'planner' in restored['host']:
        ctx.planner.load_state_dict(restored['host']['planner'])
      ctx.rl_step.old_logp_source = restored['host'].get(
          'old_logp_source', ctx.rl_step.old_logp_source)
      start = restored['step']
    # Steps a crash ran past the checkpoint are run again: log them once.
    dropped = metrics_lib.truncate_after(workdir, start)
    if dropped:
      print(f'metrics.jsonl: dropped {dropped} records past step {start}, '
            f'where this run resumes', flush=True)
    metrics_lib.truncate_after(os.path.join(workdir, SAMPLES_FILE), start)
    metrics_lib.truncate_after(
        os.path.join(workdir, expert_load.EXPERT_LOAD_FILE), start)
    # The steps past `start` that a crash logged are hidden in TensorBoard
    # as they are dropped from the .jsonl files above.
    tb = stack.enter_context(contextlib.closing(
        _phase_tb(workdir, 'rl', start + 1)))
    writer = metrics_lib.MetricsWriter(workdir, mirror=tb)
    samples_writer = metrics_lib.MetricsWriter(workdir, SAMPLES_FILE,
                                               mirror=tb)
    load_writer = metrics_lib.MetricsWriter(
        workdir, expert_load.EXPERT_LOAD_FILE, mirror=tb)
    try:
      with compiles_lib.CompileLog() as ctx.compile_log:
        state, done = rl_loop(ctx, state, start, rng, key, writer, ckpt, guard,
                              samples_writer, load_writer)
      summary_compiles = dict(compiles=ctx.compile_log.count(),
                              compile_s=ctx.compile_log.seconds())
    finally:
      ctx.planner.close()
      writer.close()
      samples_writer.close()
      load_writer.close()
    if done < config.rl.steps:
      return _stopped(workdir, done, 'rl', guard)
    summary['greedy_reward_after_rl'] = evaluate(state.params)
    tb.write(done, {'phase': 'eval', **{k: v for k, v in summary.items()
                                        if k.startswith('greedy')}})
    summary.update(_reward_summary(workdir), **_distill_summary(workdir),
                   plan_fallbacks=ctx.planner.num_fallbacks,
                   **summary_compiles)
    greedy = [(0, summary['greedy_reward_before_rl']),
              (done, summary['greedy_reward_after_rl'])]
    plots = metrics_lib.plot_metrics(
        workdir, reward_range=task.reward_range,
        greedy=[g for g in greedy if g[1] is not None])
    if distributed.is_primary():
      load_png = expert_load.plot(workdir)
      if load_png:
        plots = list(plots) + [load_png]
      # Last, and whole or not at all: its presence marks the run complete
      # (`_complete`), so a crash before it reruns the tail.
      path = os.path.join(workdir, SUMMARY_FILE)
      with open(path + '.tmp', 'w') as f:
        json.dump(summary, f, indent=1)
      os.replace(path + '.tmp', path)
    summary['plots'] = plots
    return summary
