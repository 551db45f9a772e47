"""The benchmark's alt configurations (traces of another family than the
planner was tuned on, foresight.alt_traces) build and run end to end, tiny."""
import json
import os
import subprocess
import sys

import numpy as np

from foremoe_jax.planner import evaluate

import planner_testlib as lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


def test_alt_configs_name_shape_and_targets():
  trace_configs = evaluate.alt_trace_configs()
  configs = evaluate.alt_configs(trace_configs)
  names = [c.name for c in configs]
  assert len(set(names)) == len(names) == 4 * 3 * 3 * 2
  by_name = {c.name: c for c in configs}
  c = by_name['alt_zipf1.0_c3_E128_D16_top8_r1']
  assert (c.num_experts, c.top_k, c.num_devices, c.num_nodes) == (128, 8, 16, 2)
  assert c.topology().slots_per_device == 128 // 16 + 1
  assert c.trace == 'alt:zipf1.0_c3_E128_D16_top8'
  tc = trace_configs[c.trace]
  assert (tc.zipf_exponent, tc.concentration, tc.tokens_per_device) == (
      1.0, 3.0, 2048)
  assert by_name['alt_zipf0.6_c0.3_E256_D32_top8_r2'].num_nodes == 4
  assert by_name['alt_zipf1.4_c30_E64_D8_top2_r2'].top_k == 2
  assert evaluate.alt_target_max_over_mean(1) == 1.08
  assert evaluate.alt_target_max_over_mean(2) == 1.03


def test_run_alt_benchmark_tiny():
  shapes = (('E32_D8_top4', 32, 4, 8), ('E32_D16_top2', 32, 2, 16))
  trace_configs = evaluate.alt_trace_configs(
      num_layers=2, num_microsteps=2, num_steps=2, tokens_per_device=256,
      shapes=shapes, zipf_exponents=(1.0,), concentrations=(0.3, 30.0))
  configs = evaluate.alt_configs(trace_configs)
  traces_by_source = evaluate.alt_traces_by_source(trace_configs)
  result, series = evaluate.run_alt_benchmark(configs, lib.COST,
                                              evaluate.foremoe.ForeMoEConfig(),
                                              traces_by_source)
  json.dumps(result)
  rows = result['alt_configs']
  assert [r['name'] for r in rows] == [c.name for c in configs]
  assert set(series) == {c.name for c in configs}
  for row, bc in zip(rows, configs):
    assert set(row['methods']) == set(evaluate.METHODS)
    target = {1: 1.08, 2: 1.03}[bc.redundant_slots_per_device]
    assert row['target_max_over_mean'] == target
    for key, method in (('meets_target', 'foremoe'),
                        ('meets_target_constrained', evaluate.CONSTRAINED)):
      assert row[key] == (
          row['methods'][method]['mean_max_over_mean'] <= target)
    assert row['trace'] == bc.trace and row['nodes'] == bc.num_devices // 8
    np.testing.assert_allclose(row['tokens_per_device_per_microstep'], 256)
    assert row['zipf_exponent'] == 1.0 and row['concentration'] in (0.3, 30.0)
    assert row['microstep_expert_skew'] > 1
  assert result['alt_all_targets_met'] == all(r['meets_target'] for r in rows)
  assert result['alt_all_targets_met_constrained'] == all(
      r['meets_target_constrained'] for r in rows)


def test_bench_planner_only_alt_runs():
  """experiments.bench_planner --only_alt, tiny: the alt rows alone, no
  other configs, nothing saved."""
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.bench_planner', '--json',
       '--only_alt', '--alt_layers=1', '--alt_steps=2', '--alt_microsteps=1',
       '--alt_tokens_per_device=64', '--results_dir='],
      capture_output=True, text=True, check=True, cwd=REPO)
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert 'configs' not in result and 'milp_gap' not in result
  assert len(result['alt_configs']) == 72
  assert isinstance(result['alt_all_targets_met'], bool)
  row = result['alt_configs'][0]
  assert row['name'] == 'alt_zipf0.6_c0.3_E64_D8_top2_r2'
  assert set(row['methods']) == set(evaluate.METHODS)
