"""Qwen3-30B-A3B shapes (48 layers, 128 experts, top-8) for shapes and planning.

Run (planning / shapes only, no weights are allocated):
  python -m experiments.model_shapes --config=configs/qwen3_30b_a3b.py
"""
import ml_collections

from foremoe_jax import config as config_lib


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  m = c.model = config_lib.model_defaults()
  m.name = 'qwen3_30b_a3b'
  m.vocab_size = 151_936
  m.d_model = 2048
  m.num_layers = 48
  m.num_heads = 32
  m.num_kv_heads = 4
  m.head_dim = 128
  m.rope_theta = 1_000_000.0
  m.qk_norm = True
  m.tie_embeddings = False
  m.max_seq_len = 40_960
  m.num_experts = 128
  m.top_k = 8
  m.moe_d_ff = 768
  m.renormalize_topk = True
  m.dtype = 'bfloat16'
  m.param_dtype = 'bfloat16'
  m.msa_block_size = 128
  m.msa_top_k = 16
  m.msa_index_dim = 128
  c.parallel = config_lib.parallel_defaults()
  c.parallel.num_expert = 8
  c.parallel.slots_per_device = 18  # 16 homes + 2 redundant per device.
  # ZeRO over every device: the non-expert state (attention, embeddings)
  # would otherwise be replicated on each (docs/design.md §4.7).
  c.parallel.fsdp = True
  c.parallel.fsdp_axes = 'data+expert'
  return c
