"""HF import/export against an independent numpy forward of each family."""
import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from foremoe_jax import config as config_lib
from foremoe_jax import hf
from foremoe_jax.hf import convert, files, tensors as tensors_lib
import hf_numpy_reference as ref

FAMILIES = ('qwen3_moe', 'mixtral', 'olmoe')


def make(tmp_path, model_type, shards=1, seed=0, **overrides):
  c = ref.tiny_config(model_type, **overrides)
  t = ref.random_tensors(c, seed)
  d = str(tmp_path / f'{model_type}_{shards}_{seed}')
  ref.write_checkpoint(d, c, t, shards=shards)
  return d, c, t


def tokens(b=2, t=8, vocab=64, seed=0):
  return np.random.default_rng(seed).integers(0, vocab, (b, t)).astype(np.int32)


@pytest.mark.parametrize('model_type,shards,overrides', [
    ('qwen3_moe', 1, {}),  # head_dim 16 != hidden 32 / 4 heads.
    ('mixtral', 2, {}),  # Sharded, with model.safetensors.index.json.
    ('olmoe', 1, {}),  # q/k norm over the whole projection, no renorm.
    ('olmoe', 1, dict(tie_word_embeddings=True, num_key_value_heads=2)),
    ('qwen3_moe', 2, dict(mlp_only_layers=[0], norm_topk_prob=False)),
])
def test_logits_match_numpy_reference(tmp_path, model_type, shards, overrides):
  d, c, t = make(tmp_path, model_type, shards, **overrides)
  tok = tokens()
  ours = hf.forward_logits(d, tok)
  want = ref.forward(c, t, tok)
  assert ours.dtype == np.float32 and ours.shape == (2, 8, 64)
  np.testing.assert_allclose(ours, want, atol=1e-4, rtol=1e-4)


def test_model_config_follows_each_family(tmp_path):
  m = hf.model_config_from_hf(make(tmp_path, 'qwen3_moe')[0])
  assert (m.hf_model_type, m.head_dim, m.qk_norm, m.qk_norm_scope,
          m.renormalize_topk, m.rope_theta, m.moe_d_ff) == (
              'qwen3_moe', 16, True, 'head', True, 1e6, 24)
  m = hf.model_config_from_hf(make(tmp_path, 'mixtral')[0])
  assert (m.qk_norm, m.renormalize_topk, m.norm_eps, m.num_experts) == (
      False, True, 1e-5, 4)
  base = config_lib.model_defaults()
  base.dtype, base.remat_policy = 'bfloat16', 'full'
  m = hf.model_config_from_hf(make(tmp_path, 'olmoe')[0], base)
  assert (m.qk_norm_scope, m.renormalize_topk, m.head_dim, m.tie_embeddings) \
      == ('full', False, 8, False)
  assert (m.dtype, m.remat_policy) == ('bfloat16', 'full')  # Run choices kept.
  m = hf.model_config_from_hf(make(tmp_path, 'qwen3_moe', mlp_only_layers=[0])[0])
  assert (m.first_dense_layers, m.dense_d_ff) == (1, 48)
  # transformers 5 writes rope_parameters instead of rope_theta.
  d = make(tmp_path, 'mixtral', seed=1, rope_theta=None,
           rope_parameters={'rope_theta': 5e5, 'rope_type': 'default'})[0]
  assert hf.model_config_from_hf(d).rope_theta == 5e5


def _drop(d, key):
  t = files.read_tensors(d)
  del t[key]
  save_file(t, os.path.join(d, 'model.safetensors'))


def _add(d, key, x):
  t = files.read_tensors(d)
  t[key] = x
  save_file(t, os.path.join(d, 'model.safetensors'))


def test_errors_name_the_tensor_or_field(tmp_path):
  d, c, t = make(tmp_path, 'qwen3_moe')
  key = 'model.layers.1.mlp.experts.3.up_proj.weight'
  _drop(d, key)
  with pytest.raises(hf.HFCheckpointError, match=f'{key}: missing \\(expected '
                     r'shape \(24, 32\)\)'):
    hf.import_hf(d)

  d, c, t = make(tmp_path, 'mixtral', seed=2)
  _add(d, 'model.layers.0.block_sparse_moe.experts.4.w1.weight', t[
      'model.layers.0.block_sparse_moe.experts.0.w1.weight'])
  with pytest.raises(hf.HFCheckpointError,
                     match=r'model.layers.0.block_sparse_moe.experts.4.w1.weight: '
                     r'unexpected tensor \(shape \(24, 32\)\)'):
    hf.import_hf(d)

  d, c, t = make(tmp_path, 'olmoe', seed=3)
  _add(d, 'model.layers.0.self_attn.q_norm.weight', np.ones(8, np.float32))
  with pytest.raises(hf.HFCheckpointError,
                     match=r'model.layers.0.self_attn.q_norm.weight: expected '
                     r'shape \(32,\), found \(8,\)'):
    hf.import_hf(d)

  d, c, t = make(tmp_path, 'olmoe', seed=4)
  with open(os.path.join(d, 'config.json'), 'w') as f:
    json.dump(dict(c, model_type='llama', architectures=['LlamaForCausalLM']), f)
  with pytest.raises(hf.HFCheckpointError, match="model_type 'llama'"):
    hf.import_hf(d)

  cfg = {k: v for k, v in c.items() if k != 'hidden_size'}
  with open(os.path.join(d, 'config.json'), 'w') as f:
    json.dump(cfg, f)
  with pytest.raises(hf.HFCheckpointError, match='hidden_size: must be a '
                     'positive integer, got None'):
    hf.import_hf(d)

  # Dense layers after MoE ones are not expressible: a clear error, not a
  # silent mis-load.
  d = make(tmp_path, 'qwen3_moe', seed=5, mlp_only_layers=[1])[0]
  with pytest.raises(hf.HFCheckpointError, match='mlp_only_layers'):
    hf.import_hf(d)
  # A tied checkpoint may store the table twice, but only the same table.
  d, c, t = make(tmp_path, 'olmoe', seed=6, tie_word_embeddings=True)
  _add(d, 'lm_head.weight', t['model.embed_tokens.weight'])
  hf.import_hf(d)
  _add(d, 'lm_head.weight', t['model.embed_tokens.weight'] + 1)
  with pytest.raises(hf.HFCheckpointError, match='lm_head.weight: present'):
    hf.import_hf(d)
  # The one error is also a ConfigError: entry points print it as one line.
  assert issubclass(hf.HFCheckpointError, config_lib.ConfigError)


@pytest.mark.parametrize('model_type', FAMILIES)
def test_import_export_import_is_bit_exact(tmp_path, model_type):
  d, c, t = make(tmp_path, model_type, shards=2 if model_type == 'olmoe' else 1)
  m, state, hf_config = hf.import_hf(d)
  out = str(tmp_path / 'exported')
  hf.export_hf(m, state, out, original=hf_config)
  with safe_open(os.path.join(out, 'model.safetensors'), framework='np') as f:
    exported = {k: f.get_tensor(k) for k in f.keys()}
  assert {k: v.shape for k, v in exported.items()} == \
      {k: v.shape for k, v in t.items()}
  for k in t:
    np.testing.assert_array_equal(exported[k], t[k], err_msg=k)
  new_config = json.load(open(os.path.join(out, 'config.json')))
  for k, v in c.items():  # Every original field kept (rope_theta as float).
    assert new_config[k] == v, k
  m2, state2, _ = hf.import_hf(out)
  assert m2.to_dict() == m.to_dict()
  a, b = convert.params_of_state(state), convert.params_of_state(state2)
  assert a.keys() == b.keys()
  for path in a:
    assert np.array_equal(a[path], b[path]), path


def test_bfloat16_round_trip_and_sharded_export(tmp_path):
  d, c, t = make(tmp_path, 'mixtral', torch_dtype='bfloat16')
  t16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()}
  save_file(t16, os.path.join(d, 'model.safetensors'))
  m, state, hf_config = hf.import_hf(d)
  out = str(tmp_path / 'sharded')
  names = hf.export_hf(m, state, out, original=hf_config, dtype='bfloat16',
                       max_shard_bytes=4096)
  assert 'model.safetensors.index.json' in names and len(names) > 3
  index = json.load(open(os.path.join(out, 'model.safetensors.index.json')))
  assert set(index['weight_map']) == set(t)
  back = files.read_tensors(out)
  for k in t:
    assert back[k].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back[k].view(np.uint16),
                                  t16[k].view(np.uint16), err_msg=k)


def test_tensor_map_covers_every_parameter_once(tmp_path):
  m = hf.model_config_from_hf(make(tmp_path, 'qwen3_moe', mlp_only_layers=[0])[0])
  entries = tensors_lib.tensor_map(m)
  assert len({e.path for e in entries}) == len(tensors_lib.param_shapes(m))
  keys = [k for e in entries for k in e.hf_keys]
  assert len(keys) == len(set(keys))
