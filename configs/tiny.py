"""Tiny MoE for CPU: the main job (warm start, then GRPO) in minutes.

Run:
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
  python -m experiments.rl_train --config=configs/tiny.py --workdir=/tmp/foremoe_demo
"""
import ml_collections

from foremoe_jax import config as config_lib


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = 'addition'
  c.task_kwargs = ml_collections.ConfigDict({'partial_credit': 0.0})
  c.eval_prompts = 256  # Greedy accuracy before and after RL (0: skip).
  # RL steps between checkpoints (a signal or the last step saves too). Each
  # orbax save costs ~0.3 s here and keeps ~70 kB of host memory
  # (tensorstore's JSON conversion leaks; rl/checkpoint.py avoids the
  # largest part; experiments.soak), so a long run should not save every
  # few seconds.
  c.checkpoint_every = 50
  # Every this many RL steps, a few decoded samples (prompt, completion,
  # reference, reward) go to samples.jsonl and one to the log (0: never).
  c.sample_log_every = 10
  # RL steps to trace with jax.profiler into <workdir>/profile, e.g. '3,5'.
  c.profile_steps = ''
  # A Hugging Face checkpoint directory (Qwen3-MoE, Mixtral, OLMoE) to start
  # from: its architecture replaces c.model's shapes, its weights the random
  # init (foremoe_jax/hf). '': random init.
  c.init_from_hf = ''

  c.model = config_lib.model_defaults()
  c.model.name = 'tiny'
  c.model.vocab_size = 32
  c.model.d_model = 64
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 16
  c.model.num_experts = 8
  c.model.top_k = 2
  c.model.moe_d_ff = 64
  c.model.max_seq_len = 32
  c.model.msa_block_size = 8
  c.model.msa_top_k = 2

  c.parallel = config_lib.parallel_defaults()
  c.parallel.num_data = 1
  c.parallel.num_expert = 8
  c.parallel.slots_per_device = 2  # 16 slots for 8 experts: 8 redundant.
  # 'exact': each device receives and computes exactly its rows (default);
  # 'padded': every (source, destination) cell padded to one bucket.
  c.parallel.dispatch = 'exact'

  c.warmstart = ml_collections.ConfigDict()
  c.warmstart.steps = 800
  c.warmstart.batch_size = 64
  c.warmstart.learning_rate = 3e-3

  # MSA models only: distil the index branches toward the dense attention
  # after the warm start, before RL (docs/design.md §6.11); 0 steps: off.
  c.msa_distill = config_lib.msa_distill_defaults()

  c.sampler = ml_collections.ConfigDict()
  c.sampler.temperature = 1.0
  c.sampler.top_k = 0
  c.sampler.top_p = 1.0

  c.rl = ml_collections.ConfigDict()
  c.rl.steps = 100
  c.rl.prompts_per_step = 32
  c.rl.num_generations = 8
  c.rl.num_microbatches = 4
  c.rl.learning_rate = 3e-4
  # GRPO's mu (TRL num_iterations, verl ppo_epochs): optimizer updates per
  # rollout, all against the same old log-probs. At 1 the ratio is 1 in the
  # only update, so the clip (eps_low / eps_high) never acts, and the step
  # runs no old-policy forward (the update's own log-probs are the old ones).
  c.rl.num_update_epochs = 1
  # With several epochs, where the old log-probs come from: 'rollout' (the
  # sampler's: this same model, routes replayed), 'recompute' (a forward of
  # the old policy), or 'auto' (rollout in float32, recompute in bfloat16).
  # A step whose sampler/training gap exceeds old_logp_max_gap switches the
  # run to 'recompute'.
  c.rl.old_logp_source = 'auto'
  c.rl.old_logp_max_gap = 1e-3
  c.rl.eps_low = 0.2
  c.rl.eps_high = 0.28
  c.rl.beta = 0.01  # KL to the reference policy; 0 skips its forward too.
  # The objective (rl/grpo.py; WORKSPACE.md "RL objectives: verl and TRL
  # names" maps each to verl's and TRL's settings). How token losses become
  # the step's loss: 'seq-mean-token-mean' (GRPO's paper, TRL 'grpo'; each
  # sample weighs the same), 'token-mean' (verl's default, DAPO, TRL
  # 'dapo'), 'seq-mean-token-sum', or 'seq-mean-token-sum-norm' (Dr.GRPO,
  # TRL 'dr_grpo': token sums over loss_scale_factor, 0 = completion length).
  c.rl.loss_agg_mode = 'seq-mean-token-mean'
  c.rl.loss_scale_factor = 0.0
  # Dual-clip: caps a negative-advantage token's loss at -A * c (c > 1;
  # verl: 3.0). 0 = off: at num_update_epochs = 1 the ratio is 1 and it
  # never acts.
  c.rl.clip_ratio_c = 0.0
  # KL estimator: 'k3' (= verl 'low_var_kl', clamped as verl), 'k1' ('kl'),
  # 'k2' ('mse'), 'abs'.
  c.rl.kl_estimator = 'k3'
  # Group advantages: std ddof 0 (population; verl and TRL use 1), and
  # norm_adv_by_std False for Dr.GRPO's r - group mean.
  c.rl.adv_std_ddof = 0
  c.rl.norm_adv_by_std = True
  # 'ppo' (token ratio, clipped by eps_low / eps_high) or 'gspo' (one ratio
  # per sequence, clipped by gspo_eps_low / gspo_eps_high; needs
  # loss_agg_mode 'seq-mean-token-mean').
  c.rl.policy_loss = 'ppo'
  c.rl.gspo_eps_low = 3e-4
  c.rl.gspo_eps_high = 4e-4
  c.rl.grad_clip = 1.0
  c.rl.weight_decay = 0.0
  c.rl.balance_microbatches = False
  # Lay each micro-batch's sequences out over the devices so that their
  # token counts are even (foresight/composition.balance_device_tokens):
  # a device sends its own tokens' expert rows, so the one holding the
  # most bounds each all-to-all. Only the order within a micro-batch moves.
  c.rl.balance_device_tokens = True
  # Choose the micro-steps too (foresight/composition.balance_step_tokens)
  # is off here: on a cluster a device's sends cost link time (the real
  # configs turn it on), but simulated CPU devices share memory, where no
  # gain has been measured (docs/design.md).
  c.rl.balance_step_tokens = False

  c.planner = ml_collections.ConfigDict()
  # static | eplb_step | eplb_microstep | foresight_split | foremoe
  c.planner.method = 'foremoe'
  # The plan must be ready when the recompute it overlaps ends: the deadline
  # is deadline_recompute_frac x the last recompute time, at least
  # deadline_ms (all of it on the first step). Layers whose plan is late
  # take the recompute's step-level plan (one placement for the step, from
  # its exact loads; planner/guard.py).
  c.planner.deadline_ms = 200.0
  c.planner.deadline_recompute_frac = 1.0
  # Processes planning chunks of layers side by side (planner/layers.py);
  # 0: a quarter of the host's cores, at most 8 (1, no processes, below 8
  # cores, as on this CPU demo).
  c.planner.workers = 0
  c.planner.num_nodes = 1
  # Cost model of the simulated devices (this CPU): ~10 GFLOP/s of expert
  # compute and ~10 GB/s memcpy, so a tiny expert copies in about the time of
  # one token's expert compute. Accelerator figures (400 TFLOP/s, NVLink)
  # would make every copy cost more than a whole tiny micro-step.
  c.planner.flops_per_s = 1e10
  c.planner.intra_node_bw = 1e10
  c.planner.inter_node_bw = 1e10
  c.planner.overlap = 0.5  # Share of a micro-step's compute that hides copies.

  # Transfer engine. 'exact': one ragged all-to-all per layer and
  # transition carries exactly the experts that move; a "round" is one
  # expert each way per device, so the budgets bound the experts a device
  # sends or receives per layer ('rounds': the first engine, cyclic-shift
  # ppermute rounds in which every device sends, kept for comparison).
  # step_rounds fill the slots before micro-step 0 and flush the replica
  # gradients home after the last; microstep_rounds move experts between
  # micro-steps, overlapped with compute. Plans are fitted to these budgets
  # (moves beyond them are undone), so nothing recompiles.
  c.transfer = ml_collections.ConfigDict()
  c.transfer.mode = 'exact'
  c.transfer.step_rounds = 8  # A hot expert copied to every device: D - 1 sends.
  c.transfer.microstep_rounds = 2
  # The flush's form, and the first fill's from empty buffers: 'auto' takes
  # the reduction (broadcast) tree where its buffers, summed over its
  # stages, are fewer than one collective's; 'tree' always (least memory);
  # 'direct' never (fewest collectives).
  c.transfer.flush = 'auto'
  # The recompute (the reference forward, when beta > 0) also fills the
  # policy's experts into its step-level placement's slots, a chunk of
  # layers per micro-step under its forward: the update's fill then moves
  # only the slots micro-step 0 changes.
  c.transfer.prefill = True
  return c
