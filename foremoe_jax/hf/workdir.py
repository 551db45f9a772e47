"""Workdirs of HF conversions and trainings: the bodies of the HF entry points.

Sits beside the trainer's shell (`rl/trainer.py`, `rl/checkpoint.py`):
`convert_checkpoint` writes a HF checkpoint's parameters as an orbax
checkpoint with its model config; `export_checkpoint` reads either that or a training workdir of
experiments.rl_train back into a HF checkpoint (convert.py does the
mapping).

A conversion workdir holds
  params/             orbax StandardCheckpointer: the float32 parameter State
  model_config.json   our model config (`model_config.to_dict()`)
  hf_config.json      the source config.json as it was (its extra fields
                      are written back on export)
A training workdir holds config.json (the whole experiment config) and
checkpoints/ (`rl.checkpoint.Checkpointer`, latest step); its HF source, when it has one,
is `init_from_hf`, whose config.json export reads again for the extra fields.
An MSA model's index branch travels as extra tensors and config.json's
"foremoe_msa" field (docs/design.md §6.10), so either workdir of an MSA
model exports to an MSA checkpoint.
"""
from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp
from flax import nnx

from foremoe_jax import config as config_lib
from foremoe_jax.hf import convert as convert_lib, families, files
from foremoe_jax.hf.families import HFCheckpointError
from foremoe_jax.model import expert_parallel, shapes, sharding
from foremoe_jax.rl import checkpoint as rl_checkpoint

PARAMS = 'params'
MODEL_CONFIG = 'model_config.json'
HF_CONFIG = 'hf_config.json'
EXPORT_DTYPES = ('float32', 'bfloat16', 'float16')


def _write_json(path: str, obj) -> None:
  with open(path, 'w') as f:
    json.dump(obj, f, indent=1, sort_keys=True)


def _read_json(path: str):
  with open(path) as f:
    return json.load(f)


def convert_checkpoint(hf_dir: str, workdir: str) -> dict:
  """HF checkpoint -> conversion workdir; returns what was written."""
  m, state, hf_config = convert_lib.import_hf(hf_dir)
  os.makedirs(workdir, exist_ok=True)
  ckptr = ocp.StandardCheckpointer()
  params_dir = os.path.abspath(os.path.join(workdir, PARAMS))
  ckptr.save(params_dir, state, force=True)
  ckptr.wait_until_finished()
  _write_json(os.path.join(workdir, MODEL_CONFIG), m.to_dict())
  _write_json(os.path.join(workdir, HF_CONFIG), hf_config)
  return dict(hf_model_type=m.hf_model_type, attention_type=m.attention_type,
              params_dir=params_dir,
              num_params=sum(math.prod(x.shape) for x in jax.tree.leaves(state)),
              model_config=os.path.join(workdir, MODEL_CONFIG),
              hf_config=os.path.join(workdir, HF_CONFIG))


def abstract_params(model_cfg, mesh=None):
  """The float32 parameter State's shapes and shardings (a restore template:
  orbax lays the arrays out on `mesh`, whatever mesh saved them)."""
  mesh = expert_parallel.make_mesh(1, 1) if mesh is None else mesh
  _, state = nnx.split(shapes.abstract_model(model_cfg, mesh))
  shardings = sharding.state_shardings(state, mesh)
  return jax.tree.map(
      lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, jnp.float32,
                                                  sharding=s)),
      state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _source_hf_config(hf_dir: str) -> dict | None:
  if hf_dir and os.path.isfile(os.path.join(hf_dir, files.CONFIG)):
    return files.read_config(hf_dir)
  return None


def read_workdir(workdir: str, model_type: str = ''):
  """(model config, params State, original HF config or None) of a
  conversion or training workdir (module docstring)."""
  if os.path.isfile(os.path.join(workdir, MODEL_CONFIG)):
    m = ml_collections.ConfigDict(_read_json(os.path.join(workdir, MODEL_CONFIG)))
    original = _read_json(os.path.join(workdir, HF_CONFIG)) \
        if os.path.isfile(os.path.join(workdir, HF_CONFIG)) else None
    restore = lambda template: ocp.StandardCheckpointer().restore(
        os.path.abspath(os.path.join(workdir, PARAMS)), template)
  elif os.path.isfile(os.path.join(workdir, 'config.json')):
    config = ml_collections.ConfigDict(_read_json(os.path.join(workdir,
                                                               'config.json')))
    m, hf_dir = config.model, config.get('init_from_hf', '')
    original = _source_hf_config(hf_dir)
    if not m.get('hf_model_type') and original is not None:
      # A config recorded before the trainer applied init_from_hf.
      m = families.model_config_from_hf(original, m)
    ckpt = rl_checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'))

    def restore(template):
      restored = ckpt.restore_latest(template)
      if restored is None:
        raise HFCheckpointError(f'{workdir}/checkpoints: no checkpoint to export')
      return restored['params']
  else:
    raise HFCheckpointError(
        f'{workdir}: neither {MODEL_CONFIG} (experiments.convert_hf) nor '
        f'config.json (experiments.rl_train) found')
  for f, v in config_defaults().items():
    if f not in m:
      m[f] = v
  if model_type and model_type != m.hf_model_type:
    # Another family's extra fields would not describe this one.
    m.hf_model_type, original = model_type, None
  return m, restore(abstract_params(m)), original


def config_defaults() -> dict:
  """Model fields newer than some workdirs, with the defaults they imply."""
  d = config_lib.model_defaults()
  return {f: d[f] for f in ('hf_model_type', 'qk_norm_scope')}


def export_checkpoint(workdir: str, out_dir: str, *, dtype: str = '',
                      max_shard_bytes: int = 0, model_type: str = '') -> dict:
  """Conversion or training workdir -> HF checkpoint in `out_dir`.

  dtype '': the source checkpoint's torch_dtype (float32 when unknown).
  """
  m, state, original = read_workdir(workdir, model_type)
  if not dtype:
    dtype = (original or {}).get('torch_dtype') or \
        (original or {}).get('dtype') or 'float32'
  if dtype not in EXPORT_DTYPES:
    raise HFCheckpointError(f'dtype: must be one of {", ".join(EXPORT_DTYPES)}, '
                            f'got {dtype!r}')
  written = convert_lib.export_hf(m, state, out_dir, original=original,
                                  dtype=dtype, max_shard_bytes=max_shard_bytes)
  return dict(hf_model_type=m.hf_model_type, attention_type=m.attention_type,
              dtype=dtype, out_dir=out_dir,
              files=written, kept_original_fields=original is not None)
