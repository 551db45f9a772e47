"""The tiny main job on a dataset task: JSONL files, a BPE tokenizer, math-verify.

The same model and RL as configs/tiny.py, on generated arithmetic word
problems in GSM8K's file layout. Make the files once, then train:
  python -m experiments.make_word_problems --out_dir=data/word_problems
  python -m experiments.rl_train --config=configs/tiny_dataset.py \
      --workdir=/tmp/foremoe_dataset
(`make demo-dataset` does both.) For GSM8K itself, see WORKSPACE.md
("Dataset tasks"): point train_path/eval_path at its files and
tokenizer_path at the checkpoint's tokenizer.json.
"""
import ml_collections

from configs import tiny


def get_config() -> ml_collections.ConfigDict:
  c = tiny.get_config()
  c.task = 'dataset'
  c.task_kwargs = ml_collections.ConfigDict(dict(
      train_path='data/word_problems/train.jsonl',
      eval_path='data/word_problems/eval.jsonl',
      tokenizer_path='data/word_problems',  # Its tokenizer.json.
      prompt_field='question',
      answer_field='answer',
      answer_marker='####',  # The reference is what follows it.
      solution_field='',  # Warm-start target: '' = the answer field, whole.
      prompt_template='Q: {prompt}\nA: ',
      chat_template='',  # 'auto': the tokenizer's own (tokenizer_config.json).
      system_prompt='',
      chat_template_kwargs='',  # JSON, e.g. '{"enable_thinking": false}'.
      add_bos=True,
      pad_token='',  # '' = tokenizer_config.json's, else EOS; never BOS.
      # Ids besides EOS that end a completion: '' = generation_config.json's
      # eos_token_id list; else JSON, e.g. '["<|im_end|>"]' ('[]': none).
      stop_tokens='',
      reward='math',  # math-verify; or exact_match, numeric, pkg.mod:fn.
      reward_range=(0.0, 1.0),
      max_prompt_len=48,  # Longer prompts are skipped (and counted).
      max_completion_len=16,  # EOS included.
      shuffle_seed=0,
      reward_workers=0,  # >0: the verifier runs in that many processes.
      # > 0 (with workers): a verifier call past it is stopped, scores the
      # bottom of reward_range.
      reward_timeout_s=0.0,
      sft_prompt_loss=False,  # Warm start also on the prompt's tokens.
  ))
  c.eval_prompts = 256
  c.model.vocab_size = 512  # The BPE's vocabulary.
  c.model.max_seq_len = 64
  c.warmstart.steps = 150  # Stops short, leaving RL room to improve.
  c.rl.prompts_per_step = 16
  return c
