"""Helpers shared by the Mosaic GPU kernels (index_mosaic.py,
kv_outer_mosaic.py): how they run in jax's GPU interpreter, and the
shared-memory and register layouts wgmma wants.

jax 0.10 (this suite's) and 0.11 (the GPU machine's) differ here: jax
0.10's GPU interpreter has no rule for the layout-naming ops
(plgpu.load, plgpu.broadcasted_iota with a layout), does not export its
parameters' class, and its plgpu.load takes the index apart (0.11
deprecates that). A kernel passes `layouts=named_layouts(...)` down and
builds those values through `load_columns` and `iota`, which give the
same values with plain ops where layouts do not exist.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

OLD_API = not hasattr(plgpu, 'InterpretGPUParams')  # jax 0.10

ACC = plgpu.Layout.WGMMA                # a wgmma accumulator [M, N]
ACC_ROWS = plgpu.Layout.WGMMA.reduce(1)  # its rows, a [M] vector
ACC_COLS = plgpu.Layout.WGMMA.reduce(0)  # its columns, a [N] vector


def interpret_params(interpret):
  """`interpret` as plgpu.kernel takes it: jax's GPU interpreter (simulated
  shared memory, barriers and TMA) for True, the hardware for False; an
  InterpretGPUParams (e.g. with detect_races) is passed on as it is.
  (`interpret=True` itself is jax's generic interpreter, which cannot run
  TMA copies.) The kernels call it through this module, so that
  `make gpu-rehearsal` can swap it."""
  if not interpret:
    return False
  if not isinstance(interpret, bool):
    return interpret
  params = getattr(plgpu, 'InterpretGPUParams', None)
  if params is None:
    from jax._src.pallas.mosaic_gpu.interpret import params as mod  # pylint: disable=g-import-not-at-top
    params = mod.InterpretGPUParams
  return params()


def named_layouts(interpreted: bool) -> bool:
  """Whether a kernel names its register layouts: always when compiled,
  and in jax 0.11's interpreter."""
  return not (interpreted and OLD_API)


def smem_transforms(minor: int):
  """Tiling and swizzle of a bf16 wgmma operand whose minor dimension
  holds `minor` elements: the widest swizzle (128 bytes, 64 elements) it
  fills."""
  swizzle = min(128, minor * 2)
  return (plgpu.TilingTransform((8, swizzle // 2)),
          plgpu.SwizzleTransform(swizzle))


def load_columns(ref, layouts: bool):
  """A [C] vector from shared memory, laid out as the columns of a wgmma
  accumulator (to broadcast over its rows); a plain read without
  `layouts`."""
  if not layouts:
    return ref[...]
  if OLD_API:  # jax 0.10's load takes the index apart.
    return plgpu.load(ref, (), layout=ACC_COLS)
  return plgpu.load(ref, layout=ACC_COLS)


def iota(shape, dim: int, layouts: bool, layout=ACC):
  """broadcasted_iota in `layout` (a wgmma accumulator's by default;
  ACC_ROWS / ACC_COLS for its row and column vectors)."""
  if not layouts:
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=layout)
