"""Config schema helpers and the one place where every config is validated.

Configs are ml_collections ConfigDicts built by `configs/*.py:get_config()`.
`validate_config` checks every cross-field rule and raises one ConfigError
naming the field and the rule, so a bad experiment fails before any compile.
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple

import ml_collections


# Names of model.remat_policy (the policies live in model/transformer.py).
REMAT_POLICIES = ('none', 'full', 'minimal', 'dots')
# Hugging Face model types foremoe_jax/hf imports and exports.
HF_MODEL_TYPES = ('qwen3_moe', 'mixtral', 'olmoe')
# Names of model.msa_gpu_kernels (pallas_kernels/msa/api.py GPU_KERNELS).
MSA_GPU_KERNELS = ('kv_outer', 'token', 'tiles')
# parallel.dispatch values (the strategies live in foremoe_jax/model/).
DISPATCHES = ('exact', 'padded')


class ConfigError(ValueError):
  """A config breaks a rule; the message names the field and the rule."""


def model_defaults() -> ml_collections.ConfigDict:
  """Every model field with its default; real configs override shapes."""
  m = ml_collections.ConfigDict()
  m.name = 'tiny'
  m.vocab_size = 32
  m.d_model = 64
  m.num_layers = 2
  m.num_heads = 4
  m.num_kv_heads = 2
  m.head_dim = 16
  m.rope_theta = 10_000.0
  m.norm_eps = 1e-6
  m.tie_embeddings = True
  m.qk_norm = False
  # RMSNorm of q and k per head over head_dim ('head': Qwen3) or over the
  # whole projection before the split into heads ('full': OLMoE).
  m.qk_norm_scope = 'head'
  # The q/k norms' scales at initialisation (a checkpoint's replace them).
  # After the norm a logit is at most sqrt(head_dim) * gq * gk, so with 1
  # a small model trained briefly keeps spread attention; a pretrained
  # model's attention is peaked (docs/design.md §6.11).
  m.qk_norm_init = 1.0
  m.max_seq_len = 64
  # Mixture of experts.
  m.num_experts = 8
  m.top_k = 2
  m.moe_d_ff = 64
  m.renormalize_topk = True  # Qwen3 / Mixtral: True; OLMoE: False.
  m.num_shared_experts = 0
  m.shared_d_ff = 0
  m.first_dense_layers = 0  # DeepSeek-style dense FFN in the first layers.
  m.dense_d_ff = 128
  # Switch-style balance loss, off by default. The routed shares f_e sum to
  # 1 over experts (router.balance_loss_from_sums); HF's
  # load_balancing_loss_func sums top_k of them, so its loss is top_k times
  # ours: a router_aux_loss_coef acts alike here multiplied by top_k.
  m.aux_loss_coef = 0.0
  # Attention: 'dense' everywhere, or MSA from first_sparse_layer on.
  m.attention_type = 'dense'
  m.first_sparse_layer = 0
  m.msa_block_size = 16
  m.msa_top_k = 4
  m.msa_index_dim = 16
  m.msa_indexer_warmup = False  # Train the indexer while attention stays dense.
  m.msa_indexer_loss_coef = 1.0
  # The indexer's KL: 'selected' (over the blocks the main branch attended;
  # the sparse model's loss) or 'dense' (over every causal key, attention
  # kept dense, recall reported: the distillation phase, config.msa_distill,
  # sets it on its own copy of the model; docs/design.md §6.11).
  m.msa_indexer_kl = 'selected'
  # The MSA Pallas kernels on a GPU: 'kv_outer' (a two-launch tensor-core
  # selection, query tiles per key block, dK/dV without atomics, split-K
  # decode), 'token' (the first kernels: fused selection, a program per
  # token, atomic dK/dV), the fallback, or 'tiles' (kv_outer's, but the
  # forward and dQ take a few neighbouring tokens per program against the
  # union of their blocks: no partials, at the price of the union's
  # unselected blocks). CPU and TPU ignore it.
  m.msa_gpu_kernels = 'kv_outer'
  # Mixed precision (WORKSPACE.md): dtype is the compute dtype (every weight
  # is cast to it where used); param_dtype is the dtype the model is built,
  # checkpointed for serving and moved between slots in. Training always
  # keeps a float32 master copy and float32 optimizer moments.
  m.dtype = 'float32'
  m.param_dtype = 'float32'
  # Activation memory of the update (transformer.REMAT_POLICIES): 'none'
  # keeps every activation; 'full' keeps each block's input only and
  # recomputes the block in the backward pass; 'minimal' also keeps the
  # matmul outputs (MaxText's 'minimal'); 'dots' keeps every dot's output,
  # batched ones included. Gradients are the same under every policy.
  m.remat_policy = 'none'
  # Hugging Face family the model was imported from ('qwen3_moe', 'mixtral',
  # 'olmoe'; foremoe_jax/hf), so export writes the same family; '': none.
  m.hf_model_type = ''
  return m


def parallel_defaults() -> ml_collections.ConfigDict:
  p = ml_collections.ConfigDict()
  p.num_data = 1  # 'data' mesh axis.
  p.num_expert = 1  # 'expert' mesh axis (EP size, D).
  # Shard the non-expert parameters (and so their optimizer moments) over
  # `fsdp_axes` (ZeRO-3 style; XLA gathers each where it is used): 'data'
  # (no effect with num_data = 1) or 'data+expert', every device, which is
  # what fits a large model's non-expert state at EP = 64 (docs/design.md
  # §4.7). Experts stay sharded over 'expert' only.
  p.fsdp = False
  p.fsdp_axes = 'data'
  p.slots_per_device = 0  # 0: E / D, no redundant slots.
  # Expert dispatch (docs/design.md §4.3): 'exact' sends each device
  # exactly the rows routed to it and computes only those (a ragged
  # all-to-all; emulated on CPU); 'padded' pads every (source, destination)
  # cell to one capacity and computes every padded row (for comparison).
  p.dispatch = 'exact'
  # Capacity buckets (static buffer sizes; one compile each): 'exact'
  # bounds the rows a device receives, 'padded' a (source, destination)
  # cell. The ladder climbs from the uniform expectation to the dropless
  # bound (`dropless_capacity`) in steps of at most capacity_growth x (or
  # 8 rows), each a multiple of 8. capacity_factors, when non-empty,
  # replaces the ladder by these multiples of the uniform expectation (the
  # dropless bound is always added).
  p.capacity_growth = 1.25
  p.capacity_factors = ()
  # On CPU the exact dispatch's all-to-all is emulated with one chunk per
  # (source, destination) pair, bucketed on its own ladder (`cell_buckets`):
  # its step is cell_growth x. A new pair bucket compiles a new step but
  # only sets the emulation's padded traffic, so short runs whose compiles
  # cost more than their steps take a coarse ladder (e.g. 100: the uniform
  # pair and the pair bound). cell_factors, when non-empty, replaces that
  # ladder by these multiples of the uniform pair (the pair bound always
  # added): (100,) keeps the bound alone, one step program for a whole run.
  p.cell_growth = 2.0
  p.cell_factors = ()
  return p


def slots_per_device(config) -> int:
  p, m = config.parallel, config.model
  return p.slots_per_device or max(1, m.num_experts // p.num_expert)


def num_moe_layers(model_config) -> int:
  return model_config.num_layers - model_config.first_dense_layers


def layer_attention_types(model_config) -> tuple[str, ...]:
  """'dense' or 'msa' per layer, from attention_type and first_sparse_layer."""
  if model_config.attention_type == 'dense':
    return ('dense',) * model_config.num_layers
  return tuple('msa' if i >= model_config.first_sparse_layer else 'dense'
               for i in range(model_config.num_layers))


class Segment(NamedTuple):
  """A run of consecutive layers of one kind, stored stacked and scanned."""
  start: int  # First layer (of all layers).
  stop: int  # One past the last.
  attention: str  # 'dense' | 'msa'
  moe: bool  # MoE FFN (else the dense SwiGLU of the first layers).
  moe_start: int  # Index of its first layer among the MoE layers.

  @property
  def num_layers(self) -> int:
    return self.stop - self.start


def layer_segments(model_config) -> tuple[Segment, ...]:
  """The layers cut into maximal runs of the same attention and FFN kind.

  The model stores each run's parameters stacked along a leading layer
  axis and runs it as one `lax.scan`, so compile time does not grow with
  depth: Qwen3-30B-A3B is one segment of 48 layers, a DeepSeek-style model
  two (dense FFNs first), MSA from a layer on adds one more.
  """
  types = layer_attention_types(model_config)
  first_moe = model_config.first_dense_layers
  out, start = [], 0
  for i in range(1, model_config.num_layers + 1):
    if (i == model_config.num_layers or types[i] != types[start]
        or (i >= first_moe) != (start >= first_moe)):
      moe = start >= first_moe
      out.append(Segment(start, i, types[start], moe,
                         start - first_moe if moe else -1))
      start = i
  return tuple(out)


def _require(cond: bool, field: str, rule: str) -> None:
  if not cond:
    raise ConfigError(f'{field}: {rule}')


def validate_config(config) -> None:
  """Checks every rule of a full experiment config; raises ConfigError."""
  m = config.model
  pos_int = ('vocab_size', 'd_model', 'num_layers', 'num_heads',
             'num_kv_heads', 'head_dim', 'num_experts', 'top_k', 'moe_d_ff',
             'max_seq_len')
  for f in pos_int:
    _require(int(m[f]) > 0, f'model.{f}', f'must be a positive integer, got {m[f]}')
  _require(m.num_heads % m.num_kv_heads == 0, 'model.num_heads',
           f'num_heads ({m.num_heads}) must be divisible by num_kv_heads '
           f'({m.num_kv_heads}) for GQA')
  _require(m.head_dim % 2 == 0, 'model.head_dim',
           f'head_dim ({m.head_dim}) must be even for RoPE')
  _require(m.top_k <= m.num_experts, 'model.top_k',
           f'top_k ({m.top_k}) must be <= num_experts ({m.num_experts})')
  _require(0 <= m.first_dense_layers < m.num_layers, 'model.first_dense_layers',
           f'must be in [0, num_layers={m.num_layers}) so at least one layer '
           f'is MoE, got {m.first_dense_layers}')
  _require(m.first_dense_layers == 0 or m.dense_d_ff > 0, 'model.dense_d_ff',
           'must be > 0 when first_dense_layers > 0')
  _require(m.num_shared_experts >= 0, 'model.num_shared_experts', 'must be >= 0')
  _require(m.num_shared_experts == 0 or m.shared_d_ff > 0, 'model.shared_d_ff',
           'must be > 0 when num_shared_experts > 0')
  _require(m.aux_loss_coef >= 0, 'model.aux_loss_coef', 'must be >= 0')
  _require(m.attention_type in ('dense', 'msa'), 'model.attention_type',
           f"must be 'dense' or 'msa', got {m.attention_type!r}")
  _require(m.dtype in ('float32', 'bfloat16'), 'model.dtype',
           f"must be 'float32' or 'bfloat16', got {m.dtype!r}")
  _require(m.param_dtype in ('float32', 'bfloat16'), 'model.param_dtype',
           f"must be 'float32' or 'bfloat16', got {m.param_dtype!r}")
  _require(m.get('qk_norm_init', 1.0) > 0, 'model.qk_norm_init',
           f"must be > 0, got {m.get('qk_norm_init')!r}")
  _require(m.get('qk_norm_scope', 'head') in ('head', 'full'),
           'model.qk_norm_scope', f"must be 'head' or 'full', got "
           f"{m.get('qk_norm_scope')!r}")
  _require(m.get('hf_model_type', '') in ('',) + HF_MODEL_TYPES,
           'model.hf_model_type', f'must be empty or one of '
           f"{', '.join(HF_MODEL_TYPES)}, got {m.get('hf_model_type')!r}")
  _require(m.get('remat_policy', 'none') in REMAT_POLICIES,
           'model.remat_policy', f'must be one of {", ".join(REMAT_POLICIES)}, '
           f"got {m.get('remat_policy')!r}")
  _require(m.get('msa_gpu_kernels', 'kv_outer') in MSA_GPU_KERNELS,
           'model.msa_gpu_kernels', "must be 'kv_outer', 'token' or 'tiles', "
           f"got {m.get('msa_gpu_kernels')!r}")
  _require(m.get('msa_indexer_kl', 'selected') in ('selected', 'dense'),
           'model.msa_indexer_kl', f"must be 'selected' or 'dense', got "
           f"{m.get('msa_indexer_kl')!r}")
  if m.attention_type == 'msa':
    _require(0 <= m.first_sparse_layer < m.num_layers, 'model.first_sparse_layer',
             f'must be in [0, num_layers={m.num_layers})')
    _require(m.msa_block_size > 0, 'model.msa_block_size', 'must be > 0')
    _require(m.msa_top_k >= 1, 'model.msa_top_k', 'must be >= 1 (the local block)')
    _require(m.msa_index_dim > 0 and m.msa_index_dim % 2 == 0,
             'model.msa_index_dim', 'must be a positive even number (RoPE)')
    _require(m.max_seq_len % m.msa_block_size == 0, 'model.max_seq_len',
             f'must be a multiple of msa_block_size ({m.msa_block_size})')
    # More selected blocks than exist would silently attend to every block.
    num_blocks = m.max_seq_len // m.msa_block_size
    _require(m.msa_top_k <= num_blocks, 'model.msa_top_k',
             f'must be <= the number of key blocks, max_seq_len / '
             f'msa_block_size = {m.max_seq_len} / {m.msa_block_size} = '
             f'{num_blocks}, got {m.msa_top_k}')
  if 'parallel' in config:
    p = config.parallel
    _require(p.num_data >= 1, 'parallel.num_data', 'must be >= 1')
    _require(p.num_expert >= 1, 'parallel.num_expert', 'must be >= 1')
    _require(isinstance(p.get('fsdp', False), bool), 'parallel.fsdp',
             'must be a bool')
    _require(p.get('fsdp_axes', 'data') in ('data', 'data+expert'),
             'parallel.fsdp_axes', "must be 'data' or 'data+expert'")
    _require(m.num_experts % p.num_expert == 0, 'parallel.num_expert',
             f'num_experts ({m.num_experts}) must be divisible by the EP size '
             f'num_expert ({p.num_expert}): canonical experts are sharded '
             f'evenly over the expert axis')
    spd = slots_per_device(config)
    _require(spd * p.num_expert >= m.num_experts, 'parallel.slots_per_device',
             f'num_expert * slots_per_device = {spd * p.num_expert} must be >= '
             f'num_experts ({m.num_experts}): every expert needs a slot')
    _require(p.get('dispatch', 'exact') in DISPATCHES, 'parallel.dispatch',
             f"must be one of {', '.join(DISPATCHES)}, got "
             f"{p.get('dispatch')!r}")
    for f in ('capacity_factors', 'cell_factors'):
      _require(all(x > 0 for x in p.get(f, ())), f'parallel.{f}',
               'must be positive multiples of the uniform expectation '
               '(empty: the geometric ladder)')
    for f, default in (('capacity_growth', 1.25), ('cell_growth', 2.0)):
      _require(p.get(f, default) > 1.0, f'parallel.{f}',
               f"must be > 1 (the ladder's step), got {p.get(f)!r}")
  if 'transfer' in config:
    t = config.transfer
    for f in ('step_rounds', 'microstep_rounds'):
      _require(int(t[f]) >= 1, f'transfer.{f}',
               f'must be >= 1 (rounds of one expert per device), got {t[f]}')
    _require(t.get('mode', 'exact') in ('exact', 'rounds'), 'transfer.mode',
             f"must be 'exact' or 'rounds', got {t.get('mode')!r}")
    _require(t.get('flush', 'auto') in ('auto', 'tree', 'direct'),
             'transfer.flush', "must be 'auto', 'tree' (least memory) or "
             f"'direct' (fewest collectives), got {t.get('flush')!r}")
  if 'seed' in config:
    _require_int(config.seed, 'seed', 0)
  if 'planner' in config:
    _validate_planner(config.planner)
    if 'parallel' in config:
      nodes, ring = config.planner.get('num_nodes', 1), config.parallel.num_expert
      _require(ring % nodes == 0, 'planner.num_nodes',
               f'must divide parallel.num_expert ({ring}): the EP ring is '
               f'split into nodes of equal size, got {nodes}')
  if 'rl' in config:
    _validate_rl(config.rl)
    if config.rl.get('balance_step_tokens', False):
      _require(not config.rl.get('balance_microbatches', False),
               'rl.balance_step_tokens',
               'and rl.balance_microbatches both choose which micro-step '
               'holds a sample: turn one off')
      _require(config.get('model') is None
               or config.model.get('aux_loss_coef', 0.0) == 0.0,
               'rl.balance_step_tokens',
               'with model.aux_loss_coef > 0 would change the gradient (the '
               'Switch balance loss is per micro-batch): turn one off')
    if 'parallel' in config:
      r, p = config.rl, config.parallel
      per_mb = r.prompts_per_step * r.num_generations // r.num_microbatches
      devices = p.num_data * p.num_expert
      _require(per_mb % devices == 0, 'rl.num_microbatches',
               f'each device holds whole sequences of every micro-batch: '
               f'prompts_per_step * num_generations / num_microbatches '
               f'({per_mb}) must be divisible by num_data * num_expert '
               f'({devices})')
  if 'warmstart' in config:
    w = config.warmstart
    _require_int(w.steps, 'warmstart.steps', 0)
    _require_int(w.batch_size, 'warmstart.batch_size', 1)
    if 'parallel' in config:
      _require_rows_split(w.batch_size, 'warmstart.batch_size', config)
    _require(w.learning_rate > 0, 'warmstart.learning_rate',
             f'must be > 0, got {w.learning_rate!r}')
  if 'msa_distill' in config:
    _validate_msa_distill(config)
  if 'sampler' in config:
    s = config.sampler
    _require(s.temperature > 0, 'sampler.temperature',
             f'must be > 0 (greedy decoding is SamplingParams.greedy), got '
             f'{s.temperature!r}')
    _require_int(s.top_k, 'sampler.top_k', 0, ' (0: off)')
    _require(0 < s.top_p <= 1, 'sampler.top_p',
             f'must be in (0, 1] (1: off), got {s.top_p!r}')
  for f, low in (('checkpoint_every', 1), ('eval_prompts', 0),
                 ('sample_log_every', 0)):
    if f in config:
      _require_int(config[f], f, low)
  if 'task' in config:
    _validate_task(config)
  profile_steps(config)
  hf_dir = config.get('init_from_hf', '')
  if hf_dir:
    _require(os.path.isfile(os.path.join(str(hf_dir), 'config.json')),
             'init_from_hf', f'must be a Hugging Face checkpoint directory '
             f'with a config.json, got {hf_dir!r}')


def profile_steps(config) -> tuple[int, ...]:
  """`profile_steps` ('3,5', a tuple, or absent) as RL step numbers."""
  raw = config.get('profile_steps', ())
  if isinstance(raw, str):
    parts = [p.strip() for p in raw.split(',') if p.strip()]
  elif isinstance(raw, int):
    parts = [raw]
  else:
    parts = list(raw)
  try:
    steps = tuple(int(p) for p in parts)
  except (TypeError, ValueError):
    steps = ()
    parts = None
  _require(parts is not None and all(s >= 1 for s in steps), 'profile_steps',
           f"must be RL step numbers >= 1 like '3,5', got {raw!r}")
  return steps


def _require_int(x, field: str, low: int, note: str = '') -> None:
  """`field` must be an int (not a bool) >= low; `note` explains it."""
  ok = isinstance(x, int) and not isinstance(x, bool) and x >= low
  _require(ok, field, f'must be an integer >= {low}{note}, got {x!r}')


def _validate_planner(p) -> None:
  # Imported here: the planner package imports this module.
  from foremoe_jax.planner.guard import METHODS  # pylint: disable=g-import-not-at-top
  _require(p.method in METHODS, 'planner.method',
           f'must be one of {", ".join(METHODS)}, got {p.method!r}')
  if 'deadline_ms' in p:
    _require(p.deadline_ms >= 0, 'planner.deadline_ms',
             f'must be >= 0, got {p.deadline_ms!r}')
  if 'deadline_recompute_frac' in p:
    _require(p.deadline_recompute_frac > 0, 'planner.deadline_recompute_frac',
             'must be > 0')
  if 'num_nodes' in p:
    _require_int(p.num_nodes, 'planner.num_nodes', 1)
  for f in ('flops_per_s', 'intra_node_bw', 'inter_node_bw'):
    if f in p:
      _require(p[f] > 0, f'planner.{f}', f'must be > 0, got {p[f]!r}')
  if 'overlap' in p:
    _require(0 <= p.overlap <= 1, 'planner.overlap',
             f'must be in [0, 1] (the share of a copy hidden under compute), '
             f'got {p.overlap!r}')
  if 'workers' in p:
    _require_int(p.workers, 'planner.workers', 0, ' (0: auto)')


def _validate_rl(r) -> None:
  _require_int(r.steps, 'rl.steps', 0)
  _require_int(r.prompts_per_step, 'rl.prompts_per_step', 1)
  _require(r.learning_rate > 0, 'rl.learning_rate',
           f'must be > 0, got {r.learning_rate!r}')
  _require(r.beta >= 0, 'rl.beta', f'must be >= 0 (0: no KL term), got '
           f'{r.beta!r}')
  _require(r.grad_clip > 0, 'rl.grad_clip',
           f'must be > 0 (global-norm clip), got {r.grad_clip!r}')
  _require(r.weight_decay >= 0, 'rl.weight_decay',
           f'must be >= 0, got {r.weight_decay!r}')
  _require(r.num_generations >= 2, 'rl.num_generations',
           'GRPO needs >= 2 samples per prompt for a group baseline')
  _require(r.num_microbatches >= 1, 'rl.num_microbatches', 'must be >= 1')
  batch = r.prompts_per_step * r.num_generations
  _require(batch % r.num_microbatches == 0, 'rl.num_microbatches',
           f'prompts_per_step * num_generations ({batch}) must be divisible '
           f'by num_microbatches ({r.num_microbatches})')
  _require(0 <= r.eps_low < 1 and r.eps_high >= 0, 'rl.eps_low',
           'clip range needs 0 <= eps_low < 1 and eps_high >= 0')
  _require_int(r.get('num_update_epochs', 1), 'rl.num_update_epochs', 1,
               ' (optimizer updates per rollout)')
  _require(r.get('old_logp_max_gap', 1e-3) > 0, 'rl.old_logp_max_gap',
           f"must be > 0, got {r.get('old_logp_max_gap')!r}")
  _require(r.get('old_logp_source', 'auto') in OLD_LOGP_SOURCES,
           'rl.old_logp_source', f"must be one of {', '.join(OLD_LOGP_SOURCES)}"
           f", got {r.get('old_logp_source')!r}")
  _validate_rl_objective(r)


OLD_LOGP_SOURCES = ('auto', 'recompute', 'rollout')

# The objective's options (rl/grpo.py; WORKSPACE.md "RL objectives" maps them
# to verl's and TRL's names). Values are verl's names.
LOSS_AGG_MODES = ('token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum',
                  'seq-mean-token-sum-norm')
# k1 = 'kl', k2 = 'mse', k3 = 'low_var_kl' (verl's names for the same).
KL_ESTIMATORS = ('k1', 'kl', 'abs', 'k2', 'mse', 'k3', 'low_var_kl')
POLICY_LOSSES = ('ppo', 'gspo')


def rl_objective_defaults() -> dict:
  """Every rl objective field with its default; a config without the field
  (an old config or checkpoint) gets this value. rl/grpo.py says why each
  default is what it is."""
  # 0.0 rather than None for "off" / "the completion length": a None field
  # cannot be overridden from the command line (ml_collections).
  return dict(loss_agg_mode='seq-mean-token-mean', loss_scale_factor=0.0,
              clip_ratio_c=0.0, kl_estimator='k3', adv_std_ddof=0,
              norm_adv_by_std=True, policy_loss='ppo', gspo_eps_low=3e-4,
              gspo_eps_high=4e-4)


def rl_objective(r) -> dict:
  """The objective fields of config.rl, defaults filled in."""
  return {k: r.get(k, v) for k, v in rl_objective_defaults().items()}


def _validate_rl_objective(r) -> None:
  o = rl_objective(r)
  _require(o['loss_agg_mode'] in LOSS_AGG_MODES, 'rl.loss_agg_mode',
           f"must be one of {', '.join(LOSS_AGG_MODES)}, got "
           f"{o['loss_agg_mode']!r}")
  lsf = o['loss_scale_factor']
  _require(lsf is None or (_is_number(lsf) and lsf >= 0),
           'rl.loss_scale_factor', f'must be 0 (the completion length) or a '
           f'number > 0, got {lsf!r}')
  c = o['clip_ratio_c']
  _require(c is None or (_is_number(c) and (c == 0 or c > 1)),
           'rl.clip_ratio_c', f'must be 0 (off) or a number > 1 '
           f'(dual-clip bound; verl uses 3.0), got {c!r}')
  _require(o['kl_estimator'] in KL_ESTIMATORS, 'rl.kl_estimator',
           f"must be one of {', '.join(KL_ESTIMATORS)}, got "
           f"{o['kl_estimator']!r}")
  _require(o['adv_std_ddof'] in (0, 1) and not isinstance(
      o['adv_std_ddof'], bool), 'rl.adv_std_ddof',
           f"must be 0 (population std) or 1 (unbiased, verl/TRL), got "
           f"{o['adv_std_ddof']!r}")
  _require(isinstance(o['norm_adv_by_std'], bool), 'rl.norm_adv_by_std',
           f"must be a bool (False: Dr.GRPO, advantages r - group mean), got "
           f"{o['norm_adv_by_std']!r}")
  _require(o['policy_loss'] in POLICY_LOSSES, 'rl.policy_loss',
           f"must be one of {', '.join(POLICY_LOSSES)}, got "
           f"{o['policy_loss']!r}")
  lo, hi = o['gspo_eps_low'], o['gspo_eps_high']
  _require(_is_number(lo) and _is_number(hi) and 0 <= lo < 1 and hi >= 0,
           'rl.gspo_eps_low', f'GSPO clip range needs 0 <= gspo_eps_low < 1 '
           f'and gspo_eps_high >= 0, got {lo!r}, {hi!r}')
  _require(o['policy_loss'] != 'gspo'
           or o['loss_agg_mode'] == 'seq-mean-token-mean', 'rl.loss_agg_mode',
           f"must be 'seq-mean-token-mean' with policy_loss='gspo' (GSPO's "
           f"objective is a mean over sequences), got {o['loss_agg_mode']!r}")


def _is_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)



def old_logp_source(config) -> str:
  """Where the old log-probs of a multi-epoch update come from.

  'rollout': the sampler's, which are this same model's with the same
  routes replayed (measured gap to a recompute: rounding, < 2e-5 in
  float32); 'recompute': a forward of the old policy. 'auto' takes the
  rollout's in float32 and recomputes in bfloat16, where the sampler's
  one-token decode rounds differently from the update's batched forward.
  """
  src = config.rl.get('old_logp_source', 'auto')
  if src == 'auto':
    return 'rollout' if config.model.dtype == 'float32' else 'recompute'
  return src


def msa_distill_defaults() -> ml_collections.ConfigDict:
  """The indexer distillation phase (docs/design.md §6.11): after the warm
  start (or an HF import) and before RL, only the MSA index branches train,
  toward the dense attention of the model's own main branch, which runs
  dense meanwhile (the model's outputs are exactly the dense model's). 0
  steps: no phase."""
  d = ml_collections.ConfigDict()
  d.steps = 0
  d.learning_rate = 1e-3
  d.batch_size = 32  # Sequences per step.
  # '' trains on the task's warm-start sequences (prompt + reference
  # answer); a path reads plain text, tokenised by the task's tokenizer
  # and cut into max_seq_len windows.
  d.text_file = ''
  # Tokens per text_file window (0: model.max_seq_len, which an HF import
  # sets to the checkpoint's context, e.g. 40,960 for Qwen3: windows that
  # long at batch_size would not fit where the phase runs).
  d.seq_len = 0
  # Recall and KL are measured on this many held-out sequences before the
  # first step and after the last (summary.json: msa_recall_before/after).
  d.eval_sequences = 64
  d.log_every = 25
  return d


def _require_rows_split(rows: int, name: str, config) -> None:
  """A batch of `rows` sequences is split over every device by rows."""
  devices = config.parallel.num_data * config.parallel.num_expert
  _require(rows % devices == 0, name,
           f'must be a multiple of num_data * num_expert ({devices}): each '
           f'device takes whole sequences, got {rows}')


def _validate_msa_distill(config) -> None:
  d, m = config.msa_distill, config.model
  _require_int(d.steps, 'msa_distill.steps', 0)
  if d.steps == 0:
    return
  _require(m.attention_type == 'msa', 'msa_distill.steps',
           "distils MSA index branches: needs model.attention_type='msa'")
  _require(d.learning_rate > 0, 'msa_distill.learning_rate',
           f'must be > 0, got {d.learning_rate!r}')
  _require_int(d.batch_size, 'msa_distill.batch_size', 1)
  _require_int(d.eval_sequences, 'msa_distill.eval_sequences', 0)
  if 'parallel' in config:
    _require_rows_split(d.batch_size, 'msa_distill.batch_size', config)
    _require_rows_split(d.eval_sequences, 'msa_distill.eval_sequences',
                        config)
  _require_int(d.log_every, 'msa_distill.log_every', 1)
  path = d.get('text_file', '')
  _require(not path or os.path.isfile(str(path)), 'msa_distill.text_file',
           f'no such file: {path!r}')
  seq_len = d.get('seq_len', 0)
  _require_int(seq_len, 'msa_distill.seq_len', 0)
  _require(seq_len <= m.max_seq_len, 'msa_distill.seq_len',
           f'must be at most model.max_seq_len ({m.max_seq_len}), got '
           f'{seq_len}')


def _validate_task(config) -> None:
  """The task exists, takes task_kwargs, and fits the model's vocabulary and
  context (building a task is cheap: a tokenizer and a few numbers)."""
  # Imported here: tasks are an optional layer above the config schema.
  from foremoe_jax import tasks  # pylint: disable=g-import-not-at-top
  _require(config.task in tasks.task_names(), 'task',
           f'must be one of {", ".join(tasks.task_names())}, got '
           f'{config.task!r}')
  if (config.task == 'dataset'
      and not config.get('task_kwargs', {}).get('tokenizer_path')
      and not config.get('init_from_hf')):
    # The tokenizer is to be the checkpoint's (tasks.task_from_config) and
    # none is named yet: a real-size config as shipped (configs/_real_rl.py),
    # which shape and planning tools read as is. The task is checked
    # against the model once init_from_hf or tokenizer_path names one.
    return
  try:
    task = tasks.task_from_config(config)
  except (TypeError, ValueError) as e:
    raise ConfigError(f'task_kwargs: {e}') from None
  m = config.model
  _require(m.vocab_size >= task.vocab_size, 'model.vocab_size',
           f'must be >= the vocabulary of task {config.task!r} '
           f'({task.vocab_size}), got {m.vocab_size}')
  _require(m.max_seq_len >= task.sequence_len, 'model.max_seq_len',
           f'must be >= prompt + completion ({task.sequence_len}) for task '
           f'{config.task!r}, got {m.max_seq_len}')
  # MSA layers mask padding keys like dense ones (docs/design.md §6.9), so
  # tasks with left-padded prompts take either attention type.


def dropless_capacity(dispatch: str, tokens_per_device: int, top_k: int,
                      num_devices: int, slots_per_device: int) -> int:
  """The one capacity that never drops, per data group.

  A token sends one row per chosen expert, and all of its rows for one
  device go to distinct slots there, so a token sends a device at most
  min(top_k, s) rows. 'padded' bounds one (source, destination) cell:
  tokens * min(top_k, s); 'exact' bounds the rows a device receives from
  all D sources: D * tokens * min(top_k, s).
  """
  per_cell = tokens_per_device * min(top_k, slots_per_device)
  if dispatch == 'padded':
    return per_cell
  if dispatch == 'exact':
    return num_devices * per_cell
  raise ConfigError(f"parallel.dispatch: must be one of {', '.join(DISPATCHES)}"
                    f', got {dispatch!r}')


def capacity_buckets(tokens_per_device: int, top_k: int, num_devices: int,
                     slots_per_device: int, *, dispatch: str = 'exact',
                     growth: float = 1.25, factors=()) -> tuple[int, ...]:
  """Static capacities, ascending, the last one dropless.

  The uniform expectation is what a perfectly balanced step needs: a
  device receives tokens_per_device * top_k rows ('exact'), a cell a D-th
  of that ('padded'). From there the ladder climbs geometrically, each
  bucket at most `growth` x the last (or 8 rows more, at small sizes), in
  multiples of 8, up to `dropless_capacity`: the padding a bucket adds
  over the rows it holds is under growth - 1 whatever the skew, and a
  balanced plan needs the first rungs only. `factors` (multiples of the
  uniform expectation) replaces the ladder when given.
  """
  dropless = dropless_capacity(dispatch, tokens_per_device, top_k,
                               num_devices, slots_per_device)
  uniform = tokens_per_device * top_k / (
      num_devices if dispatch == 'padded' else 1)
  round8 = lambda x: 8 * math.ceil(x / 8)
  if factors:
    caps = {min(dropless, round8(f * uniform)) for f in factors}
  else:
    caps, c = set(), max(8, round8(uniform))
    while c < dropless:
      caps.add(c)
      c = max(c + 8, 8 * math.floor(c * growth / 8))
  caps.add(dropless)
  return tuple(sorted(c for c in caps if c > 0))


def buckets_from_config(config, tokens_per_device: int) -> tuple[int, ...]:
  """`capacity_buckets` with the config's dispatch, ladder and shapes."""
  p, m = config.parallel, config.model
  return capacity_buckets(
      tokens_per_device, m.top_k, p.num_expert, slots_per_device(config),
      dispatch=p.get('dispatch', 'exact'),
      growth=p.get('capacity_growth', 1.25),
      factors=tuple(p.get('capacity_factors', ())))


def cell_buckets(tokens_per_device: int, top_k: int, num_devices: int,
                 slots_per_device: int, growth: float = 2.0, factors=()
                 ) -> tuple[int, ...]:
  """Buckets of the largest (source, destination) pair, for the exact
  dispatch's CPU emulation, which pads every pair to one (`StepPlan.cell`):
  the padded dispatch's cells, in steps of `growth` (`parallel.cell_growth`;
  a new bucket compiles a new step, the pair bound only sets the
  emulation's traffic), or `factors` x the uniform pair and the bound
  (`parallel.cell_factors`)."""
  return capacity_buckets(tokens_per_device, top_k, num_devices,
                          slots_per_device, dispatch='padded', growth=growth,
                          factors=factors)


def pick_bucket(max_rows: int, buckets) -> int:
  """Smallest bucket that drops nothing for the given row demand (a
  device's received rows, or the largest cell)."""
  for c in buckets:
    if c >= max_rows:
      return int(c)
  return int(buckets[-1])
