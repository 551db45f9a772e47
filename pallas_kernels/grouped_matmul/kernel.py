"""Grouped matmul over row tiles of one group each: the Pallas Triton kernels.

The MoE layer's expert compute multiplies each received row by its slot's
expert matrix. grouped_swiglu groups the rows into tiles of t rows, one
slot per tile, tiles in slot order (slot_n); src_nt names the row each
tile slot holds. On a GPU the alternatives are poor: XLA compiles
`jax.lax.ragged_dot` as dense GEMMs over every group (s x the work), and a
loop over tiles is a few launches per tile. Here each matmul is one
launch:

  grouped_matmul y[i] = a[i] @ w[slot_n[i]] for tiles i < num_used (the
                rest zero): a program per (tile, column block), f32
                accumulation over K blocks, output in a's dtype. a is
                tiles [n, t, K], or the rows themselves [R, K], each
                tile's gathered by src_nt as the kernel reads them; the
                output is tiles, or rows [R', N] scattered by src_nt as
                the kernel writes them (rows no tile holds: zero). So the
                layer never copies its rows into tiles and back.
  slot_matmul_t dw[s] = sum of a[i]^T @ b[i] over slot s's tiles
                (i < num_used), in f32, either operand tiles or rows: a
                program per (slot, row block, column block) walking its
                slot's tiles, which are contiguous.

`grouped_matmul` carries a custom VJP built from the two: da =
grouped_matmul(dy, w^T) from dy's layout to a's (w read transposed in the
kernel, never copied), dw = slot_matmul_t(a, dy) rounded once to w's dtype
as the kernel writes it. w may be stored wider than a (a float32 master):
blocks are cast to a's dtype in the kernel. f32 operands multiply in three
TF32 passes (f32-level error; the MSA kernels' rule,
kernel_common.gpu_precision_for). Compiled for anything
but a CUDA GPU the same calls run their jnp references (reference.py, the
spec); the kernels run in interpret mode only when asked (tests).

Shape letters: n tiles, t rows per tile, K contraction dim, N output dim,
s slots, R rows.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.grouped_matmul import reference
from pallas_kernels.msa import kernel_common as kc


def _block(dim: int, most: int) -> int:
  """The largest power of two <= most that divides dim (dims are powers
  of two times small factors: 2048, 768)."""
  b = most
  while b > 1 and dim % b:
    b //= 2
  return b


def _check_gpu_dot(t: int, k: int, big_n: int):
  """A Triton dot needs 16 along each dim: its rows (the tile) and the
  power-of-two blocks of K and N."""
  dims = dict(rows=t, k=_block(k, 64), n=_block(big_n, 128))
  small = {k: v for k, v in dims.items() if v < 16}
  if small:
    raise ValueError(
        f'the GPU grouped matmul needs tiles of at least 16 rows and K, N '
        f'with a power-of-two factor of at least 16 (a Triton dot); got '
        f'blocks {small}. Use a larger tile or grouped GEMM kind '
        f"'ragged_dot'.")


def _tile_rows(src_ref, i, num_rows: int, part=slice(None)):
  """Tile i's rows (clamped into range) and which of them are real (of
  its slots `part`)."""
  src_t = src_ref[i, part]
  return jnp.minimum(src_t, num_rows - 1), src_t < num_rows


def _read(ref, i, rows, ok, col0, width: int, as_rows: bool):
  """Tile i's [t, width] block at columns col0: from tiles (a tile's own
  block ref) or gathered from rows (the whole [R, X] ref; rows that are
  not real read zero)."""
  if not as_rows:
    return ref[:, pl.ds(col0, width)]
  cols = col0 + jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
  x = ref[rows[:, None], cols]
  return jnp.where(ok[:, None], x, jnp.zeros((), x.dtype))


def _mm_kernel(used_ref, slot_ref, src_ref, a_ref, w_ref, *refs,
               block_k: int, precision, transpose_w: bool, a_rows: bool,
               y_rows: bool, accumulate: bool):
  y_ref = refs[-1]  # (the aliased buffer it starts from before it: rows)
  i, j = pl.program_id(0), pl.program_id(1)
  k = w_ref.shape[2] if transpose_w else w_ref.shape[1]
  bn = w_ref.shape[1] if transpose_w else w_ref.shape[2]
  slot = slot_ref[i]
  live = i < used_ref[0]
  a_r = a_ok = None
  if a_rows:
    a_r, a_ok = _tile_rows(src_ref, i, a_ref.shape[0])
  # w's block is [k, bn], or [bn, k] read as its transpose (a Triton dot
  # takes a transposed operand as it is: no copy of w^T anywhere).
  contract = 1 if transpose_w else 0

  def step(kk, acc_tN):
    at = pl.ds(kk * block_k, block_k)
    x_tk = _read(a_ref, i, a_r, a_ok, kk * block_k, block_k, a_rows)
    w_blk = (w_ref[slot, :, at] if transpose_w else
             w_ref[slot, at, :]).astype(x_tk.dtype)
    return acc_tN + jax.lax.dot_general(
        x_tk, w_blk, (((1,), (contract,)), ((), ())), precision=precision,
        preferred_element_type=jnp.float32)

  # A tile past num_used runs no step: it writes zeros (tiles), nothing
  # (rows: the zero buffer stays).
  steps = jnp.where(live, jnp.int32(k // block_k), jnp.int32(0))
  t = src_ref.shape[1]
  acc = jax.lax.fori_loop(jnp.int32(0), steps, step,
                          jnp.zeros((t, bn), jnp.float32))
  if not y_rows:
    y_ref[...] = acc.astype(y_ref.dtype)
    return
  y_r, y_ok = _tile_rows(src_ref, i, y_ref.shape[0])
  cols = j * bn + jax.lax.broadcasted_iota(jnp.int32, (1, bn), 1)
  ok = y_ok & live
  if accumulate:
    # Each row is in one tile slot, each column block in one program: the
    # read-add-write of a row block races with no other program.
    acc = acc + _read(y_ref, i, y_r, ok, j * bn, bn, True).astype(
        jnp.float32)
  # Lanes that write nothing point past the last row: a GPU's masked store
  # never touches them, and jax's interpreter (which stores a masked
  # scatter as a read-modify-write of every lane) drops them, where a lane
  # clamped onto a live row of this tile could restore that row's old
  # value. So one store serves both, and interpret mode runs the GPU's.
  y_r = jnp.where(ok, y_r, y_ref.shape[0])
  plgpu.store(y_ref.at[y_r[:, None], cols], acc.astype(y_ref.dtype),
              mask=ok[:, None])


def _matmul(a, w, src_nt, slot_n, used_1, init=None, *, interpret: bool,
            a_rows: bool = False, out_rows: int | None = None,
            transpose_w: bool = False):
  """The launch behind grouped_matmul (same arguments). init: for rows
  out, the [out_rows, N] buffer to add the products to (None: zeros)."""
  n = slot_n.shape[0]
  t = _tile_size(a, src_nt)
  k = a.shape[-1]
  s = w.shape[0]
  big_n = w.shape[1] if transpose_w else w.shape[2]
  bn = _block(big_n, 128)
  bk = _block(k, 64)
  if src_nt is None:
    src_nt = jnp.zeros((n, t), jnp.int32)  # unread (tiles in and out)
  w_spec = (pl.BlockSpec((s, bn, k), lambda i, j: (0, j, 0)) if transpose_w
            else pl.BlockSpec((s, k, bn), lambda i, j: (0, 0, j)))
  a_spec = (pl.BlockSpec(a.shape, lambda i, j: (0, 0)) if a_rows
            else pl.BlockSpec((None, t, k), lambda i, j: (i, 0, 0)))
  specs = [pl.BlockSpec((1,), lambda i, j: (0,)),
           pl.BlockSpec((n,), lambda i, j: (0,)),
           pl.BlockSpec((n, t), lambda i, j: (0, 0)), a_spec, w_spec]
  args = [used_1, slot_n, src_nt, a, w]
  aliases = {}
  if out_rows is None:
    out_spec = pl.BlockSpec((None, t, bn), lambda i, j: (i, 0, j))
    out_shape = (n, t, big_n)
  else:
    # Every program writes its own rows; the rows no tile holds keep this
    # buffer's zeros.
    out_shape = (out_rows, big_n)
    out_spec = pl.BlockSpec(out_shape, lambda i, j: (0, 0))
    specs.append(out_spec)
    args.append(jnp.zeros(out_shape, a.dtype) if init is None else init)
    aliases = {len(args) - 1: 0}
  return kc.pallas_call(
      functools.partial(_mm_kernel, block_k=bk, transpose_w=transpose_w,
                        a_rows=a_rows, y_rows=out_rows is not None,
                        accumulate=init is not None,
                        precision=kc.gpu_precision_for(a.dtype, interpret)),
      grid=(n, big_n // bn),
      in_specs=specs,
      out_specs=out_spec,
      out_shape=jax.ShapeDtypeStruct(out_shape, a.dtype),
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(
          num_warps=8 if t * bn >= 128 * 128 else 4, num_stages=3),
      interpret=interpret,
      name='grouped_tile_matmul_t' if transpose_w else 'grouped_tile_matmul',
  )(*args)


def _slot_t_kernel(first_ref, count_ref, src_ref, a_ref, b_ref, dw_ref, *,
                   precision, a_rows: bool, b_rows: bool, part_rows: int):
  s, kk, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bk, bn = dw_ref.shape
  t = src_ref.shape[1]

  def tile(ii, acc_kN):
    i = first_ref[s] + ii
    # A tile's rows part_rows at a time (fewer registers for f32 rows).
    for p0 in range(0, t, part_rows):
      part = pl.ds(p0, part_rows)
      if a_rows:
        a_r, a_ok = _tile_rows(src_ref, i, a_ref.shape[0], part)
        a_tk = _read(a_ref, i, a_r, a_ok, kk * bk, bk, True)
      else:
        a_tk = a_ref[i, part, :]
      if b_rows:
        b_r, b_ok = _tile_rows(src_ref, i, b_ref.shape[0], part)
        b_tN = _read(b_ref, i, b_r, b_ok, j * bn, bn, True)
      else:
        b_tN = b_ref[i, part, :]
      acc_kN = acc_kN + jnp.dot(a_tk.T, b_tN, precision=precision,
                                preferred_element_type=jnp.float32)
    return acc_kN

  dw_ref[...] = jax.lax.fori_loop(
      jnp.int32(0), count_ref[s], tile,
      jnp.zeros((bk, bn), jnp.float32)).astype(dw_ref.dtype)


def slot_matmul_t(a, b, slot_n, used_1, num_slots: int, *,
                  interpret: bool, out_dtype=jnp.float32, src_nt=None,
                  a_rows: bool = False, b_rows: bool = False):
  """dw [s, K, N]: sum over slot s's tiles i < num_used of a[i]^T @ b[i],
  in f32, rounded once to out_dtype as it is written. Tiles are in slot
  order (slot_n non-decreasing). a ([n, t, K]) and b ([n, t, N]) are tiles,
  or rows ([R, K], [R, N]: a_rows, b_rows) read through src_nt."""
  n = slot_n.shape[0]
  t = _tile_size(a, src_nt)
  k, big_n = a.shape[-1], b.shape[-1]
  if src_nt is None:
    src_nt = jnp.zeros((n, t), jnp.int32)
  live_n = jnp.arange(n) < used_1[0]
  count_s = jnp.zeros((num_slots,), jnp.int32).at[slot_n].add(
      live_n.astype(jnp.int32))
  first_s = (jnp.cumsum(count_s) - count_s).astype(jnp.int32)
  # f32 operands: [t, bk] and [t, bn] blocks of twice the bytes, and
  # three stages of them, overflow an H100's shared memory at bn = 128
  # (experiments/gpu_static).
  f32 = jnp.dtype(a.dtype).itemsize > 2
  bk, bn = _block(k, 64), _block(big_n, 64 if f32 else 128)
  # f32 tiles, a whole tile at once, spill registers on an H100: half a
  # tile at a time.
  part_rows = t // 2 if f32 and t >= 32 else t
  whole = lambda x: pl.BlockSpec(x.shape, lambda s, kk, j: (0, 0))
  return kc.pallas_call(
      functools.partial(_slot_t_kernel, a_rows=a_rows, b_rows=b_rows,
                        part_rows=part_rows,
                        precision=kc.gpu_precision_for(a.dtype, interpret)),
      grid=(num_slots, k // bk, big_n // bn),
      in_specs=[
          pl.BlockSpec((num_slots,), lambda s, kk, j: (0,)),
          pl.BlockSpec((num_slots,), lambda s, kk, j: (0,)),
          pl.BlockSpec((n, t), lambda s, kk, j: (0, 0)),
          whole(a) if a_rows else
          pl.BlockSpec((n, t, bk), lambda s, kk, j: (0, 0, kk)),
          whole(b) if b_rows else
          pl.BlockSpec((n, t, bn), lambda s, kk, j: (0, 0, j)),
      ],
      out_specs=pl.BlockSpec((None, bk, bn), lambda s, kk, j: (s, kk, j)),
      out_shape=jax.ShapeDtypeStruct((num_slots, k, big_n), out_dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
      interpret=interpret,
      name='grouped_slot_matmul_t',
  )(first_s, count_s, src_nt, a, b)


def _by_platform(kernel, spec, *args, interpret, dims):
  """kernel(*args, interpret=...) as asked, or (None) by the platform the
  computation is compiled for: the Triton kernel for a CUDA GPU (so a
  compile for a GPU from a CPU host gets the kernel), elsewhere `spec`,
  the jnp reference. dims: (t, K, N) of the dot, checked for Triton.
  Interpret mode is for tests: inside a shard_map that checks varying
  axes (the expert-parallel layer's) jax's interpreter refuses a kernel's
  ref indexing."""
  # Compiled for a GPU (asked for, or running on one), shapes a Triton dot
  # cannot take are refused here, not deep in Triton. Both branches of
  # platform_dependent are traced, so on a CPU they pass.
  if interpret is False or (interpret is None
                            and jax.default_backend() == 'gpu'):
    _check_gpu_dot(*dims)
  if interpret is not None:
    return kernel(*args, interpret=interpret)
  return jax.lax.platform_dependent(
      *args, cuda=functools.partial(kernel, interpret=False), default=spec)


def _tile_size(a, src_nt) -> int:
  return src_nt.shape[1] if src_nt is not None else a.shape[1]


def _mm(a, w, src_nt, slot_n, used_1, init=None, *, interpret, **kw):
  """One grouped matmul launch (no VJP of its own), by `_by_platform`;
  kw: `_matmul`'s layout arguments."""
  big_n = w.shape[1] if kw.get('transpose_w') else w.shape[2]
  return _by_platform(functools.partial(_matmul, **kw),
                      functools.partial(reference.grouped_matmul, **kw),
                      a, w, src_nt, slot_n, used_1, init,
                      interpret=interpret,
                      dims=(_tile_size(a, src_nt), a.shape[-1], big_n))


def _slot_t(a, b, src_nt, slot_n, used_1, *, interpret, **kw):
  """One weight-gradient launch, by `_by_platform`; kw: slot_matmul_t's."""
  kw = dict(kw, src_nt=src_nt)
  return _by_platform(
      lambda a_, b_, sl, u, interpret: slot_matmul_t(
          a_, b_, sl, u, interpret=interpret, **kw),
      lambda a_, b_, sl, u: reference.slot_matmul_t(a_, b_, sl, u, **kw),
      a, b, slot_n, used_1, interpret=interpret,
      dims=(_tile_size(a, src_nt), a.shape[-1], b.shape[-1]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def grouped_matmul(a, w, src_nt, slot_n, used_1, a_rows: bool = False,
                   out_rows: int | None = None,
                   interpret: bool | None = None):
  """y[i] = a[i] @ w[slot_n[i]] (f32 sums, in a's dtype) for tiles i <
  used_1[0], zeros past them. a: tiles [n, t, K], or rows [R, K] read
  through src_nt [n, t] (a_rows; R or more: no row); y: tiles [n, t, N],
  or rows [out_rows, N] written through src_nt (rows no live tile holds:
  zero). used_1: int32 [1]. interpret: None, by the platform compiled for
  (`_by_platform`)."""
  return _mm(a, w, src_nt, slot_n, used_1, a_rows=a_rows, out_rows=out_rows,
             interpret=interpret)


def _grouped_matmul_fwd(a, w, src_nt, slot_n, used_1, a_rows, out_rows,
                        interpret):
  return (grouped_matmul(a, w, src_nt, slot_n, used_1, a_rows, out_rows,
                         interpret),
          (a, w, src_nt, slot_n, used_1))


def _grouped_matmul_bwd(a_rows, out_rows, interpret, res, dy):
  a, w, src_nt, slot_n, used_1 = res
  y_rows = out_rows is not None
  at = dict(src_nt=src_nt, slot_n=slot_n, used_1=used_1,
            interpret=interpret)
  # dy in y's layout, da in a's.
  da = _mm(dy, w, a_rows=y_rows, out_rows=a.shape[0] if a_rows else None,
           transpose_w=True, **at)
  dw = _slot_t(a, dy, num_slots=w.shape[0], out_dtype=w.dtype,
               a_rows=a_rows, b_rows=y_rows, **at)
  return da, dw, None, None, None


grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def tile_matmul(x_ntK, w_sKN, slot_n, used_1, interpret: bool | None = None):
  """grouped_matmul of tiles to tiles: y [n, t, N] in x's dtype, y[i] =
  x[i] @ w[slot_n[i]] for tiles i < used_1[0]; zeros past them."""
  return grouped_matmul(x_ntK, w_sKN, None, slot_n, used_1, False, None,
                        interpret)


# --------------------------------------------------------------- SwiGLU


def _swiglu_forward(x_RM, wg_sMF, wu_sMF, wd_sFM, src_nt, slot_n, used_1,
                    interpret):
  mm = functools.partial(_mm, src_nt=src_nt, slot_n=slot_n, used_1=used_1,
                         interpret=interpret)
  g_ntF = mm(x_RM, wg_sMF, a_rows=True)
  u_ntF = mm(x_RM, wu_sMF, a_rows=True)
  h_ntF = jax.nn.silu(g_ntF) * u_ntF
  return mm(h_ntF, wd_sFM, out_rows=x_RM.shape[0]), (g_ntF, u_ntF)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def swiglu(x_RM, wg_sMF, wu_sMF, wd_sFM, src_nt, slot_n, used_1,
           interpret: bool | None = None):
  """y_RM = (silu(x wg) * (x wu)) wd, each row through the slot of the
  tile slot that holds it (src_nt [n, t]; tiles i < used_1[0]); rows no
  live tile holds are zero. Rows in and rows out: the kernels gather and
  scatter them as they read and write, so the layer makes no tile copy of
  its rows, forward or backward.

  Launches: forward 3 matmuls; backward dh, dx (two launches into one
  buffer: the second adds its product) and 3 weight gradients. f32 sums,
  outputs in x's dtype, weight gradients in the weights' dtype."""
  return _swiglu_forward(x_RM, wg_sMF, wu_sMF, wd_sFM, src_nt, slot_n,
                         used_1, interpret)[0]


def _swiglu_fwd(x_RM, wg_sMF, wu_sMF, wd_sFM, src_nt, slot_n, used_1,
                interpret):
  y, (g, u) = _swiglu_forward(x_RM, wg_sMF, wu_sMF, wd_sFM, src_nt, slot_n,
                              used_1, interpret)
  return y, (x_RM, wg_sMF, wu_sMF, wd_sFM, src_nt, slot_n, used_1, g, u)


def _swiglu_bwd(interpret, res, dy_RM):
  x_RM, wg_sMF, wu_sMF, wd_sFM, src_nt, slot_n, used_1, g_ntF, u_ntF = res
  num_rows, s = x_RM.shape[0], wg_sMF.shape[0]
  at = dict(src_nt=src_nt, slot_n=slot_n, used_1=used_1,
            interpret=interpret)
  dt = x_RM.dtype
  # dh = dy wd^T, the output rows gathered into their tiles.
  dh = _mm(dy_RM, wd_sFM, a_rows=True, transpose_w=True, **at)
  g, u = g_ntF.astype(jnp.float32), u_ntF.astype(jnp.float32)
  sig = jax.nn.sigmoid(g)
  silu_g = g * sig
  dh32 = dh.astype(jnp.float32)
  dg = (dh32 * u * sig * (1 + g * (1 - sig))).astype(dt)
  du = (dh32 * silu_g).astype(dt)
  h = (silu_g * u).astype(dt)  # as the forward rounded it
  dwd = _slot_t(h, dy_RM, b_rows=True, num_slots=s, out_dtype=wd_sFM.dtype,
                **at)
  dx = _mm(dg, wg_sMF, out_rows=num_rows, transpose_w=True, **at)
  dx = _mm(du, wu_sMF, init=dx, out_rows=num_rows, transpose_w=True, **at)
  dwg = _slot_t(x_RM, dg, a_rows=True, num_slots=s, out_dtype=wg_sMF.dtype,
                **at)
  dwu = _slot_t(x_RM, du, a_rows=True, num_slots=s, out_dtype=wu_sMF.dtype,
                **at)
  return dx, dwg, dwu, dwd, None, None, None


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
