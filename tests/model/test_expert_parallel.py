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


def numpy_kept(ids, valid, p, capacity, num_shards, d_ep):
  """bool [N, K]: assignments that fit their (source, destination) cell.

  Re-derives the dispatch rule on the host, one shard at a time: rank among
  the source's assignments to the expert (token order), slot by the split
  rule, then position in the cell = the source's rows for earlier slots of
  the destination device + the rank inside the slot.
  """
  num_tokens, top_k = ids.shape
  per = num_tokens // num_shards
  spd = p.num_slots // d_ep
  se = p.slot_expert[0]
  lo, hi = placement_lib.cumulative_shares(p)
  kept = np.zeros((num_tokens, top_k), bool)
  for shard in range(num_shards):
    src = shard % d_ep
    rows = [(n, k) for n in range(shard * per, (shard + 1) * per) if valid[n]
            for k in range(top_k)]
    n_E = np.bincount([ids[n, k] for n, k in rows], minlength=E)
    n_S = n_E[se].astype(np.float32)
    start_S = placement_lib.round_half_up(lo[0, src] * n_S).astype(int)
    stop_S = placement_lib.round_half_up(hi[0, src] * n_S).astype(int)
    count_S = stop_S - start_S
    seen_E = np.zeros(E, int)
    for n, k in rows:
      e, r = ids[n, k], seen_E[ids[n, k]]
      seen_E[e] += 1
      slot = next(j for j in range(p.num_slots) if se[j] == e
                  and start_S[j] <= r < stop_S[j])
      first = slot // spd * spd
      pos = count_S[first:slot].sum() + r - start_S[slot]
      kept[n, k] = pos < capacity
  return kept


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
  # A token can send all K of its rows to one device.
  dropless = N // (num_data * num_expert) * K

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


def numpy_group_counts(ids, valid, num_data, d_ep):
  """counts[G, 1, D, E]: numpy_counts of each data group's own tokens (the
  group's shards are the contiguous block g * N / G ...)."""
  per_group = N // num_data
  return np.stack([
      numpy_counts(ids[g * per_group:(g + 1) * per_group],
                   valid[g * per_group:(g + 1) * per_group], per_group, d_ep,
                   d_ep) for g in range(num_data)])


@pytest.mark.parametrize('num_data,num_expert,spd,capacity', [
    (1, 8, 3, 1), (1, 8, 3, 3), (1, 8, 3, 6), (2, 4, 5, 3)])
def test_dropped_counts_equal_numpy(setup, num_data, num_expert, spd,
                                    capacity):
  """Cells are per data group: the device's largest cell and its drops are
  the host's per-group counts (`placement.max_cell`), not the counts of the
  groups' summed loads."""
  rng, (x, ids, gates, valid, wg, wu, wd) = setup
  ffn = jitted_ffn(ep.make_mesh(num_data, num_expert))
  counts_GLDE = numpy_group_counts(np.asarray(ids), np.asarray(valid),
                                   num_data, num_expert)
  counts = counts_GLDE.sum(0)
  for p in _placements(rng, num_expert, spd):
    _, stats = ffn(x, ids, gates, valid, wg, wu, wd, p.slot_expert[0],
                   p.slot_share[0], capacity=capacity)
    cells_GLDD = np.stack([placement_lib.cell_counts(c, p)
                           for c in counts_GLDE])
    assert int(stats.dropped) == int(np.maximum(cells_GLDD - capacity, 0).sum())
    assert int(stats.max_cell) == placement_lib.max_cell(counts_GLDE, p)
    assert int(stats.max_cell) == int(cells_GLDD.max())
    if num_data > 1:  # The summed loads' cells would over-size the bucket.
      assert placement_lib.cell_counts(counts, p).max() > stats.max_cell
    np.testing.assert_array_equal(
        stats.slot_tokens_S,
        sum(placement_lib.slot_counts(c, p)[0].sum(0) for c in counts_GLDE))


def hot_expert_placement(num_devices, spd):
  """Expert 0 alone on device 0, with all of its share on slot 0.

  With every token picking expert 0, one slot receives a whole device's
  rows (many tiles) while device 0's other slots stay empty.
  """
  rest = np.resize(np.arange(1, E), (num_devices - 1) * spd)
  se = np.concatenate([np.zeros(spd, int), rest]).astype(np.int32)
  share = 1.0 / np.bincount(se)[se]
  share[:spd] = np.arange(spd) == 0
  share = np.broadcast_to(share.astype(np.float32), (num_devices, se.size))
  return placement_lib.Placement(se[None], share[None].copy())


def hot_ids(rng, ids):
  """Every token's first choice is expert 0."""
  ids = np.asarray(ids).copy()
  ids[:, 0] = 0
  ids[:, 1] = rng.integers(1, E, N)
  return jnp.asarray(ids)


@pytest.mark.parametrize('tile', [8, None])
def test_hot_slot_matches_reference(setup, tile):
  rng, (x, ids, gates, valid, wg, wu, wd) = setup
  mesh = ep.make_mesh(1, 8)
  p = hot_expert_placement(8, 3)
  placement_lib.validate_placement(p, E, 3)
  ids = hot_ids(rng, ids)
  counts = numpy_counts(np.asarray(ids), np.asarray(valid), N, 8, 8)
  slot_tokens_S = placement_lib.slot_counts(counts, p)[0].sum(0)
  assert slot_tokens_S[0] == np.asarray(valid).sum()
  assert slot_tokens_S[1:3].sum() == 0
  capacity = int(placement_lib.cell_counts(counts, p).max())  # Exact fit.

  def ep_loss(x, gates, wg, wu, wd):
    y, _ = ep.routed_experts(x, ids, gates, valid, wg, wu, wd,
                             p.slot_expert[0], p.slot_share[0], mesh=mesh,
                             capacity=capacity, tile=tile)
    return jnp.sum(jnp.sin(y)), y

  def ref_loss(x, gates, wg, wu, wd):
    y = reference_moe_ffn(x, ids, gates, valid, wg, wu, wd)
    return jnp.sum(jnp.sin(y)), y

  argnums = (0, 1, 2, 3, 4)
  (_, y), g = jax.jit(jax.value_and_grad(ep_loss, argnums, has_aux=True))(
      x, gates, wg, wu, wd)
  (_, y_ref), g_ref = jax.value_and_grad(ref_loss, argnums, has_aux=True)(
      x, gates, wg, wu, wd)
  np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('hot', [False, True])
def test_dropped_assignments_contribute_zero(setup, hot):
  """Over capacity = gate zero: output and gradients equal the reference
  with exactly the host-predicted dropped assignments' gates zeroed."""
  rng, (x, ids, gates, valid, wg, wu, wd) = setup
  mesh = ep.make_mesh(1, 8)
  if hot:
    p, ids, capacity = hot_expert_placement(8, 3), hot_ids(rng, ids), 9
  else:
    p, capacity = random_placement(rng, E, 8, 3), 3
  kept = numpy_kept(np.asarray(ids), np.asarray(valid), p, capacity, 8, 8)
  dropped = (~kept & np.asarray(valid)[:, None]).sum()
  assert dropped > 0 and kept.sum() > 0

  def ep_loss(x, gates, wg):
    y, st = ep.routed_experts(x, ids, gates, valid, wg, wu, wd,
                              p.slot_expert[0], p.slot_share[0], mesh=mesh,
                              capacity=capacity)
    return jnp.sum(jnp.sin(y)), (y, st.dropped)

  def ref_loss(x, gates, wg):
    y = reference_moe_ffn(x, ids, gates * kept, valid, wg, wu, wd)
    return jnp.sum(jnp.sin(y)), y

  (_, (y, n_dropped)), g = jax.jit(jax.value_and_grad(
      ep_loss, argnums=(0, 1, 2), has_aux=True))(x, gates, wg)
  (_, y_ref), g_ref = jax.value_and_grad(
      ref_loss, argnums=(0, 1, 2), has_aux=True)(x, gates, wg)
  assert int(n_dropped) == dropped
  np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  # A dropped assignment's gate gets no gradient at all.
  assert np.all(np.asarray(g[1])[~kept] == 0)


def test_grouped_swiglu_worst_case_padding():
  """Every slot one row past a tile boundary: exactly the floor(R / t) + s
  tiles the static layout holds; each row matches a per-row loop."""
  rng = np.random.default_rng(1)
  spd, tile = 3, 8
  label_R = np.concatenate([np.full(tile * j + 1, j) for j in range(spd)]
                           + [np.full(4, -1)])  # Empty rows from the cells.
  label_R = rng.permutation(label_R).astype(np.int32)
  assert label_R.size // tile + spd == sum(j + 1 for j in range(spd))
  x_RM = rng.normal(size=(label_R.size, M)).astype(np.float32)
  w = [rng.normal(size=s).astype(np.float32) * 0.3
       for s in [(spd, M, F), (spd, M, F), (spd, F, M)]]
  y_RM = ep._grouped_swiglu(jnp.asarray(x_RM), jnp.asarray(label_R),
                            *map(jnp.asarray, w), tile)
  for r in np.flatnonzero(label_R >= 0):
    j = label_R[r]
    h = jax.nn.silu(x_RM[r] @ w[0][j]) * (x_RM[r] @ w[1][j])
    np.testing.assert_allclose(y_RM[r], h @ w[2][j], atol=1e-5, rtol=1e-5)


def test_rejects_token_count_not_divisible():
  mesh = ep.make_mesh(1, 8)
  x = jnp.zeros((12, M))
  with pytest.raises(ValueError, match='do not split evenly'):
    ep.routed_experts(x, jnp.zeros((12, K), jnp.int32), jnp.zeros((12, K)),
                           jnp.ones((12,), bool), jnp.zeros((E, M, F)),
                           jnp.zeros((E, M, F)), jnp.zeros((E, F, M)),
                           jnp.arange(E), jnp.ones((8, E)), mesh=mesh,
                           capacity=4)
