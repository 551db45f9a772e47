"""Expert parallelism vs. a plain loop over experts, on 8 simulated devices.

Both dispatch strategies (exact-count, padded-cell) and every grouped GEMM
(the tile loop over non-empty tiles, the static tile scan, ragged_dot) are
held to the loop reference in outputs and gradients; capacities, drops and
row counts are re-derived on the host token by token.
"""
import jax
import jax.extend  # noqa: F401  (jax.extend.core in a test below)
import jax.numpy as jnp
import numpy as np
import pytest

from foremoe_jax import config as config_lib
from foremoe_jax import placement as placement_lib
from foremoe_jax.model import dispatch_exact
from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.model import grouped_swiglu
from foremoe_jax.model import slot_assignment
from foremoe_jax.model.moe_reference import reference_moe_ffn

# (dispatch, grouped GEMM): the CPU defaults of both strategies, and the
# accelerator grouped GEMMs behind the exact dispatch: ragged_dot (TPU) and
# pallas (GPU; on CPU its jnp reference over the same tiles).
PATHS = [('exact', None), ('exact', 'tiles'), ('exact', 'ragged_dot'),
         ('exact', 'pallas'), ('padded', None)]

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


def numpy_kept(ids, valid, p, capacity, num_shards, d_ep, dispatch='padded',
               cell=None):
  """bool [N, K]: assignments that fit under the capacity.

  Re-derives the dispatch rule on the host, one shard at a time: rank among
  the source's assignments to the expert (token order), slot by the split
  rule, then position in the (source, destination) cell = the source's rows
  for earlier slots of the destination device + the rank inside the slot.
  'padded': kept when the cell position is < C. 'exact': the destination
  stacks its sources' cells in source order, so kept when the rows of the
  earlier sources of the same data group plus the cell position are < R;
  with a pair bound `cell`, only a cell's first `cell` rows are sent, so
  the cell position must also be < cell and the earlier sources count at
  most `cell` rows each.
  """
  num_tokens, top_k = ids.shape
  per = num_tokens // num_shards
  spd = p.num_slots // d_ep
  se = p.slot_expert[0]
  lo, hi = placement_lib.cumulative_shares(p)
  kept = np.zeros((num_tokens, top_k), bool)
  cell_pos = {}
  cells = np.zeros((num_shards // d_ep, d_ep, d_ep), int)  # [G, src, dst]
  for shard in range(num_shards):
    group, src = divmod(shard, d_ep)
    rows = [(n, k) for n in range(shard * per, (shard + 1) * per) if valid[n]
            for k in range(top_k)]
    n_E = np.bincount([ids[n, k] for n, k in rows], minlength=E)
    n_S = n_E[se].astype(np.float32)
    start_S = placement_lib.round_half_up(lo[0, src] * n_S).astype(int)
    stop_S = placement_lib.round_half_up(hi[0, src] * n_S).astype(int)
    count_S = stop_S - start_S
    cells[group, src] = count_S.reshape(d_ep, spd).sum(1)
    seen_E = np.zeros(E, int)
    for n, k in rows:
      e, r = ids[n, k], seen_E[ids[n, k]]
      seen_E[e] += 1
      slot = next(j for j in range(p.num_slots) if se[j] == e
                  and start_S[j] <= r < stop_S[j])
      first = slot // spd * spd
      cell_pos[n, k] = (group, src, slot // spd,
                        count_S[first:slot].sum() + r - start_S[slot])
  for (n, k), (group, src, dst, pos) in cell_pos.items():
    if dispatch == 'exact':
      sent = cells[group, :src, dst]
      if cell is not None:
        if pos >= cell:
          continue
        sent = np.minimum(sent, cell)
      pos += sent.sum()
    kept[n, k] = pos < capacity
  return kept
@pytest.fixture(scope='module')
def setup():
  rng = np.random.default_rng(0)
  return rng, make_inputs(rng)


def jitted_ffn(mesh, dispatch='padded', gemm=None):
  return jax.jit(lambda *a, capacity: ep.routed_experts(
      *a, mesh=mesh, capacity=capacity, dispatch=dispatch, gemm=gemm),
                 static_argnames='capacity')


def _placements(rng, num_devices, spd):
  return ([placement_lib.identity_placement(1, E, num_devices, spd)]
          + [random_placement(rng, E, num_devices, spd) for _ in range(3)])


def _dropless(dispatch, num_data, num_expert, spd):
  return config_lib.dropless_capacity(dispatch, N // (num_data * num_expert),
                                      K, num_expert, spd)


def _ref_loss(ids, valid, kept=None):
  def loss(x, gates, wg, wu, wd):
    g = gates if kept is None else gates * kept
    y = reference_moe_ffn(x, ids, g, valid, wg, wu, wd)
    return jnp.sum(jnp.sin(y)), y
  return loss


def _assert_close_to_ref(y, g, y_ref, g_ref):
  np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('dispatch,gemm', PATHS)
@pytest.mark.parametrize('num_data,num_expert,spd', [(1, 8, 3), (2, 4, 5)])
def test_output_and_grads_match_reference(setup, num_data, num_expert, spd,
                                          dispatch, gemm):
  rng, (x, ids, gates, valid, wg, wu, wd) = setup
  mesh = ep.make_mesh(num_data, num_expert)
  cap = _dropless(dispatch, num_data, num_expert, spd)

  def ep_loss(x, gates, wg, wu, wd, se, share):
    y, st = ep.routed_experts(x, ids, gates, valid, wg, wu, wd, se, share,
                              mesh=mesh, capacity=cap, dispatch=dispatch,
                              gemm=gemm)
    return jnp.sum(jnp.sin(y)), (y, st.dropped)

  ep_grad = jax.jit(jax.value_and_grad(ep_loss, argnums=(0, 1, 2, 3, 4),
                                       has_aux=True))
  (_, y_ref), g_ref = jax.value_and_grad(
      _ref_loss(ids, valid), argnums=(0, 1, 2, 3, 4), has_aux=True)(
          x, gates, wg, wu, wd)
  for p in _placements(rng, num_expert, spd):
    placement_lib.validate_placement(p, E, spd)
    (_, (y, dropped)), g = ep_grad(x, gates, wg, wu, wd, p.slot_expert[0],
                                   p.slot_share[0])
    assert int(dropped) == 0
    _assert_close_to_ref(y, g, y_ref, g_ref)


@pytest.mark.parametrize('dispatch', ['exact', 'padded'])
def test_one_compile_across_placements(setup, dispatch):
  rng, (x, ids, gates, valid, wg, wu, wd) = setup
  mesh = ep.make_mesh(1, 8)
  traces = []

  def fwd(x, se, share):
    traces.append(1)
    return ep.routed_experts(x, ids, gates, valid, wg, wu, wd, se, share,
                             mesh=mesh, capacity=16 if dispatch == 'padded'
                             else 64, dispatch=dispatch)[0]

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
def test_padded_drops_and_max_cell_equal_numpy(setup, num_data, num_expert,
                                               spd, capacity):
  """Cells are per data group: the device's largest cell and its drops are
  the host's per-group counts (`placement.max_cell`), not the counts of the
  groups' summed loads."""
  rng, (x, ids, gates, valid, wg, wu, wd) = setup
  ffn = jitted_ffn(ep.make_mesh(num_data, num_expert), 'padded')
  counts_GLDE = numpy_group_counts(np.asarray(ids), np.asarray(valid),
                                   num_data, num_expert)
  counts = counts_GLDE.sum(0)
  for p in _placements(rng, num_expert, spd):
    _, stats = ffn(x, ids, gates, valid, wg, wu, wd, p.slot_expert[0],
                   p.slot_share[0], capacity=capacity)
    cells_GLDD = np.stack([placement_lib.cell_counts(c, p)
                           for c in counts_GLDE])
    assert int(stats.dropped) == int(np.maximum(cells_GLDD - capacity, 0).sum())
    assert int(stats.max_rows) == placement_lib.max_cell(counts_GLDE, p)
    assert int(stats.max_rows) == placement_lib.capacity_demand(
        counts_GLDE, p, 'padded') == int(cells_GLDD.max())
    if num_data > 1:  # The summed loads' cells would over-size the bucket.
      assert placement_lib.cell_counts(counts, p).max() > stats.max_rows
    np.testing.assert_array_equal(
        stats.slot_tokens_S,
        sum(placement_lib.slot_counts(c, p)[0].sum(0) for c in counts_GLDE))


@pytest.mark.parametrize('num_data,num_expert,spd,capacity,gemm,cell', [
    (1, 8, 3, 8, None, None), (1, 8, 3, 30, None, None),
    (2, 4, 5, 20, None, None), (2, 4, 5, 200, None, None),
    (1, 8, 3, 30, 'ragged_dot', None), (2, 4, 5, 20, 'ragged_dot', None),
    (1, 8, 3, 30, None, 3), (2, 4, 5, 200, None, 4)])
def test_exact_drops_and_max_received_equal_numpy(setup, num_data, num_expert,
                                                  spd, capacity, gemm, cell):
  """The receive buffer bounds the rows a device receives in its data
  group (`placement.max_received`, the planner's device load); rows past
  it are dropped, and the outputs equal the reference with exactly the
  host-predicted assignments dropped. A pair bound `cell` (the emulated
  exchange's chunk) drops the rows past it in each (source, destination)
  pair too, and counts them."""
  rng, (x, ids, gates, valid, wg, wu, wd) = setup
  mesh = ep.make_mesh(num_data, num_expert)
  counts_GLDE = numpy_group_counts(np.asarray(ids), np.asarray(valid),
                                   num_data, num_expert)
  cap = capacity if cell is None else (capacity, cell)

  def ep_loss(x, gates, wg, se, share):
    y, st = ep.routed_experts(x, ids, gates, valid, wg, wu, wd, se, share,
                              mesh=mesh, capacity=cap, dispatch='exact',
                              gemm=gemm, exchange='emulated')
    return jnp.sum(jnp.sin(y)), (y, st)

  ep_grad = jax.jit(jax.value_and_grad(ep_loss, argnums=(0, 1, 2),
                                       has_aux=True))
  for p in _placements(rng, num_expert, spd)[:3]:
    (_, (y, st)), g = ep_grad(x, gates, wg, p.slot_expert[0], p.slot_share[0])
    recv_GD = np.stack([placement_lib.device_loads(c, p)[0]
                        for c in counts_GLDE])
    assert int(st.max_rows) == placement_lib.max_received(counts_GLDE, p)
    assert int(st.max_rows) == int(recv_GD.max())
    if cell is None:
      assert int(st.dropped) == int(np.maximum(recv_GD - capacity, 0).sum())
    else:  # The pairs' tails first, then what the kept rows overflow.
      sent_GDD = np.stack([np.minimum(placement_lib.cell_counts(c, p)[0],
                                      cell) for c in counts_GLDE])
      assert placement_lib.max_cell(counts_GLDE, p) > cell  # Some cut.
      assert int(st.dropped) == int(
          (recv_GD.sum() - sent_GDD.sum())
          + np.maximum(sent_GDD.sum(axis=1) - capacity, 0).sum())
    np.testing.assert_array_equal(
        st.slot_tokens_S,
        sum(placement_lib.slot_counts(c, p)[0].sum(0) for c in counts_GLDE))
    kept = numpy_kept(np.asarray(ids), np.asarray(valid), p, capacity,
                      num_data * num_expert, num_expert, 'exact', cell=cell)
    assert (~kept & np.asarray(valid)[:, None]).sum() == int(st.dropped)
    (_, y_ref), g_ref = jax.value_and_grad(
        _ref_loss(ids, valid, kept), argnums=(0, 1, 2), has_aux=True)(
            x, gates, wg, wu, wd)
    _assert_close_to_ref(y, g, y_ref, g_ref)


@pytest.mark.parametrize('dispatch', ['exact', 'padded'])
def test_rows_in_no_slot_are_counted_as_dropped(setup, dispatch):
  """A routed row no slot's range covers is not computed, and `dropped`
  counts it like a row over capacity. validate_placement refuses such a
  placement on the host; on the device (a placement built in jit, or
  shares rounded badly) the count must not hide the loss. Expert 3's
  shares are zeroed: its rows vanish from the output and from the count
  of computed rows alike."""
  rng, (x, ids, gates, valid, wg, wu, wd) = setup
  mesh = ep.make_mesh(1, 8)
  p = placement_lib.identity_placement(1, E, 8, 3)
  share = np.array(p.slot_share[0])
  share[:, np.asarray(p.slot_expert[0]) == 3] = 0.0
  y, st = jax.jit(lambda *a: ep.routed_experts(
      *a, mesh=mesh, capacity=_dropless(dispatch, 1, 8, 3),
      dispatch=dispatch))(x, ids, gates, valid, wg, wu, wd, p.slot_expert[0],
                          share)
  routed_3 = (np.asarray(ids) == 3) & np.asarray(valid)[:, None]
  assert routed_3.sum() > 0
  assert int(st.dropped) == int(routed_3.sum())
  y_ref = reference_moe_ffn(x, ids, gates * ~routed_3, valid, wg, wu, wd)
  np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)


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


def cold_devices_ids(rng):
  """Every token picks two of experts 0..3 (homes on devices 0 and 1 of 8):
  under static EP six devices receive nothing."""
  return jnp.asarray(np.stack([rng.choice(4, K, replace=False)
                               for _ in range(N)]).astype(np.int32))


def replicated_hot_placement(num_devices, spd, rng):
  """Expert 0 on a slot of every device (its home holds it twice), the
  other experts at home; random shares split every expert's tokens."""
  homes = E // num_devices
  assert spd == homes + 1
  se = np.concatenate([np.r_[np.arange(d * homes, (d + 1) * homes), 0]
                       for d in range(num_devices)]).astype(np.int32)
  share = rng.random((num_devices, se.size)) + 0.05
  tot = np.zeros((num_devices, E))
  np.add.at(tot.T, se, share.T)
  share = (share / tot[:, se]).astype(np.float32)
  return placement_lib.Placement(se[None], share[None])


@pytest.mark.parametrize('dispatch,gemm', PATHS)
@pytest.mark.parametrize('case', ['hot_slot', 'cold_devices', 'hot_replicated'])
def test_adversarial_routing_matches_reference(setup, case, dispatch, gemm):
  """Every token to one expert held by one slot; six of eight devices with
  nothing to do; a hot expert replicated on every device with its tokens
  split. The capacity is the exact fit the host computes; 8-row tiles, so
  a hot slot spans many."""
  rng, (x, ids, gates, valid, wg, wu, wd) = setup
  rng = np.random.default_rng(7)
  mesh = ep.make_mesh(1, 8)
  spd = 3
  if case == 'hot_slot':
    p, ids = hot_expert_placement(8, spd), hot_ids(rng, ids)
  elif case == 'cold_devices':
    p, ids = placement_lib.identity_placement(1, E, 8, spd), cold_devices_ids(
        rng)
  else:
    p, ids = replicated_hot_placement(8, spd, rng), hot_ids(rng, ids)
  placement_lib.validate_placement(p, E, spd)
  counts = numpy_counts(np.asarray(ids), np.asarray(valid), N, 8, 8)[None]
  capacity = placement_lib.capacity_demand(counts, p, dispatch)
  if case == 'hot_slot':
    slot_tokens_S = placement_lib.slot_counts(counts[0], p)[0].sum(0)
    assert slot_tokens_S[0] == np.asarray(valid).sum()
    assert slot_tokens_S[1:3].sum() == 0
  if case == 'cold_devices':
    assert (placement_lib.device_loads(counts[0], p)[0] == 0).sum() == 6

  def ep_loss(x, gates, wg, wu, wd):
    y, st = ep.routed_experts(x, ids, gates, valid, wg, wu, wd,
                              p.slot_expert[0], p.slot_share[0], mesh=mesh,
                              capacity=capacity, tile=8, dispatch=dispatch,
                              gemm=gemm)
    return jnp.sum(jnp.sin(y)), (y, st)

  argnums = (0, 1, 2, 3, 4)
  (_, (y, st)), g = jax.jit(jax.value_and_grad(ep_loss, argnums,
                                               has_aux=True))(
                                                   x, gates, wg, wu, wd)
  (_, y_ref), g_ref = jax.value_and_grad(_ref_loss(ids, valid), argnums,
                                         has_aux=True)(x, gates, wg, wu, wd)
  assert int(st.dropped) == 0 and int(st.max_rows) == capacity
  _assert_close_to_ref(y, g, y_ref, g_ref)


@pytest.mark.parametrize('dispatch', ['exact', 'padded'])
@pytest.mark.parametrize('hot', [False, True])
def test_dropped_assignments_contribute_zero(setup, hot, dispatch):
  """Over capacity = gate zero: output and gradients equal the reference
  with exactly the host-predicted dropped assignments' gates zeroed."""
  rng, (x, ids, gates, valid, wg, wu, wd) = setup
  mesh = ep.make_mesh(1, 8)
  if hot:
    p, ids, capacity = hot_expert_placement(8, 3), hot_ids(rng, ids), 9
  else:
    p, capacity = random_placement(rng, E, 8, 3), 3
  if dispatch == 'exact':
    capacity *= 4  # A device's rows, not one cell's.
  kept = numpy_kept(np.asarray(ids), np.asarray(valid), p, capacity, 8, 8,
                    dispatch)
  dropped = (~kept & np.asarray(valid)[:, None]).sum()
  assert dropped > 0 and kept.sum() > 0

  def ep_loss(x, gates, wg):
    y, st = ep.routed_experts(x, ids, gates, valid, wg, wu, wd,
                              p.slot_expert[0], p.slot_share[0], mesh=mesh,
                              capacity=capacity, dispatch=dispatch)
    return jnp.sum(jnp.sin(y)), (y, st.dropped)

  (_, (y, n_dropped)), g = jax.jit(jax.value_and_grad(
      ep_loss, argnums=(0, 1, 2), has_aux=True))(x, gates, wg)
  (_, y_ref), g_ref = jax.value_and_grad(
      _ref_loss(ids, valid, kept), argnums=(0, 1, 2), has_aux=True)(
          x, gates, wg, wu, wd)
  assert int(n_dropped) == dropped
  _assert_close_to_ref(y, g, y_ref, g_ref)
  # A dropped assignment's gate gets no gradient at all.
  assert np.all(np.asarray(g[1])[~kept] == 0)


def test_slot_assignment_is_the_split_rule():
  """The device's sort-based assignment gives every slot exactly the rows
  `placement.slot_counts` predicts, each slot's rows numbered 0..n-1 in
  token order, and its slot-sorted order lists them slot by slot."""
  rng = np.random.default_rng(3)
  num_slots, num_assign = 24, 300
  for trial in range(6):
    p = random_placement(rng, E, 8, 3)
    if trial == 0:
      p = hot_expert_placement(8, 3)
    e_A = rng.integers(0, E, num_assign).astype(np.int32)
    if trial % 2:
      e_A[: num_assign // 2] = 0  # A hot expert, split over its replicas.
    valid_A = rng.random(num_assign) > 0.2
    src = int(rng.integers(0, 8))
    sa = jax.jit(slot_assignment.assign_slots, static_argnums=4)(
        e_A, valid_A, p.slot_expert[0], p.slot_share[0, src], E)
    counts = np.zeros((1, 8, E), np.int64)
    np.add.at(counts[0, src], e_A[valid_A], 1)
    want_S = placement_lib.slot_counts(counts, p)[0, src]
    np.testing.assert_array_equal(sa.count_S, want_S)
    slot_A, pos_A, found_A = map(np.asarray, (sa.slot_A, sa.pos_A, sa.found_A))
    np.testing.assert_array_equal(found_A, valid_A)
    for j in range(num_slots):
      rows = np.flatnonzero(found_A & (slot_A == j))
      assert (p.slot_expert[0, j] == e_A[rows]).all()
      np.testing.assert_array_equal(pos_A[rows], np.arange(len(rows)))
    order = np.asarray(sa.order_A)
    assert sorted(order.tolist()) == list(range(num_assign))
    np.testing.assert_array_equal(
        np.where(found_A[order], slot_A[order], num_slots),
        np.sort(np.where(found_A, slot_A, num_slots)))


def test_an_expert_on_seven_slots_loses_no_token_at_any_count():
  """Shares made for one token count and used with others (data groups
  share a placement): an expert on 7 slots, shares from 7 counts summing to
  25,875. At every count tried the device's per-slot counts equal the
  host's (`placement.slot_counts`) and every valid assignment finds a
  slot. With float32 shares c / sum (not on the 2^-24 grid) the device's
  bounds, summed in another order, sat an ulp off the host's: at 2,597
  tokens a row moved between slots, at 6,016 (and 9,466, 12,916) one fell
  between two."""
  num_slots, e = 64, 16
  slots = np.array([0, 7, 16, 32, 40, 59, 62])
  c = np.array([4904, 1898, 3428, 4750, 3252, 4201, 3442])
  se = np.array([1 + i % (e - 1) for i in range(num_slots)], np.int32)
  se[slots] = 0
  counts = np.zeros((1, 1, num_slots), np.int64)
  counts[0, 0, slots] = c
  counts[0, 0, se != 0] = 1
  share = placement_lib.shares_from_slot_counts(counts, se[None])
  p = placement_lib.Placement(se[None], share)
  num_assign = 16384
  run = jax.jit(lambda valid: slot_assignment.assign_slots(
      jnp.zeros((num_assign,), jnp.int32), valid, jnp.asarray(se),
      jnp.asarray(share[0, 0]), e))
  rng = np.random.default_rng(0)
  for n in [2597, 6016, 9466, 12916, *rng.integers(1, num_assign, 30)]:
    got = run(jnp.arange(num_assign) < n)
    host = np.zeros((1, 1, e), np.int64)
    host[0, 0, 0] = n
    np.testing.assert_array_equal(
        np.asarray(got.count_S)[slots],
        placement_lib.slot_counts(host, p)[0, 0, slots], err_msg=str(n))
    assert int(np.asarray(got.found_A).sum()) == n, n


@pytest.mark.parametrize('platform', ['cuda', 'tpu'])
def test_slot_ranges_take_no_matmul_on_an_accelerator(platform):
  """A GPU's default float32 dot is TF32 and a TPU's one bfloat16 pass:
  shares summed by a matmul there would be rounded, and tokens would fall
  between two slots' ranges (dropped) or into both. The ranges are
  float32 adds on every backend: no dot in the program a GPU or TPU gets
  (on the CPU every dot is exact, so the test above cannot see it)."""
  s, n = 24, 300
  text = jax.jit(slot_assignment.assign_slots, static_argnums=4).trace(
      jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), bool),
      jax.ShapeDtypeStruct((s,), jnp.int32),
      jax.ShapeDtypeStruct((s,), jnp.float32), E).lower(
          lowering_platforms=(platform,)).as_text()
  assert 'dot_general' not in text and 'stablehlo.dot' not in text


@pytest.mark.parametrize('chunk', [5, 12])
def test_emulated_ragged_all_to_all_is_the_collective(chunk):
  """Random ragged sends between 8 devices, each received run placed at
  the sender's output offset (a chunk as large as the largest run, or
  larger): equal to a numpy model of
  jax.lax.ragged_all_to_all's documented semantics, and so is its gradient
  (each received row's cotangent back on the row it came from; the
  output's own rows keep theirs where nothing overwrote them)."""
  rng = np.random.default_rng(4)
  d, rows, out_rows = 8, 64, 64
  send_DD = rng.integers(0, 6, (d, d))  # [sender, receiver]
  operand = rng.normal(size=(d, rows, 3)).astype(np.float32)
  in_off = np.zeros((d, d), np.int32)
  for s_ in range(d):  # Runs placed with gaps, in a shuffled order.
    order = rng.permutation(d)
    pos = 0
    for r in order:
      in_off[s_, r] = pos
      pos += send_DD[s_, r] + 1
  # Receiver r lays its senders out in sender order, with a gap of 2.
  recv_off = np.zeros((d, d), np.int32)  # [receiver, sender]
  for r in range(d):
    recv_off[r] = np.cumsum(np.r_[0, send_DD[:-1, r] + 2])
  out_off = recv_off.T.copy()  # [sender, receiver]: where its rows land.
  fill = rng.normal(size=(d, out_rows, 3)).astype(np.float32)
  ct = rng.normal(size=(d, out_rows, 3)).astype(np.float32)
  want, want_dop, want_dfill = fill.copy(), np.zeros_like(operand), ct.copy()
  for s_ in range(d):
    for r in range(d):
      n, src, dst = send_DD[s_, r], in_off[s_, r], out_off[s_, r]
      want[r, dst:dst + n] = operand[s_, src:src + n]
      want_dop[s_, src:src + n] = ct[r, dst:dst + n]
      want_dfill[r, dst:dst + n] = 0
  mesh = ep.make_mesh(1, d)
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  per = P(ep.EXPERT)

  def body(op, out, i_off, snd, o_off, rcv, r_off):
    return dispatch_exact.emulated_ragged_all_to_all(
        op[0], out[0], i_off[0], snd[0], o_off[0], rcv[0], axis_name=ep.EXPERT,
        chunk=chunk, recv_offsets=r_off[0])[None]

  ints = (in_off, send_DD.astype(np.int32), out_off,
          send_DD.T.copy().astype(np.int32), recv_off)
  f = jax.shard_map(body, mesh=mesh, in_specs=(per,) * 7, out_specs=per)
  got = jax.jit(f)(operand, fill, *ints)
  np.testing.assert_array_equal(np.asarray(got), want)
  loss = lambda op, out: (f(op, out, *ints) * ct).sum()
  d_op, d_fill = jax.jit(jax.grad(loss, argnums=(0, 1)))(operand, fill)
  np.testing.assert_allclose(np.asarray(d_op), want_dop, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(d_fill), want_dfill, rtol=1e-6)


@pytest.mark.parametrize('kind', ['tiles_static', 'tiles', 'ragged_dot'])
def test_grouped_swiglu_worst_case_padding(kind):
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
  y_RM = grouped_swiglu.grouped_swiglu(
      jnp.asarray(x_RM), jnp.asarray(label_R), *map(jnp.asarray, w),
      tile=tile, kind=kind)
  for r in np.flatnonzero(label_R >= 0):
    j = label_R[r]
    h = jax.nn.silu(x_RM[r] @ w[0][j]) * (x_RM[r] @ w[1][j])
    np.testing.assert_allclose(y_RM[r], h @ w[2][j], atol=1e-5, rtol=1e-5)


def test_exact_compute_loops_over_the_tiles_that_arrived():
  """The tile loop's trip count is data (a while loop bounded by the
  non-empty tiles), while the padded scan's is the buffer's static tile
  count: the structure that makes exact-dispatch work follow the rows."""
  rng = np.random.default_rng(2)
  spd, tile, rows = 3, 8, 64
  x = jnp.asarray(rng.normal(size=(rows, M)).astype(np.float32))
  w = [jnp.asarray(rng.normal(size=s).astype(np.float32))
       for s in [(spd, M, F), (spd, M, F), (spd, F, M)]]
  label = jnp.asarray(rng.integers(-1, spd, rows).astype(np.int32))

  def prims(kind):
    jaxpr = jax.make_jaxpr(lambda x, lab: grouped_swiglu.grouped_swiglu(
        x, lab, *w, tile=tile, kind=kind))(x, label)
    names = set()

    def walk(j):
      for eqn in j.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
          walk(sub)
    walk(jaxpr.jaxpr)
    return names
  assert 'while' in prims('tiles') and 'while' in prims('tiles_lockstep')
  assert 'while' not in prims('tiles_static') and 'scan' in prims(
      'tiles_static')


def test_lockstep_runs_the_busiest_devices_tile_count():
  """On simulated devices every device runs as many tiles as the busiest
  one ('tiles_lockstep'); 'tiles' runs its own; the static scan all."""
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = ep.make_mesh(2, 4)
  tile = 8
  count_Ns = np.array([[d * 5, 3, 0] for d in range(8)], np.int32)  # [dev, s]
  own = ((count_Ns + tile - 1) // tile).sum(axis=1)

  def run(kind):
    return jax.jit(jax.shard_map(
        lambda c: jnp.asarray(grouped_swiglu.tiles_to_run(
            c[0], tile, kind, (ep.DATA, ep.EXPERT)))[None],
        mesh=mesh, in_specs=P((ep.DATA, ep.EXPERT)),
        out_specs=P((ep.DATA, ep.EXPERT))))(count_Ns)
  np.testing.assert_array_equal(run('tiles'), own)
  np.testing.assert_array_equal(run('tiles_lockstep'),
                                np.full(8, own.max()))
  assert grouped_swiglu.tiles_to_run(jnp.asarray(count_Ns[0]), tile,
                                     'tiles_static') is None


def test_rejects_token_count_not_divisible():
  mesh = ep.make_mesh(1, 8)
  x = jnp.zeros((12, M))
  with pytest.raises(ValueError, match='do not split evenly'):
    ep.routed_experts(x, jnp.zeros((12, K), jnp.int32), jnp.zeros((12, K)),
                      jnp.ones((12,), bool), jnp.zeros((E, M, F)),
                      jnp.zeros((E, M, F)), jnp.zeros((E, F, M)),
                      jnp.arange(E), jnp.ones((8, E)), mesh=mesh,
                      capacity=4)
