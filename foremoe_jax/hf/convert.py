"""Whole Hugging Face checkpoints in and out of our model's parameter state.

Sits at the model's edge, on top of families.py (config), tensors.py (names
and layouts) and files.py (bytes). Import returns our model config and the
parameters as an nnx State shaped like `sharding.split_model`'s state of
`transformer.Transformer(model_config, ...)`, every leaf a float32 host
array (the trainer's master dtype, `rl/step.py:master_params`); callers put
it on their mesh (`place_like`). Export is the inverse.

MSA (docs/design.md §6.10): an MSA layer's index branch is read from the
checkpoint's `self_attn.indexer.*` tensors when it has them and otherwise
initialised from the layer's own q/k weights (msa_init.py); export writes
it under those names.

Shape letters: B batch, T tokens, V vocab.
"""
from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from foremoe_jax.hf import families, files, msa_init, tensors as tensors_lib
from foremoe_jax.hf.families import HFCheckpointError
from foremoe_jax.model import expert_parallel, shapes, sharding

# Model fields an HF checkpoint fixes (the others are choices of the run).
ARCH_FIELDS = ('hf_model_type', 'vocab_size', 'd_model', 'num_layers',
               'num_heads', 'num_kv_heads', 'head_dim', 'rope_theta',
               'norm_eps', 'tie_embeddings', 'qk_norm', 'qk_norm_scope',
               'num_experts', 'top_k', 'moe_d_ff', 'renormalize_topk',
               'num_shared_experts', 'first_dense_layers')


def model_config_from_hf(hf_dir: str, base_model_config=None
                         ) -> ml_collections.ConfigDict:
  """Our model config for the checkpoint in `hf_dir` (families.py: the
  architecture from config.json, the rest from `base_model_config`)."""
  return families.model_config_from_hf(files.read_config(hf_dir),
                                       base_model_config)


def import_hf(hf_dir: str, base_model_config=None):
  """(model config, params State of float32 host arrays, HF config dict).

  Checks every tensor's key and shape against the model before reading any
  data: one HFCheckpointError names the first missing, extra or mis-shaped
  tensor. MSA layers without index tensors get an index branch derived from
  their dense weights (`missing_index_layers`, msa_init.py).
  """
  hf_config = files.read_config(hf_dir)
  m = families.model_config_from_hf(hf_config, base_model_config)
  found = files.tensor_shapes(hf_dir)
  tensors_lib.check_tensor_shapes(m, found, tied_lm_head_ok=True)
  hf = files.LazyTensors(hf_dir)
  if m.tie_embeddings and 'lm_head.weight' in hf:
    if not np.array_equal(np.asarray(hf['lm_head.weight']),
                          np.asarray(hf['model.embed_tokens.weight'])):
      raise HFCheckpointError(
          'lm_head.weight: present and different from '
          'model.embed_tokens.weight, but tie_word_embeddings is true')
  initialised = msa_init.index_tensors_from_hf(
      m, hf, tensors_lib.missing_index_layers(m, found))
  params = tensors_lib.params_from_hf(m, collections.ChainMap(initialised, hf))
  return m, state_from_params(m, params), hf_config


def missing_index_layers(model_cfg, hf_dir: str) -> list[int]:
  """The MSA layers of `model_cfg` (a config from `model_config_from_hf`)
  whose index branch `hf_dir` lacks: the import initialises them from their
  dense weights (msa_init.py). Reads the safetensors headers only."""
  return tensors_lib.missing_index_layers(model_cfg,
                                         files.tensor_shapes(hf_dir))


def state_from_params(model_cfg, params: dict[tuple, np.ndarray]) -> nnx.State:
  """An nnx State like the model's (same Variable types and order) holding
  `params` (nnx path -> array)."""
  _, abstract = nnx.split(shapes.abstract_model(model_cfg))
  return nnx.from_flat_state([(path, v.replace(params[path]))
                              for path, v in nnx.to_flat_state(abstract)])


def params_of_state(state) -> dict[tuple, np.ndarray]:
  """nnx path -> host array of every leaf of a parameter State."""
  return {path: np.asarray(jax.device_get(v.get_value()))
          for path, v in nnx.to_flat_state(state)}


def place_like(new_state, old_state):
  """`new_state`'s arrays on `old_state`'s shardings, in its dtypes."""
  return jax.tree.map(
      lambda new, old: jax.device_put(np.asarray(new).astype(old.dtype),
                                      old.sharding), new_state, old_state)


def load_into(config, hf_dir: str) -> nnx.State:
  """The trainer's `init_from_hf`: the parameters of `hf_dir` as a State of
  float32 host arrays shaped like the state of Transformer(config.model).

  config.model must already describe the checkpoint
  (`config.model = model_config_from_hf(hf_dir, config.model)`); a
  mismatch is one HFCheckpointError naming the field.
  """
  m, state, _ = import_hf(hf_dir, config.model)
  # attention_type: an MSA checkpoint turns a dense base into MSA, whose
  # layers have parameters Transformer(config.model) lacks.
  for f in ARCH_FIELDS + ('attention_type',):
    if config.model.get(f) != m.get(f):
      raise HFCheckpointError(
          f'model.{f}: the config has {config.model.get(f)!r} but {hf_dir} '
          f'has {m.get(f)!r}; build config.model with model_config_from_hf')
  return state


def export_hf(model_cfg, state, out_dir: str, *, original: dict | None = None,
              dtype: str = 'float32', max_shard_bytes: int = 0) -> list[str]:
  """Writes `state` (our parameters) as a HF checkpoint of
  model_cfg.hf_model_type in `dtype`; returns the file names written.

  config.json: every architecture field from `model_cfg`, the other fields
  of `original` kept (families.hf_config_from_model).
  """
  hf_config = families.hf_config_from_model(model_cfg, original, dtype)
  hf = tensors_lib.hf_from_params(model_cfg, params_of_state(state),
                                  dtype=jnp.dtype(dtype))
  return files.write_checkpoint(out_dir, hf_config, hf, max_shard_bytes)


def forward_logits(hf_dir: str, tokens_BT: np.ndarray, mesh=None) -> np.ndarray:
  """float32 logits [B, T, V] of our model with the weights of `hf_dir`
  (float32 compute, dropless experts; default mesh: one device). A
  checkpoint exported from an MSA model runs as that MSA model."""
  m, state, _ = import_hf(hf_dir)
  tokens_BT = np.asarray(tokens_BT)
  if (tokens_BT.ndim != 2 or not np.issubdtype(tokens_BT.dtype, np.integer)
      or tokens_BT.min() < 0 or tokens_BT.max() >= m.vocab_size):
    # An out-of-range id would be clamped silently by the embedding gather.
    raise ValueError(f'tokens: need integers [B, T] in [0, {m.vocab_size}), '
                     f'got {tokens_BT.dtype} {tokens_BT.shape}')
  mesh = expert_parallel.make_mesh(1, 1) if mesh is None else mesh
  graphdef, _ = nnx.split(shapes.abstract_model(m, mesh))
  state = sharding.shard_state(state, mesh)

  @jax.jit
  def forward(state, tokens_BT):
    logits, _, _ = nnx.merge(graphdef, state)(tokens_BT)
    return logits
  return np.asarray(forward(state, jnp.asarray(tokens_BT, jnp.int32)))
