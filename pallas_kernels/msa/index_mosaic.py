"""The index branch's score launch in Mosaic GPU (Hopper): TMA and wgmma.

index_kernel.py's score launch is written for Pallas's Triton lowering,
which has no TMA, no mbarriers and emits warpgroup MMAs only where Triton
chooses to; on an H100 it ran at 259-266 TFLOP/s (32k and 128k tokens),
a third of a plain bf16 matmul there. This is the same launch on Pallas's
Mosaic GPU lowering, which programs Hopper directly:

- the program's query tile [M, Ip] is copied into shared memory once by
  the TMA unit, swizzled as wgmma reads it;
- key blocks stream through two shared-memory slots: the copy of block
  j+1 is in flight while block j's dot runs;
- each block is one warpgroup MMA, [M, Ip] x [Ip, C] (bf16 in, f32
  accumulated in registers), so the keys are read transposed, [B, Ip, S]:
  one XLA transpose of the index keys per call (32 MB at 128k tokens),
  counted in the time of this launch;
- the epilogue is the block maximum of each row (the key-padding mask as
  an additive 0/-inf bias, copied in once per program; the causal compare
  only in the diagonal blocks), kept in shared memory and written to HBM
  by one TMA copy. Shared memory at the bench's shapes (128 rows, 128-key
  blocks, Ip 128, 16 blocks per program): 112 KiB.

Same semantics as index_kernel._scores_kernel, bit for bit where the
dots' sums are exact: S[b, n, row] = scale * max over the visible keys j
of block n of <qi_row, ki_j>, -inf where no key is visible, block-major
[B, Np, rows] f32. It feeds the same top-k launch. bf16 inputs only (f32
and fp8 scores stay on the Triton launch), at least 64 rows per tile
(wgmma's M), block sizes and padded index dims that are multiples of 16.

On CPU it runs in Mosaic GPU's interpret mode (jax's GPU interpreter:
shared memory, barriers and the TMA unit simulated), and it lowers for
CUDA on a machine without a GPU, so both are tested here; its speed is
measured by `make gpu-check`, which times it beside the Triton launch.

Letter key as in index_kernel.py: B batch, Q rows (tokens x groups), M
rows of a tile, I index head dim (padded: Ip), S keys, N key blocks
(padded: Np), C block size.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.msa import mosaic_common as mc

NEG_INF = float('-inf')
MIN_ROWS = 64  # wgmma's M: one warpgroup's MMA covers 64 rows at a time.
_SLOTS = 2     # key blocks in shared memory: one read by the MMA, one loading


def check_shapes(rows: int, index_dim_p: int, block_size: int,
                 row_tile: int):
  """Raises ValueError where the launch cannot run: wgmma's and the TMA
  unit's shape rules, said in the caller's terms."""
  if row_tile % MIN_ROWS or rows % row_tile:
    raise ValueError(
        f'the Mosaic score launch needs row tiles of a multiple of '
        f'{MIN_ROWS} rows (wgmma) that divide the rows: row_tile='
        f'{row_tile}, rows={rows}.')
  if block_size % 16 or index_dim_p % 16 or block_size > 256:
    raise ValueError(
        f'the Mosaic score launch needs a block size (at most 256) and a '
        f'padded index dim that are multiples of 16: block_size='
        f'{block_size}, index dim {index_dim_p}.')


def _scores_body(offset_gmem, qi_gmem, kiT_gmem, bias_gmem, out_gmem,
                 q_smem, k_smem, bias_smem, out_smem, q_bar, k_bars, *,
                 block_size: int, groups: int, row_base: int, scale: float,
                 n_key_blocks: int, layouts: bool):
  """One program: row tile i of batch b against key chunk j (nb blocks),
  grid (B, row tiles, key chunks), one warpgroup.

  `layouts`: mosaic_common.named_layouts'."""
  bb = jax.lax.axis_index('b')
  ii = jax.lax.axis_index('i')
  jj = jax.lax.axis_index('j')
  m = q_smem.shape[0]
  nb = out_smem.shape[0]
  c = block_size
  offset = offset_gmem[bb]
  row0 = row_base + ii * m
  # Blocks of the chunk up to the tile's last row's diagonal are visible;
  # those before its first row's are visible to every row (no causal
  # compare), as in the Triton launch.
  last_block = jax.lax.div(offset + jax.lax.div(row0 + m - 1, groups), c)
  first_block = jax.lax.div(offset + jax.lax.div(row0, groups), c)
  # Padding rows past the queries may sit past the keys: never read
  # beyond them (their scores are dropped).
  last_block = jnp.minimum(last_block, n_key_blocks - 1)
  n_vis = jnp.clip(last_block - jj * nb + 1, 0, nb)
  n_whole = jnp.clip(first_block - jj * nb, 0, n_vis)
  key0 = jj * nb * c

  out_smem[...] = jnp.full((nb, m), NEG_INF, jnp.float32)

  def start_load(jb):
    slot = jax.lax.rem(jb, _SLOTS)
    plgpu.copy_gmem_to_smem(kiT_gmem.at[bb, :, pl.ds(key0 + jb * c, c)],
                            k_smem.at[slot], k_bars.at[slot])

  # The query tile and the chunk's key-padding bias, once; the bias is not
  # slotted with the keys: the warpgroup's threads read it as registers,
  # and a copy into a slot they may still be reading would race (jax's
  # interpreter's race detector found it, tests/msa).
  @pl.when(n_vis > 0)
  def _():
    plgpu.copy_gmem_to_smem(qi_gmem.at[bb, pl.ds(ii * m, m)], q_smem, q_bar)
    plgpu.copy_gmem_to_smem(bias_gmem.at[bb, pl.ds(jj * nb, nb)], bias_smem,
                            q_bar)
    start_load(0)
    plgpu.barrier_wait(q_bar)

  def visit(causal: bool):
    def body(jb, carry):
      slot = jax.lax.rem(jb, _SLOTS)

      # The next block's copy goes to the other slot, whose previous
      # block's MMA was waited for in the iteration before.
      @pl.when(jb + 1 < n_vis)
      def _():
        start_load(jb + 1)

      plgpu.barrier_wait(k_bars.at[slot])

      def dot(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot])
        plgpu.wgmma_wait(0)
        return acc_ref[...]
      logits_MC = pl.run_scoped(dot, plgpu.ACC((m, c), jnp.float32))
      bias_C = mc.load_columns(bias_smem.at[jb], layouts)
      logits_MC = logits_MC + jax.lax.broadcast_in_dim(bias_C, (m, c), [1])
      if causal:
        row_MC = mc.iota((m, c), 0, layouts)
        col_MC = mc.iota((m, c), 1, layouts)
        qpos_MC = offset + jax.lax.div(row0 + row_MC, groups)
        kpos_MC = key0 + jb * c + col_MC
        logits_MC = jnp.where(kpos_MC <= qpos_MC, logits_MC, NEG_INF)
      out_smem[jb] = jnp.max(logits_MC, axis=1) * scale
      return carry
    return body

  jax.lax.fori_loop(0, n_whole, visit(causal=False), None)
  jax.lax.fori_loop(n_whole, n_vis, visit(causal=True), None)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(
      out_smem, out_gmem.at[bb, pl.ds(jj * nb, nb), pl.ds(ii * m, m)])
  plgpu.wait_smem_to_gmem(0)


def scores_call(offset_B, qi_BQI, kiT_BIS, bias_BS, *, n_blocks_p: int,
                block_size: int, groups: int, row_base: int, row_tile: int,
                blocks_per_program: int, scale: float,
                interpret: bool) -> jax.Array:
  """f32 block scores [B, Np, Q] of the rows qi_BQI (bf16 [B, Q, Ip], Q a
  multiple of row_tile; its first row is row `row_base` of the whole
  query) against the transposed keys kiT_BIS (bf16 [B, Ip, Sp], Sp a
  multiple of blocks_per_program * block_size); bias_BS: f32 [B, Sp], 0
  at real keys and -inf at padding ones. Programs whose chunk lies past
  the keys (Np blocks may exceed Sp's) read nothing and write -inf."""
  b, q, ip = qi_BQI.shape
  sp = kiT_BIS.shape[2]
  nb = blocks_per_program
  check_shapes(q, ip, block_size, row_tile)
  if qi_BQI.dtype != jnp.bfloat16 or kiT_BIS.dtype != jnp.bfloat16:
    raise ValueError(f'the Mosaic score launch takes bf16 index inputs, '
                     f'got {qi_BQI.dtype} and {kiT_BIS.dtype}.')
  if sp % (nb * block_size) or n_blocks_p % nb:
    raise ValueError(f'keys ({sp}) and blocks ({n_blocks_p}) must be '
                     f'multiples of the chunk of {nb} blocks.')
  params = mc.interpret_params(interpret)
  kernel = functools.partial(_scores_body, block_size=block_size,
                             groups=groups, row_base=row_base, scale=scale,
                             n_key_blocks=sp // block_size,
                             layouts=mc.named_layouts(params is not False))
  return plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((b, n_blocks_p, q), jnp.float32),
      scratch_types=[
          plgpu.SMEM((row_tile, ip), jnp.bfloat16,
                     transforms=mc.smem_transforms(ip)),
          plgpu.SMEM((_SLOTS, ip, block_size), jnp.bfloat16,
                     transforms=mc.smem_transforms(block_size)),
          plgpu.SMEM((nb, block_size), jnp.float32),
          plgpu.SMEM((nb, row_tile), jnp.float32),
          plgpu.Barrier(num_arrivals=2, num_barriers=1),
          plgpu.Barrier(num_barriers=_SLOTS),
      ],
      grid=(b, q // row_tile, n_blocks_p // nb),
      grid_names=('b', 'i', 'j'),
      interpret=params,
  )(offset_B, qi_BQI, kiT_BIS, bias_BS.reshape(b, sp // block_size,
                                               block_size))
