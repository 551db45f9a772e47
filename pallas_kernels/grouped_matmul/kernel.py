"""Grouped matmul over row tiles of one group each: the Pallas Triton kernels.

The MoE layer's expert compute multiplies each received row by its slot's
expert matrix. grouped_swiglu lays the rows out in tiles of t rows, one
slot per tile, tiles in slot order (x_ntK, slot_n). On a GPU the
alternatives are poor: XLA compiles `jax.lax.ragged_dot` as dense GEMMs
over every group (s x the work), and a loop over tiles is a few launches
per tile. Here each matmul is one launch:

  tile_matmul   y[i] = x[i] @ w[slot_n[i]] for tiles i < num_used (the rest
                zero): a program per (tile, column block), f32
                accumulation over K blocks, output in x's dtype.
  slot_matmul_t dw[s] = sum of x[i]^T @ dy[i] over slot s's tiles
                (i < num_used), in f32: a program per (slot, row block,
                column block) walking its slot's tiles, which are
                contiguous.

`tile_matmul` carries a custom VJP built from the two: dx = tile_matmul(dy,
w^T) (w read transposed in the kernel, never copied), dw = slot_matmul_t(x,
dy) rounded once to w's dtype as the kernel writes it. w may be stored
wider than x (a float32 master): blocks are cast to x's dtype in the
kernel. f32 operands multiply in three TF32 passes (f32-level error; the
MSA kernels' rule, kernel_common.gpu_precision_for). Compiled for anything
but a CUDA GPU the same calls run their jnp references (reference.py, the
spec); the kernels run in interpret mode only when asked (tests).

Shape letters: n tiles, t rows per tile, K contraction dim, N output dim,
s slots.
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


def _check_gpu_dot(a_ntK, b_sKN):
  """A Triton dot needs 16 along each dim: its rows (the tile) and the
  power-of-two blocks of K and N (the last two dims of b)."""
  dims = dict(rows=a_ntK.shape[1], k=_block(b_sKN.shape[-2], 64),
              n=_block(b_sKN.shape[-1], 128))
  small = {k: v for k, v in dims.items() if v < 16}
  if small:
    raise ValueError(
        f'the GPU grouped matmul needs tiles of at least 16 rows and K, N '
        f'with a power-of-two factor of at least 16 (a Triton dot); got '
        f'blocks {small}. Use a larger tile or grouped GEMM kind '
        f"'ragged_dot'.")


def _tile_kernel(used_ref, slot_ref, x_ref, w_ref, y_ref, *, block_k: int,
                 precision, transpose_w: bool):
  i = pl.program_id(0)
  t, k = x_ref.shape
  bn = y_ref.shape[1]
  slot = slot_ref[i]
  # w's block is [k, bn], or [bn, k] read as its transpose (a Triton dot
  # takes a transposed operand as it is: no copy of w^T anywhere).
  contract = 1 if transpose_w else 0

  def step(kk, acc_tN):
    at = pl.ds(kk * block_k, block_k)
    x_tk = x_ref[:, at]
    w_blk = (w_ref[slot, :, at] if transpose_w else
             w_ref[slot, at, :]).astype(x_tk.dtype)
    return acc_tN + jax.lax.dot_general(
        x_tk, w_blk, (((1,), (contract,)), ((), ())), precision=precision,
        preferred_element_type=jnp.float32)

  live = i < used_ref[0]
  # A tile past num_used runs no step: it writes zeros.
  steps = jnp.where(live, jnp.int32(k // block_k), jnp.int32(0))
  acc = jax.lax.fori_loop(jnp.int32(0), steps, step,
                          jnp.zeros((t, bn), jnp.float32))
  y_ref[...] = acc.astype(y_ref.dtype)


def _tile_matmul(x_ntK, w, slot_n, used_1, *, interpret: bool,
                 transpose_w: bool = False):
  """y[i] = x[i] @ w[slot_n[i]]; w [s, K, N], or with transpose_w [s, N, K]
  multiplied as its transpose (the VJP's dx against the forward's w)."""
  n, t, k = x_ntK.shape
  s = w.shape[0]
  big_n = w.shape[1] if transpose_w else w.shape[2]
  bn = _block(big_n, 128)
  bk = _block(k, 64)
  w_spec = (pl.BlockSpec((s, bn, k), lambda i, j: (0, j, 0)) if transpose_w
            else pl.BlockSpec((s, k, bn), lambda i, j: (0, 0, j)))
  return kc.pallas_call(
      functools.partial(_tile_kernel, block_k=bk, transpose_w=transpose_w,
                        precision=kc.gpu_precision_for(x_ntK.dtype,
                                                       interpret)),
      grid=(n, big_n // bn),
      in_specs=[
          pl.BlockSpec((1,), lambda i, j: (0,)),
          pl.BlockSpec((n,), lambda i, j: (0,)),
          pl.BlockSpec((None, t, k), lambda i, j: (i, 0, 0)),
          w_spec,
      ],
      out_specs=pl.BlockSpec((None, t, bn), lambda i, j: (i, 0, j)),
      out_shape=jax.ShapeDtypeStruct((n, t, big_n), x_ntK.dtype),
      compiler_params=plgpu.CompilerParams(
          num_warps=8 if t * bn >= 128 * 128 else 4, num_stages=3),
      interpret=interpret,
      name='grouped_tile_matmul_t' if transpose_w else 'grouped_tile_matmul',
  )(used_1, slot_n, x_ntK, w)


def _slot_t_kernel(first_ref, count_ref, a_ref, b_ref, dw_ref, *,
                   precision):
  s = pl.program_id(0)
  bk, bn = dw_ref.shape

  def tile(ii, acc_kN):
    i = first_ref[s] + ii
    return acc_kN + jnp.dot(a_ref[i].T, b_ref[i], precision=precision,
                            preferred_element_type=jnp.float32)

  dw_ref[...] = jax.lax.fori_loop(
      jnp.int32(0), count_ref[s], tile,
      jnp.zeros((bk, bn), jnp.float32)).astype(dw_ref.dtype)


def slot_matmul_t(a_ntK, b_ntN, slot_n, used_1, num_slots: int, *,
                  interpret: bool, out_dtype=jnp.float32):
  """dw [s, K, N]: sum over slot s's tiles i < num_used of a[i]^T @ b[i],
  in f32, rounded once to out_dtype as it is written. Tiles are in slot
  order (slot_n non-decreasing)."""
  n, t, k = a_ntK.shape
  big_n = b_ntN.shape[2]
  live_n = jnp.arange(n) < used_1[0]
  count_s = jnp.zeros((num_slots,), jnp.int32).at[slot_n].add(
      live_n.astype(jnp.int32))
  first_s = (jnp.cumsum(count_s) - count_s).astype(jnp.int32)
  bk, bn = _block(k, 64), _block(big_n, 128)
  return kc.pallas_call(
      functools.partial(_slot_t_kernel,
                        precision=kc.gpu_precision_for(a_ntK.dtype, interpret)),
      grid=(num_slots, k // bk, big_n // bn),
      in_specs=[
          pl.BlockSpec((num_slots,), lambda s, kk, j: (0,)),
          pl.BlockSpec((num_slots,), lambda s, kk, j: (0,)),
          pl.BlockSpec((n, t, bk), lambda s, kk, j: (0, 0, kk)),
          pl.BlockSpec((n, t, bn), lambda s, kk, j: (0, 0, j)),
      ],
      out_specs=pl.BlockSpec((None, bk, bn), lambda s, kk, j: (s, kk, j)),
      out_shape=jax.ShapeDtypeStruct((num_slots, k, big_n), out_dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
      interpret=interpret,
      name='grouped_slot_matmul_t',
  )(first_s, count_s, a_ntK, b_ntN)


def _by_platform(kernel, spec, *args, interpret):
  """kernel(*args, interpret=...) as asked, or (None) by the platform the
  computation is compiled for: the Triton kernel for a CUDA GPU (so a
  compile for a GPU from a CPU host gets the kernel), elsewhere `spec`,
  the jnp reference.
  Interpret mode is for tests: inside a shard_map that checks varying
  axes (the expert-parallel layer's) jax's interpreter refuses a kernel's
  ref indexing."""
  # Compiled for a GPU (asked for, or running on one), shapes a Triton dot
  # cannot take are refused here, not deep in Triton. Both branches of
  # platform_dependent are traced, so on a CPU they pass.
  if interpret is False or (interpret is None
                            and jax.default_backend() == 'gpu'):
    _check_gpu_dot(args[0], args[1])
  if interpret is not None:
    return kernel(*args, interpret=interpret)
  return jax.lax.platform_dependent(
      *args, cuda=functools.partial(kernel, interpret=False), default=spec)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def tile_matmul(x_ntK, w_sKN, slot_n, used_1, interpret: bool | None = None):
  """y [n, t, N] in x's dtype: y[i] = x[i] @ w[slot_n[i]] (f32 sums) for
  tiles i < used_1[0]; zeros past them. used_1: int32 [1]. interpret:
  None, by the platform compiled for (`_by_platform`)."""
  return _by_platform(_tile_matmul, reference.tile_matmul, x_ntK, w_sKN,
                      slot_n, used_1, interpret=interpret)


def _tile_matmul_fwd(x_ntK, w_sKN, slot_n, used_1, interpret):
  return (tile_matmul(x_ntK, w_sKN, slot_n, used_1, interpret),
          (x_ntK, w_sKN, slot_n, used_1))


def _tile_matmul_bwd(interpret, res, dy_ntN):
  x_ntK, w_sKN, slot_n, used_1 = res
  s = w_sKN.shape[0]
  dx = _by_platform(functools.partial(_tile_matmul, transpose_w=True),
                    functools.partial(reference.tile_matmul,
                                      transpose_w=True),
                    dy_ntN, w_sKN, slot_n, used_1, interpret=interpret)
  dw = _by_platform(
      functools.partial(slot_matmul_t, num_slots=s, out_dtype=w_sKN.dtype),
      functools.partial(reference.slot_matmul_t, num_slots=s,
                        out_dtype=w_sKN.dtype),
      x_ntK, dy_ntN, slot_n, used_1, interpret=interpret)
  return dx, dw, None, None


tile_matmul.defvjp(_tile_matmul_fwd, _tile_matmul_bwd)
