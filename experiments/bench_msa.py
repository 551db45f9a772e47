"""MSA vs dense causal GQA attention: CPU XLA path, or the GPU kernels.

  python -m experiments.bench_msa --json                # CPU, 4k to 32k
  JAX_PLATFORMS=cuda python -m experiments.bench_msa --device=gpu --json \
      --seq_lens=8192,16384,32768,65536,131072           # vs cuDNN

Prints the setup, one row per length (unless --json), then one JSON line,
also written to results/bench_msa.json (results/bench_msa_gpu.json on GPU):
CPU {"results": [{seq_len, causal_dense_s, dense_s, msa_s,
speedup_vs_causal_dense, speedup, flop_ratio, index_fraction, ...}],
"decode": [{cache_len, batch, dense_s, msa_s, speedup, flop_ratio}] (longest
cache last), the targets and how far each is met, ...}; causal_dense is
flash-style (chunks above the diagonal skipped), dense is the masked square.
GPU {"bench": "msa_gpu", "results": [{seq_len, dense_s, msa_s, speedup,
flop_ratio, dense_tflops, msa_tflops, decode_*, ...}], ...}. The logic lives
in pallas_kernels/msa/benchmark.py and benchmark_gpu.py.
"""
import dataclasses

from absl import app, flags

from experiments import common
from foremoe_jax.utils.run_info import print_run_info
from pallas_kernels.msa import benchmark

_JSON = flags.DEFINE_bool('json', False, 'Print only setup + one JSON line.')
_DEVICE = flags.DEFINE_enum(
    'device', 'cpu', ['cpu', 'gpu'],
    'cpu: the XLA path vs chunked dense; gpu: the Pallas Triton kernels vs '
    'cuDNN flash attention (bf16).')
_LENS = flags.DEFINE_list('seq_lens', None,
                          'Sequence lengths (default: 4k-32k on CPU, where '
                          '65536 adds about 6 minutes of dense time; 8k-128k '
                          'on GPU).')
_BLOCK = flags.DEFINE_integer('block_size', 128, 'Key block size B.')
_TOP_K = flags.DEFINE_integer('top_k', 16, 'Blocks kept per query K.')
_REPEATS = flags.DEFINE_integer('repeats', None, 'Interleaved repetitions '
                                '(default 3 on CPU, 5 on GPU).')


def main(argv):
  del argv
  kw = dict(block_size=_BLOCK.value, top_k=_TOP_K.value)
  if _LENS.value:
    kw['seq_lens'] = tuple(int(x) for x in _LENS.value)
  if _REPEATS.value:
    kw['repeats'] = _REPEATS.value
  if _DEVICE.value == 'gpu':
    from pallas_kernels.msa import benchmark_gpu  # pylint: disable=g-import-not-at-top
    cfg = benchmark_gpu.GPUBench(**kw)
    lib = benchmark_gpu
  else:
    cfg = benchmark.MSABench(**kw)
    lib = benchmark
  run = print_run_info({'bench': f'msa_{_DEVICE.value}',
                        **dataclasses.asdict(cfg)})
  kw = {'log': lambda row: None} if _JSON.value else {}
  result = lib.run(cfg, **kw)
  common.finish('bench_msa' if _DEVICE.value == 'cpu' else 'bench_msa_gpu',
                run, result)


if __name__ == '__main__':
  app.run(main)
