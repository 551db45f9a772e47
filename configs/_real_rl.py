"""What the real-size RL configs share: GRPO on GSM8K, and their smoke mode.

configs/qwen3_30b_a3b.py, deepseek_v3_like.py, mixtral_8x7b.py and
olmoe_1b_7b.py each hold a model shape and the cluster it is laid out for,
and build the rest of the experiment here (`full_config`): a dataset task
in GSM8K's layout scored by math-verify, GRPO, the sampler, no warm start,
the planner priced for H100s, the transfer engine's round budgets. Each
field below says why it has its value; WORKSPACE.md ("Running the real-size
configs") has the commands.

`get_config('smoke')` of each of those files
(`--config=configs/<name>.py:smoke`) is the same experiment cut down to run
end to end on 8 simulated CPU devices (3-5 minutes and 6.6-7.7 GB peak RSS
each on a shared 2-core host; WORKSPACE.md has the table): `smoke` applies
SMOKE_COMMON below to every model, then the config's own SMOKE_REDUCED (its
docstring says what and why). SMOKE_COMMON, field by field:

  `model.num_layers` -> 1: one block at the real width (d_model, heads,
      head_dim, expert d_ff unless the config says otherwise), the layer
      stack scanned like the full model's.
  `model.vocab_size` -> 512: the word-problem tokenizer's vocabulary
      (`python -m experiments.make_word_problems` writes it). At 151,936
      (Qwen3) the embedding and the head alone are 622M float32
      parameters, 2.5 GB before the Adam moments. With
      `--config.init_from_hf=DIR` the checkpoint's vocabulary replaces it.
  `model.dtype`, `model.param_dtype` -> float32: what every CPU test and
      demo computes in; bfloat16 is the accelerators' compute dtype.
  `task_kwargs.train_path`, `task_kwargs.eval_path`,
  `task_kwargs.tokenizer_path` -> data/word_problems: generated arithmetic
      word problems in GSM8K's layout (`#### <number>` answers) with their
      own BPE tokenizer.json, so nothing is downloaded.
  `task_kwargs.prompt_template`, `task_kwargs.chat_template` -> the
      word-problem template, no chat template (that BPE has none).
  `task_kwargs.max_prompt_len`, `task_kwargs.max_completion_len` -> 48, 16:
      the word problems fit; decode and the update scale with them.
  `task_kwargs.reward_workers`, `task_kwargs.reward_timeout_s` -> 0, off:
      two cores, no spare for workers (and a time limit needs them).
  `rl.steps` -> 2: the second step reuses the compiled programs, or
      compiles a new capacity bucket (Mixtral's did), which one step never
      shows.
  `rl.prompts_per_step`, `rl.num_generations`, `rl.num_microbatches` ->
      4, 2, 1: 8 sequences, one per simulated device (`validate_config`
      wants whole sequences on every device of every micro-batch). With one
      micro-step no expert moves between micro-steps; the step's fill and
      flush of the slots still run.
  `eval_prompts` -> 8: greedy eval before and after RL on 8 prompts.
  `sample_log_every` -> 1: both steps write a sample to samples.jsonl.

Everything else (RL objective, learning rate, KL, sampler, planner method
and its H100 cost model, fsdp, remat, dispatch, warm start) stays as in the
full run, so the smoke test runs the full run's code paths.
tests/test_real_configs.py checks that a smoke config differs from its full
config in exactly SMOKE_COMMON plus the config's SMOKE_REDUCED.
"""
from __future__ import annotations

import ml_collections

# GSM8K as Hugging Face hosts it (openai/gsm8k, config 'main'): Parquet with
# `question` and `answer` columns, the answer ending in '#### <number>'.
GSM8K_TRAIN = 'data/gsm8k/main/train-00000-of-00001.parquet'
GSM8K_TEST = 'data/gsm8k/main/test-00000-of-00001.parquet'
# verl's GSM8K instruction (examples/data_preprocess/gsm8k.py): the answer
# marker the reward looks for is asked for in the prompt.
GSM8K_TEMPLATE = ('{prompt} Let\'s think step by step and output the final '
                  'answer after "####".')

# H100 SXM figures, the ones foremoe_jax/sim/hardware.py's H100 profile
# uses, so the trainer's planner prices moves as the simulator does.
H100_EXPERT_FLOPS = 0.6 * 989e12  # 60% of the dense bf16 peak.
H100_NVLINK_BW = 450e9  # NVLink 4, bytes/s each way per GPU.
H100_NIC_BW = 50e9  # One 400 Gb/s NIC per GPU.

SMOKE_COMMON = {
    'model.num_layers': 1,
    'model.vocab_size': 512,
    'model.dtype': 'float32',
    'model.param_dtype': 'float32',
    'task_kwargs.train_path': 'data/word_problems/train.jsonl',
    'task_kwargs.eval_path': 'data/word_problems/eval.jsonl',
    'task_kwargs.tokenizer_path': 'data/word_problems',
    'task_kwargs.prompt_template': 'Q: {prompt}\nA: ',
    'task_kwargs.chat_template': '',
    'task_kwargs.max_prompt_len': 48,
    'task_kwargs.max_completion_len': 16,
    'task_kwargs.reward_workers': 0,
    'task_kwargs.reward_timeout_s': 0.0,
    'rl.steps': 2,
    'rl.prompts_per_step': 4,
    'rl.num_generations': 2,
    'rl.num_microbatches': 1,
    'eval_prompts': 8,
    'sample_log_every': 1,
}

VARIANTS = ('', 'smoke')


def full_config(model: ml_collections.ConfigDict, *, num_data: int,
                num_expert: int, slots_per_device: int, num_nodes: int,
                prompts_per_step: int, num_microbatches: int,
                chat_template_kwargs: str = '') -> ml_collections.ConfigDict:
  """The whole GRPO experiment around `model` on a num_data x num_expert
  mesh whose EP ring spans `num_nodes` nodes.

  prompts_per_step x 8 generations / num_microbatches / devices is the
  sequences each device holds per micro-step; the configs keep it at what
  the cluster simulator and memory report assume (2 on 64 devices).
  """
  c = ml_collections.ConfigDict()
  c.seed = 0  # Prompts drawn, tokens sampled, random init (if any).
  c.task = 'dataset'
  c.task_kwargs = ml_collections.ConfigDict(dict(
      # Download openai/gsm8k (config 'main') under data/gsm8k/, or point
      # these at any JSONL / Parquet in its layout.
      train_path=GSM8K_TRAIN,
      eval_path=GSM8K_TEST,  # Greedy reward on the test split's first ones.
      # '': the tokenizer.json that ships with init_from_hf's checkpoint
      # (tasks.task_from_config), so one flag names both; or a directory /
      # tokenizer.json of its own (needed for a random-init run).
      tokenizer_path='',
      prompt_field='question',
      answer_field='answer',
      answer_marker='####',  # The reference is the number after it.
      solution_field='',  # Warm-start target (unused: warmstart.steps = 0).
      prompt_template=GSM8K_TEMPLATE,
      # 'auto': the checkpoint's own chat template (instruct / chat
      # checkpoints); '' for a base checkpoint, which has none.
      chat_template='auto',
      system_prompt='',
      chat_template_kwargs=chat_template_kwargs,
      add_bos=True,  # Only where the tokenizer has a BOS the template lacks.
      pad_token='',  # '' = tokenizer_config.json's, else EOS; never BOS.
      # Ids besides EOS that end a completion: '' = generation_config.json's
      # eos_token_id list; else JSON, e.g. '["<|im_end|>"]' ('[]': none).
      stop_tokens='',
      reward='math',  # math-verify on the text after the last '####'.
      reward_range=(0.0, 1.0),
      # GSM8K questions take < 200 tokens with the template; 1,024 new
      # tokens hold a step-by-step answer without thinking mode. Prompt +
      # completion (1,280) stays under the 2 x 4,096 tokens per device per
      # micro-step that experiments.memory_report checked.
      max_prompt_len=256,
      max_completion_len=1024,
      shuffle_seed=0,
      # math-verify runs per completion on the host, in every process; 4
      # workers per process leave cores to the host code on an 8-GPU node.
      reward_workers=4,
      # A verifier call past 30 s (sympy on an adversarial expression) is
      # stopped and scores 0; math-verify's own 5 s limits cover most.
      reward_timeout_s=30.0,
      # The warm start (off here: a pretrained checkpoint) trains on the
      # solution only, as SFT on GSM8K does.
      sft_prompt_loss=False,
  ))
  c.eval_prompts = 256  # Greedy reward before and after RL (0: skip).
  # An RL checkpoint holds the float32 master, both Adam moments and the
  # reference policy (16 bytes per parameter: ~490 GB for Qwen3-30B-A3B),
  # so save every 20 steps rather than every few.
  c.checkpoint_every = 20
  c.sample_log_every = 10  # Decoded samples to samples.jsonl and the log.
  c.profile_steps = ''  # RL steps to trace, e.g. '3,5'.
  # The Hugging Face checkpoint to start from: point it at the downloaded
  # directory (config.json + safetensors + tokenizer.json). Its config.json
  # fixes the architecture (it must match `model` below for the mesh to
  # fit). '': random init at `model`'s shape (throughput runs).
  c.init_from_hf = ''

  c.model = model

  p = c.parallel = ml_collections.ConfigDict()
  p.num_data = num_data  # Data-parallel rows, each with its own EP ring.
  p.num_expert = num_expert  # EP ring: canonical experts split over it.
  p.slots_per_device = slots_per_device  # Homes + redundant replicas.
  # ZeRO over every device: the non-expert master and Adam moments would
  # otherwise be replicated on each (docs/design.md §4.7; the memory
  # report's peak per H100 for Qwen3-30B-A3B, results/memory_report.json,
  # assumes it).
  p.fsdp = True
  p.fsdp_axes = 'data+expert'
  # Ragged all-to-all of exactly the routed rows (the GPU / TPU collective),
  # not padded cells: the exact dispatch is what lets balance pay at scale.
  p.dispatch = 'exact'
  p.capacity_growth = 1.25  # Capacity-bucket ladder step (one compile each).
  p.capacity_factors = ()  # Empty: the geometric ladder.
  p.cell_growth = 2.0  # CPU exchange emulation's pair ladder (not on GPU).
  p.cell_factors = ()  # Empty: that ladder.

  # A pretrained checkpoint already writes answers; the warm start exists
  # to teach a random-init tiny model the task's format (configs/tiny.py).
  # SFT on GSM8K's solutions would be another experiment. batch_size and
  # learning_rate apply only when steps > 0.
  w = c.warmstart = ml_collections.ConfigDict()
  w.steps = 0
  w.batch_size = 64
  w.learning_rate = 1e-5

  s = c.sampler = ml_collections.ConfigDict()
  s.temperature = 1.0  # GRPO samples from the policy itself (verl, TRL).
  s.top_k = 0  # Off.
  s.top_p = 1.0  # Off.

  r = c.rl = ml_collections.ConfigDict()
  r.steps = 100  # Below two epochs of GSM8K's 7,473 training questions.
  r.prompts_per_step = prompts_per_step
  r.num_generations = 8  # GRPO group size.
  r.num_microbatches = num_microbatches
  r.learning_rate = 1e-6  # verl's and TRL's GRPO default for LLMs.
  # One update per rollout: the ratio is 1, the clip never acts and no
  # old-policy forward runs (configs/tiny.py says more).
  r.num_update_epochs = 1
  # With several epochs: 'auto' recomputes the old log-probs in bfloat16,
  # where the sampler's one-token decode rounds differently.
  r.old_logp_source = 'auto'
  r.old_logp_max_gap = 1e-3
  r.eps_low = 0.2
  r.eps_high = 0.28  # DAPO's clip-higher.
  # KL to the reference policy: verl's kl_loss_coef. Keeps the reference
  # forward the cluster simulator prices in every step.
  r.beta = 0.001
  # The objective's other fields at the repository defaults; WORKSPACE.md
  # "RL objectives: verl and TRL names" maps each to verl and TRL.
  r.loss_agg_mode = 'seq-mean-token-mean'
  r.loss_scale_factor = 0.0
  r.clip_ratio_c = 0.0
  r.kl_estimator = 'k3'
  r.adv_std_ddof = 0
  r.norm_adv_by_std = True
  r.policy_loss = 'ppo'
  r.gspo_eps_low = 3e-4
  r.gspo_eps_high = 4e-4
  r.grad_clip = 1.0
  r.weight_decay = 0.0
  r.balance_microbatches = False
  # Even each micro-batch's tokens over the devices: the device that sends
  # the most rows bounds every all-to-all (docs/results.md).
  r.balance_device_tokens = True
  # Choose the micro-steps too (foresight/composition.balance_step_tokens):
  # the step waits for each micro-step's busiest sender, so the long
  # samples share one micro-step filled evenly, instead of each setting
  # the pace of its own. Only where a sample runs changes, not the
  # gradient (a sum over sequences). Simulated at 64 H100s: the busiest
  # sender 1.93x -> 1.05x the mean (docs/design.md).
  r.balance_step_tokens = True

  pl = c.planner = ml_collections.ConfigDict()
  pl.method = 'foremoe'
  # The first step has no recompute time to hide behind, so it gets
  # deadline_ms whole: the simulator's ForeMoE plans take 0.8 s
  # (Qwen3-30B-A3B) and 1.5 s (DeepSeek-V3-like) at EP 64.
  pl.deadline_ms = 3000.0
  pl.deadline_recompute_frac = 1.0
  # Planner processes, each planning chunks of layers (planner/layers.py);
  # 0: a quarter of the host's cores, at most 8 (a GPU node's host CPUs
  # idle during the update, and DeepSeek-V3-like at EP 256 plans 58 layers).
  pl.workers = 0
  pl.num_nodes = num_nodes  # Nodes the EP ring spans (the slow tier).
  pl.flops_per_s = H100_EXPERT_FLOPS
  pl.intra_node_bw = H100_NVLINK_BW
  pl.inter_node_bw = H100_NIC_BW
  # Share of a micro-step's compute that hides expert copies (the
  # simulator's planner window on GPUs).
  pl.overlap = 0.5

  t = c.transfer = ml_collections.ConfigDict()
  # 'exact': each layer's moves are one ragged all-to-all of the experts
  # that move (wire bytes = useful bytes); 'rounds' is the first engine.
  t.mode = 'exact'
  # Fill and flush: a hot expert may be copied to every device of the ring
  # (num_expert - 1 sends), the trainer's and the simulator's default.
  t.step_rounds = num_expert
  t.microstep_rounds = 2  # Moves between micro-steps, under compute.
  # The flush's form: 'auto' takes the reduction tree (stages of s + (s +
  # h) float32 experts) where its buffers, summed over its stages, are
  # fewer than one collective's (min(s, R) + R); 'tree' whenever memory
  # is tighter than time; 'direct' never. The step's first fill from empty
  # buffers follows it (a broadcast tree, stages of (s + h) + s experts).
  t.flush = 'auto'
  # The recompute fills the policy's experts into its step-level slots under
  # its forward, so the update opens with only micro-step 0's changes.
  t.prefill = True
  return c


def smoke(config: ml_collections.ConfigDict,
          reduced: dict) -> ml_collections.ConfigDict:
  """`config` with SMOKE_COMMON, then `reduced` (dotted field -> value)."""
  c = ml_collections.ConfigDict(config.to_dict())
  for path, value in {**SMOKE_COMMON, **reduced}.items():
    *parents, name = path.split('.')
    node = c
    for parent in parents:
      node = node[parent]
    if name not in node:
      raise KeyError(f'smoke override {path!r} names no field of the config')
    node[name] = value
  return c


def variant(full: ml_collections.ConfigDict, name: str,
            reduced: dict) -> ml_collections.ConfigDict:
  """`get_config(name)` of a real-size config: '' the full run, 'smoke'."""
  if name not in VARIANTS:
    raise ValueError(f"config variant {name!r}: use '' (the full run) or "
                     "'smoke' (--config=configs/<name>.py:smoke)")
  return smoke(full, reduced) if name == 'smoke' else full
