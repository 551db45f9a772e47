"""OLMoE-1B-7B shapes (16 layers, 64 experts, top-8, no top-k renormalisation).

Run (planning / shapes only, no weights are allocated):
  python -m experiments.model_shapes --config=configs/olmoe_1b_7b.py
"""
import ml_collections

from foremoe_jax import config as config_lib


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  m = c.model = config_lib.model_defaults()
  m.name = 'olmoe_1b_7b'
  m.vocab_size = 50_304
  m.d_model = 2048
  m.num_layers = 16
  m.num_heads = 16
  m.num_kv_heads = 16
  m.head_dim = 128
  m.rope_theta = 10_000.0
  m.qk_norm = True
  m.qk_norm_scope = 'full'  # One RMSNorm over all heads' q (and k).
  m.tie_embeddings = False
  m.max_seq_len = 4096
  m.num_experts = 64
  m.top_k = 8
  m.moe_d_ff = 1024
  m.renormalize_topk = False
  m.dtype = 'bfloat16'
  m.param_dtype = 'bfloat16'
  m.msa_block_size = 128
  m.msa_top_k = 16
  m.msa_index_dim = 128
  c.parallel = config_lib.parallel_defaults()
  c.parallel.num_expert = 8
  c.parallel.slots_per_device = 10  # 8 homes + 2 redundant per device.
  # ZeRO over every device: the non-expert state (attention, embeddings)
  # would otherwise be replicated on each (docs/design.md §4.7).
  c.parallel.fsdp = True
  c.parallel.fsdp_axes = 'data+expert'
  return c
