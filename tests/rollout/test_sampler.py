"""The sampler vs a full forward pass: log-probs, greedy tokens, routes, EOS.

Every check compares the KV-cache decode with an independent reference: the
model run once, without a cache, over the final tokens (tiny config, mesh
(1, 8) on 8 simulated devices).

Shape letters: N prompts, B samples, P prompt tokens, C completion tokens,
T = P + C, V vocab, L MoE layers, K top-k.
"""
import functools
import importlib
from typing import NamedTuple

import jax
import numpy as np
import pytest
from flax import nnx

from foremoe_jax import placement as placement_lib
from foremoe_jax.foresight import loads as loads_lib
from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.model import sharding, transformer
from foremoe_jax.rollout import recompute
from foremoe_jax.rollout import sampler as sampler_lib
from foremoe_jax.tasks import get_task
from foremoe_jax.tasks.tokenizer import EOS_ID, PAD_ID

TASK = get_task('addition')
C = TASK.completion_len


class Setup(NamedTuple):
  cfg: object
  mesh: object
  graphdef: object
  state: object
  forward: object  # jit'd (state, tokens_BT, valid_BT) -> (logits, aux).
  prompts_NP: np.ndarray


@pytest.fixture(scope='module')
def setup():
  cfg = importlib.import_module('configs.tiny').get_config().model
  mesh = ep.make_mesh(1, 8)
  model = transformer.Transformer(cfg, mesh, rngs=nnx.Rngs(0))
  # A fresh model's tied N(0, 1) embedding makes next-token distributions
  # nearly one-hot; a smaller scale gives varied samples and EOS at varied
  # steps, which is what these tests need to see.
  model.embed.embedding[...] = model.embed.embedding[...] * 0.2
  graphdef, state = sharding.split_model(model, mesh)
  forward = jax.jit(lambda s, tok, valid: nnx.merge(graphdef, s)(
      tok, valid_BT=valid)[:2])
  prompts_NP = TASK.sample_prompts(0, 4)
  return Setup(cfg, mesh, graphdef, state, forward, prompts_NP)


_SAMPLERS = {}


def make_sampler(setup, **kw):
  """One Sampler per distinct SamplingParams, shared by tests (one compile)."""
  cfg, mesh, graphdef = setup.cfg, setup.mesh, setup.graphdef
  kw.setdefault('max_new_tokens', C)
  params = sampler_lib.SamplingParams(**kw)
  if params not in _SAMPLERS:
    _SAMPLERS[params] = sampler_lib.Sampler(graphdef, cfg, mesh, params)
  return _SAMPLERS[params]


def full_forward(setup, r):
  """Without a cache: (next-token log-probs [B, T-1], routes, logits).

  Rows are padded to 16 so every call splits over 8 devices with one compile.
  """
  forward, state = setup.forward, setup.state
  num = r.tokens_BT.shape[0]
  pad = 16 - num
  tokens_BT = np.pad(r.tokens_BT, ((0, pad), (0, 0)))
  valid_BT = np.pad(r.valid_BT, ((0, pad), (0, 0)))
  logits_BTV, aux = forward(state, tokens_BT, valid_BT)
  logits_BTV = np.asarray(logits_BTV)[:num]
  logp_BTV = np.asarray(jax.nn.log_softmax(logits_BTV[:, :-1], axis=-1))
  next_BT = np.take_along_axis(logp_BTV, r.tokens_BT[:, 1:, None],
                               axis=-1)[..., 0]
  return next_BT, np.asarray(aux.routes_LBTK)[:, :num], logits_BTV


def test_logp_and_routes_equal_full_forward(setup):
  prompts_NP = setup.prompts_NP
  smp = make_sampler(setup, num_generations=4)
  r = smp(setup.state, prompts_NP, jax.random.key(0))
  plen = prompts_NP.shape[1]
  assert r.tokens_BT.shape == (16, plen + C) and r.prompt_len == plen
  assert r.logp_BC.dtype == np.float32 and r.routes_LBTK.dtype == np.int8
  np.testing.assert_array_equal(r.tokens_BT[:, :plen],
                                np.repeat(prompts_NP, 4, axis=0))
  next_BT, routes_LBTK, _ = full_forward(setup, r)
  valid_BC = r.valid_BT[:, plen:]
  # Raw-model log-probs at position P + c - 1 of the token at P + c.
  np.testing.assert_allclose(np.where(valid_BC, next_BT[:, plen - 1:], 0),
                             r.logp_BC, atol=1e-5)
  assert (r.logp_BC[~valid_BC] == 0).all()
  # The record covers every valid position, T - 1 included.
  valid_LBTK = np.broadcast_to(r.valid_BT[None, :, :, None], routes_LBTK.shape)
  np.testing.assert_array_equal(r.routes_LBTK[valid_LBTK],
                                routes_LBTK[valid_LBTK])
  assert r.valid_BT[:, -1].any(), 'no sample ran to T - 1; pick another seed'
  # The device counted the record of the positions the RL step feeds
  # (all but the last), as a host count of the same record does.
  np.testing.assert_array_equal(
      r.counts_BLE, loads_lib.sample_expert_counts(
          r.routes_LBTK[:, :, :-1], r.valid_BT[:, :-1],
          setup.cfg.num_experts))
  assert r.counts_BLE.sum() == r.valid_BT[:, :-1].sum() * setup.cfg.top_k * (
      r.routes_LBTK.shape[0])
  # Samples vary within a group (a fresh-model sanity check of sampling).
  assert len({tuple(c) for c in r.completion_BC[:4]}) > 1


def test_greedy_deterministic_and_equals_full_forward_argmax(setup):
  smp = make_sampler(setup, num_generations=2, greedy=True)
  r1 = smp(setup.state, setup.prompts_NP, jax.random.key(0))
  r2 = smp(setup.state, setup.prompts_NP, jax.random.key(1))
  np.testing.assert_array_equal(r1.tokens_BT, r2.tokens_BT)
  np.testing.assert_array_equal(r1.routes_LBTK, r2.routes_LBTK)
  _, _, logits_BTV = full_forward(setup, r1)
  plen = r1.prompt_len
  argmax_BC = logits_BTV[:, plen - 1:-1].argmax(-1)
  valid_BC = r1.valid_BT[:, plen:]
  np.testing.assert_array_equal(r1.completion_BC[valid_BC], argmax_BC[valid_BC])
  # The no-cache baseline of the benchmark decodes the same greedy tokens.
  recompute_fn = jax.jit(functools.partial(
      recompute.recompute_decode, setup.graphdef, params=smp.params))
  tokens_BT = recompute_fn(setup.state, np.repeat(setup.prompts_NP, 2, axis=0),
                           jax.random.key(0))
  np.testing.assert_array_equal(tokens_BT, r1.tokens_BT)
  # ... and so does its prefix form, whatever the width step (one that
  # leaves a last width short of the buffer's multiple, one of a column).
  for bucket in (1, 5, 8):
    prefix_fn = jax.jit(functools.partial(
        recompute.recompute_decode, setup.graphdef, params=smp.params,
        bucket=bucket))
    np.testing.assert_array_equal(
        prefix_fn(setup.state, np.repeat(setup.prompts_NP, 2, axis=0),
                  jax.random.key(0)), r1.tokens_BT)
  # One compile per shape: the second call reused the first's executables.
  assert smp._decode._cache_size() == 1 and smp._prefill._cache_size() == 1


@pytest.mark.parametrize('kw', [dict(top_k=1, temperature=3.0),
                                dict(top_p=1e-6)])
def test_top_k_one_and_tiny_top_p_equal_greedy(setup, kw):
  greedy = make_sampler(setup, num_generations=2, greedy=True)(
      setup.state, setup.prompts_NP, jax.random.key(0))
  r = make_sampler(setup, num_generations=2, **kw)(
      setup.state, setup.prompts_NP, jax.random.key(7))
  np.testing.assert_array_equal(r.tokens_BT, greedy.tokens_BT)
  np.testing.assert_allclose(r.logp_BC, greedy.logp_BC, atol=1e-6)


def test_top_k_and_top_p_keep_only_the_nucleus():
  logits_BV = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 4000, np.float32))
  key = jax.random.key(0)
  for params, allowed in [
      (dict(top_k=2), {0, 1}),
      (dict(top_p=0.7), {0, 1}),  # 0.5 < 0.7, 0.8 >= 0.7: two tokens.
      (dict(top_p=0.81), {0, 1, 2}),
  ]:
    p = sampler_lib.SamplingParams(max_new_tokens=1, **params)
    tok_B = np.asarray(sampler_lib.sample_tokens(logits_BV, key, p))
    assert set(tok_B.tolist()) == allowed, params
  # Renormalised over the kept tokens: 0.5 / 0.8 of top-2 samples are token 0.
  p = sampler_lib.SamplingParams(max_new_tokens=1, top_k=2)
  tok_B = np.asarray(sampler_lib.sample_tokens(logits_BV, key, p))
  assert abs((tok_B == 0).mean() - 0.625) < 0.03


def test_eos_stops_each_sequence_and_matches_an_eos_free_run(setup):
  """With EOS disabled the same key gives the same tokens up to the EOS."""
  state, prompts_NP = setup.state, setup.prompts_NP
  key, max_new = jax.random.key(0), C
  free = make_sampler(setup, num_generations=4, eos_id=-1)(
      state, prompts_NP, key)
  r = make_sampler(setup, num_generations=4)(state, prompts_NP, key)
  is_eos_BC = free.completion_BC == EOS_ID
  done_B = is_eos_BC.any(1)
  assert done_B.any() and not done_B.all(), 'want a mix; pick another key'
  lengths_B = np.where(done_B, is_eos_BC.argmax(1) + 1, max_new)
  np.testing.assert_array_equal(r.done_B, done_B)
  np.testing.assert_array_equal(r.lengths_B, lengths_B)
  valid_BC = np.arange(max_new) < lengths_B[:, None]
  np.testing.assert_array_equal(r.valid_BT[:, r.prompt_len:], valid_BC)
  assert r.valid_BT[:, :r.prompt_len].all()
  np.testing.assert_array_equal(r.completion_BC,
                                np.where(valid_BC, free.completion_BC, PAD_ID))
  np.testing.assert_allclose(r.logp_BC, np.where(valid_BC, free.logp_BC, 0),
                             atol=1e-6)
  valid_LBTK = np.broadcast_to(r.valid_BT[None, :, :, None],
                               r.routes_LBTK.shape)
  np.testing.assert_array_equal(r.routes_LBTK[valid_LBTK],
                                free.routes_LBTK[valid_LBTK])
  assert r.decode_steps == lengths_B.max()


def test_stop_ids_end_a_completion_as_eos_does(setup):
  """A stop id ends a row at its first occurrence, like EOS, whichever of
  the two comes first; rows with neither run to the budget."""
  state, prompts_NP = setup.state, setup.prompts_NP
  key, max_new = jax.random.key(0), C
  free = make_sampler(setup, num_generations=4, eos_id=-1)(
      state, prompts_NP, key)
  # The commonest non-EOS token of the free run, so the stop id fires.
  ids, num = np.unique(free.completion_BC[free.completion_BC != EOS_ID],
                       return_counts=True)
  stop = int(ids[num.argmax()])
  r = make_sampler(setup, num_generations=4, stop_ids=(stop,))(
      state, prompts_NP, key)
  ends_BC = (free.completion_BC == EOS_ID) | (free.completion_BC == stop)
  done_B = ends_BC.any(1)
  assert done_B.any() and not done_B.all(), 'want a mix; pick another key'
  # Some rows must end at the stop id for the test to see it work.
  first_B = free.completion_BC[np.arange(len(done_B)), ends_BC.argmax(1)]
  assert (done_B & (first_B == stop)).any()
  lengths_B = np.where(done_B, ends_BC.argmax(1) + 1, max_new)
  np.testing.assert_array_equal(r.done_B, done_B)
  np.testing.assert_array_equal(r.lengths_B, lengths_B)
  valid_BC = np.arange(max_new) < lengths_B[:, None]
  np.testing.assert_array_equal(r.completion_BC,
                                np.where(valid_BC, free.completion_BC, PAD_ID))
  with pytest.raises(ValueError):
    sampler_lib.SamplingParams(max_new_tokens=2, stop_ids=('x',))


def test_loop_stops_once_all_sequences_end(setup):
  """Greedy with EOS set to the first greedy token: every row ends at once."""
  state, prompts_NP = setup.state, setup.prompts_NP
  first = make_sampler(setup, num_generations=2, greedy=True)(
      state, prompts_NP, jax.random.key(0))
  eos = int(first.completion_BC[0, 0])
  rows = first.completion_BC[::2, 0] == eos
  r = make_sampler(setup, num_generations=2, greedy=True, eos_id=eos)(
      state, prompts_NP[rows], jax.random.key(0))
  assert r.done_B.all() and (r.lengths_B == 1).all()
  assert r.decode_steps == 1  # One extra call, to record the EOS's routes.
  assert (r.completion_BC[:, 1:] == PAD_ID).all()
  _, routes_LBTK, _ = full_forward(setup, r)
  np.testing.assert_array_equal(r.routes_LBTK[:, :, :r.prompt_len + 1],
                                routes_LBTK[:, :, :r.prompt_len + 1])


def test_odd_batch_is_padded_and_placement_passes_through(setup):
  """6 samples on 8 devices; a placement with replicas changes nothing."""
  cfg, state, prompts_NP = setup.cfg, setup.state, setup.prompts_NP[:3]
  smp = make_sampler(setup, num_generations=2, greedy=True)
  base = smp(state, prompts_NP, jax.random.key(0))
  assert base.tokens_BT.shape[0] == 6 and base.routes_LBTK.shape[1] == 6
  rng = np.random.default_rng(0)
  se = np.stack([rng.permutation(np.r_[np.arange(8), rng.integers(0, 8, 8)])
                 for _ in range(cfg.num_layers)]).astype(np.int32)
  cnt = np.stack([np.bincount(s, minlength=8) for s in se])
  share = np.stack([np.broadcast_to(1.0 / cnt[l][se[l]], (8, 16))
                    for l in range(cfg.num_layers)]).astype(np.float32)
  placed = smp(state, prompts_NP, jax.random.key(0),
               placement=placement_lib.Placement(se, share), capacity=64)
  np.testing.assert_array_equal(placed.tokens_BT, base.tokens_BT)
  np.testing.assert_array_equal(placed.routes_LBTK, base.routes_LBTK)
  np.testing.assert_allclose(placed.logp_BC, base.logp_BC, atol=1e-5)


def test_routes_dtype_and_length_check(setup):
  assert sampler_lib.routes_dtype(8) == np.int8
  assert sampler_lib.routes_dtype(127) == np.int8
  assert sampler_lib.routes_dtype(128) == np.int16
  assert sampler_lib.routes_dtype(40000) == np.int32
  smp = make_sampler(setup, max_new_tokens=setup.cfg.max_seq_len)
  with pytest.raises(ValueError, match='max_seq_len'):
    smp(setup.state, setup.prompts_NP, jax.random.key(0))


def test_right_padded_and_empty_prompts_are_refused(setup):
  """Only leading PADs are hidden, so a right-padded prompt would be
  continued after its PADs as if they were text: refused before any
  compute, naming the rows; so is a prompt with no token at all."""
  smp = make_sampler(setup, num_generations=1, greedy=True)
  right = setup.prompts_NP.copy()
  right[2] = np.r_[right[2, 2:], [PAD_ID, PAD_ID]]  # Shifted left, PAD after.
  with pytest.raises(ValueError, match=r'rows \[2\] end with PAD'):
    smp(setup.state, right, jax.random.key(0))
  empty = setup.prompts_NP.copy()
  empty[1] = PAD_ID
  with pytest.raises(ValueError, match=r'rows \[1\] are all PAD'):
    smp(setup.state, empty, jax.random.key(0))
  # Left padding, a PAD id inside the text (PAD standing in for EOS) and
  # the task's own prompts pass.
  inner = setup.prompts_NP.copy()
  inner[0, :2] = PAD_ID
  inner[0, 3] = PAD_ID
  sampler_lib.check_prompts(inner, PAD_ID)


def test_left_padded_prompts_decode_as_if_alone(setup):
  """Prompts of different lengths, left-padded with PAD to one width: each
  row's greedy completion, log-probs and routes equal the model's on that
  prompt alone, unpadded (a full forward from position 0)."""
  full = setup.prompts_NP  # [4, P]: BOS + problem.
  plen = full.shape[1]
  keep = [plen, plen - 2, 3, 1]  # Ids kept from the right; 1 = the '=' only.
  prompts = np.full_like(full, PAD_ID)
  for i, k in enumerate(keep):
    prompts[i, plen - k:] = full[i, plen - k:]
  smp = make_sampler(setup, num_generations=1, greedy=True)
  r = smp(setup.state, prompts, jax.random.key(0))
  np.testing.assert_array_equal(r.valid_BT[:, :plen],
                                np.arange(plen) >= plen - np.array(keep)[:, None])
  for i, k in enumerate(keep):
    n = int(r.lengths_B[i])
    seq = np.r_[full[i, plen - k:], r.completion_BC[i, :n]]  # Unpadded.
    tokens = np.zeros((16, len(seq)), np.int32)
    tokens[0] = seq
    valid = np.zeros((16, len(seq)), bool)
    valid[0] = True
    logits, aux = setup.forward(setup.state, tokens, valid)
    logits = np.asarray(logits[0])
    # Greedy tokens are the argmax of the unpadded forward...
    np.testing.assert_array_equal(logits[k - 1:-1].argmax(-1),
                                  r.completion_BC[i, :n])
    # ... their log-probs its log-softmax, and the routes its routes.
    logp = np.asarray(jax.nn.log_softmax(logits[k - 1:-1]))
    np.testing.assert_allclose(
        logp[np.arange(n), r.completion_BC[i, :n]], r.logp_BC[i, :n],
        atol=1e-5)
    np.testing.assert_array_equal(
        r.routes_LBTK[:, i, plen - k:plen + n],
        np.asarray(aux.routes_LBTK)[:, 0])
