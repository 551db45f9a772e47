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
* GPU, union tiles (`forward_gpu_tiles`): the TPU kernel's idea on Triton.
  A program takes Tq neighbouring tokens, whose Tq x R head rows (128 in
  bf16) meet each block of the union of the tokens' selections in one
  tensor-core dot, flash-style, with the same row mask. Against the
  per-token kernel: tiles 8x taller and each block read once per tile, not
  per token; against KV-outer (kv_outer.py): a token's slots are merged in
  registers, so no per-slot partial goes to memory and back. The cost is
  the union's blocks a row did not select, computed then masked: how much
  neighbouring tokens' selections overlap decides between the kernels.

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


def tile_row_views(off_ref, sel_ref, i, tq: int, rp: int):
  """A union tile's per-row (qpos_W1, sel_WK): each of its Tq x Rp rows'
  token position and that token's selection (tile i of the grid)."""
  w = tq * rp
  qpos_W1 = (off_ref[0] + i * tq +
             kc.div(jax.lax.broadcasted_iota(jnp.int32, (w, 1), 0), rp))
  sel_WK = jnp.broadcast_to(sel_ref[...][:, None, :],
                            (tq, rp, sel_ref.shape[-1])).reshape(w, -1)
  return qpos_W1, sel_WK


def union_block(blk, k_ref, v_ref, valid_ref, block_size: int, qpos_W1,
                sel_WK):
  """(k_CD, v_CD, mask_WC) of block blk for a union tile: a row sees the
  block only if its own token selected it, causally, at valid keys."""
  start = blk * block_size
  k_CD = k_ref[pl.ds(start, block_size), :]
  v_CD = v_ref[pl.ds(start, block_size), :]
  kpos_1C = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
  ok_1C = valid_ref[pl.ds(start, block_size)][None, :] > 0
  hit_W1 = jnp.max((sel_WK == blk).astype(jnp.int32), axis=1,
                   keepdims=True) > 0
  return k_CD, v_CD, hit_W1 & (kpos_1C <= qpos_W1) & ok_1C


def _gpu_tiles_kernel(off_ref, count_ref, blocks_ref, q_ref, k_ref, v_ref,
                      valid_ref, sel_ref, o_ref, lse_ref, *, block_size: int,
                      scale: float, precision):
  """Tq neighbouring tokens x their group's Rp heads as the rows of one
  tile, against the union of the tokens' selected blocks (ascending, each
  read once); a row sees a block only if its own token selected it (and
  causally), so every token still attends exactly its K blocks."""
  tq, rp, dp = q_ref.shape
  w = tq * rp
  q_WD = q_ref[...].reshape(w, dp)
  qpos_W1, sel_WK = tile_row_views(off_ref, sel_ref, pl.program_id(0), tq,
                                   rp)

  def visit(u, carry):
    m, l, acc = carry
    k_CD, v_CD, mask_WC = union_block(blocks_ref[u], k_ref, v_ref, valid_ref,
                                      block_size, qpos_W1, sel_WK)
    s_WC = kc.dot_nt(q_WD, k_CD, precision) * scale
    return kc.online_softmax_step(m, l, acc, s_WC, mask_WC, v_CD, precision)

  m, l, acc = jax.lax.fori_loop(
      0, count_ref[0], visit,
      (jnp.full((w, 1), kc.MASK_VALUE, jnp.float32),
       jnp.zeros((w, 1), jnp.float32), jnp.zeros((w, dp), jnp.float32)))
  out_WD, lse_W1 = kc.finish_softmax(m, l, acc)
  o_ref[...] = out_WD.reshape(tq, rp, dp).astype(o_ref.dtype)
  lse_ref[...] = lse_W1.reshape(tq, rp)


def tile_union(sel_BGTK, q_tile: int, n_blocks: int):
  """(blocks_BGQU, count_BGQ): per tile of q_tile tokens, the union of its
  tokens' selected blocks, ascending, U padded to a power of two by
  repeating the last (`schedule.tile_visits`); T a multiple of q_tile."""
  blocks, count = schedule.tile_visits(sel_BGTK, q_tile, n_blocks)
  u = blocks.shape[-1]
  up = kc.next_pow2(u)
  if up != u:
    blocks = jnp.concatenate(
        [blocks, jnp.broadcast_to(blocks[..., -1:], (*blocks.shape[:-1],
                                                     up - u))], axis=-1)
  return blocks, count


def union_plan(sel_BGTK, q_tile: int, *, block_size: int, heads_p: int,
               head_dim_p: int, keys_p: int):
  """The union-tile kernels' shared launch plan for grid (tiles, B, G):
  (sel_BGTK padded to whole tiles with -1, blocks, count, in_specs of
  their common operands (offsets, the tile's union count and block list,
  q, K, V, key-valid mask, selection), the spec of a tile's [Tq, Rp, Dp]
  rows and of its [Tq, Rp] per-row values)."""
  if q_tile < 1 or q_tile & (q_tile - 1):
    raise ValueError(f'q_tile must be a power of two, got {q_tile}.')
  b, g, t, kp = sel_BGTK.shape
  tp = kc.round_up(t, q_tile)
  if tp != t:
    sel_BGTK = jnp.pad(sel_BGTK, ((0, 0), (0, 0), (0, tp - t), (0, 0)),
                       constant_values=-1)
  blocks, count = tile_union(sel_BGTK, q_tile, keys_p // block_size)
  nq, u = blocks.shape[2:]
  rows = pl.BlockSpec((None, q_tile, None, heads_p, head_dim_p),
                      lambda ii, bb, gg: (bb, ii, gg, 0, 0))
  per_row = pl.BlockSpec((None, q_tile, None, heads_p),
                         lambda ii, bb, gg: (bb, ii, gg, 0))
  kv = pl.BlockSpec((None, keys_p, None, head_dim_p),
                    lambda ii, bb, gg: (bb, 0, gg, 0))
  specs = [pl.BlockSpec((1,), lambda ii, bb, gg: (bb,)),
           pl.BlockSpec((1,), lambda ii, bb, gg: ((bb * g + gg) * nq + ii,)),
           pl.BlockSpec((None, None, None, u),
                        lambda ii, bb, gg: (bb, gg, ii, 0)),
           rows, kv, kv,
           pl.BlockSpec((None, keys_p), lambda ii, bb, gg: (bb, 0)),
           pl.BlockSpec((None, None, q_tile, kp),
                        lambda ii, bb, gg: (bb, gg, ii, 0))]
  return sel_BGTK, blocks, count.reshape(-1), specs, rows, per_row


def pad_tokens(x, tp: int):
  """x [B, T, ...] padded with zeros to tp tokens."""
  t = x.shape[1]
  return x if tp == t else jnp.pad(
      x, ((0, 0), (0, tp - t)) + ((0, 0),) * (x.ndim - 2))


def tiles_per_query_tile(heads_p: int, dtype) -> int:
  """Tokens per tile of `forward_gpu_tiles`: 128 rows in 16-bit dtypes, 64
  in f32 (as the KV-outer tiles)."""
  rows = 128 if jnp.dtype(dtype).itemsize <= 2 else 64
  return max(1, rows // heads_p)


def forward_gpu_tiles(q_BTGRD, k_BSGD, v_BSGD, sel_BGTK, off_B, valid_BS, *,
                      block_size: int, scale: float, interpret: bool,
                      q_tile: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None):
  """Padded operands in (R, D, K powers of two); (o, lse_BTGR) out, as
  forward_gpu, with q_tile neighbouring tokens per program (a power of
  two; default `tiles_per_query_tile`: 8 at 16 heads in bf16).

  Between the per-token kernel (q_tile 1: 16-row tiles, every token reads
  its own K blocks) and the KV-outer one (partials per (token, slot) that a
  combine merges): a tile's rows share each block they read and keep
  their slots merged in registers, so no partial leaves the program; the
  price is the blocks of the union that a row did not select, which it
  computes and masks. How much neighbouring tokens' selections overlap
  decides it (`tile_union`'s count against K).
  """
  b, t, g, rp, dp = q_BTGRD.shape
  tq = q_tile or tiles_per_query_tile(rp, q_BTGRD.dtype)
  sel_BGTK, blocks, count, in_specs, rows, per_row = union_plan(
      sel_BGTK, tq, block_size=block_size, heads_p=rp, head_dim_p=dp,
      keys_p=k_BSGD.shape[1])
  tp = sel_BGTK.shape[2]
  q_BTGRD = pad_tokens(q_BTGRD, tp)
  itemsize = jnp.dtype(q_BTGRD.dtype).itemsize
  kernel = functools.partial(
      _gpu_tiles_kernel, block_size=block_size, scale=scale,
      precision=kc.gpu_precision_for(q_BTGRD.dtype, interpret))
  o, lse = kc.pallas_call(
      kernel,
      grid=(blocks.shape[2], b, g),
      in_specs=in_specs,
      out_specs=[rows, per_row],
      out_shape=[jax.ShapeDtypeStruct((b, tp, g, rp, dp), q_BTGRD.dtype),
                 jax.ShapeDtypeStruct((b, tp, g, rp), jnp.float32)],
      compiler_params=plgpu.CompilerParams(
          num_warps=num_warps or (8 if tq * rp >= 128 else 4),
          num_stages=num_stages or (2 if itemsize <= 2 else 1)),
      interpret=interpret,
      name='msa_forward_gpu_tiles',
  )(off_B, count, blocks, q_BTGRD, k_BSGD, v_BSGD, valid_BS, sel_BGTK)
  return o[:, :t], lse[:, :t]
