"""Does ForeMoE make the RL step faster, all costs counted?

One RL step of an MoE-dominated model on 8 simulated CPU devices, with the
routing foresight from the project's own sampler (after a short supervised
warm start, so routing is skewed as in a trained model), micro-batches of a
few sequences, the default exact-count dispatch with the fine capacity
ladder, and each planner method driving the same compiled step as the
trainer does:

  plan (host thread, async)  ||  step-level plan (host, at once)
                                 -> recompute (device, the forwards the step
                                    needs, on that placement)
  -> update: fill slots, M micro-steps with moves between them, gradient
     returns, one optimizer update.

Methods: static EP (on the canonical layout: experts computing at home,
no slots, fill or gradient returns), EPLB from step-level history, EPLB
fed each micro-step's loads, foresight_split (the step-level plan from the
step's exact loads plus a per-micro-step token split, no moves: the
simplest use of the foresight) and ForeMoE. Per method, interleaved over
repetitions (each starting at the next method, so none always runs first
or last):
update_s, recompute_s, step_s (everything from planning to the updated
state: step-level planning, recompute, waiting for the plan, update),
plan_s and plan_wait_s, the micro-step max/mean device load (mean and
p95), weight bytes moved per device per micro-step, wire_bytes_over_useful
(experts the transfer collectives carry over those that had to move; the
CPU emulation's padded figure beside it), exposed_transfer_s
(the update minus its twin with every cross-device exchange idled; static
EP's twin is the same update again: the floor), recompute_alone_s (the same recompute again with no
planner beside it: here the planner's processes share the cores that are
the devices, which a cluster's host cores do not), each repetition's
seconds, the capacity buckets, and the bytes of any all-gather
of expert weights in the compiled update (must be 0). Every XLA compile of
the step is counted. `max_rel_param_diff` compares ForeMoE's updated
parameters with static EP's after one step (moving experts must change no
number).

On simulated devices that share the host's cores, the exact dispatch's
tile loop runs the busiest device's tile count everywhere
(`grouped_swiglu` 'tiles_lockstep'), so wall-clock follows the straggler
as on a real mesh.
"""
from __future__ import annotations

import dataclasses
import tempfile
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from foremoe_jax import config as config_lib
from foremoe_jax import placement as placement_lib
from foremoe_jax import planner as planner_lib
from foremoe_jax.foresight import loads as loads_lib
from foremoe_jax.model import expert_parallel, sharding, transformer
from foremoe_jax.rl import step as step_lib
from foremoe_jax.rl import trainer
from foremoe_jax.tasks import task_from_config
from foremoe_jax.transfer import schedule
from foremoe_jax.utils import compiles as compiles_lib
from foremoe_jax.utils import hlo

METHODS = ('static', 'eplb_step', 'eplb_microstep', 'foresight_split',
           'foremoe')


@dataclasses.dataclass(frozen=True)
class RLStepBench:
  # Expert compute dominates attention and dispatch. Per micro-step each
  # device holds 8 sequences of 64 tokens: on simulated CPU devices the
  # step's fixed costs (collectives on 2 shared cores, copies of the slot
  # weights) are large per token, and fewer tokens a device would leave
  # the experts a minor share of the step, unlike a real micro-step of
  # 8-16k tokens a GPU.
  d_model: int = 256
  moe_d_ff: int = 2048
  num_experts: int = 16
  top_k: int = 2
  num_layers: int = 2
  redundant_slots_per_device: int = 1
  num_digits: int = 31  # Sort task: 33 prompt + 32 completion tokens.
  prompts: int = 32
  generations: int = 8
  microbatches: int = 4  # 64 sequences (4,160 tokens) per micro-step.
  warmstart_steps: int = 100
  warmstart_batch: int = 32
  repeats: int = 3
  seed: int = 0


def bench_config(cfg: RLStepBench) -> ml_collections.ConfigDict:
  """The tiny config reshaped into the benchmark's model."""
  from configs import tiny  # pylint: disable=g-import-not-at-top
  c = tiny.get_config()
  c.seed = cfg.seed
  c.task = 'sort'
  c.task_kwargs = ml_collections.ConfigDict({'num_digits': cfg.num_digits})
  m = c.model
  m.d_model, m.moe_d_ff = cfg.d_model, cfg.moe_d_ff
  m.num_heads, m.num_kv_heads, m.head_dim = 4, 2, cfg.d_model // 4
  m.num_experts, m.top_k, m.num_layers = cfg.num_experts, cfg.top_k, cfg.num_layers
  m.vocab_size = 32
  m.max_seq_len = 64 * -(-(2 * cfg.num_digits + 4) // 64)
  c.parallel.slots_per_device = (cfg.num_experts // 8
                                 + cfg.redundant_slots_per_device)
  c.rl.prompts_per_step, c.rl.num_generations = cfg.prompts, cfg.generations
  c.rl.num_microbatches = cfg.microbatches
  c.warmstart.steps = cfg.warmstart_steps
  c.warmstart.batch_size = cfg.warmstart_batch
  c.transfer.step_rounds = 8
  c.transfer.microstep_rounds = 2
  c.planner.deadline_ms = 2000.0
  return c


# The cross-device half of a transition (both modes' names) and its
# "nothing" value: what `_installed` idles.
_CROSS_DEVICE = (('count_LPDD', 0), ('send_LPDR', 0), ('recv_LPDR', -1),
                 ('ret_count_LPDD', 0), ('ret_send_LPDR', 0),
                 ('ret_recv_LPDR', -1), ('shift_LR', 0), ('send_LRD', 0),
                 ('recv_LRD', -1), ('ret_shift_LR', 0), ('ret_send_LRD', 0),
                 ('ret_recv_LRD', -1))


def _installed(step_transfer):
  """The host transfer with nothing crossing devices: every exchange and
  shift round idle, the local work as it is (each slot's local copies,
  its gradient added into its home on its own device, the evictions), so
  the same update timed with it differs from the real one by the
  transfers alone (the weights are wrong where a slot waited for a
  remote expert)."""
  def idle(t):
    return t._replace(**{k: np.full_like(getattr(t, k), off)
                         for k, off in _CROSS_DEVICE if hasattr(t, k)})
  return step_transfer._replace(
      **{k: idle(getattr(step_transfer, k))
         for k in ('fill', 'steps', 'flush')})


@dataclasses.dataclass
class Prepared:
  """What every method's step starts from: the warm-started state, the
  scored rollout as a device batch with its foresight loads, and one
  planner per method whose history is the previous rollout's loads."""
  config: ml_collections.ConfigDict
  ctx: trainer.RLContext
  state0: step_lib.TrainState
  batch: dict
  loads_MGLDE: np.ndarray
  loads_MLDE: np.ndarray
  planners: dict
  history0: dict


def prepare(cfg: RLStepBench, log=print, methods=METHODS) -> Prepared:
  """Warm start, two rollouts (EPLB-step plans the second from the
  first's loads), and the planners: the setup `run` times the step on."""
  config = bench_config(cfg)
  config_lib.validate_config(config)
  task = task_from_config(config)
  mesh = expert_parallel.make_mesh(1, 8)
  model = transformer.Transformer(config.model, mesh,
                                  dispatch=config.parallel.dispatch,
                                  rngs=nnx.Rngs(cfg.seed))
  graphdef, params = sharding.split_model(model, mesh)
  rng = np.random.default_rng(cfg.seed)
  log(f'warm start: {cfg.warmstart_steps} SFT steps (skews the routing)')
  ckpt = _NoCheckpoint()
  if cfg.warmstart_steps:
    params = trainer.warm_start(config, task, graphdef, params, mesh,
                                tempfile.mkdtemp(prefix='bench_rl_step_'),
                                rng, jax.random.key(cfg.seed), ckpt)
  ctx = trainer.make_rl_context(config, graphdef, mesh, task)
  ctx.planner.close()
  state0 = step_lib.init_train_state(graphdef, params, ctx.rl_step.tx, mesh,
                                     with_ref=config.rl.beta > 0)
  batches = []
  for i in range(2):
    prompts, ro = trainer.rollout(ctx, state0.params, rng, jax.random.key(i))
    rewards = trainer.score(ctx, prompts, ro)
    mbs = trainer.compose(ctx, ro, i)
    loads = trainer.foresight(ctx, ro, mbs)
    batches.append((trainer.device_batch(trainer.rl_batch_from_rollout(
        ro, rewards, mbs), mesh), loads, mbs))
  batch, loads_MGLDE, _ = batches[1]
  planners = {}
  for method in methods:
    p = planner_lib.StepPlanner(method, ctx.topo, ctx.cost, ctx.identity,
                                deadline_s=config.planner.deadline_ms / 1e3,
                                carry_over=False, budget=ctx.budget)
    p.history_LE = planner_lib.update_history(
        None, trainer.planner_loads(batches[0][1]), 0.5)
    planners[method] = p
  # Every repetition plans the same step from the same history (a plan
  # updates its planner's history; EPLB-step would drift rep to rep).
  return Prepared(config, ctx, state0, batch, loads_MGLDE,
                  trainer.planner_loads(loads_MGLDE), planners,
                  {m: p.history_LE for m, p in planners.items()})


def planned_step(prep: Prepared, method: str, state):
  """As the trainer orders them: the step-level plan and the recompute on
  it, then the micro-step plan made while it runs. Returns (logps, the
  recompute's plan, the planner's output, the device StepPlan, and the
  times (start, plan ready, recompute ready))."""
  ctx = prep.ctx
  ctx.planner = prep.planners[method]
  ctx.planner.history_LE = prep.history0[method]
  t0 = time.perf_counter()
  logps, rplan = trainer.recompute(ctx, state, prep.batch, prep.loads_MGLDE)
  ticket = trainer.plan_async(ctx, prep.loads_MGLDE, fallback=rplan.plan,
                              start_LS=rplan.prefill_LS)
  clock = trainer._ReadyClock(logps)  # pylint: disable=protected-access
  planned = ticket.result()
  t_plan = time.perf_counter()
  t_rec = clock.wait()
  ctx.recompute_s = t_rec - t0
  plan = trainer.update_plan(ctx, planned)
  return logps, rplan, planned, plan, (t0, t_plan, t_rec)


def run(cfg: RLStepBench, log=print, extras: dict | None = None,
        calibration_skews=()) -> dict:
  """extras: when a dict, receives the step's loads ('loads_MLDE', and per
  data group 'loads_MGLDE'), the canonical layout's bucket
  ('static_capacity'), each method's host output ('planned': {method:
  PlannedStep}) and the config, for the cluster simulator's validation.
  calibration_skews: also time the update with the static layout in the
  slots (no planner, no moves: the slot path the other methods run) on
  this batch with its routes replaced by synthetic ones of these skews (`calibrate.skewed_routes`), into
  extras['calibration_runs'] (the loads, bucket and median seconds of
  each), timed in each repetition after the methods: data the simulator
  may fit on, disjoint from what it is judged on (the methods' runs on
  the sampled routes)."""
  prep = prepare(cfg, log)
  config, ctx, state0, batch = prep.config, prep.ctx, prep.state0, prep.batch
  loads_MGLDE, loads_MLDE = prep.loads_MGLDE, prep.loads_MLDE
  planners = prep.planners
  num_micro = loads_MLDE.shape[0]
  expert_elems = cfg.d_model * cfg.moe_d_ff
  res = {m: dict(update_s=[], installed_s=[], recompute_s=[],
                 recompute_alone_s=[], step_s=[], plan_s=[], plan_wait_s=[],
                 recompute_plan_s=[])
         for m in METHODS}
  rl = ctx.rl_step
  hlo_bytes, params_after = {}, {}
  # The simulator's calibration runs are timed in the same repetitions as
  # the methods, after them, so that a host growing slower or faster over
  # the run moves both alike: the fit and what it is judged on are measured
  # side by side. They are set up after repetition 0, which fixes the
  # methods' buckets, so that no calibration run shares a bucket with what
  # it is judged on, and they compile with the compile log closed, so the
  # log counts no calibration compile (with calibration_skews only: the
  # benchmark itself passes none).
  calibrate_here = extras is not None and bool(calibration_skews)
  calib = None
  compile_log = compiles_lib.CompileLog().__enter__()
  try:
    for rep in range(cfg.repeats + 1):  # Repetition 0 compiles.
      # Each repetition starts at the next method: none always runs first
      # (after the calibration runs) or last.
      first = rep % len(METHODS)
      for method in METHODS[first:] + METHODS[:first]:
        state = jax.tree.map(jnp.copy, state0)
        jax.block_until_ready(state)
        logps, rplan, planned, plan, (t0, t_plan, t_rec) = planned_step(
            prep, method, state)
        new_state, m = rl.update(state, batch, logps, plan)
        jax.block_until_ready(new_state)
        t_done = time.perf_counter()
        r = res[method]
        if rep == 0:
          # Any gather holding at least one expert matrix counts.
          hlo_bytes[method] = hlo.all_gather_bytes(
              rl.update.lower(state0, batch, logps, plan).compile().as_text(),
              min_elements=expert_elems)
          params_after[method] = jax.device_get(new_state.params)
          r['plan'] = planned
          r['recompute_capacity'] = rplan.capacity
          r['recompute_plan'] = (None if rplan.plan is None
                                 else (rplan.plan, rplan.transfer))
          r['prefilled'] = rplan.prefill_LS is not None
          r['id_errors'] = int(m['transfer_id_errors'])
          r['dropped'] = int(m['dropped'])
        # The same update with nothing crossing devices, its plan uploaded
        # inside the timer as the real one's is (`planned_step`).
        # Static EP moves nothing (the canonical layout): its twin is the
        # same update again, so its exposed transfer is the measurement's
        # floor.
        state = jax.tree.map(jnp.copy, state0)
        idle_host = (None if isinstance(plan, step_lib.CanonicalLayout)
                     else _installed(planned.transfer))
        jax.block_until_ready(state)
        t_i = time.perf_counter()
        installed = plan if idle_host is None else dataclasses.replace(
            plan, placement=step_lib.device_placement(
                planned.plan.placement, ctx.mesh),
            transfer=step_lib.device_transfer(idle_host, ctx.mesh))
        jax.block_until_ready(rl.update(state, batch, logps, installed))
        t_i_done = time.perf_counter()
        # The same recompute again, alone: on this host the micro-step
        # planner runs on the cores that are the devices, so the first one
        # shared them with it; on a cluster the planner has host cores of
        # its own. Same plan, same program (nothing compiles): the plan
        # folded this step's loads into EPLB-step's history, which its
        # step-level plan reads, so the history goes back first.
        ctx.planner.history_LE = prep.history0[method]
        state = jax.tree.map(jnp.copy, state0)
        jax.block_until_ready(state)
        t_a = time.perf_counter()
        jax.block_until_ready(trainer.recompute(ctx, state, batch,
                                                loads_MGLDE)[0])
        t_a_done = time.perf_counter()
        if rep == 0:
          continue
        r['recompute_alone_s'].append(t_a_done - t_a)
        r['update_s'].append(t_done - max(t_plan, t_rec))
        r['installed_s'].append(t_i_done - t_i)
        r['recompute_s'].append(t_rec - t0)
        r['step_s'].append(t_done - t0)
        r['plan_s'].append(planned.plan_s)
        r['recompute_plan_s'].append(rplan.plan_s)
        r['plan_wait_s'].append(max(0.0, t_plan - t_rec))
      if rep == 0 and calibrate_here:
        judged = judged_buckets(res)
        compile_log.__exit__(None, None, None)
        calib = _calibration_setup(ctx, rl, state0, batch, config, cfg,
                                   calibration_skews, avoid=judged, log=log)
        compile_log.__enter__()
      if rep and calib is not None:
        _time_calibration(rl, state0, calib)
      if rep:
        log(f'repetition {rep}/{cfg.repeats}: ' + ', '.join(
            f"{m} {res[m]['step_s'][-1]:.3f}s" for m in METHODS))
  finally:
    compile_log.__exit__(None, None, None)
  step_compiles = {name: compile_log.count(fun)
                   for name, fun in (('update', 'update'),
                                     ('recompute', 'recompute_logps'))}
  for p in planners.values():
    p.close()
  if calib is not None:
    extras['calibration_runs'] = [
        dict(loads_MLDE=r['loads_MLDE'], capacity=r['capacity'],
             skew=r['skew'], requested_skew=r['requested_skew'],
             update_s=float(np.median(r['times'])),
             recompute_s=float(np.median(r['recompute_times'])),
             update_times=[float(t) for t in r['times']],
             recompute_times=[float(t) for t in r['recompute_times']])
        for r in calib['runs']]
  if extras is not None:
    extras['loads_MLDE'] = loads_MLDE
    extras['loads_MGLDE'] = np.asarray(loads_MGLDE)
    extras['static_capacity'] = trainer.static_capacity(ctx, loads_MGLDE)
    extras['planned'] = {m: res[m]['plan'] for m in METHODS}
    extras['recompute_capacity'] = {m: res[m]['recompute_capacity']
                                    for m in METHODS}
    extras['recompute_plans'] = {m: res[m]['recompute_plan']
                                 for m in METHODS}
    extras['prefilled'] = {m: res[m]['prefilled'] for m in METHODS}
    extras['config'] = config

  out = {}
  for method in METHODS:
    r = res[method]
    planned = r['plan']
    mom = np.concatenate([placement_lib.max_over_mean(
        placement_lib.device_loads(loads_MLDE[i], planned.plan.microstep(i)))
                          for i in range(num_micro)])
    med = lambda k: float(np.median(r[k]))
    moved = trainer.transfer_metrics(
        ctx, planned, r['recompute_plan'][1] if r['prefilled'] else None)
    extra = (r['recompute_plan'][1].fill,) if r['prefilled'] else ()
    out[method] = dict(
        update_s=med('update_s'), recompute_s=med('recompute_s'),
        recompute_alone_s=med('recompute_alone_s'),
        step_s=med('step_s'), plan_s=med('plan_s'),
        plan_wait_s=med('plan_wait_s'),
        recompute_plan_s=med('recompute_plan_s'),
        # Paired: each repetition's update less its idle twin, then the
        # median (the two medians' difference mixes repetitions).
        exposed_transfer_s=float(np.median(
            np.subtract(r['update_s'], r['installed_s']))),
        microstep_max_over_mean_mean=float(mom.mean()),
        microstep_max_over_mean_p95=float(np.percentile(mom, 95)),
        capacity=planned.capacity, cell=planned.cell,
        recompute_capacity=r['recompute_capacity'],
        weight_bytes_moved_per_device_per_microstep=moved[
            'weight_bytes_moved_per_device_per_microstep'],
        # Experts on the wire over experts that had to cross devices, for
        # the collective a GPU/TPU runs (exact: the ragged all-to-all) and
        # for the CPU emulation this benchmark ran (shift rounds, every
        # device sending in each).
        wire_bytes_over_useful=moved['wire_bytes_over_useful'],
        wire_bytes_over_useful_cpu_emulation=(
            schedule.step_wire_over_useful(planned.transfer, 8,
                                           emulated=True, extra=extra)),
        reverted_moves=planned.reverted,
        transfer_id_errors=r['id_errors'], dropped=r['dropped'],
        hlo_expert_all_gather_bytes=hlo_bytes[method],
        # Each repetition's seconds, for the spread behind the medians.
        per_repetition={k: [float(t) for t in r[k]] for k in (
            'update_s', 'installed_s', 'recompute_s', 'recompute_alone_s')})
  diff = 0.0
  for a, b in zip(jax.tree.leaves(params_after['foremoe']),
                  jax.tree.leaves(params_after['static'])):
    diff = max(diff, float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12)))
  static_mom = out['static']['microstep_max_over_mean_mean']
  ratio = lambda k, base: out[base][k] / out['foremoe'][k]
  # The same ratios within each repetition, whose methods ran back to back:
  # their spread is the host's noise, beside the ratios of the medians.
  per_rep = lambda k, base: [float(b / f) for b, f in
                             zip(res[base][k], res['foremoe'][k])]
  baselines = ('static', 'eplb_step', 'foresight_split')
  return dict(
      devices=8, experts=cfg.num_experts, layers=cfg.num_layers,
      dispatch=config.parallel.dispatch, capacity_buckets=list(ctx.buckets),
      microsteps=num_micro, sequences_per_microstep=(
          cfg.prompts * cfg.generations // cfg.microbatches),
      tokens_per_microstep=int(batch['tokens_MbT'].shape[2] - 1) * (
          cfg.prompts * cfg.generations // cfg.microbatches),
      static_microstep_max_over_mean=static_mom,
      recompute_forward_passes=rl.recompute_forward_passes(
          state0.ref_params is not None),
      # XLA compiles of the step's two programs over the whole run (every
      # method, every bucket, the installed-placement variant included).
      step_compiles=step_compiles,
      methods=out,
      speedup_step_vs_static=ratio('step_s', 'static'),
      speedup_step_vs_eplb_step=ratio('step_s', 'eplb_step'),
      speedup_step_vs_foresight_split=ratio('step_s', 'foresight_split'),
      speedup_update_vs_static=ratio('update_s', 'static'),
      speedup_update_vs_eplb_step=ratio('update_s', 'eplb_step'),
      speedup_update_vs_foresight_split=ratio('update_s', 'foresight_split'),
      speedup_step_per_repetition={b: per_rep('step_s', b)
                                   for b in baselines},
      max_rel_param_diff=diff,
      plan_wait_frac_of_step=out['foremoe']['plan_wait_s']
      / out['foremoe']['step_s'])


def judged_buckets(res: dict) -> set[int]:
  """The buckets the methods' updates and recomputes ran at (repetition
  0's plans: res[method]['plan'].capacity and 'recompute_capacity'): what
  the simulator's validation is judged on."""
  return ({int(r['plan'].capacity) for r in res.values()}
          | {int(r['recompute_capacity']) for r in res.values()})


# How far a calibration run's skew moves, per try, off a bucket it must
# not take; and the most it may reach.
SKEW_STEP, MAX_SKEW = 0.02, 0.95


def held_out_skews(skews, bucket_of, avoid) -> list[tuple[float, float]]:
  """[(requested skew, skew used)]: each requested skew, raised by
  SKEW_STEP until `bucket_of(skew)` (the static layout's bucket of that
  skew's synthetic routes) is neither in `avoid` (the judged buckets) nor
  taken by an earlier run, so that the fit and what it is judged on never
  share a bucket. Raises ValueError past MAX_SKEW."""
  taken, out = set(avoid), []
  for want in skews:
    skew = float(want)
    while bucket_of(skew) in taken:
      skew = round(skew + SKEW_STEP, 6)
      if skew > MAX_SKEW:
        raise ValueError(
            f'no calibration skew from {want} up to {MAX_SKEW} lands on a '
            f'bucket outside {sorted(taken)}')
    taken.add(bucket_of(skew))
    out.append((float(want), skew))
  return out


def _calibration_setup(ctx, rl, state0, batch, config, cfg, skews,
                       avoid=(), log=print) -> dict:
  """Static-layout updates and recomputes (the home layout at the same
  bucket, as the static method runs them) on synthetic routes of each
  skew (moved off the buckets in `avoid`: `held_out_skews`), compiled
  once: {'runs': [{loads_MLDE, capacity, cell, skew, requested_skew,
  batch, plan, times, recompute_times}], 'logps'}; `_time_calibration`
  times one repetition of them."""
  from foremoe_jax.sim import calibrate  # pylint: disable=g-import-not-at-top
  m = config.model
  routes = np.asarray(jax.device_get(batch['routes_MLbTK']))
  num_micro, num_layers, per_mb, tlen, top_k = routes.shape
  valid = np.asarray(jax.device_get(batch['valid_MbT']))[:, :, :-1]
  homes = np.arange(m.num_experts // ctx.topo.num_devices)

  def synthetic(skew):
    # Seeded by the skew, so that a skew's routes (and bucket) are the
    # same however it was reached.
    rng = np.random.default_rng((cfg.seed + 1, int(round(skew * 1e6))))
    synth = calibrate.skewed_routes(rng, num_layers, num_micro * per_mb * tlen,
                                    m.num_experts, top_k, homes, skew)
    synth_MLbTK = np.moveaxis(synth.reshape(num_layers, num_micro, per_mb,
                                            tlen, top_k), 0, 1)
    # Per-sample counts in batch order, then the loads of each micro-step.
    counts_BLE = np.zeros((num_micro * per_mb, num_layers, m.num_experts),
                          np.int64)
    for i in range(num_micro):
      for j in range(per_mb):
        ok = valid[i, j]
        for l in range(num_layers):
          counts_BLE[i * per_mb + j, l] = np.bincount(
              synth_MLbTK[i, l, j][ok].reshape(-1), minlength=m.num_experts)
    order = [np.arange(i * per_mb, (i + 1) * per_mb) for i in range(num_micro)]
    loads_MGLDE = loads_lib.loads_from_sample_counts(
        counts_BLE, order, config.parallel.num_data, config.parallel.num_expert)
    return synth_MLbTK, loads_MGLDE, trainer.static_capacity(ctx, loads_MGLDE)

  made = {}

  def bucket_of(skew):
    if skew not in made:
      made[skew] = synthetic(skew)
    return made[skew][2]

  chosen = held_out_skews(skews, bucket_of, avoid)
  log(f'calibration: skews {[c[1] for c in chosen]} (asked '
      f'{[c[0] for c in chosen]}), buckets '
      f'{[bucket_of(c[1]) for c in chosen]}, none of the judged '
      f'{sorted(avoid)}')
  runs = []
  for want, skew in chosen:
    synth_MLbTK, loads_MGLDE, cap = made[skew]
    cell = trainer.cell_capacity(ctx, loads_MGLDE, ctx.identity)
    ident = placement_lib.stack_placements([ctx.identity] * num_micro)
    plan = step_lib.make_step_plan(ident, ctx.num_experts, ctx.topo,
                                   ctx.budget, cap, cell)
    synth_batch = dict(batch, routes_MLbTK=jax.device_put(
        jnp.asarray(synth_MLbTK, batch['routes_MLbTK'].dtype),
        batch['routes_MLbTK'].sharding))
    runs.append(dict(loads_MLDE=trainer.planner_loads(loads_MGLDE),
                     capacity=cap, cell=cell, skew=skew, requested_skew=want,
                     batch=synth_batch,
                     plan=plan, times=[], recompute_times=[]))
  # The same update program as the methods': the reference log-probs of
  # the step (their values do not change the time).
  calib = dict(runs=runs, logps=rl.recompute(state0, batch))
  _time_calibration(rl, state0, calib, record=False)  # Compiles.
  return calib


def _time_calibration(rl, state0, calib: dict, record: bool = True):
  """One repetition of the calibration runs: each run's recompute, then
  its update, from the step's initial state."""
  for r in calib['runs']:
    state = jax.tree.map(jnp.copy, state0)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    jax.block_until_ready(rl.recompute(state, r['batch'],
                                       step_lib.CanonicalLayout(
                                           r['capacity'], r['cell'])))
    t1 = time.perf_counter()
    jax.block_until_ready(rl.update(state, r['batch'], calib['logps'],
                                    r['plan']))
    if record:
      r['recompute_times'].append(t1 - t0)
      r['times'].append(time.perf_counter() - t1)


class _NoCheckpoint:
  """The warm start's checkpoint hook, unused by the benchmark."""

  def save(self, *args, **kwargs):
    del args, kwargs
