"""MSA with padding keys (docs/design.md §6.9): the masked selection against
an independent loop-and-numpy one, every impl (XLA, both Pallas lowerings in
interpret mode) against the reference in values and gradients, and the
model's left-padded prompts against the same prompts alone.

Letter key: B batch, T query tokens, S key tokens, G groups, K selected
blocks.
"""
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import msa_testlib as lib
from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.model import sharding, transformer
from pallas_kernels import msa
from pallas_kernels.msa import reference as ref

# Two rows of 48 keys in blocks of 16 (the GPU kernels' smallest): row 0 has
# 21 leading PADs (block 0 all padding, block 1 partly), row 1 has 5 (block
# 0 partly padding).
B, T, G, R, D, DI, C, K = 2, 48, 1, 2, 8, 8, 16, 2
LEAD = (21, 5)


def _valid_BS():
  return jnp.arange(T)[None, :] >= jnp.array(LEAD)[:, None]


def _loss(out, lse, w, valid_BS):
  # lse is -inf on queries that see only padding; those rows are dropped.
  lse = jnp.where(valid_BS[:, :, None], lse, 0.0)
  return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.sin(lse))


def test_masked_selection_equals_numpy_loop():
  _, _, _, qi, ki, _ = lib.make_inputs(B, T, T, G, R, D, DI)
  valid = _valid_BS()
  want = lib.brute_force_selection(qi, ki, C, K + 1, 0, valid_BS=valid)
  # The other impls' selections are held to the reference's in the next test.
  np.testing.assert_array_equal(jax.jit(functools.partial(
      ref.selection_BGTK, block_size=C, top_k=K + 1))(
          qi, ki, kv_valid_BS=valid), want)
  # Row 0's block 0 is all padding: never selected by the queries after it,
  # though it is earlier than their local block and a slot is free.
  assert not np.any(want[0, :, C:] == 0)
  assert np.all(want[0, :, C:2 * C, 0] == -1)


def test_padded_keys_outputs_and_gradients_match_reference():
  q, k, v, qi, ki, w = lib.make_inputs(B, T, T, G, R, D, DI)
  valid = _valid_BS()
  kw = dict(block_size=C, top_k=K, kv_valid_BS=valid)

  def run(impl, backend):
    def f(q, k, v):
      out, aux = msa.msa_attention(q, k, v, qi, ki, impl=impl,
                                   pallas_backend=backend, **kw)
      return _loss(out, aux['lse_BTH'], w, valid), (out, aux)
    (_, (out, aux)), grads = jax.jit(jax.value_and_grad(
        f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, aux, grads

  want, want_aux, want_grads = run('reference', None)
  kl = functools.partial(msa.msa_indexer_kl_loss, block_size=C,
                         kv_valid_BS=valid)
  want_kl = jax.jit(functools.partial(kl, impl='reference'))(
      q, k, qi, ki, want_aux)
  for impl, backend in (('xla', None), ('pallas', 'tpu'), ('pallas', 'gpu')):
    _check_against(run(impl, backend), (want, want_aux, want_grads), valid)
  # Every impl but the reference computes the loss in indexer_loss.py.
  lib.assert_close(jax.jit(functools.partial(kl, impl='xla'))(
      q, k, qi, ki, want_aux), want_kl, 1e-5, 'kl')
  # Decode over a cache with PADs: one query per row at its length - 1.
  lengths = jnp.array([T, 30])
  dec = lambda impl, backend=None: jax.jit(functools.partial(
      msa.msa_decode, block_size=C, top_k=K, impl=impl,
      pallas_backend=backend, kv_valid_BS=valid))(q[:, 0], k, v, qi[:, 0], ki,
                                                  lengths)
  want_dec, want_dec_aux = dec('reference')
  for impl, backend in (('xla', None), ('pallas', 'tpu'), ('pallas', 'gpu')):
    out_dec, aux_dec = dec(impl, backend)
    lib.assert_close(out_dec, want_dec, 1e-5, f'decode {impl} {backend}')
    np.testing.assert_array_equal(aux_dec['sel_BGK'], want_dec_aux['sel_BGK'])


def _check_against(got, expected, valid):
  out, aux, grads = got
  want, want_aux, want_grads = expected
  np.testing.assert_array_equal(aux['sel_BGTK'], want_aux['sel_BGTK'])
  lib.assert_close(out, want, 1e-5, 'out')
  lse, want_lse = aux['lse_BTH'], want_aux['lse_BTH']
  np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
  lib.assert_close(jnp.where(jnp.isinf(lse), 0, lse),
                   jnp.where(jnp.isinf(want_lse), 0, want_lse), 1e-5, 'lse')
  for name, a, e in zip('qkv', grads, want_grads):
    assert np.isfinite(np.asarray(a)).all(), name
    lib.assert_close(a, e, 1e-5, f'd{name}')
  # Queries that see only padding: output 0, finite gradients (above).
  pad_q = ~np.asarray(valid)
  np.testing.assert_array_equal(np.asarray(out)[pad_q], 0.0)
  # A padding key gets no gradient from any query.
  np.testing.assert_array_equal(np.asarray(grads[1])[pad_q], 0.0)
  np.testing.assert_array_equal(np.asarray(grads[2])[pad_q], 0.0)


def test_model_left_padded_prompts_score_and_decode_as_if_alone():
  """configs/tiny_msa.py's model (MSA in layer 1, blocks of 4, top-2): each
  left-padded row scores (logits, indexer loss) and decodes over the cache
  like the same prompt alone."""
  cfg = importlib.import_module('configs.tiny_msa').get_config().model
  mesh = ep.make_mesh(1, 1)
  graphdef, state = sharding.split_model(
      transformer.Transformer(cfg, mesh, rngs=nnx.Rngs(0)), mesh)
  steps = 4  # Decode crosses a block boundary in every row.

  @jax.jit
  def forward(state, tokens, valid, weight):
    logits, aux, _ = nnx.merge(graphdef, state)(
        tokens, valid_BT=valid, indexer_weight_BT=weight)
    return logits, aux.indexer_loss

  @jax.jit
  def prefill_and_decode(state, tokens, valid, nxt_BN):
    model = nnx.merge(graphdef, state)
    width = tokens.shape[1]
    cache = model.init_cache(tokens.shape[0], width + steps)
    _, _, cache = model(tokens, valid_BT=valid, cache=cache, cache_index=0)

    def step(cache, i):
      tok_B1 = jax.lax.dynamic_slice_in_dim(nxt_BN, i, 1, axis=1)
      logits, _, cache = model(tok_B1, cache=cache, cache_index=width + i,
                               valid_BT=jnp.ones_like(tok_B1, bool))
      return cache, logits[:, 0]
    return jax.lax.scan(step, cache, jnp.arange(steps))[1].transpose(1, 0, 2)

  rng = np.random.default_rng(0)
  width, lens = 24, [21, 14, 9]  # 3, 10, 15 PADs: shifts 3, 2, 3.
  tokens = np.zeros((len(lens), width), np.int32)
  valid = np.zeros((len(lens), width), bool)
  rows = [rng.integers(3, cfg.vocab_size, n).astype(np.int32) for n in lens]
  for i, r in enumerate(rows):
    tokens[i, width - len(r):], valid[i, width - len(r):] = r, True
  nxt = rng.integers(3, cfg.vocab_size, (len(lens), steps)).astype(np.int32)
  step_logits = prefill_and_decode(state, tokens, valid, nxt)
  # Scoring, as the RL update does: prompt + completion, left-padded.
  seqs = np.c_[tokens, nxt]
  seq_valid = np.c_[valid, np.ones_like(nxt, bool)]
  total = seq_valid.sum()
  logits, kl = forward(state, seqs, seq_valid, seq_valid / total)
  # The references, one batch of the same shape: each prompt alone from
  # position 0, then its decoded tokens, then filler that causal attention
  # keeps out of the positions compared (its indexer weight is 0).
  alone = rng.integers(3, cfg.vocab_size, seqs.shape).astype(np.int32)
  weight = np.zeros(alone.shape)
  for i, r in enumerate(rows):
    alone[i, :len(r) + steps] = np.r_[r, nxt[i]]
    weight[i, :len(r) + steps] = 1 / total
  ref_logits, ref_kl = forward(state, alone, np.ones_like(seq_valid), weight)
  for i, r in enumerate(rows):
    n = len(r) + steps
    np.testing.assert_allclose(logits[i, -n:], ref_logits[i, :n],
                               atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(step_logits[i], ref_logits[i, n - steps:n],
                               atol=2e-5, rtol=2e-5)
  assert ref_kl > 1e-3  # The indexer disagrees with the main branch at init.
  np.testing.assert_allclose(kl, ref_kl, rtol=1e-5)
  assert np.isfinite(np.asarray(logits)).all()
