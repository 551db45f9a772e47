"""Runs an entry point as several local processes that share one mesh.

  python -m experiments.launch --num_processes=2 --devices_per_process=4 -- \
    experiments.rl_train --config=configs/tiny.py --workdir=/tmp/run

Each process gets `devices_per_process` simulated CPU devices and the
FOREMOE_* variables that `foremoe_jax.utils.distributed.initialize_from_env`
reads, so the 2 x 4 devices above hold the config's 8-device mesh (tiny:
1 data x 8 expert) as one process with 8 would. Output lines carry a `[pI]`
prefix; experiments.rl_train prints its progress from process 0 only (the
others print only warnings and errors), and gloo's connection lines are
dropped. When a process fails the others are stopped and this exits with
its status. On a cluster, start the entry point once per host instead
(WORKSPACE.md, "Several processes").
"""
import os
import sys

from absl import app, flags

from foremoe_jax.utils import cli, launcher

# Bounded: absl refuses a bad count as a flag error, before any process.
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', 2,
                                      'Processes to start.', lower_bound=1)
_DEVICES = flags.DEFINE_integer('devices_per_process', 4,
                                'Simulated CPU devices per process.',
                                lower_bound=1)


def main(argv):
  if len(argv) < 2:
    raise app.UsageError('usage: python -m experiments.launch [flags] -- '
                         'MODULE [MODULE FLAGS]')
  # A child's resume hint (experiments.rl_train) names this whole launch.
  os.environ[cli.RERUN_ENV] = cli.rerun_command('experiments.launch',
                                                sys.argv[1:])
  sys.exit(launcher.launch(argv[1], argv[2:], _NUM_PROCESSES.value,
                           _DEVICES.value))


if __name__ == '__main__':
  app.run(main)
