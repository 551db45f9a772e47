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
shifts RSS once, by the executable's size; those shifts are bounded by the
number of buckets, so they are taken out of the series before the fit and
reported beside it (`compile_steps_after_warmup`, `compile_shift_bytes`,
and `rss_growth_with_compiles`, the fit of the raw series).

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


def trend(samples) -> dict:
  """Theil-Sen slope per sample, the growth fraction it implies over the
  series, and the Mann-Kendall test of a monotone trend."""
  y = np.asarray(samples, np.float64)
  x = np.arange(y.size, dtype=np.float64)
  if y.size < 3:
    raise ValueError(f'a trend needs at least 3 samples, got {y.size}')
  slope, intercept, _, _ = stats.theilslopes(y, x)
  tau, p_value = stats.kendalltau(x, y)
  level = max(float(intercept), 1.0)
  return dict(growth=float(slope * (y.size - 1) / level),
              slope_per_step=float(slope), level=level,
              kendall_tau=float(np.nan_to_num(tau)),
              p_value=float(np.nan_to_num(p_value, nan=1.0)),
              first=float(y[0]), last=float(y[-1]), max=float(y.max()))


def growth_per_1k_steps(t: dict) -> float:
  """The fraction a `trend` grows over 1,000 steps (one sample a step)."""
  return float(t['slope_per_step'] * 1000 / t['level'])


def without_compile_jumps(samples, compiles) -> np.ndarray:
  """The series with the change at every step that compiled taken out.

  A step that meets a new capacity bucket compiles the update for it once
  and keeps the executable (tens of MiB of RSS): a level shift bounded by the
  number of buckets, not aging. The growth is read from this series; the
  shifts are reported on their own (`compile_shift_bytes`).
  """
  y = np.asarray(samples, np.float64)
  d = np.diff(y, prepend=y[:1])
  d[np.asarray(compiles) > 0] = 0.0
  return y[0] + np.cumsum(d)


class _SamplingWriter(metrics_lib.MetricsWriter):
  """The loop's metrics writer, sampling memory after each step's write,
  and counting the XLA compiles each step ran."""

  def __init__(self, workdir: str):
    super().__init__(workdir)
    self.rss, self.device, self.t, self.compiles = [], [], [], []
    self._t0 = time.perf_counter()
    self._compiled = 0
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, duration: float, **kwargs) -> None:
    del duration, kwargs
    if event == _COMPILE_EVENT:
      self._compiled += 1

  def write(self, step: int, record: dict) -> None:
    super().write(step, record)
    self.rss.append(rss_bytes())
    self.device.append(device_bytes())
    self.t.append(time.perf_counter() - self._t0)
    self.compiles.append(self._compiled)
    self._compiled = 0

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
  writer = _SamplingWriter(workdir)  # rl_loop prints a line per step.
  try:
    trainer.rl_loop(ctx, state, 0, np.random.default_rng(config.seed),
                    jax.random.key(config.seed), writer, ckpt)
  finally:
    ctx.planner.close()
    writer.close()
  after = slice(warmup_steps, None)
  compiles = writer.compiles[after]
  rss = trend(without_compile_jumps(writer.rss[after], compiles))
  dev = trend(without_compile_jumps(writer.device[after], compiles))
  raw = trend(writer.rss[after])
  shift = np.asarray(writer.rss[after], np.float64) - without_compile_jumps(
      writer.rss[after], compiles)
  log(f'soak: {steps} steps, warm-up {warmup_steps}: RSS '
      f'{rss["level"] / 2**20:.1f} MiB growth {rss["growth"]:+.4f} '
      f'({growth_per_1k_steps(rss):+.4f} per 1k steps, p '
      f'{rss["p_value"]:.1e}); device '
      f'{dev["level"] / 2**20:.2f} MiB growth {dev["growth"]:+.4f}')
  every = config.get('checkpoint_every', 10)
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
              compile_shift_bytes=float(shift[-1]),
              step_s_median=float(np.median(np.diff(writer.t[after]))),
              rss=rss, device_bytes=dev,
              samples=dict(rss_bytes=writer.rss,
                           device_bytes=writer.device,
                           compiles=writer.compiles,
                           elapsed_s=[round(t, 3) for t in writer.t]))


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
    adjusted = without_compile_jumps(y[w:], compiles[w:])
    if np.any(compiles[w:]):
      ax.plot(steps[w:], adjusted / 2**20, lw=1, color='tab:green',
              label='compile steps taken out')
    t = result[name]
    xs = steps[w:]
    ax.plot(xs, (t['level'] + t['slope_per_step'] * (xs - xs[0])) / 2**20,
            'k--', lw=1, label=f"Theil-Sen trend: {t['growth']:+.2%}")
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
