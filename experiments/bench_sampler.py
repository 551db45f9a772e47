"""Sampler decode speed: KV cache vs recompute, and the routing record's cost.

  python -m experiments.bench_sampler --json

The benchmark body is foremoe_jax/benchmarks/sampler.py.
"""
import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

from absl import app, flags  # pylint: disable=g-import-not-at-top

from experiments import common
from configs import tiny
from foremoe_jax import config as config_lib
from foremoe_jax.benchmarks import sampler as sampler_bench
from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.tasks import get_task
from foremoe_jax.utils.run_info import print_run_info

_JSON = flags.DEFINE_bool('json', False, 'Print only setup + one JSON line.')
_PROMPTS = flags.DEFINE_integer('prompts', 8, 'Prompts per batch.')
_GENERATIONS = flags.DEFINE_integer('generations', 8, 'Samples per prompt.')
_NEW_TOKENS = flags.DEFINE_integer('new_tokens', 256, 'Tokens to decode.')
_REPEATS = flags.DEFINE_integer('repeats', 7, 'Interleaved repetitions.')
_RECOMPUTE_STEPS = flags.DEFINE_integer(
    'recompute_steps', 16, 'Steps timed for the recompute baseline.')


def main(argv):
  del argv
  cfg = tiny.get_config()
  task = get_task(cfg.task)
  total = task.prompt_len + _NEW_TOKENS.value
  block = cfg.model.msa_block_size
  cfg.model.max_seq_len = -(-total // block) * block  # Room for 256 tokens.
  config_lib.validate_config(cfg)
  mesh = ep.make_mesh(1, 8)
  run = print_run_info({'bench': 'sampler', 'model': cfg.model.to_dict(),
                  'sampler': cfg.sampler.to_dict(), 'mesh': dict(mesh.shape),
                  'prompts': _PROMPTS.value, 'generations': _GENERATIONS.value,
                  'new_tokens': _NEW_TOKENS.value, 'repeats': _REPEATS.value,
                  'recompute_steps': _RECOMPUTE_STEPS.value})
  prompts_NP = task.sample_prompts(cfg.seed, _PROMPTS.value)
  result = sampler_bench.run(
      cfg, mesh, prompts_NP, num_generations=_GENERATIONS.value,
      new_tokens=_NEW_TOKENS.value, repeats=_REPEATS.value,
      recompute_steps=_RECOMPUTE_STEPS.value)
  if not _JSON.value:
    for k, v in result.items():
      print(f'{k:>34}: {v}')
  common.finish('bench_sampler', run, result)


if __name__ == '__main__':
  app.run(main)
