"""The two-launch GPU index branch (index_kernel.py) in interpret mode.

Scores then top-k, against the numpy brute force of msa_testlib (exact
inputs, slot for slot, so the tie rule and the slot layout are checked) and
against the f32 reference scores by a margin rule (bf16 dots on random
inputs). The lowering test checks that Triton accepts both kernels at real
shapes; it compiles nothing.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msa_testlib as lib
from pallas_kernels.msa import index_kernel
from pallas_kernels.msa import reference as ref

# (b, t, s, g, di, block, top_k, q_offset): G and I not powers of two, S not
# a multiple of the block, a chunked-prefill offset, K above the number of
# blocks, K = 1 (local block only), per-sequence decode offsets.
CASES = {
    'gqa': (2, 96, 96, 2, 8, 16, 3, 0),
    'ragged_chunk': (1, 40, 100, 3, 24, 16, 4, 60),
    'k_above_blocks': (1, 48, 48, 2, 8, 16, 5, 0),
    'local_only': (1, 33, 64, 2, 8, 16, 1, 31),
    'decode': (3, 1, 120, 2, 8, 16, 3, (119, 40, 7)),
}


def _select(qi, ki, off, c, k, valid=None, **kw):
  return jax.jit(functools.partial(
      index_kernel.select_blocks_BGTK, block_size=c, top_k=k, interpret=True,
      **kw))(qi, ki, jnp.asarray(off, jnp.int32), valid)


def _offsets(b, o):
  return np.broadcast_to(np.asarray(o, np.int32), (b,))


# The selector's options: its own top-k, lax.top_k, fp8 score dots.
MODES = {'pallas': {}, 'xla': dict(topk='xla'), 'fp8': dict(fp8_scores=True)}


@pytest.mark.parametrize('mode', sorted(MODES))
@pytest.mark.parametrize('name', sorted(CASES))
def test_exact_bf16_selection_equals_brute_force_slot_for_slot(name, mode):
  # The inputs are exact in bf16 and in e4m3 after a power-of-two scale,
  # and their dot sums exact in f32: every mode must give the same slots.
  b, t, s, g, di, c, k, o = CASES[name]
  qi, ki = lib.exact_index_inputs(b, t, s, g, di, seed=3)
  off = _offsets(b, o)
  sel = _select(qi, ki, off, c, k, **MODES[mode])
  want = np.stack([lib.brute_force_selection(
      qi[i:i + 1].astype(jnp.float32), ki[i:i + 1].astype(jnp.float32), c, k,
      int(off[i]))[0] for i in range(b)])
  np.testing.assert_array_equal(np.asarray(sel), want)


@pytest.mark.parametrize('mode', sorted(MODES))
def test_padding_keys_are_never_selected(mode):
  # Left-padded rows: the first keys of each sequence are padding, and a
  # whole block of them must leave its slot -1 as in the brute force.
  b, t, s, g, di, c, k = 2, 64, 64, 2, 8, 16, 4
  qi, ki = lib.exact_index_inputs(b, t, s, g, di, seed=5)
  valid = np.ones((b, s), bool)
  valid[0, :21] = False
  valid[1, :3] = False
  sel = _select(qi, ki, np.zeros(b, np.int32), c, k, valid=jnp.asarray(valid),
                **MODES[mode])
  want = lib.brute_force_selection(qi.astype(jnp.float32),
                                   ki.astype(jnp.float32), c, k, 0, valid)
  np.testing.assert_array_equal(np.asarray(sel), want)
  assert np.any(np.asarray(sel)[0] == -1)


def test_tiles_and_row_chunks_do_not_change_the_selection():
  b, t, s, g, di, c, k, o = CASES['ragged_chunk']
  qi, ki = lib.exact_index_inputs(b, t, s, g, di, seed=7)
  base = _select(qi, ki, _offsets(b, o), c, k)
  for kw in [dict(blocks_per_program=1), dict(blocks_per_program=2,
                                                 row_tile=16, topk_rows=8),
             dict(row_tile=32, max_score_bytes=4 * 8 * 32),
             dict(row_tile=32, max_score_bytes=4 * 8 * 32, topk='xla')]:
    np.testing.assert_array_equal(
        np.asarray(_select(qi, ki, _offsets(b, o), c, k, **kw)),
        np.asarray(base), err_msg=str(kw))


@pytest.mark.parametrize('kw', [dict(row_tile=16, blocks_per_program=1),
                                dict(row_tile=16, blocks_per_program=2),
                                dict(row_tile=32),
                                dict(row_tile=16, causal_every_block=True)])
def test_block_scores_equal_the_masked_block_max_by_numpy(kw):
  """Every block score against numpy: scale x the max of the exact logits
  over the block's keys that are valid and not after the row's token,
  -inf where none is. 16-row tiles of 3 groups are 5.3 tokens, so tiles
  straddle 8-key blocks: a tile's earlier blocks take the padding mask
  alone, its diagonal ones the causal compare too, and both must agree
  with the brute force; the padding sits in the middle of the keys, so
  whole blocks of it fall on both sides of the diagonal."""
  b, t, s, g, di, c, o = 2, 24, 53, 3, 8, 8, (29, 11)
  qi, ki = lib.exact_index_inputs(b, t, s, g, di, seed=11)
  valid = np.ones((b, s), bool)
  valid[0, 8:17] = False  # Block 1 whole, block 2 in part.
  valid[1, 3:12] = False
  off = np.asarray(o, np.int32)
  out = jax.jit(functools.partial(index_kernel.index_scores, block_size=c,
                                  interpret=True, **kw))(
                                      qi, ki, jnp.asarray(off),
                                      jnp.asarray(valid))
  got = np.concatenate([np.asarray(x) for x in out], axis=2)
  n = -(-s // c)
  want_BNQ = lib.masked_block_max_BNQ(qi, ki, c, off, valid)
  assert np.isfinite(want_BNQ).any() and np.isneginf(want_BNQ).any()
  np.testing.assert_array_equal(got[:, :n, :t * g], want_BNQ)
  assert np.all(np.isneginf(got[:, n:, :t * g]))  # Padding blocks.


def test_score_launch_tilings_give_the_same_scores():
  # The score launch's knobs (the GPU bench's INDEX_VARIANTS) change how
  # the work is cut, never a block score: on exact inputs, bit for bit,
  # and the top-k on them is the default selection.
  b, t, s, g, di, c, k, o = CASES['ragged_chunk']
  qi, ki = lib.exact_index_inputs(b, t, s, g, di, seed=7)
  off = jnp.asarray(_offsets(b, o))

  def scores(**kw):
    out = jax.jit(functools.partial(index_kernel.index_scores, block_size=c,
                                    interpret=True, **kw))(qi, ki, off)
    return np.concatenate([np.asarray(x) for x in out], axis=2)

  base = scores()
  assert np.isfinite(base).any() and np.isneginf(base).any()
  for kw in [dict(key_sub=8), dict(key_sub=64), dict(num_stages=1),
             dict(row_tile=16, key_sub=4, num_stages=1), dict(num_warps=8),
             dict(causal_every_block=True)]:
    np.testing.assert_array_equal(scores(**kw), base, err_msg=str(kw))
  sel = jax.jit(functools.partial(
      index_kernel.index_topk, t=t, groups=g, num_keys=s, block_size=c,
      top_k=k, interpret=True))(
          jax.jit(functools.partial(index_kernel.index_scores, block_size=c,
                                    interpret=True, key_sub=8))(qi, ki, off),
          off)
  np.testing.assert_array_equal(np.asarray(sel),
                                np.asarray(_select(qi, ki, off, c, k)))
  with pytest.raises(ValueError, match='key_sub'):
    scores(key_sub=6)


def test_to_fp8_scales_by_the_largest_fitting_power_of_two():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3, 16)) *
                  np.array([1e-3, 1.0, 700.0])[None, :, None], jnp.float32)
  x = x.at[0, 0].set(0.0)  # an all-zero row stays zero
  q = np.asarray(index_kernel.to_fp8(x, axis=-1).astype(jnp.float32))
  amax = np.abs(q).max(-1)
  assert np.all(amax <= index_kernel.FP8_MAX)
  assert amax[0, 0] == 0
  live = amax > 0
  assert np.all(amax[live] > index_kernel.FP8_MAX / 2 * 0.9)
  # A power of two per row: q / x is one constant per row (up to e4m3's
  # rounding of x's values, 2^-4 relative).
  ratio = np.abs(q).max(-1) / np.abs(np.asarray(x)).max(-1).clip(1e-30)
  np.testing.assert_allclose(np.log2(ratio[live]),
                             np.round(np.log2(ratio[live])), atol=0.1)


def test_fp8_scores_keep_the_coarse_margin_rule():
  # Random floats: e4m3 keeps 3 mantissa bits, so the selection may differ
  # from the exact one only among blocks within eps (eps_scale 2^-3) of
  # the K-th score.
  from pallas_kernels.msa import benchmark_gpu  # pylint: disable=g-import-not-at-top
  b, t, s, g, di, c, k = 1, 256, 256, 2, 32, 16, 4
  _, _, _, qi, ki, _ = lib.make_inputs(b, t, s, g, 1, 8, di, seed=4)
  sel = _select(qi.astype(jnp.bfloat16), ki.astype(jnp.bfloat16),
                np.zeros(b, np.int32), c, k, fp8_scores=True)
  scores = np.asarray(ref.block_scores_BGTN(ref.index_logits_BGTS(qi, ki), c),
                      np.float64)
  args = (np.asarray(sel), scores, np.asarray(qi), np.asarray(ki), c, k)
  violations, flip_rate = benchmark_gpu.selection_margin(*args,
                                                         eps_scale=2.0**-3)
  print(f'fp8 index scores: flip rate {flip_rate:.3f}')
  assert violations == 0
  lib.check_selection_invariants(sel, c, 0)


def test_fp8_padding_keys_do_not_set_the_key_scale():
  # A huge padding key would shrink every real key's e4m3 scale to nothing
  # if it counted; masked out first, the selection is the exact one.
  b, t, s, g, di, c, k = 1, 64, 64, 2, 8, 16, 4
  qi, ki = lib.exact_index_inputs(b, t, s, g, di, seed=5)
  valid = np.ones((b, s), bool)
  valid[0, :5] = False
  ki = ki.at[0, 2].set(jnp.asarray(1e6, ki.dtype))
  sel = _select(qi, ki, np.zeros(b, np.int32), c, k,
                valid=jnp.asarray(valid), fp8_scores=True)
  want = lib.brute_force_selection(qi.astype(jnp.float32),
                                   ki.astype(jnp.float32), c, k, 0, valid)
  np.testing.assert_array_equal(np.asarray(sel), want)


def test_f32_random_inputs_equal_the_reference():
  b, t, s, g, di, c, k, o = CASES['ragged_chunk']
  _, _, _, qi, ki, _ = lib.make_inputs(b, t, s, g, 1, 8, di)
  sel = _select(qi, ki, _offsets(b, o), c, k)
  want = ref.selection_BGTK(qi, ki, block_size=c, top_k=k, q_offset=o)
  np.testing.assert_array_equal(np.asarray(sel), np.asarray(want))


def test_f32_takes_a_large_block_in_parts_and_still_equals_the_reference():
  # f32 splits each 128-key block into 64-key dots (score_tiling: shared
  # memory on an H100); the block's maximum over its parts, masks and a
  # ragged last block included, is the reference's.
  assert index_kernel.score_tiling(jnp.float32, 128, 128) == (64, 64, 1)
  assert index_kernel.score_tiling(jnp.bfloat16, 128, 128) == (128, 128, 2)
  b, t, s, g, di, c, k, o = 1, 200, 520, 2, 8, 128, 3, 320
  _, _, _, qi, ki, _ = lib.make_inputs(b, t, s, g, 1, 8, di, seed=5)
  valid = np.ones((b, s), bool)
  valid[:, 130:150] = False  # a hole inside the second half of block 1
  sel = _select(qi, ki, _offsets(b, o), c, k, jnp.asarray(valid))
  want = ref.selection_BGTK(qi, ki, block_size=c, top_k=k, q_offset=o,
                            kv_valid_BS=jnp.asarray(valid))
  np.testing.assert_array_equal(np.asarray(sel), np.asarray(want))


def test_bf16_dots_on_random_inputs_keep_the_margin_rule():
  # f32 normal draws rounded to bf16 for the kernel, judged against the f32
  # scores of the unrounded draws.
  b, t, s, g, di, c, k = 2, 128, 256, 2, 32, 16, 6
  _, _, _, qi, ki, _ = lib.make_inputs(b, t, s, g, 1, 8, di, seed=11)
  sel = _select(qi.astype(jnp.bfloat16), ki.astype(jnp.bfloat16),
                np.zeros(b, np.int32), c, k)
  lib.check_selection_invariants(sel, c, 0)
  scores = ref.block_scores_BGTN(ref.index_logits_BGTS(qi, ki), c)
  violations, flip_rate = lib.selection_margin_report(sel, scores, qi, ki, c,
                                                      k, 0)
  print(f'bf16 index dots: flip rate {flip_rate:.4f}')
  assert violations == 0
  # Rounding must not make the selection arbitrary either.
  assert flip_rate < 0.25, flip_rate
  # The same rule fails a selection that ignores the scores.
  shuffled = np.array(sel)
  shuffled[..., :k - 1] = np.where(shuffled[..., :k - 1] >= 0,
                                   shuffled[..., :k - 1] // 2, -1)
  assert lib.selection_margin_report(shuffled, scores, qi, ki, c, k, 0)[0] > 0


@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float32])
@lib.with_cuda_lowering
def test_both_kernels_lower_for_cuda(dtype):
  f = functools.partial(index_kernel.select_blocks_BGTK, block_size=128,
                        top_k=16, interpret=False)
  for t, s in [(2048, 4096), (1, 32768)]:
    text = jax.jit(f).trace(
        jax.ShapeDtypeStruct((2, t, 4, 128), dtype),
        jax.ShapeDtypeStruct((2, s, 128), dtype),
        jax.ShapeDtypeStruct((2,), jnp.int32)).lower(
            lowering_platforms=('cuda',)).as_text()
    assert 'msa_index_scores' in text and 'msa_index_topk' in text
  # The fp8 score dots lower too (their operands e4m3 in the kernel).
  text = jax.jit(functools.partial(f, fp8_scores=True)).trace(
      jax.ShapeDtypeStruct((1, 2048, 4, 128), dtype),
      jax.ShapeDtypeStruct((1, 2048, 128), dtype),
      jax.ShapeDtypeStruct((1,), jnp.int32)).lower(
          lowering_platforms=('cuda',)).as_text()
  assert 'msa_index_scores' in text and 'f8E4M3FN' in text
