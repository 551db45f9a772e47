"""Hugging Face tensor names <-> our parameter paths, with the layout change.

Sits beside families.py at the model's edge: one table (`tensor_map`) lists,
for a model config, every parameter of `model.transformer.Transformer`
(its nnx path) with the HF keys it comes from and how, and both directions
(`params_from_hf`, `hf_from_params`) read that same table, so import and
export cannot drift apart.

Layout facts the table encodes:
  * HF Linear weights are [out, in]; our nnx kernels are [in, out]: transpose.
  * The canonical experts are stacked [E, M, F] (gate, up) and [E, F, M]
    (down), expert e at row e, which is the layout the trainer initialises
    (the slot layout of a placement is filled from it on device).
  * q/k are [heads, head_dim] head-major in both, and both apply RoPE in the
    half-split (rotate_half) convention (`layers.apply_rope`), so q_proj and
    k_proj need no row permutation (unlike Meta's interleaved Llama weights).
  * Embedding [V, M] is stored as is; lm_head only when untied.

Shape letters: V vocab, M model dim, E experts, F expert hidden dim.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from foremoe_jax.hf import families
from foremoe_jax.hf.families import HFCheckpointError
from foremoe_jax.model import shapes


@dataclasses.dataclass(frozen=True)
class Entry:
  path: tuple  # nnx path in the model's state.
  hf_keys: tuple[str, ...]  # One key, or one per expert (kind 'experts').
  kind: str  # 'copy' | 'transpose' | 'experts' (stack of transposes).
  shape: tuple[int, ...]  # Our shape.

  def hf_shape(self) -> tuple[int, ...]:
    if self.kind == 'copy':
      return self.shape
    if self.kind == 'transpose':
      return self.shape[::-1]
    return self.shape[1:][::-1]


def param_shapes(model_cfg) -> dict[tuple, tuple[int, ...]]:
  """nnx path -> shape of every parameter, from the abstract model."""
  _, state = nnx.split(shapes.abstract_model(model_cfg))
  return {path: tuple(v.shape) for path, v in nnx.to_flat_state(state)}


def tensor_map(model_cfg) -> list[Entry]:
  """Every parameter of the model with its HF keys, in state order."""
  fam = families.FAMILIES.get(model_cfg.get('hf_model_type', ''))
  if fam is None:
    raise HFCheckpointError(
        f'model.hf_model_type: {model_cfg.get("hf_model_type", "")!r} names '
        f'no Hugging Face family ({", ".join(families.FAMILIES)})')
  gate, up, down = fam.expert_names
  out = []
  for path, shape in param_shapes(model_cfg).items():
    if path[0] == 'embed':
      out.append(Entry(path, ('model.embed_tokens.weight',), 'copy', shape))
    elif path[0] == 'final_norm':
      out.append(Entry(path, ('model.norm.weight',), 'copy', shape))
    elif path[0] == 'lm_head':
      out.append(Entry(path, ('lm_head.weight',), 'transpose', shape))
    else:
      out.append(_block_entry(fam, path, shape, (gate, up, down)))
  return out


def _block_entry(fam, path, shape, expert_names) -> Entry:
  _, i, module, *rest = path
  p = f'model.layers.{i}.'
  if module in ('attn_norm', 'ffn_norm'):
    name = ('input_layernorm' if module == 'attn_norm'
            else 'post_attention_layernorm')
    return Entry(path, (f'{p}{name}.weight',), 'copy', shape)
  if module == 'attn':
    sub = rest[0]
    if sub in ('q_norm', 'k_norm'):
      return Entry(path, (f'{p}self_attn.{sub}.weight',), 'copy', shape)
    if sub in ('q_proj', 'k_proj', 'v_proj', 'o_proj'):
      return Entry(path, (f'{p}self_attn.{sub}.weight',), 'transpose', shape)
  if module == 'ffn':
    sub = rest[0]
    moe = f'{p}{fam.moe_prefix}.'
    if sub == 'router':
      return Entry(path, (f'{moe}gate.weight',), 'transpose', shape)
    if sub in ('w_gate', 'w_up', 'w_down'):
      name = expert_names[('w_gate', 'w_up', 'w_down').index(sub)]
      keys = tuple(f'{moe}experts.{e}.{name}.weight' for e in range(shape[0]))
      return Entry(path, keys, 'experts', shape)
    if sub in ('gate', 'up', 'down'):  # A dense layer (Qwen3 mlp_only_layers).
      return Entry(path, (f'{p}mlp.{sub}_proj.weight',), 'transpose', shape)
  raise HFCheckpointError(f'parameter {"/".join(map(str, path))} of our model '
                          f'has no Hugging Face counterpart in {fam.model_type}')


def expected_hf_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
  """HF key -> shape of every tensor a checkpoint of `model_cfg` holds."""
  return {k: e.hf_shape() for e in tensor_map(model_cfg) for k in e.hf_keys}


def check_tensor_shapes(model_cfg, found: dict[str, tuple[int, ...]],
                        tied_lm_head_ok: bool = False) -> None:
  """Raises one HFCheckpointError naming the first missing, extra or
  mis-shaped tensor (and how many other problems there are).

  tied_lm_head_ok: an 'lm_head.weight' next to tied embeddings is not
  extra (some exporters write the tied table twice; the caller checks that
  it equals the embedding).
  """
  expected = expected_hf_shapes(model_cfg)
  problems = []
  for k, shape in expected.items():
    if k not in found:
      problems.append(f'{k}: missing (expected shape {shape})')
    elif tuple(found[k]) != shape:
      problems.append(f'{k}: expected shape {shape}, found {tuple(found[k])}')
  for k in sorted(set(found) - set(expected)):
    if k == 'lm_head.weight' and tied_lm_head_ok and model_cfg.tie_embeddings:
      continue
    problems.append(f'{k}: unexpected tensor (shape {tuple(found[k])}) that '
                    f'the {model_cfg.hf_model_type} model does not use')
  if problems:
    more = (f' (and {len(problems) - 1} more problem(s), e.g. {problems[1]})'
            if len(problems) > 1 else '')
    raise HFCheckpointError(f'{problems[0]}{more}')


def params_from_hf(model_cfg, tensors) -> dict[tuple, np.ndarray]:
  """nnx path -> float32 array in our layout. `tensors` maps HF keys to
  arrays (any float dtype, e.g. bfloat16) and must hold exactly the
  expected keys (`check_tensor_shapes`)."""
  out = {}
  for e in tensor_map(model_cfg):
    if e.kind == 'experts':
      x = np.stack([np.asarray(tensors[k]).T for k in e.hf_keys])
    else:
      x = np.asarray(tensors[e.hf_keys[0]])
      if e.kind == 'transpose':
        x = x.T
    out[e.path] = np.ascontiguousarray(x, dtype=np.float32)
  return out


def hf_from_params(model_cfg, params: dict[tuple, np.ndarray],
                   dtype=np.float32) -> dict[str, np.ndarray]:
  """HF key -> array in `dtype`, from nnx path -> array (our layout)."""
  out = {}
  for e in tensor_map(model_cfg):
    x = np.asarray(params[e.path])
    if e.kind == 'experts':
      for idx, k in enumerate(e.hf_keys):
        out[k] = np.ascontiguousarray(x[idx].T, dtype=dtype)
    else:
      out[e.hf_keys[0]] = np.ascontiguousarray(
          x.T if e.kind == 'transpose' else x, dtype=dtype)
  return out
