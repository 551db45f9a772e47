"""Prints a config's parameter counts and bytes per expert, allocating nothing.

  python -m experiments.model_shapes --config=configs/qwen3_30b_a3b.py
"""
import json


from foremoe_jax import config as config_lib
from foremoe_jax.model import shapes
from foremoe_jax.utils import cli
from foremoe_jax.utils.run_info import print_run_info

_CONFIG = cli.define_config_file('configs/tiny.py')


def main(argv):
  del argv
  cfg = _CONFIG.value
  config_lib.validate_config(cfg)
  print_run_info({'config': cfg.model.name})
  print(json.dumps({'name': cfg.model.name, **shapes.param_counts(cfg.model)}))


if __name__ == '__main__':
  cli.run(main)
