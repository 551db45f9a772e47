"""MSA vs dense attention on CPU: the library behind experiments/bench_msa.

Per sequence length it times, in interleaved repetitions within one process,
  dense: jax.nn.dot_product_attention, causal GQA, and
  msa:   the CPU (XLA) path end to end, index branch included,
plus the index branch alone (its share of msa), and reports the FLOP ratio
of DESIGN.md section 6 for the same shape.

The dense baseline runs jax.nn.dot_product_attention over query chunks
(lax.map, a causal mask per chunk): one call would hold [H, T, T] f32 logits
(64 GB at 32k with 16 heads). Chunking keeps its FLOPs (XLA computes the full
[T, S] square, masked, either way). The formula's dense term counts only the
causal half, so dense_s reflects twice the formula's dense FLOPs.

Letter key: B batch, T tokens, H query heads, G groups, D head dim, I index
head dim.
"""
from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.msa import reference
from pallas_kernels.msa import xla


@dataclasses.dataclass(frozen=True)
class MSABench:
  seq_lens: tuple[int, ...] = (4096, 8192, 16384, 32768)
  groups: int = 4            # G
  heads_per_group: int = 4   # r
  head_dim: int = 128        # D
  index_dim: int = 128       # dI
  block_size: int = 128      # B in the formula (C in shape names)
  top_k: int = 16            # K
  repeats: int = 3           # interleaved; 2 past 16k to bound the run time
  dense_q_chunk: int = 256
  check_len: int = 2048      # the reference is dense: check at this length
  seed: int = 0


def flop_ratio(*, r: int, d: int, di: int, block: int, k: int, n: int) -> float:
  """Dense / MSA compute per group, averaged over causal positions (DESIGN 6).

  dense 4*r*D*N/2; MSA 2*dI*N/2 (index) + 4*r*D*K*B (main).
  """
  dense = 4 * r * d * n / 2
  msa = 2 * di * n / 2 + 4 * r * d * k * block
  return dense / msa


def paper_flop_ratio() -> float:
  return flop_ratio(r=16, d=128, di=128, block=128, k=16, n=2**20)


def _inputs(cfg: MSABench, t: int):
  ks = jax.random.split(jax.random.key(cfg.seed), 5)
  g, r, d, di = cfg.groups, cfg.heads_per_group, cfg.head_dim, cfg.index_dim
  n = jax.random.normal
  return (n(ks[0], (1, t, g * r, d)), n(ks[1], (1, t, g, d)),
          n(ks[2], (1, t, g, d)), n(ks[3], (1, t, g, di)), n(ks[4], (1, t, di)))


def dense_attention(q_BTHD, k_BTGD, v_BTGD, q_chunk: int):
  """Causal GQA with jax.nn.dot_product_attention, one query chunk at a time."""
  b, t, h, d = q_BTHD.shape
  q_chunk = min(q_chunk, t)
  n = t // q_chunk
  q_NBCHD = q_BTHD.reshape(b, n, q_chunk, h, d).transpose(1, 0, 2, 3, 4)

  def chunk(args):
    i, q = args
    qpos = i * q_chunk + jnp.arange(q_chunk)
    mask = qpos[:, None] >= jnp.arange(t)[None, :]
    return jax.nn.dot_product_attention(q, k_BTGD, v_BTGD,
                                        mask=mask[None, None])

  out = jax.lax.map(chunk, (jnp.arange(n), q_NBCHD))
  return out.transpose(1, 0, 2, 3, 4).reshape(b, t, h, d)


def _time(fn, args) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def run_length(cfg: MSABench, t: int) -> dict:
  q, k, v, qi, ki = _inputs(cfg, t)
  kw = dict(block_size=cfg.block_size, top_k=cfg.top_k)
  dense = jax.jit(functools.partial(dense_attention, q_chunk=cfg.dense_q_chunk))
  msa = jax.jit(functools.partial(xla.msa_attention, **kw))
  index = jax.jit(functools.partial(xla.selection_BGTK, **kw))
  # Compiled ahead of time, not warmed up by a run: a dense call at 32k takes
  # a minute or two, and the repetitions are interleaved anyway.
  fns = {'dense': (dense, (q, k, v)), 'msa': (msa, (q, k, v, qi, ki)),
         'index': (index, (qi, ki))}
  fns = {name: (fn.lower(*args).compile(), args)
         for name, (fn, args) in fns.items()}
  times = {name: [] for name in fns}
  repeats = cfg.repeats if t <= 16384 else min(cfg.repeats, 2)
  for _ in range(repeats):
    for name, (fn, args) in fns.items():
      times[name].append(_time(fn, args))
  med = {name: statistics.median(ts) for name, ts in times.items()}
  return {
      'seq_len': t,
      'dense_s': round(med['dense'], 4),
      'msa_s': round(med['msa'], 4),
      'speedup': round(med['dense'] / med['msa'], 3),
      'flop_ratio': round(flop_ratio(
          r=cfg.heads_per_group, d=cfg.head_dim, di=cfg.index_dim,
          block=cfg.block_size, k=cfg.top_k, n=t), 3),
      'index_fraction': round(med['index'] / med['msa'], 3),
      'index_s': round(med['index'], 4),
      'repeats': repeats,
  }


def reference_error(cfg: MSABench) -> float:
  """max |CPU path - reference| on out, at check_len (the reference is dense)."""
  q, k, v, qi, ki = _inputs(cfg, cfg.check_len)
  kw = dict(block_size=cfg.block_size, top_k=cfg.top_k)
  out, aux = jax.jit(functools.partial(xla.msa_attention, **kw))(
      q, k, v, qi, ki)
  want, want_aux = jax.jit(functools.partial(reference.msa_attention, **kw))(
      q, k, v, qi, ki)
  same_sets = bool(np.array_equal(np.sort(aux['sel_BGTK'], -1),
                                  np.sort(want_aux['sel_BGTK'], -1)))
  if not same_sets:
    return float('inf')
  return float(jnp.max(jnp.abs(out - want)))


def run(cfg: MSABench, log=print) -> dict:
  rows = []
  for t in cfg.seq_lens:
    rows.append(run_length(cfg, t))
    log(rows[-1])
  last = rows[-1]
  return {
      'results': rows,
      'max_abs_err_vs_reference': reference_error(cfg),
      'reference_check_len': cfg.check_len,
      'paper_flop_ratio': round(paper_flop_ratio(), 1),
      'target_speedup_at_max_len': round(0.7 * last['flop_ratio'], 3),
      'speedup_over_target': round(last['speedup'] /
                                   (0.7 * last['flop_ratio']), 3),
      'speedup_grows_with_length': all(
          a['speedup'] < b['speedup'] for a, b in zip(rows, rows[1:])),
  }
