"""MSA layers inside the model: dense equivalence, detached indexer, sampling."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.model import sharding, transformer
from foremoe_jax.rl import step as step_lib
from foremoe_jax.rl import trainer
from foremoe_jax.rollout import sampler as sampler_lib
from foremoe_jax.tasks import get_task


def msa_cfg(**kw):
  cfg = importlib.import_module('configs.tiny').get_config()
  cfg.model.attention_type = 'msa'
  cfg.model.first_sparse_layer = 1
  cfg.model.msa_block_size = 4
  cfg.model.msa_top_k = 2
  for k, v in kw.items():
    cfg.model[k] = v
  return cfg


def build(cfg, mesh):
  model = transformer.Transformer(cfg.model, mesh, rngs=nnx.Rngs(3))
  return model, *sharding.split_model(model, mesh)


def _logits(graphdef, params, tokens):
  # The tokens are an argument, not a constant of the program: the dense
  # model's program is then the same in every test here, compiled once
  # (the run's compilation cache, tests/conftest.py).
  return jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)[:2])(params, tokens)


def _set_dense(graphdef, params):
  model = nnx.merge(graphdef, params)
  for stack in model.segments:  # Each segment's layers share one graph.
    stack.attn.layer_type = 'dense'
  return nnx.split(model)


def test_budget_covering_all_blocks_equals_dense():
  mesh = ep.make_mesh(1, 8)
  cfg = msa_cfg(msa_top_k=8)  # 8 blocks of 4 cover T = 32.
  _, graphdef, params = build(cfg, mesh)
  tokens = jax.random.randint(jax.random.key(0), (8, 32), 0, 15)
  logits_msa, aux = _logits(graphdef, params, tokens)
  logits_dense, _ = _logits(*_set_dense(graphdef, params), tokens)
  np.testing.assert_allclose(logits_msa, logits_dense, atol=1e-5, rtol=1e-5)
  assert float(aux.indexer_loss) > 0


def test_sparse_differs_and_indexer_gradient_stays_in_index_branch():
  mesh = ep.make_mesh(1, 8)
  _, graphdef, params = build(msa_cfg(), mesh)
  tokens = jax.random.randint(jax.random.key(1), (8, 32), 0, 15)

  def index_loss(p):
    logits, aux = nnx.merge(graphdef, p)(tokens)[:2]
    return aux.indexer_loss, logits
  # One program: the indexer loss's gradient, and the logits of its forward.
  grads, logits_msa = jax.jit(jax.grad(index_loss, has_aux=True))(params)
  logits_dense, _ = _logits(*_set_dense(graphdef, params), tokens)
  assert float(jnp.abs(logits_msa - logits_dense).max()) > 1e-4
  for path, g in jax.tree.leaves_with_path(grads):
    name = jax.tree_util.keystr(path)
    is_index = any(k in name for k in ('qi_proj', 'ki_proj', 'qi_norm',
                                       'ki_norm'))
    assert (float(jnp.abs(g).max()) > 0) == is_index, name


def test_indexer_loss_is_the_weighted_sum_over_query_positions():
  """The position weights reach the MSA layers' indexer KL: zero weights
  give 0 and the loss is additive over disjoint sets of positions (what the
  RL step relies on to count only the loss mask's positions)."""
  mesh = ep.make_mesh(1, 8)
  _, graphdef, params = build(msa_cfg(), mesh)
  tokens = jax.random.randint(jax.random.key(3), (8, 32), 0, 15)
  loss = jax.jit(lambda w: nnx.merge(graphdef, params)(
      tokens, indexer_weight_BT=w)[1].indexer_loss)
  prompt = (jnp.arange(32) < 10)[None] * jnp.ones((8, 1))
  rest = (1.0 - prompt) * jnp.linspace(0.5, 1.5, 8)[:, None]
  assert float(loss(jnp.zeros((8, 32)))) == 0.0
  a, b, both = float(loss(prompt)), float(loss(rest)), float(loss(prompt + rest))
  assert a > 0 and b > 0
  np.testing.assert_allclose(a + b, both, rtol=1e-5)


def test_indexer_warmup_keeps_dense_attention():
  mesh = ep.make_mesh(1, 8)
  _, graphdef, params = build(msa_cfg(msa_indexer_warmup=True), mesh)
  tokens = jax.random.randint(jax.random.key(2), (8, 32), 0, 15)
  logits_warm, aux = _logits(graphdef, params, tokens)
  logits_dense, _ = _logits(*_set_dense(graphdef, params), tokens)
  np.testing.assert_allclose(logits_warm, logits_dense, atol=1e-6)
  assert float(aux.indexer_loss) > 0


@pytest.mark.parametrize('warmup', [False, True])
def test_sampling_and_training_with_msa(warmup):
  mesh = ep.make_mesh(1, 8)
  cfg = msa_cfg(msa_indexer_warmup=warmup)
  _, graphdef, params = build(cfg, mesh)
  task = get_task('addition')
  sampler = sampler_lib.Sampler(graphdef, cfg.model, mesh,
                                sampler_lib.SamplingParams(
                                    max_new_tokens=task.completion_len,
                                    num_generations=4))
  rollout = sampler(params, task.sample_prompts(0, 8), jax.random.key(0))
  rewards = np.random.default_rng(0).random(32).astype(np.float32)
  batch = trainer.rl_batch_from_rollout(rollout, rewards,
                                        np.split(np.arange(32), 2))
  tx = step_lib.make_optimizer(1e-3, 1.0)
  state = step_lib.init_train_state(graphdef, params, tx, mesh, with_ref=False)
  from foremoe_jax import placement as placement_lib  # pylint: disable=g-import-not-at-top
  from foremoe_jax.planner.topology import Topology  # pylint: disable=g-import-not-at-top
  from foremoe_jax.transfer import schedule  # pylint: disable=g-import-not-at-top
  plan = step_lib.make_step_plan(placement_lib.stack_placements(
      [placement_lib.identity_placement(2, 8, 8, 2)] * 2), 8,
      Topology(1, 8, 2), schedule.TransferBudget(8, 2))
  rl_step = step_lib.make_rl_step(tx, num_generations=4, eps_low=0.2,
                                  eps_high=0.28, beta=0.0)
  state, m = rl_step(state, batch, plan)
  assert np.isfinite(float(m['loss'])) and float(m['indexer_loss']) > 0
  # KV-cache decode through MSA layers gives the full-forward log-probs:
  # those of the step's own forward (every micro-batch, at the loss mask's
  # positions), not of a forward program compiled for the check alone.
  assert float(m['rollout_vs_update_logp_max_abs']) <= 1e-5
