"""Main job: supervised warm start, then GRPO with routing foresight.

Intentionally kept short: the logic lives in foremoe_jax.rl.trainer.

  python -m experiments.rl_train --config=configs/tiny.py --workdir=/tmp/run
  (overrides: --config.rl.steps=10 --config.planner.method=static ...)
"""
import json
import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

from absl import app, flags, logging  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags

from foremoe_jax.rl import trainer
from foremoe_jax.utils.run_info import print_run_info

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/tiny.py')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Output directory.',
                               required=True)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every write at INFO.
  print_run_info({'config': _CONFIG.value.to_dict()})
  summary = trainer.train(_CONFIG.value, _WORKDIR.value)
  print(json.dumps(summary, default=str))


if __name__ == '__main__':
  app.run(main)
