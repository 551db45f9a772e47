"""The MoE transformer: EP on 8 devices equals 1 device; replay; real shapes."""
import importlib

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from foremoe_jax import placement as placement_lib
from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.model import attention, shapes, sharding, transformer


def tiny_model_cfg(**overrides):
  cfg = importlib.import_module('configs.tiny').get_config().model
  for k, v in overrides.items():
    cfg[k] = v
  return cfg


def loss_and_grads(cfg, mesh, tokens, placement=None):
  model = transformer.Transformer(cfg, mesh, rngs=nnx.Rngs(0))
  graphdef, state = sharding.split_model(model, mesh)

  @jax.jit
  def f(state, placement):
    def loss(state):
      logits, aux, _ = nnx.merge(graphdef, state)(tokens, placement=placement)
      return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), (logits, aux)
    return jax.value_and_grad(loss, has_aux=True)(state)
  return f(state, placement)


@pytest.mark.parametrize('overrides', [
    {},  # Qwen3-like: renormalised top-k.
    dict(renormalize_topk=False, qk_norm=True, tie_embeddings=False),  # OLMoE
    dict(first_dense_layers=1, num_shared_experts=1, shared_d_ff=32),
])
def test_ep8_equals_single_device(overrides):
  cfg = tiny_model_cfg(**overrides)
  tokens = jax.random.randint(jax.random.key(0), (8, 16), 0, cfg.vocab_size)
  (l1, (lg1, aux1)), g1 = loss_and_grads(cfg, ep.make_mesh(1, 1), tokens)
  num_moe = cfg.num_layers - cfg.first_dense_layers
  rng = np.random.default_rng(0)
  # A random placement with replicas and splits on 8 EP devices, 2 slots each.
  se = np.stack([rng.permutation(np.r_[np.arange(8), rng.integers(0, 8, 8)])
                 for _ in range(num_moe)]).astype(np.int32)
  cnt = np.stack([np.bincount(s, minlength=8) for s in se])
  share = np.stack([np.broadcast_to(1.0 / cnt[l][se[l]], (8, 16))
                    for l in range(num_moe)]).astype(np.float32)
  p = placement_lib.Placement(se, share)
  placement_lib.validate_placement(p, 8, 2)
  (l8, (lg8, aux8)), g8 = loss_and_grads(cfg, ep.make_mesh(1, 8), tokens, p)
  np.testing.assert_allclose(lg8, lg1, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(aux8.routes_LBTK, aux1.routes_LBTK)
  for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
  assert int(aux8.dropped_L.sum()) == 0


def test_replay_own_routes_identical_and_other_routes_differ():
  cfg = tiny_model_cfg()
  mesh = ep.make_mesh(1, 8)
  model = transformer.Transformer(cfg, mesh, rngs=nnx.Rngs(1))
  tokens = jax.random.randint(jax.random.key(1), (8, 8), 0, cfg.vocab_size)
  graphdef, state = sharding.split_model(model, mesh)
  fwd = jax.jit(lambda s, r: nnx.merge(graphdef, s)(
      tokens, replay_routes_LBTK=r)[:2])
  logits, aux = jax.jit(lambda s: nnx.merge(graphdef, s)(tokens)[:2])(state)
  logits2, aux2 = fwd(state, aux.routes_LBTK)
  np.testing.assert_array_equal(logits, logits2)
  other = (aux.routes_LBTK + 1) % cfg.num_experts
  logits3, aux3 = fwd(state, other)
  np.testing.assert_array_equal(aux3.routes_LBTK, other)
  assert float(jnp.abs(logits3 - logits).max()) > 1e-4


@pytest.mark.parametrize('name,total,active', [
    ('qwen3_30b_a3b', 30.5e9, 3.3e9),  # Public: 30.5B total, 3.3B active.
    ('mixtral_8x7b', 46.7e9, 12.9e9),  # Public: 46.7B total, 12.9B active.
    ('olmoe_1b_7b', 6.9e9, 1.3e9),  # Public: 6.9B total, 1.3B active.
])
def test_real_config_param_counts_match_public_figures(name, total, active):
  cfg = importlib.import_module(f'configs.{name}').get_config().model
  counts = shapes.param_counts(cfg)
  assert abs(counts['total'] - total) / total < 0.01
  assert abs(counts['active'] - active) / active < 0.03


def test_no_placement_equals_explicit_identity_placement():
  """The transfer-free default path computes what the identity placement does."""
  cfg = tiny_model_cfg()
  mesh = ep.make_mesh(1, 8)
  tokens = jax.random.randint(jax.random.key(3), (8, 8), 0, cfg.vocab_size)
  ident = placement_lib.identity_placement(cfg.num_layers, cfg.num_experts, 8,
                                           cfg.num_experts // 8)
  (_, (lg0, _)), g0 = loss_and_grads(cfg, mesh, tokens)
  (_, (lg1, _)), g1 = loss_and_grads(cfg, mesh, tokens, ident)
  np.testing.assert_allclose(lg0, lg1, atol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_left_padded_rows_equal_unpadded_forward():
  """A prompt left-padded with PAD, its PADs marked invalid, gives the same
  logits and routes at its real positions as the same prompt alone; and a
  row-by-row decode over the cache matches too (keys of PADs stay hidden)."""
  cfg = tiny_model_cfg()
  mesh = ep.make_mesh(1, 1)
  graphdef, state = sharding.split_model(
      transformer.Transformer(cfg, mesh, rngs=nnx.Rngs(0)), mesh)

  @jax.jit
  def forward(state, tokens, valid):
    logits, aux, _ = nnx.merge(graphdef, state)(tokens, valid_BT=valid)
    return logits, aux.routes_LBTK

  @jax.jit
  def prefill_and_step(state, tokens, valid, nxt):
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(tokens.shape[0], tokens.shape[1] + 1)
    _, _, cache = model(tokens, valid_BT=valid, cache=cache, cache_index=0)
    return model(nxt, cache=cache, cache_index=tokens.shape[1])[0][:, 0]

  rng = np.random.default_rng(0)
  width, lens = 8, [8, 5, 2]
  tokens = np.zeros((len(lens), width), np.int32)
  valid = np.zeros((len(lens), width), bool)
  rows = [rng.integers(3, cfg.vocab_size, n).astype(np.int32) for n in lens]
  for i, r in enumerate(rows):
    tokens[i, width - len(r):], valid[i, width - len(r):] = r, True
  nxt = rng.integers(3, cfg.vocab_size, (len(lens), 1)).astype(np.int32)
  logits, routes = forward(state, tokens, valid)
  step_logits = prefill_and_step(state, tokens, valid, nxt)
  for i, r in enumerate(rows):
    # The reference: the row alone, unpadded, with its next token appended,
    # positions from 0.
    seq = np.r_[r, nxt[i]][None]
    ref_logits, ref_routes = forward(state, seq, np.ones_like(seq, bool))
    n = len(r)
    np.testing.assert_allclose(logits[i, width - n:], ref_logits[0, :n],
                               atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(routes[:, i, width - n:],
                                  ref_routes[:, 0, :n])
    np.testing.assert_allclose(step_logits[i], ref_logits[0, -1],
                               atol=2e-5, rtol=2e-5)
  # Without the mask the PADs would be attended to: the check can fail.
  unmasked, _ = forward(state, tokens, np.ones_like(valid))
  assert not np.allclose(unmasked[2, -1], logits[2, -1], atol=1e-3)


def _normed_qk(attn, x, y, scope, h, kv, d):
  if scope == 'head':
    return (attn.q_norm(x.reshape(-1, h, d)), attn.k_norm(y.reshape(-1, kv, d)))
  return (attn.q_norm(x).reshape(-1, h, d), attn.k_norm(y).reshape(-1, kv, d))


@pytest.mark.parametrize('scope', ['head', 'full'])
def test_qk_norm_init_sets_the_scales_that_bound_the_logits(scope):
  """model.qk_norm_init is the q/k norms' starting scale; the logits scale
  by gq * gk, and with the per-head norm q.k / sqrt(D) cannot exceed
  sqrt(D) * gq * gk (why a briefly trained model's attention stays spread
  with scales of 1: docs/design.md §6.11)."""
  g = 2.5
  cfg = tiny_model_cfg(qk_norm=True, qk_norm_scope=scope, qk_norm_init=g)
  d, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
  attn = attention.Attention(cfg, rngs=nnx.Rngs(0))
  plain = attention.Attention(tiny_model_cfg(qk_norm=True, qk_norm_scope=scope),
                              rngs=nnx.Rngs(0))
  for norm in (attn.q_norm, attn.k_norm):
    np.testing.assert_array_equal(norm.scale[...], g)
  for norm in (plain.q_norm, plain.k_norm):  # The default: RMSNorm's 1.
    np.testing.assert_array_equal(norm.scale[...], 1.0)
  x = jax.random.normal(jax.random.key(0), (64, h * d))
  y = jax.random.normal(jax.random.key(1), (64, kv * d))
  q, k = _normed_qk(attn, x, y, scope, h, kv, d)
  q1, k1 = _normed_qk(plain, x, y, scope, h, kv, d)
  logits = jnp.einsum('ahd,bgd->abhg', q, k) / np.sqrt(d)
  np.testing.assert_allclose(
      jnp.einsum('ahd,bgd->abhg', q1, k1) / np.sqrt(d) * g * g, logits,
      rtol=1e-4, atol=1e-4)
  if scope == 'head':  # Each head's norm is sqrt(D) * g (eps aside).
    np.testing.assert_allclose(jnp.linalg.norm(q, axis=-1), np.sqrt(d) * g,
                               rtol=1e-4)
    assert float(jnp.abs(logits).max()) <= np.sqrt(d) * g * g * (1 + 1e-4)


def _num_eqns(jaxpr) -> int:
  """Equations of a jaxpr and of every jaxpr nested in it (scan bodies,
  checkpoints, custom VJPs), each counted once per appearance."""
  n = 0
  for eqn in jaxpr.eqns:
    n += 1
    for sub in jax_core.jaxprs_in_params(eqn.params):
      n += _num_eqns(sub)
  return n


def test_training_forward_scans_its_layers_so_the_program_does_not_grow():
  """The layers of a segment are one scan (as MaxText's scan_layers): the
  traced loss and gradient of a 6-layer model has exactly as many
  equations as a 2-layer one, so compile time does not grow with depth
  (an unrolled stack would add every layer's equations)."""
  mesh = ep.make_mesh(1, 1)
  sizes = {}
  for num_layers in (2, 6):
    cfg = tiny_model_cfg(num_layers=num_layers)
    model = transformer.Transformer(cfg, mesh, rngs=nnx.Rngs(0))
    graphdef, state = sharding.split_model(model, mesh)
    tokens = jnp.zeros((2, 8), jnp.int32)

    def loss(state):
      logits, _, _ = nnx.merge(graphdef, state)(tokens)
      return jnp.mean(logits)
    sizes[num_layers] = _num_eqns(jax.make_jaxpr(jax.grad(loss))(state).jaxpr)
  assert sizes[6] == sizes[2] > 0, sizes
