"""Metrics log (one JSON line per step) and the plots drawn from it.

Sits at the end of every step: the training loop hands its scalars to
`MetricsWriter.write`, and `plot_metrics` turns `metrics.jsonl` into the
figures of a run (reward curve, per-micro-step load balance, loss, KL).
Host-side, plain Python; matplotlib is imported only when plotting.

Record format: {"step": int, <name>: number | string | list, ...}. A string
key `phase` (e.g. "warmstart", "rl") marks the phase of training; plots draw
a vertical line where it changes. NaN and inf are written as JSON's NaN /
Infinity extensions, which `json` reads back.
"""
from __future__ import annotations

import json
import os
from typing import Any

from foremoe_jax.utils import distributed

METRICS_FILE = 'metrics.jsonl'
WARMSTART_FILE = 'warmstart.jsonl'


def _to_json(value: Any) -> Any:
  """numpy / jax scalars and arrays -> plain Python numbers and lists."""
  if isinstance(value, (str, bool, int, float)) or value is None:
    return value
  if isinstance(value, dict):
    return {str(k): _to_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_to_json(v) for v in value]
  if hasattr(value, 'tolist'):  # numpy and jax arrays and scalars.
    return value.tolist()
  if hasattr(value, '__float__'):
    return float(value)
  raise TypeError(f'cannot log a value of type {type(value).__name__}.')


class MetricsWriter:
  """Appends one JSON line per step to workdir/metrics.jsonl.

  Each line is flushed as written, so a crash loses at most the step in
  flight. Opening an existing file appends (resuming a run); a torn last line
  from a crash is closed off first so the next record starts on its own line.
  In a multi-process run only process 0 writes (`distributed.is_primary`);
  the others' writers (and their mirrors) drop every record.
  """

  def __init__(self, workdir: str, filename: str = METRICS_FILE,
               mirror=None):
    """mirror: another writer (`write(step, record)`) that gets every record
    too, such as `tensorboard.TensorBoardWriter`."""
    self._mirror = mirror
    self.workdir = workdir
    self.path = os.path.join(workdir, filename)
    self._file = None
    if not distributed.is_primary():
      return
    os.makedirs(workdir, exist_ok=True)
    needs_newline = False
    if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
      with open(self.path, 'rb') as f:
        f.seek(-1, os.SEEK_END)
        needs_newline = f.read(1) != b'\n'
    self._file = open(self.path, 'a', encoding='utf-8')
    if needs_newline:
      self._file.write('\n')
      self._file.flush()

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    if self._file is None:  # Not process 0.
      return
    record = {'step': int(step)}
    record.update({str(k): _to_json(v) for k, v in metrics.items()})
    self._file.write(json.dumps(record) + '\n')
    self._file.flush()
    if self._mirror is not None:  # The plain-Python values, as logged.
      self._mirror.write(int(step), {k: v for k, v in record.items()
                                     if k != 'step'})

  def close(self) -> None:
    if self._file is not None:
      self._file.close()

  def __enter__(self) -> 'MetricsWriter':
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
  """Records of a metrics.jsonl (or of workdir/metrics.jsonl), in file order.

  Blank lines and lines torn by a crash are skipped; a run that resumed from
  an earlier checkpoint may repeat steps, and both records are kept.
  """
  if os.path.isdir(path):
    path = os.path.join(path, METRICS_FILE)
  records = []
  with open(path, encoding='utf-8') as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        continue  # A line torn by a crash mid-write.
  return records


def truncate_after(path: str, step: int) -> int:
  """Drops the records past `step` (and torn lines); returns how many.

  A resumed run restarts at its checkpoint's step, so the steps a crash ran
  past it would otherwise appear twice. The file is rewritten through a
  temporary and renamed, so a crash here leaves either version whole. Only
  process 0 of a multi-process run rewrites the file (the others return 0).
  """
  if not distributed.is_primary():
    return 0
  if os.path.isdir(path):
    path = os.path.join(path, METRICS_FILE)
  if not os.path.exists(path):
    return 0
  with open(path, encoding='utf-8') as f:
    lines = f.read().splitlines()
  keep = []
  for line in lines:
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if record.get('step', 0) <= step:
      keep.append(line)
  dropped = sum(1 for line in lines if line.strip()) - len(keep)
  if dropped:
    tmp = path + '.tmp'
    with open(tmp, 'w', encoding='utf-8') as f:
      f.write(''.join(line + '\n' for line in keep))
    os.replace(tmp, path)
  return dropped


def _is_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _series(records, key):
  """(steps, mean, lo, hi) of `key`, sorted by step; lists reduce to their
  mean with a min..max band (e.g. one value per micro-step)."""
  rows = []
  for r in records:
    if key not in r or 'step' not in r:
      continue
    v = r[key]
    vals = [float(x) for x in (v if isinstance(v, list) else [v])
            if _is_number(x)]
    if vals:
      rows.append((r['step'], sum(vals) / len(vals), min(vals), max(vals)))
  rows.sort(key=lambda row: row[0])
  return tuple(list(col) for col in zip(*rows)) if rows else ([],) * 4


def _phase_boundaries(records):
  """Steps where the `phase` string changes, with the new phase's name."""
  out, last = [], None
  for r in sorted((r for r in records if 'phase' in r and 'step' in r),
                  key=lambda r: r['step']):
    if last is not None and r['phase'] != last:
      out.append((r['step'], r['phase']))
    last = r['phase']
  return out


# Figure file -> (title, y label, which keys it draws, horizontal reference).
_FIGURES = (
    ('reward.png', 'Reward', 'reward',
     lambda k: k == 'reward_mean', None),
    ('microstep_load.png', 'Per-micro-step device load balance',
     'max / mean device load',
     lambda k: k.startswith('microstep_max_over_mean'), 1.0),
    ('loss.png', 'Loss', 'loss',
     lambda k: k == 'loss' or k.endswith('_loss'), None),
    ('kl.png', 'KL to the reference policy', 'KL (k3)',
     lambda k: k == 'kl' or k.startswith('kl_'), None),
)


def plot_metrics(workdir: str, records: list[dict] | None = None, *,
                 reward_range: tuple[float, float] | None = None,
                 greedy: list[tuple[int, float]] | None = None) -> list[str]:
  """Writes the PNGs whose keys the log holds; returns their paths.

  reward.png: reward_mean vs step, its ± std band clipped to `reward_range`
  (the task's), and the greedy evaluations `greedy` [(step, reward)] as
  markers. microstep_load.png: every key microstep_max_over_mean* (one line
  per planner method, e.g. the suffix _static), lists drawn as mean with a
  min..max band. loss.png: loss and *_loss keys, leaving out a loss that is
  zero throughout (a term that is off). kl.png: kl and kl_* keys. Each marks
  phase changes. warmstart.png: the supervised warm start's loss, from
  warmstart.jsonl. Only process 0 of a multi-process run draws (the others
  return []).
  """
  if not distributed.is_primary():
    return []
  from matplotlib.figure import Figure  # No pyplot: no global backend state.

  written = _plot_warmstart(workdir, Figure)
  if records is None:
    records = read_metrics(workdir)
  keys = sorted({k for r in records for k in r if k not in ('step', 'phase')})
  boundaries = _phase_boundaries(records)
  for filename, title, ylabel, wanted, hline in _FIGURES:
    chosen = [k for k in keys if wanted(k)]
    series = [(k, _series(records, k)) for k in chosen]
    series = [(k, s) for k, s in series if s[0]]
    if filename == 'loss.png':
      series = [(k, s) for k, s in series
                if any(v != 0 for col in s[1:] for v in col)]
    if not series:
      continue
    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    ax = fig.subplots()
    for key, (steps, mean, lo, hi) in series:
      (line,) = ax.plot(steps, mean, label=key, lw=1.5)
      if any(a != b for a, b in zip(lo, hi)):
        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2)
    if filename == 'reward.png':
      band = sorted((r['step'], r['reward_mean'], r['reward_std'])
                    for r in records if _is_number(r.get('reward_mean'))
                    and _is_number(r.get('reward_std')) and 'step' in r)
      if band:
        steps, mean, std = zip(*band)
        lo = [m - s for m, s in zip(mean, std)]
        hi = [m + s for m, s in zip(mean, std)]
        if reward_range is not None:
          clip = lambda v: min(max(v, reward_range[0]), reward_range[1])
          lo, hi = [clip(v) for v in lo], [clip(v) for v in hi]
        ax.fill_between(steps, lo, hi, alpha=0.15,
                        color=ax.lines[0].get_color(),
                        label='reward_mean ± reward_std')
      if greedy:
        ax.plot(*zip(*greedy), 'D', color='k', ms=6,
                label='greedy eval (held-out prompts)')
    if hline is not None:
      ax.axhline(hline, color='gray', lw=0.8, ls=':')
    for step, phase in boundaries:
      ax.axvline(step, color='k', lw=0.8, ls='--')
      ax.annotate(phase, (step, 1.0), xycoords=('data', 'axes fraction'),
                  xytext=(3, -12), textcoords='offset points', fontsize=8)
    ax.set(title=title, xlabel='step', ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(workdir, filename)
    fig.savefig(path)
    written.append(path)
  return written


def _plot_warmstart(workdir: str, figure_cls) -> list[str]:
  """warmstart.png: the supervised loss of warmstart.jsonl, if there is one."""
  path = os.path.join(workdir, WARMSTART_FILE)
  if not os.path.exists(path):
    return []
  steps, loss, _, _ = _series(read_metrics(path), 'sft_loss')
  if not steps:
    return []
  fig = figure_cls(figsize=(6.4, 4.0), dpi=100)
  ax = fig.subplots()
  ax.plot(steps, loss, lw=1.5, label='sft_loss')
  ax.set(title='Supervised warm start', xlabel='warm-start step',
         ylabel='cross-entropy', yscale='log')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  out = os.path.join(workdir, 'warmstart.png')
  fig.savefig(out)
  return [out]
