"""The tiny main job with MiniMax Sparse Attention from layer 1 on.

Run:
  python -m experiments.rl_train --config=configs/tiny_msa.py --workdir=/tmp/foremoe_msa
"""
import ml_collections

from configs import tiny


def get_config() -> ml_collections.ConfigDict:
  c = tiny.get_config()
  c.model.attention_type = 'msa'
  c.model.first_sparse_layer = 1
  c.model.msa_block_size = 4
  c.model.msa_top_k = 2
  c.model.msa_index_dim = 16
  return c
