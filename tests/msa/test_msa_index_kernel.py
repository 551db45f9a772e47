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


@pytest.mark.parametrize('topk', ['pallas', 'xla'])
@pytest.mark.parametrize('name', sorted(CASES))
def test_exact_bf16_selection_equals_brute_force_slot_for_slot(name, topk):
  b, t, s, g, di, c, k, o = CASES[name]
  qi, ki = lib.exact_index_inputs(b, t, s, g, di, seed=3)
  off = _offsets(b, o)
  sel = _select(qi, ki, off, c, k, topk=topk)
  want = np.stack([lib.brute_force_selection(
      qi[i:i + 1].astype(jnp.float32), ki[i:i + 1].astype(jnp.float32), c, k,
      int(off[i]))[0] for i in range(b)])
  np.testing.assert_array_equal(np.asarray(sel), want)


@pytest.mark.parametrize('topk', ['pallas', 'xla'])
def test_padding_keys_are_never_selected(topk):
  # Left-padded rows: the first keys of each sequence are padding, and a
  # whole block of them must leave its slot -1 as in the brute force.
  b, t, s, g, di, c, k = 2, 64, 64, 2, 8, 16, 4
  qi, ki = lib.exact_index_inputs(b, t, s, g, di, seed=5)
  valid = np.ones((b, s), bool)
  valid[0, :21] = False
  valid[1, :3] = False
  sel = _select(qi, ki, np.zeros(b, np.int32), c, k, valid=jnp.asarray(valid),
                topk=topk)
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
