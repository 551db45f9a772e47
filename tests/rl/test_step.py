"""The RL step: replayed recompute equals the rollout; accumulation is exact;
moving experts between micro-steps changes no number; no expert all-gather."""
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from foremoe_jax import placement as placement_lib
from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.model import sharding, transformer
from foremoe_jax.rl import step as step_lib
from foremoe_jax.rl import trainer
from foremoe_jax.planner.topology import Topology
from foremoe_jax.rollout import sampler as sampler_lib
from foremoe_jax.tasks import get_task
from foremoe_jax.transfer import engine, schedule
from foremoe_jax.utils import hlo


@pytest.fixture(scope='module')
def setup():
  cfg = importlib.import_module('configs.tiny').get_config()
  mesh = ep.make_mesh(1, 8)
  model = transformer.Transformer(cfg.model, mesh, rngs=nnx.Rngs(3))
  graphdef, params = sharding.split_model(model, mesh)
  task = get_task('addition')
  sp = sampler_lib.SamplingParams(max_new_tokens=task.completion_len,
                                  num_generations=4)
  sampler = sampler_lib.Sampler(graphdef, cfg.model, mesh, sp)
  prompts = task.sample_prompts(0, 8)
  rollout = sampler(params, prompts, jax.random.key(0))
  rewards = np.random.default_rng(0).random(32).astype(np.float32)
  return cfg, mesh, graphdef, params, rollout, rewards


# A fill/flush budget of 32 makes the flush a reduction tree
# (schedule.flush_form: 6 stages of 2 + 3 experts against 2 + 32 at
# s = 2, h = 1), so the update's backward runs the tree here; the other
# RL tests' smaller budgets run it as one collective.
BUDGET = schedule.TransferBudget(step_rounds=32, microstep_rounds=8)


def _step_plan(placement, capacity=None, spd=2, budget=BUDGET):
  return step_lib.make_step_plan(placement, 8, Topology(1, 8, spd), budget,
                                 capacity)


def _plan(num_mb, num_layers, spd=2):
  return _step_plan(placement_lib.stack_placements(
      [placement_lib.identity_placement(num_layers, 8, 8, spd)] * num_mb))


def random_plan(rng, num_mb, num_layers, spd=2):
  """Placements with replicas that move between micro-steps, and shares
  that split each expert's tokens over its replicas at random."""
  num_slots = 8 * spd
  se, share = [], []
  prev = None
  for m in range(num_mb):
    se_LS = np.stack([rng.permutation(np.r_[np.arange(8), rng.integers(
        8, size=num_slots - 8)]) for _ in range(num_layers)]).astype(np.int32)
    if prev is not None:  # Keep about half of the slots: few moves.
      keep = rng.random(se_LS.shape) < 0.5
      cand = np.where(keep, prev, se_LS)
      ok = np.array([len(np.unique(c)) == 8 for c in cand])
      se_LS = np.where(ok[:, None], cand, se_LS)
    prev = se_LS
    raw = rng.random((num_layers, 8, num_slots)) + 0.05
    sums = np.zeros((num_layers, 8, 8))
    for l in range(num_layers):
      np.add.at(sums[l].T, se_LS[l], raw[l].T)
    share_LDS = raw / np.take_along_axis(
        sums, np.broadcast_to(se_LS[:, None], raw.shape), axis=2)
    se.append(se_LS)
    share.append(share_LDS.astype(np.float32))
  return placement_lib.Placement(np.stack(se), np.stack(share))


@functools.cache  # One jit per options: tests with the same shapes share it.
def _grads_fn(**kw):
  """jit(state, batch, plan) -> (grads, metrics): recompute (old and, with
  a reference policy, ref log-probs on the canonical layout) + update."""
  def fn(s, b, plan):
    logps = step_lib.recompute_logps(s, b, None, old=True,
                                     ref=s.ref_params is not None)
    return step_lib.update_grads(s, b, logps, plan, **kw)
  return jax.jit(fn)


@functools.cache
def _rl_step(learning_rate, **kw):
  """One RLStep (one pair of jitted halves) per options, shared by tests."""
  return step_lib.make_rl_step(step_lib.make_optimizer(learning_rate, 1.0),
                               **kw)


def _grads(state, batch, plan, **kw):
  return _grads_fn(**kw)(state, batch, plan)


def test_replayed_recompute_equals_rollout_logp(setup):
  cfg, mesh, graphdef, params, rollout, _ = setup
  # One micro-batch of every sample: [0] is the whole batch.
  batch = trainer.rl_batch_from_rollout(rollout, np.zeros(32), [np.arange(32)])
  full = {k: v[0] for k, v in batch.items() if k.endswith('_MbT')}
  logp, aux = jax.jit(lambda p, b, r: step_lib.token_logp(
      graphdef, p, b['tokens_MbT'], b['valid_MbT'], None, r, None))(
          params, full, batch['routes_MLbTK'][0])
  mask = full['loss_mask_MbT'] > 0
  assert mask.sum() > 32
  np.testing.assert_allclose(np.asarray(logp)[mask],
                             full['rollout_logp_MbT'][mask], atol=1e-5)
  # The forward with replayed routes uses exactly the recorded routes.
  valid_in = full['valid_MbT'][:, :-1]
  np.testing.assert_array_equal(
      np.asarray(aux.routes_LBTK)[:, valid_in],
      batch['routes_MLbTK'][0][:, valid_in])


# One case: 4 micro-batches of a shuffled order (contiguous micro-batches
# are the special case of the identity permutation). Its programs (1 and 4
# micro-batches, beta 0.05) are the ones test_moving_experts_changes_no_number
# and test_balance_loss_coef_reaches_router_only_through_its_term reuse.
@pytest.mark.parametrize('num_mb,shuffle', [(4, True)])
def test_accumulated_grads_equal_full_batch(setup, num_mb, shuffle):
  cfg, mesh, graphdef, params, rollout, rewards = setup
  tx = step_lib.make_optimizer(1e-3, 1.0)
  state = step_lib.init_train_state(graphdef, params, tx, mesh, with_ref=True)
  order = (np.random.default_rng(1).permutation(32) if shuffle
           else np.arange(32))
  kw = dict(num_generations=4, eps_low=0.2, eps_high=0.28, beta=0.05)
  num_layers = cfg.model.num_layers

  def grads(mbs):
    batch = trainer.rl_batch_from_rollout(rollout, rewards, mbs)
    batch = jax.tree.map(jnp.asarray, batch)
    return _grads(state, batch, _plan(len(mbs), num_layers), **kw)

  g_full, m_full = grads([np.arange(32)])
  g_acc, m_acc = grads(np.split(order, num_mb))
  leaves_full, leaves_acc = jax.tree.leaves(g_full), jax.tree.leaves(g_acc)
  assert max(float(jnp.abs(x).max()) for x in leaves_full) > 1e-4
  for a, b in zip(leaves_acc, leaves_full):
    np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4)
  np.testing.assert_allclose(m_acc['loss'], m_full['loss'], atol=1e-6)


def test_step_updates_params_and_compiles_once(setup):
  cfg, mesh, graphdef, params, rollout, rewards = setup
  tx = step_lib.make_optimizer(1e-2, 1.0)
  state = step_lib.init_train_state(graphdef, jax.tree.map(jnp.copy, params),
                                    tx, mesh, with_ref=False)
  rl_step = step_lib.make_rl_step(tx, num_generations=4, eps_low=0.2,
                                  eps_high=0.28, beta=0.0)
  batch = trainer.rl_batch_from_rollout(rollout, rewards,
                                        np.split(np.arange(32), 4))
  before = jax.tree.map(np.asarray, state.params)
  rng = np.random.default_rng(0)
  # jit caches are shared by every wrapper of the same function, so other
  # tests in this worker may have filled them: count what these calls add.
  cached = (rl_step.update._cache_size(), rl_step._recompute._cache_size())
  for _ in range(3):  # New placements and moves every step: same executable.
    plan = _step_plan(random_plan(rng, 4, cfg.model.num_layers))
    state, m = rl_step(state, batch, plan)
    assert int(m['transfer_id_errors']) == 0
  assert rl_step.update._cache_size() - cached[0] <= 1
  assert rl_step._recompute._cache_size() - cached[1] <= 1
  assert int(state.step) == 3
  assert float(m['grad_norm']) > 0
  moved = [not np.allclose(a, b) for a, b in
           zip(jax.tree.leaves(before), jax.tree.leaves(state.params))]
  assert all(moved)


def test_moving_experts_changes_no_number(setup):
  """A step whose micro-steps use random placements (replicas, moves
  between micro-steps, tokens split over replicas) equals the static-EP
  step: loss, gradients and updated parameters, f32."""
  cfg, mesh, graphdef, params, rollout, rewards = setup
  num_layers = cfg.model.num_layers
  # Adam's first step is lr * g / |g|: a gradient near zero turns rounding
  # into a whole step, so the parameter check uses a realistic lr.
  kw = dict(num_generations=4, eps_low=0.2, eps_high=0.28, beta=0.05)
  rl_step = _rl_step(1e-3, **kw)
  tx = rl_step.tx
  batch = jax.tree.map(jnp.asarray, trainer.rl_batch_from_rollout(
      rollout, rewards, np.split(np.random.default_rng(2).permutation(32), 4)))
  placement = random_plan(np.random.default_rng(5), 4, num_layers)
  moving = _step_plan(placement)
  st = schedule.build_step_transfer(placement.slot_expert, 8,
                                    Topology(1, 8, 2), BUDGET)
  assert st.remote_fills_M()[1:].sum() > 0  # Experts really move mid-step.
  # The flush in the last backward is a tree that passes sums on.
  assert st.flush.ret_count_LPDD[:, 1:].sum() > 0
  still = _plan(4, num_layers)
  out = {}
  grads_fn = _grads_fn(**kw)
  assert rl_step.num_update_epochs == 1  # The default: GRPO's mu = 1.

  @jax.jit
  def by_hand(state, grads):  # update_grads' gradient, one AdamW step.
    updates, _ = tx.update(grads, state.opt_state, state.params)
    return optax.apply_updates(state.params, updates)

  cached = rl_step.update._cache_size()  # Shared with other tests' steps.
  for name, plan in (('moving', moving), ('static', still)):
    state = step_lib.init_train_state(
        graphdef, jax.tree.map(jnp.copy, params), tx, mesh, with_ref=True)
    grads, m = grads_fn(state, batch, plan)
    want = jax.block_until_ready(by_hand(state, grads))
    new_state, m_step = rl_step(state, batch, plan)
    # mu = 1 is the single update: the recompute's gradient, one AdamW step.
    assert m_step['clip_frac_U'].shape == (1,)
    for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(want)):
      scale = float(jnp.abs(b).max())
      assert float(jnp.abs(a - b).max()) <= 1e-6 * scale, name
    out[name] = (grads, m, new_state.params)
  assert rl_step.update._cache_size() - cached <= 1
  (g_a, m_a, p_a), (g_b, m_b, p_b) = out['moving'], out['static']
  assert int(m_a['transfer_id_errors']) == 0
  # The loss cancels normalised advantages: its tolerance scales with them.
  np.testing.assert_allclose(m_a['loss'], m_b['loss'], rtol=1e-5,
                             atol=1e-6 * float(m_b['adv_abs_mean']))
  for tree_a, tree_b in ((g_a, g_b), (p_a, p_b)):
    for a, b in zip(jax.tree.leaves(tree_a), jax.tree.leaves(tree_b)):
      scale = float(jnp.abs(b).max())
      assert float(jnp.abs(a - b).max()) <= 1e-5 * scale + 1e-9


def test_compiled_step_gathers_no_expert_weights(setup):
  """Neither the recompute (here on a plan with moved experts) nor the
  update (fills, micro-steps, returns, optimizer) all-gathers a float:
  slots move by ppermute only."""
  cfg, mesh, graphdef, params, rollout, rewards = setup
  # test_moving_experts_changes_no_number's step (same options and shapes):
  # the update below is the program that test ran, from jax's cache.
  rl_step = _rl_step(1e-3, num_generations=4, eps_low=0.2, eps_high=0.28,
                     beta=0.05)
  state = step_lib.init_train_state(graphdef, params, rl_step.tx, mesh,
                                    with_ref=True)
  batch = jax.tree.map(jnp.asarray, trainer.rl_batch_from_rollout(
      rollout, rewards, np.split(np.arange(32), 4)))
  plan = _step_plan(random_plan(np.random.default_rng(1), 4,
                                cfg.model.num_layers))
  logps = rl_step.recompute(state, batch, plan)
  texts = [rl_step._recompute.lower(state, batch, plan, old=True, ref=True
                                    ).compile().as_text(),
           rl_step.update.lower(state, batch, logps, plan).compile().as_text()]
  # The moves are there (on CPU the exact exchange runs as shift rounds).
  update = hlo.collectives(texts[1])
  assert sum(c['kind'] == 'collective-permute' for c in update) > 0
  # The exact exchange as GPU/TPU run it (one collective per layer, here
  # its all_to_all stand-in 'a2a') sits in the scan over layers and in no
  # conditional, so XLA may overlap it with compute; the shift-round
  # engine's permutes all sit in the lax.switch picking each round's shift.
  canon = (jnp.zeros((cfg.model.num_layers, 8, 2)),)
  for mode, exchange, nested in (('exact', 'a2a', False),
                                 ('rounds', None, True)):
    t = _step_plan(plan.placement, budget=BUDGET._replace(mode=mode)
                   ).transfer['fill']
    fill = jax.jit(lambda c, t, x=exchange: engine.fill_slots(
        None, c, t, mesh=mesh, exchange=x))
    moves = [c for c in hlo.collectives(fill.lower(canon, t).compile()
                                        .as_text())
             if c['kind'] in ('all-to-all', 'collective-permute')]
    assert moves and all(c['in_conditional'] == nested for c in moves), (
        mode, moves)
  # The only gathers are the exact dispatch's int32 slot counts, [D, S]
  # per MoE layer: no weight, gradient or activation is ever gathered.
  for text in texts:
    gathers = hlo.all_gathers(text)
    assert gathers and all(g == ('s32', 8 * 16) for g in gathers), gathers
  # ... and the check itself finds the gather of the reference path.
  w_gate = nnx.merge(graphdef, params).segments[0].ffn.w_gate[...][0]
  ref = jax.jit(lambda w, se: ep.gather_slot_weights(w, se, mesh=mesh))
  text = ref.lower(w_gate, jnp.zeros(16, jnp.int32)).compile().as_text()
  assert hlo.all_gather_bytes(text, min_elements=w_gate.size) > 0


def test_balance_loss_coef_reaches_router_only_through_its_term(setup):
  cfg, mesh, graphdef, params, rollout, rewards = setup
  tx = step_lib.make_optimizer(1e-3, 1.0)
  # The full-batch program (beta 0.05, with a reference) of
  # test_accumulated_grads_equal_full_batch: coef 0 is its default, so g0
  # comes from jax's cache there; only coef 1 compiles here.
  state = step_lib.init_train_state(graphdef, params, tx, mesh, with_ref=True)
  batch = jax.tree.map(jnp.asarray, trainer.rl_batch_from_rollout(
      rollout, rewards, [np.arange(32)]))
  plan = _plan(1, cfg.model.num_layers)
  kw = dict(num_generations=4, eps_low=0.2, eps_high=0.28, beta=0.05)

  g0, m0 = _grads(state, batch, plan, **kw)  # balance_loss_coef = 0.0.
  g1, m1 = _grads(state, batch, plan, **kw, balance_loss_coef=1.0)
  assert float(m1['balance_loss']) >= 1.0 - 1e-5  # Switch loss: >= 1, = 1 at balance.
  router = lambda g: g['segments'][0]['ffn']['router']['kernel'][...][0]
  assert float(jnp.abs(router(g1) - router(g0)).max()) > 1e-6
  # The last layer's experts feed no router, and replayed routes fix the
  # dispatch: the balance term cannot reach them.
  last = cfg.model.num_layers - 1
  expert = lambda g: g['segments'][0]['ffn']['w_up'][...][last]
  np.testing.assert_allclose(expert(g1), expert(g0), atol=1e-7)


@pytest.mark.parametrize('mu,source,beta,passes', [
    (1, 'recompute', 0.0, 0), (1, 'rollout', 0.05, 1), (2, 'recompute', 0.0, 1),
    (2, 'recompute', 0.05, 2), (2, 'rollout', 0.05, 1)])
def test_recompute_runs_only_the_forwards_the_step_needs(mu, source, beta,
                                                         passes):
  rl_step = step_lib.make_rl_step(
      step_lib.make_optimizer(1e-3, 1.0), num_generations=4, eps_low=0.2,
      eps_high=0.28, beta=beta, num_update_epochs=mu, old_logp_source=source)
  assert rl_step.recompute_forward_passes() == passes


@pytest.mark.parametrize('mu', [1, 2])
def test_lean_step_equals_the_step_with_a_recompute(setup, mu):
  """At one update epoch the update's own detached log-probs stand in for
  the old ones (no forward: the recompute returns nothing); at two, the
  sampler's log-probs do. Both give the losses, gradients and parameters
  the step with a recomputed old policy gives. At mu = 1 the optimizer is
  SGD with rate 1, so the parameters' change is the whole gradient, leaf
  by leaf; at mu = 2 it is Adam, whose second epoch runs on the first's
  parameters (each epoch's loss and gradient norm are compared)."""
  cfg, mesh, graphdef, params, rollout, rewards = setup
  lr = 1e-3
  tx = optax.sgd(1.0) if mu == 1 else step_lib.make_optimizer(lr, 1.0)
  kw = dict(num_generations=4, eps_low=0.2, eps_high=0.28, beta=0.0,
            num_update_epochs=mu)
  batch = trainer.device_batch(trainer.rl_batch_from_rollout(
      rollout, rewards, np.split(np.arange(32), 4)), mesh)
  plan = _step_plan(random_plan(np.random.default_rng(4), 4,
                                cfg.model.num_layers))
  lean = step_lib.make_rl_step(tx, old_logp_source='rollout', **kw)
  full = step_lib.make_rl_step(tx, old_logp_source='recompute', **kw)
  assert lean.recompute_forward_passes() == 0
  out = {}
  for name, rl_step in (('lean', lean), ('full', full)):
    state = step_lib.init_train_state(
        graphdef, jax.tree.map(jnp.copy, params), tx, mesh, with_ref=False)
    logps = rl_step.recompute(state, batch)
    if name == 'lean':
      assert 'old_logp_MbT' not in logps or mu > 1
    elif mu == 1:  # The old policy's forward, at mu = 1 asked for explicitly.
      logps = step_lib.recompute_logps(state, batch, None, old=True,
                                       ref=False)
    else:  # At mu = 2 the step's own recompute ran it.
      assert rl_step.recompute_passes(False)['old']
      # Its gap to the sampler is a metric the update only passes on: without
      # it, and laid out as the batch's log-probs (the same devices: the data
      # axis has size 1), the update's inputs are the lean step's, so both
      # steps run one program (compiled once, from jax's cache the second
      # time). The values are untouched.
      assert set(logps) == {'old_logp_MbT', 'rollout_vs_recompute_logp_max_abs'}
      assert float(logps['rollout_vs_recompute_logp_max_abs']) < 1e-4
      logps = {'old_logp_MbT': jax.device_put(
          logps['old_logp_MbT'], batch['rollout_logp_MbT'].sharding)}
    new_state, m = rl_step.update(state, batch, logps, plan)
    out[name] = (jax.device_get(new_state.params), jax.device_get(m))
  (p_lean, m_lean), (p_full, m_full) = out['lean'], out['full']
  # The sampler's log-probs are the recompute's up to rounding.
  assert float(m_lean['rollout_vs_update_logp_max_abs']) < 1e-4
  np.testing.assert_allclose(m_lean['ratio_mean_U'], m_full['ratio_mean_U'],
                             rtol=1e-4)
  # The loss is a cancellation of normalised advantages: compared at a
  # tolerance scaled to its terms. The old log-probs' rounding (< 1e-4)
  # moves each ratio by about as much, so the gradients agree to ~1e-4.
  np.testing.assert_allclose(m_lean['loss_U'], m_full['loss_U'], rtol=1e-3,
                             atol=1e-4 * float(m_full['adv_abs_mean']))
  np.testing.assert_allclose(m_lean['grad_norm_U'], m_full['grad_norm_U'],
                             rtol=1e-3)
  assert float(m_full['grad_norm_U'][0]) > 1e-3  # A gradient to compare.
  p0 = jax.device_get(params)
  if mu == 1:
    # SGD at rate 1: each parameter moved by minus its gradient.
    for w0, a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p_lean),
                        jax.tree.leaves(p_full)):
      g_lean, g_full = w0 - a, w0 - b
      np.testing.assert_allclose(
          g_lean, g_full, rtol=1e-3,
          atol=1e-3 * float(np.abs(g_full).max()) + 1e-7)
  else:
    # Adam moves every parameter by about the learning rate an epoch,
    # whatever its gradient's size, so the old log-probs' rounding can tilt
    # a tiny gradient's step: bound the difference by a fraction of a step.
    for a, b in zip(jax.tree.leaves(p_lean), jax.tree.leaves(p_full)):
      assert float(np.abs(a - b).max()) <= 2e-2 * lr


def test_recompute_on_a_step_level_plan_equals_the_canonical_layout(setup):
  """The recompute on a placement with replicas (filled once, no moves)
  gives the canonical layout's log-probs, old and reference."""
  cfg, mesh, graphdef, params, rollout, rewards = setup
  tx = step_lib.make_optimizer(1e-3, 1.0)
  state = step_lib.init_train_state(graphdef, params, tx, mesh, with_ref=True)
  batch = trainer.device_batch(trainer.rl_batch_from_rollout(
      rollout, rewards, np.split(np.arange(32), 4)), mesh)
  one = random_plan(np.random.default_rng(6), 1, cfg.model.num_layers)
  held = placement_lib.Placement(np.repeat(one.slot_expert, 4, axis=0),
                                 np.repeat(one.slot_share, 4, axis=0))
  plan = _step_plan(held)
  fn = jax.jit(step_lib.recompute_logps, static_argnames=('old', 'ref'))
  a = fn(state, batch, plan, old=True, ref=True)
  b = fn(state, batch, None, old=True, ref=True)
  for k in ('old_logp_MbT', 'ref_logp_MbT'):
    np.testing.assert_allclose(a[k], b[k], atol=2e-6)
  assert float(a['rollout_vs_recompute_logp_max_abs']) < 1e-4


def test_target_logp_in_chunks_equals_full_logits():
  """Chunked target log-probs (never the whole [N, V] logits) equal
  log_softmax of the full logits at the targets, value and gradient,
  including a last chunk that is padded."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(37, 8)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(8, 50)), jnp.float32)
  t = jnp.asarray(rng.integers(0, 50, 37), jnp.int32)

  def full(x, w):
    return jnp.take_along_axis(jax.nn.log_softmax(x @ w), t[:, None], -1)[:, 0]

  def chunked(x, w):
    return step_lib.target_logp(lambda h: h @ w, x, t, chunk=8)

  np.testing.assert_allclose(chunked(x, w), full(x, w), rtol=1e-6, atol=1e-6)
  g_c = jax.grad(lambda x, w: chunked(x, w).sum(), (0, 1))(x, w)
  g_f = jax.grad(lambda x, w: full(x, w).sum(), (0, 1))(x, w)
  for a, b in zip(g_c, g_f):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _assert_slots_hold(slots, slot_expert_LS, state, graphdef):
  """The slot buffers hold the ids and the policy's weights of the
  experts slot_expert_LS names."""
  np.testing.assert_array_equal(slots[3], slot_expert_LS)
  canon = step_lib.canonical_experts(state.params, step_lib._moe_layers(
      graphdef, state.params)[1])
  for w, c in zip(slots[:3], canon):
    np.testing.assert_array_equal(w, np.take_along_axis(
        np.asarray(c), slot_expert_LS[:, :, None, None], axis=1
    ).astype(w.dtype))


def test_recompute_prefill_is_the_update_fill(setup):
  """The recompute fills the policy's experts into its step-level slots
  (a chunk of layers per micro-step under its forward); the update starting
  from them, with a fill of only what micro-step 0 changes, equals the
  update that fills from home: same log-probs, same new parameters, every
  slot holding the expert its plan names."""
  cfg, mesh, graphdef, params, rollout, rewards = setup
  num_layers = cfg.model.num_layers
  kw = dict(num_generations=4, eps_low=0.2, eps_high=0.28, beta=0.05)
  rl_step = _rl_step(1e-3, **kw)
  batch = jax.tree.map(jnp.asarray, trainer.rl_batch_from_rollout(
      rollout, rewards, np.split(np.random.default_rng(4).permutation(32), 4)))
  # The recompute's step-level placement: one placement for every micro-step.
  level = random_plan(np.random.default_rng(8), 1, num_layers)
  level = placement_lib.stack_placements(
      [jax.tree.map(lambda x: x[0], level)] * 4)
  rplan = _step_plan(level)
  moving = random_plan(np.random.default_rng(9), 4, num_layers)
  topo = Topology(1, 8, 2)
  start_LS = np.asarray(level.slot_expert[0])
  st = schedule.build_step_transfer(moving.slot_expert, 8, topo, BUDGET,
                                    start_LS=start_LS)
  full = schedule.build_step_transfer(moving.slot_expert, 8, topo, BUDGET)
  # Only the slots micro-step 0 changes move, and no gradient goes home.
  assert 0 < st.fill.remote_fills_L.sum() < full.fill.remote_fills_L.sum()
  assert schedule.remote_returns(st.fill) == 0
  delta = step_lib.StepPlan(jax.tree.map(jnp.asarray, moving),
                            engine.device_step_transfer(st), None)
  own = _step_plan(moving)
  state = step_lib.init_train_state(graphdef, jax.tree.map(jnp.copy, params),
                                    rl_step.tx, mesh, with_ref=True)
  assert rl_step.can_prefill(rplan, True)
  assert not rl_step.can_prefill(step_lib.CanonicalLayout(None), True)
  logps = rl_step.recompute(state, batch, rplan, prefill=True)
  plain = rl_step.recompute(state, batch, rplan)
  np.testing.assert_array_equal(logps['ref_logp_MbT'], plain['ref_logp_MbT'])
  # The prefilled slots are the step-level placement's, with the policy's
  # weights (here the same as the reference's: with_ref copies them).
  _assert_slots_hold(logps['prefill_slots'], start_LS, state, graphdef)
  cached = rl_step.update._cache_size()
  out = {}
  for name, (lp, plan) in (('prefilled', (logps, delta)),
                           ('own fill', (plain, own))):
    s = step_lib.init_train_state(graphdef, jax.tree.map(jnp.copy, params),
                                  rl_step.tx, mesh, with_ref=True)
    new, m = rl_step.update(s, batch, lp, plan)
    assert int(m['transfer_id_errors']) == 0, name
    out[name] = (new.params, m)
  assert rl_step.update._cache_size() - cached <= 2
  (p_a, m_a), (p_b, m_b) = out['prefilled'], out['own fill']
  np.testing.assert_allclose(m_a['loss'], m_b['loss'], rtol=1e-6,
                             atol=1e-6 * float(m_b['adv_abs_mean']))
  # The two fills return the replicas' gradients in another order, so the
  # sums differ in their last bits; Adam divides each by its own RMS, and
  # an element whose gradient is a cancellation near Adam's eps (1e-8) turns
  # that into a visible part of its step (at most lr). Hence the parameters
  # agree to 1/200 of a step: once the slot ranges' sum changed order they
  # were up to 2.1e-6 apart (the experts' weights; 7.5e-7 elsewhere),
  # past the bound of 1e-6 x their scale this test had.
  lr = 1e-3
  for a, b in zip(jax.tree.leaves(p_a), jax.tree.leaves(p_b)):
    scale = float(jnp.abs(b).max())
    assert float(jnp.abs(a - b).max()) <= 1e-6 * scale + 5e-3 * lr
  # A prefill needs slots to fill and a single epoch.
  with pytest.raises(ValueError, match='prefill'):
    rl_step.recompute(state, batch, step_lib.CanonicalLayout(None),
                      prefill=True)


def test_compiled_prefill_and_flush_sit_in_no_conditional(setup,
                                                         monkeypatch):
  """The recompute's prefill, as GPU/TPU run it (one exchange per layer,
  here the engine's all_to_all stand-in 'a2a'), is issued in the scan over
  micro-steps beside the forward and in no conditional, so XLA may overlap
  it with the forward's compute; in the update, every exchange (the
  fill, the moves, the returns, and the flush inside the last
  micro-step's backward over layers) sits in a loop and in no
  conditional too, and the moves' fills and returns share their
  computation with the layers' matmuls."""
  cfg, mesh, graphdef, params, rollout, rewards = setup
  monkeypatch.setattr(engine, 'default_exchange', lambda: 'a2a')
  tx = step_lib.make_optimizer(1e-3, 1.0)
  state = step_lib.init_train_state(graphdef, params, tx, mesh, with_ref=True)
  batch = jax.tree.map(jnp.asarray, trainer.rl_batch_from_rollout(
      rollout, rewards, np.split(np.arange(32), 4)))
  level = random_plan(np.random.default_rng(3), 1, cfg.model.num_layers)
  plan = _step_plan(placement_lib.stack_placements(
      [jax.tree.map(lambda x: x[0], level)] * 4))
  # A fresh function to trace (jax caches traces by function): the
  # engine's exchange is read when the program is traced.
  def recompute(*args, **kw):
    return step_lib.recompute_logps(*args, **kw)
  fn = jax.jit(recompute, static_argnames=('old', 'ref', 'prefill'))
  a2a, no_matmul, prefilled = {}, {}, None
  for prefill in (False, True):
    compiled = fn.lower(state, batch, plan, old=False, ref=True,
                        prefill=prefill).compile()
    text = compiled.as_text()
    a2a[prefill] = [c for c in hlo.collectives(text)
                    if c['kind'] == 'all-to-all']
    computes = hlo.compute_computations(text)
    no_matmul[prefill] = sum(c['computation'] not in computes
                             for c in a2a[prefill])
    if prefill:
      prefilled = compiled(state, batch, plan)['prefill_slots']
  assert len(a2a[True]) > len(a2a[False])  # The prefill's exchanges.
  assert not any(c['in_conditional'] for c in a2a[True]), a2a[True]
  assert all(c['in_loop'] for c in a2a[True])
  # ... all of them where the forward runs (beside its scan over layers,
  # which an asynchronous collective may span).
  assert no_matmul[True] == no_matmul[False], no_matmul
  # And they fill what the plan says: the step-level placement's experts.
  _assert_slots_hold(prefilled, np.asarray(level.slot_expert[0]), state,
                     graphdef)
  rl_step = _rl_step(1e-3, num_generations=4, eps_low=0.2, eps_high=0.28,
                     beta=0.05)

  def update(*args):
    return rl_step.update.__wrapped__(*args)
  # Shapes are all the lowering needs: no recompute is compiled or run.
  logps = jax.eval_shape(
      lambda s, b, p: step_lib.recompute_logps(s, b, p, old=False, ref=True),
      state, batch, plan)
  moving = _step_plan(random_plan(np.random.default_rng(1), 4,
                                  cfg.model.num_layers))
  compiled = jax.jit(update).lower(state, batch, logps, moving).compile()
  text = compiled.as_text()
  found = [c for c in hlo.collectives(text) if c['kind'] == 'all-to-all']
  # Fill, moves, returns and flush: four exchanges per layer's scan at
  # least, beside the token dispatch's.
  assert len(found) >= len(a2a[False]) + 4, found
  assert not any(c['in_conditional'] for c in found), found
  assert all(c['in_loop'] for c in found)
  # The moves' fills run in micro-step m's forward and the returns of the
  # replicas they evict in its backward, each layer's in the computation
  # of its matmuls, where the latency-hiding scheduler may overlap them;
  # in scans of their own (as the CPU emulation runs them) they could only
  # run before or after the forward and backward, since a loop's
  # collectives cannot leave its body. As many exchanges either way (the
  # rematerialised backward does not fill again), 7 fewer where no matmul
  # is: the fills' 4 (3 weights and the ids), the returns' 3 (the weights'
  # gradients).
  monkeypatch.setattr(engine, 'moves_in_layers', lambda t: False)

  def update_apart(*args):
    return rl_step.update.__wrapped__(*args)
  apart_text = jax.jit(update_apart).lower(state, batch, logps, moving
                                           ).compile().as_text()
  apart = [c for c in hlo.collectives(apart_text)
           if c['kind'] == 'all-to-all']
  def no_matmul(cs, t):
    computes = hlo.compute_computations(t)
    return sum(c['computation'] not in computes for c in cs)
  assert len(apart) == len(found)
  assert no_matmul(apart, apart_text) == no_matmul(found, text) + 7
  # And the numbers are the CPU emulation's (fills in place, returns
  # added in another order: f32 rounding): the update this test compiled,
  # run against the default one (both as test_moving_experts_changes_no_
  # number and test_compiled_step_gathers_no_expert_weights compile them).
  logps = rl_step.recompute(state, batch, moving)
  got = compiled(state, batch, logps, moving)
  want = rl_step.update(jax.tree.map(jnp.copy, state), batch, logps, moving)
  assert int(got[1]['transfer_id_errors']) == 0
  for a, b in zip(jax.tree.leaves(got[0].params),
                  jax.tree.leaves(want[0].params)):
    assert float(jnp.abs(a - b).max()) <= 1e-6 * float(jnp.abs(b).max())

