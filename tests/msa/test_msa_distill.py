"""The dense-target indexer KL and the selection's recall (msa/distill.py).

The KL is checked against the reference's selected-block KL with every
block selected (the same formula on another code path), the recall and the
far-query recall against a float64 numpy loop over (b, g, t).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.msa import distill, reference
from tests.msa import msa_testlib


def _numpy_recall(q, k, sel, valid, w, block, top_k):
  """(recall, recall_far, far oracle) by loops: softmax per head, mean over
  the group; the oracle keeps the local block and the top_k - 1 earlier
  blocks of largest mass."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  b, t, h, d = q.shape
  g = k.shape[2]
  r = h // g
  num = den = num_far = den_far = num_best = 0.0
  for bb in range(b):
    for tt in range(t):
      vis = [j for j in range(tt + 1) if valid[bb, j]]
      if not vis or w[bb, tt] == 0:
        continue
      masses, best = [], []
      for gg in range(g):
        p = np.zeros(t)
        for rr in range(r):
          lg = np.array([q[bb, tt, gg * r + rr] @ k[bb, j, gg] for j in vis])
          lg = np.exp(lg / np.sqrt(d) - lg.max() / np.sqrt(d))
          p[vis] += lg / lg.sum() / r
        chosen = [j for j in vis if j // block in set(sel[bb, gg, tt])]
        masses.append(p[chosen].sum())
        local = tt // block
        earlier = sorted((p[c * block:(c + 1) * block].sum()
                          for c in range(local)), reverse=True)
        best.append(p[local * block:(local + 1) * block].sum()
                    + sum(earlier[:top_k - 1]))
      m = np.mean(masses)
      num, den = num + w[bb, tt] * m, den + w[bb, tt]
      if len({j // block for j in vis}) > top_k:
        num_far, den_far = num_far + w[bb, tt] * m, den_far + w[bb, tt]
        num_best += w[bb, tt] * np.mean(best)
  return num / den, num_far / den_far, num_best / den_far


# Jitted once per shape: both cases below pass a validity mask (all True
# when unpadded), so they share one compile each.
_stats = jax.jit(distill.dense_indexer_kl,
                 static_argnames=('block_size', 'top_k', 'q_chunk'))
_ref_kl = jax.jit(reference.indexer_kl_loss, static_argnames=('block_size',))
_ref_sel = jax.jit(reference.selection_BGTK,
                   static_argnames=('block_size', 'top_k'))


@pytest.mark.parametrize('padded', [False, True])
def test_dense_kl_and_recall_match_references(padded):
  b, t, g, r, d, di, block, top_k = 2, 40, 2, 2, 8, 8, 8, 2
  q, k, _, qi, ki, _ = msa_testlib.make_inputs(b, t, t, g, r, d, di, seed=3)
  valid = np.ones((b, t), bool)
  if padded:  # Row 1: its first 8 keys (one whole block) are PADs.
    valid[1, :8] = False
  w = np.random.default_rng(0).uniform(0.5, 1.5, (b, t)).astype(np.float32)
  w[~valid] = 0.0
  w /= w.sum()
  stats = _stats(q, k, qi, ki, block_size=block, top_k=top_k, weight_BT=w,
                 kv_valid_BS=valid, q_chunk=16)  # 40 = 2.5 chunks: padding.
  n = -(-t // block)
  every_BGTK = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, g, t, n))
  kl_ref = _ref_kl(q, k, qi, ki, every_BGTK, block_size=block, weight_BT=w,
                   kv_valid_BS=valid)
  msa_testlib.assert_close(stats.kl, kl_ref, 1e-5, 'kl')
  sel = np.asarray(_ref_sel(qi, ki, block_size=block, top_k=top_k,
                            kv_valid_BS=valid))
  rec, rec_far, best = _numpy_recall(q, k, sel, valid, w, block, top_k)
  np.testing.assert_allclose(float(stats.recall), rec, rtol=1e-5)
  np.testing.assert_allclose(float(stats.recall_far), rec_far, rtol=1e-5)
  np.testing.assert_allclose(float(stats.recall_far_oracle), best, rtol=1e-5)
  # Random indexer: not everything kept, and less than the best selection.
  assert 0.0 < rec_far < best < 1.0 and rec_far < rec < 1.0


def test_gradient_reaches_index_branch_only_and_matches_reference():
  b, t, g, r, d, di, block = 1, 32, 2, 2, 8, 8, 8
  q, k, _, qi, ki, _ = msa_testlib.make_inputs(b, t, t, g, r, d, di, seed=5)
  every = jnp.broadcast_to(jnp.arange(t // block, dtype=jnp.int32),
                           (b, g, t, t // block))
  f = lambda q, k, qi, ki: distill.dense_indexer_kl(
      q, k, qi, ki, block_size=block, top_k=2, q_chunk=8).kl
  f_ref = lambda q, k, qi, ki: reference.indexer_kl_loss(
      q, k, qi, ki, every, block_size=block)
  g_ours = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(q, k, qi, ki)
  g_ref = jax.jit(jax.grad(f_ref, argnums=(2, 3)))(q, k, qi, ki)
  assert float(jnp.abs(g_ours[0]).max()) == 0.0
  assert float(jnp.abs(g_ours[1]).max()) == 0.0
  for a, e, what in zip(g_ours[2:], g_ref, ('d qi', 'd ki')):
    msa_testlib.assert_close(a, e, 1e-5, what)


def test_perfect_indexer_has_recall_one_and_far_recall_is_nan_when_short():
  # Keys whose index scores follow the attention exactly: qi = q, ki = k
  # (one head per group, one group), so the block max picks the blocks with
  # the largest logit; with top_k covering every block recall is 1.
  b, t, d, block = 1, 16, 8, 4
  q, k, _, _, _, _ = msa_testlib.make_inputs(b, t, t, 1, 1, d, d, seed=1)
  stats = _stats(q, k, q[:, :, :1, :].reshape(b, t, 1, d), k[:, :, 0],
                 block_size=block, top_k=4)
  np.testing.assert_allclose(float(stats.recall), 1.0, rtol=1e-6)
  np.testing.assert_allclose(float(stats.kl), 0.0, atol=1e-5)
  assert np.isnan(float(stats.recall_far))  # No query sees > 4 blocks.
