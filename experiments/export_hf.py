"""Writes a trained (or converted) policy as a Hugging Face checkpoint.

  python -m experiments.export_hf --workdir=W --out=DIR [--dtype=bfloat16]
      [--max_shard_bytes=N]

W is a training workdir of experiments.rl_train (config.json and the latest
checkpoint under checkpoints/) or a workdir of experiments.convert_hf. DIR
gets config.json and model.safetensors, or shards with
model.safetensors.index.json when the weights exceed --max_shard_bytes.
"""
import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import json  # pylint: disable=g-import-not-at-top

from absl import flags, logging

from foremoe_jax.hf import workdir
from foremoe_jax.utils import cli
from foremoe_jax.utils.run_info import print_run_info

_WORKDIR = flags.DEFINE_string('workdir', None, 'Training or convert_hf '
                               'workdir.', required=True)
_OUT = flags.DEFINE_string('out', None, 'Output HF checkpoint directory.',
                           required=True)
_DTYPE = flags.DEFINE_enum('dtype', '', ['', *workdir.EXPORT_DTYPES],
                           "Weights' dtype; empty: the source checkpoint's "
                           'torch_dtype (float32 when there is none).')
_MAX_SHARD = flags.DEFINE_integer('max_shard_bytes', 0, 'Shard the weights '
                                  'into files of at most this many bytes '
                                  '(0: one model.safetensors).')
_MODEL_TYPE = flags.DEFINE_enum('model_type', '', ['', 'qwen3_moe', 'mixtral',
                                                   'olmoe'],
                                'HF family to write a model that was not '
                                'imported from HF (default: its own).')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every read at INFO.
  print_run_info({'workdir': _WORKDIR.value, 'out': _OUT.value,
                  'dtype': _DTYPE.value, 'max_shard_bytes': _MAX_SHARD.value})
  result = workdir.export_checkpoint(
      _WORKDIR.value, _OUT.value, dtype=_DTYPE.value,
      max_shard_bytes=_MAX_SHARD.value, model_type=_MODEL_TYPE.value)
  print(f"exported {result['hf_model_type']} ({result['dtype']}) to "
        f"{_OUT.value}: {', '.join(result['files'])}", flush=True)
  print(json.dumps(result), flush=True)


if __name__ == '__main__':
  cli.run(main)
