"""The device transfer engine moves exactly what the schedule says.

A sequence of random placements (replicas, relocations, slots that keep
their expert) on 8 simulated devices: after every transition each slot must
hold its expert's canonical weights, the ids that travelled with them must
match, and the gradients the slots accumulated must reach the canonical
experts exactly once (checked against a numpy segment sum).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


@pytest.fixture(scope='module')
def mesh():
  return ep.make_mesh(1, D)


@pytest.mark.parametrize('num_nodes,spd,num_experts', [(1, 2, 8), (2, 3, 16)])
def test_slots_hold_planned_experts_and_gradients_go_home(mesh, num_nodes, spd,
                                                          num_experts):
  rng = np.random.default_rng(spd)
  num_micro, num_layers = 4, 2
  topo = Topology(num_nodes, D // num_nodes, spd)
  se_MLS = random_placements(rng, num_micro, num_layers, num_experts,
                             topo.num_slots)
  budget = schedule.TransferBudget(step_rounds=4 * spd, microstep_rounds=4 * spd)
  st = schedule.build_step_transfer(se_MLS, num_experts, topo, budget)
  assert st.remote_fills_M()[1:].sum() > 0  # The sequence really moves experts.
  canon_L = [(rng.standard_normal((num_experts, 3, 2)).astype(np.float32),
              rng.standard_normal((num_experts, 2)).astype(np.float32))
             for _ in range(num_layers)]
  canon_L = [tuple(jnp.asarray(w) for w in c) for c in canon_L]
  fill = jax.jit(lambda s, c, t: engine.fill_slots(s, c, t, mesh=mesh))
  fill0 = jax.jit(lambda c, t: engine.fill_slots(None, c, t, mesh=mesh))
  ret = jax.jit(lambda g, c, t: engine.return_grads(g, c, t, mesh=mesh))
  errors = jax.jit(lambda s, se: engine.id_errors(s, se, mesh=mesh))

  steps = engine.device_transition(st.steps)
  slots_L = fill0(canon_L, engine.device_transition(st.fill))
  gslots_L = [tuple(jnp.zeros((topo.num_slots,) + w.shape[1:]) for w in c)
              for c in canon_L]
  gcanon_L = [tuple(jnp.zeros_like(w) for w in c) for c in canon_L]
  expect_L = [tuple(np.zeros(w.shape) for w in c) for c in canon_L]
  for m in range(num_micro):
    for l in range(num_layers):
      np.testing.assert_array_equal(slots_L[l][-1], se_MLS[m, l])
      for w_slot, w_canon in zip(slots_L[l][:-1], canon_L[l]):
        np.testing.assert_array_equal(w_slot, np.asarray(w_canon)[se_MLS[m, l]])
    assert int(errors(slots_L, jnp.asarray(se_MLS[m]))) == 0
    # This micro-step's slot gradients: random, accumulated per slot.
    g_L = [tuple(rng.standard_normal(g.shape).astype(np.float32) for g in gs)
           for gs in gslots_L]
    for l in range(num_layers):
      for e_acc, g in zip(expect_L[l], g_L[l]):
        np.add.at(e_acc, se_MLS[m, l], g)
    gslots_L = jax.tree.map(lambda a, b: a + b, gslots_L, g_L)
    t_m = {k: v[m] for k, v in steps.items()}
    slots_L = fill(slots_L, canon_L, t_m)
    gslots_L, gcanon_L = ret(gslots_L, gcanon_L, t_m)
  gslots_L, gcanon_L = ret(gslots_L, gcanon_L,
                           engine.device_transition(st.flush))
  for l in range(num_layers):
    for got, want in zip(gcanon_L[l], expect_L[l]):
      np.testing.assert_allclose(got, want, atol=1e-5)
    for g in gslots_L[l]:
      assert float(jnp.abs(g).max()) == 0.0  # The flush empties every slot.


def test_id_check_catches_a_wrong_schedule(mesh):
  rng = np.random.default_rng(0)
  topo = Topology(1, D, 2)
  se_MLS = random_placements(rng, 1, 1, 8, 16)
  st = schedule.build_step_transfer(se_MLS, 8, topo,
                                    schedule.TransferBudget(8, 8))
  canon_L = [(jnp.arange(8.0)[:, None] * jnp.ones((1, 4)),)]
  t = engine.device_transition(st.fill)
  fill = jax.jit(lambda t: engine.fill_slots(None, canon_L, t, mesh=mesh))
  errors = jax.jit(lambda s: engine.id_errors(s, jnp.asarray(se_MLS[0]),
                                              mesh=mesh))
  assert int(errors(fill(t))) == 0
  # Sending every device's first source instead: the ids give it away.
  t['send_LRD'] = jnp.zeros_like(t['send_LRD'])
  t['local_src_LS'] = jnp.where(t['local_src_LS'] >= 0, 2, -1)
  assert int(errors(fill(t))) > 0
