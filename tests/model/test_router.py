"""Router: top-k, gate rule under routing replay, counts and balance loss."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foremoe_jax.model import router


@pytest.mark.parametrize('renormalize', [True, False])
def test_replaying_own_choice_is_identical(renormalize):
  logits = jax.random.normal(jax.random.key(0), (32, 8))
  r = router.route(logits, 2, renormalize=renormalize)
  rr = router.route(logits, 2, renormalize=renormalize, replay_ids_NK=r.ids_NK)
  np.testing.assert_array_equal(r.ids_NK, rr.ids_NK)
  np.testing.assert_array_equal(r.gates_NK, rr.gates_NK)


@pytest.mark.parametrize('renormalize', [True, False])
def test_replayed_other_ids_follow_gate_rule(renormalize):
  logits = np.random.default_rng(1).normal(size=(16, 8)).astype(np.float32)
  ids = np.stack([np.random.default_rng(i).choice(8, 3, replace=False)
                  for i in range(16)]).astype(np.int32)
  r = router.route(jnp.asarray(logits), 3, renormalize=renormalize,
                   replay_ids_NK=jnp.asarray(ids))
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  want = np.take_along_axis(p, ids, -1)
  if renormalize:
    want /= want.sum(-1, keepdims=True)
  np.testing.assert_array_equal(r.ids_NK, ids)
  np.testing.assert_allclose(r.gates_NK, want, rtol=1e-6)


def test_router_gets_gradient_under_replay():
  logits = jax.random.normal(jax.random.key(2), (8, 4))
  ids = jnp.tile(jnp.array([[3, 1]]), (8, 1))
  g = jax.grad(lambda l: router.route(l, 2, renormalize=True,
                                      replay_ids_NK=ids).gates_NK[:, 0].sum())(logits)
  assert float(jnp.abs(g).sum()) > 0
  # Only the replayed logits move a renormalised gate.
  np.testing.assert_allclose(g[:, [0, 2]], 0.0, atol=1e-7)


def test_counts_and_balance_loss_by_hand():
  ids = jnp.array([[0, 1], [0, 2], [1, 0]])
  valid = jnp.array([True, True, False])
  counts = router.expert_counts(ids, valid, 4)
  np.testing.assert_array_equal(counts, [2, 1, 1, 0])
  probs = jnp.array([[0.5, 0.3, 0.1, 0.1], [0.4, 0.1, 0.4, 0.1],
                     [0.0, 0.0, 0.0, 1.0]])
  # f = [0.5, 0.25, 0.25, 0]; P = mean of valid rows = [0.45, 0.2, 0.25, 0.1]
  want = 4 * (0.5 * 0.45 + 0.25 * 0.2 + 0.25 * 0.25)
  np.testing.assert_allclose(router.balance_loss(probs, counts, valid), want,
                             rtol=1e-6)
