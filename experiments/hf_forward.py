"""Our model's logits for a Hugging Face checkpoint, to compare with HF's.

  python -m experiments.hf_forward --hf_dir=DIR --tokens_npy=IN.npy \
      --out_npy=OUT.npy

IN.npy holds int32 tokens [B, T]; OUT.npy gets float32 logits [B, T, V]
(float32 compute on one device, dropless experts).
"""
import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import json  # pylint: disable=g-import-not-at-top

from absl import flags
import numpy as np

from foremoe_jax import hf
from foremoe_jax.utils import cli
from foremoe_jax.utils.run_info import print_run_info

_HF_DIR = flags.DEFINE_string('hf_dir', None, 'HF checkpoint directory.',
                              required=True)
_TOKENS = flags.DEFINE_string('tokens_npy', None, 'int tokens [B, T] (.npy).',
                              required=True)
_OUT = flags.DEFINE_string('out_npy', None, 'Where to write the logits.',
                           required=True)


def main(argv):
  del argv
  tokens_BT = np.load(_TOKENS.value)
  print_run_info({'hf_dir': _HF_DIR.value, 'tokens': list(tokens_BT.shape)})
  logits_BTV = hf.forward_logits(_HF_DIR.value, tokens_BT)
  np.save(_OUT.value, logits_BTV)
  print(json.dumps({'out_npy': _OUT.value, 'shape': list(logits_BTV.shape),
                    'dtype': str(logits_BTV.dtype)}), flush=True)


if __name__ == '__main__':
  cli.run(main)
