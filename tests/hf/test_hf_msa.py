"""MSA models through HF checkpoints: the index branch a dense checkpoint
starts with (foremoe_jax/hf/msa_init.py) and MSA checkpoints that round-trip."""
import importlib
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from foremoe_jax import config as config_lib
from foremoe_jax import hf
from foremoe_jax.hf import convert, files, msa_init, tensors as tensors_lib
from foremoe_jax.hf import workdir as workdir_lib
from foremoe_jax.model import attention, layers, shapes
from pallas_kernels import msa
import hf_numpy_reference as ref


def msa_model_config(**overrides):
  """configs/tiny_msa.py's model (MSA from layer 1, blocks of 4), Qwen3-MoE."""
  m = importlib.import_module('configs.tiny_msa').get_config().model
  m.hf_model_type, m.qk_norm = 'qwen3_moe', True
  m.update(overrides)
  return m


def msa_base(**overrides):
  """A base model config that asks for MSA from layer 1 (the run's choice)."""
  base = config_lib.model_defaults()
  base.update(dict(attention_type='msa', first_sparse_layer=1,
                   msa_block_size=4, msa_top_k=2, msa_index_dim=8), **overrides)
  return base


def random_params(param_shapes: dict, seed: int) -> dict:
  """path -> float32 array: norm scales around 1, other weights
  N(0, 1 / fan_in) (fan_in: the second-last axis)."""
  rng = np.random.default_rng(seed)
  out = {}
  for path, shape in param_shapes.items():
    if any('norm' in str(part) for part in path):
      x = 1 + 0.3 * rng.standard_normal(shape)
    else:
      x = rng.standard_normal(shape) / np.sqrt(shape[-2])
    out[path] = x.astype(np.float32)
  return out


def dense_checkpoint(tmp_path, seed=1, name='dense'):
  """tests/hf's tiny Qwen3-MoE: H 4, G 2, D 16, M 32, 2 layers."""
  c = ref.tiny_config('qwen3_moe')
  t = ref.random_tensors(c, seed)
  d = str(tmp_path / name)
  ref.write_checkpoint(d, c, t)
  return d, c, t


# The index branch from dense weights.

def test_index_scores_equal_attention_logits_when_one_head_and_I_equals_D():
  # R = G = 1, per-head q/k norm, I == D: qi == q and ki == k, so the index
  # logits are the attention logits and the selection their top-k blocks.
  m = msa_model_config(num_heads=1, num_kv_heads=1, head_dim=16,
                       msa_index_dim=16, msa_top_k=3, rope_theta=1e4)
  graphdef, abstract = nnx.split(nnx.eval_shape(
      lambda: attention.Attention(m, 'msa', rngs=nnx.Rngs(0))))
  params = random_params({path: v.shape for path, v in
                          nnx.to_flat_state(abstract)}, seed=0)
  branch = msa_init.index_branch_from_dense(
      m, params[('q_proj', 'kernel')], params[('k_proj', 'kernel')],
      params[('q_norm', 'scale')], params[('k_norm', 'scale')])
  for name, x in branch.items():
    params[(name, 'kernel' if name.endswith('_proj') else 'scale')] = x
  state = nnx.from_flat_state([(path, v.replace(params[path]))
                               for path, v in nnx.to_flat_state(abstract)])
  b, t, c, k_top = 2, 16, m.msa_block_size, m.msa_top_k
  x_BTM = np.random.default_rng(1).standard_normal(
      (b, t, m.d_model)).astype(np.float32)

  @jax.jit
  def pieces(state, x_BTM):
    attn = nnx.merge(graphdef, state)
    pos_BT = jnp.broadcast_to(jnp.arange(t), (b, t))
    # The model's own main-branch q and k (Attention.__call__'s first steps).
    q = attn.q_norm(attn.q_proj(x_BTM).reshape(b, t, 1, 16))
    k = attn.k_norm(attn.k_proj(x_BTM).reshape(b, t, 1, 16))
    q, k = (layers.apply_rope(y, pos_BT, m.rope_theta) for y in (q, k))
    qi_BTGI, ki_BSI = attn._index_branch(x_BTM, pos_BT)
    _, aux = msa.msa_attention(q, k, k, qi_BTGI, ki_BSI, block_size=c,
                               top_k=k_top)
    return q[:, :, 0], k[:, :, 0], qi_BTGI[:, :, 0], ki_BSI, aux['sel_BGTK']

  q_BTD, k_BSD, qi_BTI, ki_BSI, sel_BGTK = map(
      np.asarray, pieces(state, x_BTM))
  logits_BTS = np.einsum('btd,bsd->bts', q_BTD.astype(np.float64),
                         k_BSD.astype(np.float64)) / 4.0  # sqrt(D)
  index_BTS = np.einsum('bti,bsi->bts', qi_BTI.astype(np.float64),
                        ki_BSI.astype(np.float64)) / 4.0  # sqrt(I)
  np.testing.assert_allclose(index_BTS, logits_BTS, rtol=1e-5, atol=1e-5)
  chosen_earlier = 0
  for bi in range(b):
    for ti in range(t):
      local = ti // c  # Earlier blocks are wholly visible: rank their max.
      block_max = [logits_BTS[bi, ti, n * c:(n + 1) * c].max()
                   for n in range(local)]
      want = set(np.argsort(block_max)[::-1][:k_top - 1].tolist()) | {local}
      got = {int(s) for s in sel_BGTK[bi, 0, ti] if s >= 0}
      assert got == want, (bi, ti, got, want)
      chosen_earlier += local > k_top - 1  # A real choice was made.
  assert chosen_earlier > 0


def test_rope_pairs_keep_the_frequencies():
  d, i = 16, 8
  dims = msa_init.rope_pair_dims(d, i)
  assert dims.tolist() == [0, 2, 4, 6, 8, 10, 12, 14]  # Pairs j -> 2j.
  assert msa_init.rope_frequencies_exact(d, i)
  rope = jax.jit(layers.apply_rope, static_argnums=2)
  rng = np.random.default_rng(1)
  x_BTHD = rng.standard_normal((1, 40, 1, d)).astype(np.float32)
  pos_BT = np.arange(40)[None] * 3  # Angles well past 2 pi.
  rotated = np.asarray(rope(x_BTHD, pos_BT, 1e4))[..., dims]
  sub = np.asarray(rope(x_BTHD[..., dims], pos_BT, 1e4))
  np.testing.assert_allclose(sub, rotated, atol=2e-5)
  # I not dividing D: nearest pairs (0, 1.33, 2.67, 4, 5.33, 6.67), and the
  # frequencies then differ.
  dims = msa_init.rope_pair_dims(16, 12)
  assert dims.tolist() == [0, 1, 3, 4, 5, 7, 8, 9, 11, 12, 13, 15]
  assert not msa_init.rope_frequencies_exact(16, 12)
  rotated = np.asarray(rope(x_BTHD, pos_BT, 1e4))[..., dims]
  sub = np.asarray(rope(x_BTHD[..., dims], pos_BT, 1e4))
  assert np.abs(sub - rotated).max() > 0.1


def test_averaging_over_heads_and_groups_by_hand():
  # H 4, G 2 (R 2), D 4, I 2: index pair 0 copies main pair 0, dims (0, 2).
  m = ml_collections.ConfigDict(dict(num_heads=4, num_kv_heads=2, head_dim=4,
                                     msa_index_dim=2, qk_norm=True,
                                     qk_norm_scope='head'))
  q_kernel = np.stack([np.arange(16.), 100 + np.arange(16.)])  # [M 2, H*D]
  k_kernel = 10 * np.arange(8.)[None]  # [M 1, G*D]: kv head g dim d = 40g+10d.
  out = msa_init.index_branch_from_dense(m, q_kernel, k_kernel,
                                         np.array([1., 2., 3., 4.]),
                                         np.array([5., 6., 7., 8.]))
  # Head h, dim d sits at column 4h + d. Group 0 = heads 0, 1:
  # ((0 + 4) / 2, (2 + 6) / 2); group 1 = heads 2, 3: ((8 + 12) / 2, ...).
  np.testing.assert_array_equal(out['qi_proj'], [[2, 4, 10, 12],
                                                 [102, 104, 110, 112]])
  # Kv heads 0, 1: ((0 + 40) / 2, (20 + 60) / 2).
  np.testing.assert_array_equal(out['ki_proj'], [[20, 40]])
  np.testing.assert_array_equal(out['qi_norm'], [1, 3])
  np.testing.assert_array_equal(out['ki_norm'], [5, 7])
  assert all(x.dtype == np.float32 for x in out.values())
  for scope, qk_norm in (('full', True), ('head', False)):
    m.qk_norm_scope, m.qk_norm = scope, qk_norm
    out = msa_init.index_branch_from_dense(m, q_kernel, k_kernel,
                                           np.ones(16), np.ones(8))
    np.testing.assert_array_equal(out['qi_norm'], [1, 1])
    np.testing.assert_array_equal(out['ki_norm'], [1, 1])


# MSA checkpoints.

def test_msa_export_import_round_trip(tmp_path):
  m = msa_model_config(tie_embeddings=False)
  # Every weight random, the index branch and the norm scales included.
  params = random_params(tensors_lib.param_shapes(m), seed=2)
  state = convert.state_from_params(m, params)
  graphdef, _ = nnx.split(shapes.abstract_model(m))
  out = str(tmp_path / 'msa')
  hf.export_hf(m, state, out)
  config = json.load(open(os.path.join(out, 'config.json')))
  assert config['foremoe_msa'] == dict(first_sparse_layer=1, block_size=4,
                                       top_k=2, index_dim=16)
  found = files.tensor_shapes(out)
  p = 'model.layers.1.self_attn.indexer.'
  assert {k: v for k, v in found.items() if 'indexer' in k} == {
      p + 'q_proj.weight': (2 * 16, 64), p + 'k_proj.weight': (16, 64),
      p + 'q_norm.weight': (16,), p + 'k_norm.weight': (16,)}
  np.testing.assert_array_equal(
      files.read_tensors(out)[p + 'q_proj.weight'],
      params[('segments', 1, 'attn', 'qi_proj', 'kernel')][0].T)

  m2, state2, _ = hf.import_hf(out)  # Default (dense) base: MSA from config.
  for f in convert.ARCH_FIELDS + ('attention_type', 'first_sparse_layer',
                                  'msa_block_size', 'msa_top_k',
                                  'msa_index_dim'):
    assert m2[f] == m[f], f
  assert hf.missing_index_layers(m2, out) == []
  got = convert.params_of_state(state2)
  assert got.keys() == params.keys()
  for path in params:
    assert got[path].dtype == np.float32
    np.testing.assert_array_equal(got[path], params[path], err_msg=str(path))

  tokens_BT = np.random.default_rng(3).integers(
      0, m.vocab_size, (2, 16)).astype(np.int32)
  want = jax.jit(lambda s: nnx.merge(graphdef, s)(tokens_BT)[0])(state)
  np.testing.assert_allclose(convert.forward_logits(out, tokens_BT),
                             np.asarray(want), rtol=1e-6, atol=1e-6)

  # experiments.convert_hf / export_hf: the workdir keeps it MSA.
  work, out2 = str(tmp_path / 'work'), str(tmp_path / 'msa2')
  assert workdir_lib.convert_checkpoint(out, work)['attention_type'] == 'msa'
  workdir_lib.export_checkpoint(work, out2)
  assert json.load(open(os.path.join(out2, 'config.json')))['foremoe_msa'] \
      == config['foremoe_msa']
  back, want_t = files.read_tensors(out2), files.read_tensors(out)
  assert back.keys() == want_t.keys()
  for k in want_t:
    np.testing.assert_array_equal(back[k], want_t[k], err_msg=k)


def test_dense_checkpoint_with_msa_base_initialises_the_index_branch(tmp_path):
  d, c, t = dense_checkpoint(tmp_path)
  base = msa_base()
  m = hf.model_config_from_hf(d, base)
  assert (m.attention_type, m.first_sparse_layer, m.msa_block_size,
          m.msa_top_k, m.msa_index_dim) == ('msa', 1, 4, 2, 8)
  assert hf.missing_index_layers(m, d) == [1]
  _, state, _ = hf.import_hf(d, base)
  # load_into (init_from_hf) gives the same state once config.model is built.
  loaded = hf.load_into(ml_collections.ConfigDict({'model': m}), d)
  back = tensors_lib.hf_from_params(m, convert.params_of_state(state))
  for k in t:  # Every dense tensor exactly as in the checkpoint.
    np.testing.assert_array_equal(back[k], t[k], err_msg=k)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(a, b)
  assert sorted(set(back) - set(t)) == sorted(tensors_lib.index_keys(1))

  # The rule, re-derived on the HF tensors ([out, in]): index pair j takes
  # main pair 2j (D 16, I 8), query heads averaged per group (R 2), the two
  # kv heads averaged, norm scales at the same dims.
  h, g, dh, di, dm = 4, 2, 16, 8, 32
  pairs = [j * dh // di for j in range(di // 2)]
  dims = pairs + [p + dh // 2 for p in pairs]
  key = 'model.layers.1.self_attn.{}.weight'
  w = lambda name: t[key.format(name)].astype(np.float64)
  q, k = w('q_proj'), w('k_proj')
  want_q = np.zeros((g * di, dm))
  want_k = np.zeros((di, dm))
  for a, dim in enumerate(dims):
    for grp in range(g):
      heads = range(grp * h // g, (grp + 1) * h // g)
      want_q[grp * di + a] = sum(q[hd * dh + dim] for hd in heads) / len(heads)
    want_k[a] = sum(k[kv * dh + dim] for kv in range(g)) / g
  p = 'model.layers.1.self_attn.indexer.'
  np.testing.assert_allclose(back[p + 'q_proj.weight'], want_q, rtol=1e-6)
  np.testing.assert_allclose(back[p + 'k_proj.weight'], want_k, rtol=1e-6)
  np.testing.assert_array_equal(back[p + 'q_norm.weight'], w('q_norm')[dims])
  np.testing.assert_array_equal(back[p + 'k_norm.weight'], w('k_norm')[dims])


def _with_index_branch(d, c, t, layers, index_dim, first_sparse_layer):
  """Rewrites checkpoint `d` (M 32, G 2) as if exported from an MSA model."""
  rng = np.random.default_rng(3)
  t = dict(t)
  hf_shapes = {'q_proj': (2 * index_dim, 32), 'k_proj': (index_dim, 32),
               'q_norm': (index_dim,), 'k_norm': (index_dim,)}
  for i in layers:
    for name, shape in hf_shapes.items():
      t[f'model.layers.{i}.self_attn.indexer.{name}.weight'] = \
          rng.standard_normal(shape).astype(np.float32)
  c = dict(c, foremoe_msa=dict(first_sparse_layer=first_sparse_layer,
                               block_size=8, top_k=3, index_dim=index_dim))
  ref.write_checkpoint(d, c, t)
  return t


def test_msa_checkpoint_settings_and_errors(tmp_path):
  d, c, t = dense_checkpoint(tmp_path)
  t = _with_index_branch(d, c, t, [1], 8, 1)
  # A dense base becomes the checkpoint's MSA model.
  m, state, _ = hf.import_hf(d)
  assert (m.attention_type, m.first_sparse_layer, m.msa_block_size,
          m.msa_top_k, m.msa_index_dim) == ('msa', 1, 8, 3, 8)
  np.testing.assert_array_equal(
      convert.params_of_state(state)[('segments', 1, 'attn', 'ki_proj',
                                      'kernel')][0],
      t['model.layers.1.self_attn.indexer.k_proj.weight'].T)
  # An MSA base keeps its block size and top-k, from layer 0 on: layer 0 is
  # initialised, layer 1 read.
  m = hf.model_config_from_hf(d, msa_base(first_sparse_layer=0))
  assert (m.first_sparse_layer, m.msa_block_size, m.msa_top_k) == (0, 4, 2)
  assert hf.missing_index_layers(m, d) == [0]
  # ... but the index width is in the weights.
  with pytest.raises(hf.HFCheckpointError,
                     match=r'^model\.msa_index_dim: the base config has 16 but '
                     r"the checkpoint's index branch has 8"):
    hf.import_hf(d, msa_base(msa_index_dim=16))
  # init_from_hf with a config.model not built by model_config_from_hf.
  dense = hf.model_config_from_hf(d)
  dense.attention_type = 'dense'
  with pytest.raises(hf.HFCheckpointError, match=r'^model\.attention_type: '):
    hf.load_into(ml_collections.ConfigDict({'model': dense}), d)

  # Index tensors of a layer the config makes dense.
  d, c, t = dense_checkpoint(tmp_path, name='msa0')
  _with_index_branch(d, c, t, [0, 1], 8, 0)
  with pytest.raises(hf.HFCheckpointError,
                     match=r'^model\.layers\.0\.self_attn\.indexer\.k_norm\.'
                     r'weight: index-branch tensor of layer 0, which the model '
                     r'config makes dense \(model\.first_sparse_layer 1, '
                     r".*and 3 more problem"):
    hf.import_hf(d, msa_base(first_sparse_layer=1))
  # A layer with part of an index branch is missing the rest.
  part = dict(t, **{'model.layers.0.self_attn.indexer.q_norm.weight':
                    np.ones(8, np.float32)})
  ref.write_checkpoint(d, dict(c), part)
  with pytest.raises(hf.HFCheckpointError,
                     match=r'^model\.layers\.0\.self_attn\.indexer\.k_norm\.'
                     r'weight: missing \(expected shape \(8,\)\)'):
    hf.import_hf(d, msa_base(first_sparse_layer=0))
