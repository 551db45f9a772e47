"""Pallas kernels (b'), (c'), (d') for GPUs: block-sparse attention KV-outer.

The per-token kernels (forward_kernel.py, backward_kernel.py) run one
program per (token, group): a selected key block is read for one token's
16 head rows, so the forward is bound by L2 traffic, and the backward adds
each block's dK/dV with float32 atomics. Here the loop is turned inside
out, as the MSA paper's "KV-outer" sparse attention does:

1. **Tiles** (XLA, `build_tiles`): the selection is inverted into, per
   (sequence, group, key block), the list of queries that selected the
   block (a stable sort of the T*K (token, slot) pairs by block), cut into
   tiles of `q_per_tile` queries. A tile's rows are its queries x the
   group's heads (128 rows at 8 queries x 16 heads in bf16, 64 in f32),
   so one K/V block serves 128 rows instead of 16.
2. **Forward** (`_forward_kernel`): a program loads one key block and
   streams that block's tiles past it (up to `tiles_per_program`: twice a
   block's mean, so a block most queries select is split over several
   programs); per tile it gathers the query rows, attends the block (the
   causal mask matters only on the diagonal block; key padding is masked
   everywhere) and writes a per-slot partial: the block-local output and
   its log-sum-exp.
3. **Combine** (XLA): a token's K partials merge by the log-sum-exp rule,
   O = sum_j exp(lse_j - lse) O_j, lse = logsumexp_j lse_j, reduced
   straight into the token-major output. Or (`fused_combine`) one Pallas
   launch that merges them slot by slot with a running maximum
   (`combine_kernel`), reading each partial once and writing the output
   once in its own dtype.
4. **Backward** without atomics: dK/dV KV-outer (`_dkv_kernel`): a program
   owns one key block's float32 accumulators and walks up to
   `tiles_per_program` of its tiles (heavy early blocks, which most queries
   select, are split over several programs, and the programs are launched
   largest first); the programs' partial sums of one block are added in
   XLA in a fixed order. dQ per token
   (backward_kernel's per-token kernel with its atomics taken out). No
   atomic anywhere: two runs give the same bits.
5. **Decode** (`forward` at T = 1): one query per sequence, so the tiles
   are the selection itself: split-K, one program per (sequence, group,
   slot) that reads its block id from the selection (`decode_partials`:
   no tables built), then the combine kernel.

Queries are processed in chunks of `query_chunk` tokens so the partial
outputs stay bounded (at 128k tokens, 16 heads per group and K = 16 they
would be 34 GB at once).

`ForwardConfig` holds the forward's knobs. On an H100 the default ran at
about 107 TFLOP/s of useful work (results/gpu_check_h100.json), slower
than the per-token kernel it replaced; two costs stand out by
arithmetic: a combine that gathers every partial back (8.6 GB at 32k), and
a tile loop in which each tile waits on its own row-table load and query
gather. `pair_order` writes each partial at its (token, slot) row, so the
combine reads them in order; `prefetch` issues the next tile's gather
before this tile's dots. benchmark_gpu's tune phase times them.

Letter key: B batch, T query tokens (Tc in a chunk), S key tokens, G
groups, R heads per group (padded: Rp), D head dim (padded: Dp), K selected
blocks, C block size, N key blocks, J tiles, Q queries per tile, W rows of
a tile (Q * Rp), P (token, slot) pairs, U work items of the dK/dV kernel.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.msa import kernel_common as kc

NEG_INF = float('-inf')


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
  """Knobs of the forward kernel; None keeps the default.

  They exist to be timed against each other on a GPU (benchmark_gpu's
  `tune` phase), since which is fastest depends on the card's latency and
  L2, not on anything a CPU can measure:

  q_per_tile: queries per tile (tile rows = q_per_tile * Rp).
  tiles_per_program: tiles a program streams past its block (default
    twice a block's mean): few give many short programs, whose gathers
    the scheduler overlaps across programs; many reuse the block longer.
  num_warps, num_stages: Triton's (default 8 warps for 128-row tiles, 2
    stages in 16-bit dtypes).
  query_chunk: tokens per launch (default: partials of about 1 GiB, 4096
    tokens at 16 heads a group and K = 16): longer chunks have fewer
    launch tails, shorter ones keep a group's queries in L2.
  prefetch: gather the next tile's rows while this one's dots run (a
    software pipeline through the loop carry), instead of relying on
    Triton's pipeliner, which cannot see through the row-table load.
  pair_order: write each partial at its (token, slot) row, so the combine
    is a reshape and a sum instead of a gather over all partials.
  fused_combine: merge the pair-order partials in a Pallas kernel
    (`combine_kernel`: each partial read once, the output written once,
    token-major, in its own dtype) instead of XLA's reduction; needs
    pair_order.
  tiled_decode: at one query per sequence, the general tile kernel on
    forward_plan's XLA-built tables (tile rows, work items, pair table)
    instead of `decode_partials`, which reads the selection itself: the
    decode step as it was, for the GPU bench to time beside the default.
  kernel: 'triton', or 'mosaic' (kv_outer_mosaic.py: the tiles' queries
    gathered by TMA, the dots on warpgroup MMAs; bf16, 64-row tiles, so
    q_per_tile defaults to 64 / Rp; needs pair_order; its gather is
    always double-buffered, so `prefetch`, Triton's, has no effect).
    Prefill only: one query per sequence keeps `decode_partials`.
  """
  q_per_tile: int | None = None
  tiles_per_program: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  query_chunk: int | None = None
  prefetch: bool = False
  pair_order: bool = False
  fused_combine: bool = False
  tiled_decode: bool = False
  kernel: str = 'triton'

  def __post_init__(self):
    if self.fused_combine and not self.pair_order:
      raise ValueError('fused_combine merges pair-order partials: it needs '
                       'pair_order=True.')
    if self.kernel not in ('triton', 'mosaic'):
      raise ValueError(f"kernel must be 'triton' or 'mosaic', got "
                       f'{self.kernel!r}.')
    if self.kernel == 'mosaic' and not self.pair_order:
      raise ValueError('the Mosaic forward writes pair-order partials: it '
                       'needs pair_order=True.')

  def label(self) -> str:
    """A short name of the non-default knobs ('default' when none)."""
    parts = [f'{f.name}={getattr(self, f.name)}'
             for f in dataclasses.fields(self)
             if getattr(self, f.name) != f.default]
    return ','.join(parts) or 'default'


# ----------------------------------------------------------------------------
# Tiles: the selection inverted (XLA)


def build_tiles(sel_BGTK, *, n_blocks: int, q_per_tile: int, t0: int = 0):
  """Query tiles per (sequence, group, key block).

  Returns (tile_blk_BGJ, tile_q_BGJQ, pair_BGP): the block each tile
  reads (-1: unused tile), the tokens of its lanes (absolute index t0 + t;
  -1: empty lane), and for each (token, slot) pair p = t * K + k the flat
  lane j * Q + q that holds it (-1: a -1 slot). J is a static bound: every
  block's list ends in at most one part-filled tile, so J <= P / Q + N.
  """
  b, g, t, k = sel_BGTK.shape
  p = t * k
  q = q_per_tile
  n_tiles = -(-p // q) + n_blocks
  blk_BGP = sel_BGTK.reshape(b, g, p)
  key_BGP = jnp.where(blk_BGP >= 0, blk_BGP, n_blocks)
  order_BGP = jnp.argsort(key_BGP, axis=-1, stable=True)
  sorted_blk = jnp.take_along_axis(key_BGP, order_BGP, axis=-1)
  count_BGN = jax.vmap(jax.vmap(
      lambda x: jnp.bincount(x, length=n_blocks + 1)))(key_BGP)[..., :n_blocks]
  first_pair_BGN = jnp.cumsum(count_BGN, axis=-1) - count_BGN
  tiles_BGN = -(-count_BGN // q)
  first_tile_BGN = jnp.cumsum(tiles_BGN, axis=-1) - tiles_BGN
  live = sorted_blk < n_blocks
  blk_c = jnp.minimum(sorted_blk, n_blocks - 1)
  rank = (jnp.arange(p)[None, None, :] -
          jnp.take_along_axis(first_pair_BGN, blk_c, axis=-1))
  tile = jnp.take_along_axis(first_tile_BGN, blk_c, axis=-1) + rank // q
  lane = jnp.where(live, tile * q + rank % q, n_tiles * q)  # dead: dropped
  token = t0 + order_BGP // k
  bi = jnp.arange(b)[:, None, None]
  gi = jnp.arange(g)[None, :, None]
  tile_q = jnp.full((b, g, n_tiles * q), -1, jnp.int32).at[bi, gi, lane].set(
      token.astype(jnp.int32), mode='drop')
  tile_blk = jnp.full((b, g, n_tiles), -1, jnp.int32).at[
      bi, gi, jnp.where(live, tile, n_tiles)].set(
          sorted_blk.astype(jnp.int32), mode='drop')
  pair = jnp.full((b, g, p), -1, jnp.int32).at[bi, gi, order_BGP].set(
      jnp.where(live, lane, -1).astype(jnp.int32))
  return tile_blk, tile_q.reshape(b, g, n_tiles, q), pair


def decode_tiles(sel_BGK):
  """One query per sequence: tile k is slot k (split-K), lane 0."""
  b, g, k = sel_BGK.shape
  tile_q = jnp.where(sel_BGK >= 0, 0, -1).astype(jnp.int32)[..., None]
  pair = jnp.where(sel_BGK >= 0, jnp.arange(k)[None, None, :], -1)
  return sel_BGK.astype(jnp.int32), tile_q, pair.astype(jnp.int32)


def tile_rows(tile_q_BGJQ, *, groups: int, heads_p: int):
  """Row index of every tile row in the [T*G*Rp] query view (-1: empty)."""
  b, g, j, q = tile_q_BGJQ.shape
  gi = jnp.arange(g, dtype=jnp.int32)[None, :, None, None, None]
  r = jnp.arange(heads_p, dtype=jnp.int32)[None, None, None, None, :]
  t = tile_q_BGJQ[..., None]
  rows = jnp.where(t >= 0, (t * groups + gi) * heads_p + r, -1)
  return rows.reshape(b, g, j, q * heads_p)


def pair_rows(pair_BGP, n_lanes: int, *, heads_p: int):
  """Row of every tile row in the [P*Rp] pair-order partial view (-1:
  empty lane): lane l holding pair p writes rows p*Rp .. p*Rp + Rp-1."""
  b, g, p = pair_BGP.shape
  bi = jnp.arange(b)[:, None, None]
  gi = jnp.arange(g)[None, :, None]
  lane_pair = jnp.full((b, g, n_lanes), -1, jnp.int32).at[
      bi, gi, jnp.where(pair_BGP >= 0, pair_BGP, n_lanes)].set(
          jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, g, p)),
          mode='drop')
  r = jnp.arange(heads_p, dtype=jnp.int32)
  rows = jnp.where(lane_pair[..., None] >= 0,
                   lane_pair[..., None] * heads_p + r, -1)
  return rows.reshape(b, g, n_lanes * heads_p)


# ----------------------------------------------------------------------------
# Kernels (Triton; interpret mode on CPU)


def _key_block(blk, k_ref, v_ref, valid_ref, block_size: int, part=0,
               size: int | None = None):
  """Block blk's keys k_CD and values v_CD, the position of its first key,
  and its key-valid row ok_1C; with `size`, only keys [part * size, (part
  + 1) * size) of the block."""
  size = size or block_size
  start = jnp.maximum(blk, 0) * block_size + part * size
  return (k_ref[pl.ds(start, size), :], v_ref[pl.ds(start, size), :], start,
          valid_ref[pl.ds(start, size)][None, :] > 0)


def _gather_queries(rows_W, q_ref):
  """A tile's query rows q_WD (empty rows read row 0; the mask drops them)."""
  return q_ref[jnp.maximum(rows_W, 0), :]


def _tile_scores(off_ref, blk, rows_W, q_WD, k_CD, start, ok_1C, *,
                 rows_per_token: int, scale: float, precision):
  """(scaled scores s_WC, mask_WC) of one tile's gathered queries q_WD
  against block blk. A row's token is its row in the query view over
  rows_per_token (= G * Rp)."""
  block_size = k_CD.shape[0]
  live_W = rows_W >= 0
  qpos_W1 = (off_ref[0] + kc.div(jnp.maximum(rows_W, 0),
                                 rows_per_token))[:, None]
  kpos_1C = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
  mask_WC = (kpos_1C <= qpos_W1) & ok_1C & live_W[:, None] & (blk >= 0)
  s_WC = kc.dot_nt(q_WD, k_CD, precision) * scale
  return s_WC, mask_WC


def _forward_kernel(off_ref, blk_ref, first_ref, count_ref, rows_ref, *refs,
                    block_size: int, rows_per_token: int, scale: float,
                    precision, reload_kv: bool, prefetch: bool,
                    pair_order: bool):
  """One key block, loaded once (per tile with reload_kv), against
  `count` of its tiles. With pair_order the next ref is the tiles' rows in
  the pair-order partial view, where each tile row is stored."""
  if pair_order:
    out_rows_ref, q_ref, k_ref, v_ref, valid_ref, o_ref, lse_ref = refs
  else:
    q_ref, k_ref, v_ref, valid_ref, o_ref, lse_ref = refs
  blk, first, count = blk_ref[0], first_ref[0], count_ref[0]
  n = jnp.where(blk >= 0, count, 0)
  load = lambda: _key_block(blk, k_ref, v_ref, valid_ref, block_size)
  held = None if reload_kv else load()

  def tile(i):
    rows_W = rows_ref[first + i, :]
    return rows_W, _gather_queries(rows_W, q_ref)

  def visit(i, carry):
    rows_W, q_WD = carry if prefetch else tile(i)
    # Issued before this tile's dots, awaited only at the next step.
    nxt = tile(jnp.minimum(i + 1, n - 1)) if prefetch else carry
    k_CD, v_CD, start, ok_1C = load() if reload_kv else held
    s_WC, mask_WC = _tile_scores(
        off_ref, blk, rows_W, q_WD, k_CD, start, ok_1C,
        rows_per_token=rows_per_token, scale=scale, precision=precision)
    m_W1 = jnp.max(jnp.where(mask_WC, s_WC, kc.MASK_VALUE), axis=1,
                   keepdims=True)
    p_WC = jnp.where(mask_WC, jnp.exp(s_WC - m_W1), 0.0)
    l_W1 = jnp.sum(p_WC, axis=1, keepdims=True)
    acc_WD = kc.dot_nn(p_WC.astype(v_CD.dtype), v_CD, precision)
    out_WD, lse_W1 = kc.finish_softmax(m_W1, l_W1, acc_WD)
    if pair_order:
      # Empty lanes all write the spare last row, which nothing reads.
      out_rows_W = out_rows_ref[first + i, :]
      at_W = jnp.where(out_rows_W >= 0, out_rows_W, o_ref.shape[0] - 1)
      o_ref[at_W, :] = out_WD.astype(o_ref.dtype)
      lse_ref[at_W] = lse_W1[:, 0]
    else:
      o_ref[first + i, :, :] = out_WD.astype(o_ref.dtype)
      lse_ref[first + i, :] = lse_W1[:, 0]
    return nxt

  jax.lax.fori_loop(0, n, visit, tile(0) if prefetch else 0)


def _dkv_kernel(off_ref, blk_ref, first_ref, count_ref, rows_ref, q_ref,
                k_ref, v_ref, valid_ref, do_ref, lse_ref, delta_ref, dk_ref,
                dv_ref, *, block_size: int, rows_per_token: int, scale: float,
                precision, reload_kv: bool, parts: int, prefetch: bool):
  """One key block's partial dK, dV (float32, in registers) over `count`
  of its tiles: p recomputed from the forward's LSE, ds = p (dO V^T -
  delta). With parts > 1 a program owns one part of the block's keys
  (grid axis 2 is item x part): every term is per key, so the parts are
  independent. With prefetch the next tile's rows (q, dO, LSE, delta) are
  gathered before this tile's dots, as in the forward."""
  blk, first, count = blk_ref[0], first_ref[0], count_ref[0]
  n = jnp.where(blk >= 0, count, 0)
  dp = k_ref.shape[-1]
  sub = block_size // parts
  part = pl.program_id(2) % parts
  load = lambda: _key_block(blk, k_ref, v_ref, valid_ref, block_size, part,
                            sub)
  held = None if reload_kv else load()

  def tile(i):
    rows_W = rows_ref[first + i, :]
    rows_c = jnp.maximum(rows_W, 0)
    return (rows_W, _gather_queries(rows_W, q_ref), do_ref[rows_c, :],
            lse_ref[rows_c][:, None], delta_ref[rows_c][:, None])

  def visit(i, carry):
    dk_CD, dv_CD, nxt = carry
    rows_W, q_WD, do_WD, lse_W1, delta_W1 = nxt if prefetch else tile(i)
    if prefetch:
      nxt = tile(jnp.minimum(i + 1, n - 1))
    k_CD, v_CD, start, ok_1C = load() if reload_kv else held
    s_WC, mask_WC = _tile_scores(
        off_ref, blk, rows_W, q_WD, k_CD, start, ok_1C,
        rows_per_token=rows_per_token, scale=scale, precision=precision)
    p_WC = jnp.where(mask_WC, jnp.exp(s_WC - lse_W1), 0.0)
    ds_WC = p_WC * (kc.dot_nt(do_WD, v_CD, precision) - delta_W1)
    dv_CD = dv_CD + kc.dot_tn(p_WC.astype(do_WD.dtype), do_WD, precision)
    dk_CD = dk_CD + kc.dot_tn(ds_WC.astype(q_WD.dtype), q_WD,
                              precision) * scale
    return dk_CD, dv_CD, nxt

  zeros = jnp.zeros((sub, dp), jnp.float32)
  dk_CD, dv_CD, _ = jax.lax.fori_loop(
      0, n, visit, (zeros, zeros, tile(0) if prefetch else 0))
  dk_ref[...] = dk_CD
  dv_ref[...] = dv_CD


# ----------------------------------------------------------------------------
# Calls


def _reload_kv(dtype) -> bool:
  """Whether the kernels read the key block per tile instead of once.

  In f32 the dots are three TF32 passes, so each [C, D] operand sits in
  shared memory as a high and a low half: K and V held across the loop
  take 4 x 64 KiB at C = D = 128, past the H100's 227 KiB. Read per tile
  (from L2), K's halves are dead before V's are made."""
  return jnp.dtype(dtype).itemsize > 2


def _dkv_tiling(dtype, block_size: int, heads_p: int) -> tuple[int, int]:
  """(queries per tile, key parts per block) of the dK/dV kernel.

  bf16: the forward's tiles, whole blocks. f32: on an H100 the whole-block
  kernel asked for 256 KiB + 2.5 KiB per tile row of shared memory (K and
  V as TF32 high and low halves, 4 x 64 KiB at C = D = 128, plus the row
  operands; 227 KiB there), so f32 takes 32-row tiles and 32-key parts of
  the block, about a quarter of that."""
  if jnp.dtype(dtype).itemsize <= 2:
    return _queries_per_tile(heads_p, dtype), 1
  return max(1, 32 // heads_p), max(1, block_size // 32)


def _params(rows: int, dtype, num_warps: int | None = None,
            num_stages: int | None = None) -> plgpu.CompilerParams:
  # 8 warps for 128-row tiles: the [W, C] f32 scores and the [C, D] f32
  # dK/dV accumulators spill from the registers of 4.
  return plgpu.CompilerParams(
      num_warps=num_warps or (8 if rows >= 128 else 4),
      num_stages=num_stages or (2 if jnp.dtype(dtype).itemsize <= 2 else 1))


def _work_specs(b: int, g: int, n_items: int, rows_shape, x: int, dp: int,
                sp: int, parts: int = 1):
  """In-specs both work-item kernels open with: offsets, an item's block,
  first tile and tile count, the (sequence, group) tile rows, the query
  view, K, V and the key-valid mask. Grid (B, G, U * parts)."""
  n_tiles, w = rows_shape
  item = pl.BlockSpec(
      (1,), lambda bb, gg, uu: ((bb * g + gg) * n_items + uu // parts,))
  kv = pl.BlockSpec((None, sp, None, dp), lambda bb, gg, uu: (bb, 0, gg, 0))
  return [pl.BlockSpec((1,), lambda bb, gg, uu: (bb,)), item, item, item,
          pl.BlockSpec((None, None, n_tiles, w),
                       lambda bb, gg, uu: (bb, gg, 0, 0)),
          pl.BlockSpec((None, x, dp), lambda bb, gg, uu: (bb, 0, 0)), kv, kv,
          pl.BlockSpec((None, sp), lambda bb, gg, uu: (bb, 0))]


def _forward_call(off_B, items, rows_BGJW, out_rows_BGJW, q_BXD, k_BSGD,
                  v_BSGD, valid_BS, *, n_pairs, block_size, rows_per_token,
                  scale, interpret, config):
  """The forward kernel over work items; partials in tile order [B, G, J,
  W, Dp] (out_rows None), or pair order [B, G, P*Rp, Dp] from n_pairs."""
  b, g, n_tiles, w = rows_BGJW.shape
  blk, first, count = items
  n_items = blk.shape[-1]
  x, dp = q_BXD.shape[1:]
  pair_order = out_rows_BGJW is not None
  kernel = functools.partial(
      _forward_kernel, block_size=block_size, rows_per_token=rows_per_token,
      scale=scale, precision=kc.gpu_precision_for(q_BXD.dtype, interpret),
      reload_kv=_reload_kv(q_BXD.dtype), prefetch=config.prefetch,
      pair_order=pair_order)
  in_specs = _work_specs(b, g, n_items, (n_tiles, w), x, dp, k_BSGD.shape[1])
  operands = [rows_BGJW, q_BXD, k_BSGD, v_BSGD, valid_BS]
  # Each program writes only its own tiles' rows of the (sequence, group)
  # slab.
  if pair_order:
    # The out-row table rides beside the query-row table.
    in_specs.insert(5, in_specs[4])
    operands.insert(1, out_rows_BGJW)
    n_rows = n_pairs * (rows_per_token // g) + 1  # + the spare row
    out_specs = [
        pl.BlockSpec((None, None, n_rows, dp),
                     lambda bb, gg, uu: (bb, gg, 0, 0)),
        pl.BlockSpec((None, None, n_rows), lambda bb, gg, uu: (bb, gg, 0)),
    ]
    out_shape = [jax.ShapeDtypeStruct((b, g, n_rows, dp), q_BXD.dtype),
                 jax.ShapeDtypeStruct((b, g, n_rows), jnp.float32)]
  else:
    out_specs = [
        pl.BlockSpec((None, None, n_tiles, w, dp),
                     lambda bb, gg, uu: (bb, gg, 0, 0, 0)),
        pl.BlockSpec((None, None, n_tiles, w),
                     lambda bb, gg, uu: (bb, gg, 0, 0)),
    ]
    out_shape = [jax.ShapeDtypeStruct((b, g, n_tiles, w, dp), q_BXD.dtype),
                 jax.ShapeDtypeStruct((b, g, n_tiles, w), jnp.float32)]
  return kc.pallas_call(
      kernel,
      grid=(b, g, n_items),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_params(w, q_BXD.dtype, config.num_warps,
                              config.num_stages),
      interpret=interpret,
      name='msa_kv_outer_forward',
  )(off_B, blk.reshape(-1), first.reshape(-1), count.reshape(-1), *operands)


def _decode_kernel(off_ref, sel_ref, q_ref, k_ref, v_ref, *refs,
                   block_size: int, scale: float, precision):
  """Split-K decode: one selected block of one (sequence, group) against
  the group's Rp head rows (grid (B, G, K)), its partial output and
  log-sum-exp written at the slot's rows. A -1 slot attends nothing and
  writes output 0, log-sum-exp -inf (no branch: its block is clamped to 0
  and wholly masked), so the combine needs no pair table. refs: (valid_ref,
  o_ref, lse_ref), or (o_ref, lse_ref) where every key is valid."""
  valid_ref, o_ref, lse_ref = refs if len(refs) == 3 else (None,) + refs
  blk = sel_ref[0]
  start = jnp.maximum(blk, 0) * block_size
  kpos_1C = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
  ok_1C = (kpos_1C <= off_ref[0]) & (blk >= 0)
  if valid_ref is not None:
    ok_1C = ok_1C & (valid_ref[pl.ds(start, block_size)][None, :] > 0)
  q_RD = q_ref[...]
  s_RC = kc.dot_nt(q_RD, k_ref[pl.ds(start, block_size), :],
                   precision) * scale
  mask_RC = jnp.broadcast_to(ok_1C, s_RC.shape)
  m_R1 = jnp.max(jnp.where(mask_RC, s_RC, kc.MASK_VALUE), axis=1,
                 keepdims=True)
  p_RC = jnp.where(mask_RC, jnp.exp(s_RC - m_R1), 0.0)
  l_R1 = jnp.sum(p_RC, axis=1, keepdims=True)
  # V is read after the score dot, so that in f32 (each dot operand held
  # as TF32 halves in shared memory) K's are dead before V's are made.
  v_CD = v_ref[pl.ds(start, block_size), :]
  acc_RD = kc.dot_nn(p_RC.astype(v_CD.dtype), v_CD, precision)
  out_RD, lse_R1 = kc.finish_softmax(m_R1, l_R1, acc_RD)
  o_ref[...] = out_RD.astype(o_ref.dtype)
  lse_ref[...] = lse_R1[:, 0]


def decode_partials(q_BGRD, k_BSGD, v_BSGD, sel_BGK, off_B, valid_BS, *,
                    block_size: int, scale: float, interpret: bool):
  """Decode's split-K partials, one launch straight from the selection:
  (o_BGKRD, lse_BGKR f32), a program per (sequence, group, slot).

  The general path (`forward_plan` at T = 1) builds the same work as XLA
  tables first (tile rows, work items, pair table: four small launches a
  step); here each program reads its block id from the selection and its
  rows are its group's, so none is needed. valid_BS: int32 [B, Sp] or
  None (every key valid: no mask operand).
  """
  b, g, rp, dp = q_BGRD.shape
  k = sel_BGK.shape[-1]
  sp = k_BSGD.shape[1]
  kernel = functools.partial(
      _decode_kernel, block_size=block_size, scale=scale,
      precision=kc.gpu_precision_for(q_BGRD.dtype, interpret))
  kv = pl.BlockSpec((None, sp, None, dp), lambda bb, gg, kk: (bb, 0, gg, 0))
  in_specs = [
      pl.BlockSpec((1,), lambda bb, gg, kk: (bb,)),
      pl.BlockSpec((1,), lambda bb, gg, kk: ((bb * g + gg) * k + kk,)),
      pl.BlockSpec((None, None, rp, dp), lambda bb, gg, kk: (bb, gg, 0, 0)),
      kv, kv]
  operands = [off_B, sel_BGK.reshape(-1).astype(jnp.int32), q_BGRD, k_BSGD,
              v_BSGD]
  if valid_BS is not None:
    in_specs.append(pl.BlockSpec((None, sp), lambda bb, gg, kk: (bb, 0)))
    operands.append(valid_BS)
  return kc.pallas_call(
      kernel,
      grid=(b, g, k),
      in_specs=in_specs,
      out_specs=[
          pl.BlockSpec((None, None, None, rp, dp),
                       lambda bb, gg, kk: (bb, gg, kk, 0, 0)),
          pl.BlockSpec((None, None, None, rp),
                       lambda bb, gg, kk: (bb, gg, kk, 0)),
      ],
      out_shape=[jax.ShapeDtypeStruct((b, g, k, rp, dp), q_BGRD.dtype),
                 jax.ShapeDtypeStruct((b, g, k, rp), jnp.float32)],
      compiler_params=_params(rp, q_BGRD.dtype),
      interpret=interpret,
      name='msa_kv_outer_decode',
  )(*operands)


def _merge(o_BGTKRD, lse_BGTKR):
  """A token's K partials merged by the log-sum-exp rule: (out_BTGRD f32,
  lse_BTGR), in the output's own (token-major) order.

  The partials are group-major, as the kernel writes them; the merge reads
  them through a transpose, so the reduction writes the token-major output
  directly instead of a group-major one that another pass would transpose.
  """
  lse_BTGKR = lse_BGTKR.transpose(0, 2, 1, 3, 4)
  lse_T = jax.nn.logsumexp(lse_BTGKR, axis=3)
  safe = jnp.where(jnp.isfinite(lse_T), lse_T, 0.0)
  w_P = jnp.where(jnp.isfinite(lse_BTGKR),
                  jnp.exp(lse_BTGKR - safe[:, :, :, None]), 0.0)
  # A sum, not a dot: f32 dots on the GPU default to TF32.
  o_BTGKRD = o_BGTKRD.transpose(0, 2, 1, 3, 4, 5).astype(jnp.float32)
  out = jnp.sum(w_P[..., None] * o_BTGKRD, axis=3)
  return out, lse_T


def combine(o_BGJWD, lse_BGJW, pair_BGP, *, top_k: int, heads_p: int):
  """Merge each token's per-slot partials, stored in tile order: (out_BTGRD
  f32, lse_BTGR)."""
  b, g, n_tiles, w, dp = o_BGJWD.shape
  q = w // heads_p
  p = pair_BGP.shape[-1]
  t = p // top_k
  o = o_BGJWD.reshape(b, g, n_tiles * q, heads_p, dp)
  lse = lse_BGJW.reshape(b, g, n_tiles * q, heads_p)
  idx = jnp.maximum(pair_BGP, 0)
  # Unused tiles are never written: a -1 pair must not read one, even
  # times a zero weight (garbage may be NaN).
  o_P = jnp.where((pair_BGP >= 0)[..., None, None],
                  jnp.take_along_axis(o, idx[..., None, None], axis=2), 0)
  lse_P = jnp.where((pair_BGP >= 0)[..., None],
                    jnp.take_along_axis(lse, idx[..., None], axis=2), NEG_INF)
  return _merge(o_P.reshape(b, g, t, top_k, heads_p, dp),
                lse_P.reshape(b, g, t, top_k, heads_p))


def combine_pairs(o_BGXD, lse_BGX, pair_BGP, *, top_k: int, heads_p: int):
  """Merge partials stored in pair order (row (t*K + k)*Rp + r): no
  gather. A -1 slot (pair -1) has rows never written, so they are masked,
  not read as weights (garbage may be NaN)."""
  b, g, p = pair_BGP.shape
  t, k = p // top_k, top_k
  dp = o_BGXD.shape[-1]
  n = p * heads_p  # the rows past n are the kernel's spare row
  live = (pair_BGP >= 0).reshape(b, g, t, k)[..., None]
  o = jnp.where(live[..., None],
                o_BGXD[:, :, :n].reshape(b, g, t, k, heads_p, dp), 0)
  lse = jnp.where(live, lse_BGX[:, :, :n].reshape(b, g, t, k, heads_p),
                  NEG_INF)
  return _merge(o, lse)


def _combine_kernel(*refs, top_k: int, heads_p: int, groups: int,
                    tokens: int):
  """`tokens` tokens of one (sequence, group): their K pair-order partials
  merged by a running log-sum-exp (slot by slot, each partial read once),
  written at their rows of the token-major output view [T*G*Rp, Dp].
  refs: (pair_ref, o_ref, lse_ref, out_ref, lse_out_ref), or without
  pair_ref where every partial was written (a -1 slot as output 0 and
  log-sum-exp -inf, which weigh nothing: `decode_partials`)."""
  pair_ref = refs[0] if len(refs) == 5 else None
  o_ref, lse_ref, out_ref, lse_out_ref = refs[-4:]
  i, g = pl.program_id(1), pl.program_id(2)
  rows = tokens * heads_p
  r_W = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
  t_W = i * tokens + kc.div(r_W, heads_p)
  head_W = r_W - kc.div(r_W, heads_p) * heads_p
  dp = o_ref.shape[-1]

  def slot(k, carry):
    m_W1, s_W1, acc_WD = carry
    pair_W = t_W * top_k + k
    at_W = pair_W * heads_p + head_W
    lse_W1 = lse_ref[at_W][:, None]
    o_WD = o_ref[at_W, :].astype(jnp.float32)
    if pair_ref is not None:
      # A -1 slot's rows were never written (garbage, maybe NaN): masked
      # before any arithmetic.
      live_W1 = (pair_ref[pair_W] >= 0)[:, None]
      lse_W1 = jnp.where(live_W1, lse_W1, NEG_INF)
      o_WD = jnp.where(live_W1, o_WD, 0.0)
    m_new = jnp.maximum(m_W1, lse_W1)
    safe = jnp.where(m_new > NEG_INF, m_new, 0.0)
    old_w = jnp.where(m_W1 > NEG_INF, jnp.exp(m_W1 - safe), 0.0)
    new_w = jnp.where(lse_W1 > NEG_INF, jnp.exp(lse_W1 - safe), 0.0)
    return m_new, s_W1 * old_w + new_w, acc_WD * old_w + new_w * o_WD

  m_W1, s_W1, acc_WD = jax.lax.fori_loop(
      0, top_k, slot, (jnp.full((rows, 1), NEG_INF, jnp.float32),
                       jnp.zeros((rows, 1), jnp.float32),
                       jnp.zeros((rows, dp), jnp.float32)))
  seen = s_W1 > 0
  out_WD = jnp.where(seen, acc_WD / jnp.where(seen, s_W1, 1.0), 0.0)
  lse_W1 = jnp.where(seen, m_W1 + jnp.log(jnp.where(seen, s_W1, 1.0)),
                     NEG_INF)
  out_at_W = (t_W * groups + g) * heads_p + head_W
  out_ref[out_at_W, :] = out_WD.astype(out_ref.dtype)
  lse_out_ref[out_at_W] = lse_W1[:, 0]


def combine_kernel(o_BGXD, lse_BGX, pair_BGP, *, top_k: int, heads_p: int,
                   dtype, interpret: bool, tokens: int | None = None,
                   n_tokens: int | None = None):
  """combine_pairs as one Pallas launch: (out_BTGRD in `dtype`, lse_BTGR).

  pair_BGP None: every partial of the n_tokens tokens was written, a -1
  slot's as output 0 and log-sum-exp -inf (`decode_partials`), so no pair
  table is read.

  A program merges `tokens` tokens of one (sequence, group) (default: 128
  rows of tokens x heads), slot by slot with a running maximum, so each
  partial is read once and the output written once, token-major; XLA's
  reduction writes an f32 result. The merge order differs from
  combine_pairs' (a running log-sum-exp against one over all slots), so
  the two agree to rounding, not bit for bit.
  """
  b, g = o_BGXD.shape[:2]
  t = n_tokens if pair_BGP is None else pair_BGP.shape[-1] // top_k
  p = t * top_k
  dp = o_BGXD.shape[-1]
  most = max(1, 128 // heads_p)
  # A power of two that divides t (t & -t: t's largest one).
  tokens = tokens or min(t & -t, most)
  if t % tokens:
    raise ValueError(f'tokens={tokens} must divide the {t} tokens.')
  n_out = t * g * heads_p
  kernel = functools.partial(_combine_kernel, top_k=top_k, heads_p=heads_p,
                             groups=g, tokens=tokens)
  rows = tokens * heads_p
  in_specs = [
      pl.BlockSpec((None, None) + o_BGXD.shape[2:],
                   lambda bb, ii, gg: (bb, gg, 0, 0)),
      pl.BlockSpec((None, None, lse_BGX.shape[2]),
                   lambda bb, ii, gg: (bb, gg, 0)),
  ]
  operands = [o_BGXD, lse_BGX]
  if pair_BGP is not None:
    in_specs.insert(
        0, pl.BlockSpec((None, None, p), lambda bb, ii, gg: (bb, gg, 0)))
    operands.insert(0, pair_BGP)
  out, lse = kc.pallas_call(
      kernel,
      grid=(b, t // tokens, g),
      in_specs=in_specs,
      out_specs=[
          pl.BlockSpec((None, n_out, dp), lambda bb, ii, gg: (bb, 0, 0)),
          pl.BlockSpec((None, n_out), lambda bb, ii, gg: (bb, 0)),
      ],
      out_shape=[jax.ShapeDtypeStruct((b, n_out, dp), dtype),
                 jax.ShapeDtypeStruct((b, n_out), jnp.float32)],
      compiler_params=plgpu.CompilerParams(
          num_warps=8 if rows >= 128 else 4, num_stages=2),
      interpret=interpret,
      name='msa_kv_outer_combine',
  )(*operands)
  return (out.reshape(b, t, g, heads_p, dp),
          lse.reshape(b, t, g, heads_p))


def _query_view(q_BTGRD):
  b, t, g, rp, dp = q_BTGRD.shape
  return q_BTGRD.reshape(b, t * g * rp, dp)


def _queries_per_tile(heads_p: int, dtype) -> int:
  """Queries per tile: 128 rows in 16-bit dtypes, 64 in f32, whose
  [rows, D] operands and [rows, C] scores take twice the registers and
  shared memory."""
  rows = 128 if jnp.dtype(dtype).itemsize <= 2 else 64
  return max(1, rows // heads_p)


def _per_program(n_tiles: int, n_blocks: int) -> int:
  """Tiles per program: twice a block's mean, so most blocks are one
  program and a block most queries select is split over several."""
  return max(4, 2 * -(-max(n_tiles - n_blocks, 1) // n_blocks))


def _query_chunk(config: ForwardConfig, q: int, g: int, k: int, rp: int,
                 dp: int) -> int:
  """Tokens per launch: config.query_chunk, or partials of about 1 GiB."""
  return config.query_chunk or max(
      q, (2**30 // (g * k * rp * dp * 2)) // q * q)


def _mosaic():
  """kv_outer_mosaic, imported when first used: jax's Mosaic GPU package
  costs every process that imports this module (each training run) a
  quarter of a second."""
  from pallas_kernels.msa import kv_outer_mosaic  # pylint: disable=g-import-not-at-top
  return kv_outer_mosaic


def _tile_queries(config: ForwardConfig, heads_p: int, dtype) -> int:
  """Queries per tile under `config` (its kernel's default if unset)."""
  if config.q_per_tile:
    return config.q_per_tile
  if config.kernel == 'mosaic':
    return max(1, _mosaic().TILE_ROWS // heads_p)
  return _queries_per_tile(heads_p, dtype)


def unsupported(config: ForwardConfig, *, heads_p: int, head_dim_p: int,
                block_size: int, dtype) -> str | None:
  """Why `config`'s forward cannot run at these padded shapes (None: it
  can); only the Mosaic kernel has such limits."""
  if config.kernel != 'mosaic':
    return None
  return _mosaic().unsupported(
      heads_p, head_dim_p, block_size,
      _tile_queries(config, heads_p, dtype), dtype)


def forward_plan(sel_BGTK, *, n_blocks: int, heads_p: int, head_dim_p: int,
                 dtype, config: ForwardConfig | None = None) -> list:
  """The forward's work, per query chunk (XLA, no kernel): a list of
  (items, rows_BGJW, out_rows_BGJW or None, pair_BGP).

  items: (block, first tile, tile count) per program; rows: each tile
  row's row in the query view; out_rows (pair_order only): its row in the
  pair-order partial view; pair: the lane of each (token, slot) pair (-1:
  a -1 slot). One query per sequence (T = 1, decode) is one chunk whose
  tiles are the selection itself (split-K).
  """
  config = config or ForwardConfig()
  b, g, t, k = sel_BGTK.shape
  q = _tile_queries(config, heads_p, dtype)

  def chunk(tiles, items):
    _, tile_q, pair = tiles
    rows = tile_rows(tile_q, groups=g, heads_p=heads_p)
    out_rows = None
    if config.pair_order:
      out_rows = pair_rows(pair, tile_q.shape[2] * tile_q.shape[3],
                           heads_p=heads_p).reshape(rows.shape)
    return items, rows, out_rows, pair

  if t == 1:
    tiles = decode_tiles(sel_BGTK[:, :, 0])
    tile_blk = tiles[0]
    direct = (tile_blk, jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32),
                                         tile_blk.shape),
              (tile_blk >= 0).astype(jnp.int32))
    return [chunk(tiles, direct)]
  size = _query_chunk(config, q, g, k, heads_p, head_dim_p)

  def one(sel_c, t0):
    tiles = build_tiles(sel_c, n_blocks=n_blocks, q_per_tile=q, t0=t0)
    items = _work_items(
        tiles[0], n_blocks,
        config.tiles_per_program or _per_program(tiles[0].shape[-1],
                                                 n_blocks))
    return chunk(tiles, items[:3])

  # The whole chunks' plans in one batched computation (a chunk's plan is
  # a few dozen small XLA ops, sorts and scatters: built chunk by chunk
  # they were that many launches per chunk, 32 chunks at 128k), then the
  # remainder chunk alone.
  n_full = t // size
  plan = []
  if n_full:
    sel_CBGTK = sel_BGTK[:, :, :n_full * size].reshape(
        b, g, n_full, size, k).transpose(2, 0, 1, 3, 4)
    stacked = jax.vmap(one)(sel_CBGTK,
                            jnp.arange(n_full, dtype=jnp.int32) * size)
    plan += [jax.tree.map(lambda a, i=i: a[i], stacked)
             for i in range(n_full)]
  if t % size:
    plan.append(one(sel_BGTK[:, :, n_full * size:], n_full * size))
  return plan


def forward_partials(plan: list, q_BTGRD, k_BSGD, v_BSGD, off_B, valid_BS,
                     *, block_size: int, scale: float, interpret: bool,
                     config: ForwardConfig | None = None) -> list:
  """The forward kernel over each chunk of `plan`: per chunk (o, lse), the
  per-slot partial outputs and log-sum-exps, in tile order [B, G, J, W,
  Dp] or (pair_order) pair order [B, G, P*Rp + 1, Dp]."""
  config = config or ForwardConfig()
  g, rp = q_BTGRD.shape[2:4]
  if config.kernel == 'mosaic':
    n_blocks = k_BSGD.shape[1] // block_size
    return [_mosaic().forward_call(
        off_B, items, rows, out_rows, pair, _query_view(q_BTGRD), k_BSGD,
        v_BSGD, valid_BS, block_size=block_size, rows_per_token=g * rp,
        scale=scale, interpret=interpret,
        window=config.tiles_per_program or _per_program(rows.shape[2],
                                                        n_blocks))
            for items, rows, out_rows, pair in plan]
  call = functools.partial(_forward_call, off_B=off_B,
                           q_BXD=_query_view(q_BTGRD), k_BSGD=k_BSGD,
                           v_BSGD=v_BSGD, valid_BS=valid_BS,
                           block_size=block_size, rows_per_token=g * rp,
                           scale=scale, interpret=interpret, config=config)
  return [call(items=items, rows_BGJW=rows, out_rows_BGJW=out_rows,
               n_pairs=None if out_rows is None else pair.shape[-1])
          for items, rows, out_rows, pair in plan]


def forward_combine(plan: list, partials: list, *, top_k: int,
                    heads_p: int, dtype=jnp.float32,
                    config: ForwardConfig | None = None,
                    interpret: bool = False):
  """Each token's partials merged across slots: (out_BTGRD in `dtype`,
  lse_BTGR f32), the chunks joined along T (each cast first, so the join
  copies the narrow output). With config.fused_combine, and always at one
  query per sequence (decode), by `combine_kernel`."""
  config = config or ForwardConfig()
  outs, lses = [], []
  for (_, _, out_rows, pair), (o, lse) in zip(plan, partials):
    if len(plan) == 1 and out_rows is None and pair.shape[-1] == top_k:
      # One query per sequence (decode): tile k is slot k, so the partials
      # are in pair order as they stand, and one launch merges them (as
      # XLA ops the merge was five launches on a few MB: launches.py).
      # Only a plan of one chunk is decode's: a longer input's one-token
      # remainder chunk (T % query_chunk == 1) has build_tiles' tile order.
      b, g = o.shape[:2]
      out_c, lse_c = combine_kernel(
          o.reshape(b, g, -1, o.shape[-1]), lse.reshape(b, g, -1), pair,
          top_k=top_k, heads_p=heads_p, dtype=dtype, interpret=interpret)
    elif config.fused_combine:
      out_c, lse_c = combine_kernel(o, lse, pair, top_k=top_k,
                                    heads_p=heads_p, dtype=dtype,
                                    interpret=interpret)
    else:
      merge = combine if out_rows is None else combine_pairs
      out_c, lse_c = merge(o, lse, pair, top_k=top_k, heads_p=heads_p)
    outs.append(out_c.astype(dtype))
    lses.append(lse_c)
  lse = lses[0] if len(lses) == 1 else jnp.concatenate(lses, axis=1)
  return _join_in_place(outs), lse


def _join_in_place(chunks: list):
  """The chunks (along T, axis 1) written into one buffer in turn: each
  merge then writes its slice in place, where a concatenate copies every
  chunk's output once more (about 1 GB at 32k: launches.py). For the
  outputs only: the small log-sum-exps joined so take a launch a chunk."""
  if len(chunks) == 1:
    return chunks[0]
  shape = list(chunks[0].shape)
  shape[1] = sum(c.shape[1] for c in chunks)
  out, t0 = jnp.zeros(shape, chunks[0].dtype), 0
  for c in chunks:
    out = jax.lax.dynamic_update_slice_in_dim(out, c, t0, axis=1)
    t0 += c.shape[1]
  return out


def forward(q_BTGRD, k_BSGD, v_BSGD, sel_BGTK, off_B, valid_BS, *,
            block_size: int, scale: float, interpret: bool,
            config: ForwardConfig | None = None):
  """Padded operands in (R, D powers of two); (o_BTGRD, lse_BTGR f32) out.

  Same contract as forward_kernel.forward_gpu, but valid_BS may be None
  (every key valid). One query per sequence (T = 1, decode) is split-K: a
  program per selected slot (`decode_partials`; config.tiled_decode: the
  general tile kernel on forward_plan's tables). Longer inputs
  take the sorted tiles, config.query_chunk tokens at a time, a program
  per key block (or per part of a heavy one: config.tiles_per_program).
  Three stages, each callable alone (the GPU bench times them apart):
  forward_plan (XLA), forward_partials (the kernel), forward_combine
  (XLA).
  """
  config = config or ForwardConfig()
  b, t, g, rp, dp = q_BTGRD.shape
  top_k = sel_BGTK.shape[-1]
  if t == 1 and not config.tiled_decode:
    o, lse = decode_partials(q_BTGRD[:, 0], k_BSGD, v_BSGD,
                             sel_BGTK[:, :, 0], off_B, valid_BS,
                             block_size=block_size, scale=scale,
                             interpret=interpret)
    # Tile k is slot k: the partials are in pair order as they stand.
    return combine_kernel(o.reshape(b, g, top_k * rp, dp),
                          lse.reshape(b, g, top_k * rp), None, top_k=top_k,
                          heads_p=rp, dtype=q_BTGRD.dtype,
                          interpret=interpret, n_tokens=1)
  if valid_BS is None:
    valid_BS = jnp.ones(k_BSGD.shape[:2], jnp.int32)
  plan = forward_plan(sel_BGTK, n_blocks=k_BSGD.shape[1] // block_size,
                      heads_p=rp, head_dim_p=dp, dtype=q_BTGRD.dtype,
                      config=config)
  parts = forward_partials(plan, q_BTGRD, k_BSGD, v_BSGD, off_B, valid_BS,
                           block_size=block_size, scale=scale,
                           interpret=interpret, config=config)
  return forward_combine(plan, parts, top_k=sel_BGTK.shape[-1], heads_p=rp,
                         dtype=q_BTGRD.dtype, config=config,
                         interpret=interpret)


def _work_items(tile_blk_BGJ, n_blocks: int, per_program: int):
  """Work items in launch order, largest first: (blk, first tile, tile
  count) per item [B, G, U], then the block's first item and item count
  [B, G, N], and the launch slot of each item [B, G, U].

  Block n's tiles are contiguous (build_tiles sorts by block); they are cut
  into items of at most `per_program` tiles, numbered in block order. The
  programs are launched by tile count, most first (ties in item order,
  then the empty items): grid axis 2 is the slowest, so every (sequence,
  group)'s heavy items start in the first wave and a light one, not a
  heavy one, runs last. A block's items stay numbered in block order, so
  `_sum_items` adds them in the same order wherever they were launched.
  U is a static bound: J / per_program + N.
  """
  b, g, n_tiles = tile_blk_BGJ.shape
  n_items = -(-n_tiles // per_program) + n_blocks
  key = jnp.where(tile_blk_BGJ >= 0, tile_blk_BGJ, n_blocks)
  tiles_BGN = jax.vmap(jax.vmap(
      lambda x: jnp.bincount(x, length=n_blocks + 1)))(key)[..., :n_blocks]
  first_tile_BGN = jnp.cumsum(tiles_BGN, axis=-1) - tiles_BGN
  items_BGN = -(-tiles_BGN // per_program)
  last_item_BGN = jnp.cumsum(items_BGN, axis=-1)
  first_item_BGN = last_item_BGN - items_BGN
  # Item u belongs to the first block whose items end past u (blocks with
  # no tile end where the one before them does, so they own nothing).
  # 'compare_all': one fused [U, N] comparison; the default binary search
  # is a loop, which XLA launches as kernels per step on a GPU
  # (launches.py).
  u = jnp.arange(n_items)
  owner = jax.vmap(jax.vmap(lambda ends: jnp.searchsorted(
      ends, u, side='right', method='compare_all')))(last_item_BGN)
  live = owner < n_blocks
  owner_c = jnp.minimum(owner, n_blocks - 1)
  part = u[None, None, :] - jnp.take_along_axis(first_item_BGN, owner_c, -1)
  n_in_block = jnp.take_along_axis(tiles_BGN, owner_c, -1)
  first = jnp.take_along_axis(first_tile_BGN, owner_c, -1) + part * per_program
  count = jnp.where(live, jnp.clip(n_in_block - part * per_program, 0,
                                   per_program), 0).astype(jnp.int32)
  blk = jnp.where(live, owner_c, -1).astype(jnp.int32)
  first = jnp.where(live, first, 0).astype(jnp.int32)
  order_BGU = jnp.argsort(-count, axis=-1, stable=True)
  launch = lambda a: jnp.take_along_axis(a, order_BGU, axis=-1)
  slot_BGU = jnp.argsort(order_BGU, axis=-1).astype(jnp.int32)
  return (launch(blk), launch(first), launch(count), first_item_BGN,
          items_BGN, slot_BGU)


# Elements of one block's [C, D] sum a program owns: 32 f32 a thread at
# four warps.
SUM_CHUNK = 4096


def _sum_items_kernel(first_ref, items_ref, slot_ref, dk_ref, dv_ref,
                      dk_out_ref, dv_out_ref, *, chunk: int, chunks: int):
  """One chunk of one key block's dK and dV: its items' partials added in
  item order (the order of a sequential sum, so deterministic), each read
  once. Grid (B, G, N * chunks)."""
  j = pl.program_id(2)
  n = kc.div(j, chunks)
  at = pl.ds((j - n * chunks) * chunk, chunk)
  first = first_ref[n]

  def add(i, acc):
    dk_E, dv_E = acc
    u = slot_ref[first + i]
    return dk_E + dk_ref[u, at], dv_E + dv_ref[u, at]

  zeros = jnp.zeros((chunk,), jnp.float32)
  dk_E, dv_E = jax.lax.fori_loop(0, items_ref[n], add, (zeros, zeros))
  dk_out_ref[...] = dk_E
  dv_out_ref[...] = dv_E


def _sum_items(dk_BGUCD, dv_BGUCD, first_item_BGN, items_BGN, slot_BGU, *,
               interpret: bool):
  """Each block's items summed in item order (deterministic): (dk, dv)
  [B, G, N, C, D] f32; item u's partial sum is at launch slot
  slot_BGU[u]. One launch; as XLA ops it was a loop of data-dependent trip
  count, which on a GPU syncs with the host every step (launches.py)."""
  b, g, n = first_item_BGN.shape
  n_items, c, dp = dk_BGUCD.shape[2:]
  e = c * dp
  chunk = min(e, SUM_CHUNK)  # both powers of two (C and the padded D)
  chunks = e // chunk
  flat = lambda a: a.reshape(b, g, n_items, e)
  part_spec = pl.BlockSpec((None, None, n_items, e),
                           lambda bb, gg, jj: (bb, gg, 0, 0))
  index_spec = lambda size: pl.BlockSpec((None, None, size),
                                         lambda bb, gg, jj: (bb, gg, 0))
  out_spec = pl.BlockSpec((None, None, None, chunk),
                          lambda bb, gg, jj: (bb, gg, jj // chunks,
                                              jj % chunks))
  kernel = functools.partial(_sum_items_kernel, chunk=chunk, chunks=chunks)
  dk, dv = kc.pallas_call(
      kernel,
      grid=(b, g, n * chunks),
      in_specs=[index_spec(n), index_spec(n), index_spec(n_items),
                part_spec, part_spec],
      out_specs=[out_spec, out_spec],
      out_shape=[jax.ShapeDtypeStruct((b, g, n, e), jnp.float32)] * 2,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name='msa_kv_outer_dkv_sum',
  )(first_item_BGN, items_BGN, slot_BGU, flat(dk_BGUCD), flat(dv_BGUCD))
  whole = lambda a: a.reshape(b, g, n, c, dp)
  return whole(dk), whole(dv)


def dkv(q_BTGRD, k_BSGD, v_BSGD, sel_BGTK, off_B, valid_BS, do_BTGRD,
        lse_BTGR, delta_BTGR, *, block_size: int, scale: float,
        interpret: bool, q_per_tile: int | None = None,
        tiles_per_program: int | None = None, prefetch: bool = False,
        key_parts: int | None = None):
  """(dk_BSGD f32, dv_BSGD f32), KV-outer, without atomics.

  tiles_per_program: by default twice a block's mean tile count, so most
  blocks are one program and the partial sums stay near 1.5x dK's size;
  a block most queries select is split over several programs.
  prefetch: the next tile's gathers before this tile's dots (timed against
  the default by the GPU bench; the same bits).
  key_parts: programs per key block, each owning block_size / key_parts
  keys (default: `_dkv_tiling`'s). Compiled for an H100, the bf16 kernel
  over whole blocks holds two [C, D] f32 accumulators and the [W, C]
  scores in 255 registers and spills; in two parts it does not
  (experiments/gpu_static), at the price of gathering each tile's rows
  once per part. The GPU bench times it beside the default.
  """
  b, t, g, rp, dp = q_BTGRD.shape
  sp = k_BSGD.shape[1]
  n_blocks = sp // block_size
  q_default, parts = _dkv_tiling(q_BTGRD.dtype, block_size, rp)
  if key_parts is not None:
    # A part's keys are the N of its dots: tl.dot needs 16 on a GPU.
    least = 1 if interpret else 16
    if (key_parts < 1 or block_size % key_parts
        or block_size // key_parts < least):
      raise ValueError(f'key_parts must divide block_size={block_size} into '
                       f'parts of at least {least} keys, got {key_parts}.')
    parts = key_parts
  q = q_per_tile or q_default
  sub = block_size // parts
  # Sorted tiles even at T = 1: the work items need a block's tiles
  # contiguous.
  tile_blk, tile_q, _ = build_tiles(sel_BGTK, n_blocks=n_blocks,
                                    q_per_tile=q)
  rows = tile_rows(tile_q, groups=g, heads_p=rp)
  n_tiles, w = rows.shape[2:]
  per_program = tiles_per_program or _per_program(n_tiles, n_blocks)
  blk, first, count, first_item, items, slot = _work_items(
      tile_blk, n_blocks, per_program)
  n_items = blk.shape[-1]
  x = t * g * rp
  flat = lambda a: a.reshape(b, x)
  out_spec = pl.BlockSpec((None, None, None, sub, dp),
                          lambda bb, gg, uu: (bb, gg, uu, 0, 0))
  kernel = functools.partial(
      _dkv_kernel, block_size=block_size, rows_per_token=g * rp, scale=scale,
      precision=kc.gpu_precision_for(q_BTGRD.dtype, interpret),
      reload_kv=_reload_kv(q_BTGRD.dtype), parts=parts, prefetch=prefetch)
  dk_u, dv_u = kc.pallas_call(
      kernel,
      grid=(b, g, n_items * parts),
      in_specs=[
          *_work_specs(b, g, n_items, (n_tiles, w), x, dp, sp, parts),
          pl.BlockSpec((None, x, dp), lambda bb, gg, uu: (bb, 0, 0)),
          pl.BlockSpec((None, x), lambda bb, gg, uu: (bb, 0)),
          pl.BlockSpec((None, x), lambda bb, gg, uu: (bb, 0)),
      ],
      out_specs=[out_spec, out_spec],
      out_shape=[jax.ShapeDtypeStruct((b, g, n_items * parts, sub, dp),
                                      jnp.float32)] * 2,
      compiler_params=_params(w, q_BTGRD.dtype),
      interpret=interpret,
      name='msa_kv_outer_dkv',
  )(off_B, blk.reshape(-1), first.reshape(-1), count.reshape(-1), rows,
    _query_view(q_BTGRD), k_BSGD, v_BSGD, valid_BS, _query_view(do_BTGRD),
    flat(lse_BTGR), flat(delta_BTGR))
  # Item u's parts are consecutive programs: in key order once reshaped.
  whole = lambda a: a.reshape(b, g, n_items, block_size, dp)
  to_bsgd = lambda a: a.reshape(b, g, sp, dp).transpose(0, 2, 1, 3)
  dk, dv = _sum_items(whole(dk_u), whole(dv_u), first_item, items, slot,
                      interpret=interpret)
  return to_bsgd(dk), to_bsgd(dv)
