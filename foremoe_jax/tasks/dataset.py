"""Dataset tasks: prompts and reference answers from files, a real tokenizer,
a verifier by name. How verl, Tunix and TRL users run GRPO.

Sits where `CharTask` sits in the data flow: `sample_prompts` feeds the
sampler, `reward` scores its completions, `supervised_batch` feeds the warm
start. What differs:

  * Records come from JSONL (one JSON object per line), a JSON list, or
    Parquet (needs pyarrow). `prompt_field` holds the question,
    `answer_field` the reference answer; `answer_marker` ('####' for GSM8K)
    keeps only what follows the marker as the reference. `solution_field`
    (default: the answer field, whole) is the warm start's target text.
  * Text becomes ids through a Hugging Face `tokenizer.json`
    (`HFTokenizer`): `prompt_template` ('{prompt}' by default) wraps the
    question, then the optional chat template renders it as a user turn.
  * Prompts are left-padded with the tokenizer's PAD to `max_prompt_len`;
    the sampler hides those PADs from attention and from the experts, so a
    prompt's completion does not depend on its padding. Records whose
    prompt is longer are skipped (counted in `num_skipped`), as verl's
    `filter_overlong_prompts` does; so are warm-start targets longer than
    `max_completion_len` - 1, for the warm start only.
  * The warm start's loss is on the solution and EOS; with
    `sft_prompt_loss` it is on the prompt's tokens too (every real token
    after the first), as pretraining trains a checkpoint on all of its
    text, so attention at prompt positions is learnt, not left as at init.
  * The order is a `grain.MapDataset`: shuffled with `shuffle_seed`,
    reshuffled every epoch, repeated forever, read by index. The data
    position is the index of the next record, so `data_state` is two
    integers (RL and warm-start streams) and a resumed run reads on from
    exactly where the interrupted one stopped.
  * A completion ends at EOS or at any of the checkpoint's other end ids
    (`eos_token_id` in `generation_config.json`, as transformers and vLLM
    stop; `stop_tokens` overrides them).
  * `reward` decodes each completion to text (up to its EOS) and calls the
    verifier `reward` names (`tasks.rewards`: 'math' for math-verify,
    'exact_match', 'numeric', a registered name or 'pkg.module:function'),
    in `reward_workers` spawned processes when that is > 0 (`RewardPool`);
    with `reward_timeout_s` > 0 (workers needed) a call that runs longer is
    stopped and its completion scores the bottom of `reward_range`.

The reference answer of each prompt is kept in a table keyed by the prompt's
ids, built when the files are read, which is how `reward` finds it from the
ids the trainer passes back. A record whose prompt repeats an earlier one's
(in the training file, or the training file's in the eval file) with a
different answer cannot be scored by ids alone: it is left out of RL and
evaluation and counted (`num_conflicting`, `num_eval_conflicting`); the warm
start still trains on it.
"""
from __future__ import annotations

import collections.abc
import json
import os
from typing import Any

import grain
import numpy as np

from foremoe_jax.tasks import reward_pool
from foremoe_jax.tasks import rewards as rewards_lib
from foremoe_jax.tasks.base import Task
from foremoe_jax.tasks.hf_tokenizer import HFTokenizer


def read_records(path: str) -> list[dict[str, Any]]:
  """The records of a .jsonl / .json / .parquet file, as dicts."""
  if not path:
    raise ValueError('a dataset path is required (train_path).')
  if not os.path.exists(path):
    raise ValueError(f'dataset file {path!r} does not exist.')
  ext = os.path.splitext(path)[1].lower()
  if ext == '.parquet':
    try:
      import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ValueError(f'reading {path!r} needs pyarrow: pip install '
                       'pyarrow') from e
    return pq.read_table(path).to_pylist()
  if ext not in ('.jsonl', '.json', '.ndjson'):
    raise ValueError(f'dataset file {path!r}: expected .jsonl, .json or '
                     '.parquet.')
  with open(path, encoding='utf-8') as f:
    text = f.read()
  if text.lstrip().startswith('['):  # A JSON list of records.
    records = json.loads(text)
  else:
    records = []
    for i, line in enumerate(text.splitlines()):
      if line.strip():
        try:
          records.append(json.loads(line))
        except json.JSONDecodeError as e:
          raise ValueError(f'{path}:{i + 1}: not a JSON object ({e}).') from None
  if not records:
    raise ValueError(f'dataset file {path!r} holds no records.')
  if not all(isinstance(r, dict) for r in records):
    raise ValueError(f'dataset file {path!r}: every record must be a JSON '
                     'object.')
  return records


def _field(records, name: str, path: str) -> list:
  for i, r in enumerate(records):
    if name not in r:
      raise ValueError(f'{path}: record {i} has no field {name!r} (it has '
                       f'{sorted(r)}); set task_kwargs to the right field '
                       'name.')
  return [r[name] for r in records]


def prompt_targets(prompts_NP, pad_id: int) -> np.ndarray:
  """float32 [N, P]: 1 where a prompt token is a warm-start target, i.e. it
  and the token before it are real. Real means at or after the row's first
  non-PAD token (the sampler's `prompt_valid`), not `!= pad_id`: with no
  PAD token the tokenizer pads with EOS (`HFTokenizer`), and an EOS inside
  a prompt (a chat turn's end) is text the sampler feeds, not padding."""
  real_NP = np.cumsum(np.asarray(prompts_NP) != pad_id, axis=1) > 0
  mask_NP = np.zeros(real_NP.shape, np.float32)
  mask_NP[:, 1:] = real_NP[:, 1:] & real_NP[:, :-1]
  return mask_NP


class DatasetTask(Task):
  """A task read from a dataset file; see the module docstring."""

  name = 'dataset'

  def __init__(self, *, train_path: str = '', tokenizer_path: str = '',
               eval_path: str = '', prompt_field: str = 'question',
               answer_field: str = 'answer', solution_field: str = '',
               answer_marker: str = '', prompt_template: str = '{prompt}',
               chat_template: str = '', system_prompt: str = '',
               chat_template_kwargs: str | dict = '', pad_token: str = '',
               stop_tokens: str | tuple[str, ...] = '',
               add_bos: bool = True, reward: str = 'math',
               reward_range: tuple[float, float] = (0.0, 1.0),
               max_prompt_len: int = 64, max_completion_len: int = 32,
               shuffle_seed: int = 0, reward_workers: int = 0,
               reward_timeout_s: float = 0.0,
               sft_prompt_loss: bool = False):
    if not tokenizer_path:
      raise ValueError('a tokenizer is required (tokenizer_path: a '
                       'tokenizer.json or the directory holding one).')
    if max_prompt_len < 1 or max_completion_len < 2:
      raise ValueError('max_prompt_len must be >= 1 and max_completion_len '
                       f'>= 2, got {max_prompt_len}, {max_completion_len}.')
    if '{prompt}' not in prompt_template:
      raise ValueError(f'prompt_template {prompt_template!r} must contain '
                       '{prompt}.')
    # '': the checkpoint's generation_config.json decides; else a JSON list
    # on the command line ('["<|im_end|>"]'; '[]' for EOS alone).
    if stop_tokens == '':
      stop_tokens = None
    elif isinstance(stop_tokens, str):
      try:
        stop_tokens = json.loads(stop_tokens)
      except json.JSONDecodeError as e:
        raise ValueError(f'stop_tokens {stop_tokens!r} is not a JSON list of '
                         f'token strings ({e}).') from None
    if stop_tokens is not None and (
        not isinstance(stop_tokens, (list, tuple))
        or not all(isinstance(t, str) for t in stop_tokens)):
      raise ValueError('stop_tokens must be a list of token strings, got '
                       f'{stop_tokens!r}.')
    try:
      self.tokenizer = HFTokenizer.from_path(
          tokenizer_path, chat_template=chat_template or None,
          pad_token=pad_token or None, stop_tokens=stop_tokens)
    except FileNotFoundError as e:
      raise ValueError(str(e)) from None
    self.reward_fn = rewards_lib.get_reward(reward)
    self._reward_name = reward
    self._reward_range = (float(reward_range[0]), float(reward_range[1]))
    self._scorer = reward_pool.RewardPool(
        self.reward_fn, reward_workers, timeout_s=reward_timeout_s or None,
        timeout_score=self._reward_range[0])
    self._prompt_len, self._completion_len = max_prompt_len, max_completion_len
    self._template, self._system = prompt_template, system_prompt or None
    # A JSON object on the command line ('{"enable_thinking": false}').
    if isinstance(chat_template_kwargs, str):
      try:
        chat_template_kwargs = json.loads(chat_template_kwargs or '{}')
      except json.JSONDecodeError as e:
        raise ValueError(f'chat_template_kwargs {chat_template_kwargs!r} is '
                         f'not a JSON object ({e}).') from None
    # A dict in a Python config arrives as a ConfigDict (no dict subclass).
    if hasattr(chat_template_kwargs, 'to_dict'):
      chat_template_kwargs = chat_template_kwargs.to_dict()
    if not isinstance(chat_template_kwargs, collections.abc.Mapping):
      raise ValueError('chat_template_kwargs must be a JSON object, got '
                       f'{chat_template_kwargs!r}.')
    self._template_vars = dict(chat_template_kwargs)
    self._add_bos = add_bos
    self._sft_prompt_loss = bool(sft_prompt_loss)
    self._marker = answer_marker
    self._fields = (prompt_field, answer_field, solution_field or answer_field)
    self._references: dict[bytes, str] = {}

    train = self._load(train_path, with_solutions=True)
    self._train_prompts, self._train_refs, sft_ids = train
    self._refuse_pad_first(train_path, self._train_prompts)
    keep = [i for i, p in enumerate(self._train_prompts) if p is not None]
    self.num_records = len(self._train_prompts)
    self.num_skipped = self.num_records - len(keep)
    if not keep:
      raise ValueError(f'{train_path}: no prompt fits max_prompt_len='
                       f'{max_prompt_len} tokens; raise it.')
    sft_keep = [i for i in keep
                if len(sft_ids[i]) <= max_completion_len - 1]
    if not sft_keep:
      raise ValueError(f'{train_path}: no warm-start target fits '
                       f'max_completion_len={max_completion_len} tokens '
                       '(EOS included); raise it.')
    self._sft_ids = sft_ids
    self._sft_keep = sft_keep
    self.num_sft_skipped = len(keep) - len(sft_keep)
    # reward() finds a prompt's reference from its ids alone, so two
    # records with one prompt and different answers cannot both be scored
    # right: the later one is left out of the RL stream (counted).
    keep = self._claim_references(keep, self._train_prompts, self._train_refs)
    self.num_conflicting = self.num_records - self.num_skipped - len(keep)
    self._rl_keep = keep
    # Record indices in training order; ds[i] is the i-th record drawn.
    self._order = grain.MapDataset.source(keep).shuffle(
        seed=shuffle_seed).repeat(None)
    self._sft_order = grain.MapDataset.source(sft_keep).shuffle(
        seed=shuffle_seed + 1).repeat(None)
    self._position = self._sft_position = 0
    self._train_path = train_path
    self._eval = None
    self._eval_sft = []  # (prompt ids, solution ids) of eval records.
    self.num_eval_conflicting = 0
    if eval_path:
      # With the solution field, eval records are held-out warm-start
      # sequences too (MSA distillation's evaluation batch).
      prompts, refs, sols = self._load(eval_path, with_solutions=None)
      self._refuse_pad_first(eval_path, prompts)
      fit = [i for i, p in enumerate(prompts) if p is not None]
      if not fit:
        raise ValueError(f'{eval_path}: no prompt fits max_prompt_len.')
      claimed = self._claim_references(fit, prompts, refs)
      self.num_eval_conflicting = len(fit) - len(claimed)
      if not claimed:
        raise ValueError(f'{eval_path}: every prompt repeats a training '
                         'prompt with another reference answer.')
      fit = claimed
      self._eval = [prompts[i] for i in fit]
      self._eval_sft = [(prompts[i], sols[i]) for i in fit if sols
                        and len(sols[i]) <= max_completion_len - 1]

  def _refuse_pad_first(self, path, prompts) -> None:
    # Only leading PADs are padding (`sampler.prompt_valid`): a prompt that
    # starts with the PAD id (a BOS that is also PAD, as in tokenizers whose
    # one special token is BOS, EOS and PAD at once) would lose that token.
    first = next((p for p in prompts if p and p[0] == self.pad_id), None)
    if first is not None:
      raise ValueError(
          f'{path}: prompts start with token {self.pad_id} '
          f'({self.tokenizer.pad_token!r}), which is also the PAD token, '
          f'and leading PADs are hidden as '
          f'padding. Name another PAD (task_kwargs.pad_token, a token of '
          f'the vocabulary that prompts never start with), or add_bos=False.')

  def _claim_references(self, indices, prompts, refs) -> list[int]:
    """Records the reference of each indexed record's prompt; returns the
    indices kept: all but those whose prompt already holds a different
    reference (an earlier record's, of this file or the training file)."""
    kept = []
    for i in indices:
      key = self._pad(prompts[i]).tobytes()
      if self._references.setdefault(key, refs[i]) == refs[i]:
        kept.append(i)
    return kept

  # Reading.

  def _load(self, path, *, with_solutions: bool | None):
    """(prompt ids or None when too long, references, solution ids).

    with_solutions: None reads the solutions when every record has the
    field (an eval file may not), else returns none."""
    records = read_records(path)
    if with_solutions is None:
      with_solutions = all(self._fields[2] in r for r in records)
    prompt_f, answer_f, solution_f = self._fields
    questions = _field(records, prompt_f, path)
    tok = self.tokenizer
    # replace, not format: a template may hold other braces (LaTeX, JSON).
    texts = [tok.render_prompt(self._template.replace('{prompt}', str(q)),
                               system_prompt=self._system,
                               **self._template_vars) for q in questions]
    bos = ([tok.bos_id] if self._add_bos and tok.bos_id is not None else [])
    prompts = []
    for ids in tok.encode_batch(texts):
      if bos and ids[:1] != bos:
        ids = bos + ids
      prompts.append(ids if len(ids) <= self._prompt_len else None)
    answers = [str(a) for a in _field(records, answer_f, path)]
    refs = [rewards_lib.answer_after_marker(a, self._marker) if self._marker
            else a.strip() for a in answers]
    sft = []
    if with_solutions:
      solutions = [str(s) for s in _field(records, solution_f, path)]
      sft = tok.encode_batch(solutions)
    return prompts, refs, sft

  def _pad(self, prompt_ids) -> np.ndarray:
    row = np.full(self._prompt_len, self.pad_id, np.int32)
    row[self._prompt_len - len(prompt_ids):] = prompt_ids
    return row

  def _rows(self, prompt_ids_list) -> np.ndarray:
    return np.stack([self._pad(p) for p in prompt_ids_list])

  # The Task interface.

  def describe(self) -> str:
    used = self.num_records - self.num_skipped
    line = (f'dataset {self._train_path}: {used} of {self.num_records} '
            f'records used ({self.num_skipped} prompts longer than '
            f'max_prompt_len={self._prompt_len} skipped; '
            f'{used - self.num_sft_skipped} with a warm-start target within '
            f'max_completion_len={self._completion_len})')
    if self.num_conflicting:
      line += (f'; {self.num_conflicting} left out of RL: their prompt '
               'repeats an earlier record\'s with another answer')
    if self._eval is not None:
      line += f'; {len(self._eval)} eval prompts'
      if self.num_eval_conflicting:
        line += f' ({self.num_eval_conflicting} left out the same way)'
    return line + f'; reward {self._reward_name!r}'

  @property
  def prompt_len(self) -> int:
    return self._prompt_len

  @property
  def completion_len(self) -> int:
    return self._completion_len

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.vocab_size

  @property
  def pad_id(self) -> int:
    return self.tokenizer.pad_id

  @property
  def eos_id(self) -> int:
    return self.tokenizer.eos_id

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return self.tokenizer.stop_ids

  @property
  def pads_prompts(self) -> bool:
    return True

  @property
  def reward_range(self) -> tuple[float, float]:
    return self._reward_range

  def sample_prompts(self, rng, n: int) -> np.ndarray:
    """The next n prompts of the shuffled stream (rng is not used: the
    order is the dataset's, and its position is in `data_state`)."""
    del rng
    idx = [self._order[self._position + i] for i in range(n)]
    self._position += n
    return self._rows([self._train_prompts[i] for i in idx])

  def eval_prompts(self, n: int, seed: int) -> np.ndarray:
    """The first n prompts of eval_path, in file order; without an eval
    file, n training prompts in an order of their own (they overlap the
    training data, so the number is a training accuracy)."""
    if self._eval is not None:
      return self._rows(self._eval[:n])
    keep = self._rl_keep
    order = grain.MapDataset.source(keep).shuffle(seed=10_000 + seed)
    idx = [order[i] for i in range(min(n, len(keep)))]
    return self._rows([self._train_prompts[i] for i in idx])

  def references(self, prompts_NP: np.ndarray) -> list[str]:
    """The reference answer of each prompt row (drawn from this task)."""
    out = []
    for row in np.asarray(prompts_NP, np.int32):
      ref = self._references.get(row.tobytes())
      if ref is None:
        raise KeyError(f'prompt {self.decode(row)!r} is not one of this '
                       "task's prompts, so its reference answer is unknown.")
      out.append(ref)
    return out

  def completion_texts(self, completions_NC, lengths_N=None) -> list[str]:
    completions_NC = np.asarray(completions_NC)
    if lengths_N is None:
      lengths_N = np.full(len(completions_NC), completions_NC.shape[1])
    return [self.tokenizer.decode(c[:int(n)])
            for c, n in zip(completions_NC, np.asarray(lengths_N))]

  def reward(self, prompts_NP, completions_NC, lengths_N=None) -> np.ndarray:
    """The verifier's score of each completion's text (up to its EOS)
    against its prompt's reference answer; float32 [N]."""
    refs = self.references(prompts_NP)
    texts = self.completion_texts(completions_NC, lengths_N)
    if self._marker:  # Score the final answer, as the reference holds it.
      texts = [rewards_lib.answer_after_marker(t, self._marker)
               if self._marker in t else t for t in texts]
    return np.array(self._scorer(texts, refs), np.float32)

  @property
  def last_reward_timeouts(self) -> int:
    return self._scorer.last_timeouts

  def close(self) -> None:
    self._scorer.close()

  def supervised_batch(self, rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The next n warm-start examples: left-padded prompt, then the solution
    and EOS, right-padded with PAD; loss on the solution and EOS (and with
    sft_prompt_loss on each prompt token that follows a real one)."""
    del rng
    idx = [self._sft_order[self._sft_position + i] for i in range(n)]
    self._sft_position += n
    return self._supervised_rows([self._train_prompts[i] for i in idx],
                                 [self._sft_ids[i] for i in idx])

  def heldout_supervised_batch(self, rng, n: int
                               ) -> tuple[np.ndarray, np.ndarray]:
    """n warm-start examples of eval_path's records (file order, cycled
    when n exceeds them), when that file has the solution field; else of
    the training records in an order of their own (`heldout_source` says
    which). Reads no stream: the training draws do not depend on it."""
    del rng
    if self._eval_sft:
      pairs = [self._eval_sft[i % len(self._eval_sft)] for i in range(n)]
    else:
      order = grain.MapDataset.source(self._sft_keep).shuffle(
          seed=20_000).repeat(None)
      pairs = [(self._train_prompts[order[i]], self._sft_ids[order[i]])
               for i in range(n)]
    return self._supervised_rows(*zip(*pairs))

  @property
  def heldout_source(self) -> str:
    return ('eval_path records' if self._eval_sft else
            'training records (no eval_path with solutions: not held out)')

  def _supervised_rows(self, prompt_ids_list, solution_ids_list):
    n, c = len(prompt_ids_list), self._completion_len
    prompts_NP = self._rows(prompt_ids_list)
    targets_NC = np.full((n, c), self.pad_id, np.int32)
    mask_NC = np.zeros((n, c), np.float32)
    for row, sol in enumerate(solution_ids_list):
      ids = list(sol) + [self.eos_id]
      targets_NC[row, :len(ids)], mask_NC[row, :len(ids)] = ids, 1.0
    tokens_NS = np.concatenate([prompts_NP, targets_NC], axis=1)
    prompt_mask_NP = np.zeros_like(prompts_NP, np.float32)
    if self._sft_prompt_loss:
      prompt_mask_NP = prompt_targets(prompts_NP, self.pad_id)
    mask_NS = np.concatenate([prompt_mask_NP, mask_NC], axis=1)
    return tokens_NS, mask_NS

  def decode(self, ids) -> str:
    return self.tokenizer.decode(ids)

  def data_state(self) -> dict:
    return dict(position=self._position, sft_position=self._sft_position,
                num_records=self.num_records)

  def load_data_state(self, state: dict) -> None:
    if not state:
      return
    if state.get('num_records', self.num_records) != self.num_records:
      raise ValueError(
          f'the checkpoint read a dataset of {state["num_records"]} records; '
          f'this one has {self.num_records}. Resuming on a different file '
          'would not continue the same run; use a new workdir.')
    self._position = int(state['position'])
    self._sft_position = int(state.get('sft_position', 0))
