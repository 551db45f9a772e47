"""Runs the main job and records its numbers in results/<name>.json.

  python -m experiments.record_demo                      # make demo's job
  python -m experiments.record_demo --config=configs/tiny_dataset.py \
      --name=demo_dataset                                # make demo-dataset's
  python -m experiments.record_demo --workdir=W          # a finished run in W
  (`make demo-results` runs both and renders the README; rl_train flags go
  after `--`: ... -- --config.rl.steps=20)

Runs `python -m experiments.rl_train --config=C --workdir=W` as a child
process (the very command `make demo` runs, its output shown as it goes)
and times it from start to exit, set-up, warm start and compiles included.
When W already holds a finished run (its summary.json), nothing is run and
the run is recorded untimed. Then the numbers are read back from W
(foremoe_jax/benchmarks/demo.py) and saved, with this command, the machine
and the versions, to results/<name>.json, from which
`python -m experiments.render_results` renders the README's demo block.
"""
import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import shlex  # pylint: disable=g-import-not-at-top
import subprocess  # pylint: disable=g-import-not-at-top
import sys  # pylint: disable=g-import-not-at-top
import time  # pylint: disable=g-import-not-at-top

from absl import app, flags, logging  # pylint: disable=g-import-not-at-top

from experiments import common  # pylint: disable=g-import-not-at-top
from foremoe_jax.benchmarks import demo  # pylint: disable=g-import-not-at-top
from foremoe_jax.utils.run_info import print_run_info  # pylint: disable=g-import-not-at-top

_CONFIG = flags.DEFINE_string('config', 'configs/tiny.py',
                              'The config file rl_train runs.')
_WORKDIR = flags.DEFINE_string(
    'workdir', None, "The run's workdir; default: a new one under "
    '/tmp/foremoe_demo/.')
_NAME = flags.DEFINE_string('name', 'demo', 'Writes results/<name>.json '
                            '(demo: configs/tiny.py, demo_dataset: '
                            'configs/tiny_dataset.py).')


def main(argv):
  logging.set_verbosity(logging.WARNING)  # jax logs a missing TPU at INFO.
  overrides = argv[1:]  # rl_train flags given after `--`.
  workdir = _WORKDIR.value or os.path.join(
      '/tmp/foremoe_demo', time.strftime('%Y%m%d-%H%M%S'))
  train_argv = ['-m', 'experiments.rl_train', f'--config={_CONFIG.value}',
                f'--workdir={workdir}', *overrides]
  train_command = 'python ' + shlex.join(train_argv)
  info = print_run_info({'workdir': workdir, 'train_command': train_command})
  wall_s = None
  if os.path.exists(os.path.join(workdir, 'summary.json')):
    print(f'{workdir} holds a finished run: recording it untimed', flush=True)
  else:
    t0 = time.perf_counter()
    # A child process, so the timing is the user's: interpreter start, jax
    # set-up and every compile included.
    rc = subprocess.run([sys.executable, *train_argv], check=False).returncode
    if rc != 0:
      print(f'error: {train_command} exited with {rc}; nothing recorded',
            file=sys.stderr, flush=True)
      sys.exit(rc)
    wall_s = time.perf_counter() - t0
  result = demo.demo_result(workdir, wall_s=wall_s)
  result.update(config_file=_CONFIG.value, train_command=train_command)
  common.finish(_NAME.value, {k: v for k, v in info.items()
                              if k not in ('workdir', 'train_command')},
                result)


if __name__ == '__main__':
  app.run(main)
