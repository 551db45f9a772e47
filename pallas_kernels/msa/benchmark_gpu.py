"""MSA Pallas kernels vs cuDNN flash attention on one NVIDIA GPU.

The library behind `experiments.bench_msa --device=gpu` (`make gpu-check`).
Phases, each timed in interleaved repetitions in one process (median, and
the spread (max - min) / median). ceilings, check and tune run first; the
measuring phases then run cheapest target first (`schedule`: prefill up
to train_max_len, decode, train, longer prefill, then profile), so a
deadline that falls early still leaves most targets measured:

  ceilings  a large bf16 matmul and a large copy: what the card gives here.
  check     at check_len, the kernels' selection against the f32 reference
            scores (margin rule, flip rate) and the main branch on the
            kernels' own selection against the reference.
  tune      at tune_len, the KV-outer forward's variants (TUNE, most
            promising first, a few at a time beside the default, until
            tune_budget_s): which is fastest depends on the card's
            latencies, so it is measured, not guessed. The fastest, if it
            beats the default, is timed again in every later row as
            main_tuned / msa_tuned, side by side with the default.
  prefill   per seq_len: dense: jax.nn.dot_product_attention(
            implementation='cudnn'), causal GQA; msa: selection + sparse
            forward end to end; each kernel alone: index (the two-launch
            selector), main (the KV-outer sparse forward) and, up to
            train_max_len, their stages apart (index_scores, index_topk;
            main_plan, main_kernel, main_combine: where the time goes),
            the score launch's tilings (INDEX_VARIANTS) and the union-tile
            forward (main_tiles; main_shared / main_tiles_shared: both
            forwards on a selection a tile's tokens share, its best case;
            tiles_union_per_k: blocks it reads per token-slot); up to
            fused_max_len the kernels they replace: index_fused (the
            running-table selector), main_token (a program per token).
  train     up to train_max_len (its fields join the prefill row of the
            same length): the gradient of sum(out) w.r.t. q, k, v,
            dense vs the main branch on a fixed selection (KV-outer dK/dV
            without atomics; and the per-token atomics backward); the
            backward's dQ and dK/dV kernels each alone (bwd_dq, bwd_dkv;
            bwd_dkv_prefetch: its next-tile prefetch variant;
            bwd_dkv_parts2: two programs per key block, which compiled
            for an H100 does not spill, experiments/gpu_static;
            bwd_dq_tiles: dQ by union tiles, and with _shared both dQs
            on a tile-shared selection).
  decode    per decode_len: one new token for each of decode_batch
            sequences against full caches: dense vs selection + split-K
            attention; each half alone (index, main), and the variants
            (the selection finished by lax.top_k; the tuned forward; the
            score launch's blocks per program).
  profile   one trace each of MSA and dense, prefill at the longest
            train_max_len row and decode at the longest cache, summed per
            kernel (trace.py): per call, the span, the time some kernel
            ran, launches, and the costliest kernels by name. Diagnostic:
            it leaves `complete` as it is.

A soft deadline (`deadline`, a time.monotonic() value) is checked before
every measurement: past it, the rest is recorded as skipped and run()
still returns, so the summary is always written. Index inputs are in the
model dtype (bf16), as a bf16 model's index branch emits them.

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
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.msa import benchmark
from pallas_kernels.msa import forward_kernel
from pallas_kernels.msa import index_kernel
from pallas_kernels.msa import kernel_common as kc
from pallas_kernels.msa import kv_outer
from pallas_kernels.msa import pallas_path
from pallas_kernels.msa import reference
from pallas_kernels.msa import select_kernel
from pallas_kernels.msa import trace
from pallas_kernels.msa import xla

PAPER_PREFILL_SPEEDUP = 14.2
PAPER_DECODE_SPEEDUP = 7.6
# The speedups over cuDNN that the GPU kernels aim for, each well under
# its FLOP ratio: (what, phase, length, row key, the row key of its best
# measured variant (None: no variants), target).
TARGETS = (
    ('prefill 32k', 'results', 32768, 'speedup', 'speedup_tuned', 2.5),
    ('prefill 128k', 'results', 131072, 'speedup', 'speedup_tuned', 7.0),
    ('decode 128k, batch 8', 'decode', 131072, 'decode_speedup',
     'decode_speedup_best', 5.0),
    ('forward+backward 32k (main branch)', 'results', 32768,
     'train_speedup_main_only', 'train_speedup_tuned', 2.0),
)

# The KV-outer forward's variants the tune phase times beside the default,
# most promising first (the phase stops at its budget). Pair order and the
# prefetch attack the two costs the H100 run pointed at: the combine's
# gather over every partial, and a tile loop that waits on each gather.
# Compiled for an H100 (experiments/gpu_static, results/gpu_static.json),
# every 128-row variant takes 255 registers and so one block of 8 warps
# per SM, which leaves a tile's gather nothing to overlap with; 64-row
# tiles (q_per_tile=4) fit two blocks per SM without spilling, so they
# are in the first group, as is the Pallas combine (fused_combine: each
# partial read once and the bf16 output written once, where XLA's
# reduction writes f32).
TUNE = (
    kv_outer.ForwardConfig(pair_order=True, prefetch=True),
    kv_outer.ForwardConfig(pair_order=True, prefetch=True, q_per_tile=4),
    kv_outer.ForwardConfig(pair_order=True, prefetch=True,
                           fused_combine=True),
    kv_outer.ForwardConfig(pair_order=True),
    kv_outer.ForwardConfig(prefetch=True),
    kv_outer.ForwardConfig(pair_order=True, prefetch=True,
                           tiles_per_program=8),
    kv_outer.ForwardConfig(pair_order=True, prefetch=True,
                           tiles_per_program=2),
    kv_outer.ForwardConfig(pair_order=True, prefetch=True, num_warps=4),
    kv_outer.ForwardConfig(pair_order=True, prefetch=True, num_stages=3),
    kv_outer.ForwardConfig(pair_order=True, prefetch=True, num_stages=1),
    kv_outer.ForwardConfig(pair_order=True, prefetch=True,
                           query_chunk=16384),
    kv_outer.ForwardConfig(pair_order=True, prefetch=True, query_chunk=2048),
    kv_outer.ForwardConfig(pair_order=True, prefetch=True,
                           tiles_per_program=32),
)

# Prefill: the index score launch's tilings timed beside its default at
# train_max_len (scores alone). At 128k the scores were 26% of MSA's time,
# at about 30% of the card's bf16 matmul rate. Compiled for an H100
# (experiments/gpu_static), the default holds 243 registers and 97 KiB of
# shared memory, two blocks of 4 warps per SM; it compares key and query
# positions only in the diagonal blocks, which takes a second loop body.
# The variants: a longer key span per program (the query tile's load and
# the output's write amortised); 64-row tiles in 32-key dots without
# pipelining (146 registers, 24 KiB: three blocks per SM; four, at 119
# registers, with the causal compare in every block, one loop body); 64-row
# tiles unpipelined (three blocks); 64-row tiles in 64-key dots; the
# default with the compare in every block (209 registers).
INDEX_VARIANTS = ({'blocks_per_program': 32},
                  {'row_tile': 64, 'key_sub': 32, 'num_stages': 1},
                  {'row_tile': 64, 'key_sub': 32, 'num_stages': 1,
                   'causal_every_block': True},
                  {'row_tile': 64, 'num_stages': 1},
                  {'row_tile': 64, 'key_sub': 64},
                  {'causal_every_block': True})


def index_variant_label(kw: dict) -> str:
  return ','.join(f'{k}={v}' for k, v in sorted(kw.items()))


# Decode: the index score launch's blocks per program, timed beside its
# default.
DECODE_BLOCKS_PER_PROGRAM = (4, 8, 32)

# The margin rule's eps for fp8 index scores (e4m3: 3 mantissa bits; bf16
# products are exact, so theirs is 2^-7).
FP8_EPS_SCALE = 2.0**-3

# Largest |variant - default| of the forward's bf16 output for a variant's
# time to count: bf16 rounding of outputs below 1 in magnitude is < 4e-3.
TUNE_TOLERANCE = 2e-2


def targets(bench: dict) -> list[dict]:
  """Each target against a bench summary (final, or the rows of a run cut
  short): {what, target, measured (None:
  not measured), flop_ratio, met, best (the best measured variant's
  speedup, at least `measured`), best_met, with_fp8_index (prefill: with
  fp8 index scores, an approximate selection, so never `best`)}."""
  prefill_rows, decode_rows = phase_rows(bench)
  rows = {'results': prefill_rows, 'decode': decode_rows}
  out = []
  for what, phase, n, key, best_key, target in TARGETS:
    length = 'seq_len' if phase == 'results' else 'cache_len'
    row = next((r for r in rows[phase] if r.get(length) == n), {})
    got = row.get(key)
    best = max((x for x in (got, row.get(best_key) if best_key else None)
                if x is not None), default=None)
    fp8 = row.get('speedup_fp8') if key == 'speedup' else None
    out.append({'what': what, 'target': target, 'measured': got,
                'flop_ratio': row.get('flop_ratio',
                                      row.get('decode_flop_ratio')),
                'met': got is not None and got >= target,
                'best': best,
                'best_met': best is not None and best >= target,
                'with_fp8_index': fp8})
  return out


@dataclasses.dataclass(frozen=True)
class GPUBench:
  seq_lens: tuple[int, ...] = (8192, 32768, 131072)
  decode_lens: tuple[int, ...] = (32768, 131072)
  groups: int = 4             # G
  heads_per_group: int = 16   # r (the paper's ratio uses r = 16)
  head_dim: int = 128         # D
  index_dim: int = 128        # dI
  block_size: int = 128       # B in the formula
  top_k: int = 16             # K
  dtype: str = 'bfloat16'     # cuDNN flash attention needs bf16 / f16
  decode_batch: int = 8
  train_max_len: int = 32768  # fwd+bwd timed up to here
  # The fused selector and per-token forward, timed up to here (at 32k
  # the fused selector alone took 0.92 s a call: results/gpu_check_h100).
  fused_max_len: int = 8192
  tune_len: int = 32768       # the tune phase's length
  tune_budget_s: float = 60.0  # the tune phase starts no group past this
  tune_group: int = 4         # variants timed beside the default at once
  repeats: int = 5            # interleaved
  check_len: int = 2048       # end-to-end error vs the dense reference
  matmul_n: int = 8192        # ceilings: an n^3 bf16 matmul
  copy_bytes: int = 2 << 30   # ceilings: a copy of this many bytes
  seed: int = 0
  dense_impl: str = 'cudnn'   # 'xla' and interpret=True: a CPU dry run
  interpret: bool = False


# A CPU dry run (bench_msa --dry_run, DRY_RUN=1 make gpu-check): toy
# shapes, the kernels in interpret mode and XLA's dense attention, so the
# bench's code runs end to end without a GPU; it measures nothing.
DRY_RUN = dict(seq_lens=(128,), decode_lens=(128,), groups=2,
               heads_per_group=2, head_dim=16, index_dim=16, block_size=16,
               top_k=3, decode_batch=2, repeats=1, check_len=128,
               matmul_n=128, copy_bytes=1 << 20, train_max_len=128,
               fused_max_len=128, tune_len=128, dense_impl='xla',
               interpret=True)


def prefill_flops(cfg: GPUBench, n: int) -> tuple[float, float]:
  """(dense, msa) forward FLOPs of one length-n sequence, all groups."""
  r, d, di = cfg.heads_per_group, cfg.head_dim, cfg.index_dim
  dense = 4 * r * d * n / 2 * n * cfg.groups
  msa = (2 * di * n / 2 + 4 * r * d * cfg.top_k * cfg.block_size) * n * \
      cfg.groups
  return dense, msa


def index_flops(cfg: GPUBench, n: int) -> float:
  """The index branch's score dots in prefill_flops' msa count."""
  return 2 * cfg.index_dim * n / 2 * n * cfg.groups


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
          n(ks[2], (b, s, g, d), dt), n(ks[3], (b, t, g, di), dt),
          n(ks[4], (b, s, di), dt))


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


class _Clock:
  """The soft deadline: measurements start only while time is left."""

  def __init__(self, deadline: float | None):
    self.deadline = deadline

  def left(self) -> float:
    return (float('inf') if self.deadline is None
            else self.deadline - time.monotonic())

  def ok(self) -> bool:
    return self.left() > 0


def _measure(cfg: GPUBench, fns: dict, compile_s: dict | None = None,
             outputs: dict | None = None, **kw) -> tuple[dict, dict, dict]:
  """(medians, spreads, errors): a kernel that fails to compile or run is
  left out and its error kept, and the others are still timed; compile_s,
  when given, gets each one's compile-and-first-run seconds."""
  spread, errors = {}, {}
  med = benchmark.measure(fns, cfg.repeats, spread=spread, errors=errors,
                          compile_s=compile_s, outputs=outputs, **kw)
  return med, spread, errors


def _ratio(med: dict, num: str, den: str) -> float | None:
  return med[num] / med[den] if num in med and den in med else None


def ceilings(cfg: GPUBench) -> dict:
  """What this card gives here: bf16 matmul TFLOP/s and copy GB/s (read +
  write counted)."""
  n = cfg.matmul_n
  a = jnp.ones((n, n), jnp.bfloat16)
  x = jnp.ones((cfg.copy_bytes // 4,), jnp.float32)
  med, spread, _ = _measure(cfg, {
      'matmul': (lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32),
                 (a,)),
      'copy': (lambda x: x + 1.0, (x,))})
  return {'matmul_n': n, 'matmul_tflops': 2 * n**3 / med['matmul'] / 1e12,
          'copy_bytes': cfg.copy_bytes,
          'copy_gbps': 2 * cfg.copy_bytes / med['copy'] / 1e9,
          'spread': spread}


def check(cfg: GPUBench) -> dict:
  """The kernels at check_len against the f32 reference.

  Selection: the margin rule of docs/design.md §6.8 (violations, flip rate)
  against the f32 block scores of the same bf16 index inputs. Main branch:
  max |out - reference| on the kernels' own selection.
  """
  c, k = cfg.block_size, cfg.top_k
  q, kk, v, qi, ki = _inputs(cfg, 1, cfg.check_len, cfg.check_len)
  out, aux = jax.jit(functools.partial(
      pallas_path.msa_attention, q_offset=0, backend='gpu',
      interpret=cfg.interpret, block_size=c, top_k=k))(q, kk, v, qi, ki)
  f32 = lambda x: x.astype(jnp.float32)
  sel = aux['sel_BGTK']
  want, _ = jax.jit(functools.partial(reference.sparse_attention,
                                      block_size=c))(f32(q), f32(kk), f32(v),
                                                     sel)
  scores = np.asarray(jax.jit(lambda qi, ki: reference.block_scores_BGTN(
      reference.index_logits_BGTS(qi, ki), c))(f32(qi), f32(ki)), np.float64)
  violations, flip_rate = selection_margin(np.asarray(sel), scores,
                                           np.asarray(f32(qi)),
                                           np.asarray(f32(ki)), c, k)
  # The fp8 score variant, by the coarser rule its 3 mantissa bits allow.
  sel8 = jax.jit(functools.partial(
      select_kernel.select_blocks_BGTK, backend='gpu', interpret=cfg.interpret,
      block_size=c, top_k=k, fp8_scores=True))(qi, ki,
                                                jnp.zeros((1,), jnp.int32))
  violations8, flip_rate8 = selection_margin(
      np.asarray(sel8), scores, np.asarray(f32(qi)), np.asarray(f32(ki)), c,
      k, eps_scale=FP8_EPS_SCALE)
  return {'selection_margin_violations': violations,
          'selection_flip_rate': flip_rate,
          'fp8_margin_violations': violations8,
          'fp8_flip_rate': flip_rate8,
          'max_abs_err': float(jnp.max(jnp.abs(f32(out) - want)))}


def selection_margin(sel_BGTK, scores_BGTN, qi_BTGI, ki_BSI, block_size: int,
                     top_k: int, eps_scale: float = 2.0**-7):
  """(violations, flip_rate) of a prefill selection (offset 0), vectorised.

  With tau a row's (K-1)-th best earlier score: kept blocks must score >=
  tau - eps, earlier blocks left out <= tau + eps, eps = eps_scale * |qi| *
  max|ki| / sqrt(I). flip_rate: rows whose kept set differs from the exact
  top-(K-1) (rows with fewer earlier blocks than K-1 cannot differ).
  """
  b, g, t, n = scores_BGTN.shape
  di = qi_BTGI.shape[-1]
  local_T = np.arange(t) // block_size
  earlier_TN = np.arange(n)[None, :] < local_T[:, None]
  ranked = np.where(earlier_TN, scores_BGTN, -np.inf)
  n_e_T = np.minimum(local_T, top_k - 1)
  order = np.argsort(-ranked, axis=-1, kind='stable')
  best_BGTN = np.take_along_axis(ranked, order, -1)
  tau = np.take_along_axis(
      best_BGTN, np.broadcast_to(np.maximum(n_e_T - 1, 0)[None, None, :, None],
                                 (b, g, t, 1)), -1)[..., 0]
  kept = np.zeros((b, g, t, n + 1), bool)
  slot_K = np.arange(sel_BGTK.shape[-1])
  earlier_slot = slot_K[None, None, None, :] < n_e_T[None, None, :, None]
  ids = np.where(earlier_slot & (sel_BGTK >= 0), sel_BGTK, n)
  np.put_along_axis(kept, ids, True, -1)
  kept = kept[..., :n]
  eps = (eps_scale * np.linalg.norm(qi_BTGI, axis=-1).transpose(0, 2, 1) *
         np.linalg.norm(ki_BSI, axis=-1).max(axis=1)[:, None, None] /
         np.sqrt(di))
  has = (n_e_T > 0)[None, None, :]
  low = kept & (scores_BGTN < (tau - eps)[..., None])
  high = earlier_TN & ~kept & (scores_BGTN > (tau + eps)[..., None])
  violations = int(np.sum((low | high) & has[..., None]))
  exact = np.zeros((b, g, t, n + 1), bool)
  top_ids = np.where(np.arange(n)[None, None, None, :] <
                     n_e_T[None, None, :, None], order, n)
  np.put_along_axis(exact, top_ids, True, -1)
  differ = np.any(exact[..., :n] != kept, axis=-1) & has
  return violations, float(differ.sum() / max(has.sum() * b * g, 1))


def _selection(cfg: GPUBench, qi, ki, off, errors: dict):
  """The two-launch selector's selection (the XLA path's if it fails,
  recorded in errors, so the main branch is still timed) and the
  selector itself."""
  kw = dict(block_size=cfg.block_size, top_k=cfg.top_k)
  select = functools.partial(select_kernel.select_blocks_BGTK, backend='gpu',
                             interpret=cfg.interpret, **kw)
  try:
    return jax.block_until_ready(jax.jit(select)(qi, ki, off)), select
  except Exception as e:  # pylint: disable=broad-except
    errors['index'] = benchmark.error_text(e)
    if qi.shape[1] == 1:  # decode: per-sequence offsets, small scores
      f32 = lambda x: x.astype(jnp.float32)
      return reference.selection_BGTK(f32(qi), f32(ki), q_offset=off,
                                      **kw), select
    return jax.jit(functools.partial(xla.selection_BGTK, **kw))(qi, ki), select


def _main_branch(cfg: GPUBench, off, config=None, gpu_kernels='kv_outer'):
  """The main branch alone on a fixed selection (differentiable), with the
  KV-outer knobs `config`, or the per-token kernels."""
  return lambda q, k, v, sel: pallas_path.sparse_attention(
      q, k, v, sel, off, cfg.block_size, 'gpu', cfg.interpret,
      gpu_kernels=gpu_kernels, kv_config=config)


def _index_stages(cfg: GPUBench, qi, ki, off) -> dict:
  """The two-launch selector's launches, each alone: index_scores (the
  tensor-core block maxima, written to HBM) and index_topk (the K-1 argmax
  rounds per row, on those scores). Together they are what 'index'
  times."""
  t, g = qi.shape[1:3]
  scores_fn = lambda qi, ki: index_kernel.index_scores(
      qi, ki, off, block_size=cfg.block_size, interpret=cfg.interpret)
  topk_fn = lambda scores: index_kernel.index_topk(
      scores, off, t=t, groups=g, num_keys=ki.shape[1],
      block_size=cfg.block_size, top_k=cfg.top_k, interpret=cfg.interpret)
  scores = jax.jit(scores_fn)(qi, ki)
  fns = {'index_scores': (scores_fn, (qi, ki)),
         'index_topk': (topk_fn, (scores,))}
  for kw in INDEX_VARIANTS:
    fns[f'index_scores[{index_variant_label(kw)}]'] = (
        lambda qi, ki, kw=kw: index_kernel.index_scores(
            qi, ki, off, block_size=cfg.block_size, interpret=cfg.interpret,
            **kw), (qi, ki))
  return fns


def scores_equal(a: list, b: list) -> bool:
  """Whether two index_scores results hold the same block scores (any row
  chunking; -inf at the same places, finite ones within f32 summation
  noise)."""
  cat = lambda xs: jnp.concatenate([x.astype(jnp.float32) for x in xs], 2)
  a, b = cat(a), cat(b)
  if a.shape != b.shape:
    return False
  fa, fb = jnp.isfinite(a), jnp.isfinite(b)
  scale = jnp.max(jnp.where(fa, jnp.abs(a), 0.0))
  diff = jnp.max(jnp.where(fa & fb, jnp.abs(a - b), 0.0))
  return bool(jnp.all(fa == fb) & (diff <= 1e-5 * jnp.maximum(scale, 1.0)))


def _forward_stages(cfg: GPUBench, off, q, k, v, sel) -> dict:
  """The default KV-outer forward's three stages, each alone on the
  previous stage's output: main_plan (the selection inverted into tiles
  and work items, XLA), main_kernel (the Pallas kernel writing per-slot
  partials), main_combine (their log-sum-exp merge, written token-major
  in the output dtype, XLA). Together they are what 'main' times."""
  q_p, k_p, v_p, valid, scale = pallas_path.kv_outer_operands(
      q, k, v, None, block_size=cfg.block_size)
  rp, dp = q_p.shape[3:]
  plan_fn = lambda sel: kv_outer.forward_plan(
      sel, n_blocks=k_p.shape[1] // cfg.block_size, heads_p=rp,
      head_dim_p=dp, dtype=q_p.dtype)
  kernel_fn = lambda plan, q_p, k_p, v_p, valid: kv_outer.forward_partials(
      plan, q_p, k_p, v_p, off, valid, block_size=cfg.block_size,
      scale=scale, interpret=cfg.interpret)

  combine_fn = lambda plan, parts: kv_outer.forward_combine(
      plan, parts, top_k=sel.shape[-1], heads_p=rp, dtype=q.dtype)

  plan = jax.jit(plan_fn)(sel)
  parts = jax.jit(kernel_fn)(plan, q_p, k_p, v_p, valid)
  return {'main_plan': (plan_fn, (sel,)),
          'main_kernel': (kernel_fn, (plan, q_p, k_p, v_p, valid)),
          'main_combine': (combine_fn, (plan, parts))}


def tune(cfg: GPUBench, clock: _Clock) -> dict:
  """TUNE's variants of the KV-outer forward at tune_len, each group beside
  the default (so every ratio is side by side); `best` names the fastest
  when it beats the default."""
  t = cfg.tune_len
  q, k, v, qi, ki = _inputs(cfg, 1, t, t)
  off = jnp.zeros((1,), jnp.int32)
  errors = {}
  sel, _ = _selection(cfg, qi, ki, off, errors)
  default = _main_branch(cfg, off)
  start = time.monotonic()
  ratio, secs, diff, defaults, todo = {}, {}, {}, [], list(TUNE)
  compile_s = {}
  while (todo and clock.ok() and
         time.monotonic() - start < cfg.tune_budget_s):
    group, todo = todo[:cfg.tune_group], todo[cfg.tune_group:]
    fns = {'default': (default, (q, k, v, sel))}
    fns.update({c.label(): (_main_branch(cfg, off, c), (q, k, v, sel))
                for c in group})
    outs = {}
    med, _, errs = _measure(cfg, fns, compile_s, outputs=outs)
    errors.update(errs)
    if 'default' not in med:
      break
    defaults.append(med['default'])
    want = outs.pop('default')[0].astype(jnp.float32)
    for c in group:
      if c.label() not in med:
        continue
      # A variant's time counts only if it computes what the default does
      # (bf16 outputs; a different tile shape may round differently).
      got = outs.pop(c.label())[0].astype(jnp.float32)
      diff[c.label()] = float(jnp.max(jnp.abs(got - want)))
      secs[c.label()] = med[c.label()]
      if diff[c.label()] <= TUNE_TOLERANCE:
        ratio[c.label()] = med['default'] / med[c.label()]
  row = {'tune_len': t, 'speedup_vs_default': ratio, 'variant_s': secs,
         'default_s': defaults, 'max_abs_diff_vs_default': diff,
         'compile_s': compile_s,
         'wrong': sorted(set(secs) - set(ratio)),
         'not_timed': [c.label() for c in todo]}
  best = max(ratio, key=ratio.get, default=None)
  if best is not None and ratio[best] > 1.0:
    row['best'] = best
    row['best_speedup_vs_default'] = ratio[best]
  if errors:
    row['kernel_errors'] = errors
  return row


def tuned_config(tune_row: dict) -> kv_outer.ForwardConfig | None:
  """The TUNE entry the tune phase found fastest (None: the default)."""
  return {c.label(): c for c in TUNE}.get(tune_row.get('best'))


def tile_shared_selection(sel_BGTK, q_tile: int):
  """Every token of a tile of q_tile neighbours given the selection of the
  tile's last token: a valid selection (q_tile <= block size, so a tile
  lies in one block, whose keys past a token the causal mask drops) at
  the union tiles' best case, a union of K blocks. T a multiple of
  q_tile."""
  b, g, t, k = sel_BGTK.shape
  last = sel_BGTK.reshape(b, g, t // q_tile, q_tile, k)[:, :, :, -1:]
  return jnp.broadcast_to(last, (b, g, t // q_tile, q_tile, k)).reshape(
      b, g, t, k)


def _tile_rows(cfg: GPUBench) -> int:
  """Tokens per union tile at the bench's heads and dtype."""
  return forward_kernel.tiles_per_query_tile(
      kc.next_pow2(cfg.heads_per_group), jnp.dtype(cfg.dtype))


def _shared_selection(cfg: GPUBench, sel_BGTK):
  """`tile_shared_selection` at the bench's union tiles (at most a block)."""
  return tile_shared_selection(sel_BGTK, min(_tile_rows(cfg), cfg.block_size))


def prefill(cfg: GPUBench, t: int,
            tuned: kv_outer.ForwardConfig | None = None) -> dict:
  kw = dict(block_size=cfg.block_size, top_k=cfg.top_k)
  q, k, v, qi, ki = _inputs(cfg, 1, t, t)
  off = jnp.zeros((1,), jnp.int32)
  msa = functools.partial(pallas_path.msa_attention, q_offset=0,
                          backend='gpu', interpret=cfg.interpret, **kw)
  errors = {}
  sel, select = _selection(cfg, qi, ki, off, errors)
  main = _main_branch(cfg, off)
  dense = functools.partial(dense_prefill, implementation=cfg.dense_impl)
  fns = {'dense': (dense, (q, k, v)),
         'msa': (msa, (q, k, v, qi, ki)),
         'index': (select, (qi, ki, off)),
         'main': (main, (q, k, v, sel))}
  if tuned is not None:
    fns['main_tuned'] = (_main_branch(cfg, off, tuned), (q, k, v, sel))
    fns['msa_tuned'] = (functools.partial(msa, kv_config=tuned),
                        (q, k, v, qi, ki))
  # The union-tile forward beside KV-outer, on this selection (random
  # inputs: neighbours share little but their local block, the tiles'
  # worst case) and on one where a tile's tokens share their selection
  # (their best case, a union of K); the truth for a trained model lies
  # between, by how much neighbours' selections overlap.
  # Up to train_max_len: the budget goes to the 128k row's targets.
  if t <= cfg.train_max_len:
    tiles = _main_branch(cfg, off, gpu_kernels='tiles')
    shared = _shared_selection(cfg, sel)
    fns['main_tiles'] = (tiles, (q, k, v, sel))
    fns['main_shared'] = (main, (q, k, v, shared))
    fns['main_tiles_shared'] = (tiles, (q, k, v, shared))
  # fp8 index scores (an approximate selection: reported apart), with the
  # fastest forward measured so far.
  fns['index_fp8'] = (functools.partial(select, fp8_scores=True),
                      (qi, ki, off))
  fns['msa_fp8'] = (functools.partial(msa, fp8_scores=True, kv_config=tuned),
                    (q, k, v, qi, ki))
  if t <= cfg.train_max_len:
    # Where the index branch's and the main branch's times go: each stage
    # alone (their inputs are made here, so a failure costs only them).
    for name, stages in (
        ('index_stages', lambda: _index_stages(cfg, qi, ki, off)),
        ('main_stages', lambda: _forward_stages(cfg, off, q, k, v, sel))):
      try:
        fns.update(stages())
      except Exception as e:  # pylint: disable=broad-except
        errors[name] = benchmark.error_text(e)
  if t <= cfg.fused_max_len:
    # The previous kernels, side by side, where they finish in time.
    fns['index_fused'] = (functools.partial(select, gpu_method='fused'),
                          (qi, ki, off))
    fns['main_token'] = (_main_branch(cfg, off, gpu_kernels='token'),
                         (q, k, v, sel))
  if 'index' in errors:
    for name in ('index', 'msa', 'msa_tuned', 'index_fp8', 'msa_fp8'):
      fns.pop(name, None)
  compile_s, outs = {}, {}
  med, spread, errs = _measure(
      cfg, fns, compile_s, outputs=outs,
      keep=lambda name: name.startswith('index_scores'))
  errors.update(errs)
  dense_f, msa_f = prefill_flops(cfg, t)
  index_f = index_flops(cfg, t)
  row = {'seq_len': t, 'flop_ratio': dense_f / msa_f, 'spread': spread,
         'compile_s': compile_s}
  row.update({f'{name}_s': sec for name, sec in med.items()})
  flops = {'dense': dense_f, 'msa': msa_f, 'index': index_f,
           'index_fp8': index_f}
  row.update({f'{name}_tflops': f / med[name] / 1e12
              for name, f in flops.items() if name in med})
  for key, num, den in (('speedup', 'dense', 'msa'),
                        ('speedup_tuned', 'dense', 'msa_tuned'),
                        ('speedup_fp8', 'dense', 'msa_fp8'),
                        ('index_fp8_speedup', 'index', 'index_fp8'),
                        ('main_tuned_speedup', 'main', 'main_tuned'),
                        ('index_speedup_vs_fused', 'index_fused', 'index'),
                        ('main_speedup_vs_token', 'main_token', 'main'),
                        ('tiles_speedup', 'main', 'main_tiles'),
                        ('tiles_shared_speedup', 'main_shared',
                         'main_tiles_shared')):
    if (ratio := _ratio(med, num, den)) is not None:
      row[key] = ratio
  if tuned is not None:
    row['tuned_config'] = tuned.label()
  # Blocks a union tile reads per token-slot: 1 at full overlap, up to
  # the tile's tokens.
  if 'main_tiles' in med:
    count = forward_kernel.tile_union(sel, _tile_rows(cfg),
                                      -(-t // cfg.block_size))[1]
    row['tiles_union_per_k'] = float(jnp.mean(count)) / cfg.top_k
  # Score-launch tilings: a speedup over the default counts only where the
  # variant's scores equal the default's.
  variants = {name[len('index_scores['):-1]: name for name in med
              if name.startswith('index_scores[')}
  if variants and 'index_scores' in med:
    row['index_scores_variants'] = {
        label: med['index_scores'] / med[name]
        for label, name in variants.items()
        if scores_equal(outs[name], outs['index_scores'])}
    row['index_scores_variants_wrong'] = sorted(
        set(variants) - set(row['index_scores_variants']))
  if errors:
    row['kernel_errors'] = errors
  return row


def train(cfg: GPUBench, t: int,
          tuned: kv_outer.ForwardConfig | None = None) -> dict:
  """Forward+backward at t: the gradient of sum(out) w.r.t. q, k, v, dense
  vs the main branch on the kernels' own selection (the KV-outer dK/dV
  without atomics; the per-token atomics backward up to fused_max_len),
  and the backward's kernels each alone. Its fields join the prefill row
  of the same length (`merge_train`)."""
  q, k, v, qi, ki = _inputs(cfg, 1, t, t)
  off = jnp.zeros((1,), jnp.int32)
  errors = {}
  sel, _ = _selection(cfg, qi, ki, off, errors)
  main = _main_branch(cfg, off)
  dense = functools.partial(dense_prefill, implementation=cfg.dense_impl)
  fns = {'dense_train': (_grad_of_sum(dense), (q, k, v)),
         'msa_train': (_grad_of_sum(lambda q, k, v: main(q, k, v, sel)),
                       (q, k, v))}
  if tuned is not None:
    main_tuned = _main_branch(cfg, off, tuned)
    fns['msa_train_tuned'] = (_grad_of_sum(
        lambda q, k, v: main_tuned(q, k, v, sel)), (q, k, v))
  if t <= cfg.fused_max_len:
    main_token = _main_branch(cfg, off, gpu_kernels='token')
    fns['msa_train_token'] = (_grad_of_sum(
        lambda q, k, v: main_token(q, k, v, sel)), (q, k, v))
  # The backward's two kernels alone (with their XLA glue), on the
  # forward's out and LSE and the cotangent of sum(out).
  fwd_out, fwd_lse = jax.jit(main)(q, k, v, sel)
  bwd = lambda parts, on=sel, **kw: (
      lambda q, k, v, o, l: pallas_path.sparse_backward(
          q, k, v, on, off, None, o, l, jnp.ones_like(o), None,
          block_size=cfg.block_size, backend='gpu',
          interpret=cfg.interpret, parts=parts, **kw))
  for parts in ('dq', 'dkv'):
    fns[f'bwd_{parts}'] = (bwd(parts), (q, k, v, fwd_out, fwd_lse))
  fns['bwd_dkv_prefetch'] = (bwd('dkv', dkv_prefetch=True),
                             (q, k, v, fwd_out, fwd_lse))
  fns['bwd_dkv_parts2'] = (bwd('dkv', dkv_parts=2),
                           (q, k, v, fwd_out, fwd_lse))
  # dQ by union tiles beside the per-token dQ: on this selection and on
  # one a tile's tokens share (as prefill's main_tiles / _shared).
  fns['bwd_dq_tiles'] = (bwd('dq', gpu_kernels='tiles'),
                         (q, k, v, fwd_out, fwd_lse))
  shared = _shared_selection(cfg, sel)
  s_out, s_lse = jax.jit(main)(q, k, v, shared)
  fns['bwd_dq_shared'] = (bwd('dq', shared), (q, k, v, s_out, s_lse))
  fns['bwd_dq_tiles_shared'] = (bwd('dq', shared, gpu_kernels='tiles'),
                                (q, k, v, s_out, s_lse))
  compile_s = {}
  med, spread, errs = _measure(cfg, fns, compile_s)
  errors.update(errs)
  row = {'seq_len': t, 'spread': spread, 'compile_s': compile_s}
  row.update({f'{name}_s': sec for name, sec in med.items()})
  if (ratio := _ratio(med, 'dense_train', 'msa_train')) is not None:
    row['train_speedup_main_only'] = ratio
  if (ratio := _ratio(med, 'dense_train', 'msa_train_tuned')) is not None:
    row['train_speedup_tuned'] = ratio
  if errors:
    row['kernel_errors'] = errors
  return row


def decode(cfg: GPUBench, s: int, impl: str,
           tuned: kv_outer.ForwardConfig | None = None) -> dict:
  b = cfg.decode_batch
  kw = dict(block_size=cfg.block_size, top_k=cfg.top_k)
  q, k, v, qi, ki = _inputs(cfg, b, 1, s)
  lengths = jnp.full((b,), s, jnp.int32)
  off = lengths - 1
  dense = functools.partial(benchmark.dense_decode, implementation=impl)
  msa = functools.partial(pallas_path.msa_decode, backend='gpu',
                          interpret=cfg.interpret, **kw)
  errors = {}
  sel, select = _selection(cfg, qi, ki, off, errors)
  args = (q[:, 0], k, v, qi[:, 0], ki, lengths)
  fns = {'dense': (dense, (q[:, 0], k, v, lengths)),
         'msa': (msa, args),
         'msa_xla_topk': (functools.partial(msa, topk='xla'), args),
         # The split-K step as it was: the general tile kernel on tables
         # XLA builds from the selection (four small launches more).
         'msa_tiled_decode': (functools.partial(
             msa, kv_config=kv_outer.ForwardConfig(tiled_decode=True)),
                              args),
         # Each half alone: where decode's time goes.
         'index': (select, (qi, ki, off)),
         'index_xla_topk': (functools.partial(select, topk='xla'),
                            (qi, ki, off)),
         'main': (_main_branch(cfg, off), (q, k, v, sel))}
  if tuned is not None:
    fns['msa_tuned'] = (functools.partial(msa, kv_config=tuned), args)
  if s == max(cfg.decode_lens):
    # The score launch's key span per program (default 16 blocks): at one
    # query per sequence it sets how many programs stream the index keys.
    for nb in DECODE_BLOCKS_PER_PROGRAM:
      fns[f'index_nb{nb}'] = (functools.partial(
          index_kernel.select_blocks_BGTK, interpret=cfg.interpret,
          blocks_per_program=nb, **kw), (qi, ki, off))
    if tuned is not None:
      fns['msa_tuned_xla_topk'] = (functools.partial(
          msa, kv_config=tuned, topk='xla'), args)
    # A cache of no whole number of blocks, as the sampler allocated before
    # msa.decode_cache_len (prompt + max_new_tokens): what its pads (a copy
    # of the whole cache) cost a step. Not a variant of the default.
    u = s - cfg.block_size // 2
    fns['unaligned_msa'] = (msa, (q[:, 0], k[:, :u], v[:, :u], qi[:, 0],
                                  ki[:, :u], jnp.full((b,), u, jnp.int32)))
  compile_s = {}
  med, spread, errs = _measure(cfg, fns, compile_s, budget_s=0.2,
                               max_calls=100)
  errors.update(errs)
  dense_f, msa_f = decode_flops(cfg, s)
  row = {'cache_len': s, 'batch': b, 'decode_flop_ratio': dense_f / msa_f,
         'spread': spread, 'compile_s': compile_s}
  row.update({f'decode_{name}_s': sec for name, sec in med.items()})
  if (ratio := _ratio(med, 'dense', 'msa')) is not None:
    row['decode_speedup'] = ratio
  ends = [name for name in med if name.startswith('msa')]
  if 'dense' in med and ends:
    # Every variant is a whole decode step, timed side by side.
    best = min(ends, key=med.get)
    row['decode_best'] = best
    row['decode_speedup_best'] = med['dense'] / med[best]
  if (ratio := _ratio(med, 'unaligned_msa', 'msa')) is not None:
    row['unaligned_cost'] = ratio
  if tuned is not None:
    row['tuned_config'] = tuned.label()
  if errors:
    row['kernel_errors'] = errors
  return row


# The Mosaic GPU kernels' forward (kv_outer_mosaic.py), with the fused
# merge; timed in the `mosaic` phase beside itself with XLA's.
MOSAIC_FORWARD = kv_outer.ForwardConfig(pair_order=True, kernel='mosaic',
                                        fused_combine=True)


def mosaic(cfg: GPUBench, t: int) -> dict:
  """The Mosaic GPU kernels beside the Triton ones at t: the index score
  launch (index_mosaic.py) against the Triton launch, the KV-outer forward
  (kv_outer_mosaic.py, with XLA's merge and the fused one) against the
  default, and MSA end to end on both against cuDNN, in one interleaved
  measurement.

  The last phase of a run: these kernels had run only in jax's GPU
  interpreter, and a launch that faults can leave the device unusable for
  the rest of the process. A speedup counts only where the results agree:
  the scores equal (`scores_equal`), the outputs within TUNE_TOLERANCE of
  the Triton ones' (MSA end to end too: equal scores give the same
  selection); otherwise the name is listed under `mosaic_wrong`. Where
  the forward cannot run at the bench's shapes (the dry run's 2 heads a
  group), `mosaic_not_applicable` says why and only the scores are timed.
  """
  q, k, v, qi, ki = _inputs(cfg, 1, t, t)
  off = jnp.zeros((1,), jnp.int32)
  errors = {}
  sel, _ = _selection(cfg, qi, ki, off, errors)
  scores = lambda kernel: lambda qi, ki: index_kernel.index_scores(
      qi, ki, off, block_size=cfg.block_size, interpret=cfg.interpret,
      kernel=kernel)
  fns = {'index_scores': (scores('triton'), (qi, ki)),
         'index_scores_mosaic': (scores('mosaic'), (qi, ki))}
  heads_p, dim_p = kc.next_pow2(cfg.heads_per_group), kc.next_pow2(
      cfg.head_dim)
  why = kv_outer.unsupported(MOSAIC_FORWARD, heads_p=heads_p,
                             head_dim_p=dim_p, block_size=cfg.block_size,
                             dtype=q.dtype)
  if why is None:
    msa = functools.partial(pallas_path.msa_attention, q_offset=0,
                            backend='gpu', interpret=cfg.interpret,
                            block_size=cfg.block_size, top_k=cfg.top_k)
    unfused = dataclasses.replace(MOSAIC_FORWARD, fused_combine=False)
    fns.update({
        'dense': (functools.partial(dense_prefill,
                                    implementation=cfg.dense_impl),
                  (q, k, v)),
        'msa': (msa, (q, k, v, qi, ki)),
        'msa_mosaic': (functools.partial(msa, scores_kernel='mosaic',
                                         kv_config=MOSAIC_FORWARD),
                       (q, k, v, qi, ki)),
        'main': (_main_branch(cfg, off), (q, k, v, sel)),
        'main_mosaic': (_main_branch(cfg, off, MOSAIC_FORWARD),
                        (q, k, v, sel)),
        'main_mosaic_xla_merge': (_main_branch(cfg, off, unfused),
                                  (q, k, v, sel))})
  compile_s, outs = {}, {}
  med, spread, errs = _measure(cfg, fns, compile_s, outputs=outs)
  errors.update(errs)
  row = {'seq_len': t, 'spread': spread, 'compile_s': compile_s}
  row.update({f'{name}_s': sec for name, sec in med.items()})
  if why is not None:
    row['mosaic_not_applicable'] = why
  agree = {}
  if {'index_scores', 'index_scores_mosaic'} <= set(outs):
    agree['index_scores_mosaic'] = scores_equal(
        outs['index_scores_mosaic'], outs['index_scores'])
  for name, base in (('main_mosaic', 'main'), ('main_mosaic_xla_merge', 'main'),
                     ('msa_mosaic', 'msa')):
    if {name, base} <= set(outs):
      diff = float(jnp.max(jnp.abs(outs[name][0].astype(jnp.float32) -
                                   outs[base][0].astype(jnp.float32))))
      row[f'{name}_max_abs_diff'] = diff
      agree[name] = diff <= TUNE_TOLERANCE
  wrong = sorted(name for name, ok in agree.items() if not ok)
  for key, num, den in (('speedup', 'dense', 'msa'),
                        ('speedup_mosaic', 'dense', 'msa_mosaic'),
                        ('msa_mosaic_speedup', 'msa', 'msa_mosaic'),
                        ('index_scores_mosaic_speedup', 'index_scores',
                         'index_scores_mosaic'),
                        ('main_mosaic_speedup', 'main', 'main_mosaic'),
                        ('main_mosaic_xla_merge_speedup', 'main',
                         'main_mosaic_xla_merge')):
    if den in wrong:
      continue
    if (ratio := _ratio(med, num, den)) is not None:
      row[key] = ratio
  if 'main_mosaic' in med:
    main_f = prefill_flops(cfg, t)[1] - index_flops(cfg, t)
    row['main_mosaic_tflops'] = main_f / med['main_mosaic'] / 1e12
  row['mosaic_wrong'] = wrong
  if errors:
    row['kernel_errors'] = errors
  return row


PROFILE_CALLS = 3  # back-to-back calls per trace


def profile(cfg: GPUBench, t: int, decode_impl: str) -> dict:
  """One trace each of MSA and dense: prefill at t, decode at the longest
  cache (decode_batch sequences), summed per kernel (`trace.summarize`):
  whether a step's time is its kernels' or the gaps between its launches
  (decode: measured MSA 225 us at 128k, where its 302 MB take about 100
  us at the measured copy rate), and which kernel to work on next."""
  kw = dict(block_size=cfg.block_size, top_k=cfg.top_k)
  q, k, v, qi, ki = _inputs(cfg, 1, t, t)
  prefill_fns = {
      'msa': (functools.partial(pallas_path.msa_attention, q_offset=0,
                                backend='gpu', interpret=cfg.interpret, **kw),
              (q, k, v, qi, ki)),
      'dense': (functools.partial(dense_prefill,
                                  implementation=cfg.dense_impl), (q, k, v))}
  s, b = max(cfg.decode_lens), cfg.decode_batch
  q, k, v, qi, ki = _inputs(cfg, b, 1, s)
  lengths = jnp.full((b,), s, jnp.int32)
  decode_fns = {
      'msa': (functools.partial(pallas_path.msa_decode, backend='gpu',
                                interpret=cfg.interpret, **kw),
              (q[:, 0], k, v, qi[:, 0], ki, lengths)),
      'dense': (functools.partial(benchmark.dense_decode,
                                  implementation=decode_impl),
                (q[:, 0], k, v, lengths))}
  out, errors = {}, {}
  for what, fns in ((f'prefill {t}', prefill_fns),
                    (f'decode {s} x{b}', decode_fns)):
    for name, (fn, args) in fns.items():
      try:
        out[f'{what} {name}'] = trace.profile(fn, args, calls=PROFILE_CALLS)
      except Exception as e:  # pylint: disable=broad-except
        errors[f'{what} {name}'] = benchmark.error_text(e)
  row = {'profiles': out}
  if errors:
    row['kernel_errors'] = errors
  return row


def _log_row(row: dict):
  print('# row ' + json.dumps(row), flush=True)


def _rounded(row: dict) -> dict:
  def r(x):
    if isinstance(x, float):
      return round(x, 6)
    if isinstance(x, dict):
      return {key: r(val) for key, val in x.items()}
    return x
  return r(row)


def _phase(name: str, fn, clock: _Clock, log, **key) -> dict:
  """One measurement: its row, or why it has none (error, deadline)."""
  start = time.monotonic()
  if not clock.ok():
    row = {**key, 'skipped': 'deadline'}
  else:
    try:
      row = {**key, **fn()}
    except Exception as e:  # pylint: disable=broad-except
      # Keep what ran; say why this one did not.
      row = {**key, 'error': f'{type(e).__name__}: {e}'[:2000]}
  # Wall time with compiles: what the next run's budget has to fit.
  row['elapsed_s'] = time.monotonic() - start
  row = _rounded({'phase': name, **row})
  log(row)
  return row


def schedule(cfg: GPUBench) -> list[tuple[str, int]]:
  """The measuring phases after ceilings, check and tune, in run order:
  (phase, length).

  A GPU is lent for minutes and the soft deadline ends the run wherever it
  falls, so the cheaper target measurements go first: prefill up to
  train_max_len, then decode, then forward+backward (the most compiles),
  then the longer prefill rows (128k: the costliest dense calls), and
  then, being no target, a kernel-by-kernel trace of one prefill and one
  decode step (`profile`), and last the Mosaic GPU kernels beside the
  Triton ones at train_max_len and the longest prefill (`mosaic`: they
  had never run on a GPU, and a faulting launch could spoil what follows
  it in the process).
  """
  short = [t for t in cfg.seq_lens if t <= cfg.train_max_len]
  long = [t for t in cfg.seq_lens if t > cfg.train_max_len]
  return ([('prefill', t) for t in short] +
          [('decode', s) for s in cfg.decode_lens] +
          [('train', t) for t in short] +
          [('prefill', t) for t in long] +
          [('profile', t) for t in short[-1:]] +
          [('mosaic', t) for t in short[-1:] + long[-1:]])


# Fields of a train row that name its own run, not a measurement: kept
# under train_* in the prefill row it joins.
_TRAIN_OWN = ('elapsed_s', 'skipped', 'error')


def merge_train(rows: list[dict], trains: list[dict]) -> list[dict]:
  """Prefill rows with the train row of the same length folded in (its
  spread, compile times and kernel errors beside the prefill's; its own
  elapsed time, skip or error as train_elapsed_s, train_skipped,
  train_error)."""
  by_len = {r['seq_len']: r for r in trains}
  out = []
  for row in rows:
    tr = by_len.get(row.get('seq_len'))
    if tr is None:
      out.append(row)
      continue
    row = dict(row)
    for key, val in tr.items():
      if key in ('phase', 'seq_len'):
        continue
      if key in _TRAIN_OWN:
        row[f'train_{key}'] = val
      elif isinstance(val, dict):
        row[key] = {**row.get(key, {}), **val}
      else:
        row[key] = val
    out.append(row)
  return out


def phase_rows(bench: dict) -> tuple[list[dict], list[dict]]:
  """(prefill rows with their train fields, decode rows) of a bench
  summary: the final JSON's, or those a run cut short printed as it went
  (gpu_check_summary keeps them under 'partial')."""
  if 'results' in bench or 'decode' in bench:
    return bench.get('results') or [], bench.get('decode') or []
  part = bench.get('partial', [])
  pick = lambda name: [r for r in part if r.get('phase') == name]
  return (merge_train(pick('prefill'), pick('train')), pick('decode'))


def run(cfg: GPUBench, log=_log_row, deadline: float | None = None) -> dict:
  """Every phase, in `schedule` order; `deadline` (time.monotonic()) is
  soft."""
  clock = _Clock(deadline)
  ceil = _phase('ceilings', lambda: ceilings(cfg), clock, log)
  decode_impl = _decode_impl(cfg) if clock.ok() else cfg.dense_impl
  chk = _phase('check', lambda: check(cfg), clock, log,
               check_len=cfg.check_len, decode_dense_impl=decode_impl)
  tun = _phase('tune', lambda: tune(cfg, clock), clock, log,
               tune_len=cfg.tune_len)
  best = tuned_config(tun)
  measure = {
      'prefill': lambda t: prefill(cfg, t, best),
      'decode': lambda s: decode(cfg, s, decode_impl, best),
      'train': lambda t: train(cfg, t, best),
      'profile': lambda t: profile(cfg, t, decode_impl),
      'mosaic': lambda t: mosaic(cfg, t)}
  length = {'prefill': 'seq_len', 'decode': 'cache_len', 'train': 'seq_len',
            'profile': 'seq_len', 'mosaic': 'seq_len'}
  done_rows = {name: [] for name in measure}
  for name, n in schedule(cfg):
    done_rows[name].append(_phase(name, lambda f=measure[name], n=n: f(n),
                                  clock, log, **{length[name]: n}))
  # Rows in length order, as before the schedule.
  by_len = lambda rs, key: sorted(rs, key=lambda r: r[key])
  rows = merge_train(by_len(done_rows['prefill'], 'seq_len'),
                     done_rows['train'])
  dec = by_len(done_rows['decode'], 'cache_len')
  done = lambda rs, key: [r for r in rs if key in r]
  ok = done(rows, 'speedup')
  last = ok[-1] if ok else {}
  dok = done(dec, 'decode_speedup')
  dlast = dok[-1] if dok else {}
  return {
      'bench': 'msa_gpu',
      'ceilings': ceil,
      'reference_check': chk,
      'tune': tun,
      'results': rows,
      'decode': dec,
      # Diagnostic, not a target: a trace that fails (no CUPTI) leaves the
      # run complete, with its error in this row.
      'profile': done_rows['profile'][0] if done_rows['profile'] else None,
      # Diagnostic too: kernels not yet the default.
      'mosaic': done_rows['mosaic'],
      'complete': all('skipped' not in r and 'error' not in r and
                      'kernel_errors' not in r
                      for r in [ceil, chk, tun, *done_rows['prefill'],
                                *done_rows['train'], *dec]),
      'order': [f'{name} {n}' for name, n in schedule(cfg)],
      'dense_prefill_impl': cfg.dense_impl,
      'dense_decode_impl': decode_impl,
      'paper_prefill_speedup': PAPER_PREFILL_SPEEDUP,
      'paper_decode_speedup': PAPER_DECODE_SPEEDUP,
      'max_len': last.get('seq_len'),
      'prefill_speedup_at_max_len': last.get('speedup'),
      'prefill_flop_ratio_at_max_len': last.get('flop_ratio'),
      'decode_len': dlast.get('cache_len'),
      'decode_speedup_at_max_len': dlast.get('decode_speedup'),
      'decode_flop_ratio_at_max_len': dlast.get('decode_flop_ratio'),
  }
