"""Expert parallelism vs. a plain loop over experts, on 8 simulated devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foremoe_jax import placement as placement_lib
from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.model.moe_reference import reference_moe_ffn

E, M, F, N, K = 16, 8, 12, 128, 2


def random_placement(rng, num_experts, num_devices, spd):
  """Random experts-to-slots with replicas and random shares (splits)."""
  num_slots = num_devices * spd
  se = np.concatenate([rng.permutation(num_experts),
                       rng.integers(0, num_experts, num_slots - num_experts)])
  se = rng.permutation(se).astype(np.int32)
  share = rng.random((num_devices, num_slots)) + 0.05
  tot = np.zeros((num_devices, num_experts))
  np.add.at(tot.T, se, share.T)
  share = (share / tot[:, se]).astype(np.float32)
  return placement_lib.Placement(se[None], share[None])


def make_inputs(rng):
  x = rng.normal(size=(N, M)).astype(np.float32)
  ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N)])
  # Skew: the first tokens all pick expert 0, so replicas and splits matter.
  ids[: N // 4, 0] = 0
  ids[: N // 4, 1] = rng.integers(1, E, N // 4)
  gates = rng.random((N, K)).astype(np.float32)
  valid = rng.random(N) > 0.1
  w = [rng.normal(size=s).astype(np.float32) * 0.3
       for s in [(E, M, F), (E, M, F), (E, F, M)]]
  return [jnp.asarray(a) for a in (x, ids.astype(np.int32), gates, valid, *w)]


def numpy_counts(ids, valid, num_tokens, num_shards, d_ep):
  """counts[1, D, E] by the fixed token layout (data-major shards)."""
  c = np.zeros((1, d_ep, E), np.int64)
  per = num_tokens // num_shards
  for n in range(num_tokens):
    if valid[n]:
      for k in range(ids.shape[1]):
        c[0, (n // per) % d_ep, ids[n, k]] += 1
  return c


@pytest.fixture(scope='module')
def setup():
  rng = np.random.default_rng(0)
  return rng, make_inputs(rng)


def jitted_ffn(mesh):
  return jax.jit(lambda *a, capacity: ep.routed_experts(
      *a, mesh=mesh, capacity=capacity), static_argnames='capacity')


def _placements(rng, num_devices, spd):
  return ([placement_lib.identity_placement(1, E, num_devices, spd)]
          + [random_placement(rng, E, num_devices, spd) for _ in range(3)])


@pytest.mark.parametrize('num_data,num_expert,spd', [(1, 8, 3), (2, 4, 5)])
def test_output_and_grads_match_reference(setup, num_data, num_expert, spd):
  rng, (x, ids, gates, valid, wg, wu, wd) = setup
  mesh = ep.make_mesh(num_data, num_expert)
  dropless = N // (num_data * num_expert)

  def ep_loss(x, gates, wg, wu, wd, se, share):
    y, _ = ep.routed_experts(x, ids, gates, valid, wg, wu, wd, se, share,
                                  mesh=mesh, capacity=dropless)
    return jnp.sum(jnp.sin(y)), y

  def ref_loss(x, gates, wg, wu, wd):
    y = reference_moe_ffn(x, ids, gates, valid, wg, wu, wd)
    return jnp.sum(jnp.sin(y)), y

  ep_grad = jax.jit(jax.value_and_grad(ep_loss, argnums=(0, 1, 2, 3, 4),
                                       has_aux=True))
  (_, y_ref), g_ref = jax.value_and_grad(
      ref_loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(x, gates, wg, wu, wd)
  for p in _placements(rng, num_expert, spd):
    placement_lib.validate_placement(p, E, spd)
    (_, y), g = ep_grad(x, gates, wg, wu, wd, p.slot_expert[0], p.slot_share[0])
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(g, g_ref):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_one_compile_across_placements(setup):
  rng, (x, ids, gates, valid, wg, wu, wd) = setup
  mesh = ep.make_mesh(1, 8)
  traces = []

  def fwd(x, se, share):
    traces.append(1)
    return ep.routed_experts(x, ids, gates, valid, wg, wu, wd, se, share,
                                  mesh=mesh, capacity=16)[0]

  f = jax.jit(fwd)
  for p in _placements(rng, 8, 3) + [random_placement(rng, E, 8, 3)]:
    f(x, p.slot_expert[0], p.slot_share[0]).block_until_ready()
  assert len(traces) == 1
  assert f._cache_size() == 1


@pytest.mark.parametrize('capacity', [1, 3, 6])
def test_dropped_counts_equal_numpy(setup, capacity):
  rng, (x, ids, gates, valid, wg, wu, wd) = setup
  ffn = jitted_ffn(ep.make_mesh(1, 8))
  for p in _placements(rng, 8, 3):
    _, stats = ffn(x, ids, gates, valid, wg, wu, wd,
                                      p.slot_expert[0], p.slot_share[0],
                   capacity=capacity)
    counts = numpy_counts(np.asarray(ids), np.asarray(valid), N, 8, 8)
    cells_LDS = placement_lib.slot_counts(counts, p)
    assert int(stats.dropped) == int(np.maximum(cells_LDS - capacity, 0).sum())
    assert int(stats.max_cell) == int(cells_LDS.max())
    np.testing.assert_array_equal(stats.slot_tokens_S, cells_LDS[0].sum(0))


def test_dropped_tokens_are_zero_in_output(setup):
  """With capacity 0-ish, an assignment over capacity contributes nothing."""
  rng, (x, ids, gates, valid, wg, wu, wd) = setup
  ffn = jitted_ffn(ep.make_mesh(1, 8))
  p = placement_lib.identity_placement(1, E, 8, 2)
  args = (x, ids, gates, valid, wg, wu, wd, p.slot_expert[0], p.slot_share[0])
  y_full, _ = ffn(*args, capacity=N // 8)
  y_cut, st = ffn(*args, capacity=1)
  assert int(st.dropped) > 0
  changed = np.abs(np.asarray(y_full - y_cut)).max(axis=1) > 1e-6
  assert changed.sum() > 0 and (~changed).sum() > 0


def test_rejects_token_count_not_divisible():
  mesh = ep.make_mesh(1, 8)
  x = jnp.zeros((12, M))
  with pytest.raises(ValueError, match='do not split evenly'):
    ep.routed_experts(x, jnp.zeros((12, K), jnp.int32), jnp.zeros((12, K)),
                           jnp.ones((12,), bool), jnp.zeros((E, M, F)),
                           jnp.zeros((E, M, F)), jnp.zeros((E, F, M)),
                           jnp.arange(E), jnp.ones((8, E)), mesh=mesh,
                           capacity=4)
