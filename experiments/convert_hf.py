"""Converts a Hugging Face MoE checkpoint (Qwen3-MoE, Mixtral, OLMoE) to ours.

  python -m experiments.convert_hf --hf_dir=DIR --workdir=W

Writes W/params (orbax: the float32 parameter state of our Transformer),
W/model_config.json (our model config) and W/hf_config.json (the source
config.json, kept for export). The mapping is in foremoe_jax/hf.
"""
import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import json  # pylint: disable=g-import-not-at-top

from absl import flags, logging

from foremoe_jax.hf import workdir
from foremoe_jax.utils import cli
from foremoe_jax.utils.run_info import print_run_info

_HF_DIR = flags.DEFINE_string('hf_dir', None, 'HF checkpoint directory.',
                              required=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Output directory.',
                               required=True)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every write at INFO.
  print_run_info({'hf_dir': _HF_DIR.value, 'workdir': _WORKDIR.value})
  result = workdir.convert_checkpoint(_HF_DIR.value, _WORKDIR.value)
  print(f"converted {result['hf_model_type']} checkpoint {_HF_DIR.value} "
        f"({result['num_params']:,} parameters) into {result['params_dir']}",
        flush=True)
  print(json.dumps(result), flush=True)


if __name__ == '__main__':
  cli.run(main)
