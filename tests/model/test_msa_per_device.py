"""The MSA layer's kernels run per device on a multi-GPU mesh.

The sampler's prefill and decode are jit'd on rows split over the mesh, and
let XLA partition attention. XLA cannot split a Pallas kernel (a custom
call it knows nothing of): it would gather every device's rows, and in
decode the whole KV cache, to each device and run the kernel on all of
them. So the MSA layer runs its kernels inside a shard_map over the rows
(`attention.Attention._per_device`). Checked here on the traced prefill
and decode of the tiny MSA model on 8 devices, with the choices a GPU
backend makes, and lowered for CUDA (no device needed); interpreted on
CPU, the per-device kernels sample what the XLA path samples, and a
sharded training step (the warm start's form: jit, no shard_map of its
own) gets its gradients.
"""
import importlib

import jax
import jax.extend.core as jax_core
import numpy as np
import pytest
from flax import nnx

from foremoe_jax.benchmarks import remat
from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.model import sharding, transformer
from foremoe_jax.rollout import sampler as sampler_lib
from pallas_kernels.msa import api as msa_api


def _kernel_sites(jaxpr, manual=()):
  """[(kernel name, mesh axes of the shard_maps around it)] of every
  pallas_call in a closed jaxpr, nested calls and loops included."""
  out = []
  for eqn in jaxpr.eqns:
    inner = manual
    if eqn.primitive.name == 'shard_map':
      inner = manual + tuple(eqn.params['mesh'].axis_names)
    if eqn.primitive.name == 'pallas_call':
      name = eqn.params['name']
      out.append((getattr(name, 'name', name), manual))
      continue
    for sub in jax_core.jaxprs_in_params(eqn.params):
      out.extend(_kernel_sites(sub, inner))
  return out


def _interpret_gpu_kernels(monkeypatch):
  """MSA's 'auto' takes the Pallas GPU kernels, interpreted on this CPU."""
  monkeypatch.setattr(msa_api, 'resolve_impl', lambda impl, pallas_backend=None: (
      'pallas' if impl == 'auto' else impl, 'gpu', True))


@pytest.fixture(scope='module')
def msa_sampler():
  cfg = importlib.import_module('configs.tiny_msa').get_config().model
  cfg.msa_block_size = 16  # The Triton kernels' smallest tile.
  mesh = ep.make_mesh(1, 8)
  model = transformer.Transformer(cfg, mesh, rngs=nnx.Rngs(0))
  # Varied samples (a fresh tied embedding makes them nearly one-hot).
  model.embed.embedding[...] = model.embed.embedding[...] * 0.2
  graphdef, state = sharding.split_model(model, mesh)
  params = sampler_lib.SamplingParams(max_new_tokens=4)
  return sampler_lib.Sampler(graphdef, cfg, mesh, params), state


def test_the_msa_kernels_run_per_device_in_prefill_and_decode(
    gpu_choices, msa_sampler):
  del gpu_choices
  sampler, state = msa_sampler
  rows, plen = 16, 28
  prompts_BP = np.ones((rows, plen), np.int32)
  valid_B = np.ones((rows,), bool)
  key = jax.random.key(0)
  cache = sampler._init_cache_fn(state, rows, plen + 4)
  prefill = lambda *a: sampler._prefill_fn(*a, capacity=None)
  sites = _kernel_sites(jax.make_jaxpr(prefill)(
      state, prompts_BP, valid_B, key, None, cache).jaxpr)
  carry = jax.eval_shape(prefill, state, prompts_BP, valid_B, key, None,
                         cache)
  decode = lambda *a: sampler._decode_fn(*a, capacity=None)
  sites_decode = _kernel_sites(jax.make_jaxpr(decode)(
      state, carry, key, None).jaxpr)
  # Per device: the index scores, the top-k and the main branch in both.
  assert len(sites) >= 3 and len(sites_decode) >= 3, (sites, sites_decode)
  for name, axes in sites + sites_decode:
    assert set(axes) == {ep.DATA, ep.EXPERT}, (name, axes)
  # And both lower for CUDA, each kernel a Triton call.
  for fn, args in ((prefill, (state, prompts_BP, valid_B, key, None, cache)),
                   (decode, (state, carry, key, None))):
    text = jax.jit(fn).trace(*args).lower(
        lowering_platforms=('cuda',)).as_text()
    assert text.count('__gpu$xla.gpu.triton') >= 3


def test_msa_layers_get_a_cache_the_decode_kernels_read_in_place(
    gpu_choices, msa_sampler):
  # 33 slots asked for: an MSA layer's cache is as long as the GPU decode
  # reads without a pad (a copy of it per step: test_msa_kernels.py), a
  # dense layer's exactly as asked; the sampler test below decodes on such
  # a cache and samples what the XLA path samples on a 30-slot one.
  del gpu_choices
  sampler, state = msa_sampler
  cache = sampler._init_cache_fn(state, 16, 33)
  types = transformer.config_lib.layer_attention_types(sampler.cfg)
  assert 'msa' in types and 'dense' in types, types
  for t, c in zip(types, cache):
    want = (msa_api.decode_cache_len(33, block_size=16) if t == 'msa'
            else 33)
    assert c.k_BSGD.shape[1] == c.v_BSGD.shape[1] == c.valid_BS.shape[1] \
        == want, (t, c.k_BSGD.shape)
    if t == 'msa':
      assert want == 64 and c.ki_BSI.shape[1] == want


def test_per_device_kernels_sample_what_the_xla_path_samples(msa_sampler,
                                                           monkeypatch):
  # The same sampler with the Pallas GPU kernels, interpreted on CPU, run
  # per device inside the layer's shard_map: the same tokens and log-probs
  # as the XLA path, left-padded prompts included.
  sampler, state = msa_sampler
  prompts_NP = np.random.default_rng(0).integers(
      3, sampler.cfg.vocab_size, (4, 24)).astype(np.int32)
  prompts_NP[0, :5] = sampler.params.pad_id
  params = sampler_lib.SamplingParams(max_new_tokens=6, num_generations=4)
  make = lambda: sampler_lib.Sampler(sampler.graphdef, sampler.cfg,
                                     sampler.mesh, params)
  want = make()(state, prompts_NP, jax.random.key(1))
  _interpret_gpu_kernels(monkeypatch)
  got = make()(state, prompts_NP, jax.random.key(1))
  np.testing.assert_array_equal(got.tokens_BT, want.tokens_BT)
  np.testing.assert_allclose(got.logp_BC, want.logp_BC, atol=1e-5)


def test_per_device_kernels_give_the_xla_paths_gradients(monkeypatch):
  # Gradients flow back through the layer's shard_map and the kernels'
  # custom VJPs (interpreted) to every parameter: as the XLA path's.
  cfg = importlib.import_module('configs.tiny_msa').get_config().model
  cfg.msa_block_size = 16
  mesh = ep.make_mesh(1, 8)
  tokens_BT = jax.random.randint(jax.random.key(1), (8, 33), 0,
                                 cfg.vocab_size)
  out = {}
  for mode in ('xla', 'kernels'):
    if mode == 'kernels':
      _interpret_gpu_kernels(monkeypatch)
    params, loss_of = remat.loss_fn(cfg, mesh, tokens_BT)
    grad_fn = jax.value_and_grad(loss_of)
    sites = _kernel_sites(jax.make_jaxpr(grad_fn)(params).jaxpr)
    loss, grads = jax.jit(grad_fn)(params)
    out[mode] = (float(loss), jax.tree.leaves(grads), sites)
  assert not out['xla'][2]
  # Forward and backward kernels, all per device.
  assert len(out['kernels'][2]) >= 5, out['kernels'][2]
  assert all(set(axes) == {ep.DATA, ep.EXPERT}
             for _, axes in out['kernels'][2]), out['kernels'][2]
  np.testing.assert_allclose(out['kernels'][0], out['xla'][0], rtol=1e-6)
  for got, want in zip(out['kernels'][1], out['xla'][1]):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4,
                               atol=1e-6)
