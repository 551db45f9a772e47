"""Metrics log: JSON-lines round trip, crash safety, resume, and plots."""
import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

from foremoe_jax.utils.metrics import MetricsWriter, plot_metrics, read_metrics
from foremoe_jax.utils.metrics import _phase_boundaries
from foremoe_jax.utils import metrics

PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'


def test_roundtrip_converts_numpy_and_jax(tmp_path):
  with MetricsWriter(str(tmp_path)) as w:
    w.write(np.int64(3), {'loss': np.float32(0.5), 'kl': jnp.float32(0.25),
                          'ok': np.bool_(True), 'n': np.int32(7),
                          'per_mb': np.array([1.5, 2.0]), 'phase': 'rl',
                          'arr': jnp.arange(3), 'bad': float('nan')})
    w.write(4, {'loss': 1})
    # Flushed per line: readable before close.
    mid = read_metrics(str(tmp_path / 'metrics.jsonl'))
    assert len(mid) == 2
  recs = read_metrics(str(tmp_path))
  assert recs[1] == {'step': 4, 'loss': 1}
  r = recs[0]
  assert r['step'] == 3 and type(r['step']) is int
  assert r['loss'] == 0.5 and r['kl'] == 0.25 and r['n'] == 7
  assert r['ok'] is True and r['phase'] == 'rl'
  assert r['per_mb'] == [1.5, 2.0] and r['arr'] == [0, 1, 2]
  assert math.isnan(r['bad'])
  # One JSON object per line.
  lines = (tmp_path / 'metrics.jsonl').read_text().splitlines()
  assert [json.loads(l)['step'] for l in lines] == [3, 4]


def test_unknown_type_is_rejected(tmp_path):
  with MetricsWriter(str(tmp_path)) as w:
    with pytest.raises(TypeError, match='object'):
      w.write(0, {'x': object()})


def test_resume_appends_and_survives_torn_line(tmp_path):
  with MetricsWriter(str(tmp_path)) as w:
    w.write(0, {'loss': 2.0})
  with open(tmp_path / 'metrics.jsonl', 'a') as f:
    f.write('{"step": 1, "lo')  # A crash mid-write.
  with MetricsWriter(str(tmp_path)) as w:
    w.write(1, {'loss': 1.0})
  assert read_metrics(str(tmp_path)) == [{'step': 0, 'loss': 2.0},
                                         {'step': 1, 'loss': 1.0}]


def test_phase_boundaries():
  recs = [{'step': s, 'phase': 'warmstart' if s < 3 else 'rl'}
          for s in (4, 0, 1, 2, 3)] + [{'step': 5}]
  assert _phase_boundaries(recs) == [(3, 'rl')]
  assert _phase_boundaries([{'step': 0, 'phase': 'rl'}]) == []


def _png_size(path):
  with open(path, 'rb') as f:
    head = f.read(24)
  assert head[:8] == PNG_SIGNATURE
  return int.from_bytes(head[16:20], 'big'), int.from_bytes(head[20:24], 'big')


def _full_log(workdir):
  with MetricsWriter(workdir) as w:
    for step in range(10):
      m = {'phase': 'warmstart' if step < 4 else 'rl',
           'sft_loss': 1 / (step + 1)}
      if step >= 4:
        m.update(reward_mean=step / 10, reward_std=0.1, reward_count=64,
                 loss=0.1 * step, grad_norm=1.0 / step,
                 kl=0.01 * step, microstep_max_over_mean=[1.1, 1.3, 1.2],
                 microstep_max_over_mean_static=2.0 + 0.01 * step)
      w.write(step, m)


def test_plots_are_written(tmp_path):
  _full_log(str(tmp_path))
  paths = plot_metrics(str(tmp_path))
  names = sorted(os.path.basename(p) for p in paths)
  assert names == ['kl.png', 'microstep_load.png', 'reward.png', 'update.png']
  for p in paths:
    assert os.path.getsize(p) > 1000
    # update.png: two panels (gradient norm; the loss, since this log does
    # not say how many update epochs ran), 2.4 inches each + 1.6 at 100 dpi.
    height = 640 if p.endswith('update.png') else 400
    assert _png_size(p) == (640, height)
  # The image is real: read it back and check it is not blank.
  import matplotlib.image
  img = matplotlib.image.imread(paths[0])
  assert img.shape[:2] == (400, 640) and img.std() > 0.01


@pytest.mark.parametrize('keys, expected', [
    ({'reward_mean': 0.5}, ['reward.png']),
    ({'microstep_max_over_mean_eplb_step': 1.5}, ['microstep_load.png']),
    ({'pg_loss': 0.1, 'kl_coef': 0.0}, ['kl.png', 'update.png']),
    ({'grad_norm': 0.1}, ['update.png']),
    ({'other': 1.0}, []),
])
def test_only_present_keys_are_plotted(tmp_path, keys, expected):
  with MetricsWriter(str(tmp_path)) as w:
    for step in range(3):
      w.write(step, keys)
  paths = plot_metrics(str(tmp_path))
  assert sorted(os.path.basename(p) for p in paths) == expected
  assert sorted(f for f in os.listdir(tmp_path) if f.endswith('.png')) == \
      expected


def test_truncate_after_drops_later_and_torn_records(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  with metrics.MetricsWriter(str(tmp_path)) as w:
    for step in range(1, 6):
      w.write(step, {'phase': 'rl', 'x': step})
  with open(path, 'a') as f:
    f.write('{"step": 6, "x"')  # torn by a crash mid-write
  assert metrics.truncate_after(str(tmp_path), 3) == 3
  assert [r['step'] for r in metrics.read_metrics(str(path))] == [1, 2, 3]
  assert metrics.truncate_after(str(tmp_path), 3) == 0
  with metrics.MetricsWriter(str(tmp_path)) as w:  # appends after step 3
    w.write(4, {'phase': 'rl', 'x': 40})
  assert [r['x'] for r in metrics.read_metrics(str(path))] == [1, 2, 3, 40]


def _band(ax):
  """{step: (lo, hi)} of the one shaded band on `ax` (its polygon's
  vertices: the hi edge one way, the lo edge back)."""
  (poly,) = ax.collections
  out = {}
  for x, y in poly.get_paths()[0].vertices:
    lo, hi = out.get(float(x), (np.inf, -np.inf))
    out[float(x)] = (min(lo, float(y)), max(hi, float(y)))
  return out


def _legend_texts(fig):
  return [t.get_text() for leg in fig.legends for t in leg.get_texts()]


def test_reward_band_is_the_95_interval_of_the_mean_clipped_to_the_range():
  """Not the rewards' own ± std (for 0/1 rewards most of [0, 1]): the
  interval of the step's mean, from the sample std (ddof 1) of its n."""
  rng = np.random.default_rng(0)
  rewards = {1: (rng.random(64) < 0.5).astype(float),
             2: (rng.random(16) < 0.2).astype(float),
             3: np.ones(16) - (np.arange(16) == 0)}  # 15/16: clips at 1.
  records = [{'step': s, 'phase': 'rl', 'reward_mean': float(r.mean()),
              'reward_std': float(r.std()), 'reward_count': r.size}
             for s, r in rewards.items()]
  fig = metrics.make_figures(records, reward_range=(0.0, 1.0),
                             greedy=[(0, 0.2), (3, 0.7)])['reward.png']
  (ax,) = fig.axes
  band = _band(ax)
  for s, r in rewards.items():
    half = 1.96 * np.std(r, ddof=1) / np.sqrt(r.size)
    np.testing.assert_allclose(
        band[s], (max(r.mean() - half, 0.0), min(r.mean() + half, 1.0)),
        rtol=1e-12)
  assert band[3][1] == 1.0 and band[1][1] - band[1][0] < 0.25
  assert _legend_texts(fig) == [
      "mean reward of the step's samples",
      '95% interval of the mean (n = 16..64 per step)',
      'greedy eval (held-out prompts)']
  # Without reward_count (older logs) there is no band, not a wrong one.
  old = [{k: v for k, v in r.items() if k != 'reward_count'} for r in records]
  assert not metrics.make_figures(old)['reward.png'].axes[0].collections


def test_legends_sit_below_the_axes_and_name_curves_in_words():
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  records = [{'step': s, 'phase': 'rl', 'planner': 'foremoe',
              'reward_mean': 0.5, 'reward_std': 0.5, 'reward_count': 64,
              'microstep_max_over_mean': [1.1, 1.2],
              'microstep_max_over_mean_static': [2.5, 3.5],
              'microstep_max_over_mean_eplb_step': 1.5,
              'plan_fallback': s == 2, 'kl': 0.1 * s, 'grad_norm': 1.0,
              'loss': 0.1, 'clip_frac_per_epoch': [0.0]} for s in (1, 2, 3)]
  figures = metrics.make_figures(records)
  assert sorted(figures) == ['kl.png', 'microstep_load.png', 'reward.png',
                             'update.png']
  for name, fig in figures.items():
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:  # Off every curve: outside every axes.
      assert not box.overlaps(ax.get_window_extent(renderer)), name
      assert box.y1 < ax.get_window_extent(renderer).y0, name
    # Words, never a raw metric name.
    assert all('_' not in t for t in _legend_texts(fig)), name
  load = figures['microstep_load.png']
  assert _legend_texts(load) == [
      'ForeMoE plan', 'EPLB, one placement per step', 'static EP',
      'plan fell back (the step line says why)']
  # The fallback is marked on the plan's curve, at its step.
  marks = [l for l in load.axes[0].lines if l.get_marker() == 'x']
  (mark,) = marks
  assert list(mark.get_xdata()) == [2]
  assert list(mark.get_ydata()) == [pytest.approx(1.15)]
  # A run whose own plan is static EP draws that line once.
  static = [dict(r, planner='static') for r in records]
  texts = _legend_texts(metrics.make_figures(static)['microstep_load.png'])
  assert texts.count('static EP') == 1
  assert metrics.label('microstep_max_over_mean', 'eplb_microstep') == \
      'EPLB, per micro-step'


@pytest.mark.parametrize('epochs', [1, 2])
def test_update_figure_draws_the_loss_only_where_it_carries_information(
    epochs):
  """One epoch: ratio 1, the policy-gradient term is a cancellation (~0)
  and the loss is beta x KL (kl.png's): only the gradient norm and the
  non-zero terms. Several epochs: the losses and the clipped share too."""
  records = [{'step': s, 'phase': 'rl', 'grad_norm': 0.5 + s, 'kl': 0.1,
              'loss': 0.01 * s, 'pg_loss': 1e-9 * (-1) ** s,
              'indexer_loss': 0.2, 'balance_loss': 0.0,
              'clip_frac': 0.0 if epochs == 1 else 0.05 * s,
              'clip_frac_per_epoch': [0.0] * epochs} for s in (1, 2, 3)]
  fig = metrics.make_figures(records)['update.png']
  panels = [(ax.get_ylabel(), [l.get_label() for l in ax.lines])
            for ax in fig.axes]
  if epochs == 1:
    assert panels == [('gradient norm', ['gradient norm (before clipping)']),
                      ('loss', ['MSA indexer loss'])]
  else:
    assert panels == [
        ('gradient norm', ['gradient norm (before clipping)']),
        ('clipped share', ['share of tokens clipped']),
        ('loss', ['MSA indexer loss',
                  'total loss (policy gradient + beta x KL)',
                  'policy-gradient loss'])]
  # Each curve its own colour: the panels share one legend.
  colors = [l.get_color() for ax in fig.axes for l in ax.lines]
  assert len(set(colors)) == len(colors)
  np.testing.assert_allclose(fig.axes[0].lines[0].get_ydata(),
                             [1.5, 2.5, 3.5])


def test_plot_metrics_drops_zero_losses_and_draws_warm_start(tmp_path):
  with MetricsWriter(str(tmp_path), 'warmstart.jsonl') as w:
    for step in (50, 100):
      w.write(step, {'phase': 'warmstart', 'sft_loss': 3.0 / step})
  records = [{'step': s, 'phase': 'rl', 'reward_mean': 0.9, 'reward_std': 0.5,
              'loss': 0.1 * s, 'indexer_loss': 0.0} for s in (1, 2, 3)]
  paths = plot_metrics(str(tmp_path), records, reward_range=(0.0, 1.0))
  names = sorted(os.path.basename(p) for p in paths)
  assert names == ['reward.png', 'update.png', 'warmstart.png']
  fig = metrics.make_figures(records)['update.png']
  # The all-zero indexer loss is left out; the loss stays (the log does
  # not say how many update epochs ran).
  assert [l.get_label() for l in fig.axes[0].lines] == [
      'total loss (policy gradient + beta x KL)']
