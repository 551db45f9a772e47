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

With --alt_traces (default), the same methods also run on traces of another
family than the one the planner was tuned on
(foremoe_jax.foresight.alt_traces: Zipf popularity per layer, exponent s in
{0.6, 1.0, 1.4}; Dirichlet routing per sequence around it, concentration c
in {0.3, 3, 30}; exact top-k per token), at 2,048 tokens per device and
micro-step on E=64 D=8 top-2, E=128 D=8 / D=16 / E=256 D=32 top-8 (8
devices per node), 4 layers, 3 RL steps (one warm-up), 4 micro-steps
(--alt_layers, --alt_steps, --alt_microsteps): 72 rows named like
alt_zipf1.0_c3_E128_D16_top8_r1, under 'alt_configs' in the JSON, each
checked against ForeMoE targets 1.08 (one redundant slot per device) and
1.03 (two), summarised in 'alt_all_targets_met'. --only_alt runs just
those (no MILP, no sampled traces):

  python -m experiments.bench_planner --json --only_alt --results_dir=

See foremoe_jax.planner.evaluate for what is measured. Intentionally kept
short: the logic lives in the libraries. The last line printed is the JSON
result.
"""
import dataclasses
import os
import time

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
                                'per micro-step here (the alt configs: '
                                'planner_alt_max_over_mean.png).')
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
_ALT = flags.DEFINE_bool('alt_traces', True, 'Also run the alt configs: '
                         'traces of another family (Zipf + Dirichlet, '
                         'foremoe_jax.foresight.alt_traces).')
_ONLY_ALT = flags.DEFINE_bool('only_alt', False, 'Run only the alt configs '
                              '(no synthetic / sampled configs, no MILP).')
_ALT_LAYERS = flags.DEFINE_integer('alt_layers', 4, 'Layers of the alt '
                                   'traces.')
_ALT_STEPS = flags.DEFINE_integer('alt_steps', 3, 'RL steps of the alt '
                                  'traces (the first is a warm-up).')
_ALT_MICROSTEPS = flags.DEFINE_integer('alt_microsteps', 4, 'Micro-steps per '
                                       'RL step of the alt traces.')
_ALT_TOKENS = flags.DEFINE_integer('alt_tokens_per_device', 2048, 'Tokens '
                                   'per device and micro-step of the alt '
                                   'traces.')
_MICRO_ROUNDS = flags.DEFINE_integer(
    'transfer_microstep_rounds', None, 'Rounds between micro-steps of the '
    'constrained ForeMoE (default: the trainer\'s, 2).')


def main(argv):
  del argv
  only_alt = _ONLY_ALT.value
  configs = ([] if only_alt
             else evaluate.default_configs(num_layers=_LAYERS.value))
  traces_by_source, trace_info = {}, []
  if _SAMPLED.value and not only_alt:
    for tc in sampled_traces.default_sampled_configs():
      trace, generated = sampled_traces.load_or_generate(
          tc, _TRACE_DIR.value, _REGENERATE.value)
      traces_by_source[tc.source] = trace
      trace_info.append({'source': tc.source, 'generated_now': generated,
                         'path': sampled_traces.trace_path(tc, _TRACE_DIR.value),
                         'meta': trace.meta})
    configs += evaluate.sampled_configs(traces_by_source)
  alt_trace_configs, alt_configs = {}, []
  if _ALT.value or only_alt:
    alt_trace_configs = evaluate.alt_trace_configs(
        num_layers=_ALT_LAYERS.value, num_microsteps=_ALT_MICROSTEPS.value,
        num_steps=_ALT_STEPS.value, tokens_per_device=_ALT_TOKENS.value)
    alt_configs = evaluate.alt_configs(alt_trace_configs)
  budgeted = lambda cs: [dataclasses.replace(
      c, transfer_step_rounds=_STEP_ROUNDS.value,
      transfer_microstep_rounds=_MICRO_ROUNDS.value) for c in cs]
  configs, alt_configs = budgeted(configs), budgeted(alt_configs)
  cost, config = CostModel(), ForeMoEConfig()
  run = print_run_info({'bench': 'planner',
                        'uses_jax': any(t['generated_now'] for t in trace_info),
                        'configs': [dataclasses.asdict(c) for c in configs],
                        'sampled_traces': trace_info,
                        'alt_configs': [dataclasses.asdict(c)
                                        for c in alt_configs],
                        'alt_traces': {k: dataclasses.asdict(v) for k, v in
                                       alt_trace_configs.items()},
                        'cost_model': dataclasses.asdict(cost),
                        'foremoe': dataclasses.asdict(config)})
  result, series = {}, {}
  if configs:
    result, series = evaluate.run_benchmark(
        configs, cost, config, with_milp=not _NO_MILP.value,
        traces_by_source=traces_by_source)
  if alt_configs:
    t0 = time.perf_counter()
    alt_by_source = evaluate.alt_traces_by_source(alt_trace_configs)
    generate_s = time.perf_counter() - t0
    alt_result, alt_series = evaluate.run_alt_benchmark(
        alt_configs, cost, config, alt_by_source)
    alt_result['alt_trace_generation_s'] = generate_s
    alt_result['alt_total_s'] = time.perf_counter() - t0
    result.update(alt_result)
  if _PLOT_DIR.value:
    from foremoe_jax.planner import plots  # pylint: disable=g-import-not-at-top
    if series:
      print('# plot: ' + plots.plot_max_over_mean(series, _PLOT_DIR.value))
    if alt_configs:  # A file of their own (72 panels).
      os.makedirs(_PLOT_DIR.value, exist_ok=True)
      print('# plot: ' + plots.plot_max_over_mean(alt_series, os.path.join(
          _PLOT_DIR.value, 'planner_alt_max_over_mean.png')))
  if not _JSON.value:
    for c in result.get('configs', []) + result.get('alt_configs', []):
      for method, m in c['methods'].items():
        print(f"{c['name']:>36} {method:>19}: "
              + ' '.join(f'{k}={v:.4g}' for k, v in m.items()))
  common.finish('bench_planner', run, result)


if __name__ == '__main__':
  app.run(main)
