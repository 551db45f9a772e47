"""Pallas kernel (b): block-sparse flash-attention forward, output and LSE.

Only selected K/V blocks are read. Two lowerings:

* TPU (Mosaic): grid (B, G, query tiles, U). A query tile walks the union of
  its tokens' selected blocks (`schedule.tile_visits`), passed by scalar
  prefetch; the K/V index_map reads the block id from that list, so the
  pipeline DMAs exactly the listed blocks. A row mask (token's own selection
  AND causal) keeps each token to its K blocks, so the result is exact per
  token. Each of the group's R heads is a [Tq, D] x [D, C] MXU matmul against
  the shared block.
* GPU (Triton): one program per (token, batch, group), NSA-style: the r heads
  of the token's group are the rows of the tile (padded to 16 for tl.dot) and
  a loop over the K selected blocks loads each with a dynamic slice.
  No union, no wasted columns; -1 slots are masked out.

Padding keys: an int32 key-valid mask is read with each key block (TPU
[B, N, 1, C], one lane row per block; GPU [B, S]) and ANDed into the row
mask, so a padding key weighs exactly 0; a row that meets no valid key ends
with out 0 and lse -inf (`kernel_common.finish_softmax`).

Letter key: B batch, T query tokens, S key tokens, H query heads, G groups,
R heads per group, D head dim, K selected blocks, C block size, Q query
tiles, U union entries per tile, X = R*D (a group's heads side by side).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.msa import kernel_common as kc
from pallas_kernels.msa import schedule

LANES = 128


# ----------------------------------------------------------------------------
# TPU (Mosaic)


def _tpu_kernel(off_ref, blocks_ref, count_ref, q_ref, k_ref, v_ref, valid_ref,
                sel_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr, *, block_size: int,
                n_heads: int, head_dim: int, scale: float, n_groups: int,
                n_qtiles: int, width: int):
  b, g, i, u = (pl.program_id(a) for a in range(4))
  tq = q_ref.shape[0]
  tile = (b * n_groups + g) * n_qtiles + i
  prec = kc.precision_for(q_ref.dtype)

  @pl.when(u == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, kc.MASK_VALUE, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  @pl.when(u < count_ref[tile])
  def _visit():
    blk = blocks_ref[tile * width + u]
    mask = kc.query_tile_mask(sel_ref[...], blk, off_ref[b] + i * tq, tq,
                              block_size) & (valid_ref[...] > 0)
    k, v = k_ref[...], v_ref[...]
    for h in range(n_heads):
      q = q_ref[:, h * head_dim:(h + 1) * head_dim]
      s = kc.dot_nt(q, k, prec) * scale
      m, l, acc = kc.online_softmax_step(m_scr[h][:, :1], l_scr[h][:, :1],
                                         acc_scr[h], s, mask, v, prec)
      m_scr[h] = jnp.broadcast_to(m, (tq, LANES))
      l_scr[h] = jnp.broadcast_to(l, (tq, LANES))
      acc_scr[h] = acc

  @pl.when(u == pl.num_programs(3) - 1)
  def _finish():
    for h in range(n_heads):
      out, lse = kc.finish_softmax(m_scr[h][:, :1], l_scr[h][:, :1],
                                   acc_scr[h])
      o_ref[:, h * head_dim:(h + 1) * head_dim] = out.astype(o_ref.dtype)
      lse_ref[:, h:h + 1] = lse


def forward_tpu(q_BGTX, k_BGSD, v_BGSD, sel_BGTK, off_B, valid_BS, *,
                block_size: int, n_heads: int, q_tile: int, scale: float,
                interpret: bool):
  """Padded group-major operands in; (o_BGTX, lse_BGTR f32) out.

  valid_BS: int32 [B, Sp], 0 at padding keys.
  """
  b, g, tp, x = q_BGTX.shape
  sp, d = k_BGSD.shape[2:]
  n_blocks = sp // block_size
  nq = tp // q_tile
  blocks, count = schedule.tile_visits(sel_BGTK, q_tile, n_blocks)
  width = blocks.shape[-1]

  def kv_map(bb, gg, ii, uu, off, blocks, count):
    return bb, gg, blocks[((bb * g + gg) * nq + ii) * width + uu], 0

  def valid_map(bb, gg, ii, uu, off, blocks, count):
    return bb, kv_map(bb, gg, ii, uu, off, blocks, count)[2], 0, 0

  def q_map(bb, gg, ii, uu, *_):
    return bb, gg, ii, 0

  kernel = functools.partial(
      _tpu_kernel, block_size=block_size, n_heads=n_heads, head_dim=d,
      scale=scale, n_groups=g, n_qtiles=nq, width=width)
  return kc.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3,
          grid=(b, g, nq, width),
          in_specs=[
              pl.BlockSpec((None, None, q_tile, x), q_map),
              pl.BlockSpec((None, None, block_size, d), kv_map),
              pl.BlockSpec((None, None, block_size, d), kv_map),
              pl.BlockSpec((None, None, 1, block_size), valid_map),
              pl.BlockSpec((None, None, q_tile, sel_BGTK.shape[-1]), q_map),
          ],
          out_specs=[
              pl.BlockSpec((None, None, q_tile, x), q_map),
              pl.BlockSpec((None, None, q_tile, n_heads), q_map),
          ],
          scratch_shapes=[
              pltpu.VMEM((n_heads, q_tile, LANES), jnp.float32),
              pltpu.VMEM((n_heads, q_tile, LANES), jnp.float32),
              pltpu.VMEM((n_heads, q_tile, d), jnp.float32),
          ]),
      out_shape=[jax.ShapeDtypeStruct((b, g, tp, x), q_BGTX.dtype),
                 jax.ShapeDtypeStruct((b, g, tp, n_heads), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'parallel',
                               'arbitrary')),
      interpret=interpret,
      name='msa_forward_tpu',
  )(off_B, blocks.reshape(-1), count.reshape(-1), q_BGTX, k_BGSD, v_BGSD,
    valid_BS.reshape(b, n_blocks, 1, block_size), sel_BGTK)


# ----------------------------------------------------------------------------
# GPU (Triton)


def _gpu_kernel(off_ref, q_ref, k_ref, v_ref, valid_ref, sel_ref, o_ref,
                lse_ref, *,
                block_size: int, top_k: int, scale: float, precision):
  t = pl.program_id(0)
  q = q_ref[...]
  rows, d = q.shape
  qpos = off_ref[0] + t

  # A loop, not a Python unroll: one body for ptxas to compile however
  # large top_k is.
  def visit(slot, carry):
    m, l, acc = carry
    blk = sel_ref[slot]
    start = jnp.maximum(blk, 0) * block_size
    k = k_ref[pl.ds(start, block_size), :]
    v = v_ref[pl.ds(start, block_size), :]
    kpos = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
    ok = valid_ref[pl.ds(start, block_size)][None, :] > 0
    mask = (kpos <= qpos) & (blk >= 0) & ok
    s = kc.dot_nt(q, k, precision) * scale
    return kc.online_softmax_step(m, l, acc, s, mask, v, precision)

  m, l, acc = jax.lax.fori_loop(
      0, top_k, visit, (jnp.full((rows, 1), kc.MASK_VALUE, jnp.float32),
                        jnp.zeros((rows, 1), jnp.float32),
                        jnp.zeros((rows, d), jnp.float32)))
  out, lse = kc.finish_softmax(m, l, acc)
  o_ref[...] = out.astype(o_ref.dtype)
  lse_ref[...] = lse[:, 0]


def forward_gpu(q_BTGRD, k_BSGD, v_BSGD, sel_BGTK, off_B, valid_BS, *,
                block_size: int, scale: float, interpret: bool,
                num_warps: int = 4, num_stages: int | None = None):
  """Padded operands in (R, D, K powers of two, R >= 16); (o, lse_BTGR) out.

  valid_BS: int32 [B, Sp], 0 at padding keys.
  """
  b, t, g, rp, dp = q_BTGRD.shape
  sp = k_BSGD.shape[1]
  kp = sel_BGTK.shape[-1]
  if num_stages is None:
    # Each pipeline stage buffers one K and one V block in shared memory:
    # 2 x 64 KiB in f32 at block = D = 128, so f32 gets no second stage
    # (the H100 has 227 KiB per block).
    num_stages = 2 if k_BSGD.dtype.itemsize <= 2 else 1
  kernel = functools.partial(
      _gpu_kernel, block_size=block_size, top_k=kp, scale=scale,
      precision=kc.gpu_precision_for(q_BTGRD.dtype, interpret))
  return kc.pallas_call(
      kernel,
      grid=(t, b, g),
      in_specs=[
          pl.BlockSpec((1,), lambda tt, bb, gg: (bb,)),
          pl.BlockSpec((None, None, None, rp, dp),
                       lambda tt, bb, gg: (bb, tt, gg, 0, 0)),
          pl.BlockSpec((None, sp, None, dp), lambda tt, bb, gg: (bb, 0, gg, 0)),
          pl.BlockSpec((None, sp, None, dp), lambda tt, bb, gg: (bb, 0, gg, 0)),
          pl.BlockSpec((None, sp), lambda tt, bb, gg: (bb, 0)),
          pl.BlockSpec((None, None, None, kp),
                       lambda tt, bb, gg: (bb, gg, tt, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, rp, dp),
                       lambda tt, bb, gg: (bb, tt, gg, 0, 0)),
          pl.BlockSpec((None, None, None, rp),
                       lambda tt, bb, gg: (bb, tt, gg, 0)),
      ],
      out_shape=[jax.ShapeDtypeStruct(q_BTGRD.shape, q_BTGRD.dtype),
                 jax.ShapeDtypeStruct((b, t, g, rp), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                           num_stages=num_stages),
      interpret=interpret,
      name='msa_forward_gpu',
  )(off_B, q_BTGRD, k_BSGD, v_BSGD, valid_BS, sel_BGTK)
