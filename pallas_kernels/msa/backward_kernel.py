"""Pallas kernel (c): backward of the block-sparse attention (dq, dk, dv).

Recomputes p = exp(s - lse) from the forward's LSE (flash-attention-2 style)
with delta = rowsum(dO * O) - dLSE, so a cotangent on the LSE output is
honoured too (d lse / d s = p).

* TPU (Mosaic), two kernels:
  - dQ: the forward's grid and visit lists (query tile x union blocks).
  - dK/dV: grid (B, G, key blocks, query tiles); a key block walks the query
    tiles whose union holds it (`schedule.block_visits`, scalar prefetch), so
    its accumulators stay in VMEM and each block is written once. Scores are
    formed transposed, s^T = k q^T [C, Tq], so the per-query LSE, delta and
    selection-hit vectors broadcast along sublanes as rows.
* Padding keys: the forward's int32 key-valid mask is ANDed into every
  mask (dQ: a lane row per block, [B, N, 1, C]; dK/dV: a sublane column,
  [B, N, C, 1]; GPU: [B, S]), so padding keys get p = ds = 0.
* GPU (Triton): one program per (token, batch, group) as in the forward; dq
  is accumulated in registers, dk/dv blocks are added with f32 atomics
  (several tokens select the same block). The default GPU backward
  (kv_outer.py) runs this kernel for dq alone and computes dK/dV KV-outer,
  without atomics.
* GPU, union tiles (`dq_gpu_tiles`): dq of Tq neighbouring tokens per
  program over the union of their blocks, the union-tile forward's layout
  (forward_kernel.forward_gpu_tiles); the 'tiles' kernel set's dq, beside
  the KV-outer dK/dV.

Letter key: B batch, T query tokens, S key tokens, G groups, R heads per
group, D head dim, K selected blocks, C block size, X = R*D, Q query tiles,
N key blocks, V query tiles listed per key block.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.msa import forward_kernel
from pallas_kernels.msa import kernel_common as kc
from pallas_kernels.msa import schedule


def _probs(s, mask, lse):
  # Masked entries are exactly 0 even where lse = -inf (query padding rows).
  return jnp.where(mask, jnp.exp(s - lse), 0.0)


# ----------------------------------------------------------------------------
# TPU (Mosaic): dQ


def _tpu_dq_kernel(off_ref, blocks_ref, count_ref, q_ref, k_ref, v_ref,
                   valid_ref, sel_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_scr, *,
                   block_size: int, n_heads: int, head_dim: int, scale: float,
                   n_groups: int, n_qtiles: int, width: int):
  b, g, i, u = (pl.program_id(a) for a in range(4))
  tq = q_ref.shape[0]
  tile = (b * n_groups + g) * n_qtiles + i
  prec = kc.precision_for(q_ref.dtype)

  @pl.when(u == 0)
  def _init():
    dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

  @pl.when(u < count_ref[tile])
  def _visit():
    blk = blocks_ref[tile * width + u]
    mask = kc.query_tile_mask(sel_ref[...], blk, off_ref[b] + i * tq, tq,
                              block_size) & (valid_ref[...] > 0)
    k, v = k_ref[...], v_ref[...]
    for h in range(n_heads):
      cols = slice(h * head_dim, (h + 1) * head_dim)
      q, do = q_ref[:, cols], do_ref[:, cols]
      p = _probs(kc.dot_nt(q, k, prec) * scale, mask, lse_ref[:, h:h + 1])
      ds = p * (kc.dot_nt(do, v, prec) - delta_ref[:, h:h + 1])
      dq_scr[h] = dq_scr[h] + kc.dot_nn(ds.astype(k.dtype), k, prec) * scale

  @pl.when(u == pl.num_programs(3) - 1)
  def _finish():
    for h in range(n_heads):
      dq_ref[:, h * head_dim:(h + 1) * head_dim] = dq_scr[h].astype(
          dq_ref.dtype)


# ----------------------------------------------------------------------------
# TPU (Mosaic): dK / dV


def _tpu_dkv_kernel(off_ref, qtiles_ref, count_ref, q_ref, k_ref, v_ref,
                    validT_ref, selT_ref, do_ref, lseT_ref, deltaT_ref, dk_ref, dv_ref,
                    dk_scr, dv_scr, *, block_size: int, n_heads: int,
                    head_dim: int, scale: float, n_groups: int, n_blocks: int,
                    width: int):
  b, g, n, u = (pl.program_id(a) for a in range(4))
  tq = q_ref.shape[0]
  row = (b * n_groups + g) * n_blocks + n
  prec = kc.precision_for(q_ref.dtype)

  @pl.when(u == 0)
  def _init():
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

  @pl.when(u < count_ref[row])
  def _visit():
    qt = qtiles_ref[row * width + u]
    qpos = off_ref[b] + qt * tq + jax.lax.broadcasted_iota(jnp.int32, (1, tq), 1)
    kpos = n * block_size + jax.lax.broadcasted_iota(
        jnp.int32, (block_size, 1), 0)
    hit = jnp.max((selT_ref[...] == n).astype(jnp.int32), axis=0,
                  keepdims=True) > 0
    mask = hit & (kpos <= qpos) & (validT_ref[...] > 0)
    k, v = k_ref[...], v_ref[...]
    dk, dv = dk_scr[...], dv_scr[...]
    for h in range(n_heads):
      cols = slice(h * head_dim, (h + 1) * head_dim)
      q, do = q_ref[:, cols], do_ref[:, cols]
      pT = _probs(kc.dot_nt(k, q, prec) * scale, mask, lseT_ref[h:h + 1, :])
      dv = dv + kc.dot_nn(pT.astype(do.dtype), do, prec)
      dsT = pT * (kc.dot_nt(v, do, prec) - deltaT_ref[h:h + 1, :])
      dk = dk + kc.dot_nn(dsT.astype(q.dtype), q, prec) * scale
    dk_scr[...] = dk
    dv_scr[...] = dv

  @pl.when(u == pl.num_programs(3) - 1)
  def _finish():
    dk_ref[...] = dk_scr[...].astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def backward_tpu(q_BGTX, k_BGSD, v_BGSD, sel_BGTK, off_B, valid_BS, do_BGTX,
                 lse_BGTR, delta_BGTR, *, block_size: int, n_heads: int, q_tile: int,
                 scale: float, interpret: bool):
  """Padded group-major operands in; (dq_BGTX, dk_BGSD, dv_BGSD) out."""
  b, g, tp, x = q_BGTX.shape
  sp, d = k_BGSD.shape[2:]
  n_blocks = sp // block_size
  nq = tp // q_tile
  kk = sel_BGTK.shape[-1]
  common = dict(block_size=block_size, n_heads=n_heads, head_dim=d,
                scale=scale, n_groups=g)
  sem = pltpu.CompilerParams(dimension_semantics=(
      'parallel', 'parallel', 'parallel', 'arbitrary'))

  blocks, count = schedule.tile_visits(sel_BGTK, q_tile, n_blocks)
  width = blocks.shape[-1]

  def kv_map(bb, gg, ii, uu, off, blocks, count):
    return bb, gg, blocks[((bb * g + gg) * nq + ii) * width + uu], 0

  def valid_map(bb, gg, ii, uu, off, blocks, count):
    return bb, kv_map(bb, gg, ii, uu, off, blocks, count)[2], 0, 0

  def q_map(bb, gg, ii, uu, *_):
    return bb, gg, ii, 0

  dq = kc.pallas_call(
      functools.partial(_tpu_dq_kernel, n_qtiles=nq, width=width, **common),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3,
          grid=(b, g, nq, width),
          in_specs=[
              pl.BlockSpec((None, None, q_tile, x), q_map),
              pl.BlockSpec((None, None, block_size, d), kv_map),
              pl.BlockSpec((None, None, block_size, d), kv_map),
              pl.BlockSpec((None, None, 1, block_size), valid_map),
              pl.BlockSpec((None, None, q_tile, kk), q_map),
              pl.BlockSpec((None, None, q_tile, x), q_map),
              pl.BlockSpec((None, None, q_tile, n_heads), q_map),
              pl.BlockSpec((None, None, q_tile, n_heads), q_map),
          ],
          out_specs=pl.BlockSpec((None, None, q_tile, x), q_map),
          scratch_shapes=[pltpu.VMEM((n_heads, q_tile, d), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct(q_BGTX.shape, q_BGTX.dtype),
      compiler_params=sem, interpret=interpret, name='msa_backward_dq_tpu',
  )(off_B, blocks.reshape(-1), count.reshape(-1), q_BGTX, k_BGSD, v_BGSD,
    valid_BS.reshape(b, n_blocks, 1, block_size), sel_BGTK, do_BGTX, lse_BGTR,
    delta_BGTR)

  qtiles, qcount = schedule.block_visits(sel_BGTK, q_tile, n_blocks)
  vwidth = qtiles.shape[-1]

  def qt_of(bb, gg, nn, uu, qtiles):
    return qtiles[((bb * g + gg) * n_blocks + nn) * vwidth + uu]

  def qrow_map(bb, gg, nn, uu, off, qtiles, count):
    return bb, gg, qt_of(bb, gg, nn, uu, qtiles), 0

  def qcol_map(bb, gg, nn, uu, off, qtiles, count):
    return bb, gg, 0, qt_of(bb, gg, nn, uu, qtiles)

  def kv_own_map(bb, gg, nn, uu, *_):
    return bb, gg, nn, 0

  def valid_own_map(bb, gg, nn, uu, *_):
    return bb, nn, 0, 0

  dk, dv = kc.pallas_call(
      functools.partial(_tpu_dkv_kernel, n_blocks=n_blocks, width=vwidth,
                        **common),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3,
          grid=(b, g, n_blocks, vwidth),
          in_specs=[
              pl.BlockSpec((None, None, q_tile, x), qrow_map),
              pl.BlockSpec((None, None, block_size, d), kv_own_map),
              pl.BlockSpec((None, None, block_size, d), kv_own_map),
              pl.BlockSpec((None, None, block_size, 1), valid_own_map),
              pl.BlockSpec((None, None, kk, q_tile), qcol_map),
              pl.BlockSpec((None, None, q_tile, x), qrow_map),
              pl.BlockSpec((None, None, n_heads, q_tile), qcol_map),
              pl.BlockSpec((None, None, n_heads, q_tile), qcol_map),
          ],
          out_specs=[pl.BlockSpec((None, None, block_size, d), kv_own_map),
                     pl.BlockSpec((None, None, block_size, d), kv_own_map)],
          scratch_shapes=[pltpu.VMEM((block_size, d), jnp.float32),
                          pltpu.VMEM((block_size, d), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct(k_BGSD.shape, k_BGSD.dtype),
                 jax.ShapeDtypeStruct(v_BGSD.shape, v_BGSD.dtype)],
      compiler_params=sem, interpret=interpret, name='msa_backward_dkv_tpu',
  )(off_B, qtiles.reshape(-1), qcount.reshape(-1), q_BGTX, k_BGSD, v_BGSD,
    valid_BS.reshape(b, n_blocks, block_size, 1),
    sel_BGTK.transpose(0, 1, 3, 2), do_BGTX, lse_BGTR.transpose(0, 1, 3, 2),
    delta_BGTR.transpose(0, 1, 3, 2))
  return dq, dk, dv


# ----------------------------------------------------------------------------
# GPU (Triton)


def _gpu_kernel(off_ref, q_ref, k_ref, v_ref, valid_ref, sel_ref, do_ref,
                lse_ref, delta_ref, *refs, block_size: int, top_k: int,
                scale: float, precision, with_dkv: bool = True):
  """dq of one (token, group); with_dkv: also add dK/dV by atomics, else
  (the KV-outer backward computes them) dq alone."""
  if with_dkv:
    # dk_in / dv_in are aliased to dk / dv (zero-initialised).
    _, _, dq_ref, dk_ref, dv_ref = refs
  else:
    (dq_ref,) = refs
  t = pl.program_id(0)
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
  qpos = off_ref[0] + t

  # A loop, not a Python unroll (see forward_kernel): one body to compile.
  def visit(slot, dq):
    blk = sel_ref[slot]
    start = jnp.maximum(blk, 0) * block_size
    rows = pl.ds(start, block_size)
    k, v = k_ref[rows, :], v_ref[rows, :]
    kpos = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
    ok = valid_ref[pl.ds(start, block_size)][None, :] > 0
    mask = (kpos <= qpos) & (blk >= 0) & ok
    p = _probs(kc.dot_nt(q, k, precision) * scale, mask, lse)
    ds = p * (kc.dot_nt(do, v, precision) - delta)
    if with_dkv:
      # A -1 slot has p = ds = 0, so it adds exact zeros to block 0; no
      # atomic mask (interpret mode cannot discharge masked atomics).
      plgpu.atomic_add(dv_ref, (rows, slice(None)),
                       kc.dot_tn(p.astype(do.dtype), do, precision))
      plgpu.atomic_add(dk_ref, (rows, slice(None)),
                       kc.dot_tn(ds.astype(q.dtype), q, precision) * scale)
    return dq + kc.dot_nn(ds.astype(k.dtype), k, precision) * scale

  dq = jax.lax.fori_loop(0, top_k, visit, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def backward_gpu(q_BTGRD, k_BSGD, v_BSGD, sel_BGTK, off_B, valid_BS, do_BTGRD,
                 lse_BTGR, delta_BTGR, *, block_size: int, scale: float, interpret: bool,
                 num_warps: int = 8, num_stages: int = 1, with_dkv: bool = True):
  """Padded operands in; (dq_BTGRD, dk_BSGD f32, dv_BSGD f32) out, or
  dq_BTGRD alone when not with_dkv."""
  b, t, g, rp, dp = q_BTGRD.shape
  sp = k_BSGD.shape[1]
  kp = sel_BGTK.shape[-1]
  q_spec = pl.BlockSpec((None, None, None, rp, dp),
                        lambda tt, bb, gg: (bb, tt, gg, 0, 0))
  row_spec = pl.BlockSpec((None, None, None, rp),
                          lambda tt, bb, gg: (bb, tt, gg, 0))
  kv_spec = pl.BlockSpec((None, sp, None, dp), lambda tt, bb, gg: (bb, 0, gg, 0))
  # 8 warps: the [C, D] f32 dK/dV contributions of one block (64 KiB each
  # at C = D = 128) would spill from the registers of 4.
  kernel = functools.partial(
      _gpu_kernel, block_size=block_size, top_k=kp, scale=scale,
      precision=kc.gpu_precision_for(q_BTGRD.dtype, interpret),
      with_dkv=with_dkv)
  in_specs = [
      pl.BlockSpec((1,), lambda tt, bb, gg: (bb,)),
      q_spec, kv_spec, kv_spec,
      pl.BlockSpec((None, sp), lambda tt, bb, gg: (bb, 0)),
      pl.BlockSpec((None, None, None, kp),
                   lambda tt, bb, gg: (bb, gg, tt, 0)),
      q_spec, row_spec, row_spec]
  args = (off_B, q_BTGRD, k_BSGD, v_BSGD, valid_BS, sel_BGTK, do_BTGRD,
          lse_BTGR, delta_BTGR)
  if not with_dkv:
    return kc.pallas_call(
        kernel, grid=(t, b, g), in_specs=in_specs, out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q_BTGRD.shape, q_BTGRD.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                             num_stages=num_stages),
        interpret=interpret, name='msa_backward_dq_gpu')(*args)
  return kc.pallas_call(
      kernel,
      grid=(t, b, g),
      in_specs=[*in_specs, kv_spec, kv_spec],
      out_specs=[q_spec, kv_spec, kv_spec],
      out_shape=[jax.ShapeDtypeStruct(q_BTGRD.shape, q_BTGRD.dtype),
                 jax.ShapeDtypeStruct(k_BSGD.shape, jnp.float32),
                 jax.ShapeDtypeStruct(v_BSGD.shape, jnp.float32)],
      input_output_aliases={9: 1, 10: 2},
      compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                           num_stages=num_stages),
      interpret=interpret,
      name='msa_backward_gpu',
  )(*args, jnp.zeros(k_BSGD.shape, jnp.float32),
    jnp.zeros(v_BSGD.shape, jnp.float32))


def _gpu_dq_tiles_kernel(off_ref, count_ref, blocks_ref, q_ref, k_ref, v_ref,
                         valid_ref, sel_ref, do_ref, lse_ref, delta_ref,
                         dq_ref, *, block_size: int, scale: float, precision):
  """dq of Tq neighbouring tokens' R head rows over the union of their
  blocks, with the forward's row mask (forward_kernel._gpu_tiles_kernel)."""
  tq, rp, dp = q_ref.shape
  w = tq * rp
  q_WD = q_ref[...].reshape(w, dp)
  do_WD = do_ref[...].reshape(w, dp)
  lse_W1 = lse_ref[...].reshape(w, 1)
  delta_W1 = delta_ref[...].reshape(w, 1)
  qpos_W1, sel_WK = forward_kernel.tile_row_views(
      off_ref, sel_ref, pl.program_id(0), tq, rp)

  def visit(u, dq_WD):
    k_CD, v_CD, mask_WC = forward_kernel.union_block(
        blocks_ref[u], k_ref, v_ref, valid_ref, block_size, qpos_W1, sel_WK)
    p_WC = _probs(kc.dot_nt(q_WD, k_CD, precision) * scale, mask_WC, lse_W1)
    ds_WC = p_WC * (kc.dot_nt(do_WD, v_CD, precision) - delta_W1)
    return dq_WD + kc.dot_nn(ds_WC.astype(k_CD.dtype), k_CD,
                             precision) * scale

  dq_WD = jax.lax.fori_loop(0, count_ref[0], visit,
                            jnp.zeros((w, dp), jnp.float32))
  dq_ref[...] = dq_WD.reshape(tq, rp, dp).astype(dq_ref.dtype)


def dq_gpu_tiles(q_BTGRD, k_BSGD, v_BSGD, sel_BGTK, off_B, valid_BS,
                 do_BTGRD, lse_BTGR, delta_BTGR, *, block_size: int,
                 scale: float, interpret: bool, q_tile: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None):
  """dq_BTGRD of Tq neighbouring tokens per program over the union of their
  blocks, no atomics (each program owns its rows): the union-tile forward's
  layout (forward_kernel.forward_gpu_tiles), for its backward beside the
  KV-outer dK/dV. Padded operands as backward_gpu's (R, D, K powers of
  two)."""
  b, t, g, rp, dp = q_BTGRD.shape
  tq = q_tile or forward_kernel.tiles_per_query_tile(rp, q_BTGRD.dtype)
  sel_BGTK, blocks, count, in_specs, rows, per_row = forward_kernel.union_plan(
      sel_BGTK, tq, block_size=block_size, heads_p=rp, head_dim_p=dp,
      keys_p=k_BSGD.shape[1])
  tp = sel_BGTK.shape[2]
  q_BTGRD, do_BTGRD, lse_BTGR, delta_BTGR = (
      forward_kernel.pad_tokens(x, tp)
      for x in (q_BTGRD, do_BTGRD, lse_BTGR, delta_BTGR))
  kernel = functools.partial(
      _gpu_dq_tiles_kernel, block_size=block_size, scale=scale,
      precision=kc.gpu_precision_for(q_BTGRD.dtype, interpret))
  dq = kc.pallas_call(
      kernel,
      grid=(blocks.shape[2], b, g),
      in_specs=[*in_specs, rows, per_row, per_row],
      out_specs=rows,
      out_shape=jax.ShapeDtypeStruct((b, tp, g, rp, dp), q_BTGRD.dtype),
      compiler_params=plgpu.CompilerParams(
          num_warps=num_warps or (8 if tq * rp >= 128 else 4),
          num_stages=num_stages or 1),
      interpret=interpret,
      name='msa_backward_dq_gpu_tiles',
  )(off_B, count, blocks, q_BTGRD, k_BSGD, v_BSGD, valid_BS, sel_BGTK,
    do_BTGRD, lse_BTGR, delta_BTGR)
  return dq[:, :t]
