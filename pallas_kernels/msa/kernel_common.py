"""Helpers shared by the MSA Pallas kernels (TPU and GPU lowerings).

Letter key: X rows of a score tile (query tokens on TPU, heads on GPU),
C keys of a block, D head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

# Finite stand-in for -inf: keeps exp() NaN-free on rows that have not met a
# visible key yet (the convention of jax's own flash kernels).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def _varying(x) -> frozenset:
  aval = jax.typeof(x)
  vma = getattr(aval, 'vma', None)
  if vma is None:
    mat = getattr(aval, 'manual_axis_type', None)
    vma = () if mat is None else mat.varying
  return frozenset(vma)


def like_inputs(init, *refs):
  """`init` (a pytree of fresh buffers) marked as varying over the mesh
  axes the `refs` vary over, so that a loop's carry keeps one type when
  these kernels run per device inside a shard_map (outside one: as is)."""
  axes = frozenset().union(*(_varying(r) for r in jax.tree.leaves(refs)))
  if not axes:
    return init

  def vary(x):
    todo = tuple(sorted(axes - _varying(x)))
    return jax.lax.pcast(x, todo, to='varying') if todo else x
  return jax.tree.map(vary, init)


def pallas_call(kernel, *, out_shape, **kwargs):
  """`pl.pallas_call` whose outputs vary over the mesh axes its operands
  vary over.

  Run per device inside a shard_map that checks varying axes (the RL
  step's), a kernel's outputs must say how they vary, and a plain
  ShapeDtypeStruct says nothing (jax refuses to trace it). A kernel's
  outputs are per device exactly when some operand is. Outside a shard_map
  the type is ignored: this is `pl.pallas_call` as is.
  """
  def call(*args):
    axes = frozenset().union(*(_varying(a) for a in jax.tree.leaves(args)))
    kind = jax.sharding.ManualAxisType(varying=axes)
    typed = jax.tree.map(lambda s: jax.ShapeDtypeStruct(
        s.shape, s.dtype, manual_axis_type=kind), out_shape)
    return pl.pallas_call(kernel, out_shape=typed, **kwargs)(
        *like_inputs(args, args))
  return call


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def next_pow2(x: int) -> int:
  return 1 << max(0, int(x) - 1).bit_length()


def div(x, d: int):
  """x // d for non-negative int32 positions.

  `//` lowers through sign(), which Mosaic refuses to lower without a TPU
  attached; positions are never negative, so truncation is floor.
  """
  return jax.lax.div(x, jnp.asarray(d, jnp.int32))


def precision_for(dtype):
  # f32 operands on the TPU MXU default to bf16 passes; the f32 tests need
  # the exact product. bf16 operands are exact at the default.
  return (jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32
          else jax.lax.Precision.DEFAULT)


def gpu_precision_for(dtype, interpret: bool):
  """Dot precision of the Triton kernels.

  On the GPU, HIGHEST lowers f32 dots to Triton's IEEE mode: FMA loops
  without tensor cores, which at D = block = 128 made the unrolled backward
  kernel take minutes to compile on an H100. Three TF32 passes (tf32x3) run
  on tensor cores with f32-level error. Interpret mode (CPU) cannot run that
  algorithm, so it keeps HIGHEST.
  """
  if jnp.dtype(dtype) != jnp.float32:
    return jax.lax.Precision.DEFAULT
  if interpret:
    return jax.lax.Precision.HIGHEST
  return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def dot_nt(a_XD, b_CD, precision):
  """a @ b.T with f32 accumulation."""
  return jax.lax.dot_general(a_XD, b_CD, (((1,), (1,)), ((), ())),
                             precision=precision,
                             preferred_element_type=jnp.float32)


def dot_nn(a_XC, b_CD, precision):
  return jax.lax.dot_general(a_XC, b_CD, (((1,), (0,)), ((), ())),
                             precision=precision,
                             preferred_element_type=jnp.float32)


def dot_tn(a_CX, b_CD, precision):
  """a.T @ b with f32 accumulation."""
  return jax.lax.dot_general(a_CX, b_CD, (((0,), (0,)), ((), ())),
                             precision=precision,
                             preferred_element_type=jnp.float32)


def online_softmax_step(m_X1, l_X1, acc_XD, s_XC, mask_XC, v_CD, precision):
  """One key block of flash attention; masked keys contribute exactly zero."""
  s_XC = jnp.where(mask_XC, s_XC, MASK_VALUE)
  m_next = jnp.maximum(m_X1, jnp.max(s_XC, axis=1, keepdims=True))
  alpha = jnp.exp(m_X1 - m_next)
  p_XC = jnp.where(mask_XC, jnp.exp(s_XC - m_next), 0.0)
  l_next = alpha * l_X1 + jnp.sum(p_XC, axis=1, keepdims=True)
  acc_next = acc_XD * alpha + dot_nn(p_XC.astype(v_CD.dtype), v_CD, precision)
  return m_next, l_next, acc_next


def finish_softmax(m_X1, l_X1, acc_XD):
  """(out, lse); rows that saw no key (query padding) get out 0, lse -inf."""
  l_safe = jnp.where(l_X1 == 0.0, 1.0, l_X1)
  lse = jnp.where(l_X1 == 0.0, -jnp.inf, m_X1 + jnp.log(l_safe))
  return acc_XD / l_safe, lse


def query_tile_mask(sel_XK, blk, q_start, tq: int, block_size: int):
  """[tq, block_size] mask of a TPU query tile visiting key block `blk`.

  A row may see the block's keys only if its own selection holds `blk`
  (the tile visits the union of its rows' blocks) and causally.
  q_start is the position of the tile's first query.
  """
  qpos = q_start + jax.lax.broadcasted_iota(jnp.int32, (tq, 1), 0)
  kpos = blk * block_size + jax.lax.broadcasted_iota(
      jnp.int32, (1, block_size), 1)
  hit = jnp.max((sel_XK == blk).astype(jnp.int32), axis=1, keepdims=True) > 0
  return hit & (kpos <= qpos)
