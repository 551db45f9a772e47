"""Compiled memory and gradients of the training step under each remat policy.

  python -m experiments.remat_memory --json [--config=configs/tiny_msa.py]
      [--batch=16] [--seq_len=32]

The last line is one JSON object: per policy, XLA's memory analysis of the
compiled loss-and-gradient step (temp_bytes holds the saved activations) and
the largest gradient difference from 'none'.
"""
import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import json  # pylint: disable=g-import-not-at-top

from absl import flags
import jax

from foremoe_jax.benchmarks import remat
from foremoe_jax.model import expert_parallel
from foremoe_jax.utils import cli
from foremoe_jax.utils.run_info import print_run_info

_CONFIG = cli.define_config_file('configs/tiny_msa.py')
_BATCH = flags.DEFINE_integer('batch', 16, 'Sequences per step.')
_SEQ_LEN = flags.DEFINE_integer('seq_len', 32, 'Tokens per sequence.')
_JSON = flags.DEFINE_bool('json', False, 'Print only setup + one JSON line.')


def main(argv):
  del argv
  config = _CONFIG.value
  p = config.parallel
  print_run_info({'bench': 'remat_memory', 'model': config.model.to_dict(),
                  'mesh': [p.num_data, p.num_expert], 'batch': _BATCH.value,
                  'seq_len': _SEQ_LEN.value})
  mesh = expert_parallel.make_mesh(p.num_data, p.num_expert)
  # seq_len + 1 tokens: the model reads seq_len of them and predicts the next.
  tokens = jax.random.randint(jax.random.key(1),
                              (_BATCH.value, _SEQ_LEN.value + 1), 0,
                              config.model.vocab_size)
  result = remat.report(config.model, mesh, tokens)
  if not _JSON.value:
    for policy, r in result.items():
      print(f"{policy:>8}: kept for backward "
            f"{r['saved_residual_bytes'] / 2**20:7.2f} MiB | XLA temp "
            f"{r['temp_bytes'] / 2**20:7.2f} MiB | grad diff vs none "
            f"{r['grad_max_abs_diff_vs_none']:.1e}")
  print(json.dumps(result), flush=True)


if __name__ == '__main__':
  cli.run(main)
