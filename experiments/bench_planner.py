"""Planner benchmark: ForeMoE vs static / EPLB-step / EPLB-microstep, MILP gap.

ForeMoE is scored twice: on its own ('foremoe'), and as training runs it
('foremoe_constrained': the trainer's StepPlanner kwargs, from the home
layout every step, fitted to the transfer budget; `constraint_cost` is the
difference). The budget is the trainer's default, one fill / flush round
per EP device and 2 rounds between micro-steps (configs/tiny.py's 8 and 2
on 8 devices), unless --transfer_step_rounds / --transfer_microstep_rounds
set it as a config's `transfer` section would.

  python -m experiments.bench_planner --json [--plot_dir=/tmp/planner_plots]

Configurations, each with 2 and with 1 redundant slot per device (names end
in _r2 / _r1): four on synthetic Qwen3-like traces (E=64 D=8 top-2; E=128
D=8 top-8; E=128 and E=256 on 64 devices in 8 nodes, top-8;
foremoe_jax.foresight.traces) and, with --sampled_traces (default), two on
traces recorded from the repository's own sampler (E=64 top-2 and E=128
top-8 on D=8; foremoe_jax.foresight.sampled_traces). Those are read from
--trace_dir (results/traces/sampler_*.npz, committed) and generated there
(jax, a few minutes on CPU) when missing, made from another config, or
with --regenerate_traces:

  python -m experiments.bench_planner --regenerate_traces --json

See foremoe_jax.planner.evaluate for what is measured. Intentionally kept
short: the logic lives in the libraries. The last line printed is the JSON
result.
"""
import dataclasses
import os

# Only trace generation uses jax; entry points set the simulated devices
# before anything imports it.
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

from absl import app, flags  # pylint: disable=g-import-not-at-top

from experiments import common  # pylint: disable=g-import-not-at-top
from foremoe_jax.foresight import sampled_traces  # pylint: disable=g-import-not-at-top
from foremoe_jax.planner import evaluate  # pylint: disable=g-import-not-at-top
from foremoe_jax.planner.foremoe import ForeMoEConfig  # pylint: disable=g-import-not-at-top
from foremoe_jax.planner.topology import CostModel  # pylint: disable=g-import-not-at-top
from foremoe_jax.utils.run_info import print_run_info  # pylint: disable=g-import-not-at-top

_JSON = flags.DEFINE_bool('json', False, 'Print only the setup and one JSON line.')
_LAYERS = flags.DEFINE_integer('layers', 16, 'MoE layers of the synthetic '
                               'configs, planned together (per-layer latency '
                               'is about flat in this).')
_PLOT_DIR = flags.DEFINE_string('plot_dir', None, 'Write a PNG of max/mean '
                                'per micro-step here.')
_NO_MILP = flags.DEFINE_bool('no_milp', False, 'Skip the MILP gap.')
_SAMPLED = flags.DEFINE_bool('sampled_traces', True, 'Also run the configs '
                             'on traces recorded from the sampler.')
_TRACE_DIR = flags.DEFINE_string('trace_dir', 'results/traces', 'Where the '
                                 'sampled traces are cached.')
_REGENERATE = flags.DEFINE_bool('regenerate_traces', False, 'Regenerate the '
                                'sampled traces even if cached.')
_STEP_ROUNDS = flags.DEFINE_integer(
    'transfer_step_rounds', None, 'Fill / flush rounds of the constrained '
    'ForeMoE (default: the trainer\'s, one per EP device).')
_MICRO_ROUNDS = flags.DEFINE_integer(
    'transfer_microstep_rounds', None, 'Rounds between micro-steps of the '
    'constrained ForeMoE (default: the trainer\'s, 2).')


def main(argv):
  del argv
  configs = evaluate.default_configs(num_layers=_LAYERS.value)
  traces_by_source, trace_info = {}, []
  if _SAMPLED.value:
    for tc in sampled_traces.default_sampled_configs():
      trace, generated = sampled_traces.load_or_generate(
          tc, _TRACE_DIR.value, _REGENERATE.value)
      traces_by_source[tc.source] = trace
      trace_info.append({'source': tc.source, 'generated_now': generated,
                         'path': sampled_traces.trace_path(tc, _TRACE_DIR.value),
                         'meta': trace.meta})
    configs += evaluate.sampled_configs(traces_by_source)
  configs = [dataclasses.replace(
      c, transfer_step_rounds=_STEP_ROUNDS.value,
      transfer_microstep_rounds=_MICRO_ROUNDS.value) for c in configs]
  cost, config = CostModel(), ForeMoEConfig()
  run = print_run_info({'bench': 'planner',
                        'uses_jax': any(t['generated_now'] for t in trace_info),
                        'configs': [dataclasses.asdict(c) for c in configs],
                        'sampled_traces': trace_info,
                        'cost_model': dataclasses.asdict(cost),
                        'foremoe': dataclasses.asdict(config)})
  result, series = evaluate.run_benchmark(configs, cost, config,
                                          with_milp=not _NO_MILP.value,
                                          traces_by_source=traces_by_source)
  if _PLOT_DIR.value:
    from foremoe_jax.planner import plots  # pylint: disable=g-import-not-at-top
    print('# plot: ' + plots.plot_max_over_mean(series, _PLOT_DIR.value))
  if not _JSON.value:
    for c in result['configs']:
      for method, m in c['methods'].items():
        print(f"{c['name']:>26} {method:>15}: "
              + ' '.join(f'{k}={v:.4g}' for k, v in m.items()))
  common.finish('bench_planner', run, result)


if __name__ == '__main__':
  app.run(main)
