"""A DeepSeek-V3-like shape (61 layers, 3 dense, 256 routed experts, top-8,
one shared expert) for shapes, planning and the cluster simulator.

MLA is approximated by grouped-query attention with MLA's 128 query heads
of width 128 and 16 KV heads: the attention-score FLOPs match, the
projections hold ~264M parameters per layer against MLA's ~187M, so the
non-expert compute is overstated by a few percent of the step; the expert
part, which the planner acts on, is exact. Nothing allocates weights:
  python -m experiments.model_shapes --config=configs/deepseek_v3_like.py
"""
import ml_collections

from foremoe_jax import config as config_lib


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  m = c.model = config_lib.model_defaults()
  m.name = 'deepseek_v3_like'
  m.vocab_size = 129_280
  m.d_model = 7168
  m.num_layers = 61
  m.first_dense_layers = 3
  m.dense_d_ff = 18_432
  m.num_heads = 128
  m.num_kv_heads = 16
  m.head_dim = 128
  m.rope_theta = 10_000.0
  m.tie_embeddings = False
  m.max_seq_len = 32_768
  m.num_experts = 256
  m.top_k = 8
  m.moe_d_ff = 2048
  m.num_shared_experts = 1
  m.shared_d_ff = 2048
  m.renormalize_topk = True
  m.dtype = 'bfloat16'
  m.param_dtype = 'bfloat16'
  m.msa_block_size = 128
  m.msa_top_k = 16
  m.msa_index_dim = 128
  c.parallel = config_lib.parallel_defaults()
  c.parallel.num_expert = 64
  c.parallel.slots_per_device = 6  # 4 homes + 2 redundant per device.
  # ZeRO over every device: the non-expert state (attention, embeddings)
  # would otherwise be replicated on each (docs/design.md §4.7).
  c.parallel.fsdp = True
  c.parallel.fsdp_axes = 'data+expert'
  return c
