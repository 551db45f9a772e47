"""The soak benchmark: its trend statistics, its probes and a short run."""
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import conftest

from foremoe_jax.benchmarks import soak

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_trend_reads_a_steady_leak_through_noise_and_spikes():
  rng = np.random.default_rng(0)
  n, base, leak = 200, 1e9, 2e5  # 0.02% a step: +3.98% over 199 steps.
  y = base + leak * np.arange(n) + rng.normal(0, 2e6, n)
  y[[50, 120, 180]] += 5e7  # Garbage-collection-like spikes.
  t = soak.trend(y)
  assert t['growth'] == pytest.approx(leak * (n - 1) / base, rel=0.1)
  assert t['kendall_tau'] > 0.5 and t['p_value'] < 1e-6


def test_trend_of_a_flat_series_is_flat_even_with_a_late_spike():
  """Two points (first and last) would call this a 5% leak."""
  rng = np.random.default_rng(1)
  y = 1e9 + rng.normal(0, 2e6, 200)
  y[-1] += 5e7
  t = soak.trend(y)
  assert abs(t['growth']) < 0.002
  assert t['p_value'] > 0.01


def test_trend_matches_the_hand_computed_line():
  t = soak.trend([100.0, 102.0, 104.0, 106.0])
  assert t['slope_per_step'] == pytest.approx(2.0)
  assert t['level'] == pytest.approx(100.0)
  assert t['growth'] == pytest.approx(0.06)
  # 2 a step on a level of 100: +2,000% over 1,000 steps.
  assert soak.growth_per_1k_steps(t) == pytest.approx(20.0)


def test_device_bytes_counts_a_buffer():
  x = jnp.ones((1024, 256), jnp.float32) + 0  # A fresh 1 MiB buffer.
  nbytes, with_x = x.nbytes, soak.device_bytes()
  x.delete()
  assert with_x - soak.device_bytes() == nbytes


def test_short_soak_run_prints_its_growth_and_plot(tmp_path):
  cmd = [sys.executable, '-m', 'experiments.soak', '--steps=8',
         '--warmup_steps=3', '--json', f'--workdir={tmp_path}',
         f'--results_dir={tmp_path}',
         # The programs other tests' runs share (conftest.SHARED_TINY_RUN):
         # one update program for every step (a compile per bucket costs
         # more than the whole short run's steps, and EPLB-step's buckets
         # change step to step).
         *conftest.shared_tiny_run_flags()]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.strip().splitlines()
  assert not any(l.startswith('step ') for l in lines)  # --json: quiet.
  result = json.loads(lines[-1])
  assert len(result['samples']['rss_bytes']) == 8
  assert result['rss_growth'] == result['rss']['growth']
  assert np.isfinite(result['rss_growth'])
  rss = result['rss']
  assert result['rss_growth_per_1k_steps'] == pytest.approx(
      rss['slope_per_step'] * 1000 / rss['level'])
  assert result['target_met'] == (
      rss['p_value'] > 0.01 or result['rss_growth_per_1k_steps'] < 0.005)
  # Device buffers hold the state, the plan and the batch: no more each step.
  assert abs(result['device_bytes_growth']) <= 0.02
  assert os.path.getsize(tmp_path / 'soak.png') > 0
  steps = [json.loads(l)['step'] for l in open(tmp_path / 'metrics.jsonl')]
  assert steps == list(range(1, 9))
  assert json.load(open(tmp_path / 'soak.json'))['result'] == result


def test_kendall_test_of_one_stretch_matches_scipy_with_ties():
  rng = np.random.default_rng(2)
  y = np.round(rng.normal(0, 1, 120) + 0.01 * np.arange(120), 1)  # Ties.
  t = soak.trend(y)
  tau_b, p_value = stats.kendalltau(np.arange(120), y)
  assert t['p_value'] == pytest.approx(p_value, rel=1e-9)
  assert np.sign(t['kendall_tau']) == np.sign(tau_b)
  assert t['segments'] == 1 and t['samples_fitted'] == 120


def test_compile_segments_leave_out_a_compile_until_the_trim_after_it():
  compiles = [0, 0, 1, 0, 0, 0, 0, 0, 0, 0]
  trims = [False] * 10
  trims[4] = True  # A save (and trim) right after sample 4.
  labels = soak.compile_segments(compiles, trims, settle=2)
  # Out: the compile (2) through the trim (4) and 2 samples to settle.
  assert labels.tolist() == [0, 0, -1, -1, -1, -1, -1, 1, 1, 1]
  # No trim after the compile: only the settling samples go.
  assert soak.compile_segments(compiles, [False] * 10, settle=2).tolist() == [
      0, 0, -1, -1, 1, 1, 1, 1, 1, 1]


def test_pooled_slope_ignores_a_level_shift_between_stretches():
  # Slope 1 within each stretch; the jump of 10 between them is no trend.
  t = soak.trend([0., 1., 2., 13., 14., 15.], segments=[0, 0, 0, 1, 1, 1])
  assert t['slope_per_step'] == pytest.approx(1.0)
  assert t['level_shift'] == pytest.approx(10.0)
  assert soak.trend([0., 1., 2., 13., 14., 15.])['slope_per_step'] > 2.0


@pytest.mark.parametrize('leak_per_step', [0.0, 4.5e3])
def test_a_temporary_compile_jump_released_later_is_not_read_as_a_trend(
    leak_per_step):
  """As in the 2,000-step run: a compile raises RSS by 612 MB, of which
  only 120 MB stays; the trim after the next save releases the rest."""
  rng = np.random.default_rng(3)
  n, every, base = 1800, 50, 8e8
  y = base + leak_per_step * np.arange(n) + rng.normal(0, 2e6, n)
  compiles = np.zeros(n, int)
  compiles[269] = 1
  trims = (np.arange(1, n + 1) % every) == 0
  released = np.flatnonzero(trims[269:])[0] + 269 + 1
  y[269:] += 120e6  # The executable, kept.
  y[269:released] += 492e6  # Scratch memory, resident until the trim.
  t = soak.trend(y, soak.compile_segments(compiles, trims))
  assert t['segments'] == 2
  assert t['slope_per_step'] == pytest.approx(leak_per_step, abs=300.0)
  assert t['level_shift'] == pytest.approx(120e6, rel=0.02)
  if leak_per_step == 0:
    assert abs(soak.growth_per_1k_steps(t)) < 5e-4
    assert t['p_value'] > 0.01
  else:
    assert soak.growth_per_1k_steps(t) == pytest.approx(
        leak_per_step * 1000 / base, rel=0.1)
    assert t['p_value'] < 1e-6
