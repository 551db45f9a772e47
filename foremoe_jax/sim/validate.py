"""The simulator against measurement: bench_rl_step on this machine.

Two profiles of this machine, neither of which sees a method's plan,
moves or timing:

* `kernels`: `calibrate.cpu_profile`, from microbenchmarks (all-to-all,
  the engine's own rounds, memory, the model's forward + backward at five
  capacities);
* `update`: the same, with its compute constants (GEMM rate, per-layer
  overhead) refitted on the RL update program itself, run with the static
  layout (no planner, no moves) at the buckets *below* the static
  bucket, so that the static method's own time is extrapolated, not fitted.

`bench_rl_step` then times every method's real update, and
`simulate.time_step` predicts each one from the benchmark's own plans,
move schedules and buckets; the report is the relative error per method
and profile. The `update` profile is the one the validation target reads.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from foremoe_jax import config as config_lib
from foremoe_jax.benchmarks import rl_step
from foremoe_jax.sim import calibrate, simulate
from foremoe_jax.sim.hardware import HardwareProfile, describe
from foremoe_jax.sim.workload import ModelShape, Workload
from foremoe_jax.tasks import task_from_config


def refit_compute(profile: HardwareProfile, update_s: dict, mp_static,
                  loads_MLDE, model: ModelShape, work: Workload
                  ) -> HardwareProfile:
  """The profile with F and the per-layer overhead fitted to update times
  of the static layout at several capacities ({capacity: seconds}).

  The predicted update is linear in 1/F and in the overhead: what the
  profile predicts with infinite F and no overhead (all-to-alls, copies,
  optimizer) plus FLOPs / F plus (2 passes x layers x micro-steps) x
  overhead, so a least-squares line through the measurements gives both.
  """
  fast = dataclasses.replace(profile, peak_flops_per_s=1e30,
                             matmul_efficiency=1.0, layer_overhead_s=0.0)
  count = dataclasses.replace(fast, peak_flops_per_s=1.0, hbm_bw=1e30)
  xs, ys = [], []
  for cap, secs in update_s.items():
    mp = dataclasses.replace(mp_static, capacity=int(cap))
    base = simulate.time_step(mp, loads_MLDE, model, work, fast, 'padded')
    flops = simulate.time_step(mp, loads_MLDE, model, work, count, 'padded')
    xs.append(flops['moe_compute_s'] + flops['nonexpert_s'])  # At 1 FLOP/s.
    ys.append(secs - (base['update_s'] - base['moe_compute_s']
                      - base['nonexpert_s']))
  slope, fixed = np.polyfit(np.asarray(xs), np.asarray(ys), 1)
  overhead = max(float(fixed), 0.0) / (
      2 * model.num_layers * work.num_microsteps)
  return dataclasses.replace(
      profile, name='cpu_update_fit', peak_flops_per_s=1.0 / max(slope, 1e-30),
      matmul_efficiency=1.0, layer_overhead_s=overhead)


def validate(bench: rl_step.RLStepBench = rl_step.RLStepBench(repeats=3),
             log=print) -> dict:
  config = rl_step.bench_config(bench)
  seqs_per_device = bench.prompts * bench.generations // bench.microbatches // 8
  task = task_from_config(config)
  tokens_per_seq = task.sequence_len - 1  # Positions the model reads.
  kernels, raw = calibrate.cpu_profile(
      config.model, tokens_per_seq=tokens_per_seq,
      seqs_per_device=seqs_per_device,
      slots_per_device=config.parallel.slots_per_device, log=log)
  buckets = config_lib.capacity_buckets(
      seqs_per_device * tokens_per_seq, config.model.top_k, 8,
      config.parallel.slots_per_device, dispatch='padded',
      factors=simulate.CAPACITY_FACTORS)
  extras = {}
  measured = rl_step.run(bench, log=log, extras=extras,
                         calibration_capacities=buckets)
  model = ModelShape.from_config(config.model)
  work = Workload(num_devices=8, num_microsteps=bench.microbatches,
                  seqs_per_microbatch=seqs_per_device,
                  tokens_per_seq=tokens_per_seq,
                  redundant_slots_per_device=bench.redundant_slots_per_device,
                  reference_forward=True)
  plans = {m: simulate.MethodPlan(p.plan, p.transfer, p.capacity,
                                  extras['static_capacity'], p.reverted,
                                  p.plan_s)
           for m, p in extras['planned'].items()}
  static_cap = extras['static_capacity']
  fit_on = {c: t for c, t in extras['static_update_s'].items()
            if c < static_cap}
  update_fit = refit_compute(kernels, fit_on, plans['static'],
                             extras['loads_MLDE'], model, work)
  log(f'calibrate: update fit on buckets {sorted(fit_on)}: GEMM '
      f'{update_fit.flops_per_s / 1e9:.2f} GFLOP/s, '
      f'{update_fit.layer_overhead_s * 1e3:.2f} ms per layer and pass')
  methods = {}
  for method, mp in plans.items():
    meas = measured['methods'][method]
    row = dict(measured_update_s=meas['update_s'],
               measured_recompute_s=meas['recompute_s'],
               measured_exposed_transfer_s=meas['exposed_transfer_s'],
               capacity=mp.capacity)
    for name, prof in (('update', update_fit), ('kernels', kernels)):
      pred = simulate.time_step(mp, extras['loads_MLDE'], model, work, prof,
                                'padded')
      sfx = '' if name == 'update' else '_kernels_profile'
      row[f'predicted_update_s{sfx}'] = pred['update_s']
      row[f'rel_error_update{sfx}'] = pred['update_s'] / meas['update_s'] - 1
      row[f'predicted_recompute_s{sfx}'] = pred['recompute_s']
      row[f'predicted_exposed_transfer_s{sfx}'] = pred['transfer_exposed_s']
    methods[method] = row
  pred_su = (methods['static']['predicted_update_s']
             / methods['foremoe']['predicted_update_s'])
  return dict(
      bench=dataclasses.asdict(bench), profile=describe(update_fit),
      kernels_profile=describe(kernels), calibration=dict(
          raw, static_update_s={str(c): t for c, t in
                                extras['static_update_s'].items()},
          fitted_on_capacities=sorted(fit_on)),
      methods=methods,
      max_rel_error_update=max(abs(m['rel_error_update'])
                               for m in methods.values()),
      max_rel_error_update_kernels_profile=max(
          abs(m['rel_error_update_kernels_profile']) for m in methods.values()),
      predicted_speedup_update_vs_static=pred_su,
      measured_speedup_update_vs_static=measured['speedup_update_vs_static'])
