"""A DeepSeek-V3-like shape (61 layers, 3 dense, 256 routed experts, top-8,
one shared expert): GRPO on GSM8K laid out on 64 H100s, and its smoke test.
The full run does NOT fit yet: see below.

MLA is approximated by grouped-query attention with MLA's 128 query heads
of width 128 and 16 KV heads: the attention-score FLOPs match, the
projections hold ~264M parameters per layer against MLA's ~187M, so the
non-expert compute is overstated by a few percent of the step; the expert
part, which the planner acts on, is exact. No DeepSeek checkpoint imports
(foremoe_jax/hf has no MLA family): a run starts from random init and needs
a tokenizer, e.g. DeepSeek-V3's (--config.task_kwargs.tokenizer_path=DIR).

Run on 8 nodes x 8 H100 (one process per GPU; WORKSPACE.md, "Running the
real-size configs"):
  srun --nodes=8 --ntasks-per-node=8 --gpus-per-task=1 \
    env FOREMOE_DISTRIBUTED=auto python -m experiments.rl_train \
    --config=configs/deepseek_v3_like.py --workdir=/shared/run \
    --config.task_kwargs.tokenizer_path=/shared/DeepSeek-V3
Smoke test, one layer on 8 simulated CPU devices:
  python -m experiments.make_word_problems --out_dir=data/word_problems
  python -m experiments.rl_train --config=configs/deepseek_v3_like.py:smoke \
    --workdir=/tmp/smoke_dsv3
Shapes only (no weights allocated; also the cluster simulator's input):
  python -m experiments.model_shapes --config=configs/deepseek_v3_like.py

Cluster: 8 nodes x 8 H100 = 64 devices, mesh 1 data x 64 expert: EP 64
over 8 nodes, as DeepSeek-V3 itself was trained (4 homes + 2 redundant
slots per GPU; planner.num_nodes = 8). Memory: 526 GB a device by the
simulator's memory model (results/simulate_cluster.json; 339 GB at EP 256),
over an 80 GB H100: DeepSeek-V3 also needs pipeline parallelism, which this
repository does not have (WORKSPACE.md, "Known not to scale yet").

Smoke reductions (SMOKE_REDUCED below; configs/_real_rl.py lists the ones
every real config shares, layers and vocabulary among them). At d_model
7,168 one layer of the real model holds 264M attention parameters and 44M
per expert. During the update each of the 8 simulated devices gathers the
non-expert weights and keeps its own float32 gradient of them, all in this
host's memory, so attention costs ~8x its master here: with 16 query heads
(and 4 slots) the smoke run peaked at 9.4 GB, with 8 heads at 8.5 GB.
  `model.num_heads` 128 -> 8, `model.num_kv_heads` 16 -> 1: attention
      264M -> 16.5M parameters; 8 query heads per KV head as before.
  `model.num_experts` 256 -> 16: top-8 routing stays a choice.
  `model.moe_d_ff` 2,048 -> 128 and `model.shared_d_ff` 2,048 -> 128:
      16 experts + the shared one at 2.8M parameters each.
  `model.first_dense_layers` 3 -> 0: the one layer must be MoE; the
      dense-first segment is not exercised.
  `parallel.num_expert` 64 -> 8, `parallel.slots_per_device` 6 -> 3: the
      8 simulated devices with 2 homes + 1 redundant slot each. On CPU the
      ragged all-to-all is emulated with every (source, destination) pair
      padded to tokens x min(top_k, slots) rows of d_model: at 7,168 wide
      the fourth slot cost 0.8 GB (8.5 -> 7.7 GB peak).
  `planner.num_nodes` 8 -> 2: 2 nodes of 4, so the planner's two tiers
      still act.
  `transfer.step_rounds` 64 -> 8: one round per device of the ring.
d_model and head_dim stay real.
"""
import ml_collections

from configs import _real_rl
from foremoe_jax import config as config_lib

SMOKE_REDUCED = {
    'model.num_heads': 8,
    'model.num_kv_heads': 1,
    'model.num_experts': 16,
    'model.moe_d_ff': 128,
    'model.shared_d_ff': 128,
    'model.first_dense_layers': 0,
    'parallel.num_expert': 8,
    'parallel.slots_per_device': 3,
    'planner.num_nodes': 2,
    'transfer.step_rounds': 8,
}


def model_config() -> ml_collections.ConfigDict:
  """The DeepSeek-V3-like shape (MLA as GQA; see the module docstring)."""
  m = config_lib.model_defaults()
  m.name = 'deepseek_v3_like'
  m.hf_model_type = ''  # No Hugging Face family: nothing imports or exports.
  m.vocab_size = 129_280
  m.d_model = 7168
  m.num_layers = 61
  m.first_dense_layers = 3  # Dense SwiGLU FFNs before the MoE layers.
  m.dense_d_ff = 18_432
  m.num_heads = 128
  m.num_kv_heads = 16
  m.head_dim = 128
  m.rope_theta = 10_000.0
  m.tie_embeddings = False
  m.max_seq_len = 32_768  # Only a bound here.
  m.num_experts = 256
  m.top_k = 8
  m.moe_d_ff = 2048
  m.num_shared_experts = 1  # Every token also runs it (not routed).
  m.shared_d_ff = 2048
  # DeepSeek-V3 routes by sigmoid scores normalised over the top 8; ours
  # is a softmax, renormalised over the top-k alike.
  m.renormalize_topk = True
  # bfloat16 compute and slot copies; the train state is a float32 master
  # (WORKSPACE.md, "Mixed precision").
  m.dtype = 'bfloat16'
  m.param_dtype = 'bfloat16'
  m.remat_policy = 'full'  # Each block recomputed in the backward pass.
  # MSA's shape, for tools that try it (attention is dense here).
  m.msa_block_size = 128
  m.msa_top_k = 16
  m.msa_index_dim = 128
  return m


def get_config(variant: str = '') -> ml_collections.ConfigDict:
  c = _real_rl.full_config(
      model_config(), num_data=1, num_expert=64,
      slots_per_device=6,  # 4 homes + 2 redundant per device.
      num_nodes=8,
      # 128 x 8 = 1,024 sequences in 8 micro-steps: 2 per device per
      # micro-step, the simulator's workload.
      prompts_per_step=128, num_microbatches=8)
  return _real_rl.variant(c, variant, SMOKE_REDUCED)
