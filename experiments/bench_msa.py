"""MSA vs dense causal GQA attention: CPU XLA path, or the GPU kernels.

  python -m experiments.bench_msa --json                # CPU, 4k to 32k
  JAX_PLATFORMS=cuda python -m experiments.bench_msa --device=gpu --json \
      --deadline_s=300                                  # vs cuDNN, 8k-128k

Prints the setup, one row per length (unless --json), then one JSON line,
also written to results/bench_msa.json (results/bench_msa_gpu.json on GPU):
CPU {"results": [{seq_len, causal_dense_s, dense_s, msa_s,
speedup_vs_causal_dense, speedup, flop_ratio, index_fraction, ...}],
"decode": [{cache_len, batch, dense_s, msa_s, speedup, flop_ratio}] (longest
cache last), the targets and how far each is met, ...}; causal_dense is
flash-style (chunks above the diagonal skipped), dense is the masked square.
GPU {"bench": "msa_gpu", "ceilings": {...}, "reference_check": {...},
"results": [{seq_len, dense_s, msa_s, index_s, index_fused_s, main_s,
speedup, flop_ratio, *_tflops, *_train_s, spread}], "decode": [{cache_len,
decode_dense_s, decode_msa_s, decode_speedup, ...}], "complete", ...}; a
phase cut by --deadline_s reads {"skipped": "deadline"}. The logic lives in
pallas_kernels/msa/benchmark.py and benchmark_gpu.py.
"""
import dataclasses
import time

from absl import app, flags

from experiments import common
from foremoe_jax.utils.run_info import print_run_info
from pallas_kernels.msa import benchmark

START = time.monotonic()  # the soft deadline counts from the import

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
_DECODE_LENS = flags.DEFINE_list('decode_lens', None,
                                 'GPU: decode cache lengths (default 32k, '
                                 '128k).')
_DRY_RUN = flags.DEFINE_bool(
    'dry_run', False, 'GPU bench on CPU at toy shapes: the kernels in '
    'interpret mode, XLA dense attention (tests the bench, measures nothing).')
_DEADLINE = flags.DEFINE_float(
    'deadline_s', None, 'GPU: a soft time limit in seconds from the start. '
    'No measurement starts past it; the rest is recorded as skipped and the '
    'JSON is still written.')


def main(argv):
  del argv
  kw = dict(block_size=_BLOCK.value, top_k=_TOP_K.value)
  if _LENS.value:
    kw['seq_lens'] = tuple(int(x) for x in _LENS.value)
  if _REPEATS.value:
    kw['repeats'] = _REPEATS.value
  if _DEVICE.value == 'gpu':
    from pallas_kernels.msa import benchmark_gpu  # pylint: disable=g-import-not-at-top
    if _DECODE_LENS.value:
      kw['decode_lens'] = tuple(int(x) for x in _DECODE_LENS.value)
    if _DRY_RUN.value:
      kw.update(benchmark_gpu.DRY_RUN)
    cfg = benchmark_gpu.GPUBench(**kw)
    lib = benchmark_gpu
  else:
    cfg = benchmark.MSABench(**kw)
    lib = benchmark
  run = print_run_info({'bench': f'msa_{_DEVICE.value}',
                        **dataclasses.asdict(cfg)})
  kw = {'log': lambda row: None} if _JSON.value else {}
  if _DEADLINE.value is not None:
    if _DEVICE.value != 'gpu':
      raise app.UsageError('--deadline_s applies to --device=gpu only.')
    kw['deadline'] = START + _DEADLINE.value
  result = lib.run(cfg, **kw)
  common.finish('bench_msa' if _DEVICE.value == 'cpu' else 'bench_msa_gpu',
                run, result)


if __name__ == '__main__':
  app.run(main)
