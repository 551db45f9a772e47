"""Main job: supervised warm start, then GRPO with routing foresight.

Intentionally kept short: the logic lives in foremoe_jax.rl.trainer.

  python -m experiments.rl_train --config=configs/tiny.py --workdir=/tmp/run
  (overrides: --config.rl.steps=10 --config.planner.method=static ...)

Rerunning with the same --workdir resumes from its latest checkpoint; a
finished run is left as it is. SIGINT (Ctrl-C) or SIGTERM finishes the step
in flight, saves a checkpoint, prints how to resume and exits with status
128 + the signal number (130, 143), as a shell reports a signal. A bad flag
or config field is one line on stderr and exit status 2, before any work.

As one of several processes sharing one mesh (one per host on a cluster),
it joins the others first (`utils.distributed.initialize_from_env`); locally:
  python -m experiments.launch --num_processes=2 --devices_per_process=4 -- \
    experiments.rl_train --config=configs/tiny.py --workdir=/tmp/run
(WORKSPACE.md, "Several processes").
"""
import json
import os
import signal
import sys

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

from absl import flags, logging  # pylint: disable=g-import-not-at-top

from foremoe_jax import config as config_lib
from foremoe_jax.utils import cli, distributed, host_memory
from foremoe_jax.utils.preemption import PreemptionGuard
from foremoe_jax.utils.run_info import print_run_info

_CONFIG = cli.define_config_file('configs/tiny.py')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Output directory.',
                               required=True)


def _resume_command() -> str:
  """This run's command, runnable as printed (cli.rerun_command)."""
  return cli.rerun_command('experiments.rl_train', sys.argv[1:])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every write at INFO.
  config = _CONFIG.value
  if config.get('init_from_hf'):
    # The checkpoint fixes the architecture (as the trainer applies it), so
    # the checks and the printed config are those of the model that runs.
    from foremoe_jax import hf  # pylint: disable=g-import-not-at-top
    config.model = hf.model_config_from_hf(config.init_from_hf, config.model)
  config_lib.validate_config(config)  # Before any work (cli.run).
  # jax and the model load after the checks: a bad flag or config is its
  # line at once, not after the seconds these imports take.
  from foremoe_jax.rl import trainer  # pylint: disable=g-import-not-at-top
  # One of several processes (experiments.launch, a cluster): join them
  # before any jax work; a no-op when run alone.
  distributed.initialize_from_env()
  cli.check_mesh(config)  # One line naming what to change, not a traceback.
  # The processes print the same lines: process 0 prints them.
  distributed.quiet_unless_primary()
  # RSS stays flat over a long run (utils/host_memory.py, experiments.soak).
  pinned = host_memory.pin_mmap_threshold()
  p = config.parallel
  print_run_info({'config': config.to_dict(),
                  'mesh': f'{p.num_data} data x {p.num_expert} expert',
                  'mmap_threshold_pinned': pinned})
  with PreemptionGuard() as guard:
    try:
      summary = trainer.train(config, _WORKDIR.value, guard=guard)
    except trainer.NonFiniteError as e:
      print(f'error: {e}', file=sys.stderr, flush=True)
      sys.exit(1)
  if summary.get('preempted'):
    where = ('nothing saved yet: the warm start runs again'
             if summary['phase'] == 'warmstart' else
             f"step {summary['step']} saved in {summary['checkpoint_dir']}")
    name = signal.Signals(summary['signal']).name
    print(f'stopped by {name}: {where}; resume with: {_resume_command()}',
          flush=True)
    sys.exit(summary['exit_code'])
  print(json.dumps(summary, default=str))


if __name__ == '__main__':
  cli.run(main, interrupt_hint='the step in flight is not saved; resume '
          f'from the last checkpoint with: {_resume_command()}')
