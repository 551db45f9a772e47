"""The three Hugging Face MoE families and how their config.json maps to ours.

Sits at the edge of the model: foremoe_jax/hf turns a Hugging Face
checkpoint into the model config and parameters the trainer builds
(`model/transformer.py`) and back. This module holds what differs between
the families (names of the MoE tensors, the q/k norm, the router's top-k
renormalisation, config defaults) and the config translation both ways;
`tensors.py` maps the weights, `files.py` reads and writes them.

Where HF is silent we follow its modeling code: a field missing from
config.json takes the HF config class's default (`Family.defaults`).

MSA (docs/design.md §6.10): an MSA model exports to its family's config.json
plus one field of our own, `"foremoe_msa": {"first_sparse_layer",
"block_size", "top_k", "index_dim"}`, beside the index-branch tensors
(tensors.py). transformers keeps an unknown config field as an attribute it
never reads, so the checkpoint still loads there as the dense model of its
family, with a warning that the `indexer` weights are unused (expected:
transformers has no MSA).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from foremoe_jax import config as config_lib


class HFCheckpointError(config_lib.ConfigError):
  """A Hugging Face checkpoint we cannot import (or a model we cannot export):
  the message names the config field or tensor key, and what was expected.
  A ConfigError (so a ValueError): entry points print it as one line."""


@dataclasses.dataclass(frozen=True)
class Family:
  model_type: str
  architecture: str
  moe_prefix: str  # Under 'model.layers.{i}.': the MoE block.
  expert_names: tuple[str, str, str]  # gate, up, down projections.
  num_experts_field: str
  qk_norm: str  # '': none; 'head' (per head_dim) or 'full' (whole projection).
  renormalize_field: str  # '' when the family always renormalises.
  defaults: dict[str, Any]


_COMMON = dict(hidden_act='silu', rope_theta=10_000.0, rope_scaling=None,
               tie_word_embeddings=False, attention_bias=False)

FAMILIES = {
    'qwen3_moe': Family(
        'qwen3_moe', 'Qwen3MoeForCausalLM', 'mlp',
        ('gate_proj', 'up_proj', 'down_proj'), 'num_experts', 'head',
        'norm_topk_prob',
        dict(_COMMON, rms_norm_eps=1e-6, norm_topk_prob=False,
             decoder_sparse_step=1, mlp_only_layers=[],
             use_sliding_window=False, max_position_embeddings=32768)),
    # Mixtral's router is a softmax over the top-k logits, which equals the
    # full softmax's top-k renormalised: renormalize_topk is always True.
    'mixtral': Family(
        'mixtral', 'MixtralForCausalLM', 'block_sparse_moe',
        ('w1', 'w3', 'w2'), 'num_local_experts', '', '',
        dict(_COMMON, rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None,
             max_position_embeddings=4096 * 32)),
    'olmoe': Family(
        'olmoe', 'OlmoeForCausalLM', 'mlp',
        ('gate_proj', 'up_proj', 'down_proj'), 'num_experts', 'full',
        'norm_topk_prob',
        dict(_COMMON, rms_norm_eps=1e-5, norm_topk_prob=False, clip_qkv=None,
             max_position_embeddings=4096)),
}
assert tuple(FAMILIES) == config_lib.HF_MODEL_TYPES

# config.json's "foremoe_msa" fields -> our model fields.
MSA_FIELD = 'foremoe_msa'
MSA_FIELDS = {'first_sparse_layer': 'first_sparse_layer',
              'block_size': 'msa_block_size', 'top_k': 'msa_top_k',
              'index_dim': 'msa_index_dim'}


def family_of(hf_config: dict) -> Family:
  """The family of a config.json dict, from model_type (or architectures)."""
  model_type = hf_config.get('model_type')
  if model_type in FAMILIES:
    return FAMILIES[model_type]
  for fam in FAMILIES.values():
    if fam.architecture in (hf_config.get('architectures') or ()):
      return fam
  raise HFCheckpointError(
      f'config.json: model_type {model_type!r} (architectures '
      f'{hf_config.get("architectures")}) is not supported; expected one of '
      f'{", ".join(FAMILIES)} ({", ".join(f.architecture for f in FAMILIES.values())})')


def _rope_theta(c: dict) -> float:
  """rope_theta from transformers 4 (rope_theta, rope_scaling) or 5
  (rope_parameters) configs; only plain RoPE is supported."""
  params = c.get('rope_parameters') or {}
  scaling = c.get('rope_scaling') or {}
  for field, d in (('rope_parameters', params), ('rope_scaling', scaling)):
    kind = d.get('rope_type', d.get('type', 'default'))
    if kind != 'default':
      raise HFCheckpointError(
          f'config.json: {field} {d} is not supported (plain RoPE only)')
  return float(params.get('rope_theta', c['rope_theta']))


def _require(cond: bool, field: str, rule: str) -> None:
  if not cond:
    raise HFCheckpointError(f'config.json: {field}: {rule}')


def _dense_layers(fam: Family, c: dict) -> int:
  """Qwen3-MoE's dense (MLP-only) layers, which must be the first few: our
  model has dense layers only there (model.first_dense_layers)."""
  if fam.model_type != 'qwen3_moe':
    return 0
  n, step = c['num_hidden_layers'], c['decoder_sparse_step']
  dense = [i for i in range(n)
           if i in c['mlp_only_layers'] or (i + 1) % step != 0]
  _require(dense == list(range(len(dense))) and len(dense) < n,
           'mlp_only_layers',
           f'dense layers {dense} (from mlp_only_layers '
           f'{c["mlp_only_layers"]} and decoder_sparse_step {step}) must be the '
           f'first k < num_hidden_layers ({n}) layers: our model has dense '
           f'FFNs only before its MoE layers (model.first_dense_layers)')
  return len(dense)


def _msa_config(c: dict, num_layers: int) -> dict | None:
  """The checkpoint's "foremoe_msa" field, checked (None when absent)."""
  msa = c.get(MSA_FIELD)
  if msa is None:
    return None
  _require(isinstance(msa, dict) and set(msa) == set(MSA_FIELDS), MSA_FIELD,
           f'must be a dict with exactly the fields {", ".join(MSA_FIELDS)}, '
           f'got {msa!r}')
  for f, v in msa.items():
    _require(isinstance(v, int) and not isinstance(v, bool) and v >= 0,
             f'{MSA_FIELD}.{f}', f'must be a non-negative integer, got {v!r}')
  _require(msa['first_sparse_layer'] < num_layers,
           f'{MSA_FIELD}.first_sparse_layer', f'must be < num_hidden_layers '
           f'({num_layers}), got {msa["first_sparse_layer"]}')
  _require(msa['index_dim'] > 0 and msa['index_dim'] % 2 == 0,
           f'{MSA_FIELD}.index_dim', f'must be a positive even number, got '
           f'{msa["index_dim"]}')
  return msa


def _apply_msa(m: ml_collections.ConfigDict, msa: dict | None) -> None:
  """An MSA checkpoint's settings onto `m` (docs/design.md §6.10).

  A dense base becomes the checkpoint's MSA model. An MSA base keeps its
  own first_sparse_layer, block size and top-k (choices of the run: layers
  it makes MSA without index tensors are initialised, index tensors of a
  layer it makes dense are refused), but the index head's width is in the
  weights.
  """
  if msa is None:
    return
  if m.attention_type != 'msa':
    m.attention_type = 'msa'
    m.update({ours: msa[theirs] for theirs, ours in MSA_FIELDS.items()})
  elif m.msa_index_dim != msa['index_dim']:
    raise HFCheckpointError(
        f'model.msa_index_dim: the base config has {m.msa_index_dim} but the '
        f'checkpoint\'s index branch has {msa["index_dim"]} (config.json '
        f'{MSA_FIELD}.index_dim); set model.msa_index_dim='
        f'{msa["index_dim"]}')


def model_config_from_hf(hf_config: dict,
                         base: ml_collections.ConfigDict | None = None
                         ) -> ml_collections.ConfigDict:
  """Our model config for a HF config.json dict.

  The architecture comes from the HF config; everything HF does not
  describe (dtype, param_dtype, remat_policy, aux_loss_coef, ...) from
  `base` (default `config.model_defaults()`). HF's router_aux_loss_coef is
  not taken: the balance loss is a choice of the RL run, not of the
  checkpoint.
  """
  fam = family_of(hf_config)
  c = {**fam.defaults, **{k: v for k, v in hf_config.items() if v is not None}}
  size_field = ('moe_intermediate_size' if fam.model_type == 'qwen3_moe'
                else 'intermediate_size')
  for f in ('vocab_size', 'hidden_size', 'num_hidden_layers',
            'num_attention_heads', 'num_experts_per_tok', size_field):
    _require(isinstance(c.get(f), int) and c[f] > 0, f,
             f'must be a positive integer, got {c.get(f)!r}')
  num_experts = c.get(fam.num_experts_field,
                      c.get('num_experts', c.get('num_local_experts')))
  _require(isinstance(num_experts, int) and num_experts > 0,
           fam.num_experts_field, f'must be a positive integer, got '
           f'{num_experts!r}')
  m = ml_collections.ConfigDict((base or config_lib.model_defaults()).to_dict())
  for f in ('hf_model_type', 'qk_norm_scope'):
    if f not in m:
      m[f] = config_lib.model_defaults()[f]
  _require(c['hidden_act'] == 'silu', 'hidden_act',
           f"only 'silu' (SwiGLU) is supported, got {c['hidden_act']!r}")
  _require(not c.get('attention_bias'), 'attention_bias',
           'biases in attention are not supported')
  _require(c.get('clip_qkv') is None, 'clip_qkv', 'q/k/v clipping is not '
           'supported')
  num_heads = c['num_attention_heads']
  head_dim = c.get('head_dim') or c['hidden_size'] // num_heads
  if fam.qk_norm == 'full':  # OLMoE derives head_dim, it has no field.
    head_dim = c['hidden_size'] // num_heads
  max_len = int(c['max_position_embeddings'])
  _require(not c.get('use_sliding_window'), 'use_sliding_window',
           'sliding-window attention is not supported')
  window = c.get('sliding_window') if fam.model_type == 'mixtral' else None
  _require(window is None or window >= max_len, 'sliding_window',
           f'a window ({window}) shorter than max_position_embeddings '
           f'({max_len}) is not supported')
  dense = _dense_layers(fam, c)
  m.update(
      name=fam.model_type,
      hf_model_type=fam.model_type,
      vocab_size=int(c['vocab_size']),
      d_model=int(c['hidden_size']),
      num_layers=int(c['num_hidden_layers']),
      num_heads=int(num_heads),
      num_kv_heads=int(c.get('num_key_value_heads') or num_heads),
      head_dim=int(head_dim),
      rope_theta=_rope_theta(c),
      norm_eps=float(c['rms_norm_eps']),
      tie_embeddings=bool(c['tie_word_embeddings']),
      qk_norm=bool(fam.qk_norm),
      qk_norm_scope=fam.qk_norm or 'head',
      max_seq_len=max_len,
      num_experts=int(num_experts),
      top_k=int(c['num_experts_per_tok']),
      moe_d_ff=int(c[size_field]),
      renormalize_topk=(bool(c[fam.renormalize_field])
                        if fam.renormalize_field else True),
      num_shared_experts=0, shared_d_ff=0,
      first_dense_layers=dense,
  )
  if dense:
    m.dense_d_ff = int(c['intermediate_size'])
  _apply_msa(m, _msa_config(c, m.num_layers))
  return m


def hf_config_from_model(m, original: dict | None = None,
                         dtype: str = 'float32') -> dict:
  """A full HF config.json dict for our model config `m`.

  Every field that fixes the architecture is written from `m`; the other
  fields of `original` (the imported config.json: token ids, initializer
  range, router_aux_loss_coef, ...) are kept as they were. An MSA model
  adds "foremoe_msa" (module docstring); a dense one drops it. Raises
  HFCheckpointError when `m` cannot be expressed in its family.
  """
  fam = FAMILIES.get(m.get('hf_model_type', ''))
  if fam is None:
    raise HFCheckpointError(
        f'model.hf_model_type: {m.get("hf_model_type", "")!r} names no '
        f'Hugging Face family; one of {", ".join(FAMILIES)} is needed to '
        f'export (experiments.export_hf --model_type)')
  def need(cond, field, rule):
    if not cond:
      raise HFCheckpointError(f'model.{field}: {rule} to export as '
                              f'{fam.model_type}')
  need(m.num_shared_experts == 0, 'num_shared_experts', 'must be 0')
  need(bool(m.qk_norm) == bool(fam.qk_norm), 'qk_norm',
       f'must be {bool(fam.qk_norm)}')
  if fam.qk_norm:
    need(m.get('qk_norm_scope', 'head') == fam.qk_norm, 'qk_norm_scope',
         f'must be {fam.qk_norm!r}')
  if fam.qk_norm == 'full':
    need(m.head_dim * m.num_heads == m.d_model, 'head_dim',
         'must be d_model / num_heads')
  if not fam.renormalize_field:
    need(m.renormalize_topk, 'renormalize_topk', 'must be True')
  need(m.first_dense_layers == 0 or fam.model_type == 'qwen3_moe',
       'first_dense_layers', 'must be 0')
  c = {k: v for k, v in (original or {}).items()
       if k not in ('rope_parameters', 'rope_scaling', 'torch_dtype', 'dtype')}
  c.update(
      architectures=[fam.architecture], model_type=fam.model_type,
      vocab_size=m.vocab_size, hidden_size=m.d_model,
      num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
      num_key_value_heads=m.num_kv_heads, hidden_act='silu',
      max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps,
      rope_theta=m.rope_theta, rope_scaling=None,
      tie_word_embeddings=bool(m.tie_embeddings),
      num_experts_per_tok=m.top_k, torch_dtype=dtype)
  c[fam.num_experts_field] = m.num_experts
  if fam.renormalize_field:
    c[fam.renormalize_field] = bool(m.renormalize_topk)
  if fam.model_type == 'qwen3_moe':
    c.update(head_dim=m.head_dim, moe_intermediate_size=m.moe_d_ff,
             decoder_sparse_step=1,
             mlp_only_layers=list(range(m.first_dense_layers)))
    c['intermediate_size'] = (m.dense_d_ff if m.first_dense_layers
                              else c.get('intermediate_size', m.moe_d_ff))
  else:
    c['intermediate_size'] = m.moe_d_ff
  if fam.model_type == 'mixtral':
    c['head_dim'] = m.head_dim
  c.pop(MSA_FIELD, None)
  if m.attention_type == 'msa':
    c[MSA_FIELD] = {theirs: int(m[ours]) for theirs, ours in MSA_FIELDS.items()}
  return c
