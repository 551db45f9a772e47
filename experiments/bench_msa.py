"""MSA (CPU XLA path) vs dense causal GQA attention, 4k to 32k tokens.

  python -m experiments.bench_msa --json

Prints the setup, one row per length (unless --json), then one JSON line:
{"results": [{seq_len, dense_s, msa_s, speedup, flop_ratio, index_fraction,
...}], "max_abs_err_vs_reference", "paper_flop_ratio", ...}. The logic lives
in pallas_kernels/msa/benchmark.py.
"""
import dataclasses
import json

from absl import app, flags

from foremoe_jax.utils.run_info import print_run_info
from pallas_kernels.msa import benchmark

_JSON = flags.DEFINE_bool('json', False, 'Print only setup + one JSON line.')
_LENS = flags.DEFINE_list('seq_lens', ['4096', '8192', '16384', '32768'],
                          'Sequence lengths (65536 fits in memory but adds '
                          'about 6 minutes of dense time).')
_BLOCK = flags.DEFINE_integer('block_size', 128, 'Key block size B.')
_TOP_K = flags.DEFINE_integer('top_k', 16, 'Blocks kept per query K.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Interleaved repetitions.')


def main(argv):
  del argv
  cfg = benchmark.MSABench(seq_lens=tuple(int(x) for x in _LENS.value),
                           block_size=_BLOCK.value, top_k=_TOP_K.value,
                           repeats=_REPEATS.value)
  print_run_info({'bench': 'msa', **dataclasses.asdict(cfg)})
  result = benchmark.run(cfg, log=(lambda row: None) if _JSON.value else print)
  print(json.dumps(result))


if __name__ == '__main__':
  app.run(main)
