"""Benchmark library (planner.evaluate, planner.plots) end to end, tiny."""
import json
import os
import subprocess
import sys

from foremoe_jax.planner import evaluate, plots

import planner_testlib as lib


def test_run_benchmark_reports_every_method(tmp_path):
  configs = [evaluate.BenchConfig('tiny', 32, 4, num_layers=2, num_microsteps=3,
                                  num_steps=2, tokens_per_seq=512)]
  result, series = evaluate.run_benchmark(configs, lib.COST, with_milp=False)
  json.dumps(result)  # JSON-able.
  (config,) = result['configs']
  assert config['experts'] == 32 and config['devices'] == 8
  assert set(config['methods']) == set(evaluate.METHODS)
  for m in config['methods'].values():
    for key in ('mean_max_over_mean', 'p95_max_over_mean',
                'bytes_moved_per_microstep', 'moves_per_device_per_microstep',
                'latency_ms_per_layer', 'latency_ms_per_step'):
      assert key in m
  assert config['methods']['static']['moves_per_device_per_microstep'] == 0
  path = plots.plot_max_over_mean(series, str(tmp_path))
  assert os.path.getsize(path) > 1000


def test_planner_does_not_import_jax():
  code = ('import sys, foremoe_jax.planner, foremoe_jax.planner.evaluate; '
          'print("jax" in sys.modules)')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True,
                       text=True, check=True)
  assert out.stdout.strip() == 'False'
