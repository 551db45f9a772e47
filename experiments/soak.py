"""Software aging of the RL loop: memory growth over many steps.

  python -m experiments.soak --steps=200 --json [--config=configs/tiny.py]
      [--warmup_steps=20] [--workdir=/tmp/soak]

Runs the trainer's RL loop (checkpoints and metrics included) from a fresh
model and samples the process RSS and live device-buffer bytes after every
step. The last line is one JSON object; `rss_growth` and
`device_bytes_growth` are the fractions by which each grew from the end of
the warm-up to the end of the run, read from a Theil-Sen trend over the
samples (foremoe_jax/benchmarks/soak.py); a step that compiles starts a new
stretch, and the samples up to the heap trim after the next checkpoint save
are left out (the compiler's scratch memory stays resident until then), so
no compile enters the trend; `rss_growth_with_compiles` is the raw fit.
`rss_growth_per_1k_steps` is the same trend per 1,000 steps, and
`target_met` says whether the RSS trend is not significant (p > 0.01) or
under 0.5% per 1,000 steps. It also writes soak.png (the samples and the
trends) in the workdir.

Allocator: the run pins glibc's mmap threshold (--pin_mmap_threshold);
to try jemalloc instead, without root (Debian/Ubuntu):
  apt-get download libjemalloc2 && dpkg-deb -x libjemalloc2_*.deb jemalloc
  LD_PRELOAD=$PWD/jemalloc/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \
    python -m experiments.soak --steps=2000 --json --nopin_mmap_threshold
"""
import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import contextlib  # pylint: disable=g-import-not-at-top
import tempfile  # pylint: disable=g-import-not-at-top

from absl import flags
from absl import logging

from experiments import common
from foremoe_jax.benchmarks import soak
from foremoe_jax.utils import cli
from foremoe_jax.utils import host_memory
from foremoe_jax.utils.run_info import print_run_info

_CONFIG = cli.define_config_file('configs/tiny.py')
_STEPS = flags.DEFINE_integer('steps', 200, 'RL steps to run.')
_WARMUP = flags.DEFINE_integer(
    'warmup_steps', None, 'Steps left out of the trend (compiles, allocator '
    'warm-up); default: a tenth of --steps, at least 5.')
_WORKDIR = flags.DEFINE_string('workdir', None,
                               'Where metrics, checkpoints and soak.png go; '
                               'default: a new temporary directory.')
_JSON = flags.DEFINE_bool('json', False, 'Print only the setup and the '
                          'result line, not a line per step.')
_PIN = flags.DEFINE_bool(
    'pin_mmap_threshold', True, 'Pin glibc\'s mmap threshold first, as '
    'experiments.rl_train does (foremoe_jax/utils/host_memory.py); '
    '--nopin_mmap_threshold measures the allocator\'s default behaviour.')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every write at INFO.
  config = _CONFIG.value
  steps = _STEPS.value
  warmup = _WARMUP.value if _WARMUP.value is not None else max(5, steps // 10)
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix='foremoe_soak_')
  pinned = _PIN.value and host_memory.pin_mmap_threshold()
  run = {'bench': 'soak', 'steps': steps, 'warmup_steps': warmup,
         'workdir': workdir, 'mmap_threshold_pinned': pinned,
         # An allocator swapped in through LD_PRELOAD (jemalloc, tcmalloc).
         'ld_preload': ' '.join(os.path.basename(p) for p in
                                os.environ.get('LD_PRELOAD', '').split()),
         'config': config.to_dict()}
  info = print_run_info(run)
  # The step lines go to /dev/null, not to a buffer: a buffer would keep
  # every line, ~250 bytes a step, and read as a leak of the loop.
  with contextlib.ExitStack() as quiet:
    if _JSON.value:
      quiet.enter_context(contextlib.redirect_stdout(
          quiet.enter_context(open(os.devnull, 'w', encoding='utf-8'))))
    result = soak.run(config, workdir, steps, warmup)
  result['plot'] = soak.plot(result, os.path.join(workdir, 'soak.png'))
  common.finish('soak', {k: v for k, v in info.items() if k != 'config'},
                result)


if __name__ == '__main__':
  cli.run(main)
