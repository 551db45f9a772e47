"""The KV-outer sparse forward's kernel in Mosaic GPU (Hopper): TMA, wgmma.

kv_outer.py's forward kernel is written for Pallas's Triton lowering: a
program holds one key block and streams the query tiles that selected it,
each tile's rows gathered by an index load (`q_ref[rows, :]`), which
Triton turns into per-thread loads with no TMA and no overlap beyond its
pipeliner. On an H100 that forward ran at about 107 TFLOP/s of useful work
(results/gpu_check_h100.json). This is the same work on Pallas's Mosaic
GPU lowering:

- the block's keys (read transposed, [B, G, Dp, S]: one XLA transpose of K
  per call), its values and its key-padding bias are copied into shared
  memory once by the TMA unit, with the program's window of the tile
  tables (per tile and lane: the query row it reads, the pair row it
  writes);
- a tile's rows are Q queries x the group's Rp heads, and each query's Rp
  rows are contiguous in the query view [T*G*Rp, Dp]: the gather is Q TMA
  copies of [Rp, Dp], straight into the swizzled layout wgmma reads, into
  one of two buffers, so the next tile's gather overlaps this one's work;
- S = Q K^T and O = P V are warpgroup MMAs (bf16 in, f32 accumulated in
  registers; P from registers), with the block-local softmax between them;
  the causal compare uses each row's position, built from the Q lane
  scalars, not loaded per row;
- the partial output, staged in the tile's query buffer, goes out in pair
  order (kv_outer's `pair_order`: a (token, slot) pair's Rp rows at row
  pair * Rp), one TMA copy per lane;
  the log-sum-exps in tile order, one copy per tile (a lane's Rp f32 are
  below the 128 bytes jax 0.10's TMA lowering takes), put in pair order by
  an XLA gather of 1/Dp of the output's size.

A tile is 64 rows, one warpgroup MMA's M: at Rp = 16 that is 4 queries.
The [64, C] scores and the [64, Dp] output accumulator then fit one
warpgroup's registers (at 128 rows they would spill). A program is one
warpgroup; at C = Dp = 128 its shared memory is K and V (64 KiB), two
query buffers (32 KiB), the tables and the bias: about 100 KiB, so two
programs share an SM (227 KiB) and one's MMAs overlap the other's
softmax.

Same partials as kv_outer._forward_kernel with pair_order (to bf16
rounding: P is rounded to bf16 before its MMA in both), merged by the same
combine. bf16 only; Rp a multiple of 8 (the layout's row tile), Dp and C
multiples of 16. On CPU it runs in jax's GPU interpreter and lowers for
CUDA (tests/msa); `make gpu-check` times it beside the Triton forward (the
tune phase).

Letter key as in kv_outer.py: B batch, G groups, Rp padded heads per
group, Dp padded head dim, S keys, C block size, J tiles, Q queries (lanes)
per tile, W rows of a tile (Q * Rp), P (token, slot) pairs, U work items,
L the program's window of tiles.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.msa import mosaic_common as mc

NEG_INF = float('-inf')
TILE_ROWS = 64
_DEAD = -(2**30)  # a dead lane's token: before every key, so all masked
_TABLE_ROWS = 256  # the most rows (tiles) of a table one TMA copy moves


def unsupported(heads_p: int, head_dim_p: int, block_size: int,
                q_per_tile: int, dtype) -> str | None:
  """Why the kernel cannot run at these shapes, in the caller's terms
  (None: it can)."""
  if jnp.dtype(dtype) != jnp.bfloat16:
    return (f'the Mosaic KV-outer forward takes bf16 q, k, v, got '
            f'{jnp.dtype(dtype).name}.')
  if heads_p % 8 or q_per_tile * heads_p != TILE_ROWS:
    return (f'the Mosaic KV-outer forward needs tiles of {TILE_ROWS} rows '
            f'made of whole 8-row parts: heads per group (padded) {heads_p} '
            f'x q_per_tile {q_per_tile}.')
  if head_dim_p % 16 or block_size % 16 or block_size > 256:
    return (f'the Mosaic KV-outer forward needs a head dim and a block size '
            f'(at most 256) that are multiples of 16: head_dim {head_dim_p}, '
            f'block_size {block_size}.')
  return None


def check_shapes(heads_p: int, head_dim_p: int, block_size: int,
                 q_per_tile: int, dtype):
  """Raises ValueError where the kernel cannot run (`unsupported`)."""
  reason = unsupported(heads_p, head_dim_p, block_size, q_per_tile, dtype)
  if reason:
    raise ValueError(reason)


def _forward_body(off_gmem, blk_gmem, first_gmem, count_gmem, src_gmem,
                  dst_gmem, q_gmem, kT_gmem, v_gmem, bias_gmem, o_gmem,
                  lse_gmem, kT_smem, v_smem, bias_smem, src_smem, dst_smem,
                  q_smem, lse_smem, kv_bar, q_bar, p_smem=None, *,
                  block_size: int,
                  heads_p: int, rows_per_token: int, scale: float,
                  n_items: int, layouts: bool):
  """One work item (a key block's run of at most L tiles); grid (B, G, U),
  one warpgroup. Tile i: gather its lanes' query rows, attend the block,
  write the partials."""
  bb = jax.lax.axis_index('b')
  gg = jax.lax.axis_index('g')
  uu = jax.lax.axis_index('u')
  item = (bb * kT_gmem.shape[1] + gg) * n_items + uu
  blk, first, count = blk_gmem[item], first_gmem[item], count_gmem[item]
  n = jnp.where(blk >= 0, count, 0)
  c, rp = block_size, heads_p
  w, q_lanes = q_smem.shape[1], src_smem.shape[1]
  window = src_smem.shape[0]
  start = pl.multiple_of(jnp.maximum(blk, 0) * c, c)
  offset = off_gmem[bb]

  @pl.when(n > 0)
  def _():
    keys = pl.ds(start, c)
    plgpu.copy_gmem_to_smem(kT_gmem.at[bb, gg, :, keys], kT_smem, kv_bar)
    plgpu.copy_gmem_to_smem(v_gmem.at[bb, keys, gg, :], v_smem, kv_bar)
    plgpu.copy_gmem_to_smem(bias_gmem.at[bb, keys], bias_smem, kv_bar)
    # The TMA unit moves at most 256 rows a copy.
    for t0 in range(0, window, _TABLE_ROWS):
      rows = min(_TABLE_ROWS, window - t0)
      for table, buf in ((src_gmem, src_smem), (dst_gmem, dst_smem)):
        plgpu.copy_gmem_to_smem(table.at[bb, gg, pl.ds(first + t0, rows)],
                                buf.at[pl.ds(t0, rows)], kv_bar)
    plgpu.barrier_wait(kv_bar)

  # Read once: nothing rewrites the block's buffers in this program.
  bias_C = mc.load_columns(bias_smem, layouts)
  kpos_C = start + mc.iota((c,), 0, layouts, mc.ACC_COLS)
  lane_W = jax.lax.div(mc.iota((w,), 0, layouts, mc.ACC_ROWS), rp)


  def gather(i, slot):
    for lane in range(q_lanes):
      # A dead lane reads row 0 (masked): every tile waits for Q copies.
      # (Rows of a lane start at a multiple of Rp: the TMA copy's
      # layout inference must be told.)
      row0 = pl.multiple_of(jnp.maximum(src_smem[i, lane], 0), rp)
      plgpu.copy_gmem_to_smem(q_gmem.at[bb, pl.ds(row0, rp)],
                              q_smem.at[slot, pl.ds(lane * rp, rp)],
                              q_bar.at[slot])

  # Two query buffers: tile i+1's gather runs while tile i's softmax, P V
  # and writes do.
  @pl.when(n > 0)
  def _():
    gather(0, 0)

  def tile(i, carry):
    slot = jax.lax.rem(i, 2)
    srcs = [src_smem[i, lane] for lane in range(q_lanes)]
    # Each row's position: its lane's token (the lanes' rows are
    # contiguous), before every key for a dead lane.
    qpos_W = jnp.full((w,), _DEAD, jnp.int32)
    for lane, src in enumerate(srcs):
      tok = jnp.where(src >= 0, offset + jax.lax.div(src, rows_per_token),
                      _DEAD)
      qpos_W = jnp.where(lane_W == lane, tok, qpos_W)
    plgpu.barrier_wait(q_bar.at[slot])

    def scores(acc_ref):
      plgpu.wgmma(acc_ref, q_smem.at[slot], kT_smem)
      plgpu.wgmma_wait(0)
      return acc_ref[...]
    s_WC = pl.run_scoped(scores, plgpu.ACC((w, c), jnp.float32)) * scale
    # The other buffer held tile i-1's queries (its S is done) and then its
    # partials (their copies out are awaited here).
    plgpu.wait_smem_to_gmem(0)

    @pl.when(i + 1 < n)
    def _():
      gather(i + 1, 1 - slot)
    s_WC = s_WC + jax.lax.broadcast_in_dim(bias_C, (w, c), [1])
    see_WC = (jax.lax.broadcast_in_dim(kpos_C, (w, c), [1])
              <= jax.lax.broadcast_in_dim(qpos_W, (w, c), [0]))
    s_WC = jnp.where(see_WC, s_WC, NEG_INF)
    m_W = jnp.max(s_WC, axis=1)
    m_W = jnp.where(m_W > NEG_INF, m_W, 0.0)  # a row with no key: p = 0
    p_WC = jnp.exp(s_WC - jax.lax.broadcast_in_dim(m_W, (w, c), [0]))
    l_W = jnp.sum(p_WC, axis=1)

    p16_WC = p_WC.astype(v_smem.dtype)
    if p_smem is not None:
      # jax's GPU interpreter takes an MMA's A operand from shared memory
      # only; on the GPU it stays in registers (the same bf16 values).
      p_smem[...] = p16_WC
      plgpu.commit_smem()
      p16_WC = p_smem

    def values(acc_ref):
      plgpu.wgmma(acc_ref, p16_WC, v_smem)
      plgpu.wgmma_wait(0)
      return acc_ref[...]
    acc_WD = pl.run_scoped(values, plgpu.ACC((w, v_smem.shape[1]),
                                             jnp.float32))
    seen_W = l_W > 0
    out_WD = acc_WD / jax.lax.broadcast_in_dim(
        jnp.where(seen_W, l_W, 1.0), acc_WD.shape, [0])
    lse_W = jnp.where(seen_W, m_W + jnp.log(jnp.where(seen_W, l_W, 1.0)),
                      NEG_INF)

    # The partials are staged in this tile's query buffer (S, its only
    # reader, is done): no buffer of their own, so two programs fit an
    # SM's shared memory. The previous tile's copies out (of lse_smem too)
    # were awaited above.
    o_smem = q_smem.at[slot]
    o_smem[...] = out_WD.astype(o_smem.dtype)
    lse_smem[...] = lse_W
    plgpu.commit_smem()
    for lane in range(q_lanes):
      dst = dst_smem[i, lane]

      @pl.when(dst >= 0)
      def _():
        plgpu.copy_smem_to_gmem(
            o_smem.at[pl.ds(lane * rp, rp)],
            o_gmem.at[bb, gg, pl.ds(pl.multiple_of(dst, rp), rp)])
    plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[bb, gg, first + i])
    return carry

  jax.lax.fori_loop(0, n, tile, None)
  plgpu.wait_smem_to_gmem(0)


def forward_call(off_B, items, rows_BGJW, out_rows_BGJW, pair_BGP, q_BXD,
                 k_BSGD, v_BSGD, valid_BS, *, block_size: int,
                 rows_per_token: int, scale: float, window: int,
                 interpret) -> tuple[jax.Array, jax.Array]:
  """kv_outer._forward_call's pair-order partials on Mosaic GPU: (o [B, G,
  P*Rp, Dp] in q's dtype, lse [B, G, P*Rp] f32), without the Triton
  kernel's spare last row (dead lanes write nothing here; the TMA unit
  wants the rows a multiple of its 8-row tile). items: (block, first tile,
  tile count) [B, G, U]; rows / out_rows: each tile row's query-view row
  and pair-order row (-1: empty); pair: the flat lane (tile * Q + lane)
  of each (token, slot) pair (-1: none); window: the most tiles an item
  has."""
  b, g, n_tiles, w = rows_BGJW.shape
  n_pairs = pair_BGP.shape[-1]
  x, dp = q_BXD.shape[1:]
  rp = rows_per_token // g
  q_lanes = w // rp
  check_shapes(rp, dp, block_size, q_lanes, q_BXD.dtype)
  blk, first, count = items
  n_items = blk.shape[-1]
  # Per lane, its first row (the lanes' rows are contiguous); padded by
  # a window of dead tiles (and to 32 lanes' worth: jax 0.10's TMA moves
  # multiples of 128 bytes) so every item's window lies inside.
  window = -(-window * q_lanes // 32) * 32 // q_lanes
  pad = ((0, 0), (0, 0), (0, window), (0, 0))
  src_BGJQ = jnp.pad(rows_BGJW[..., ::rp], pad, constant_values=-1)
  dst_BGJQ = jnp.pad(out_rows_BGJW[..., ::rp], pad, constant_values=-1)
  kT_BGDS = k_BSGD.transpose(0, 2, 3, 1)
  bias_BS = jnp.where(valid_BS > 0, 0.0, NEG_INF).astype(jnp.float32)
  params = mc.interpret_params(interpret)
  interpreted = params is not False
  kernel = functools.partial(
      _forward_body, block_size=block_size, heads_p=rp,
      rows_per_token=rows_per_token, scale=scale, n_items=n_items,
      layouts=mc.named_layouts(interpreted))
  o, lse_BGJW = plgpu.kernel(
      kernel,
      out_type=[jax.ShapeDtypeStruct((b, g, n_pairs * rp, dp),
                                     q_BXD.dtype),
                jax.ShapeDtypeStruct((b, g, n_tiles, w), jnp.float32)],
      scratch_types=[
          plgpu.SMEM((dp, block_size), q_BXD.dtype,
                     transforms=mc.smem_transforms(block_size)),
          plgpu.SMEM((block_size, dp), q_BXD.dtype,
                     transforms=mc.smem_transforms(dp)),
          plgpu.SMEM((block_size,), jnp.float32),
          plgpu.SMEM((window, q_lanes), jnp.int32),
          plgpu.SMEM((window, q_lanes), jnp.int32),
          plgpu.SMEM((2, w, dp), q_BXD.dtype, transforms=mc.smem_transforms(dp)),
          plgpu.SMEM((w,), jnp.float32),
          plgpu.Barrier(num_arrivals=3 + 2 * -(-window // _TABLE_ROWS),
                        num_barriers=1),
          plgpu.Barrier(num_arrivals=q_lanes, num_barriers=2),
          # P's shared-memory copy, interpreted only (_forward_body).
          *([plgpu.SMEM((w, block_size), q_BXD.dtype,
                        transforms=mc.smem_transforms(block_size))]
            if interpreted else []),
      ],
      grid=(b, g, n_items),
      grid_names=('b', 'g', 'u'),
      interpret=params,
  )(off_B, blk.reshape(-1), first.reshape(-1), count.reshape(-1), src_BGJQ,
    dst_BGJQ, q_BXD, kT_BGDS, v_BSGD, bias_BS)
  # The log-sum-exps in pair order: pair p's rows are those of its lane
  # (a -1 pair reads lane 0; the combine masks it).
  lse_BGLR = lse_BGJW.reshape(b, g, n_tiles * q_lanes, rp)
  lse_BGPR = jnp.take_along_axis(
      lse_BGLR, jnp.maximum(pair_BGP, 0)[..., None], axis=2)
  return o, lse_BGPR.reshape(b, g, n_pairs * rp)
