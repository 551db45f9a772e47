"""Software aging of the RL loop: does memory creep up over many steps?

Runs the trainer's own RL loop (`trainer.rl_loop`: rollout, planning thread,
transfer, update, metrics and checkpoints) for many steps and samples, after
every step, the process's resident memory (RSS) and the bytes of live JAX
device buffers (`jax.live_arrays`). A leak that costs a few kB a step is
invisible in one step and fatal in a week.

The growth is read from a trend fitted over all samples after the warm-up,
not from two points: memory is noisy (allocator arenas, garbage collection,
a compile for a new capacity bucket), and a single late spike would read as
a leak, a single late dip as none. As in studies of software aging in LLM
serving, the trend is the Theil-Sen slope (the median of all pairwise
slopes, robust to spikes), with a Mann-Kendall test (Kendall's tau of the
series against time) to say whether there is a monotone trend at all.

  growth = slope * (steps after warm-up) / level at the end of warm-up

where the level is the fitted line's value at the first sample after
warm-up: the fraction by which memory grew over the run, per the trend.

A step that compiles (a capacity bucket the run meets for the first time)
raises RSS twice over: by the executable it keeps (a bounded, one-time
shift: there are finitely many buckets) and by the compiler's scratch
memory, hundreds of MiB that glibc keeps resident until the next
`malloc_trim` (the one after the next checkpoint save, `Checkpointer.save`).
Taking out the compile step's whole jump, as this benchmark first did,
took out the scratch memory too, and the trim that returned it later then
read as a drop of ~500 MB that stayed in the series. So each compile
instead starts a new stretch of the series, and the samples from the
compile up to the first trim after it, plus `SETTLE_STEPS`, are left out
(`compile_segments`). The slope is the median of the pairwise slopes of
samples in the same stretch, and the Mann-Kendall statistic and its
variance are summed over the stretches: the seasonal Kendall test and
slope of Hirsch, Slack and Smith (1982), with stretches for seasons. No
pair of samples spans a compile, so neither its persistent part nor its
temporary part enters the trend, whatever their sizes; a series that
never compiles after the warm-up is one stretch, a plain Theil-Sen fit
and Mann-Kendall test. Leaving the compile's whole window out costs a few
dozen samples; fitting only after the last compile would lose the whole
stretch before it, and a late compile would leave almost nothing. The
persistent part is reported on its own: `compile_shift_bytes`, the level of
the last stretch less that of the first (each stretch's level fitted with
the common slope), beside `compile_steps_after_warmup` and
`rss_growth_with_compiles`, the fit of the raw series.

Checkpoint saves are not taken out. tensorstore's JSON-to-Python
conversion keeps a reference to every key and value of the dicts it
returns, and orbax went through it twice per array item on each save, for a
log line: ~145 kB kept per save on configs/tiny.py's state.
`rl.checkpoint.Checkpointer` reads those counters another way, which halves
that to ~74 kB (the rest is orbax's per-array `KvStore.Spec.to_json`, the
same conversion, and tensorstore's own state); the growth still depends on
how often the run saves (`--config.checkpoint_every`), and the result
records the number of saves.

The target (`target_met`): the RSS trend is not significant (Mann-Kendall
p > 0.01), or it is under 0.5% per 1,000 steps (`rss_growth_per_1k_steps`,
the Theil-Sen slope times 1,000 over the level).
"""
from __future__ import annotations

import os
import resource
import time

import jax
import numpy as np
from flax import nnx
from scipy import stats

from foremoe_jax import config as config_lib
from foremoe_jax.model import expert_parallel, sharding, transformer
from foremoe_jax.rl import checkpoint, step as step_lib, trainer
from foremoe_jax.tasks import task_from_config
from foremoe_jax.utils import metrics as metrics_lib

# Emitted once per XLA backend compile (jax/_src/dispatch.py).
_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'
# A trend is aging when it is significant AND at least this much a 1k steps.
TARGET_P_VALUE = 0.01
TARGET_GROWTH_PER_1K_STEPS = 0.005
# Samples left out after the first trim that follows a compile: the heap
# settles over a step or two after a trim.
SETTLE_STEPS = 5


def rss_bytes() -> int:
  """Resident set size of this process now (Linux /proc; else the peak)."""
  try:
    with open('/proc/self/statm') as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
  except OSError:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_bytes() -> int:
  """Bytes held by live JAX arrays, summed over their device shards."""
  return int(sum(a.nbytes for a in jax.live_arrays()))


def _kendall_s(y) -> tuple[float, float, int]:
  """Mann-Kendall S of `y` against its order, its variance under no trend
  (with the correction for tied values) and the number of pairs."""
  n = y.size
  if n < 2:
    return 0.0, 0.0, 0
  i, j = np.triu_indices(n, k=1)
  s = float(np.sign(y[j] - y[i]).sum())
  _, counts = np.unique(y, return_counts=True)
  var = (n * (n - 1) * (2 * n + 5)
         - float(np.sum(counts * (counts - 1) * (2 * counts + 5)))) / 18.0
  return s, var, int(i.size)


def trend(samples, segments=None) -> dict:
  """Theil-Sen slope per sample, the growth fraction it implies over the
  series, and the Mann-Kendall test of a monotone trend.

  segments: optional label per sample (`compile_segments`); samples labelled
  -1 are left out, and only pairs of samples with the same label enter the
  slope and the test, so a level shift between stretches does not. The
  level is the fitted line's value at the first sample fitted.
  """
  y_all = np.asarray(samples, np.float64)
  labels = (np.zeros(y_all.size, np.int64) if segments is None
            else np.asarray(segments, np.int64))
  if labels.shape != y_all.shape:
    raise ValueError(f'segments has {labels.size} labels for '
                     f'{y_all.size} samples')
  x_all = np.arange(y_all.size, dtype=np.float64)
  keep = labels >= 0
  if np.count_nonzero(keep) < 3:
    raise ValueError(f'a trend needs at least 3 samples, got '
                     f'{np.count_nonzero(keep)}')
  groups = [np.flatnonzero(labels == g) for g in np.unique(labels[keep])]
  slopes, s_sum, var_sum, pairs = [], 0.0, 0.0, 0
  for idx in groups:
    i, j = np.triu_indices(idx.size, k=1)
    slopes.append((y_all[idx][j] - y_all[idx][i])
                  / (x_all[idx][j] - x_all[idx][i]))
    s, var, n_pairs = _kendall_s(y_all[idx])
    s_sum, var_sum, pairs = s_sum + s, var_sum + var, pairs + n_pairs
  slope = float(np.median(np.concatenate(slopes))) if pairs else 0.0
  # Each stretch's level (the intercept at sample 0) under the common slope.
  intercepts = [float(np.median(y_all[idx] - slope * x_all[idx]))
                for idx in groups]
  first, last = groups[0][0], groups[-1][-1]
  level = max(float(intercepts[0] + slope * x_all[first]), 1.0)
  if var_sum > 0:  # As scipy's kendalltau: no continuity correction.
    p_value = float(2 * stats.norm.sf(abs(s_sum) / np.sqrt(var_sum)))
  else:  # Every fitted sample tied within its stretch: no trend at all.
    p_value = 1.0
  return dict(growth=float(slope * (x_all[last] - x_all[first]) / level),
              slope_per_step=slope, level=level,
              kendall_tau=float(s_sum / pairs) if pairs else 0.0,
              p_value=p_value, segments=len(groups),
              samples_fitted=int(np.count_nonzero(keep)),
              level_shift=intercepts[-1] - intercepts[0],
              first=float(y_all[0]), last=float(y_all[-1]),
              max=float(y_all.max()))


def growth_per_1k_steps(t: dict) -> float:
  """The fraction a `trend` grows over 1,000 steps (one sample a step)."""
  return float(t['slope_per_step'] * 1000 / t['level'])


def compile_segments(compiles, trims, settle: int = SETTLE_STEPS
                     ) -> np.ndarray:
  """A stretch label per sample: a new stretch starts at every sample whose
  step compiled; -1 marks the samples left out after a compile.

  compiles: compiles per sample (> 0: that step compiled).
  trims: per sample, whether the heap was trimmed right after it (a
    checkpoint save). A compile's scratch memory stays resident until then,
    so a compile's samples are left out up to the first trim at or after it,
    and `settle` samples more (only `settle` samples where no trim follows).
  """
  compiles = np.asarray(compiles)
  trims = np.asarray(trims, bool)
  if compiles.shape != trims.shape:
    raise ValueError(f'{compiles.size} compile counts for {trims.size} '
                     f'trim flags')
  labels = np.zeros(compiles.size, np.int64)
  label, skip_to = 0, 0
  for k in range(compiles.size):
    if compiles[k] > 0:
      label += 1
      after = np.flatnonzero(trims[k:])
      skip_to = max(skip_to, k + (after[0] + 1 if after.size else 0) + settle)
    labels[k] = -1 if k < skip_to else label
  return labels


class _SamplingWriter(metrics_lib.MetricsWriter):
  """The loop's metrics writer, sampling memory after each step's write,
  and counting the XLA compiles each step ran.

  The samples go into arrays sized and written for the run up front:
  appending Python ints to lists would itself grow the heap by ~150 bytes a
  step, and so would the lazily mapped pages of `np.zeros` (8 bytes a
  sample) as they are first written."""

  def __init__(self, workdir: str, steps: int):
    super().__init__(workdir)
    self._rss = np.full(steps, -1, np.int64)
    self._device = np.full(steps, -1, np.int64)
    self._t = np.full(steps, -1.0)
    self._compiles = np.full(steps, -1, np.int64)
    self.count = 0
    self._t0 = time.perf_counter()
    self._compiled = 0
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, duration: float, **kwargs) -> None:
    del duration, kwargs
    if event == _COMPILE_EVENT:
      self._compiled += 1

  def write(self, step: int, record: dict) -> None:
    super().write(step, record)
    k = self.count
    self._rss[k] = rss_bytes()
    self._device[k] = device_bytes()
    self._t[k] = time.perf_counter() - self._t0
    self._compiles[k] = self._compiled
    self._compiled = 0
    self.count = k + 1

  # The samples so far, as lists of Python numbers.
  rss = property(lambda self: self._rss[:self.count].tolist())
  device = property(lambda self: self._device[:self.count].tolist())
  t = property(lambda self: self._t[:self.count].tolist())
  compiles = property(lambda self: self._compiles[:self.count].tolist())

  def close(self) -> None:
    jax.monitoring.unregister_event_duration_listener(self._on_event)
    super().close()


def run(config, workdir: str, steps: int, warmup_steps: int,
        log=print) -> dict:
  """`steps` RL steps of `config` from a fresh model in `workdir`; returns
  the growth of RSS and device bytes after `warmup_steps` (see `trend`)."""
  if steps - warmup_steps < 3:
    raise ValueError(f'steps ({steps}) must exceed warmup_steps '
                     f'({warmup_steps}) by at least 3')
  config = config.copy_and_resolve_references()
  config.rl.steps = steps
  config_lib.validate_config(config)
  task = task_from_config(config)
  mesh = expert_parallel.make_mesh(config.parallel.num_data,
                                   config.parallel.num_expert)
  model = transformer.Transformer(config.model, mesh,
                                  dispatch=config.parallel.dispatch,
                                  rngs=nnx.Rngs(config.seed))
  graphdef, params = sharding.split_model(
      model, mesh, **sharding.fsdp_options(config.parallel))
  del model
  ctx = trainer.make_rl_context(config, graphdef, mesh, task)
  state = step_lib.init_train_state(graphdef, params, ctx.rl_step.tx, mesh,
                                    with_ref=config.rl.beta > 0)
  del params
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'))
  writer = _SamplingWriter(workdir, steps)  # rl_loop prints a line a step.
  try:
    trainer.rl_loop(ctx, state, 0, np.random.default_rng(config.seed),
                    jax.random.key(config.seed), writer, ckpt)
  finally:
    ctx.planner.close()
    writer.close()
  after = slice(warmup_steps, None)
  every = config.get('checkpoint_every', 10)
  compiles = writer.compiles[after]
  segments = _fitted_segments(writer.compiles, every, warmup_steps)
  rss = trend(writer.rss[after], segments)
  dev = trend(writer.device[after], segments)
  raw = trend(writer.rss[after])
  log(f'soak: {steps} steps, warm-up {warmup_steps}: RSS '
      f'{rss["level"] / 2**20:.1f} MiB growth {rss["growth"]:+.4f} '
      f'({growth_per_1k_steps(rss):+.4f} per 1k steps, p '
      f'{rss["p_value"]:.1e}); device '
      f'{dev["level"] / 2**20:.2f} MiB growth {dev["growth"]:+.4f}')
  per_1k = growth_per_1k_steps(rss)
  return dict(steps=steps, warmup_steps=warmup_steps,
              checkpoint_every=every,
              checkpoint_saves=sum(1 for i in range(1, steps + 1)
                                   if i % every == 0 or i == steps),
              rss_growth=rss['growth'], device_bytes_growth=dev['growth'],
              rss_growth_per_1k_steps=per_1k,
              target=dict(p_value_above=TARGET_P_VALUE,
                          or_growth_per_1k_steps_below=(
                              TARGET_GROWTH_PER_1K_STEPS)),
              target_met=bool(rss['p_value'] > TARGET_P_VALUE
                              or per_1k < TARGET_GROWTH_PER_1K_STEPS),
              rss_growth_with_compiles=raw['growth'],
              compile_steps_after_warmup=int(np.count_nonzero(compiles)),
              compile_shift_bytes=rss['level_shift'],
              samples_left_out_after_compiles=int(
                  len(compiles) - rss['samples_fitted']),
              step_s_median=float(np.median(np.diff(writer.t[after]))),
              rss=rss, device_bytes=dev,
              samples=dict(rss_bytes=writer.rss,
                           device_bytes=writer.device,
                           compiles=writer.compiles,
                           elapsed_s=[round(t, 3) for t in writer.t]))


def _fitted_segments(compiles, checkpoint_every: int, warmup_steps: int
                     ) -> np.ndarray:
  """The stretch labels of the samples after the warm-up (`run` saves, and
  so trims, after every `checkpoint_every`-th step and the last); a single
  stretch where compiles leave fewer than 3 samples to fit."""
  n = len(compiles)
  saved = [(i + 1) % checkpoint_every == 0 or i + 1 == n for i in range(n)]
  labels = compile_segments(compiles[warmup_steps:], saved[warmup_steps:])
  return labels if np.count_nonzero(labels >= 0) >= 3 else 0 * labels


def plot(result: dict, path: str) -> str:
  """RSS and device bytes per step, with the fitted trends, to `path`."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  w = result['warmup_steps']
  compiles = np.asarray(result['samples']['compiles'])
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
  for ax, key, name in ((axes[0], 'rss_bytes', 'rss'),
                        (axes[1], 'device_bytes', 'device_bytes')):
    y = np.asarray(result['samples'][key], np.float64)
    steps = np.arange(1, y.size + 1)
    ax.plot(steps, y / 2**20, lw=1, label='sampled')
    t = result[name]
    xs, ys = steps[w:], y[w:]
    labels = _fitted_segments(result['samples']['compiles'],
                              result['checkpoint_every'], w)
    for g in np.unique(labels[labels >= 0]):
      # The common slope through each stretch's own level.
      seg = labels == g
      level = np.median(ys[seg] - t['slope_per_step'] * xs[seg])
      ax.plot(xs[seg], (level + t['slope_per_step'] * xs[seg]) / 2**20,
              'k--', lw=1, label=(f"Theil-Sen trend: {t['growth']:+.2%}"
                                  if g == labels.max() else None))
    if np.any(labels < 0):
      ax.plot(xs[labels < 0], ys[labels < 0] / 2**20, '.', ms=1.5,
              color='tab:orange', label='left out after a compile')
    for s in steps[compiles > 0]:
      ax.axvline(s, color='tab:red', lw=0.5, alpha=0.5)
    ax.axvspan(0.5, w + 0.5, color='0.9', label='warm-up')
    ax.set_xlabel('RL step (red: a step that compiled)')
    ax.set_ylabel('MiB')
    ax.set_title('process RSS' if key == 'rss_bytes' else
                 'live device buffers')
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
