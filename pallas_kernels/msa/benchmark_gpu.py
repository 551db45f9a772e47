"""MSA Pallas kernels vs cuDNN flash attention on one NVIDIA GPU.

The library behind `experiments.bench_msa --device=gpu` (`make gpu-check`).
Per sequence length, in interleaved repetitions within one process:

  prefill  dense: jax.nn.dot_product_attention(implementation='cudnn'),
           causal GQA; msa: kernels (a) selection + (b) sparse forward, end
           to end, plus each alone.
  train    the same with the gradient of sum(out) w.r.t. q, k, v
           (msa: kernel (c), the atomics backward).
  decode   one new token per sequence against a full cache of the same
           length: dense attention over the cache vs kernels (a) + (d).

Achieved TFLOP/s counts the formula's FLOPs (docs/design.md §6.6: dense
causal 4*r*D*N/2 per query and group, MSA 2*dI*N/2 + 4*r*D*K*B), so it is
useful work per second, not what the hardware executed (padding and masked
columns are not counted). The FLOP ratio is printed beside the paper's
reported speedups (14.2x prefill, 7.6x decode).

Letter key: B batch, T tokens, H query heads, G groups, R heads per group,
D head dim, I index head dim, K selected blocks.
"""
from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.msa import benchmark
from pallas_kernels.msa import pallas_path
from pallas_kernels.msa import reference
from pallas_kernels.msa import select_kernel

PAPER_PREFILL_SPEEDUP = 14.2
PAPER_DECODE_SPEEDUP = 7.6


@dataclasses.dataclass(frozen=True)
class GPUBench:
  seq_lens: tuple[int, ...] = (8192, 16384, 32768, 65536, 131072)
  groups: int = 4             # G
  heads_per_group: int = 16   # r (the paper's ratio uses r = 16)
  head_dim: int = 128         # D
  index_dim: int = 128        # dI
  block_size: int = 128       # B in the formula
  top_k: int = 16             # K
  dtype: str = 'bfloat16'     # cuDNN flash attention needs bf16 / f16
  decode_batch: int = 8
  train_max_len: int = 32768  # fwd+bwd timed up to here
  repeats: int = 5            # interleaved
  check_len: int = 2048       # end-to-end error vs the dense reference
  seed: int = 0
  dense_impl: str = 'cudnn'   # 'xla' and interpret=True: a CPU dry run
  interpret: bool = False


def prefill_flops(cfg: GPUBench, n: int) -> tuple[float, float]:
  """(dense, msa) forward FLOPs of one length-n sequence, all groups."""
  r, d, di = cfg.heads_per_group, cfg.head_dim, cfg.index_dim
  dense = 4 * r * d * n / 2 * n * cfg.groups
  msa = (2 * di * n / 2 + 4 * r * d * cfg.top_k * cfg.block_size) * n * \
      cfg.groups
  return dense, msa


def decode_flops(cfg: GPUBench, n: int) -> tuple[float, float]:
  """(dense, msa) FLOPs of one new token against a cache of n, all groups."""
  r, d, di = cfg.heads_per_group, cfg.head_dim, cfg.index_dim
  kb = min(cfg.top_k * cfg.block_size, n)
  return 4 * r * d * n * cfg.groups, (2 * di * n + 4 * r * d * kb) * cfg.groups


def _inputs(cfg: GPUBench, b: int, t: int, s: int):
  ks = jax.random.split(jax.random.key(cfg.seed), 5)
  g, r, d, di = cfg.groups, cfg.heads_per_group, cfg.head_dim, cfg.index_dim
  dt = jnp.dtype(cfg.dtype)
  n = jax.random.normal
  return (n(ks[0], (b, t, g * r, d), dt), n(ks[1], (b, s, g, d), dt),
          n(ks[2], (b, s, g, d), dt), n(ks[3], (b, t, g, di), jnp.float32),
          n(ks[4], (b, s, di), jnp.float32))


def dense_prefill(q_BTHD, k_BTGD, v_BTGD, implementation='cudnn'):
  return jax.nn.dot_product_attention(q_BTHD, k_BTGD, v_BTGD, is_causal=True,
                                      implementation=implementation)


def _grad_of_sum(attn):
  def loss(q, k, v):
    out = attn(q, k, v)
    out = out[0] if isinstance(out, tuple) else out
    return jnp.sum(out.astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2))


def _decode_impl(cfg: GPUBench) -> str:
  """'cudnn' when it accepts a one-token query with per-sequence lengths."""
  if cfg.dense_impl != 'cudnn':
    return cfg.dense_impl
  q, k, v, _, _ = _inputs(cfg, 2, 1, 256)
  try:
    jax.block_until_ready(jax.jit(functools.partial(
        benchmark.dense_decode, implementation='cudnn'))(
            q[:, 0], k, v, jnp.array([256, 100], jnp.int32)))
    return 'cudnn'
  except Exception:  # pylint: disable=broad-except
    return 'xla'


def run_length(cfg: GPUBench, t: int, decode_impl: str) -> dict:
  kw = dict(block_size=cfg.block_size, top_k=cfg.top_k)
  q, k, v, qi, ki = _inputs(cfg, 1, t, t)
  off = jnp.zeros((1,), jnp.int32)
  msa = functools.partial(pallas_path.msa_attention, q_offset=0,
                          backend='gpu', interpret=cfg.interpret, **kw)
  select = functools.partial(select_kernel.select_blocks_BGTK, backend='gpu',
                             interpret=cfg.interpret, **kw)
  sel = jax.jit(select)(qi, ki, off)
  main = lambda q, k, v, sel: pallas_path.sparse_attention(
      q, k, v, sel, off, cfg.block_size, 'gpu', cfg.interpret)
  dense = functools.partial(dense_prefill, implementation=cfg.dense_impl)
  fns = {'dense': (dense, (q, k, v)),
         'msa': (msa, (q, k, v, qi, ki)),
         'index': (select, (qi, ki, off)),
         'main': (main, (q, k, v, sel))}
  if t <= cfg.train_max_len:
    fns['dense_train'] = (_grad_of_sum(dense), (q, k, v))
    fns['msa_train'] = (_grad_of_sum(lambda q, k, v: main(q, k, v, sel)),
                        (q, k, v))
  med = benchmark.measure(fns, cfg.repeats)
  dense_f, msa_f = prefill_flops(cfg, t)
  row = {
      'seq_len': t,
      'dense_s': med['dense'], 'msa_s': med['msa'],
      'index_s': med['index'], 'main_s': med['main'],
      'speedup': med['dense'] / med['msa'],
      'flop_ratio': dense_f / msa_f,
      'dense_tflops': dense_f / med['dense'] / 1e12,
      'msa_tflops': msa_f / med['msa'] / 1e12,
  }
  if 'msa_train' in med:
    row.update(dense_train_s=med['dense_train'], msa_train_s=med['msa_train'],
               train_speedup_main_only=med['dense_train'] / med['msa_train'])
  del q, k, v, qi, ki, sel
  try:
    row.update(run_decode(cfg, t, decode_impl))
  except Exception as e:  # pylint: disable=broad-except
    row['decode_error'] = f'{type(e).__name__}: {e}'[:2000]
  return {key: (round(val, 6) if isinstance(val, float) else val)
          for key, val in row.items()}


def run_decode(cfg: GPUBench, s: int, impl: str) -> dict:
  b = cfg.decode_batch
  kw = dict(block_size=cfg.block_size, top_k=cfg.top_k)
  q, k, v, qi, ki = _inputs(cfg, b, 1, s)
  lengths = jnp.full((b,), s, jnp.int32)
  dense = functools.partial(benchmark.dense_decode, implementation=impl)
  msa = functools.partial(pallas_path.msa_decode, backend='gpu',
                          interpret=cfg.interpret, **kw)
  med = benchmark.measure(
      {'dense': (dense, (q[:, 0], k, v, lengths)),
       'msa': (msa, (q[:, 0], k, v, qi[:, 0], ki, lengths))}, cfg.repeats)
  dense_f, msa_f = decode_flops(cfg, s)
  return {'decode_dense_s': med['dense'], 'decode_msa_s': med['msa'],
          'decode_speedup': med['dense'] / med['msa'],
          'decode_flop_ratio': dense_f / msa_f}


def reference_error(cfg: GPUBench) -> dict:
  """max |msa kernels - dense reference| at check_len, f32 reference."""
  kw = dict(block_size=cfg.block_size, top_k=cfg.top_k)
  q, k, v, qi, ki = _inputs(cfg, 1, cfg.check_len, cfg.check_len)
  out, aux = jax.jit(functools.partial(
      pallas_path.msa_attention, q_offset=0, backend='gpu', interpret=cfg.interpret,
      **kw))(q, k, v, qi, ki)
  f32 = lambda x: x.astype(jnp.float32)
  want, want_aux = jax.jit(functools.partial(reference.msa_attention, **kw))(
      f32(q), f32(k), f32(v), qi, ki)
  same = bool(np.array_equal(np.sort(aux['sel_BGTK'], -1),
                             np.sort(want_aux['sel_BGTK'], -1)))
  return {'selection_equal': same,
          'max_abs_err': float(jnp.max(jnp.abs(f32(out) - want)))}


def _log_row(row: dict):
  print('# row ' + json.dumps(row), flush=True)


def run(cfg: GPUBench, log=_log_row) -> dict:
  decode_impl = _decode_impl(cfg)
  try:
    check = reference_error(cfg)
  except Exception as e:  # pylint: disable=broad-except
    check = {'error': f'{type(e).__name__}: {e}'[:2000]}
  log({'reference_check': check, 'decode_dense_impl': decode_impl})
  rows = []
  for t in cfg.seq_lens:
    try:
      rows.append(run_length(cfg, t, decode_impl))
    except Exception as e:  # pylint: disable=broad-except
      # Keep the lengths that ran; say why this one did not.
      rows.append({'seq_len': t, 'error': f'{type(e).__name__}: {e}'[:2000]})
    log(rows[-1])
  ok = [row for row in rows if 'error' not in row]
  last = ok[-1] if ok else {}
  return {
      'bench': 'msa_gpu',
      'results': rows,
      'reference_check_len': cfg.check_len,
      'reference_check': check,
      'dense_prefill_impl': cfg.dense_impl,
      'dense_decode_impl': decode_impl,
      'paper_prefill_speedup': PAPER_PREFILL_SPEEDUP,
      'paper_decode_speedup': PAPER_DECODE_SPEEDUP,
      'max_len': last.get('seq_len'),
      'prefill_speedup_at_max_len': last.get('speedup'),
      'prefill_flop_ratio_at_max_len': last.get('flop_ratio'),
      'decode_speedup_at_max_len': last.get('decode_speedup'),
      'decode_flop_ratio_at_max_len': last.get('decode_flop_ratio'),
  }
