"""Data parallelism: on a (data, expert) = (2, 4) mesh the trainer's RL step
(foresight -> plan -> capacity bucket -> recompute -> update) equals the
static, dropless step on a (1, 8) mesh, and its capacity bucket is the
smallest dropless one for the cells each data group really dispatches,
counted here from the routes with the split rule re-derived token by token.

One MoE layer and a short task keep the compiles few and small.
"""
import importlib
import types

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from foremoe_jax import config as config_lib
from foremoe_jax import placement as placement_lib
from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.model import moe, sharding, transformer
from foremoe_jax.rl import step as step_lib
from foremoe_jax.rl import trainer
from foremoe_jax.tasks import get_task
from foremoe_jax.utils import hlo

NUM_EXPERTS, TOP_K, SPD = 8, 2, 3
PROMPTS, NUM_GEN, NUM_MB = 16, 4, 2  # 64 samples, 32 per micro-step.


def _config(num_data, num_expert, fsdp=False, fsdp_axes='data'):
  cfg = importlib.import_module('configs.tiny').get_config()
  m = cfg.model
  m.num_layers, m.num_experts, m.top_k = 1, NUM_EXPERTS, TOP_K
  cfg.parallel.num_data, cfg.parallel.num_expert = num_data, num_expert
  cfg.parallel.slots_per_device = SPD
  cfg.parallel.fsdp = fsdp
  cfg.parallel.fsdp_axes = fsdp_axes
  cfg.rl.prompts_per_step, cfg.rl.num_generations = PROMPTS, NUM_GEN
  cfg.rl.num_microbatches = NUM_MB
  cfg.planner.deadline_ms = 60_000.0  # Never the fallback: test the plan.
  # Compile time grows with the static transfer rounds and the reference
  # policy's second recompute. D - 1 = 3 fill rounds is the least that
  # leaves this plan its replicas; beta does not touch data parallelism.
  cfg.transfer.step_rounds, cfg.transfer.microstep_rounds = 3, 1
  cfg.rl.beta = 0.0
  config_lib.validate_config(cfg)
  return cfg


def _rollout(task, seed=0):
  """A rollout-shaped record: tokens, padding after random completion
  lengths, and routes skewed towards experts 0 and 1 (so the planner
  replicates them)."""
  rng = np.random.default_rng(seed)
  b, t = PROMPTS * NUM_GEN, task.sequence_len
  plen = t - task.completion_len
  tokens = rng.integers(1, 16, (b, t)).astype(np.int32)
  lengths = rng.integers(plen + 2, t + 1, b)
  valid = np.arange(t)[None] < lengths[:, None]
  p_E = np.r_[4.0, 3.0, np.ones(NUM_EXPERTS - 2)]
  keys = rng.random((1, b, t, NUM_EXPERTS)) ** (1.0 / p_E)  # Weighted draw.
  routes = np.argsort(-keys, axis=-1)[..., :TOP_K].astype(np.int8)
  return types.SimpleNamespace(
      prompt_len=plen, tokens_BT=tokens, valid_BT=valid, routes_LBTK=routes,
      logp_BC=np.zeros((b, task.completion_len), np.float32))


def numpy_cells_MGLDD(routes_LBTK, valid_BT, microbatches, placements,
                      d_data, d_ep):
  """[M, G, L, D_src, D_dst]: rows each (data group, source) sends each
  destination device, from the routes token by token.

  Tokens of micro-batch m flatten row-major into d_data * d_ep data-major
  shards; a shard ranks its assignments to each expert in token order and
  gives the expert's replicas (slot order) the rank ranges
  [round(lo n), round(hi n)), lo the float32 sum of the earlier replicas'
  shares; a slot's rows go to device slot // s.
  """
  num_micro = len(microbatches)
  out = np.zeros((num_micro, d_data, routes_LBTK.shape[0], d_ep, d_ep),
                 np.int64)
  for m, idx in enumerate(microbatches):
    se_LS = placements[m].slot_expert
    share_LDS = placements[m].slot_share
    spd = se_LS.shape[1] // d_ep
    ids_IK = routes_LBTK[:, idx].reshape(routes_LBTK.shape[0], -1, TOP_K)
    ok_I = valid_BT[idx].reshape(-1)
    per = ok_I.size // (d_data * d_ep)
    for l in range(ids_IK.shape[0]):
      for shard in range(d_data * d_ep):
        g, src = divmod(shard, d_ep)
        rows = slice(shard * per, (shard + 1) * per)
        e_A = ids_IK[l, rows][ok_I[rows]].reshape(-1)
        n_E = np.bincount(e_A, minlength=NUM_EXPERTS)
        cell_D = np.zeros(d_ep, np.int64)
        for e in range(NUM_EXPERTS):
          lo = np.float32(0)
          for j in np.flatnonzero(se_LS[l] == e):
            hi = lo + np.float32(share_LDS[l, src, j])
            n = np.float32(n_E[e])
            start = int(np.floor(lo * n + np.float32(0.5)))
            stop = int(np.floor(hi * n + np.float32(0.5)))
            cell_D[j // spd] += stop - start
            lo = hi
        out[m, g, l, src] = cell_D
  return out


def numpy_received_MG(cells_MGLDD):
  """[M, G]: the most rows any device receives (over layers) per data
  group: what the exact dispatch's receive buffer must hold."""
  return cells_MGLDD.sum(axis=3).max(axis=(2, 3))


def _smallest_dropless(demand, buckets):
  return min(c for c in buckets if c >= demand)


def _state(cfg, mesh, ctx):
  model = transformer.Transformer(cfg.model, mesh, rngs=nnx.Rngs(0))
  graphdef, params = sharding.split_model(
      model, mesh, **sharding.fsdp_options(cfg.parallel))
  return step_lib.init_train_state(graphdef, params, ctx.rl_step.tx, mesh,
                                   with_ref=cfg.rl.beta > 0)


def _context(cfg, mesh, task):
  graphdef = nnx.split(nnx.eval_shape(lambda: transformer.Transformer(
      cfg.model, mesh, rngs=nnx.Rngs(0))))[0]
  return trainer.make_rl_context(cfg, graphdef, mesh, task)


def _trainer_step(cfg, mesh, task, ro, mbs, batch, logps=None):
  """foresight -> plan -> recompute -> update, as `trainer.rl_iteration`;
  given `logps`, those stand in for the recompute."""
  ctx = _context(cfg, mesh, task)
  try:
    loads_MGLDE = trainer.foresight(ctx, ro, mbs)
    planned = trainer.plan_async(ctx, loads_MGLDE).result()
    assert ctx.planner.num_fallbacks == 0
  finally:
    ctx.planner.close()
  state = _state(cfg, mesh, ctx)
  params0 = jax.device_get(state.params)
  if logps is None:
    logps = trainer.recompute(ctx, state, batch, loads_MGLDE)[0]
  shardings = jax.tree.map(lambda x: x.sharding, state)
  new_state, m = trainer.update(ctx, state, batch, logps, planned)
  return dict(ctx=ctx, loads=loads_MGLDE, planned=planned, metrics=m,
              logps=logps,
              params=jax.device_get(new_state.params),
              static=trainer.static_capacity(ctx, loads_MGLDE),
              shardings=shardings, params0=params0,
              new_shardings=jax.tree.map(lambda x: x.sharding, new_state))


@pytest.fixture(scope='module')
def dp_run():
  """The trainer's step on (2, 4), without and with FSDP, and the static
  dropless step on (1, 8)."""
  task = get_task('addition')
  ro = _rollout(task)
  rewards = np.random.default_rng(1).random(PROMPTS * NUM_GEN)
  mbs = np.split(np.random.default_rng(2).permutation(PROMPTS * NUM_GEN),
                 NUM_MB)
  host_batch = trainer.rl_batch_from_rollout(ro, rewards, mbs)
  batch = trainer.device_batch(host_batch, ep.make_mesh(2, 4))
  out = {'ro': ro, 'mbs': mbs, 'dp_batch': batch}

  mesh = ep.make_mesh(2, 4)
  out['dp'] = _trainer_step(_config(2, 4), mesh, task, ro, mbs, batch)
  # FSDP reuses those old log-probs (one compile fewer): its update runs the
  # same forward, on data-sharded weights, and must match the reference.
  out['fsdp'] = _trainer_step(_config(2, 4, fsdp=True), mesh, task, ro, mbs,
                              batch, logps=out['dp']['logps'])
  # ZeRO over every device: the same, split 8 ways over ('data', 'expert').
  out['fsdp_all'] = _trainer_step(
      _config(2, 4, fsdp=True, fsdp_axes='data+expert'), mesh, task, ro, mbs,
      batch, logps=out['dp']['logps'])

  cfg = _config(1, 8)
  mesh = ep.make_mesh(1, 8)
  ctx = _context(cfg, mesh, task)
  ctx.planner.close()
  state = _state(cfg, mesh, ctx)
  out['ref_params0'] = jax.device_get(state.params)
  # The same seed builds the same weights on every mesh and layout.
  for run in ('dp', 'fsdp', 'fsdp_all'):
    for a, b in zip(jax.tree.leaves(out[run]['params0']),
                    jax.tree.leaves(out['ref_params0'])):
      np.testing.assert_array_equal(a, b)
  identity = placement_lib.stack_placements([ctx.identity] * NUM_MB)
  plan = step_lib.make_step_plan(identity, NUM_EXPERTS, ctx.topo, ctx.budget,
                                 capacity=ctx.buckets[-1])  # Dropless.
  new_state, m = ctx.rl_step(state, trainer.device_batch(host_batch, mesh),
                             plan)
  out['ref'] = dict(metrics=jax.device_get(m),
                    params=jax.device_get(new_state.params))
  return out


def _assert_same_step(dp, ref, params0):
  m = dp['metrics']
  assert int(m['dropped']) == 0 and int(ref['metrics']['dropped']) == 0
  assert int(m['transfer_id_errors']) == 0
  # The loss is a cancellation of normalised advantages (its value sits at
  # float32 noise), so its tolerance scales with its terms, the advantages;
  # the gradients and parameters below carry the information.
  loss_atol = 1e-6 * float(ref['metrics']['adv_abs_mean'])
  np.testing.assert_allclose(m['loss'], ref['metrics']['loss'], rtol=1e-5,
                             atol=loss_atol)
  np.testing.assert_allclose(m['grad_norm'], ref['metrics']['grad_norm'],
                             rtol=1e-5)
  moved = 0
  for a, b, b0 in zip(jax.tree.leaves(dp['params']),
                      jax.tree.leaves(ref['params']),
                      jax.tree.leaves(params0)):
    scale = float(np.abs(b).max())
    assert float(np.abs(a - b).max()) <= 1e-5 * scale + 1e-9
    moved += not np.array_equal(b, b0)
  assert moved == len(jax.tree.leaves(ref['params']))


def test_dp_step_equals_static_dropless_step_on_one_data_group(dp_run):
  dp, ref = dp_run['dp'], dp_run['ref']
  assert dp['planned'].capacity < dp['ctx'].buckets[-1]  # Not dropless.
  # The plan is not the home layout: replicas and splits are exercised.
  home = placement_lib.stack_placements([dp['ctx'].identity] * NUM_MB)
  assert not np.array_equal(dp['planned'].plan.placement.slot_expert,
                            home.slot_expert)
  _assert_same_step(dp, ref, dp_run['ref_params0'])


def test_fsdp_step_equals_reference_and_keeps_its_sharding(dp_run):
  """parallel.fsdp: non-expert parameters and their Adam moments split over
  'data', experts over 'expert'; the step's numbers do not change, and it
  returns the state in the layout it got (the next call reuses the
  executable)."""
  fsdp = dp_run['fsdp']
  _assert_same_step(fsdp, dp_run['ref'], dp_run['ref_params0'])
  assert fsdp['planned'].capacity == dp_run['dp']['planned'].capacity
  specs = [s.spec for s in jax.tree.leaves(fsdp['shardings'].params)]
  assert P(None, 'expert') in specs  # Stacked layers, then E.
  assert sum('data' in tuple(s) for s in specs) >= len(specs) // 2
  # Adam's moments are laid out like the parameters.
  opt_specs = {s.spec for s in jax.tree.leaves(fsdp['shardings'].opt_state)}
  assert set(specs) <= opt_specs
  assert fsdp['new_shardings'] == fsdp['shardings']


def test_fsdp_over_every_device_equals_reference(dp_run):
  """parallel.fsdp_axes='data+expert': the non-expert state split 8 ways,
  over both mesh axes (the 'expert' axis of a data group holds different
  shards, not copies); same numbers, same layout returned."""
  zero = dp_run['fsdp_all']
  _assert_same_step(zero, dp_run['ref'], dp_run['ref_params0'])
  specs = [s.spec for s in jax.tree.leaves(zero['shardings'].params)]
  both = P(('data', 'expert'))
  split = [s for s in specs if any(a == both[0] for a in tuple(s))]
  assert len(split) >= len(specs) // 2, specs
  assert all('data' not in tuple(s) for s in specs)  # Never 'data' alone.
  opt_specs = {s.spec for s in jax.tree.leaves(zero['shardings'].opt_state)}
  assert set(specs) <= opt_specs
  assert zero['new_shardings'] == zero['shardings']


def test_dp_bucket_is_smallest_dropless_for_per_group_rows(dp_run):
  """The exact dispatch's bucket bounds the rows a device receives within
  its data group, counted here token by token from the routes."""
  dp, ro, mbs = dp_run['dp'], dp_run['ro'], dp_run['mbs']
  ctx, planned = dp['ctx'], dp['planned']
  routes, valid = ro.routes_LBTK[:, :, :-1], ro.valid_BT[:, :-1]
  placements = [planned.plan.microstep(i) for i in range(NUM_MB)]
  cells_MGLDD = numpy_cells_MGLDD(routes, valid, mbs, placements, 2, 4)
  received_MG = numpy_received_MG(cells_MGLDD)
  # The device's busiest receiver in each micro-step is this count.
  np.testing.assert_array_equal(dp['metrics']['max_rows_M'],
                                received_MG.max(axis=1))
  want = _smallest_dropless(received_MG.max(), ctx.buckets)
  assert planned.capacity == want
  # The loads summed over the data groups (what the planner balances)
  # would pick a larger bucket: a device is sent one group's rows only.
  summed = config_lib.pick_bucket(max(
      int(placement_lib.device_loads(dp['loads'][i].sum(0), placements[i]
                                     ).max()) for i in range(NUM_MB)),
                              ctx.buckets)
  assert summed > want, (summed, want, ctx.buckets)
  # The recompute's bucket: the home layout's per-group rows.
  home = [ctx.identity] * NUM_MB
  static_rows = numpy_received_MG(numpy_cells_MGLDD(routes, valid, mbs, home,
                                                    2, 4))
  assert dp['static'] == _smallest_dropless(static_rows.max(), ctx.buckets)
  # Padded cells, the comparison path's demand, from the same count.
  assert placement_lib.max_cell(dp['loads'][0], placements[0]) == \
      cells_MGLDD[0].max()


def test_planner_cost_is_per_summed_token():
  """The planner's loads are summed over the data groups while a device
  computes one group's share: per summed token it spends 1 / num_data of a
  token's time, and a copy costs the same on every data row."""
  _, one = trainer.planner_setup(_config(1, 4))
  _, two = trainer.planner_setup(_config(2, 4))
  assert two.token_time_s == one.token_time_s / 2
  assert two.bytes_per_expert == one.bytes_per_expert
  assert two.move_tokens(False) == 2 * one.move_tokens(False)


def test_fsdp_data_spec():
  """The first axis that splits evenly over 'data'; none: replicated."""
  assert sharding.data_spec((6, 4), 2) == P('data')
  assert sharding.data_spec((3, 4), 2) == P(None, 'data')
  assert sharding.data_spec((3, 5), 2) == P()
  assert sharding.data_spec((1, 8), 4) == P(None, 'data')
  assert sharding.data_spec((), 2) == P()
  assert sharding.data_spec((6, 4), 1) == P()  # No data axis: replicated.
  both = ('data', 'expert')
  assert sharding.data_spec((2, 16, 4), 8, skip=1, axes=both) == P(None, both)
  assert sharding.fsdp_mesh_axes('data+expert') == both
  with pytest.raises(ValueError, match='fsdp_axes'):
    sharding.fsdp_mesh_axes('expert')


@pytest.mark.parametrize('fsdp,fsdp_axes', [(False, 'data'), (True, 'data'),
                                            (True, 'data+expert')])
def test_gradients_are_reduced_once_per_step(dp_run, fsdp, fsdp_axes):
  """The compiled update (NUM_MB micro-steps on the (2, 4) mesh) sums the
  non-expert gradients over the mesh in exactly one all-reduce, after the
  micro-step loop, never inside it; no floating-point value is reduced
  inside the loop at all (the per-layer statistics are reduced once, at
  the end, too)."""
  cfg = _config(2, 4, fsdp=fsdp, fsdp_axes=fsdp_axes)
  mesh = ep.make_mesh(2, 4)
  # The context that ran this config's step in dp_run: the lowering below
  # is of the program that step compiled (jax's cache returns it).
  run = {(False, 'data'): 'dp', (True, 'data'): 'fsdp',
         (True, 'data+expert'): 'fsdp_all'}[fsdp, fsdp_axes]
  ctx = dp_run[run]['ctx']
  assert ctx.config.parallel.fsdp == fsdp
  assert ctx.config.parallel.fsdp_axes == fsdp_axes
  state = _state(cfg, mesh, ctx)
  planned = dp_run['dp']['planned']
  plan = step_lib.StepPlan(
      step_lib.device_placement(planned.plan.placement, mesh),
      step_lib.device_transfer(planned.transfer, mesh), planned.capacity)
  batch = dp_run['dp_batch']
  text = ctx.rl_step.update.lower(state, batch, {}, plan).compile().as_text()
  reduces = hlo.all_reduces(text)
  assert not [r for r in reduces if r['in_loop'] and
              any(d.startswith(('f', 'bf')) for d in r['dtypes'])]
  experts, rest = nnx.split_state(state.params, moe.ExpertWeight, ...)
  num_rest = sum(x.size for x in jax.tree.leaves(rest))
  # Over all 8 devices: the non-expert gradients (with the loss sums).
  big = [r for r in reduces if r['elements'] >= num_rest
         and r['group_size'] == 8]
  assert len(big) == 1 and not big[0]['in_loop'], big
  # In float32 (the gradient sums' dtype, whatever the compute dtype).
  assert {d for d in big[0]['dtypes'] if d.startswith(('f', 'bf'))} == {'f32'}
  # Over the 2 data rows: the canonical experts' gradients, also once.
  num_experts = sum(x.size for x in jax.tree.leaves(experts)) // 4
  rows = [r for r in reduces if r['group_size'] == 2
          and r['elements'] >= num_experts]
  assert len(rows) == 1 and not rows[0]['in_loop'], rows
  # The loop is really there: the micro-steps' moves run inside it.
  assert hlo.loop_computations(text)


def test_static_ep_updates_on_the_canonical_layout(dp_run):
  """planner.method 'static': the trainer's update runs on the canonical
  layout (experts differentiated at home, no slots), on (2, 4) equals the
  reference step, and reduces the experts' gradients over the data rows
  once, after the micro-step loop."""
  task = get_task('addition')
  cfg = _config(2, 4)
  cfg.planner.method = 'static'
  mesh = ep.make_mesh(2, 4)
  run = _trainer_step(cfg, mesh, task, dp_run['ro'], dp_run['mbs'],
                      dp_run['dp_batch'], logps=dp_run['dp']['logps'])
  ctx, planned = run['ctx'], run['planned']
  plan = trainer.update_plan(ctx, planned)
  assert plan == step_lib.CanonicalLayout(planned.capacity, planned.cell)
  assert planned.capacity == run['static']
  _assert_same_step(run, dp_run['ref'], dp_run['ref_params0'])
  state = _state(cfg, mesh, ctx)
  text = ctx.rl_step.update.lower(state, dp_run['dp_batch'], {},
                                  plan).compile().as_text()
  reduces = hlo.all_reduces(text)
  assert not [r for r in reduces if r['in_loop'] and
              any(d.startswith(('f', 'bf')) for d in r['dtypes'])]
  experts = nnx.split_state(state.params, moe.ExpertWeight, ...)[0]
  num_experts = sum(x.size for x in jax.tree.leaves(experts)) // 4
  rows = [r for r in reduces if r['group_size'] == 2
          and r['elements'] >= num_experts]
  assert len(rows) == 1 and not rows[0]['in_loop'], rows
