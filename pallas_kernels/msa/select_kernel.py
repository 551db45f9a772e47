"""Pallas kernel (a): causal block-max index scores and top-k block selection.

One program owns a tile of queries of one GQA group and streams the key
blocks past it, keeping a running top-(K-1) of the earlier blocks per query in
a small (value, id) table, so the [T, N] score matrix is never written out.
When the last visible block has been seen the table is sorted (score
descending, lower id first on ties, as `lax.top_k`) and laid out as
docs/design.md §6.3 asks: earlier blocks, then the local block, then -1.

Two lowerings share the math helpers below:
* TPU (Mosaic): grid (B, G, query tiles, key chunks); the key chunk index is
  clamped to the last visible chunk in the index_map, so chunks above the
  diagonal are neither fetched nor computed. The per-sequence offsets ride in
  scalar prefetch (decode has one offset per sequence).
* GPU (Triton): grid (B, G, query tiles); a fori_loop walks the visible
  blocks, loading each with a dynamic slice of the key array.
On CPU both run with interpret=True.
Padding keys: an int32 key-valid mask rides along with the index keys (TPU
[B, chunks, 1, chunk], a lane row per chunk; GPU [B, S]); an invalid key's
logit is -inf, so a block's score is the max over its valid keys and a block
with none never enters the table (its slot stays -1).

Letter key: B batch, T query tokens, S key tokens, G groups, I index head dim,
N key blocks, C block size, K selected blocks, L lanes of the running table.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.msa import index_kernel
from pallas_kernels.msa import kernel_common as kc

NEG_INF = float('-inf')
HIGHEST = jax.lax.Precision.HIGHEST
# TPU: key blocks per streamed chunk (the keys are padded to whole chunks).
CHUNK_BLOCKS = 4


def insert_candidate(vals, ids, score, block_id, n_live: int):
  """Offer one block's score ([Tq, 1]) to every row's running top table.

  Blocks arrive in increasing id order, so a newcomer that only ties the
  worst entry must lose (the lower id wins ties); among equal worst entries the
  highest id is evicted.
  """
  lane = jax.lax.broadcasted_iota(jnp.int32, vals.shape, 1)
  live = lane < n_live
  worst = jnp.min(jnp.where(live, vals, jnp.inf), axis=1, keepdims=True)
  at_worst = live & (vals == worst)
  victim_id = jnp.max(jnp.where(at_worst, ids, -2), axis=1, keepdims=True)
  victim_lane = jnp.min(
      jnp.where(at_worst & (ids == victim_id), lane, vals.shape[1]),
      axis=1, keepdims=True)
  take = (lane == victim_lane) & (score > worst)
  return jnp.where(take, score, vals), jnp.where(take, block_id, ids)


def compose_selection(vals, ids, local, n_live: int, k_out: int):
  """Sort the running table and lay out [earlier..., local, -1...] ([Tq, k_out])."""
  lane = jax.lax.broadcasted_iota(jnp.int32, vals.shape, 1)
  avail = lane < n_live
  slot = jax.lax.broadcasted_iota(jnp.int32, (vals.shape[0], k_out), 1)
  out = jnp.full((vals.shape[0], k_out), -1, jnp.int32)
  big = jnp.int32(2**30)
  for kk in range(n_live):
    best = jnp.max(jnp.where(avail, vals, NEG_INF), axis=1, keepdims=True)
    at_best = avail & (vals == best)
    best_id = jnp.min(jnp.where(at_best, ids, big), axis=1, keepdims=True)
    lane_taken = jnp.min(jnp.where(at_best & (ids == best_id), lane,
                                   vals.shape[1]), axis=1, keepdims=True)
    avail = avail & (lane != lane_taken)
    out = jnp.where(slot == kk, best_id, out)
  n_earlier = jnp.minimum(local, n_live)
  return jnp.where(slot < n_earlier, out,
                   jnp.where(slot == n_earlier, local, -1)).astype(jnp.int32)


# ----------------------------------------------------------------------------
# TPU (Mosaic)


def _tpu_kernel(offset_ref, qi_ref, ki_ref, valid_ref, sel_ref, vals_ref,
                ids_ref, *,
                block_size: int, chunk: int, top_k: int, scale: float):
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  tq = qi_ref.shape[0]
  n_live = top_k - 1
  qpos = offset_ref[b] + i * tq + jax.lax.broadcasted_iota(jnp.int32, (tq, 1), 0)

  @pl.when(j == 0)
  def _init():
    vals_ref[...] = jnp.full(vals_ref.shape, NEG_INF, jnp.float32)
    ids_ref[...] = jnp.full(ids_ref.shape, -1, jnp.int32)

  @pl.when(j * chunk <= offset_ref[b] + i * tq + tq - 1)
  def _scan_chunk():
    logits = jax.lax.dot_general(
        qi_ref[...].astype(jnp.float32), ki_ref[...].astype(jnp.float32),
        (((1,), (1,)), ((), ())), precision=HIGHEST,
        preferred_element_type=jnp.float32) * scale
    kpos = j * chunk + jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
    logits = jnp.where((kpos <= qpos) & (valid_ref[...] > 0), logits, NEG_INF)
    vals, ids = vals_ref[...], ids_ref[...]
    for jb in range(chunk // block_size):
      score = jnp.max(logits[:, jb * block_size:(jb + 1) * block_size], axis=1,
                      keepdims=True)
      block_id = j * (chunk // block_size) + jb
      score = jnp.where(block_id < kc.div(qpos, block_size), score, NEG_INF)
      vals, ids = insert_candidate(vals, ids, score, block_id, n_live)
    vals_ref[...] = vals
    ids_ref[...] = ids

  @pl.when(j == pl.num_programs(3) - 1)
  def _emit():
    sel_ref[...] = compose_selection(vals_ref[...], ids_ref[...],
                                     kc.div(qpos, block_size), n_live, top_k)


def _select_tpu(qi_BGTI, ki_BSI, valid_BS, offset_B, *, block_size, top_k,
                q_tile, chunk, scale, interpret):
  b, g, tp, di = qi_BGTI.shape
  sp = ki_BSI.shape[1]
  lanes = kc.round_up(max(top_k - 1, 1), 128)
  n_chunks = sp // chunk

  def ki_map(bb, gg, ii, jj, off_ref):
    # Past the last visible chunk keep the same block index: no new DMA.
    last = kc.div(off_ref[bb] + ii * q_tile + q_tile - 1, chunk)
    return bb, jnp.minimum(jj, last), 0

  def valid_map(bb, gg, ii, jj, off_ref):
    return bb, ki_map(bb, gg, ii, jj, off_ref)[1], 0, 0

  kernel = functools.partial(_tpu_kernel, block_size=block_size, chunk=chunk,
                             top_k=top_k, scale=scale)
  return kc.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(b, g, tp // q_tile, n_chunks),
          in_specs=[
              pl.BlockSpec((None, None, q_tile, di),
                           lambda bb, gg, ii, jj, off: (bb, gg, ii, 0)),
              pl.BlockSpec((None, chunk, di), ki_map),
              pl.BlockSpec((None, None, 1, chunk), valid_map),
          ],
          out_specs=pl.BlockSpec((None, None, q_tile, top_k),
                                 lambda bb, gg, ii, jj, off: (bb, gg, ii, 0)),
          scratch_shapes=[pltpu.VMEM((q_tile, lanes), jnp.float32),
                          pltpu.VMEM((q_tile, lanes), jnp.int32)]),
      out_shape=jax.ShapeDtypeStruct((b, g, tp, top_k), jnp.int32),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'parallel',
                               'arbitrary')),
      interpret=interpret,
      name='msa_select_tpu',
  )(offset_B, qi_BGTI, ki_BSI, valid_BS.reshape(b, n_chunks, 1, chunk))


# ----------------------------------------------------------------------------
# GPU (Triton)


def _gpu_kernel(offset_ref, qi_ref, ki_ref, valid_ref, sel_ref, *,
                block_size: int,
                top_k: int, scale: float, n_blocks: int):
  i = pl.program_id(2)
  tq = qi_ref.shape[0]
  n_live = top_k - 1
  lanes = kc.next_pow2(max(n_live, 1))
  offset = offset_ref[0]
  qpos = offset + i * tq + jax.lax.broadcasted_iota(jnp.int32, (tq, 1), 0)
  qi = qi_ref[...].astype(jnp.float32)

  def body(jb, carry):
    vals, ids = carry
    k = ki_ref[pl.ds(jb * block_size, block_size), :].astype(jnp.float32)
    logits = jax.lax.dot_general(qi, k, (((1,), (1,)), ((), ())),
                                 precision=HIGHEST,
                                 preferred_element_type=jnp.float32) * scale
    kpos = jb * block_size + jax.lax.broadcasted_iota(
        jnp.int32, (1, block_size), 1)
    ok = valid_ref[pl.ds(jb * block_size, block_size)][None, :] > 0
    logits = jnp.where((kpos <= qpos) & ok, logits, NEG_INF)
    score = jnp.max(logits, axis=1, keepdims=True)
    score = jnp.where(jb < kc.div(qpos, block_size), score, NEG_INF)
    return insert_candidate(vals, ids, score, jb, n_live)

  # Blocks below the tile's last local block are the only candidates.
  n_scan = jnp.minimum(kc.div(offset + i * tq + tq - 1, block_size), n_blocks)
  vals, ids = jax.lax.fori_loop(
      0, n_scan, body, (jnp.full((tq, lanes), NEG_INF, jnp.float32),
                        jnp.full((tq, lanes), -1, jnp.int32)))
  sel_ref[...] = compose_selection(vals, ids, kc.div(qpos, block_size), n_live,
                                   sel_ref.shape[-1])


def _select_gpu(qi_BGTI, ki_BSI, valid_BS, offset_B, *, block_size, top_k,
                q_tile, scale, interpret):
  b, g, tp, di = qi_BGTI.shape
  sp = ki_BSI.shape[1]
  kp = kc.next_pow2(top_k)
  kernel = functools.partial(_gpu_kernel, block_size=block_size, top_k=top_k,
                             scale=scale,
                             n_blocks=sp // block_size)
  sel = kc.pallas_call(
      kernel,
      grid=(b, g, tp // q_tile),
      in_specs=[
          pl.BlockSpec((1,), lambda bb, gg, ii: (bb,)),
          pl.BlockSpec((None, None, q_tile, di),
                       lambda bb, gg, ii: (bb, gg, ii, 0)),
          pl.BlockSpec((None, sp, di), lambda bb, gg, ii: (bb, 0, 0)),
          pl.BlockSpec((None, sp), lambda bb, gg, ii: (bb, 0)),
      ],
      out_specs=pl.BlockSpec((None, None, q_tile, kp),
                             lambda bb, gg, ii: (bb, gg, ii, 0)),
      out_shape=jax.ShapeDtypeStruct((b, g, tp, kp), jnp.int32),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name='msa_select_gpu',
  )(offset_B, qi_BGTI, ki_BSI, valid_BS)
  return sel[..., :top_k]


def select_blocks_BGTK(qi_BTGI, ki_BSI, offset_B, *, block_size: int,
                       top_k: int, backend: str, interpret: bool,
                       q_tile: int | None = None,
                       chunk_blocks: int = CHUNK_BLOCKS, kv_valid_BS=None,
                       gpu_method: str = 'two_pass',
                       topk: str = 'pallas',
                       fp8_scores: bool = False,
                       scores_kernel: str = 'triton') -> jax.Array:
  """Selection [B, G, T, K] for queries at positions t + offset_B[b].

  Any T and S work: queries and keys are zero-padded to whole tiles and the
  padding is masked out (padded keys sit beyond every query's position).
  kv_valid_BS: bool [B, S], False at padding keys (None: all valid).
  gpu_method: on the GPU backend, 'two_pass' (index_kernel.py: a tensor-core
  score launch, then a top-k launch; dots in bf16 when qi and ki are bf16)
  or 'fused' (this module's running-table kernel, f32 dots: the oracle).
  topk, fp8_scores, scores_kernel: the two-launch selector's options
  (index_kernel.select_blocks_BGTK).
  """
  if backend == 'gpu' and gpu_method == 'two_pass':
    return index_kernel.select_blocks_BGTK(
        qi_BTGI, ki_BSI, offset_B, kv_valid_BS, block_size=block_size,
        top_k=top_k, interpret=interpret, topk=topk, fp8_scores=fp8_scores,
        scores_kernel=scores_kernel)
  if fp8_scores:
    raise ValueError('fp8_scores needs the two-pass GPU selector.')
  if scores_kernel != 'triton':
    raise ValueError('scores_kernel needs the two-pass GPU selector.')
  if gpu_method not in ('two_pass', 'fused'):
    raise ValueError(f"gpu_method must be 'two_pass' or 'fused', got "
                     f'{gpu_method!r}.')
  b, t, g, di = qi_BTGI.shape
  s = ki_BSI.shape[1]
  if backend == 'tpu':
    q_tile = q_tile or (8 if t <= 8 else 128)
    chunk = block_size * chunk_blocks
    dip = di
  else:
    q_tile = q_tile or (16 if t <= 16 else 64)
    chunk = block_size
    dip = max(16, kc.next_pow2(di))
  tp = kc.round_up(t, q_tile)
  sp = kc.round_up(s, chunk)
  qi = jnp.pad(qi_BTGI.astype(jnp.float32).transpose(0, 2, 1, 3),
               ((0, 0), (0, 0), (0, tp - t), (0, dip - di)))
  # The keys stay in their dtype (the kernels cast each tile to f32, which
  # is exact from bf16): a decode cache of whole chunks is read in place,
  # never recast whole at every step.
  ki = ki_BSI
  if ki.dtype not in (jnp.float32, jnp.bfloat16):
    ki = ki.astype(jnp.float32)
  if sp != s or dip != di:
    ki = jnp.pad(ki, ((0, 0), (0, sp - s), (0, dip - di)))
  valid = (jnp.ones((b, s), jnp.int32) if kv_valid_BS is None
           else jnp.asarray(kv_valid_BS).astype(jnp.int32))
  valid = jnp.pad(valid, ((0, 0), (0, sp - s)))
  offset_B = jnp.broadcast_to(jnp.asarray(offset_B, jnp.int32), (b,))
  if backend == 'tpu':
    sel = _select_tpu(qi, ki, valid, offset_B, block_size=block_size, top_k=top_k,
                      q_tile=q_tile, chunk=chunk, scale=1.0 / math.sqrt(di),
                      interpret=interpret)
  else:
    sel = _select_gpu(qi, ki, valid, offset_B, block_size=block_size, top_k=top_k,
                      q_tile=q_tile, scale=1.0 / math.sqrt(di),
                      interpret=interpret)
  return sel[:, :, :t]
