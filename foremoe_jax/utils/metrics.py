"""Metrics log (one JSON line per step) and the plots drawn from it.

Sits at the end of every step: the training loop hands its scalars to
`MetricsWriter.write`, and `plot_metrics` turns `metrics.jsonl` into the
figures of a run (reward, per-micro-step load balance, the policy update,
KL; `make_figures` says what each shows and why).
Host-side, plain Python; matplotlib is imported only when plotting.

Record format: {"step": int, <name>: number | string | list, ...}. A string
key `phase` (e.g. "warmstart", "rl") marks the phase of training; plots draw
a vertical line where it changes. NaN and inf are written as JSON's NaN /
Infinity extensions, which `json` reads back.
"""
from __future__ import annotations

import json
import math
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


# Legend words for the logged keys, in one place so that every figure (and
# anyone re-plotting a metrics.jsonl) names a curve the same way; a key that
# is not here is shown as logged. The run's own plan, logged as
# `microstep_max_over_mean`, is named by the record's `planner` method, as
# if it were logged as microstep_max_over_mean_<method> (`label`).
LABELS = {
    'reward_mean': "mean reward of the step's samples",
    'microstep_max_over_mean': "this run's plan",  # When the log has no method.
    'microstep_max_over_mean_static': 'static EP',
    'microstep_max_over_mean_eplb_step': 'EPLB, one placement per step',
    'microstep_max_over_mean_eplb_microstep': 'EPLB, per micro-step',
    'microstep_max_over_mean_foresight_split': 'foresight split',
    'microstep_max_over_mean_foremoe': 'ForeMoE plan',
    'kl': 'KL to the reference policy',
    'kl_coef': 'KL coefficient (beta)',
    'loss': 'total loss (policy gradient + beta x KL)',
    'pg_loss': 'policy-gradient loss',
    'indexer_loss': 'MSA indexer loss',
    'sft_loss': 'cross-entropy',
    'grad_norm': 'gradient norm (before clipping)',
    'clip_frac': 'share of tokens clipped',
}
_PLAN_KEY = 'microstep_max_over_mean'


def label(key: str, planner: str | None = None) -> str:
  """Words for a logged key (`LABELS`); `planner`: the run's method."""
  if key == _PLAN_KEY and planner:
    return LABELS.get(f'{key}_{planner}', f'{planner} plan')
  return LABELS.get(key, key)


def _planner_name(records) -> str | None:
  names = [r['planner'] for r in records if isinstance(r.get('planner'), str)]
  return names[-1] if names else None


def _num_update_epochs(records) -> int | None:
  """Update epochs per RL step, from the per-epoch lists the trainer logs
  (None: the log does not say)."""
  counts = [len(r[k]) for r in records
            for k in ('clip_frac_per_epoch', 'ratio_mean_per_epoch')
            if isinstance(r.get(k), list)]
  return max(counts) if counts else None


def _nonzero(series) -> bool:
  return any(v != 0 for col in series[1:] for v in col)


def _reward_band(records, reward_range):
  """(steps, lo, hi, n) of the 95% interval of each step's mean reward, or
  None when the log lacks reward_std or reward_count."""
  rows = sorted((r['step'], r['reward_mean'], r['reward_std'],
                 r['reward_count']) for r in records
                if 'step' in r and all(_is_number(r.get(k)) for k in (
                    'reward_mean', 'reward_std', 'reward_count'))
                and r['reward_count'] > 1)
  if not rows:
    return None
  steps, lo, hi = [], [], []
  for step, mean, std, n in rows:
    # reward_std is the population std (ddof 0); the sample std is
    # std * sqrt(n / (n - 1)), so its standard error is std / sqrt(n - 1).
    half = 1.96 * std / math.sqrt(n - 1)
    steps.append(step)
    lo.append(mean - half)
    hi.append(mean + half)
  if reward_range is not None:
    clip = lambda v: min(max(v, reward_range[0]), reward_range[1])
    lo, hi = [clip(v) for v in lo], [clip(v) for v in hi]
  sizes = sorted({int(row[3]) for row in rows})
  n = str(sizes[0]) if len(sizes) == 1 else f'{sizes[0]}..{sizes[-1]}'
  return steps, lo, hi, n


def _draw(ax, records, keys, planner, first_color=0) -> int:
  """Each key's mean line (named by `label`), lists with a min..max band;
  colours C<first_color>, C<first_color + 1>, ... (so that the panels of
  one figure, which share a legend, never reuse one). Returns the count."""
  drawn = 0
  for key in keys:
    steps, mean, lo, hi = _series(records, key)
    if not steps:
      continue
    color = f'C{(first_color + drawn) % 10}'
    ax.plot(steps, mean, label=label(key, planner), lw=1.5, color=color)
    if any(a != b for a, b in zip(lo, hi)):
      ax.fill_between(steps, lo, hi, color=color, alpha=0.2)
    drawn += 1
  return drawn


def _finish(fig, axes, title, boundaries, ylabels) -> None:
  """Phase lines, labels, and one legend under the axes, off the curves."""
  for i, (ax, ylabel) in enumerate(zip(axes, ylabels)):
    for step, phase in boundaries:
      ax.axvline(step, color='k', lw=0.8, ls='--')
      if i == 0:
        ax.annotate(phase, (step, 1.0), xycoords=('data', 'axes fraction'),
                    xytext=(3, -12), textcoords='offset points', fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
  axes[0].set_title(title)
  axes[-1].set_xlabel('step')
  handles, names = [], []
  for ax in axes:
    for h, n in zip(*ax.get_legend_handles_labels()):
      if n not in names:
        handles.append(h)
        names.append(n)
  if handles:
    # Outside the axes (constrained layout makes room below them): a curve
    # or band that fills the axes can never sit under the legend.
    fig.legend(handles, names, loc='outside lower center', fontsize=8,
               ncols=2 if len(names) > 1 else 1)


def make_figures(records: list[dict], *,
                 reward_range: tuple[float, float] | None = None,
                 greedy: list[tuple[int, float]] | None = None) -> dict:
  """{file name: matplotlib Figure} for the keys the records hold.

  reward.png: the mean reward per step (for 0/1 rewards: the pass rate)
  and, shaded, the 95% interval of that mean, mean ± 1.96 s / sqrt(n), s
  the sample std of the step's n = `reward_count` rewards; clipped to
  `reward_range` (the task's). Not the ± std band of the rewards
  themselves: for 0/1 rewards that spans most of [0, 1] whatever the
  model does. The n samples are treated as independent; those of one
  prompt are correlated, so the interval is narrower than the spread
  between steps that draw other prompts. The greedy evaluations `greedy`
  [(step, reward)] are markers.

  microstep_load.png: the max/mean device load of every micro-step, for
  this run's plan (named after its `planner` method) and for static EP,
  and any other microstep_max_over_mean_<method> key: the mean over the
  step's micro-steps with a min..max band. Steps whose plan fell back
  (`plan_fallback`) are marked.

  update.png (it replaces loss.png): what carries information about the
  policy update. Always the gradient norm (the size of each update); the
  clip fraction when some token was clipped; the losses only where they
  are not known in advance. With one update epoch the ratio is 1 at every
  token, so the clipped policy-gradient term is minus the mean advantage,
  which group-normalised advantages make zero up to float noise, and the
  total loss is then beta x KL, which kl.png already shows; `loss` and
  `pg_loss` are drawn only with several epochs (the length of the
  `*_per_epoch` lists; when the log does not say, they are drawn). Other
  *_loss terms (the MSA indexer's) are drawn when not zero throughout.

  kl.png: kl and kl_* keys.

  Every figure marks phase changes and has its legend below the axes, its
  curves named in words (`LABELS`).
  """
  from matplotlib.figure import Figure  # No pyplot: no global backend state.

  keys = sorted({k for r in records for k in r if k not in ('step', 'phase')})
  boundaries = _phase_boundaries(records)
  planner = _planner_name(records)
  figures = {}

  def new(height=4.0, panels=1):
    fig = Figure(figsize=(6.4, height), dpi=100, layout='constrained')
    axes = fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
    return fig, list(axes)

  if _series(records, 'reward_mean')[0]:
    fig, (ax,) = new()
    _draw(ax, records, ['reward_mean'], planner)
    band = _reward_band(records, reward_range)
    if band is not None:
      steps, lo, hi, n = band
      ax.fill_between(steps, lo, hi, alpha=0.2, color=ax.lines[0].get_color(),
                      label=f'95% interval of the mean (n = {n} per step)')
    if greedy:
      ax.plot(*zip(*greedy), 'D', color='k', ms=6,
              label='greedy eval (held-out prompts)')
    _finish(fig, [ax], 'Reward', boundaries, ['reward'])
    figures['reward.png'] = fig

  load_keys = [k for k in keys if k.startswith(_PLAN_KEY)]
  if planner == 'static':  # The run's plan is static EP: one line, not two.
    load_keys = [k for k in load_keys if k != f'{_PLAN_KEY}_static']
  if any(_series(records, k)[0] for k in load_keys):
    fig, (ax,) = new()
    _draw(ax, records, load_keys, planner)
    steps, mean, _, _ = _series(records, _PLAN_KEY)
    fell = {r['step'] for r in records if r.get('plan_fallback') is True}
    marks = [(s, m) for s, m in zip(steps, mean) if s in fell]
    if marks:
      ax.plot(*zip(*marks), 'x', color='r', ms=7, mew=1.5,
              label='plan fell back (the step line says why)')
    ax.axhline(1.0, color='gray', lw=0.8, ls=':')  # Perfect balance.
    _finish(fig, [ax], 'Device load balance per micro-step', boundaries,
            ['max / mean device load\n(mean; band: min..max over '
             'micro-steps)'])
    figures['microstep_load.png'] = fig

  panels = []  # (y label, keys) of update.png.
  if _series(records, 'grad_norm')[0]:
    panels.append(('gradient norm', ['grad_norm']))
  if _nonzero(_series(records, 'clip_frac')):
    panels.append(('clipped share', ['clip_frac']))
  epochs = _num_update_epochs(records)
  losses = [k for k in keys if (k == 'loss' or k.endswith('_loss'))
            and k != 'sft_loss' and _nonzero(_series(records, k))
            and not (epochs == 1 and k in ('loss', 'pg_loss'))]
  if losses:
    panels.append(('loss', losses))
  if panels:
    fig, axes = new(1.6 + 2.4 * len(panels), len(panels))
    colors = 0
    for ax, (_, panel_keys) in zip(axes, panels):
      colors += _draw(ax, records, panel_keys, planner, colors)
    _finish(fig, axes, 'The policy update', boundaries,
            [ylabel for ylabel, _ in panels])
    figures['update.png'] = fig

  kl_keys = [k for k in keys if k == 'kl' or k.startswith('kl_')]
  if any(_series(records, k)[0] for k in kl_keys):
    fig, (ax,) = new()
    _draw(ax, records, kl_keys, planner)
    _finish(fig, [ax], 'KL to the reference policy', boundaries, ['KL'])
    figures['kl.png'] = fig
  return figures


def plot_metrics(workdir: str, records: list[dict] | None = None, *,
                 reward_range: tuple[float, float] | None = None,
                 greedy: list[tuple[int, float]] | None = None) -> list[str]:
  """Writes the PNGs of `make_figures` (what each shows, and why, is there)
  and warmstart.png (the supervised warm start's loss, from
  warmstart.jsonl) into workdir; returns their paths. Only process 0 of a
  multi-process run draws (the others return []).
  """
  if not distributed.is_primary():
    return []
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  written = _plot_warmstart(workdir, Figure)
  if records is None:
    records = read_metrics(workdir)
  figures = make_figures(records, reward_range=reward_range, greedy=greedy)
  for filename, fig in figures.items():
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
  # One curve, named by the title and the axis: no legend to cover it.
  ax.plot(steps, loss, lw=1.5, label=label('sft_loss'))
  ax.set(title='Supervised warm start', xlabel='warm-start step',
         ylabel='cross-entropy', yscale='log')
  ax.grid(alpha=0.3)
  fig.tight_layout()
  out = os.path.join(workdir, 'warmstart.png')
  fig.savefig(out)
  return [out]
