"""Benchmark library (planner.evaluate, planner.plots) end to end, tiny."""
import dataclasses
import glob
import json
import os
import subprocess
import sys
import types

import ml_collections
import numpy as np
import pytest

from foremoe_jax.foresight import sampled_traces, traces
from foremoe_jax.planner import evaluate, plots

import planner_testlib as lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
TINY = evaluate.BenchConfig('tiny', 32, 4, num_layers=2, num_microsteps=3,
                            num_steps=2, tokens_per_seq=512)


def test_run_benchmark_reports_every_method(tmp_path):
  configs = [TINY, dataclasses.replace(TINY, name='tiny_r1',
                                       redundant_slots_per_device=1)]
  result, series = evaluate.run_benchmark(configs, lib.COST, with_milp=False)
  json.dumps(result)  # JSON-able.
  two, one = result['configs']
  for config, r, target in ((two, 2, 1.05), (one, 1, 1.08)):
    assert config['experts'] == 32 and config['devices'] == 8
    assert config['trace'] == 'synthetic'
    assert config['redundant_slots_per_device'] == r
    assert config['slots_per_device'] == 32 // 8 + r
    assert config['target_max_over_mean'] == target
    assert config['meets_target'] == (
        config['methods']['foremoe']['mean_max_over_mean'] <= target)
    assert set(config['methods']) == set(evaluate.METHODS)
    for m in config['methods'].values():
      for key in ('mean_max_over_mean', 'p95_max_over_mean',
                  'bytes_moved_per_microstep',
                  'copies_per_device_per_microstep_all_layers',
                  'copies_per_device_per_microstep_per_layer',
                  'latency_ms_per_layer', 'latency_ms_per_step',
                  'latency_vs_eplb_microstep'):
        assert key in m
      np.testing.assert_allclose(
          m['latency_vs_eplb_microstep'],
          m['latency_ms_per_step']
          / config['methods']['eplb_microstep']['latency_ms_per_step'])
      np.testing.assert_allclose(
          m['copies_per_device_per_microstep_per_layer'] * 2,
          m['copies_per_device_per_microstep_all_layers'])
    assert config['methods']['eplb_microstep']['latency_vs_eplb_microstep'] == 1
    assert config['methods']['static'][
        'copies_per_device_per_microstep_all_layers'] == 0
  assert result['all_targets_met'] == (two['meets_target']
                                       and one['meets_target'])
  path = plots.plot_max_over_mean(series, str(tmp_path))
  assert os.path.getsize(path) > 1000


def test_copies_summed_over_layers_equal_a_count_of_new_experts():
  """Independent count: per device, experts in a micro-step's slots that
  the device did not hold one micro-step earlier (micro-step 0: the
  previous RL step's last), summed over layers."""
  bc = dataclasses.replace(TINY, num_layers=3, num_microsteps=4, num_steps=3,
                           redundant_slots_per_device=1)
  topo = bc.topology()
  runs = evaluate.run_methods(evaluate.config_trace(bc), topo, lib.COST)
  for method in ('eplb_step', 'eplb_microstep', 'foremoe'):
    plans, seconds = runs[method]
    se = [p.placement.slot_expert for p in plans]  # [M, L, S] per step.
    counts = []
    for r in range(1, len(plans)):  # Step 0 is the unscored warm-up.
      for m in range(bc.num_microsteps):
        prev_LS = se[r][m - 1] if m else se[r - 1][-1]
        for d in range(topo.num_devices):
          held = slice(d * topo.slots_per_device,
                       (d + 1) * topo.slots_per_device)
          counts.append(sum(len(set(se[r][m][l, held]) - set(prev_LS[l, held]))
                            for l in range(bc.num_layers)))
    got = evaluate.method_metrics(plans, seconds)
    np.testing.assert_allclose(
        got['copies_per_device_per_microstep_all_layers'], np.mean(counts))


def test_configs_have_one_and_two_redundant_slots_and_unique_names():
  configs = evaluate.default_configs(num_layers=2)
  names = [c.name for c in configs]
  assert len(set(names)) == len(names) == 8
  for c in configs:
    r = c.redundant_slots_per_device
    assert c.name.endswith(f'_r{r}') and r in (1, 2)
    assert c.topology().slots_per_device == c.num_experts // c.num_devices + r
  assert {c.redundant_slots_per_device for c in configs} == {1, 2}
  e128 = [c for c in configs if c.name == 'E128_D8_top8_r1'][0]
  assert e128.topology().slots_per_device == 128 // 8 + 1  # 12.5% redundancy.
  with pytest.raises(ValueError, match='unique'):
    evaluate.run_benchmark([TINY, TINY], lib.COST, with_milp=False)


def test_sampled_configs_scale_and_name_their_trace():
  trace = lib.small_trace(num_steps=2, num_layers=2, num_microsteps=3,
                          tokens_per_seq=64)
  trace = traces.Trace(trace.loads_RMLDE, {**trace.meta, 'top_k': 4})
  configs = evaluate.sampled_configs({'sampler:t': trace},
                                     tokens_per_device=2048)
  assert [c.redundant_slots_per_device for c in configs] == [2, 1]
  have = trace.loads_RMLDE.sum(axis=(3, 4)).mean() / 4 / 8
  for c in configs:
    assert c.trace == 'sampler:t' and c.load_scale == round(2048 / have)
  summary, _ = evaluate.run_config(configs[1], lib.COST, trace=trace)
  assert summary['trace'] == 'sampler:t'
  assert summary['slots_per_device'] == 32 // 8 + 1
  np.testing.assert_allclose(summary['tokens_per_device_per_microstep'],
                             have * configs[1].load_scale)
  with pytest.raises(ValueError, match='not supplied'):
    evaluate.run_config(configs[0], lib.COST)


@pytest.mark.parametrize('cfg', sampled_traces.default_sampled_configs(),
                         ids=lambda c: c.name)
def test_committed_sampled_traces(cfg):
  """The committed traces: small, made from the current config, and every
  (step, micro-step, layer) dispatches tokens * top_k assignments."""
  path = sampled_traces.trace_path(cfg, os.path.join(REPO, 'results',
                                                     'traces'))
  assert os.path.getsize(path) < 2 << 20
  trace, generated = sampled_traces.load_or_generate(
      cfg, os.path.dirname(path))
  assert not generated  # Cached and up to date: nothing was sampled.
  assert trace.meta['source'] == f'sampler:{cfg.name}'
  assert trace.loads_RMLDE.shape == (cfg.num_steps, cfg.num_microsteps,
                                     cfg.num_layers, cfg.d_ep, cfg.num_experts)
  tokens_RM = np.asarray(trace.meta['tokens_RM'])
  np.testing.assert_array_equal(trace.loads_RMLDE.sum(axis=(3, 4)),
                                (tokens_RM * cfg.top_k)[:, :, None]
                                .repeat(cfg.num_layers, 2))


def test_sampled_trace_equals_the_trainers_foresight():
  """generate_trace's loads are what rl.trainer's compose + foresight
  phases compute from the same rollouts."""
  from foremoe_jax.rl import trainer  # pylint: disable=g-import-not-at-top
  cfg = sampled_traces.SampledTraceConfig(
      'tiny', 16, 2, num_layers=1, prompts_per_step=8, num_generations=4,
      num_microsteps=2, num_steps=2, seed=3)
  trace, rollouts = sampled_traces.generate_trace(cfg, keep_rollouts=True)
  config = ml_collections.ConfigDict({
      'seed': cfg.seed,
      'parallel': {'num_data': cfg.d_data, 'num_expert': cfg.d_ep},
      'rl': {'num_microbatches': cfg.num_microsteps,
             'balance_microbatches': False}})
  ctx = types.SimpleNamespace(config=config, num_experts=cfg.num_experts)
  for step, ro in enumerate(rollouts):
    want = trainer.planner_loads(
        trainer.foresight(ctx, ro, trainer.compose(ctx, ro, step)))
    np.testing.assert_array_equal(trace.step(step), want)
  assert trace.loads_RMLDE.sum() > 0


def test_planner_does_not_import_jax():
  code = ('import sys, foremoe_jax.planner, foremoe_jax.planner.evaluate, '
          'foremoe_jax.foresight.sampled_traces; print("jax" in sys.modules)')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True,
                       text=True, check=True, cwd=REPO)
  assert out.stdout.strip() == 'False'
