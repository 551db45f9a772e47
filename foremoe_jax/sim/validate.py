"""The simulator against measurement: bench_rl_step on this machine.

Calibrates a profile of this machine (`calibrate.cpu_profile`, which never
reads the benchmark), runs `bench_rl_step` (each method's real update,
timed), feeds the benchmark's own plans, move schedules and capacity
buckets to `simulate.time_step` with the measured profile, and reports the
relative error of the predicted update time per method.
"""
from __future__ import annotations

import dataclasses

from foremoe_jax.benchmarks import rl_step
from foremoe_jax.sim import calibrate, simulate
from foremoe_jax.sim.hardware import describe
from foremoe_jax.sim.workload import ModelShape, Workload
from foremoe_jax.tasks import get_task


def validate(bench: rl_step.RLStepBench = rl_step.RLStepBench(repeats=3),
             log=print) -> dict:
  config = rl_step.bench_config(bench)
  seqs_per_device = bench.prompts * bench.generations // bench.microbatches // 8
  task = get_task(config.task, **config.task_kwargs)
  tokens_per_seq = task.sequence_len - 1  # Positions the model reads.
  profile, raw = calibrate.cpu_profile(
      config.model, tokens_per_seq=tokens_per_seq,
      seqs_per_device=seqs_per_device,
      slots_per_device=config.parallel.slots_per_device, log=log)
  extras = {}
  measured = rl_step.run(bench, log=log, extras=extras)
  model = ModelShape.from_config(config.model)
  work = Workload(num_devices=8, num_microsteps=bench.microbatches,
                  seqs_per_microbatch=seqs_per_device,
                  tokens_per_seq=tokens_per_seq,
                  redundant_slots_per_device=bench.redundant_slots_per_device,
                  reference_forward=True)
  methods = {}
  for method, planned in extras['planned'].items():
    mp = simulate.MethodPlan(planned.plan, planned.transfer, planned.capacity,
                             extras['static_capacity'], planned.reverted,
                             planned.plan_s)
    pred = simulate.time_step(mp, extras['loads_MLDE'], model, work, profile,
                              'padded')
    meas = measured['methods'][method]
    methods[method] = dict(
        predicted_update_s=pred['update_s'], measured_update_s=meas['update_s'],
        rel_error_update=pred['update_s'] / meas['update_s'] - 1.0,
        predicted_recompute_s=pred['recompute_s'],
        measured_recompute_s=meas['recompute_s'],
        rel_error_recompute=pred['recompute_s'] / meas['recompute_s'] - 1.0,
        predicted_exposed_transfer_s=pred['transfer_exposed_s'],
        measured_exposed_transfer_s=meas['exposed_transfer_s'],
        capacity=planned.capacity)
  pred_su = (methods['static']['predicted_update_s']
             / methods['foremoe']['predicted_update_s'])
  return dict(
      bench=dataclasses.asdict(bench), profile=describe(profile),
      calibration=raw, methods=methods,
      max_rel_error_update=max(abs(m['rel_error_update'])
                               for m in methods.values()),
      predicted_speedup_update_vs_static=pred_su,
      measured_speedup_update_vs_static=measured['speedup_update_vs_static'])
