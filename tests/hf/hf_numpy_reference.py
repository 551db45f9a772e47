"""Independent numpy forward of the three HF MoE families, and tiny checkpoints.

Written from the Hugging Face modeling conventions directly on the HF
tensor dict (keys and [out, in] Linear weights), sharing no code with
foremoe_jax: RMSNorm, RoPE with rotate_half, GQA with a causal mask, a
softmax router with top-k (renormalised per family), SwiGLU experts and a
tied or untied lm_head. `write_checkpoint` builds small random checkpoints
with exactly the HF names, in one file or two shards.
"""
import json
import os

import numpy as np
from safetensors.numpy import save_file


def tiny_config(model_type: str, **overrides) -> dict:
  """A small config.json of each family (2 layers, d 32, 4 experts, top-2)."""
  base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=64,
              rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act='silu',
              tie_word_embeddings=False, torch_dtype='float32',
              bos_token_id=1, eos_token_id=2)
  if model_type == 'qwen3_moe':
    base.update(architectures=['Qwen3MoeForCausalLM'], model_type='qwen3_moe',
                head_dim=16, num_experts=4, moe_intermediate_size=24,
                intermediate_size=48, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[],
                router_aux_loss_coef=0.001, rope_theta=1e6)
  elif model_type == 'mixtral':
    base.update(architectures=['MixtralForCausalLM'], model_type='mixtral',
                num_local_experts=4, intermediate_size=24, rms_norm_eps=1e-5,
                sliding_window=None, router_jitter_noise=0.0)
  elif model_type == 'olmoe':
    base.update(architectures=['OlmoeForCausalLM'], model_type='olmoe',
                num_experts=4, intermediate_size=24, norm_topk_prob=False,
                num_key_value_heads=4, clip_qkv=None, rms_norm_eps=1e-5)
  base.update(overrides)
  return base


def _head_dim(c):
  if c['model_type'] == 'olmoe':
    return c['hidden_size'] // c['num_attention_heads']
  return c.get('head_dim') or c['hidden_size'] // c['num_attention_heads']


def _num_experts(c):
  return c['num_local_experts'] if c['model_type'] == 'mixtral' else c['num_experts']


def _dense_layers(c):
  if c['model_type'] != 'qwen3_moe':
    return set()
  return {i for i in range(c['num_hidden_layers'])
          if i in c.get('mlp_only_layers', [])
          or (i + 1) % c.get('decoder_sparse_step', 1) != 0}


def random_tensors(c: dict, seed: int = 0) -> dict:
  """HF key -> float32 array of the shapes the HF model declares."""
  rng = np.random.default_rng(seed)
  m, h, g = c['hidden_size'], c['num_attention_heads'], c['num_key_value_heads']
  d, e, v = _head_dim(c), _num_experts(c), c['vocab_size']
  f = c['moe_intermediate_size'] if c['model_type'] == 'qwen3_moe' \
      else c['intermediate_size']
  lin = lambda o, i: (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)
  norm = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
  t = {'model.embed_tokens.weight': rng.standard_normal((v, m)).astype(np.float32),
       'model.norm.weight': norm(m)}
  if not c['tie_word_embeddings']:
    t['lm_head.weight'] = lin(v, m)
  for i in range(c['num_hidden_layers']):
    p = f'model.layers.{i}.'
    t[p + 'input_layernorm.weight'] = norm(m)
    t[p + 'post_attention_layernorm.weight'] = norm(m)
    t[p + 'self_attn.q_proj.weight'] = lin(h * d, m)
    t[p + 'self_attn.k_proj.weight'] = lin(g * d, m)
    t[p + 'self_attn.v_proj.weight'] = lin(g * d, m)
    t[p + 'self_attn.o_proj.weight'] = lin(m, h * d)
    if c['model_type'] == 'qwen3_moe':
      t[p + 'self_attn.q_norm.weight'] = norm(d)
      t[p + 'self_attn.k_norm.weight'] = norm(d)
    elif c['model_type'] == 'olmoe':
      t[p + 'self_attn.q_norm.weight'] = norm(h * d)
      t[p + 'self_attn.k_norm.weight'] = norm(g * d)
    if i in _dense_layers(c):
      fd = c['intermediate_size']
      t[p + 'mlp.gate_proj.weight'] = lin(fd, m)
      t[p + 'mlp.up_proj.weight'] = lin(fd, m)
      t[p + 'mlp.down_proj.weight'] = lin(m, fd)
      continue
    if c['model_type'] == 'mixtral':
      moe, names = p + 'block_sparse_moe.', ('w1', 'w3', 'w2')
    else:
      moe, names = p + 'mlp.', ('gate_proj', 'up_proj', 'down_proj')
    t[moe + 'gate.weight'] = lin(e, m)
    for j in range(e):
      t[f'{moe}experts.{j}.{names[0]}.weight'] = lin(f, m)
      t[f'{moe}experts.{j}.{names[1]}.weight'] = lin(f, m)
      t[f'{moe}experts.{j}.{names[2]}.weight'] = lin(m, f)
  return t


def write_checkpoint(hf_dir, c: dict, tensors: dict, shards: int = 1) -> None:
  """config.json + model.safetensors, or `shards` files and the index."""
  os.makedirs(hf_dir, exist_ok=True)
  with open(os.path.join(hf_dir, 'config.json'), 'w') as f:
    json.dump(c, f)
  if shards == 1:
    save_file(tensors, os.path.join(hf_dir, 'model.safetensors'))
    return
  keys = list(tensors)
  weight_map = {}
  for s in range(shards):
    name = f'model-{s + 1:05d}-of-{shards:05d}.safetensors'
    part = keys[s::shards]
    save_file({k: tensors[k] for k in part}, os.path.join(hf_dir, name))
    weight_map.update({k: name for k in part})
  with open(os.path.join(hf_dir, 'model.safetensors.index.json'), 'w') as f:
    json.dump({'metadata': {}, 'weight_map': weight_map}, f)


def _rms_norm(x, w, eps):
  x = x.astype(np.float64)
  return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rotate_half(x):
  half = x.shape[-1] // 2
  return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _rope(x_BHTD, theta):
  d = x_BHTD.shape[-1]
  inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
  freqs = np.arange(x_BHTD.shape[2])[:, None] * inv_freq[None]
  emb = np.concatenate([freqs, freqs], axis=-1)  # [T, D]
  return x_BHTD * np.cos(emb) + _rotate_half(x_BHTD) * np.sin(emb)


def _softmax(x, axis=-1):
  x = x - x.max(axis=axis, keepdims=True)
  e = np.exp(x)
  return e / e.sum(axis=axis, keepdims=True)


def _silu(x):
  return x / (1 + np.exp(-x))


def forward(c: dict, t: dict, tokens_BT: np.ndarray) -> np.ndarray:
  """Logits [B, T, V] in float64 from the HF tensor dict."""
  w = {k: np.asarray(v, np.float64) for k, v in t.items()}
  mt = c['model_type']
  eps, theta = c['rms_norm_eps'], c.get('rope_theta', 10000.0)
  h, g, d = c['num_attention_heads'], c['num_key_value_heads'], _head_dim(c)
  e_num, k_top = _num_experts(c), c['num_experts_per_tok']
  renorm = True if mt == 'mixtral' else c.get('norm_topk_prob', False)
  b, n = tokens_BT.shape
  x = w['model.embed_tokens.weight'][tokens_BT]  # [B, T, M]
  causal = np.tril(np.ones((n, n), bool))
  for i in range(c['num_hidden_layers']):
    p = f'model.layers.{i}.'
    hn = _rms_norm(x, w[p + 'input_layernorm.weight'], eps)
    q = hn @ w[p + 'self_attn.q_proj.weight'].T
    k = hn @ w[p + 'self_attn.k_proj.weight'].T
    v = hn @ w[p + 'self_attn.v_proj.weight'].T
    if mt == 'olmoe':  # Norm over the whole projection, before the heads.
      q = _rms_norm(q, w[p + 'self_attn.q_norm.weight'], eps)
      k = _rms_norm(k, w[p + 'self_attn.k_norm.weight'], eps)
    q = q.reshape(b, n, h, d).transpose(0, 2, 1, 3)
    k = k.reshape(b, n, g, d).transpose(0, 2, 1, 3)
    v = v.reshape(b, n, g, d).transpose(0, 2, 1, 3)
    if mt == 'qwen3_moe':  # Norm per head over head_dim.
      q = _rms_norm(q, w[p + 'self_attn.q_norm.weight'], eps)
      k = _rms_norm(k, w[p + 'self_attn.k_norm.weight'], eps)
    q, k = _rope(q, theta), _rope(k, theta)
    k = np.repeat(k, h // g, axis=1)  # HF repeat_kv: kv head j // (h / g).
    v = np.repeat(v, h // g, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d)
    s = np.where(causal, s, -np.inf)
    a = (_softmax(s) @ v).transpose(0, 2, 1, 3).reshape(b, n, h * d)
    x = x + a @ w[p + 'self_attn.o_proj.weight'].T
    hn = _rms_norm(x, w[p + 'post_attention_layernorm.weight'], eps)
    if p + 'mlp.gate_proj.weight' in w:  # Dense layer.
      y = (_silu(hn @ w[p + 'mlp.gate_proj.weight'].T)
           * (hn @ w[p + 'mlp.up_proj.weight'].T)) @ w[p + 'mlp.down_proj.weight'].T
      x = x + y
      continue
    if mt == 'mixtral':
      moe, names = p + 'block_sparse_moe.', ('w1', 'w3', 'w2')
    else:
      moe, names = p + 'mlp.', ('gate_proj', 'up_proj', 'down_proj')
    flat = hn.reshape(b * n, -1)
    probs = _softmax(flat @ w[moe + 'gate.weight'].T)
    y = np.zeros_like(flat)
    for r in range(b * n):
      top = np.argsort(-probs[r], kind='stable')[:k_top]
      gates = probs[r, top]
      if renorm:
        gates = gates / gates.sum()
      for j, gate in zip(top, gates):
        ew = lambda nm: w[f'{moe}experts.{j}.{nm}.weight']
        hid = _silu(ew(names[0]) @ flat[r]) * (ew(names[1]) @ flat[r])
        y[r] += gate * (ew(names[2]) @ hid)
    x = x + y.reshape(b, n, -1)
  x = _rms_norm(x, w['model.norm.weight'], eps)
  head = (w['model.embed_tokens.weight'] if c['tie_word_embeddings']
          else w['lm_head.weight'])
  return x @ head.T
