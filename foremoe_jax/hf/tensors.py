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
  * Our decoder layers are stored in segments, stacked along a leading
    layer axis (`config.layer_segments`); HF stores one tensor per layer
    (and per expert), so one of our leaves stacks n layers' tensors (and,
    for experts, n x E of them).
  * An MSA layer's index branch (docs/design.md §6.10) has no HF
    counterpart; we write it as extra tensors under
    `model.layers.{i}.self_attn.indexer.{q_proj,k_proj,q_norm,k_norm}.weight`
    (q_proj [G * I, M], k_proj [I, M]: [out, in] like the other Linear
    weights; norms [I]). An MSA layer whose checkpoint has none of them is
    initialised on import (msa_init.py): check_tensor_shapes lets exactly
    those be absent (`missing_index_layers`).

Shape letters: V vocab, M model dim, E experts, F expert hidden dim,
n layers of one segment.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np
from flax import nnx

from foremoe_jax import config as config_lib
from foremoe_jax.hf import families
from foremoe_jax.hf.families import HFCheckpointError
from foremoe_jax.model import shapes


# Our index-branch parameter -> its name under 'self_attn.' in a checkpoint.
INDEX_NAMES = {'qi_proj': 'indexer.q_proj', 'ki_proj': 'indexer.k_proj',
               'qi_norm': 'indexer.q_norm', 'ki_norm': 'indexer.k_norm'}
_INDEX_KEY = re.compile(r'model\.layers\.(\d+)\.self_attn\.indexer\.')


def attn_key(layer: int, name: str) -> str:
  """HF key of one layer's attention weight `name` ('q_proj', 'q_norm',
  'indexer.q_proj', ...)."""
  return f'model.layers.{layer}.self_attn.{name}.weight'


def index_keys(layer: int) -> tuple[str, ...]:
  """The HF keys of one layer's index branch."""
  return tuple(attn_key(layer, name) for name in INDEX_NAMES.values())


def index_layer_of(key: str) -> int | None:
  """The layer of an index-branch key, None for any other key."""
  match = _INDEX_KEY.match(key)
  return int(match.group(1)) if match else None


def missing_index_layers(model_cfg, found) -> list[int]:
  """The MSA layers of `model_cfg` for which `found` (HF keys) holds none of
  the index-branch tensors: the import initialises them (msa_init.py)."""
  types = config_lib.layer_attention_types(model_cfg)
  return [i for i, kind in enumerate(types) if kind == 'msa'
          and not any(k in found for k in index_keys(i))]


@dataclasses.dataclass(frozen=True)
class Entry:
  path: tuple  # nnx path in the model's state.
  # HF keys, flattened over the `stack` axes (layers, then experts).
  hf_keys: tuple[str, ...]
  kind: str  # 'copy' | 'transpose' (of each stacked tensor).
  shape: tuple[int, ...]  # Our shape (stack axes first).
  stack: tuple[int, ...] = ()  # Leading axes our leaf stacks: (), (n,), (n, E).

  def hf_shape(self) -> tuple[int, ...]:
    one = self.shape[len(self.stack):]
    return one if self.kind == 'copy' else one[::-1]


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
  segments = config_lib.layer_segments(model_cfg)
  out = []
  for path, shape in param_shapes(model_cfg).items():
    if path[0] == 'embed':
      out.append(Entry(path, ('model.embed_tokens.weight',), 'copy', shape))
    elif path[0] == 'final_norm':
      out.append(Entry(path, ('model.norm.weight',), 'copy', shape))
    elif path[0] == 'lm_head':
      out.append(Entry(path, ('lm_head.weight',), 'transpose', shape))
    else:
      out.append(_segment_entry(fam, segments[path[1]], path, shape,
                                (gate, up, down)))
  return out


def _segment_entry(fam, seg, path, shape, expert_names) -> Entry:
  _, _, module, *rest = path
  layers = range(seg.start, seg.stop)
  one = lambda fmt: tuple(fmt.format(p=f'model.layers.{i}.') for i in layers)
  if module in ('attn_norm', 'ffn_norm'):
    name = ('input_layernorm' if module == 'attn_norm'
            else 'post_attention_layernorm')
    return Entry(path, one(f'{{p}}{name}.weight'), 'copy', shape,
                 (seg.num_layers,))
  if module == 'attn':
    sub = rest[0]
    if sub in INDEX_NAMES:  # MSA index branch: our own names (docstring).
      return Entry(path, tuple(attn_key(i, INDEX_NAMES[sub]) for i in layers),
                   'transpose' if sub.endswith('_proj') else 'copy', shape,
                   (seg.num_layers,))
    if sub in ('q_norm', 'k_norm'):
      return Entry(path, one(f'{{p}}self_attn.{sub}.weight'), 'copy', shape,
                   (seg.num_layers,))
    if sub in ('q_proj', 'k_proj', 'v_proj', 'o_proj'):
      return Entry(path, one(f'{{p}}self_attn.{sub}.weight'), 'transpose',
                   shape, (seg.num_layers,))
  if module == 'ffn':
    sub = rest[0]
    moe = f'{fam.moe_prefix}.'
    if sub == 'router':
      return Entry(path, one(f'{{p}}{moe}gate.weight'), 'transpose', shape,
                   (seg.num_layers,))
    if sub in ('w_gate', 'w_up', 'w_down'):
      name = expert_names[('w_gate', 'w_up', 'w_down').index(sub)]
      keys = tuple(f'model.layers.{i}.{moe}experts.{e}.{name}.weight'
                   for i in layers for e in range(shape[1]))
      return Entry(path, keys, 'transpose', shape, shape[:2])
    if sub in ('gate', 'up', 'down'):  # A dense layer (Qwen3 mlp_only_layers).
      return Entry(path, one(f'{{p}}mlp.{sub}_proj.weight'), 'transpose',
                   shape, (seg.num_layers,))
  raise HFCheckpointError(f'parameter {"/".join(map(str, path))} of our model '
                          f'has no Hugging Face counterpart in {fam.model_type}')


def expected_hf_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
  """HF key -> shape of every tensor a checkpoint of `model_cfg` holds."""
  return {k: e.hf_shape() for e in tensor_map(model_cfg) for k in e.hf_keys}


def check_tensor_shapes(model_cfg, found: dict[str, tuple[int, ...]],
                        tied_lm_head_ok: bool = False) -> None:
  """Raises one HFCheckpointError naming the first missing, extra or
  mis-shaped tensor (and how many other problems there are).

  An MSA layer with none of its index-branch tensors is not missing them
  (the import initialises it, `missing_index_layers`); one with some of
  them must have all. Index tensors of a layer the config makes dense come
  first, naming model.first_sparse_layer.

  tied_lm_head_ok: an 'lm_head.weight' next to tied embeddings is not
  extra (some exporters write the tied table twice; the caller checks that
  it equals the embedding).
  """
  expected = expected_hf_shapes(model_cfg)
  types = config_lib.layer_attention_types(model_cfg)
  problems, on_dense = [], set()
  for layer, k in sorted((index_layer_of(k), k) for k in found
                         if index_layer_of(k) is not None):
    if layer >= len(types) or types[layer] != 'msa':
      on_dense.add(k)
      problems.append(
          f'{k}: index-branch tensor of layer {layer}, which the model config '
          f'makes dense (model.first_sparse_layer '
          f'{model_cfg.first_sparse_layer}, model.attention_type '
          f'{model_cfg.attention_type!r}); an MSA model with '
          f'model.first_sparse_layer <= {layer} would use it')
  initialised = {k for i in missing_index_layers(model_cfg, found)
                 for k in index_keys(i)}
  for k, shape in expected.items():
    if k in initialised:
      continue
    if k not in found:
      problems.append(f'{k}: missing (expected shape {shape})')
    elif tuple(found[k]) != shape:
      problems.append(f'{k}: expected shape {shape}, found {tuple(found[k])}')
  for k in sorted(set(found) - set(expected)):
    if k == 'lm_head.weight' and tied_lm_head_ok and model_cfg.tie_embeddings:
      continue
    if k in on_dense:  # Reported above.
      continue
    problems.append(f'{k}: unexpected tensor (shape {tuple(found[k])}) that '
                    f'the {model_cfg.hf_model_type} model does not use')
  if problems:
    more = (f' (and {len(problems) - 1} more problem(s), e.g. {problems[1]})'
            if len(problems) > 1 else '')
    raise HFCheckpointError(f'{problems[0]}{more}')


def params_from_hf(model_cfg, tensors) -> dict[tuple, np.ndarray]:
  """nnx path -> float32 array in our layout. `tensors` maps HF keys to
  arrays (any float dtype, e.g. bfloat16) and must hold every expected key
  (`check_tensor_shapes`; convert.py adds the initialised index branches)."""
  out = {}
  for e in tensor_map(model_cfg):
    parts = [np.asarray(tensors[k]) for k in e.hf_keys]
    if e.kind == 'transpose':
      parts = [x.T for x in parts]
    x = np.stack(parts).reshape(e.shape) if e.stack else parts[0]
    out[e.path] = np.ascontiguousarray(x, dtype=np.float32)
  return out


def hf_from_params(model_cfg, params: dict[tuple, np.ndarray],
                   dtype=np.float32) -> dict[str, np.ndarray]:
  """HF key -> array in `dtype`, from nnx path -> array (our layout)."""
  out = {}
  for e in tensor_map(model_cfg):
    x = np.asarray(params[e.path])
    parts = (x.reshape((len(e.hf_keys),) + e.shape[len(e.stack):])
             if e.stack else [x])
    for k, part in zip(e.hf_keys, parts):
      out[k] = np.ascontiguousarray(part.T if e.kind == 'transpose' else part,
                                    dtype=dtype)
  return out
