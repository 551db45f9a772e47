"""Pallas kernel (d): MSA decode, one new token per sequence vs a KV cache.

The new token's K/V are already in the cache at position length-1 and it
attends to the selected blocks of keys [0, length). Per-sequence lengths and
the selection [B, G, K] go in scalar prefetch.

* TPU (Mosaic): grid (B, G, K) in the paged-attention pattern: slot k's
  index_map fetches block sel[b, g, k] straight from the cache; a -1 slot maps
  to the local block (already fetched, so no DMA) and the body is skipped.
  The cache is read in place as [B, S, G*D] (a free reshape) when D % 128 == 0
  or G == 1, so a decode step never copies the cache; otherwise it is
  transposed to [B, G, S, D] first (correct, but O(S) extra traffic).
  The group's R heads are the rows of one [R, D] x [D, C] matmul. An int32
  key-valid mask [B, N, 1, C] is fetched with each block, so padding keys in
  the cache weigh 0.
* GPU (Triton): decode is the KV-outer forward at T = 1 and offset
  length-1 (`kv_outer.forward`): split-K, one program per (sequence,
  group, slot), then the log-sum-exp combine; with gpu_kernels='token' the
  per-token prefill kernel (`forward_kernel.forward_gpu`). pallas_path
  calls them directly.

Letter key: B batch, S cache length, G groups, R heads per group, D head dim,
K selected blocks, C block size.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.msa import kernel_common as kc

LANES = 128


def _tpu_kernel(len_ref, sel_ref, q_ref, k_ref, v_ref, valid_ref, o_ref,
                lse_ref, m_scr,
                l_scr, acc_scr, *, block_size: int, scale: float,
                n_groups: int, top_k: int):
  b, g, slot = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows = q_ref.shape[0]
  blk = sel_ref[(b * n_groups + g) * top_k + slot]
  prec = kc.precision_for(q_ref.dtype)

  @pl.when(slot == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, kc.MASK_VALUE, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  @pl.when(blk >= 0)
  def _visit():
    kpos = blk * block_size + jax.lax.broadcasted_iota(
        jnp.int32, (1, block_size), 1)
    mask = jnp.broadcast_to((kpos < len_ref[b]) & (valid_ref[...] > 0),
                            (rows, block_size))
    s = kc.dot_nt(q_ref[...], k_ref[...], prec) * scale
    m, l, acc = kc.online_softmax_step(m_scr[:, :1], l_scr[:, :1], acc_scr[...],
                                       s, mask, v_ref[...], prec)
    m_scr[...] = jnp.broadcast_to(m, m_scr.shape)
    l_scr[...] = jnp.broadcast_to(l, l_scr.shape)
    acc_scr[...] = acc

  @pl.when(slot == top_k - 1)
  def _finish():
    out, lse = kc.finish_softmax(m_scr[:, :1], l_scr[:, :1], acc_scr[...])
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def decode_tpu(q_BGRD, k_cache_BSGD, v_cache_BSGD, sel_BGK, lengths_B,
               valid_BS, *, block_size: int, scale: float, interpret: bool):
  """(out_BGRD, lse_BGR1 f32); S must be a multiple of block_size.

  valid_BS: int32 [B, S], 0 at padding keys.
  """
  b, g, r, d = q_BGRD.shape
  s = k_cache_BSGD.shape[1]
  top_k = sel_BGK.shape[-1]
  in_place = d % 128 == 0 or g == 1

  def fetch(bb, gg, kk, lengths, sel):
    blk = sel[(bb * g + gg) * top_k + kk]
    # -1 slot: re-point at the local block, which every row holds.
    return jnp.where(blk >= 0, blk, kc.div(lengths[bb] - 1, block_size))

  if in_place:
    caches = [x.reshape(b, s, g * d) for x in (k_cache_BSGD, v_cache_BSGD)]
    kv_spec = pl.BlockSpec(
        (None, block_size, d),
        lambda bb, gg, kk, ln, sl: (bb, fetch(bb, gg, kk, ln, sl), gg))
  else:
    caches = [x.transpose(0, 2, 1, 3) for x in (k_cache_BSGD, v_cache_BSGD)]
    kv_spec = pl.BlockSpec(
        (None, None, block_size, d),
        lambda bb, gg, kk, ln, sl: (bb, gg, fetch(bb, gg, kk, ln, sl), 0))
  valid_spec = pl.BlockSpec(
      (None, None, 1, block_size),
      lambda bb, gg, kk, ln, sl: (bb, fetch(bb, gg, kk, ln, sl), 0, 0))
  row_map = lambda bb, gg, kk, *_: (bb, gg, 0, 0)
  kernel = functools.partial(_tpu_kernel, block_size=block_size, scale=scale,
                             n_groups=g, top_k=top_k)
  return kc.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(b, g, top_k),
          in_specs=[pl.BlockSpec((None, None, r, d), row_map), kv_spec,
                    kv_spec, valid_spec],
          out_specs=[pl.BlockSpec((None, None, r, d), row_map),
                     pl.BlockSpec((None, None, r, 1), row_map)],
          scratch_shapes=[pltpu.VMEM((r, LANES), jnp.float32),
                          pltpu.VMEM((r, LANES), jnp.float32),
                          pltpu.VMEM((r, d), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct((b, g, r, d), q_BGRD.dtype),
                 jax.ShapeDtypeStruct((b, g, r, 1), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'arbitrary')),
      interpret=interpret,
      name='msa_decode_tpu',
  )(lengths_B.astype(jnp.int32), sel_BGK.reshape(-1).astype(jnp.int32),
    q_BGRD, *caches, valid_BS.reshape(b, s // block_size, 1, block_size))
