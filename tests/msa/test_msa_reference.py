"""The pure-jnp MSA reference against independent computations.

What it must compute: docs/design.md §6.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msa_testlib as lib
from pallas_kernels.msa import reference as ref


@pytest.mark.parametrize('name', sorted(lib.SHAPES))
def test_selection_matches_brute_force_and_invariants(name):
  b, t, s, g, r, d, di, c, k, o = lib.SHAPES[name]
  _, _, _, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  sel = ref.selection_BGTK(qi, ki, block_size=c, top_k=k, q_offset=o)
  want = lib.brute_force_selection(qi, ki, c, k, o)
  np.testing.assert_array_equal(lib.as_sets(sel), lib.as_sets(want))
  lib.check_selection_invariants(sel, c, o)


def test_ties_go_to_the_lower_block_id():
  # Block scores 1, 3, 3, 2, 3 (blocks 0-4), local block 5, K-1 = 2 picks.
  c = 2
  ki = np.zeros((1, 12, 1), np.float32)
  for n, v in enumerate([1, 3, 3, 2, 3, 0]):
    ki[0, 2 * n] = v
  qi = np.ones((1, 12, 1, 1), np.float32)
  sel = ref.selection_BGTK(qi, ki, block_size=c, top_k=3)
  np.testing.assert_array_equal(sel[0, 0, 11], [1, 2, 5])
  # All scores equal: the lowest ids win.
  sel = ref.selection_BGTK(np.ones((1, 12, 1, 1)), np.ones((1, 12, 1)),
                           block_size=c, top_k=3)
  np.testing.assert_array_equal(sel[0, 0, 11], [0, 1, 5])


@pytest.mark.parametrize('name', sorted(lib.SHAPES))
def test_main_branch_matches_dense_masked_attention(name):
  b, t, s, g, r, d, di, c, k, o = lib.SHAPES[name]
  q, kk, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  sel = np.asarray(ref.selection_BGTK(qi, ki, block_size=c, top_k=k,
                                      q_offset=o))
  # Independent mask: numpy loops over the selection rows.
  mask = np.zeros((b, g, t, s), bool)
  for bb, gg, tt, slot in np.ndindex(*sel.shape):
    n = sel[bb, gg, tt, slot]
    if n >= 0:
      mask[bb, gg, tt, n * c:min((n + 1) * c, tt + o + 1)] = True
  mask_BHTS = np.repeat(mask, r, axis=1)
  want = jax.nn.dot_product_attention(q, kk, v, mask=jnp.asarray(mask_BHTS))
  out, lse = ref.sparse_attention(q, kk, v, sel, block_size=c, q_offset=o)
  lib.assert_close(out, want, 1e-5, 'out')
  assert np.all(np.isfinite(lse))


def test_full_budget_equals_dense_causal_gqa():
  b, t, s, g, r, d, di, c, _, o = lib.SHAPES['ragged_chunk']
  q, k, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  n_blocks = -(-s // c)
  out, _ = ref.msa_attention(q, k, v, qi, ki, block_size=c, top_k=n_blocks,
                             q_offset=o)
  lib.assert_close(out, ref.dense_causal_attention(q, k, v, o), 1e-5)


def test_shuffled_and_padded_selection_changes_nothing():
  b, t, s, g, r, d, di, c, k, o = lib.SHAPES['gqa']
  q, kk, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  sel = ref.selection_BGTK(qi, ki, block_size=c, top_k=k, q_offset=o)
  perm = np.random.default_rng(0).permutation(k)
  shuffled = jnp.concatenate([sel[..., perm], -jnp.ones_like(sel)], axis=-1)
  a = ref.sparse_attention(q, kk, v, sel, block_size=c, q_offset=o)
  z = ref.sparse_attention(q, kk, v, shuffled, block_size=c, q_offset=o)
  lib.assert_close(z[0], a[0], 1e-6)
  lib.assert_close(z[1], a[1], 1e-6)


def test_chunked_prefill_rows_equal_full_prefill_rows():
  b, t, s, g, r, d, di, c, k, _ = lib.SHAPES['gqa']
  q, kk, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  full, aux = ref.msa_attention(q, kk, v, qi, ki, block_size=c, top_k=k)
  o = 56
  part, aux_p = ref.msa_attention(q[:, o:], kk, v, qi[:, o:], ki,
                                  block_size=c, top_k=k, q_offset=o)
  lib.assert_close(part, full[:, o:], 1e-6)
  np.testing.assert_array_equal(aux_p['sel_BGTK'], aux['sel_BGTK'][:, :, o:])


def _numpy_indexer_kl_BGT(q, kk, qi, ki, sel, c, o):
  """KL(head-averaged main attention || index distribution) per (b, g, t),
  over the allowed keys, in float64."""
  b, t, h, d = q.shape
  s, g = kk.shape[1:3]
  r, di = h // g, qi.shape[-1]
  allowed = np.asarray(ref.allowed_keys_BGTS(sel, s, block_size=c,
                                             q_offset=o))
  qn, kn = np.asarray(q, np.float64), np.asarray(kk, np.float64)
  qin, kin = np.asarray(qi, np.float64), np.asarray(ki, np.float64)
  kl = np.zeros((b, g, t))
  for bb, gg, tt in np.ndindex(b, g, t):
    m = allowed[bb, gg, tt]
    heads = qn[bb, tt, gg * r:(gg + 1) * r] @ kn[bb, m, gg].T / np.sqrt(d)
    p = np.exp(heads - heads.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).mean(0)
    si = kin[bb, m] @ qin[bb, tt, gg] / np.sqrt(di)
    logi = si - si.max() - np.log(np.exp(si - si.max()).sum())
    kl[bb, gg, tt] = np.sum(p * (np.log(p) - logi))
  return kl


def test_indexer_kl_matches_numpy_and_trains_only_the_indexer():
  b, t, s, g, r, d, di, c, k, o = lib.SHAPES['ragged_chunk']
  q, kk, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  sel = ref.selection_BGTK(qi, ki, block_size=c, top_k=k, q_offset=o)
  loss = ref.indexer_kl_loss(q, kk, qi, ki, sel, block_size=c, q_offset=o)
  kls = _numpy_indexer_kl_BGT(q, kk, qi, ki, sel, c, o)
  np.testing.assert_allclose(float(loss), np.mean(kls), rtol=1e-5)
  grads = jax.grad(lambda *a: ref.indexer_kl_loss(
      *a, sel, block_size=c, q_offset=o), argnums=(0, 1, 2, 3))(q, kk, qi, ki)
  assert float(jnp.abs(grads[0]).max()) == 0.0
  assert float(jnp.abs(grads[1]).max()) == 0.0
  assert float(jnp.abs(grads[2]).max()) > 0.0



def test_indexer_kl_weighted_is_the_masked_mean_over_valid_positions():
  """With weights mask / mask.sum() (the RL loss's completion positions,
  padding and prompt at 0), both implementations give numpy's masked mean
  of the per-position KL, which differs from the plain mean."""
  from pallas_kernels.msa import indexer_loss  # pylint: disable=g-import-not-at-top
  b, t, s, g, r, d, di, c, k, o = lib.SHAPES['ragged_chunk']
  q, kk, v, qi, ki, _ = lib.make_inputs(b, t, s, g, r, d, di)
  _, aux = ref.msa_attention(q, kk, v, qi, ki, block_size=c, top_k=k,
                             q_offset=o)
  sel = aux['sel_BGTK']
  kl_BGT = _numpy_indexer_kl_BGT(q, kk, qi, ki, sel, c, o)
  # A prompt of 3 positions, then completions that end (padding) at random.
  mask = np.arange(t)[None] >= 3
  mask &= np.arange(t)[None] < np.random.default_rng(0).integers(5, t, b)[:, None]
  assert 0 < mask.sum() < mask.size
  want = (kl_BGT * mask[:, None]).sum() / (g * mask.sum())
  assert abs(want - kl_BGT.mean()) > 1e-3 * want
  weight = jnp.asarray(mask / mask.sum(), jnp.float32)
  got_ref = ref.indexer_kl_loss(q, kk, qi, ki, sel, block_size=c, q_offset=o,
                                weight_BT=weight)
  got_xla = indexer_loss.indexer_kl_loss(
      q, kk, qi, ki, sel, aux['lse_BTH'], block_size=c, q_offset=o,
      pairs_per_tile=8, tiles_per_step=4, weight_BT=weight)
  np.testing.assert_allclose(float(got_ref), want, rtol=1e-5)
  np.testing.assert_allclose(float(got_xla), want, rtol=1e-5)