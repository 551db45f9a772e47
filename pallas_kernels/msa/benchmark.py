"""MSA vs dense attention on CPU: the library behind experiments/bench_msa.

Prefill, per sequence length, timed in interleaved repetitions in one process:
  causal_dense: flash-style causal GQA (`causal_dense`): query chunk c visits
                key chunks 0..c only, with an online softmax. The strongest
                dense baseline, and the one `speedup_vs_causal_dense` uses.
  dense:        jax.nn.dot_product_attention over query chunks, each under a
                causal mask over all T keys (the masked square: twice the
                causal FLOPs). One call would hold [H, T, T] f32 logits (64 GB
                at 32k with 16 heads), hence the chunks. Kept as `speedup`
                for continuity with earlier runs.
  msa:          the CPU (XLA) path end to end, index branch included,
plus the index branch alone (its share of msa), and the FLOP ratio of the
MSA cost formula (`flop_ratio`: dense counts only the causal half).

Decode, per cache length: one new token for each of `decode_batch` sequences
against a full [B, S, G, D] cache, `xla.msa_decode` vs three dense decodes:
jax.nn.dot_product_attention with per-sequence lengths, the grouped einsum
a GQA user writes (`grouped_dense_decode`: a group's queries against their
one K/V), and `rows_dense_decode` (the cache read in row order).
`speedup` is against the fastest, `speedup_vs_jax_nn` against the first;
with the decode FLOP ratio of the same formula at one query position
(`decode_flop_ratio`).

Every row carries `spread`, (max - min) / median over the interleaved
repetitions; prefill rows also carry the speedup of each repetition.

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
  repeats: int = 3           # interleaved, at every length
  dense_q_chunk: int = 256
  causal_chunk: int = 512    # flash-style dense: query and key chunk
  decode_cache_lens: tuple[int, ...] = (8192, 32768, 131072)
  decode_batch: int = 4
  check_len: int = 2048      # the reference is dense: check at this length
  seed: int = 0


def flop_ratio(*, r: int, d: int, di: int, block: int, k: int, n: int) -> float:
  """Dense / MSA compute per group, averaged over causal positions.

  The compute model of docs/design.md §6.6: dense 4*r*D*N/2; MSA 2*dI*N/2
  (index) + 4*r*D*K*B (main).
  """
  dense = 4 * r * d * n / 2
  msa = 2 * di * n / 2 + 4 * r * d * k * block
  return dense / msa


def paper_flop_ratio() -> float:
  return flop_ratio(r=16, d=128, di=128, block=128, k=16, n=2**20)


def decode_flop_ratio(*, r: int, d: int, di: int, block: int, k: int,
                      n: int) -> float:
  """Dense / MSA compute of one new token against a cache of n, per group.

  The same terms as `flop_ratio` at one query position n instead of the
  causal average: dense 4*r*D*n; MSA 2*dI*n (index) + 4*r*D*min(K*B, n).
  """
  return 4 * r * d * n / (2 * di * n + 4 * r * d * min(k * block, n))


# The paper's reported decode speedup at a 1M-token cache.
PAPER_DECODE_SPEEDUP = 7.6


def _inputs(cfg: MSABench, t: int):
  ks = jax.random.split(jax.random.key(cfg.seed), 5)
  g, r, d, di = cfg.groups, cfg.heads_per_group, cfg.head_dim, cfg.index_dim
  n = jax.random.normal
  return (n(ks[0], (1, t, g * r, d)), n(ks[1], (1, t, g, d)),
          n(ks[2], (1, t, g, d)), n(ks[3], (1, t, g, di)), n(ks[4], (1, t, di)))


def dense_attention(q_BTHD, k_BTGD, v_BTGD, q_chunk: int):
  """Causal GQA with jax.nn.dot_product_attention, one query chunk at a time.

  Every chunk attends to all T keys under a causal mask: the masked square,
  twice the causal FLOPs. Kept as the naive baseline beside `causal_dense`.
  """
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


def causal_dense(q_BTHD, k_BTGD, v_BTGD, chunk: int = 512):
  """Flash-style causal GQA: key chunks above the diagonal are never touched.

  Query chunk c visits key chunks 0..c with an online softmax (running max,
  sum and output, merged chunk by chunk as flash attention does); only the
  diagonal chunk pays for a mask. Work is the causal half of the square plus
  one diagonal tile per chunk, the strongest dense baseline a user would run.
  The R heads of a group share each key chunk, so a tile is one
  [C*R, D] x [D, C] matmul per group.
  """
  b, t, h, d = q_BTHD.shape
  g = k_BTGD.shape[2]
  r = h // g
  c = min(chunk, t)
  if t % c:
    raise ValueError(f'causal_dense: T={t} must be a multiple of chunk={c}.')
  n = t // c
  f32 = jnp.float32
  scale = 1.0 / np.sqrt(d)
  # [B, N, G, C*R, D] queries and [B, N, G, C, D] keys/values per chunk.
  q_BNGXD = (q_BTHD.astype(f32) * scale).reshape(b, n, c, g, r, d).transpose(
      0, 1, 3, 2, 4, 5).reshape(b, n, g, c * r, d)
  k_BNGCD = k_BTGD.astype(f32).reshape(b, n, c, g, d).transpose(0, 1, 3, 2, 4)
  v_BNGCD = v_BTGD.astype(f32).reshape(b, n, c, g, d).transpose(0, 1, 3, 2, 4)
  # Row x of a chunk is token x // R of it; the diagonal tile's causal mask.
  diag_XC = (jnp.arange(c * r)[:, None] // r) >= jnp.arange(c)[None, :]

  def merge(carry, q_GXD, k_GCD, v_GCD, mask_XC=None):
    m_GX, l_GX, o_GXD = carry
    s_GXC = jnp.einsum('gxd,gcd->gxc', q_GXD, k_GCD)
    if mask_XC is not None:
      s_GXC = jnp.where(mask_XC, s_GXC, -jnp.inf)
    m_new = jnp.maximum(m_GX, s_GXC.max(axis=-1))
    p_GXC = jnp.exp(s_GXC - m_new[..., None])
    w_GX = jnp.exp(m_GX - m_new)
    return (m_new, w_GX * l_GX + p_GXC.sum(axis=-1),
            w_GX[..., None] * o_GXD + jnp.einsum('gxc,gcd->gxd', p_GXC, v_GCD))

  def one_chunk(q_GXD, i, k_NGCD, v_NGCD):
    init = (jnp.full((g, c * r), -jnp.inf, f32), jnp.zeros((g, c * r), f32),
            jnp.zeros((g, c * r, d), f32))
    # A while loop with a data-dependent trip count: chunks above the
    # diagonal are skipped, not computed and masked.
    below = jax.lax.fori_loop(
        0, i, lambda j, carry: merge(carry, q_GXD, k_NGCD[j], v_NGCD[j]), init)
    _, l_GX, o_GXD = merge(below, q_GXD, k_NGCD[i], v_NGCD[i], diag_XC)
    return o_GXD / l_GX[..., None]

  def one_sequence(q_NGXD, k_NGCD, v_NGCD):
    return jax.lax.map(lambda args: one_chunk(*args, k_NGCD, v_NGCD),
                       (q_NGXD, jnp.arange(n)))

  o_BNGXD = jax.vmap(one_sequence)(q_BNGXD, k_BNGCD, v_BNGCD)
  o_BTHD = o_BNGXD.reshape(b, n, g, c, r, d).transpose(0, 1, 3, 2, 4, 5)
  return o_BTHD.reshape(b, t, h, d).astype(q_BTHD.dtype)


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
  causal = jax.jit(functools.partial(causal_dense, chunk=cfg.causal_chunk))
  fns = {'dense': (dense, (q, k, v)), 'causal_dense': (causal, (q, k, v)),
         'msa': (msa, (q, k, v, qi, ki)), 'index': (index, (qi, ki))}
  fns = {name: (fn.lower(*args).compile(), args)
         for name, (fn, args) in fns.items()}
  times = {name: [] for name in fns}
  # As many at the longest length as at the others: its speedup is the one
  # against the target, and a median of two is only their mean (one
  # 32k run's two repetitions gave 3.19 and 2.54).
  repeats = cfg.repeats
  for _ in range(repeats):
    for name, (fn, args) in fns.items():
      times[name].append(_time(fn, args))
  med = {name: statistics.median(ts) for name, ts in times.items()}
  return {
      'seq_len': t,
      # Each repetition's own ratio: how much one run's number can vary.
      'speedup_vs_causal_dense_per_repeat': [
          round(c / m, 3) for c, m in zip(times['causal_dense'],
                                          times['msa'])],
      'spread': {name: round((max(ts) - min(ts)) / med[name], 3)
                 for name, ts in times.items()},
      'dense_s': round(med['dense'], 4),
      'msa_s': round(med['msa'], 4),
      'speedup': round(med['dense'] / med['msa'], 3),
      'causal_dense_s': round(med['causal_dense'], 4),
      'speedup_vs_causal_dense': round(med['causal_dense'] / med['msa'], 3),
      'flop_ratio': round(flop_ratio(
          r=cfg.heads_per_group, d=cfg.head_dim, di=cfg.index_dim,
          block=cfg.block_size, k=cfg.top_k, n=t), 3),
      'index_fraction': round(med['index'] / med['msa'], 3),
      'index_s': round(med['index'], 4),
      'repeats': repeats,
  }


def dense_decode(q_BHD, k_BSGD, v_BSGD, lengths_B, implementation=None):
  """One new token per sequence against its cache: jax.nn attention (XLA
  on CPU; 'cudnn' on GPU)."""
  out = jax.nn.dot_product_attention(q_BHD[:, None], k_BSGD, v_BSGD,
                                     key_value_seq_lengths=lengths_B,
                                     implementation=implementation)
  return out[:, 0]


def _finish_decode(logits_BGRS, v_BSGD, lengths_B, out_dtype):
  """Softmax over each sequence's live keys, then the values: [B, H, D]."""
  b, g, r, s = logits_BGRS.shape
  live_BS = jnp.arange(s)[None, :] < lengths_B[:, None]
  logits_BGRS = jnp.where(live_BS[:, None, None, :], logits_BGRS, -jnp.inf)
  p_BGRS = jax.nn.softmax(logits_BGRS, axis=-1)
  out_BGRD = jnp.einsum('bgrs,bsgd->bgrd', p_BGRS.astype(v_BSGD.dtype),
                        v_BSGD, preferred_element_type=jnp.float32)
  return out_BGRD.reshape(b, g * r, -1).astype(out_dtype)


def grouped_dense_decode(q_BHD, k_BSGD, v_BSGD, lengths_B):
  """The same decode as dense_decode, written for GQA: each group's R
  queries against its one shared K/V, which is read once (an attention
  that repeats K/V per query head reads R x the bytes; XLA:CPU's jax.nn
  path measured no slower than this)."""
  b, h, d = q_BHD.shape
  g = k_BSGD.shape[2]
  q_BGRD = q_BHD.reshape(b, g, h // g, d)
  logits_BGRS = jnp.einsum('bgrd,bsgd->bgrs', q_BGRD, k_BSGD,
                           preferred_element_type=jnp.float32) / np.sqrt(d)
  return _finish_decode(logits_BGRS, v_BSGD, lengths_B, q_BHD.dtype)


def rows_dense_decode(q_BHD, k_BSGD, v_BSGD, lengths_B):
  """The same decode again, laid out for a row-major CPU cache: every head
  against the cache read as [S, G*D] rows in one matmul, each head's query
  zero outside its group's D columns. It spends G x the logit FLOPs but
  reads K in order, which on XLA:CPU beats both forms above (measured
  1.66x faster than jax.nn at a 128k cache)."""
  b, h, d = q_BHD.shape
  s, g = k_BSGD.shape[1], k_BSGD.shape[2]
  r = h // g
  q_BGRD = q_BHD.reshape(b, g, r, d) / np.sqrt(d)
  q_BHX = jnp.einsum('bgrd,gf->bgrfd', q_BGRD,
                     jnp.eye(g, dtype=q_BHD.dtype)).reshape(b, h, g * d)
  logits_BHS = jnp.einsum('bsx,bhx->bhs', k_BSGD.reshape(b, s, g * d), q_BHX,
                          preferred_element_type=jnp.float32)
  return _finish_decode(logits_BHS.reshape(b, g, r, s), v_BSGD, lengths_B,
                        q_BHD.dtype)


def time_calls(fn, args, n_calls: int) -> float:
  """Seconds per call over n_calls back-to-back calls, one sync at the end."""
  t0 = time.perf_counter()
  out = None
  for _ in range(n_calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / n_calls


def error_text(e: Exception) -> str:
  """An exception as one bounded line for a benchmark row."""
  return f'{type(e).__name__}: {e}'[:1500]


def measure(fns: dict, repeats: int, budget_s: float = 0.05,
            max_calls: int = 200, spread: dict | None = None,
            errors: dict | None = None,
            compile_s: dict | None = None,
            outputs: dict | None = None, keep=None) -> dict:
  """Median seconds per call of each {name: (fn, args)}: compiled and run
  once first, then `repeats` interleaved timings of enough back-to-back
  calls (about budget_s each) that dispatch overhead is amortised.
  spread: when given, filled with (max - min) / median per name.
  errors: when given, a function that fails to compile or run is left out
  of the result and its error recorded here (name -> message), so one
  broken kernel does not cost the others' timings; otherwise it raises.
  compile_s: when given, filled with each function's seconds to lower,
  compile and run once (what a time-boxed run has to budget for).
  outputs: when given, filled with each function's result from that first
  run (to check variants against each other without compiling again);
  keep(name), when given, picks whose (the rest are not held in memory)."""
  compiled = {}
  for name, (fn, args) in fns.items():
    start = time.perf_counter()
    try:
      compiled[name] = (jax.jit(fn).lower(*args).compile(), args)
      out = jax.block_until_ready(compiled[name][0](*args))
      if compile_s is not None:
        compile_s[name] = round(time.perf_counter() - start, 3)
      if outputs is not None and (keep is None or keep(name)):
        outputs[name] = out
      del out
    except Exception as e:  # pylint: disable=broad-except
      if errors is None:
        raise
      compiled.pop(name, None)
      errors[name] = error_text(e)
  n_calls = {name: max(1, min(max_calls,
                              int(budget_s / max(time_calls(f, a, 1), 1e-6))))
             for name, (f, a) in compiled.items()}
  times = {name: [] for name in compiled}
  for _ in range(repeats):
    for name, (fn, args) in compiled.items():
      times[name].append(time_calls(fn, args, n_calls[name]))
  med = {name: statistics.median(ts) for name, ts in times.items()}
  if spread is not None:
    spread.update({name: (max(ts) - min(ts)) / max(med[name], 1e-12)
                   for name, ts in times.items()})
  return med


def run_decode(cfg: MSABench, s: int) -> dict:
  """Dense vs MSA decode of decode_batch tokens over full caches of s."""
  b, g, r, d, di = (cfg.decode_batch, cfg.groups, cfg.heads_per_group,
                    cfg.head_dim, cfg.index_dim)
  ks = jax.random.split(jax.random.key(cfg.seed + 1), 5)
  n = jax.random.normal
  q, k, v = (n(ks[0], (b, g * r, d)), n(ks[1], (b, s, g, d)),
             n(ks[2], (b, s, g, d)))
  qi, ki = n(ks[3], (b, g, di)), n(ks[4], (b, s, di))
  lengths = jnp.full((b,), s, jnp.int32)
  msa = functools.partial(xla.msa_decode, block_size=cfg.block_size,
                          top_k=cfg.top_k)
  fns = {'dense': (dense_decode, (q, k, v, lengths)),
         'grouped_dense': (grouped_dense_decode, (q, k, v, lengths)),
         'rows_dense': (rows_dense_decode, (q, k, v, lengths)),
         'msa': (lambda *a: msa(*a)[0], (q, k, v, qi, ki, lengths))}
  spread = {}
  med = measure(fns, cfg.repeats, budget_s=0.2, max_calls=50, spread=spread)
  # The strongest dense decode on the same [B, S, G, D] cache: the fastest
  # of the three, measured side by side.
  best = min(('dense', 'grouped_dense', 'rows_dense'), key=med.get)
  return {
      'cache_len': s,
      'batch': b,
      'dense_s': med['dense'],
      'grouped_dense_s': med['grouped_dense'],
      'rows_dense_s': med['rows_dense'],
      'msa_s': med['msa'],
      'speedup_vs_jax_nn': round(med['dense'] / med['msa'], 3),
      'strongest_dense': best,
      'speedup': round(med[best] / med['msa'], 3),
      'spread': {name: round(x, 3) for name, x in spread.items()},
      'flop_ratio': round(decode_flop_ratio(
          r=r, d=d, di=di, block=cfg.block_size, k=cfg.top_k, n=s), 3),
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
  decode = []
  for s in cfg.decode_cache_lens:
    decode.append(run_decode(cfg, s))
    log(decode[-1])
  rows = []
  for t in cfg.seq_lens:
    rows.append(run_length(cfg, t))
    log(rows[-1])
  last, last_dec = rows[-1], decode[-1] if decode else None
  causal_target = 0.7 * last['flop_ratio']
  return {
      'results': rows,
      'decode': decode,
      'max_abs_err_vs_reference': reference_error(cfg),
      'reference_check_len': cfg.check_len,
      'paper_flop_ratio': round(paper_flop_ratio(), 1),
      'target_speedup_at_max_len': round(0.7 * last['flop_ratio'], 3),
      'speedup_over_target': round(last['speedup'] /
                                   (0.7 * last['flop_ratio']), 3),
      'speedup_grows_with_length': all(
          a['speedup'] < b['speedup'] for a, b in zip(rows, rows[1:])),
      'target_speedup_vs_causal_dense_at_max_len': round(causal_target, 3),
      'speedup_vs_causal_dense_over_target': round(
          last['speedup_vs_causal_dense'] / causal_target, 3),
      'speedup_vs_causal_dense_grows_with_length': all(
          a['speedup_vs_causal_dense'] < b['speedup_vs_causal_dense']
          for a, b in zip(rows, rows[1:])),
      'decode_target_speedup_at_max_cache': (
          round(0.5 * last_dec['flop_ratio'], 3) if decode else None),
      'decode_speedup_over_target': (
          round(last_dec['speedup'] / (0.5 * last_dec['flop_ratio']), 3)
          if decode else None),
      'paper_decode_speedup_at_1m': PAPER_DECODE_SPEEDUP,
      'paper_decode_flop_ratio_at_1m': round(decode_flop_ratio(
          r=16, d=128, di=128, block=128, k=16, n=2**20), 2),
  }
