"""The expert compute alone: grouped SwiGLU kinds vs a dense batched GEMM.

  python -m experiments.bench_grouped_gemm --json               # CPU shapes
  JAX_PLATFORMS=cuda python -m experiments.bench_grouped_gemm --device=gpu \
      --json          # one device of a Qwen3-30B-A3B layer at EP 8

Each kind of `grouped_swiglu` (--kinds; GPU: the Triton grouped matmul
'pallas' and XLA's 'ragged_dot') runs forward+backward on one device's
rows, is checked against a float32 reference, and is timed beside a dense
batched einsum of the same useful rows split evenly (the most a grouped
kernel could hope for). Prints the setup, one line per kind, then one
JSON line, also written to results/bench_grouped_gemm[_gpu].json:
{"check": {kind: error}, "seconds", "tflops", "efficiency_vs_batched",
"pallas_speedup_vs_ragged_dot", "complete", ...}. The logic lives in
foremoe_jax/benchmarks/grouped_gemm.py; `make gpu-check` runs it after the
MSA bench when time is left.
"""
import dataclasses
import time

from absl import app, flags

from experiments import common
from foremoe_jax.benchmarks import grouped_gemm
from foremoe_jax.utils.run_info import print_run_info

START = time.monotonic()  # the soft deadline counts from the import

_JSON = flags.DEFINE_bool('json', False, 'Print only setup + one JSON line.')
_DEVICE = flags.DEFINE_enum(
    'device', 'cpu', ['cpu', 'gpu'],
    'cpu: small shapes, the CPU kinds; gpu: a Qwen3-30B-A3B layer\'s device '
    'share, pallas vs ragged_dot.')
_DRY_RUN = flags.DEFINE_bool(
    'dry_run', False, 'The GPU run\'s kinds at the CPU shapes (tests the '
    'plumbing on CPU, measures nothing).')
_KINDS = flags.DEFINE_list('kinds', None, 'grouped_swiglu kinds to time '
                           '(default: by --device).')
_REPEATS = flags.DEFINE_integer('repeats', None, 'Interleaved repetitions.')
_DEADLINE = flags.DEFINE_float(
    'deadline_s', None, 'A soft time limit in seconds from the start: no '
    'phase starts past it, and the JSON is still written.')


def main(argv):
  del argv
  kw = {}
  if _DEVICE.value == 'cpu' or _DRY_RUN.value:
    kw.update(grouped_gemm.CPU)
    if _DEVICE.value == 'gpu':
      kw['kinds'] = grouped_gemm.GroupedGemmBench.kinds
  if _KINDS.value:
    kw['kinds'] = tuple(_KINDS.value)
  if _REPEATS.value:
    kw['repeats'] = _REPEATS.value
  cfg = grouped_gemm.GroupedGemmBench(**kw)
  name = 'bench_grouped_gemm' + ('_gpu' if _DEVICE.value == 'gpu' else '')
  run = print_run_info({'bench': name, 'device': _DEVICE.value,
                        'dry_run': _DRY_RUN.value, **dataclasses.asdict(cfg)})
  deadline = None if _DEADLINE.value is None else START + _DEADLINE.value
  result = grouped_gemm.run(
      cfg, log=common.progress(_JSON.value), deadline=deadline)
  common.finish(name, run, result)


if __name__ == '__main__':
  app.run(main)
