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
        m.update(reward_mean=step / 10, reward_std=0.1, loss=0.1 * step,
                 kl=0.01 * step, microstep_max_over_mean=[1.1, 1.3, 1.2],
                 microstep_max_over_mean_static=2.0 + 0.01 * step)
      w.write(step, m)


def test_plots_are_written(tmp_path):
  _full_log(str(tmp_path))
  paths = plot_metrics(str(tmp_path))
  names = sorted(os.path.basename(p) for p in paths)
  assert names == ['kl.png', 'loss.png', 'microstep_load.png', 'reward.png']
  for p in paths:
    assert os.path.getsize(p) > 1000
    assert _png_size(p) == (640, 400)
  # The image is real: read it back and check it is not blank.
  import matplotlib.image
  img = matplotlib.image.imread(paths[0])
  assert img.shape[:2] == (400, 640) and img.std() > 0.01


@pytest.mark.parametrize('keys, expected', [
    ({'reward_mean': 0.5}, ['reward.png']),
    ({'microstep_max_over_mean_eplb_step': 1.5}, ['microstep_load.png']),
    ({'pg_loss': 0.1, 'kl_coef': 0.0}, ['kl.png', 'loss.png']),
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


def test_plots_clip_the_reward_band_drop_zero_losses_and_draw_warm_start(
    tmp_path):
  from matplotlib.axes import Axes
  from foremoe_jax.utils import metrics as m
  with MetricsWriter(str(tmp_path), 'warmstart.jsonl') as w:
    for step in (50, 100):
      w.write(step, {'phase': 'warmstart', 'sft_loss': 3.0 / step})
  records = [{'step': s, 'phase': 'rl', 'reward_mean': 0.9, 'reward_std': 0.5,
              'loss': 0.1 * s, 'indexer_loss': 0.0} for s in (1, 2, 3)]
  bands, lines = [], []
  fill, plot = Axes.fill_between, Axes.plot

  def spy_fill(self, x, y1, y2=0, **kw):
    bands.append((self, list(y1), list(y2)))
    return fill(self, x, y1, y2, **kw)

  def spy_plot(self, *args, **kw):
    lines.append((self, kw.get('label')))
    return plot(self, *args, **kw)
  Axes.fill_between, Axes.plot = spy_fill, spy_plot
  try:
    paths = m.plot_metrics(str(tmp_path), records, reward_range=(0.0, 1.0),
                           greedy=[(0, 0.2), (3, 0.7)])
  finally:
    Axes.fill_between, Axes.plot = fill, plot
  names = sorted(os.path.basename(p) for p in paths)
  assert names == ['loss.png', 'reward.png', 'warmstart.png']
  # 0.9 +- 0.5 would reach 1.4: the band stops at the reward's maximum.
  (lo, hi), = [(y1, y2) for ax, y1, y2 in bands if ax.get_title() == 'Reward']
  assert max(hi) == 1.0 and min(lo) == pytest.approx(0.4)
  drawn = lambda title: [l for ax, l in lines if ax.get_title() == title]
  assert drawn('Reward') == ['reward_mean', 'greedy eval (held-out prompts)']
  # The all-zero indexer loss is left out; the real loss stays.
  assert drawn('Loss') == ['loss']
  assert drawn('Supervised warm start') == ['sft_loss']
