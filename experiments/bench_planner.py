"""Planner benchmark: ForeMoE vs static / EPLB-step / EPLB-microstep, MILP gap.

  python -m experiments.bench_planner --json [--plot_dir=/tmp/planner_plots]

Four configurations (E=64 D=8 top-2; E=128 D=8 top-8; E=128 and E=256 on
64 devices in 8 nodes, top-8), each with 2 redundant slots per device, on
synthetic Qwen3-like traces (foremoe_jax.foresight.traces); see
foremoe_jax.planner.evaluate for what is measured. Intentionally kept short:
the logic lives in the library. The last line printed is the JSON result.
"""
import dataclasses
import json

from absl import app, flags

from foremoe_jax.planner import evaluate
from foremoe_jax.planner.foremoe import ForeMoEConfig
from foremoe_jax.planner.topology import CostModel
from foremoe_jax.utils.run_info import print_run_info

_JSON = flags.DEFINE_bool('json', False, 'Print only the setup and one JSON line.')
_LAYERS = flags.DEFINE_integer('layers', 16, 'MoE layers planned together '
                               '(per-layer latency is about flat in this).')
_PLOT_DIR = flags.DEFINE_string('plot_dir', None, 'Write a PNG of max/mean '
                                'per micro-step here.')
_NO_MILP = flags.DEFINE_bool('no_milp', False, 'Skip the MILP gap.')


def main(argv):
  del argv
  configs = evaluate.default_configs(num_layers=_LAYERS.value)
  cost, config = CostModel(), ForeMoEConfig()
  print_run_info({'bench': 'planner', 'uses_jax': False,
                  'configs': [dataclasses.asdict(c) for c in configs],
                  'cost_model': dataclasses.asdict(cost),
                  'foremoe': dataclasses.asdict(config)})
  result, series = evaluate.run_benchmark(configs, cost, config,
                                          with_milp=not _NO_MILP.value)
  if _PLOT_DIR.value:
    from foremoe_jax.planner import plots  # pylint: disable=g-import-not-at-top
    print('# plot: ' + plots.plot_max_over_mean(series, _PLOT_DIR.value))
  if not _JSON.value:
    for c in result['configs']:
      for method, m in c['methods'].items():
        print(f"{c['name']:>18} {method:>15}: "
              + ' '.join(f'{k}={v:.4g}' for k, v in m.items()))
  print(json.dumps(result))


if __name__ == '__main__':
  app.run(main)
