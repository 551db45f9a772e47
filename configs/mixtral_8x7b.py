"""Mixtral-8x7B shapes (32 layers, 8 experts, top-2) for shapes and planning.

Run (planning / shapes only, no weights are allocated):
  python -m experiments.model_shapes --config=configs/mixtral_8x7b.py
"""
import ml_collections

from foremoe_jax import config as config_lib


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  m = c.model = config_lib.model_defaults()
  m.name = 'mixtral_8x7b'
  m.vocab_size = 32_000
  m.d_model = 4096
  m.num_layers = 32
  m.num_heads = 32
  m.num_kv_heads = 8
  m.head_dim = 128
  m.rope_theta = 1_000_000.0
  m.tie_embeddings = False
  m.max_seq_len = 32_768
  m.num_experts = 8
  m.top_k = 2
  m.moe_d_ff = 14_336
  m.renormalize_topk = True  # Softmax over the top-2 logits.
  m.dtype = 'bfloat16'
  m.param_dtype = 'bfloat16'
  m.msa_block_size = 128
  m.msa_top_k = 16
  m.msa_index_dim = 128
  c.parallel = config_lib.parallel_defaults()
  c.parallel.num_expert = 8
  c.parallel.slots_per_device = 2  # 1 home + 1 redundant per device.
  # ZeRO over every device: the non-expert state (attention, embeddings)
  # would otherwise be replicated on each (docs/design.md §4.7).
  c.parallel.fsdp = True
  c.parallel.fsdp_axes = 'data+expert'
  return c
