"""ForeMoE at 8-256 devices on real model shapes, predicted and validated.

  python -m experiments.simulate_cluster --json

Stages, each logged (unless --json):
  1. validation: calibrate a profile of this machine, run bench_rl_step on 8
     simulated CPU devices, predict its update times from the benchmark's
     own plans with the measured profile, and report the error per method;
  2. the grid: models x device counts x methods on each hardware profile
     (foremoe_jax/sim), with the repository's planner timed on this host;
  3. outputs: results/simulate_cluster.json (run info, summary, validation,
     every row) and PNG plots in --out_dir (default: beside the JSON);
     `python -m experiments.render_results` turns them into README tables.
The last line printed is one JSON object: `validation` (with
`max_rel_error_update` and `max_rel_error_recompute`),
`speedup_64gpu_foremoe_vs_static`, `speedup_64gpu_foremoe_vs_eplb_step`,
`speedup_64gpu_foremoe_vs_foresight_split` and
`peak_bytes_per_device_64gpu` (Qwen3-30B-A3B, 64 H100s, the default
dispatch named in `dispatch_64gpu`; the `_padded` keys are the padded-cell
layer) beside the paper's 1.45x, and the assumptions that drive them.
"""
import dataclasses
import json
import os
import time

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

from absl import app, flags, logging  # pylint: disable=g-import-not-at-top

from experiments import common  # pylint: disable=g-import-not-at-top
from foremoe_jax.sim import cluster, hardware, plots, simulate  # pylint: disable=g-import-not-at-top
from foremoe_jax.utils import results  # pylint: disable=g-import-not-at-top
from foremoe_jax.utils.run_info import print_run_info  # pylint: disable=g-import-not-at-top

_JSON = flags.DEFINE_bool('json', False, 'Print only setup + one JSON line '
                          '(progress on stderr).')
_MODELS = flags.DEFINE_list('models', list(cluster.MODELS), 'Model shapes.')
_DEVICES = flags.DEFINE_list('devices', [str(d) for d in cluster.DEVICE_COUNTS],
                             'Device counts.')
_PROFILES = flags.DEFINE_list('profiles', ['h100', 'h800', 'tpu_v5p'],
                              'Hardware profiles; the first one plans.')
_METHODS = flags.DEFINE_list(
    'methods', list(simulate.METHODS) + list(simulate.ABLATIONS),
    'Methods (foremoe_before_fixes: ForeMoE as it planned before the '
    'simulator: weight copies priced alone, rounds ignored; '
    'foremoe_compute_anchor: its anchor packs replicas on compute rows '
    'alone, blind to the per-node demand).')
_VALIDATE = flags.DEFINE_bool('validate', True,
                              'Run the CPU validation (about 4 minutes).')
_GRID = flags.DEFINE_bool('grid', True, 'Run the scale-out grid (off: the '
                          'validation alone).')
_REPEATS = flags.DEFINE_integer('validation_repeats', 3,
                                'bench_rl_step repetitions for validation.')
_CACHE = flags.DEFINE_string(
    'validation_cache', '', 'A file for the validation\'s measurements: '
    'written after measuring, read instead of measuring when it exists (for '
    'the same bench), to redo the fit without the runs.')
_MICRO = flags.DEFINE_integer('microsteps', 8, 'Micro-steps per RL step.')
_SEQS = flags.DEFINE_integer('seqs_per_microbatch', 2,
                             'Sequences per device and micro-step.')
_TOKENS = flags.DEFINE_integer('tokens_per_seq', 4096, 'Tokens per sequence.')
_REDUNDANT = flags.DEFINE_integer('redundant_slots', 2,
                                  'Redundant expert slots per device.')
_STEP_TOKENS = flags.DEFINE_bool(
    'balance_step_tokens', True, 'Choose each step\'s micro-steps for even '
    'device token counts as well as their layout (the trainer\'s '
    'rl.balance_step_tokens); off: only the layout within each micro-step '
    '(rl.balance_device_tokens).')
_TRACE = flags.DEFINE_string(
    'trace', None, 'A recorded load trace (.npz of foresight.traces) used '
    'instead of the synthetic one where its [M, L, D, E] fits a model and EP '
    'group.')
_TRANSFER = flags.DEFINE_enum(
    'transfer_mode', 'exact', ['exact', 'rounds'], 'How expert moves travel: '
    'exact (one ragged all-to-all of the experts that move, the default) or '
    'rounds (cyclic-shift ppermute rounds, the first engine).')
_WORKERS = flags.DEFINE_integer(
    'planner_workers', 1, 'Planner processes planning chunks of layers side '
    'by side (the trainer\'s planner.workers); 1: one thread. Plan times are '
    'measured with them on this host.')
_PREFILL = flags.DEFINE_bool(
    'prefill', True, 'The recompute fills the update\'s slots under its '
    'forward (the trainer\'s transfer.prefill); off: the update opens with '
    'the whole fill.')
_OUT = flags.DEFINE_string('out_dir', '', 'Where the PNGs go; empty: '
                           '<results_dir>/simulate_cluster (none when '
                           '--results_dir is empty too).')

PAPER_SPEEDUP_64GPU = 1.45  # ForeMoE's reported best, 64 GPUs.


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  work_kwargs = dict(num_microsteps=_MICRO.value,
                     seqs_per_microbatch=_SEQS.value,
                     tokens_per_seq=_TOKENS.value,
                     redundant_slots_per_device=_REDUNDANT.value,
                     balance_step_tokens=_STEP_TOKENS.value)
  profiles = tuple(hardware.get_profile(p) for p in _PROFILES.value)
  devices = tuple(int(d) for d in _DEVICES.value)
  run = print_run_info({'experiment': 'simulate_cluster', 'models': _MODELS.value,
                        'device_counts': devices,
                        'profiles': _PROFILES.value,
                        'methods': _METHODS.value, 'workload': work_kwargs,
                        'transfer_mode': _TRANSFER.value,
                        'planner_workers': _WORKERS.value,
                        'prefill': _PREFILL.value,
                        'validate': _VALIDATE.value})
  log = common.progress(_JSON.value)
  t0 = time.perf_counter()
  validation = None
  if _VALIDATE.value:
    from foremoe_jax.benchmarks import rl_step  # pylint: disable=g-import-not-at-top
    from foremoe_jax.sim import validate  # pylint: disable=g-import-not-at-top
    validation = validate.validate(rl_step.RLStepBench(repeats=_REPEATS.value),
                                   log=log, cache=_CACHE.value or None)
    log('validation: ' + ', '.join(
        f"{m} predicted {v['predicted_update_s']:.3f}s measured "
        f"{v['measured_update_s']:.3f}s ({100 * v['rel_error_update']:+.1f}%)"
        for m, v in validation['methods'].items()))
  trace = None
  if _TRACE.value:
    from foremoe_jax.foresight import traces  # pylint: disable=g-import-not-at-top
    trace = traces.load_trace(_TRACE.value)
  rows, pngs = [], []
  if _GRID.value:
    rows = cluster.run_grid(_MODELS.value, devices, profiles, _METHODS.value,
                            work_kwargs=work_kwargs, trace=trace,
                            transfer_mode=_TRANSFER.value,
                            planner_workers=_WORKERS.value,
                            prefill=_PREFILL.value, log=log)
    out_dir = common.plot_dir(_OUT.value, 'simulate_cluster')
    if out_dir:
      pngs = plots.write_plots(rows, out_dir, profiles[0].name)
  for r in rows:
    if r['mode'] == 'exact' and r['profile'] == profiles[0].name:
      log(f"{r['model']:>17} {r['devices']:>4} {r['method']:>14}: step "
          f"{r['step_s']:8.3f}s update {r['update_s']:8.3f}s "
          f"x{r.get('speedup_step_vs_static', float('nan')):.3f} vs static "
          f"x{r.get('speedup_step_vs_eplb_step', float('nan')):.3f} vs EPLB")
  summary = {
      'validation': None if validation is None else {
          'max_rel_error_update': validation['max_rel_error_update'],
          'max_rel_error_recompute': validation['max_rel_error_recompute'],
          'per_method': {m: v['rel_error_update']
                         for m, v in validation['methods'].items()},
          'per_method_recompute': {m: v['rel_error_recompute']
                                   for m, v in validation['methods'].items()},
          'predicted_speedup_update_vs_static':
              validation['predicted_speedup_update_vs_static'],
          'measured_speedup_update_vs_static':
              validation['measured_speedup_update_vs_static']},
      **cluster.headline(rows, profile=profiles[0].name),
      **cluster.transfer_summary(rows),
      **cluster.planning_summary(rows),
      'paper_speedup_64gpu': PAPER_SPEEDUP_64GPU,
      'assumptions': {
          'profile': hardware.describe(profiles[0]),
          'workload': cluster.workload_description(work_kwargs),
          'rollout': 'excluded (the same for every method)',
          'recompute': 'the forwards the step needs (workload '
                       'recompute_forward_passes), on each method\'s '
                       'step-level placement',
          'memory': 'foremoe_jax/sim/memory.py (checked against XLA by '
                    'experiments.memory_report)',
          'trace': 'synthetic, hottest expert per layer calibrated to public '
                   'routing statistics (foremoe_jax/sim/workload.HOT_SHARE)',
          'planner_time': (f'measured on this host ({os.cpu_count()} '
                           f'cores), {_WORKERS.value} planner process(es)'
                           if _WORKERS.value > 1 else
                           'measured on this host, one thread'),
          'skipped': {m: f'EP groups above {d} devices (planning takes '
                         f'minutes per step)'
                      for m, d in cluster.SKIP_ABOVE.items()},
      },
      'plots': pngs,
      'seconds': time.perf_counter() - t0,
  }
  # Every row goes to the file; the printed line is the summary alone.
  path = results.save('simulate_cluster', run,
                      {'summary': summary, 'validation': validation,
                       'rows': rows}, results_dir=common.RESULTS_DIR.value)
  if path:
    print(f'# saved: {path}')
  print(json.dumps(summary, default=float))

if __name__ == '__main__':
  app.run(main)
