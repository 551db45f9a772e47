"""The device transfer engine moves exactly what the schedule says.

A sequence of random placements (replicas, relocations, slots that keep
their expert) on 8 simulated devices: after every transition each slot must
hold its expert's canonical weights, the ids that travelled with them must
match, and the gradients the slots accumulated must reach the canonical
experts exactly once (checked against a numpy segment sum).
"""
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.planner.topology import Topology
from foremoe_jax.transfer import engine, schedule

D = 8


def random_placements(rng, num_micro, num_layers, num_experts, num_slots):
  """[M, L, S]: every expert once, the remaining slots random replicas."""
  out = np.empty((num_micro, num_layers, num_slots), np.int32)
  for m in range(num_micro):
    for l in range(num_layers):
      extra = rng.integers(num_experts, size=num_slots - num_experts)
      out[m, l] = rng.permutation(np.r_[np.arange(num_experts), extra])
      if m and rng.random() < 0.5:  # Often keep most slots: few moves.
        keep = rng.random(num_slots) < 0.7
        cand = np.where(keep, out[m - 1, l], out[m, l])
        if len(np.unique(cand)) == num_experts:
          out[m, l] = cand
  return out


def _sources_also_written(steps, spd: int) -> int:
  """(micro-step, layer, device, slot)s of an ExactTransition stack that
  send or locally copy their slot's old expert and are overwritten in the
  same transition."""
  num_micro, num_layers = steps.local_src_LS.shape[:2]
  count = 0
  for m in range(num_micro):
    for l in range(num_layers):
      for d in range(D):
        local = steps.local_src_LS[m, l, d * spd:(d + 1) * spd]
        read = ({int(x) for x in steps.send_LPDR[m, l, 0, d] if 0 <= x < spd}
                | {int(x) for x in local if 0 <= x < spd})
        written = ({int(x) for x in steps.recv_LPDR[m, l, 0, d] if x >= 0}
                   | {j for j in range(spd) if local[j] >= 0})
        count += len(read & written)
  return count


@pytest.fixture(scope='module')
def mesh():
  return ep.make_mesh(1, D)


@pytest.mark.parametrize('mode,exchange,num_nodes,spd,num_experts,tree',
                         [('exact', 'emulated', 1, 2, 8, True),
                          ('exact', 'emulated', 2, 3, 16, True),
                          ('exact', 'emulated', 1, 2, 8, False),
                          ('exact', 'emulated', 2, 3, 16, False),
                          ('exact', 'a2a', 2, 3, 16, True),
                          ('rounds', None, 2, 3, 16, True)])
def test_slots_hold_planned_experts_and_gradients_go_home(mesh, mode, exchange,
                                                          num_nodes, spd,
                                                          num_experts, tree):
  """tree: a fill/flush budget large enough for the flush to be a
  reduction tree and the first fill a broadcast tree (schedule.flush_form,
  fill_form): 32 or 48 against s + h = 3 or 5; else one stage each, which
  the CPU's emulated exchange runs in place (`engine._fill_inplace`), as
  it does every move between micro-steps. The moves include slots that
  send their old expert and take a new one in the same transition."""
  rng = np.random.default_rng(spd)
  num_micro, num_layers = 4, 2
  topo = Topology(num_nodes, D // num_nodes, spd)
  se_MLS = random_placements(rng, num_micro, num_layers, num_experts,
                             topo.num_slots)
  budget = schedule.TransferBudget(step_rounds=(16 if tree else 4) * spd,
                                   microstep_rounds=4 * spd, mode=mode)
  st = schedule.build_step_transfer(se_MLS, num_experts, topo, budget)
  assert st.remote_fills_M()[1:].sum() > 0  # The sequence really moves experts.
  if mode == 'exact':
    # The moves: one stage, with slots that are both a source and a
    # destination of the same transition.
    assert st.steps.count_LPDD.shape[2] == 1
    assert _sources_also_written(st.steps, spd) > 0
    stages = (st.flush.ret_count_LPDD.shape[1], st.fill.count_LPDD.shape[1])
    if tree:
      assert min(stages) > 1
      assert st.flush.ret_count_LPDD[:, 1:].sum() > 0
      assert st.fill.count_LPDD[:, 1:].sum() > 0
    else:
      assert stages == (1, 1)
  # Two leaves of different shapes, stacked over the layers as the model
  # stores them: [L, E, ...].
  canon = (jnp.asarray(rng.standard_normal((num_layers, num_experts, 3, 2)),
                       jnp.float32),
           jnp.asarray(rng.standard_normal((num_layers, num_experts, 2)),
                       jnp.float32))
  fill = jax.jit(lambda s, c, t: engine.fill_slots(s, c, t, mesh=mesh,
                                                   exchange=exchange))
  fill0 = jax.jit(lambda c, t: engine.fill_slots(None, c, t, mesh=mesh,
                                                 exchange=exchange))
  ret = jax.jit(lambda g, c, t: engine.return_grads(g, c, t, mesh=mesh,
                                                    exchange=exchange))
  errors = jax.jit(lambda s, se: engine.id_errors(s, se, mesh=mesh))

  steps = engine.device_transition(st.steps)
  slots = fill0(canon, engine.device_transition(st.fill))
  gslots = tuple(jnp.zeros((num_layers, topo.num_slots) + w.shape[2:])
                 for w in canon)
  gcanon = tuple(jnp.zeros_like(w) for w in canon)
  expect = tuple(np.zeros(w.shape) for w in canon)
  for m in range(num_micro):
    np.testing.assert_array_equal(slots[-1], se_MLS[m])
    for l in range(num_layers):
      for w_slot, w_canon in zip(slots[:-1], canon):
        np.testing.assert_array_equal(w_slot[l],
                                      np.asarray(w_canon)[l][se_MLS[m, l]])
    assert int(errors(slots, jnp.asarray(se_MLS[m]))) == 0
    # This micro-step's slot gradients: random, accumulated per slot.
    g = tuple(rng.standard_normal(x.shape).astype(np.float32) for x in gslots)
    for l in range(num_layers):
      for e_acc, g_leaf in zip(expect, g):
        np.add.at(e_acc[l], se_MLS[m, l], g_leaf[l])
    gslots = jax.tree.map(lambda a, b: a + b, gslots, g)
    t_m = {k: v[m] for k, v in steps.items()}
    slots = fill(slots, canon, t_m)
    gslots, gcanon = ret(gslots, gcanon, t_m)
  gslots, gcanon = ret(gslots, gcanon, engine.device_transition(st.flush))
  for got, want in zip(gcanon, expect):
    np.testing.assert_allclose(got, want, atol=1e-5)
  for g in gslots:
    assert float(jnp.abs(g).max()) == 0.0  # The flush empties every slot.


def _count_eqns(jaxpr, primitive: str) -> int:
  """Equations of `primitive` in a jaxpr and every jaxpr nested in it (loop
  bodies, branches, shard_map): each is a copy in the program."""
  return sum((eqn.primitive.name == primitive)
             + sum(_count_eqns(sub, primitive)
                   for sub in jax.extend.core.jaxprs_in_params(eqn.params))
             for eqn in jaxpr.eqns)


def test_emulated_tree_is_one_stage_of_program(mesh):
  """The CPU emulation runs a broadcast tree's (first fill) and a reduction
  tree's (flush) stages as one loop: its program holds one stage's shift
  rounds, the D - 1 ppermutes per leaf of the `lax.switch` over shifts,
  however many stages the budget makes (unrolled, each stage was a copy:
  most of the RL update's compile). The stand-in for the GPU's ragged
  exchange ('a2a') keeps them unrolled, each stage its own collective."""
  spd, num_experts, num_layers = 2, 8, 2
  topo = Topology(1, D, spd)
  se_MLS = random_placements(np.random.default_rng(0), 2, num_layers,
                             num_experts, topo.num_slots)
  budget = schedule.TransferBudget(step_rounds=32 * spd,
                                   microstep_rounds=4 * spd)
  st = schedule.build_step_transfer(se_MLS, num_experts, topo, budget)
  fill_t = engine.device_transition(st.fill)
  flush_t = engine.device_transition(st.flush)
  stages = (fill_t['count_LPDD'].shape[1], flush_t['ret_count_LPDD'].shape[1])
  assert min(stages) >= 4
  canon = (jnp.zeros((num_layers, num_experts, 3, 2)),
           jnp.zeros((num_layers, num_experts, 2)))
  gslots = tuple(jnp.zeros((num_layers, topo.num_slots) + w.shape[2:])
                 for w in canon)

  def count(exchange, primitive):
    fill = jax.make_jaxpr(lambda c, t: engine.fill_slots(
        None, c, t, mesh=mesh, exchange=exchange))(canon, fill_t)
    flush = jax.make_jaxpr(lambda g, c, t: engine.return_grads(
        g, c, t, mesh=mesh, exchange=exchange))(gslots, canon, flush_t)
    return (_count_eqns(fill.jaxpr, primitive),
            _count_eqns(flush.jaxpr, primitive))
  # Weights and ids travel in a fill (3 leaves), gradients in a flush (2).
  assert count('emulated', 'ppermute') == ((D - 1) * 3, (D - 1) * 2)
  # The a2a stand-in: each stage's all-to-all of each leaf, unrolled.
  assert count('a2a', 'all_to_all') == (stages[0] * 3, stages[1] * 2)


def test_id_check_catches_a_wrong_schedule(mesh):
  rng = np.random.default_rng(0)
  topo = Topology(1, D, 2)
  se_MLS = random_placements(rng, 1, 1, 8, 16)
  st = schedule.build_step_transfer(se_MLS, 8, topo,
                                    schedule.TransferBudget(8, 8, 'rounds'))
  canon = ((jnp.arange(8.0)[:, None] * jnp.ones((1, 4)))[None],)
  t = engine.device_transition(st.fill)
  fill = jax.jit(lambda t: engine.fill_slots(None, canon, t, mesh=mesh))
  errors = jax.jit(lambda s: engine.id_errors(s, jnp.asarray(se_MLS[0]),
                                              mesh=mesh))
  assert int(errors(fill(t))) == 0
  # Sending every device's first source instead: the ids give it away.
  t['send_LRD'] = jnp.zeros_like(t['send_LRD'])
  t['local_src_LS'] = jnp.where(t['local_src_LS'] >= 0, 2, -1)
  assert int(errors(fill(t))) > 0


def test_exact_sends_only_the_counted_items(mesh):
  """The exchange carries exactly the counted items: whatever sits in the
  send buffer past a device's count never reaches anyone, and a count
  taken away loses exactly that item."""
  rng = np.random.default_rng(0)
  topo = Topology(1, D, 2)
  se_MLS = random_placements(rng, 1, 1, 8, 16)
  st = schedule.build_step_transfer(se_MLS, 8, topo,
                                    schedule.TransferBudget(8, 8))
  canon = ((jnp.arange(8.0)[:, None] * jnp.ones((1, 4)))[None],)
  want = np.asarray(canon[0])[0][se_MLS[0, 0]]
  t = engine.device_transition(st.fill)
  fill = jax.jit(lambda t: engine.fill_slots(None, canon, t, mesh=mesh))
  slots = fill(t)
  np.testing.assert_array_equal(slots[0][0], want)
  assert st.fill.count_LPDD.shape[1] == 1  # One collective (no tree).
  sent_D = st.fill.count_LPDD[0, 0].sum(1)
  past = np.arange(8)[None, :] >= sent_D[:, None]  # [D, R]
  t['send_LPDR'] = jnp.where(past[None, None], 2 + np.arange(8) % 2,
                             t['send_LPDR'])
  slots = fill(t)
  np.testing.assert_array_equal(slots[0][0], want)
  np.testing.assert_array_equal(slots[-1], se_MLS[0])
  # The last receiver of the last sender: its last item no longer counted.
  c = int(np.flatnonzero(sent_D)[-1])
  d = int(np.flatnonzero(st.fill.count_LPDD[0, 0, c])[-1])
  count_LPDD = st.fill.count_LPDD.copy()
  count_LPDD[0, 0, c, d] -= 1  # Both ends read it (sender's row, receiver's).
  t = dict(engine.device_transition(st.fill._replace(count_LPDD=count_LPDD)),
           send_LPDR=t['send_LPDR'])
  q = int(st.fill.count_LPDD[0, 0, :, d].sum()) - 1  # Its place at d.
  slot = d * 2 + int(st.fill.recv_LPDR[0, 0, d, q])
  slots = fill(t)
  got_ids = np.asarray(slots[-1])[0]
  assert got_ids[slot] != se_MLS[0, 0, slot]
  np.testing.assert_array_equal(np.delete(got_ids, slot),
                                np.delete(se_MLS[0, 0], slot))


@pytest.mark.parametrize('mode,num_layers,chunks',
                         [('exact', 5, 3), ('rounds', 5, 3), ('exact', 2, 4)])
def test_fill_in_layer_chunks_equals_one_fill(mesh, mode, num_layers, chunks):
  """A fill spread over scan iterations, one chunk of layers each
  (`chunk`, as the recompute's prefill runs it), leaves every slot as the
  whole fill does; a chunk touches only its own layers, those
  `layer_chunks` assigns it (with more chunks than layers, some chunks
  touch none). Then a fill from those slots to the next placement
  (`start_LS`) moves only the changed slots and holds the next
  placement's experts."""
  rng = np.random.default_rng(11)
  num_experts, spd = 16, 3
  topo = Topology(2, D // 2, spd)
  se_MLS = random_placements(rng, 2, num_layers, num_experts, topo.num_slots)
  budget = schedule.TransferBudget(step_rounds=4 * spd,
                                   microstep_rounds=4 * spd, mode=mode)
  st = schedule.build_step_transfer(se_MLS[:1], num_experts, topo, budget)
  canon = (jnp.asarray(rng.standard_normal((num_layers, num_experts, 3, 2)),
                       jnp.float32),)
  t = engine.device_transition(st.fill)
  chunk_L = np.asarray(engine.layer_chunks(num_layers, chunks))
  if chunks <= num_layers:  # Every chunk holds a layer.
    assert sorted(set(chunk_L.tolist())) == list(range(chunks))
  spec = jax.sharding.PartitionSpec(None, ep.EXPERT)
  rep = jax.sharding.PartitionSpec()
  fill_chunk = jax.jit(jax.shard_map(
      lambda s, c, t, k: engine.fill_slots_local(s, c, t, num_devices=D,
                                                 chunk=k, num_chunks=chunks),
      mesh=mesh, in_specs=((spec, spec), (spec,),
                           engine.transition_specs(t), rep),
      out_specs=(spec, spec)))
  whole = jax.jit(lambda c, t: engine.fill_slots(None, c, t, mesh=mesh))(
      canon, t)
  empty = engine.empty_slots(canon, topo.num_slots)
  # Each chunk alone: its layers filled, the others still empty (ids -1).
  for k in range(chunks):
    one = fill_chunk(empty, canon, t, jnp.int32(k))
    for l in range(num_layers):
      if chunk_L[l] == k:
        np.testing.assert_array_equal(one[-1][l], se_MLS[0, l])
        np.testing.assert_array_equal(one[0][l], whole[0][l])
      else:
        assert (np.asarray(one[-1][l]) == -1).all()
        assert (np.asarray(one[0][l]) == 0).all()
  # Chunk by chunk, reading the previous chunk's slots: the whole fill.
  slots = empty
  for k in range(chunks):
    slots = fill_chunk(slots, canon, t, jnp.int32(k))
  for a, b in zip(slots, whole):
    np.testing.assert_array_equal(a, b)
  # From those slots to the next placement: the changed slots only.
  nxt = schedule.build_step_transfer(se_MLS[1:], num_experts, topo, budget,
                                     start_LS=se_MLS[0])
  assert (nxt.fill.remote_fills_L.sum()
          < schedule.build_step_transfer(se_MLS[1:], num_experts, topo,
                                         budget).fill.remote_fills_L.sum())
  moved = jax.jit(lambda s, c, t: engine.fill_slots(s, c, t, mesh=mesh))(
      slots, canon, engine.device_transition(nxt.fill))
  np.testing.assert_array_equal(moved[-1], se_MLS[1])
  for l in range(num_layers):
    np.testing.assert_array_equal(moved[0][l],
                                  np.asarray(canon[0])[l][se_MLS[1, l]])


@pytest.mark.parametrize('mode', ['exact', 'rounds'])
def test_each_device_receives_only_its_own_rows(mesh, mode):
  """A step's transfer on the mesh: every field with a device or slot axis
  is split over 'expert' (each device holds 1/D of it), only the [L, R]
  shifts and [L, K] depths are whole; the exchange's rows equal the host
  counts read from the other side (column, offsets, shift depths by
  loops), and a fill from the split fields holds the plan."""
  rng = np.random.default_rng(5)
  num_experts, spd = 16, 3
  topo = Topology(2, D // 2, spd)
  se_MLS = random_placements(rng, 3, 2, num_experts, topo.num_slots)
  st = schedule.build_step_transfer(
      se_MLS, num_experts, topo, schedule.TransferBudget(48, 12, mode))
  dev = engine.device_step_transfer(
      st, lambda spec: jax.sharding.NamedSharding(mesh, spec))
  whole = {'shift_LR', 'ret_shift_LR', 'depth_LPK', 'ret_depth_LPK'}
  for name, t in dev.items():
    for k, x in t.items():
      shard = x.sharding.shard_shape(x.shape)
      split = [i for i, (a, b) in enumerate(zip(x.shape, shard)) if a != b]
      if k in whole:
        assert not split, (name, k)
      else:
        assert len(split) == 1 and shard[split[0]] * D == x.shape[split[0]], (
            name, k, x.shape, shard)
  if mode == 'exact':
    # The moves' fills ([M, L, D, D]) and the flush's staged returns (a
    # tree here: 6 stages of 3 + 5 buffers against 3 + 48; [L, P, D, D]).
    assert st.flush.ret_count_LPDD.shape[1] > 1
    for t, c, pre, lp in ((dev['steps'], st.steps.count_LPDD, '', 'LP'),
                          (dev['flush'], st.flush.ret_count_LPDD, 'ret_',
                           'LP')):
      np.testing.assert_array_equal(t[f'{pre}count_{lp}DD'], c)
      for i in np.ndindex(c.shape[:-2]):
        for src, dst in np.ndindex(c.shape[-2:]):
          assert t[f'{pre}recv_count_{lp}DD'][i + (dst, src)] == c[
              i + (src, dst)]
          assert (t[f'{pre}out_off_{lp}DD'][i + (src, dst)]
                  == c[i][:src, dst].sum())
        for k in range(D):
          assert t[f'{pre}depth_{lp}K'][i + (k,)] == max(
              c[i][s, (s + k) % D] for s in range(D))
  slots = jax.jit(lambda c, t: engine.fill_slots(None, c, t, mesh=mesh))(
      (jnp.asarray(rng.standard_normal((2, num_experts, 4)), jnp.float32),),
      dev['fill'])
  np.testing.assert_array_equal(slots[-1], se_MLS[0])


@pytest.mark.parametrize('mode,tree', [('exact', False), ('exact', True),
                                       ('rounds', True)])
def test_returns_in_backward_sends_the_flush_as_the_homes_cotangent(
    mesh, mode, tree):
  """`engine.returns_in_backward`, the RL update's flush hook: the forward
  is the identity on the slots; in the backward the homes' gradient sums
  so far come back as their cotangent, plus (flush active) every slot's
  accumulated gradient and its new one, each summed at its expert (numpy
  segment sum), or (inactive, every micro-step but the last) untouched:
  no zero-filled canonical gradient is made. The slots' own cotangent
  flows on either way. Single-stage exact is the CPU's in-place path;
  tree and rounds are the exchange's."""
  rng = np.random.default_rng(7)
  spd, num_experts, num_layers = 3, 16, 2
  topo = Topology(2, D // 2, spd)
  se_MLS = random_placements(rng, 1, num_layers, num_experts, topo.num_slots)
  budget = schedule.TransferBudget(step_rounds=(16 if tree else 4) * spd,
                                   microstep_rounds=4 * spd, mode=mode)
  st = schedule.build_step_transfer(se_MLS, num_experts, topo, budget)
  flush = engine.device_transition(st.flush)
  shapes = ((3, 2), (2,))
  slot_w = tuple(jnp.asarray(rng.standard_normal((num_layers, topo.num_slots)
                                                 + s), jnp.float32)
                 for s in shapes)
  acc, ct = (tuple(jnp.asarray(rng.standard_normal(w.shape), jnp.float32)
                   for w in slot_w) for _ in range(2))
  home = tuple(jnp.asarray(rng.standard_normal((num_layers, num_experts) + s),
                           jnp.float32) for s in shapes)
  specs = lambda tree_: jax.tree.map(lambda _: P(None, ep.EXPERT), tree_)

  def per_device(w, h, a, c, t, active):
    outs = []
    for l in range(num_layers):
      at = lambda x: tuple(v[l] for v in x)
      t_l = {k: v[l] for k, v in t.items()}
      f = lambda w_l, h_l: engine.returns_in_backward(w_l, h_l, at(a),
                                                      ((t_l, active),))
      y, vjp = jax.vjp(f, at(w), at(h))
      for got, want in zip(y, at(w)):  # The forward is the identity.
        assert got.shape == want.shape
      outs.append(vjp(at(c)))
    stack = lambda i: tuple(jnp.stack([o[i][j] for o in outs])
                            for j in range(len(shapes)))
    return stack(0), stack(1)

  run = jax.jit(jax.shard_map(
      per_device, mesh=mesh,
      in_specs=(specs(slot_w), specs(home), specs(acc), specs(ct),
                engine.transition_specs(flush), P()),
      out_specs=(specs(slot_w), specs(home))))
  for active in (False, True):
    ct_w, ct_home = run(slot_w, home, acc, ct, flush, jnp.asarray(active))
    for got, want in zip(ct_w, ct):
      np.testing.assert_array_equal(got, want)
    for leaf, (got, h) in enumerate(zip(ct_home, home)):
      want = np.array(h)
      if active:
        sent = np.asarray(acc[leaf]) + np.asarray(ct[leaf])
        for l in range(num_layers):
          np.add.at(want[l], se_MLS[0, l], sent[l])
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
      else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize('exchange', ['emulated', 'a2a'])
def test_returns_in_backward_chains_the_flush_and_a_moves_returns(
    mesh, monkeypatch, exchange):
  """With the exact exchanges the update returns the replicas a move
  evicts in the backward too, after the (switched-off) flush in the same
  hook: whichever return is active sends what it evicts (the flush every
  slot, the move the slots it evicts, numpy segment sums of acc + the new
  gradient), the other adds nothing, and `zero_evicted_local` then zeroes
  exactly the move's evicted slots' sums. 'emulated' is the CPU's in-place
  path, 'a2a' the ragged exchange's shape."""
  monkeypatch.setattr(engine, 'default_exchange', lambda: exchange)
  rng = np.random.default_rng(11)
  spd, num_experts, num_layers = 3, 16, 2
  topo = Topology(2, D // 2, spd)
  se_MLS = random_placements(rng, 2, num_layers, num_experts, topo.num_slots)
  budget = schedule.TransferBudget(step_rounds=4 * spd,
                                   microstep_rounds=4 * spd, mode='exact')
  st = schedule.build_step_transfer(se_MLS, num_experts, topo, budget)
  evict_LS = np.asarray(st.steps.evict_LS[0])
  assert 0 < evict_LS.sum() < evict_LS.size  # A move, not a flush.
  flush = engine.device_transition(st.flush)
  move = engine.device_transition(jax.tree.map(lambda x: x[0], st.steps))
  shapes = ((3, 2), (2,))
  draw = lambda lead: tuple(
      jnp.asarray(rng.standard_normal((num_layers, lead) + s), jnp.float32)
      for s in shapes)
  slot_w, acc, ct = draw(topo.num_slots), draw(topo.num_slots), draw(
      topo.num_slots)
  home = draw(num_experts)
  specs = lambda tree_: jax.tree.map(lambda _: P(None, ep.EXPERT), tree_)

  def per_device(w, h, a, c, tf, tm, on_flush, on_move):
    outs = []
    for l in range(num_layers):
      at = lambda x: tuple(v[l] for v in x)
      layer = lambda t: {k: v[l] for k, v in t.items()}
      returns = ((layer(tf), on_flush), (layer(tm), on_move))
      f = lambda w_l, h_l: engine.returns_in_backward(w_l, h_l, at(a),
                                                      returns)
      outs.append(jax.vjp(f, at(w), at(h))[1](at(c)))
    stack = lambda i: tuple(jnp.stack([o[i][j] for o in outs])
                            for j in range(len(shapes)))
    summed = tuple(x + y for x, y in zip(a, c))
    return stack(0), stack(1), engine.zero_evicted_local(summed, tm)

  run = jax.jit(jax.shard_map(
      per_device, mesh=mesh,
      in_specs=(specs(slot_w), specs(home), specs(acc), specs(ct),
                engine.transition_specs(flush), engine.transition_specs(move),
                P(), P()),
      out_specs=(specs(slot_w), specs(home), specs(acc))))
  for on_flush, on_move in ((False, True), (True, False)):
    ct_w, ct_home, zeroed = run(slot_w, home, acc, ct, flush, move,
                                jnp.asarray(on_flush), jnp.asarray(on_move))
    for leaf, (got, h) in enumerate(zip(ct_home, home)):
      np.testing.assert_array_equal(ct_w[leaf], ct[leaf])
      sent = np.asarray(acc[leaf]) + np.asarray(ct[leaf])
      np.testing.assert_allclose(
          zeroed[leaf], np.where(evict_LS.reshape(evict_LS.shape + (1,) * (
              sent.ndim - 2)), 0.0, sent), rtol=1e-6)
      want = np.array(h)
      for l in range(num_layers):
        # The flush returns the last placement's slots, the move the
        # first's it evicts.
        se_S = se_MLS[-1 if on_flush else 0, l]
        sends = np.ones(topo.num_slots, bool) if on_flush else evict_LS[l]
        np.add.at(want[l], se_S[sends], sent[l][sends])
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
