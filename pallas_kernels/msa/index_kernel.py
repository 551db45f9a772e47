"""Pallas kernels (a) for GPUs: the index branch in two launches.

The fused selector (select_kernel.py) keeps a running top-(K-1) table per
query while it streams key blocks: a loop-carried insertion per block, f32
dots, one (query tile, group) per program. On an H100 that ran at 0.56
TFLOP/s. Here the two halves of the index branch are separate launches,
each shaped for what it does:

1. **Scores** (`_scores_kernel`): S[b, n, row] = scale * max over the
   visible keys j of block n of <qi_row, ki_j>. A row is one (token, group)
   pair: all groups share the one index key head, so qi [B, T, G, I] is
   read as [B, T*G, I] (a free reshape) and a 128-row tile of it meets each
   key block in one tensor-core dot (bf16 in, f32 accumulated). The max
   needs no exponent; the scale is positive, so it is applied after the max.
   A program takes `blocks_per_program` key blocks, loading its query tile
   once; blocks past the tile's causal diagonal are skipped, and only the
   diagonal ones pay the causal compare. Scores are
   written block-major, [B, N, rows], as f32.
2. **Top-k** (`_topk_kernel`): per row, K-1 rounds of argmax over the
   earlier blocks (id < the local block), ties to the lower id (`lax.top_k`
   order), written most-important first; then the local block; then -1.
   A block whose score is -inf (only padding keys) is never taken: its slot
   is -1, as in the reference (docs/design.md §6.3, §6.9).

Precision follows the inputs: bf16 qi and ki give bf16 dots (exact products,
f32 sums: the scores differ from an f32 reference only in summation order);
anything else runs in f32 (three TF32 passes on the GPU, exact in
interpret mode). The queries are processed in row chunks so the score
buffer stays bounded (`max_score_bytes`).

Letter key: B batch, T query tokens, S key tokens, G groups, I index head
dim (padded: Ip), N key blocks (padded to a power of two: Np), C block
size, K selected blocks (padded: Kp), M rows of a score tile, W rows of a
top-k tile, Q rows (tokens x groups).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.msa import kernel_common as kc
from pallas_kernels.msa import xla

NEG_INF = float('-inf')


def _row_positions(offset, row0, n_rows: int, groups: int, axis: int):
  """Absolute position of each row's token: offset + (row // G)."""
  shape = (n_rows, 1) if axis == 0 else (1, n_rows)
  rows = row0 + jax.lax.broadcasted_iota(jnp.int32, shape, axis)
  return offset + kc.div(rows, groups)


def _scores_kernel(offset_ref, qi_ref, ki_ref, valid_ref, out_ref, *,
                   block_size: int, groups: int, row_base: int, scale: float,
                   precision, key_sub: int, causal_every_block: bool = False):
  """Block maxima of one tile of m rows against nb key blocks (grid (B,
  row tiles, key chunks)), written [nb, m]; blocks past the tile's last
  row's diagonal stay -inf without a dot.

  Blocks before the tile's first row's block are wholly visible to every
  row: they take the key-padding mask alone, and only the blocks from
  there to the last row's (the diagonal: one or two blocks for a tile of
  m / G tokens) pay the causal compare. causal_every_block: one loop that
  compares in every block (fewer registers on an H100: 119 against 146 at
  64-row tiles of 32-key dots, 4 blocks per SM against 3,
  experiments/gpu_static; the GPU bench times both)."""
  i, j = pl.program_id(1), pl.program_id(2)
  m = qi_ref.shape[0]
  nb = out_ref.shape[0]
  row0 = row_base + i * m
  qpos_M1 = _row_positions(offset_ref[0], row0, m, groups, axis=0)
  # The tile's last row sees the most blocks; later blocks are all masked.
  last_block = kc.div(offset_ref[0] + kc.div(row0 + m - 1, groups),
                      block_size)
  first_block = kc.div(offset_ref[0] + kc.div(row0, groups), block_size)
  n_vis = jnp.clip(last_block - j * nb + 1, 0, nb)
  n_whole = jnp.clip(first_block - j * nb, 0, n_vis)
  qi_MI = qi_ref[...]
  blk_iota = jax.lax.broadcasted_iota(jnp.int32, (nb, m), 0)

  def body(causal: bool):
    def visit(jb, tile_NM):
      # The block's keys key_sub at a time (f32: smaller shared-memory
      # operands), the maximum taken over the parts.
      best_M = jnp.full((m,), NEG_INF, jnp.float32)
      for c0 in range(0, block_size, key_sub):
        key0 = jb * block_size + c0
        k_CI = ki_ref[pl.ds(key0, key_sub), :]
        logits_MC = kc.dot_nt(qi_MI, k_CI, precision)
        ok_MC = valid_ref[pl.ds(key0, key_sub)][None, :] > 0
        if causal:
          kpos_1C = j * nb * block_size + key0 + jax.lax.broadcasted_iota(
              jnp.int32, (1, key_sub), 1)
          ok_MC = ok_MC & (kpos_1C <= qpos_M1)
        logits_MC = jnp.where(ok_MC, logits_MC, NEG_INF)
        best_M = jnp.maximum(best_M, jnp.max(logits_MC, axis=1))
      return jnp.where(blk_iota == jb, best_M[None, :] * scale, tile_NM)
    return visit

  tile_NM = jnp.full((nb, m), NEG_INF, jnp.float32)
  if causal_every_block:
    n_whole = 0
  else:
    tile_NM = jax.lax.fori_loop(0, n_whole, body(causal=False), tile_NM)
  out_ref[...] = jax.lax.fori_loop(n_whole, n_vis, body(causal=True),
                                   tile_NM)


def _topk_kernel(offset_ref, scores_ref, sel_ref, *, block_size: int,
                 groups: int, row_base: int, top_k: int):
  """The selection of w rows from their [N, w] block-major scores,
  written slot-major [Kp, w]."""
  i = pl.program_id(1)
  n, w = scores_ref.shape
  kp = sel_ref.shape[0]
  local_1W = kc.div(
      _row_positions(offset_ref[0], row_base + i * w, w, groups, axis=1),
      block_size)
  ids_NW = jax.lax.broadcasted_iota(jnp.int32, (n, w), 0)
  slot_KW = jax.lax.broadcasted_iota(jnp.int32, (kp, w), 0)
  scores_NW = scores_ref[...]
  avail_NW = ids_NW < local_1W
  big = jnp.int32(2**30)
  sel_KW = jnp.full((kp, w), -1, jnp.int32)
  for kk in range(top_k - 1):
    best_1W = jnp.max(jnp.where(avail_NW, scores_NW, NEG_INF), axis=0,
                      keepdims=True)
    # Lowest id among the maxima: lax.top_k's order, whatever the lowering's
    # own argmax tie rule.
    best_id_1W = jnp.min(
        jnp.where(avail_NW & (scores_NW == best_1W), ids_NW, big), axis=0,
        keepdims=True)
    taken_1W = jnp.where(best_1W > NEG_INF, best_id_1W, -1)
    sel_KW = jnp.where(slot_KW == kk, taken_1W, sel_KW)
    avail_NW = avail_NW & (ids_NW != best_id_1W)
  n_earlier_1W = jnp.minimum(local_1W, top_k - 1)
  sel_ref[...] = jnp.where(
      slot_KW < n_earlier_1W, sel_KW,
      jnp.where(slot_KW == n_earlier_1W, local_1W, -1)).astype(jnp.int32)


def _scores_call(offset_B, qi_BQI, ki_BSI, valid_BS, *, n_blocks_p: int,
                 block_size: int, groups: int, row_base: int, row_tile: int,
                 blocks_per_program: int, scale: float, precision,
                 interpret: bool, key_sub: int, num_stages: int,
                 num_warps: int = 4, causal_every_block: bool = False):
  b, q, ip = qi_BQI.shape
  nb = blocks_per_program
  span = nb * block_size
  n_key_chunks = ki_BSI.shape[1] // span
  # Programs past the keys are past every diagonal too: they only write
  # -inf, so they may reread the last chunk.
  key_chunk = lambda jj: jnp.minimum(jj, n_key_chunks - 1)
  kernel = functools.partial(_scores_kernel, block_size=block_size,
                             groups=groups, row_base=row_base, scale=scale,
                             precision=precision, key_sub=key_sub,
                             causal_every_block=causal_every_block)
  return kc.pallas_call(
      kernel,
      grid=(b, q // row_tile, n_blocks_p // nb),
      in_specs=[
          pl.BlockSpec((1,), lambda bb, ii, jj: (bb,)),
          pl.BlockSpec((None, row_tile, ip), lambda bb, ii, jj: (bb, ii, 0)),
          pl.BlockSpec((None, span, ip),
                       lambda bb, ii, jj: (bb, key_chunk(jj), 0)),
          pl.BlockSpec((None, span), lambda bb, ii, jj: (bb, key_chunk(jj))),
      ],
      out_specs=pl.BlockSpec((None, nb, row_tile),
                             lambda bb, ii, jj: (bb, jj, ii)),
      out_shape=jax.ShapeDtypeStruct((b, n_blocks_p, q), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                           num_stages=num_stages),
      interpret=interpret,
      name='msa_index_scores',
  )(offset_B, qi_BQI, ki_BSI, valid_BS)


def _topk_call(offset_B, scores_BNQ, *, block_size: int, groups: int,
               row_base: int, top_k: int, topk_rows: int, interpret: bool,
               real_rows: int | None = None):
  """Tiles of topk_rows rows up to real_rows (default: all q); the
  columns past them (padding rows) are left unwritten."""
  b, n_p, q = scores_BNQ.shape
  kp = kc.next_pow2(top_k)
  kernel = functools.partial(_topk_kernel, block_size=block_size,
                             groups=groups, row_base=row_base, top_k=top_k)
  return kc.pallas_call(
      kernel,
      grid=(b, -(-(q if real_rows is None else real_rows) // topk_rows)),
      in_specs=[
          pl.BlockSpec((1,), lambda bb, ii: (bb,)),
          pl.BlockSpec((None, n_p, topk_rows), lambda bb, ii: (bb, 0, ii)),
      ],
      out_specs=pl.BlockSpec((None, kp, topk_rows), lambda bb, ii: (bb, 0, ii)),
      out_shape=jax.ShapeDtypeStruct((b, kp, q), jnp.int32),
      compiler_params=plgpu.CompilerParams(
          num_warps=8 if n_p * topk_rows > 8192 else 4, num_stages=1),
      interpret=interpret,
      name='msa_index_topk',
  )(offset_B, scores_BNQ)


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value

# What Triton's own tl.dot asks of Hopper for 8-bit float operands: fast
# accumulation in the tensor core, never promoted to f32 mid-dot (its
# default on compute capability 9.0).
FP8_IMPRECISE_ACC = 2**30


class _Fp8DotsOnTensorCores:
  """jax's Triton dialect module, but an fp8 `tt.dot` that names no
  maxNumImpreciseAcc gets FP8_IMPRECISE_ACC.

  jax's Pallas lowering emits every dot without that attribute, and
  without it Triton (3.6) converts 8-bit operands to f16 and runs
  `mma.sync`: the fp8 score dots then ran slower than bf16 ones, never on
  fp8 tensor cores (experiments/gpu_static found it: HMMA, no HGMMA). With
  it they compile as Triton's own fp8 dots do, to warpgroup MMAs. Dots of
  other types pass through untouched.
  """

  def __init__(self, dialect):
    self._dialect = dialect

  def __getattr__(self, name):
    return getattr(self._dialect, name)

  def dot(self, a, b, c, *, max_num_imprecise_acc=None, **kwargs):
    from jax._src.lib.mlir import ir  # pylint: disable=g-import-not-at-top
    element = str(ir.RankedTensorType(a.type).element_type)
    if max_num_imprecise_acc is None and element.startswith('f8'):
      max_num_imprecise_acc = FP8_IMPRECISE_ACC
    return self._dialect.dot(a, b, c,
                             max_num_imprecise_acc=max_num_imprecise_acc,
                             **kwargs)


def fp8_dots_on_tensor_cores() -> bool:
  """Makes Pallas's Triton lowering give fp8 dots Triton's Hopper default
  (`_Fp8DotsOnTensorCores`), once per process; False where this jax's
  lowering is not laid out as expected (the dots then lower as before)."""
  try:
    from jax._src.pallas.triton import lowering  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  dialect = getattr(lowering, 'tt_dialect', None)
  if dialect is None or not hasattr(dialect, 'dot'):
    return False
  if not isinstance(dialect, _Fp8DotsOnTensorCores):
    lowering.tt_dialect = _Fp8DotsOnTensorCores(dialect)
  return True


def to_fp8(x, axis):
  """x as float8_e4m3fn, first scaled by a power of two (exact) per slice
  over `axis` so that its largest |x| is at most 448.

  For the index scores, a positive scale per query row leaves the row's
  block ranking as it is, and one scale over all of a sequence's keys
  (axis covering S and I) keeps every key's logit on one scale, so only
  e4m3's rounding (3 mantissa bits) can change a selection."""
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=True)
  safe = jnp.where(amax > 0, amax, 1.0)
  scale = jnp.exp2(jnp.floor(jnp.log2(FP8_MAX / safe)))
  return (x.astype(jnp.float32) * scale).astype(jnp.float8_e4m3fn)


def index_dtype(qi_dtype, ki_dtype):
  """bf16 dots when both index inputs are bf16, else f32."""
  both_bf16 = (jnp.dtype(qi_dtype) == jnp.bfloat16 and
               jnp.dtype(ki_dtype) == jnp.bfloat16)
  return jnp.bfloat16 if both_bf16 else jnp.float32


def score_tiling(dtype, block_size: int, row_tile: int):
  """(row_tile, key_sub, num_stages) of the score launch.

  bf16 takes the block's keys in one dot, pipelined. f32's dots are three
  TF32 passes, whose operands sit in shared memory as a high and a low
  half: at 128-row tiles and 128-key blocks that asked for 320 KiB on an
  H100 (227 KiB there), so f32 halves both and does not pipeline."""
  if jnp.dtype(dtype).itemsize <= 2:
    return row_tile, block_size, 2
  return min(row_tile, 64), min(block_size, 64), 1


def key_span(num_keys: int, block_size: int,
             blocks_per_program: int | None = None) -> int:
  """Keys one score program reads (its `blocks_per_program` blocks): the
  keys are padded to a multiple of it, so a decode cache whose length is
  one (`pallas_path.decode_cache_len`) is read in place, not copied."""
  n_p = kc.next_pow2(-(-num_keys // block_size))
  return min(blocks_per_program or max(1, 2048 // block_size), n_p) * block_size


def _score_dtype(qi_dtype, ki_dtype, fp8_scores: bool):
  """The score dots' operand dtype."""
  return (jnp.float8_e4m3fn if fp8_scores
          else index_dtype(qi_dtype, ki_dtype))


def _score_tile_rows(row_tile: int, rows: int) -> int:
  """Rows of a score tile (`row_tile` as score_tiling gives it), fewer for
  a short input; every row chunk is a multiple of it, and the top-k tile
  must divide it."""
  return min(row_tile, max(16, kc.next_pow2(rows)))


def _index_operands(qi_BTGI, ki_BSI, offset_B, kv_valid_BS, *,
                    block_size: int, interpret: bool, row_tile: int,
                    blocks_per_program: int | None, max_score_bytes: int,
                    fp8_scores: bool, min_rows: int = 16):
  """The score launch's operands and tiling: (qi_BQI, ki_BSI, valid_BS,
  offset_B, tiling), the index inputs cast (fp8: scaled, `to_fp8`) and
  padded to the tiles; a tile has at least min_rows rows."""
  b, t, g, di = qi_BTGI.shape
  s = ki_BSI.shape[1]
  dtype = _score_dtype(qi_BTGI.dtype, ki_BSI.dtype, fp8_scores)
  if fp8_scores:
    if kv_valid_BS is not None:
      # Padding keys are masked anyway; they must not set the keys' scale.
      ki_BSI = jnp.where(jnp.asarray(kv_valid_BS, bool)[..., None], ki_BSI,
                         jnp.zeros((), ki_BSI.dtype))
    qi_BTGI = to_fp8(qi_BTGI, axis=-1)
    ki_BSI = to_fp8(ki_BSI, axis=(1, 2))
    if not interpret:
      fp8_dots_on_tensor_cores()
  ip = max(16, kc.next_pow2(di))
  n_blocks = -(-s // block_size)
  n_p = kc.next_pow2(n_blocks)
  span = key_span(s, block_size, blocks_per_program)
  sp = kc.round_up(s, span)
  # Keys: padded only where the shape needs it (a decode cache whose length
  # is a multiple of the span is used in place, in its own dtype).
  ki = ki_BSI.astype(dtype)
  if sp != s or ip != di:
    ki = jnp.pad(ki, ((0, 0), (0, sp - s), (0, ip - di)))
  valid = (jnp.ones((b, s), jnp.int32) if kv_valid_BS is None
           else jnp.asarray(kv_valid_BS).astype(jnp.int32))
  valid = jnp.pad(valid, ((0, 0), (0, sp - s)))
  offset_B = jnp.broadcast_to(jnp.asarray(offset_B, jnp.int32), (b,))
  rows = t * g
  row_tile, key_sub, stages = score_tiling(dtype, block_size, row_tile)
  m = max(min_rows, _score_tile_rows(row_tile, rows))
  rp = kc.round_up(rows, m)
  qi = jnp.pad(qi_BTGI.astype(dtype).reshape(b, rows, di),
               ((0, 0), (0, rp - rows), (0, ip - di)))
  tiling = dict(
      dtype=dtype, n_p=n_p, nb=span // block_size, m=m,
      key_sub=key_sub, stages=stages,
      chunk=max(m, (max_score_bytes // (4 * n_p)) // m * m),
      scale=1.0 / math.sqrt(di))
  return qi, ki, valid, offset_B, tiling


def _key_sub(asked: int | None, default: int, block_size: int) -> int:
  """Keys per score dot: the default, or `asked` capped at the block."""
  if asked is None:
    return default
  if asked < 1 or block_size % min(asked, block_size):
    raise ValueError(f'key_sub must divide block_size={block_size}, got '
                     f'{asked}.')
  return min(asked, block_size)


def index_scores(qi_BTGI, ki_BSI, offset_B, kv_valid_BS=None, *,
                 block_size: int, interpret: bool, row_tile: int = 128,
                 blocks_per_program: int | None = None,
                 max_score_bytes: int = 2**28,
                 fp8_scores: bool = False, num_warps: int = 4,
                 key_sub: int | None = None,
                 num_stages: int | None = None,
                 causal_every_block: bool = False,
                 kernel: str = 'triton') -> list:
  """The first launch alone: per row chunk, the f32 block scores [B, Np,
  rows of the chunk] (rows are (token, group) pairs; -inf past a row's
  diagonal). Arguments as in select_blocks_BGTK; num_warps: the score
  launch's (4: one warpgroup per 128-row tile); key_sub: keys per dot
  (`score_tiling`'s by default: the whole block in 16-bit dtypes), fewer
  for smaller [rows, keys] f32 logits in registers; num_stages: Triton's
  (`score_tiling`'s by default), 1 for less shared memory;
  causal_every_block: the causal compare in every block, not only the
  diagonal ones (one loop body: fewer registers; the same scores).
  kernel: 'triton' (this module's launch) or 'mosaic' (index_mosaic.py:
  TMA and warpgroup MMAs on Hopper; bf16 inputs, tiles of at least 64
  rows; the Triton-only knobs above do not apply to it)."""
  if kernel not in ('triton', 'mosaic'):
    raise ValueError(f"kernel must be 'triton' or 'mosaic', got {kernel!r}.")
  mosaic = kernel == 'mosaic'
  if mosaic:
    # Imported here: jax's Mosaic GPU package costs every process that
    # imports this module (each training run) a quarter of a second.
    from pallas_kernels.msa import index_mosaic  # pylint: disable=g-import-not-at-top
  if mosaic and (fp8_scores
                 or index_dtype(qi_BTGI.dtype, ki_BSI.dtype) != jnp.bfloat16):
    raise ValueError(
        'the Mosaic score launch takes bf16 index inputs without '
        f'fp8_scores; got qi {qi_BTGI.dtype}, ki {ki_BSI.dtype}, '
        f'fp8_scores={fp8_scores}.')
  qi, ki, valid, offset_B, tl = _index_operands(
      qi_BTGI, ki_BSI, offset_B, kv_valid_BS, block_size=block_size,
      interpret=interpret, row_tile=row_tile,
      blocks_per_program=blocks_per_program,
      max_score_bytes=max_score_bytes, fp8_scores=fp8_scores,
      min_rows=index_mosaic.MIN_ROWS if mosaic else 16)
  if mosaic:
    # wgmma reads the keys as its [Ip, C] operand: transposed once here.
    ki_BIS = ki.transpose(0, 2, 1)
    bias_BS = jnp.where(valid > 0, 0.0, NEG_INF).astype(jnp.float32)
    return [index_mosaic.scores_call(
        offset_B, qi[:, r0:r0 + tl['chunk']], ki_BIS, bias_BS,
        n_blocks_p=tl['n_p'], block_size=block_size,
        groups=qi_BTGI.shape[2], row_base=r0, row_tile=tl['m'],
        blocks_per_program=tl['nb'], scale=tl['scale'],
        interpret=interpret)
            for r0 in range(0, qi.shape[1], tl['chunk'])]
  precision = kc.gpu_precision_for(tl['dtype'], interpret)
  return [_scores_call(offset_B, qi[:, r0:r0 + tl['chunk']], ki, valid,
                       n_blocks_p=tl['n_p'], block_size=block_size,
                       groups=qi_BTGI.shape[2], row_base=r0,
                       row_tile=tl['m'], blocks_per_program=tl['nb'],
                       scale=tl['scale'], precision=precision,
                       interpret=interpret,
                       key_sub=_key_sub(key_sub, tl['key_sub'], block_size),
                       num_stages=num_stages or tl['stages'],
                       num_warps=num_warps,
                       causal_every_block=causal_every_block)
          for r0 in range(0, qi.shape[1], tl['chunk'])]


def index_topk(scores: list, offset_B, *, t: int, groups: int,
               num_keys: int, block_size: int, top_k: int, interpret: bool,
               topk: str = 'pallas', topk_rows: int | None = None,
               row_tile: int = 128) -> jax.Array:
  """The second launch alone, on index_scores' chunks: the selection int32
  [B, G, T, K] (topk='xla': lax.top_k over the same scores). row_tile:
  the score launch's rows per tile (`score_tiling`'s: 64 in f32), which
  bounds the top-k tile's so that it divides every chunk."""
  b = scores[0].shape[0]
  n_p = scores[0].shape[1]
  n_blocks = -(-num_keys // block_size)
  rows = t * groups
  offset_B = jnp.broadcast_to(jnp.asarray(offset_B, jnp.int32), (b,))
  if topk == 'xla':
    parts = [sc[:, :n_blocks] for sc in scores]
    scores_BNQ = parts[0] if len(parts) == 1 else jnp.concatenate(parts, 2)
    scores_BGTN = scores_BNQ[:, :, :rows].reshape(
        b, n_blocks, t, groups).transpose(0, 3, 2, 1)
    return xla.select_blocks_BGTK(scores_BGTN, block_size=block_size,
                                  top_k=top_k, q_offset=offset_B)
  # The score tile's rows bound the top-k tile's (the tilings must agree);
  # a tile is no wider than the real rows (decode: G of the score tile's
  # 16), whose [N, w] scores a program holds in registers.
  w = min(topk_rows or max(8, min(128, kc.next_pow2(8192 // n_p))),
          _score_tile_rows(row_tile, rows), kc.next_pow2(rows))
  parts, r0 = [], 0
  for sc in scores:
    parts.append(_topk_call(offset_B, sc, block_size=block_size,
                            groups=groups, row_base=r0, top_k=top_k,
                            topk_rows=w, real_rows=min(sc.shape[2], rows - r0),
                            interpret=interpret))
    r0 += sc.shape[2]
  sel_BKQ = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=2)
  sel_BKTG = sel_BKQ[:, :top_k, :rows].reshape(b, top_k, t, groups)
  return sel_BKTG.transpose(0, 3, 2, 1)


def select_blocks_BGTK(qi_BTGI, ki_BSI, offset_B, kv_valid_BS=None, *,
                       block_size: int, top_k: int, interpret: bool,
                       row_tile: int = 128, blocks_per_program: int | None = None,
                       topk_rows: int | None = None,
                       max_score_bytes: int = 2**28,
                       topk: str = 'pallas',
                       fp8_scores: bool = False,
                       scores_kernel: str = 'triton') -> jax.Array:
  """Selection int32 [B, G, T, K] for queries at positions t + offset_B[b].

  Equal to reference.selection_BGTK up to the summation order of the index
  dots (bit for bit when those sums are exact).
  kv_valid_BS: bool [B, S], False at padding keys (None: all valid).
  row_tile, blocks_per_program, topk_rows: tile sizes (powers of two);
  max_score_bytes bounds one row chunk's f32 score buffer.
  topk: 'pallas' (the second launch above) or 'xla' (lax.top_k over the
  same scores, which has the same tie rule): in decode the Pallas top-k is
  a handful of programs, each 15 serial argmax rounds over every block,
  and XLA's may be faster there; the GPU bench times both.
  fp8_scores: the score dots in float8_e4m3fn (Hopper's fp8 tensor cores,
  twice bf16's rate), qi scaled per row and ki per sequence (`to_fp8`):
  an approximate selection, within the margin rule at eps_scale 2^-3
  (docs/design.md §6.8) rather than 2^-7; for prefill, since quantizing a
  decode cache every step would reread it.
  scores_kernel: the score launch's lowering, 'triton' or 'mosaic'
  (index_scores' `kernel`).
  The two launches are index_scores and index_topk (the GPU bench times
  them apart).
  """
  _, t, g, _ = qi_BTGI.shape
  if top_k < 1:
    raise ValueError(f'top_k must be >= 1, got {top_k}.')
  if topk not in ('pallas', 'xla'):
    raise ValueError(f"topk must be 'pallas' or 'xla', got {topk!r}.")
  scores = index_scores(qi_BTGI, ki_BSI, offset_B, kv_valid_BS,
                        block_size=block_size, interpret=interpret,
                        row_tile=row_tile,
                        blocks_per_program=blocks_per_program,
                        max_score_bytes=max_score_bytes,
                        fp8_scores=fp8_scores, kernel=scores_kernel)
  dtype = _score_dtype(qi_BTGI.dtype, ki_BSI.dtype, fp8_scores)
  return index_topk(scores, offset_B, t=t, groups=g,
                    num_keys=ki_BSI.shape[1], block_size=block_size,
                    top_k=top_k, interpret=interpret, topk=topk,
                    topk_rows=topk_rows,
                    row_tile=score_tiling(dtype, block_size, row_tile)[0])
