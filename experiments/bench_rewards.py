"""Verifier cost per RL step: math-verify in-process vs reward worker processes.

  python -m experiments.bench_rewards --json

The benchmark body is foremoe_jax/benchmarks/rewards.py; a dataset task
picks the worker count with --config.task_kwargs.reward_workers.
"""
from absl import app, flags

from experiments import common
from foremoe_jax.benchmarks import rewards as rewards_bench
from foremoe_jax.utils.run_info import print_run_info

_JSON = flags.DEFINE_bool('json', False, 'Print only setup + one JSON line.')
_COMPLETIONS = flags.DEFINE_integer('completions', 512,
                                    'Completions scored per step.')
_WORKERS = flags.DEFINE_list('workers', ['1', '2'], 'Worker counts to time.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Interleaved repetitions.')
_REWARD = flags.DEFINE_string('reward', 'math', 'Verifier name.')


def main(argv):
  del argv
  workers = tuple(int(w) for w in _WORKERS.value)
  run = print_run_info({'bench': 'rewards', 'completions': _COMPLETIONS.value,
                        'workers': list(workers), 'repeats': _REPEATS.value,
                        'reward': _REWARD.value})
  result = rewards_bench.run(_COMPLETIONS.value, workers, _REPEATS.value,
                             _REWARD.value)
  if not _JSON.value:
    for k, v in result.items():
      print(f'{k:>30}: {v}')
  common.finish('bench_rewards', run, result)


if __name__ == '__main__':
  app.run(main)
