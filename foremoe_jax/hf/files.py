"""Hugging Face checkpoint files: config.json and safetensors, one file or sharded.

Sits at the model's edge with families.py (config) and tensors.py (names
and layouts); this module only reads and writes bytes, with safetensors'
numpy API. Two forms are read: `model.safetensors`, or shards named by
`model.safetensors.index.json` (`weight_map`: key -> file). Writing uses
the single file when it fits `max_shard_bytes`, else the sharded form
with HF's names (`model-00001-of-00003.safetensors`).
"""
from __future__ import annotations

import collections.abc
import json
import os

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from foremoe_jax.hf.families import HFCheckpointError

CONFIG = 'config.json'
SINGLE = 'model.safetensors'
INDEX = 'model.safetensors.index.json'


def _read_json(path: str):
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise HFCheckpointError(f'{path}: not valid JSON ({e}); the file may be '
                            f'truncated: download it again') from None


def open_safetensors(path: str):
  """safe_open(path) with a truncated or corrupt file as one
  HFCheckpointError naming it (safetensors checks the header against the
  file's size when it opens the file, so no later read fails this way)."""
  try:
    return safe_open(path, framework='np')
  except SafetensorError as e:
    raise HFCheckpointError(
        f'{path}: not a complete safetensors file '
        f'({str(e).splitlines()[0]}; {os.path.getsize(path)} bytes): an '
        f'interrupted download or copy; fetch the file again') from None


def read_config(hf_dir: str) -> dict:
  path = os.path.join(hf_dir, CONFIG)
  if not os.path.isfile(path):
    raise HFCheckpointError(f'{path}: no config.json in the checkpoint directory')
  return _read_json(path)


def _key_files(hf_dir: str) -> dict[str, str]:
  """HF key -> the safetensors file that holds it."""
  index = os.path.join(hf_dir, INDEX)
  if os.path.isfile(index):
    weight_map = _read_json(index)['weight_map']
    return {k: os.path.join(hf_dir, v) for k, v in weight_map.items()}
  single = os.path.join(hf_dir, SINGLE)
  if not os.path.isfile(single):
    raise HFCheckpointError(f'{hf_dir}: neither {SINGLE} nor {INDEX} found')
  with open_safetensors(single) as f:
    return {k: single for k in f.keys()}


def tensor_shapes(hf_dir: str) -> dict[str, tuple[int, ...]]:
  """HF key -> shape, from the safetensors headers only (no data read).

  A key the index names but its shard lacks is left out (reported missing).
  """
  by_file: dict[str, list[str]] = {}
  for k, path in _key_files(hf_dir).items():
    by_file.setdefault(path, []).append(k)
  out = {}
  for path, keys in by_file.items():
    if not os.path.isfile(path):
      raise HFCheckpointError(f'{path}: shard named by {INDEX} is missing')
    with open_safetensors(path) as f:
      have = set(f.keys())
      for k in keys:
        if k in have:
          out[k] = tuple(f.get_slice(k).get_shape())
  return out


class LazyTensors(collections.abc.Mapping):
  """HF key -> array as stored (bfloat16 as ml_dtypes.bfloat16), read from
  its file on first access, so an import holds one source tensor at a time
  beside the converted parameters, not the whole checkpoint twice."""

  def __init__(self, hf_dir: str):
    self._files = _key_files(hf_dir)
    self._open = {}

  def __getitem__(self, key: str) -> np.ndarray:
    path = self._files[key]
    if path not in self._open:
      self._open[path] = open_safetensors(path)
    return self._open[path].get_tensor(key)

  def __iter__(self):
    return iter(self._files)

  def __len__(self) -> int:
    return len(self._files)


def read_tensors(hf_dir: str) -> dict[str, np.ndarray]:
  """Every tensor of the checkpoint, read now (see `LazyTensors`)."""
  lazy = LazyTensors(hf_dir)
  return {k: lazy[k] for k in lazy}


def write_checkpoint(out_dir: str, hf_config: dict,
                     tensors: dict[str, np.ndarray],
                     max_shard_bytes: int = 0) -> list[str]:
  """Writes config.json and the weights; returns the files written.

  max_shard_bytes 0 (or at least the total size): one model.safetensors;
  smaller: shards of at most that many bytes (a tensor larger than it gets
  a shard of its own) plus model.safetensors.index.json, keys in order.
  """
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, CONFIG), 'w') as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
  total = sum(int(x.nbytes) for x in tensors.values())
  meta = {'format': 'pt'}  # What transformers checks before loading.
  written = [CONFIG]
  single = not max_shard_bytes or total <= max_shard_bytes
  # A stale file of the other form would win (the index) or confuse readers.
  stale = os.path.join(out_dir, INDEX if single else SINGLE)
  if os.path.exists(stale):
    os.remove(stale)
  if single:
    save_file(tensors, os.path.join(out_dir, SINGLE), metadata=meta)
    return written + [SINGLE]
  shards, size = [[]], 0
  for k, x in tensors.items():
    if shards[-1] and size + x.nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(k)
    size += int(x.nbytes)
  weight_map = {}
  for i, keys in enumerate(shards):
    name = f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors'
    save_file({k: tensors[k] for k in keys}, os.path.join(out_dir, name),
              metadata=meta)
    weight_map.update({k: name for k in keys})
    written.append(name)
  with open(os.path.join(out_dir, INDEX), 'w') as f:
    json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map},
              f, indent=2)
  return written + [INDEX]
