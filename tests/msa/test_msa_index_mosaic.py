"""The Mosaic GPU score launch (index_mosaic.py) in jax's GPU interpreter.

Its block scores against numpy's masked block maxima and against the
Triton launch, bit for bit on exact inputs; the selection on them against
the brute force, slot for slot; and its lowering for CUDA at real shapes,
which runs Pallas's Mosaic GPU lowering (layouts, wgmma and TMA shapes)
on this machine, without a GPU.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msa_testlib as lib
from pallas_kernels.msa import index_kernel
from pallas_kernels.msa import index_mosaic
from pallas_kernels.msa import mosaic_common
from pallas_kernels.msa import select_kernel


def _scores(qi, ki, off, valid, c, **kw):
  out = jax.jit(functools.partial(index_kernel.index_scores, block_size=c,
                                  interpret=True, **kw))(
                                      qi, ki, jnp.asarray(off), valid)
  return np.concatenate([np.asarray(x) for x in out], axis=2)


def test_block_scores_equal_numpy_and_the_triton_launch():
  """scale x the max of the exact logits over the block's keys that are
  valid and not after the row's token, -inf where none is. Two sequences
  at chunked-prefill offsets, 3 groups (64-row tiles straddle 16-key
  blocks: tiles see whole blocks without the causal compare and diagonal
  ones with it), padding keys in the middle (a whole block of them),
  key chunks of 2 blocks (one past the keys: it writes -inf without a
  read), and row chunks of 64 rows (a row base)."""
  kw = dict(row_tile=64, max_score_bytes=2048, blocks_per_program=2)
  b, t, s, g, di, c, o = 2, 40, 75, 3, 24, 16, (29, 11)
  qi, ki = lib.exact_index_inputs(b, t, s, g, di, seed=11)
  valid = np.ones((b, s), bool)
  valid[0, 16:35] = False  # Block 1 whole, block 2 in part.
  valid[1, 3:12] = False
  off = np.asarray(o, np.int32)
  got = _scores(qi, ki, off, jnp.asarray(valid), c, kernel='mosaic', **kw)
  n = -(-s // c)
  want_BNQ = lib.masked_block_max_BNQ(qi, ki, c, off, valid)
  assert np.isfinite(want_BNQ).any() and np.isneginf(want_BNQ).any()
  np.testing.assert_array_equal(got[:, :n, :t * g], want_BNQ)
  assert np.all(np.isneginf(got[:, n:, :t * g]))  # Padding blocks.
  triton = _scores(qi, ki, off, jnp.asarray(valid), c, **kw)
  np.testing.assert_array_equal(got[:, :, :t * g], triton[:, :, :t * g])


def test_selection_on_mosaic_scores_equals_brute_force_slot_for_slot():
  # Exact inputs, plentiful ties: the same slots as the brute force, so the
  # scores feed the top-k launch in its layout (block-major, row chunks).
  b, t, s, g, di, c, k, o = 1, 40, 100, 3, 24, 16, 4, 60
  qi, ki = lib.exact_index_inputs(b, t, s, g, di, seed=7)
  off = np.full((b,), o, np.int32)
  sel = jax.jit(functools.partial(
      index_kernel.select_blocks_BGTK, block_size=c, top_k=k, interpret=True,
      scores_kernel='mosaic', row_tile=64, max_score_bytes=2048))(qi, ki, jnp.asarray(off))
  want = lib.brute_force_selection(qi.astype(jnp.float32),
                                   ki.astype(jnp.float32), c, k, o)
  np.testing.assert_array_equal(np.asarray(sel), want)


def test_unsupported_inputs_are_refused_with_the_reason():
  qi, ki = lib.exact_index_inputs(1, 32, 32, 2, 16, seed=0)
  off = jnp.zeros((1,), jnp.int32)
  f = functools.partial(index_kernel.index_scores, interpret=True,
                        kernel='mosaic')
  with pytest.raises(ValueError, match='bf16'):
    f(qi.astype(jnp.float32), ki, off, block_size=16)
  with pytest.raises(ValueError, match='fp8_scores'):
    f(qi, ki, off, block_size=16, fp8_scores=True)
  with pytest.raises(ValueError, match='multiples of 16'):
    f(qi, ki, off, block_size=8)
  with pytest.raises(ValueError, match="'triton' or 'mosaic'"):
    index_kernel.index_scores(qi, ki, off, block_size=16, interpret=True,
                              kernel='cuda')
  with pytest.raises(ValueError, match='two-pass GPU selector'):
    select_kernel.select_blocks_BGTK(qi, ki, off, block_size=16, top_k=2,
                                     backend='gpu', interpret=True,
                                     gpu_method='fused',
                                     scores_kernel='mosaic')
  with pytest.raises(ValueError, match='multiple of 64 rows'):
    index_mosaic.check_shapes(rows=128, index_dim_p=128, block_size=128,
                              row_tile=32)


@lib.with_cuda_lowering
def test_lowers_for_cuda_at_real_shapes():
  """Prefill and decode shapes of the GPU bench: Pallas's Mosaic GPU
  lowering accepts the kernel (its layouts, the wgmma operands' swizzles
  and the TMA copies) and emits one Mosaic GPU custom call per row chunk
  (PTX is made on the GPU, by `make gpu-check`)."""
  f = functools.partial(index_kernel.index_scores, block_size=128,
                        interpret=False, kernel='mosaic')
  for b, t, s in [(1, 8192, 8192), (8, 1, 32768)]:
    text = jax.jit(f).trace(
        jax.ShapeDtypeStruct((b, t, 4, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((b, s, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((b,), jnp.int32)).lower(
            lowering_platforms=('cuda',)).as_text()
    assert 'mosaic_gpu' in text, text[:2000]


def test_no_data_race_between_the_key_copies_and_the_dots():
  """jax's GPU interpreter with its happens-before race detector: the copy
  of block j+1 into the other slot never overlaps the dot reading block j,
  over key chunks of 4 blocks, diagonal and whole ones."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret  # pylint: disable=g-import-not-at-top
  b, t, s, g, di, c = 1, 64, 64, 2, 16, 16
  qi, ki = lib.exact_index_inputs(b, t, s, g, di, seed=2)
  params = type(mosaic_common.interpret_params(True))(detect_races=True)
  out = index_mosaic.scores_call(
      jnp.zeros((b,), jnp.int32), qi.reshape(b, t * g, di),
      ki.transpose(0, 2, 1), jnp.zeros((b, s), jnp.float32), n_blocks_p=4,
      block_size=c, groups=g, row_base=0, row_tile=64, blocks_per_program=4,
      scale=1.0, interpret=params)
  jax.block_until_ready(out)
  assert not gpu_interpret.get_races().races_found
  assert np.isfinite(np.asarray(out)).sum() > 0
