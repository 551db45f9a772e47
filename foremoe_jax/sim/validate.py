"""The simulator against measurement: bench_rl_step on this machine.

Two profiles of this machine, neither of which sees a method's plan,
moves or timing:

* `kernels`: `calibrate.cpu_profile`, from microbenchmarks (all-to-all,
  the engine's own rounds, memory, the model's forward + backward at five
  routing skews);
* `update`: the same, with its compute constants (GEMM rate and per-layer
  overhead, of the update and of a forward-only pass) refitted on
  the RL step's own programs, the update and the recompute, run with the
  static layout (no planner, no moves) on the benchmark's batch with its
  routes replaced by synthetic ones of several skews. What it is fitted on
  is held out from what it is judged on: the judged runs are the methods'
  updates and recomputes on the sampled routes, which no fit sees, and no
  calibration run shares a capacity bucket with them (each skew is moved
  off the judged buckets, `rl_step.held_out_skews`; `held_out_buckets`
  refuses a measurement where they meet). The
  two are timed side by side, each repetition running the methods and
  then the calibration runs, so that drift in a shared host's speed over
  the half hour of runs biases neither against the other.

`bench_rl_step` then times every method's real update and recompute, and
`simulate.time_step` predicts each from the benchmark's own plans, move
schedules and buckets; the report is the relative error per method and
profile, for the update and for the recompute. The `update` profile is the
one the validation target reads.
"""
from __future__ import annotations

import dataclasses
import os
import pickle

import numpy as np

from foremoe_jax import placement as placement_lib
from foremoe_jax.benchmarks import rl_step
from foremoe_jax.sim import calibrate, simulate
from foremoe_jax.sim.hardware import HardwareProfile, describe
from foremoe_jax.sim.workload import ModelShape, Workload
from foremoe_jax.tasks import task_from_config
from foremoe_jax.transfer import schedule

CALIBRATION_SKEWS = (0.0, 0.2, 0.4, 0.6)
# The layout of what `_measure` caches. Raise it whenever the measured
# step or the cached objects change (the engine's transfers, the
# recompute's prefill, ...): a cache of another format is measured anew,
# never read as if the current code had produced it. 2: staged exact
# transfers with their budget, and the recompute's prefill of the update's
# slots. 3: the chunked prefill in place, and the CPU exchange picking items
# as its rounds send them. 4: the emulated dispatch pads
# each pair to the step's pair bucket (`StepPlan.cell`), not the routing bound.
# 5: the calibration runs timed in the methods' repetitions, after them.
# 6: the CPU engine's single-stage transitions in place. 7: the
# calibration runs' skews moved off the buckets the methods are judged at
# (`rl_step.held_out_skews`). 8: each method's recompute timed again alone
# (`recompute_alone_s`), and every repetition's seconds kept. 9: EPLB-step's
# even split leaves a packing's filler copies idle (`split.uniform_flows`);
# the exposed transfer's idle twin keeps the local work, and EPLB-step's
# recompute alone runs the timed plan (benchmarks/rl_step.py). 10: static EP
# updates on the canonical layout (no slots), and the methods' order
# rotates over repetitions.
CACHE_FORMAT = 10


def _static_plan(loads_MLDE, capacity: int, topo, cost) -> simulate.MethodPlan:
  """The static layout as a MethodPlan (no planner, no moves)."""
  num_micro, num_layers, num_dev, num_experts = np.shape(loads_MLDE)
  home = placement_lib.identity_placement(num_layers, num_experts, num_dev,
                                          topo.slots_per_device)
  from foremoe_jax.planner import baselines  # pylint: disable=g-import-not-at-top
  from foremoe_jax.transfer import schedule  # pylint: disable=g-import-not-at-top
  plan = baselines.plan_static(loads_MLDE, topo, cost, home)
  transfer = schedule.build_step_transfer(
      plan.placement.slot_expert, num_experts, topo,
      simulate.default_budget(topo))
  caps = {mode: capacity for mode in simulate.MODES}
  return simulate.MethodPlan(plan, transfer, caps, caps, 0, 0.0,
                             recompute_capacity=caps)


def refit_compute(profile: HardwareProfile, runs, topo, cost,
                  model: ModelShape, work: Workload) -> HardwareProfile:
  """The profile with F, the per-layer overheads and (with `tiled_gemm`)
  the per-tile overhead fitted to update (and recompute) times of the
  static layout on synthetic routes ([{loads_MLDE, capacity, update_s,
  recompute_s}]).

  The predicted update is linear in 1/F, in the per-tile and in the
  per-layer overhead: what the profile predicts with infinite F and no
  overheads (all-to-alls, copies, optimizer) plus FLOPs / F plus the
  busiest device's tiles x passes x tile overhead plus (2 passes x layers
  x micro-steps) x layer overhead, so least squares through the
  measurements gives all three. Tiles are a regressor of their own
  because the tile grows with the bucket (`default_tile`): rows and tiles
  do not move together across buckets.
  """
  fast = dataclasses.replace(profile, peak_flops_per_s=1e30,
                             matmul_efficiency=1.0, layer_overhead_s=0.0,
                             tile_overhead_s=0.0)
  count = dataclasses.replace(fast, peak_flops_per_s=1.0, hbm_bw=1e30)
  regressors = [count]
  if profile.tiled_gemm:
    regressors.append(dataclasses.replace(fast, tile_overhead_s=1.0,
                                          hbm_bw=1e30))
  coef, fixed = _fit_phase(runs, fast, regressors, 'update_s',
                           ('moe_compute_s', 'nonexpert_s'), topo, cost,
                           model, work)
  fit = dataclasses.replace(
      profile, name='cpu_update_fit', peak_flops_per_s=1.0 / coef[0],
      matmul_efficiency=1.0, layer_overhead_s=fixed / (
          2 * model.num_layers * work.num_microsteps),
      tile_overhead_s=coef[1] if len(coef) > 1 else 0.0)
  # The forward-only pass (the recompute) the same way, on the same runs'
  # recomputes: its own GEMM rate, per-tile and per-layer overheads. Its
  # tiles are priced apart from the update's: there a tile's cost is mostly
  # its backward's (the weight gradients written into the slot's sum), and
  # borrowing it for the forward pulled the forward's fixed cost below 0
  # (fitted through 0: 8-15% residuals on the calibration runs themselves).
  passes = work.recompute_forward_passes
  timed = [r for r in runs if r.get('recompute_s')]
  if not passes or len(timed) < 2:
    return fit
  fast_f = dataclasses.replace(fit, forward_flops_per_s=1e30,
                               forward_layer_overhead_s=0.0,
                               forward_tile_overhead_s=0.0)
  regressors_f = [dataclasses.replace(fast_f, forward_flops_per_s=1.0,
                                      hbm_bw=1e30)]
  if profile.tiled_gemm:
    regressors_f.append(dataclasses.replace(
        fast_f, forward_tile_overhead_s=1.0, hbm_bw=1e30))
  coef, fixed = _fit_phase(timed, fast_f, regressors_f, 'recompute_s',
                           ('recompute_moe_s', 'recompute_nonexpert_s'),
                           topo, cost, model, work)
  return dataclasses.replace(
      fit, forward_flops_per_s=1.0 / coef[0], forward_layer_overhead_s=fixed / (
          passes * model.num_layers * work.num_microsteps),
      forward_tile_overhead_s=coef[1] if len(coef) > 1 else None)


def _fit_phase(runs, fast, regressors, total, parts, topo, cost, model,
               work):
  """(coefficients, fixed seconds) of one phase (`total`, e.g. 'update_s')
  by least squares: each run's measured seconds less what `fast` (infinite
  F, no overheads) predicts outside the compute `parts`, against each
  regressor's seconds of those parts (a profile that prices only one
  thing, e.g. the FLOPs: seconds at 1 FLOP/s and nothing else). If a
  regressor after the first comes out negative (too few or too alike runs
  to separate it), the extra ones are dropped: coefficient 0; if the fixed
  seconds come out negative, the fit is redone through 0."""
  xs, ys = [], []
  for r in runs:
    mp = _static_plan(r['loads_MLDE'], r['capacity'], topo, cost)
    base = simulate.time_step(mp, r['loads_MLDE'], model, work, fast)
    row = []
    for prof in regressors:
      pred = simulate.time_step(mp, r['loads_MLDE'], model, work, prof)
      row.append(sum(pred[k] for k in parts))
    xs.append(row)
    y = r[total] - (base[total] - sum(base[k] for k in parts))
    ys.append(y)
  xs, ys = np.asarray(xs), np.asarray(ys)

  def fit(n, intercept=True):
    cols = [xs[:, :n]] + ([np.ones((len(ys), 1))] if intercept else [])
    sol = np.linalg.lstsq(np.concatenate(cols, axis=1), ys, rcond=None)[0]
    return sol if intercept else np.append(sol, 0.0)

  def solve(intercept):
    sol = fit(len(regressors), intercept)
    if (sol[1:-1] <= 0).any():  # The FLOPs stay; the extra regressors go.
      one = fit(1, intercept)
      sol = np.concatenate([one[:1], np.zeros(len(regressors) - 1), one[1:]])
    return sol

  sol = solve(True)
  # A fixed cost cannot be negative. Clamping the intercept to 0 while
  # keeping the slope fitted beside the negative one would tilt every
  # prediction up; the constrained least squares is the fit through 0.
  if sol[-1] < 0:
    sol = solve(False)
  coef = [max(float(sol[0]), 1e-30)] + [float(c) for c in sol[1:-1]]
  return coef, float(sol[-1])


def held_out_buckets(runs, extras) -> tuple[list[int], list[int]]:
  """(the calibration runs' buckets, the buckets the methods' updates and
  recomputes are judged at), sorted; raises ValueError when they share
  one: a fit judged where it was fitted would hide its error there."""
  fit = sorted({int(r['capacity']) for r in runs})
  judged = sorted({int(p.capacity) for p in extras['planned'].values()}
                  | {int(c) for c in extras['recompute_capacity'].values()})
  shared = set(fit) & set(judged)
  if shared:
    raise ValueError(f'calibration buckets {fit} and judged buckets {judged} '
                     f'share {sorted(shared)}: the validation would not hold '
                     'out what it fits on')
  return fit, judged


def _measure(bench, config, tokens_per_seq, seqs_per_device, skews, log):
  """Everything the validation measures on this machine (the slow part)."""
  kernels, raw = calibrate.cpu_profile(
      config.model, tokens_per_seq=tokens_per_seq,
      seqs_per_device=seqs_per_device,
      slots_per_device=config.parallel.slots_per_device, log=log)
  extras = {}
  measured = rl_step.run(bench, log=log, extras=extras,
                         calibration_skews=skews)
  extras.pop('config', None)  # Rebuilt from the bench.
  return dict(kernels=kernels, raw=raw, extras=extras, measured=measured)


def cache_key(bench: rl_step.RLStepBench, skews) -> dict:
  return dict(bench=dataclasses.asdict(bench), skews=list(skews),
              format=CACHE_FORMAT)


def read_cache(path: str, key: dict, log=print):
  """The measurements cached at path for key, or None (no file, or one
  for another bench, skews or CACHE_FORMAT)."""
  if not os.path.exists(path):
    return None
  with open(path, 'rb') as f:
    saved = pickle.load(f)
  if saved.get('key') != key:
    log(f'validation: {path} holds measurements of another bench or cache '
        f'format (now {CACHE_FORMAT}); measuring again')
    return None
  log(f'validation: measurements read from {path}')
  return saved['data']


def validate(bench: rl_step.RLStepBench = rl_step.RLStepBench(repeats=3),
             log=print, skews=CALIBRATION_SKEWS,
             cache: str | None = None) -> dict:
  """cache: a file of the measurements (written after measuring, read
  instead of measuring when it exists, for the same bench and skews), so
  the fit and the predictions can be redone without the half hour of runs.
  """
  config = rl_step.bench_config(bench)
  seqs_per_device = bench.prompts * bench.generations // bench.microbatches // 8
  task = task_from_config(config)
  tokens_per_seq = task.sequence_len - 1  # Positions the model reads.
  key = cache_key(bench, skews)
  data = read_cache(cache, key, log) if cache else None
  if data is None:
    data = _measure(bench, config, tokens_per_seq, seqs_per_device, skews,
                    log)
    if cache:
      try:  # A cache that cannot be written must not cost the run.
        with open(cache, 'wb') as f:
          pickle.dump(dict(key=key, data=data), f)
      except Exception as err:  # pylint: disable=broad-except
        log(f'validation: could not write {cache}: {err!r}')
  kernels, raw = data['kernels'], data['raw']
  extras, measured = data['extras'], data['measured']
  model = ModelShape.from_config(config.model)
  work = Workload(num_devices=8, num_microsteps=bench.microbatches,
                  seqs_per_microbatch=seqs_per_device,
                  tokens_per_seq=tokens_per_seq,
                  redundant_slots_per_device=bench.redundant_slots_per_device,
                  recompute_forward_passes=measured['recompute_forward_passes'],
                  remat_policy=config.model.remat_policy,
                  fsdp_all=(config.parallel.fsdp and config.parallel.get(
                      'fsdp_axes', 'data') == 'data+expert'))
  topo = simulate.topology(model, work, kernels)
  cost = simulate.cost_model(model, kernels)
  loads = extras['loads_MLDE']
  plans = {}
  for method, p in extras['planned'].items():
    cap = {mode: p.capacity for mode in simulate.MODES}
    rcap = {mode: extras['recompute_capacity'][method]
            for mode in simulate.MODES}
    rplan = extras['recompute_plans'].get(method)
    plans[method] = simulate.MethodPlan(
        p.plan, p.transfer, cap, {m: extras['static_capacity']
                                  for m in simulate.MODES}, p.reverted,
        p.plan_s, recompute_plan=None if rplan is None else rplan[0],
        recompute_transfer=None if rplan is None else rplan[1],
        recompute_capacity=rcap,
        recompute_plan_s=measured['methods'][method]['recompute_plan_s'],
        # Whether the bench's recompute prefilled the update's slots (its
        # fill then starts from them).
        prefilled=extras['prefilled'][method],
        canonical=method == 'static')  # As the bench's update runs it.
  runs = extras['calibration_runs']
  fit_buckets, judged = held_out_buckets(runs, extras)
  update_fit = refit_compute(kernels, runs, topo, cost, model, work)
  log(f'calibrate: update fit on {len(runs)} static-layout runs of synthetic '
      f'routes (skews {[r["skew"] for r in runs]}): GEMM '
      f'{update_fit.flops_per_s / 1e9:.2f} GFLOP/s, '
      f'{update_fit.layer_overhead_s * 1e3:.2f} ms per layer and pass, '
      f'{update_fit.tile_overhead_s * 1e3:.2f} ms per tile and pass, '
      f'forward-only {(update_fit.forward_flops_per_s or 0.0) / 1e9:.2f} '
      f'GFLOP/s, {(update_fit.forward_layer_overhead_s or 0.0) * 1e3:.2f} ms '
      f'per layer, {(update_fit.forward_tile_overhead_s or 0.0) * 1e3:.2f} '
      f'ms per tile')
  methods = {}
  for method, mp in plans.items():
    meas = measured['methods'][method]
    # The recompute is judged as it ran alone (`rl_step.run`): the
    # simulator prices devices whose host has cores of its own for the
    # planner; here the planner of the micro-steps ran on the cores that
    # are the devices, beside the first run of it (reported too).
    rec = meas['recompute_alone_s']
    row = dict(measured_update_s=meas['update_s'],
               measured_recompute_s=rec,
               measured_recompute_beside_planner_s=meas['recompute_s'],
               measured_exposed_transfer_s=meas['exposed_transfer_s'],
               capacity=mp.capacity['exact'],
               recompute_capacity=mp.recompute_capacity['exact'])
    # The host's noise: each timing's spread over the repetitions, (max -
    # min) / median.
    for k, times in meas['per_repetition'].items():
      if len(times) > 1:
        row[f'spread_{k}'] = float(np.ptp(times) / np.median(times))
    for name, prof in (('update', update_fit), ('kernels', kernels)):
      pred = simulate.time_step(mp, loads, model, work, prof)
      sfx = '' if name == 'update' else '_kernels_profile'
      row[f'predicted_update_s{sfx}'] = pred['update_s']
      row[f'rel_error_update{sfx}'] = pred['update_s'] / meas['update_s'] - 1
      row[f'predicted_recompute_s{sfx}'] = pred['recompute_s']
      row[f'rel_error_recompute{sfx}'] = (
          pred['recompute_s'] / rec - 1 if rec > 0 else 0.0)
      row[f'predicted_exposed_transfer_s{sfx}'] = pred['transfer_exposed_s']
      if name == 'update':  # What the predicted recompute is made of.
        row['predicted_recompute_parts_s'] = {
            k: pred[k] for k in ('recompute_fill_s', 'recompute_moe_s',
                                 'recompute_a2a_s', 'recompute_nonexpert_s',
                                 'prefill_s', 'prefill_exposed_s')
            if k in pred}
    methods[method] = row
  pred_su = (methods['static']['predicted_update_s']
             / methods['foremoe']['predicted_update_s'])
  return dict(
      bench=dataclasses.asdict(bench), profile=describe(update_fit),
      kernels_profile=describe(kernels), calibration=dict(
          raw, fitted_on=[dict(skew=r['skew'],
                               requested_skew=r.get('requested_skew'),
                               capacity=r['capacity'],
                               update_s=r['update_s'],
                               recompute_s=r.get('recompute_s'))
                          for r in runs]),
      held_out='the methods\' updates and recomputes on the sampled routes, '
               'at buckets no calibration run used (the fit saw only the '
               'static layout on synthetic routes)',
      fit_buckets=fit_buckets, judged_buckets=judged,
      methods=methods,
      max_rel_error_update=max(abs(m['rel_error_update'])
                               for m in methods.values()),
      max_rel_error_recompute=max(abs(m['rel_error_recompute'])
                                  for m in methods.values()),
      max_spread=max((v for m in methods.values() for k, v in m.items()
                      if k.startswith('spread_')), default=None),
      max_rel_error_update_kernels_profile=max(
          abs(m['rel_error_update_kernels_profile']) for m in methods.values()),
      predicted_speedup_update_vs_static=pred_su,
      measured_speedup_update_vs_static=measured['speedup_update_vs_static'])
