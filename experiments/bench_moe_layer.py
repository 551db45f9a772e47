"""EP MoE layer: static vs balanced placement on 8 simulated CPU devices.

  python -m experiments.bench_moe_layer --json
"""
import dataclasses
import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

from absl import app, flags  # pylint: disable=g-import-not-at-top

from experiments import common
from foremoe_jax.benchmarks import moe_layer
from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.utils.run_info import print_run_info

_JSON = flags.DEFINE_bool('json', False, 'Print only setup + one JSON line.')
_TOKENS = flags.DEFINE_integer('tokens', 4096, 'Tokens per micro-batch.')
_REPEATS = flags.DEFINE_integer('repeats', 7, 'Interleaved repetitions.')


def main(argv):
  del argv
  cfg = moe_layer.MoELayerBench(tokens=_TOKENS.value, repeats=_REPEATS.value)
  run = print_run_info({'bench': 'moe_layer', **dataclasses.asdict(cfg)})
  result = moe_layer.run(cfg, ep.make_mesh(1, 8))
  if not _JSON.value:
    for k, v in result.items():
      print(f'{k:>28}: {v}')
  common.finish('bench_moe_layer', run, result)


if __name__ == '__main__':
  app.run(main)
