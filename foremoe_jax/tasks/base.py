"""The task interface: prompts in, rewards out.

Sits at both ends of the rollout: `sample_prompts` feeds the sampler, and
`reward` scores what it generated (the verifier in the RL step, before the
GRPO advantages). `supervised_batch` feeds the warm start that teaches a fresh
model the answer format before RL.

Shape letters: N problems, P prompt tokens, C completion tokens,
S = P + C sequence tokens.

Two kinds implement `Task`:
  * `CharTask` (this module): generated problems over a character alphabet,
    every prompt exactly `prompt_len` ids, no padding. Addition and sorting.
  * `tasks.dataset.DatasetTask`: prompts and reference answers read from
    JSONL or Parquet, a Hugging Face tokenizer, a verifier by name. Prompts
    differ in length and are left-padded with PAD to `prompt_len`; the
    sampler hides those PADs (`rollout.sampler.prompt_valid`).

Layout of a CharTask:
  prompt     = [BOS] + problem characters, exactly `prompt_len` ids (no PAD, so
               prompts batch to a static shape and no attention mask is needed).
  completion = answer characters + [EOS]; at most `completion_len` =
               `max_answer_len` + 1 ids.
Reward: 1.0 when the completion is exactly the answer followed by EOS (ids
after that EOS, or beyond `lengths`, are ignored). Otherwise
`partial_credit * (answer positions right) / len(answer)`, where positions past
`lengths` count as wrong. With the default partial_credit = 0 the reward is
the plain 0/1 verifier.
"""
from __future__ import annotations

import abc

import numpy as np

from foremoe_jax.tasks.tokenizer import BOS_ID, EOS_ID, PAD_ID, CharTokenizer


class Task(abc.ABC):
  """What the trainer needs of a task. Prompts are int32 [N, prompt_len],
  left-padded with `pad_id` where shorter; completions end with `eos_id`."""

  name: str

  @property
  @abc.abstractmethod
  def prompt_len(self) -> int:
    """Prompt ids per row (the padded width), BOS included."""

  @property
  @abc.abstractmethod
  def completion_len(self) -> int:
    """Tokens the sampler must be able to generate, EOS included."""

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    """Ids the tokenizer can produce (the model's vocabulary may be larger)."""

  @abc.abstractmethod
  def sample_prompts(self, rng, n: int) -> np.ndarray:
    """int32 [n, prompt_len] prompts for one RL step."""

  @abc.abstractmethod
  def reward(self, prompts_NP: np.ndarray, completions_NC: np.ndarray,
             lengths_N: np.ndarray | None = None) -> np.ndarray:
    """float32 [N] verifier rewards of the completions of these prompts."""

  @abc.abstractmethod
  def supervised_batch(self, rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Warm-start examples: (tokens int32 [n, S], loss_mask float32 [n, S])."""

  @abc.abstractmethod
  def decode(self, ids) -> str:
    """Text of a 1-D id sequence (specials dropped, stops at EOS)."""

  @property
  def pad_id(self) -> int:
    return PAD_ID

  @property
  def eos_id(self) -> int:
    return EOS_ID

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Ids other than `eos_id` that also end a completion (a checkpoint's
    second end-of-turn token); the sampler stops at any of them."""
    return ()

  @property
  def sequence_len(self) -> int:
    return self.prompt_len + self.completion_len

  @property
  def pads_prompts(self) -> bool:
    """Whether prompts may be left-padded (MSA layers cannot hide PADs)."""
    return False

  @property
  def reward_range(self) -> tuple[float, float]:
    """Lowest and highest reward the verifier gives (plots clip to it)."""
    return (0.0, 1.0)

  @property
  def last_reward_timeouts(self) -> int:
    """Verifier calls the last `reward` stopped at its time limit (their
    completions scored the bottom of `reward_range`); 0 without a limit."""
    return 0

  def references(self, prompts_NP: np.ndarray) -> list[str]:
    """The reference answer of each prompt row, as text (for logs)."""
    raise NotImplementedError

  def describe(self) -> str:
    """One line on the data the run reads ('' for a generated task)."""
    return ''

  def heldout_supervised_batch(self, rng, n: int
                               ) -> tuple[np.ndarray, np.ndarray]:
    """Warm-start examples for an evaluation (MSA distillation's), drawn
    without moving the training draws. A generated task draws them from
    `rng`, a generator of their own: independent draws of the same
    problems, not a disjoint set (`heldout_source`)."""
    return self.supervised_batch(rng, n)

  @property
  def heldout_source(self) -> str:
    """Where `heldout_supervised_batch` comes from, for reports."""
    return 'independent draws of the generated problems'

  def eval_prompts(self, n: int, seed: int) -> np.ndarray:
    """int32 [n, prompt_len] held-out prompts for the greedy evaluation."""
    return self.sample_prompts(np.random.default_rng(10_000 + seed), n)

  def close(self) -> None:
    """Releases what the task started (a dataset task's reward workers)."""

  def data_state(self) -> dict:
    """The task's data position, JSON-able, for the checkpoint.

    A generated task draws its problems from the run's numpy RNG, whose
    state the checkpoint already holds, so it has no position of its own;
    a task that reads a dataset returns its reader's position here.
    """
    return {}

  def load_data_state(self, state: dict) -> None:
    if state:
      raise ValueError(f'{type(self).__name__} keeps no data position, but '
                       f'the checkpoint holds one: {state}')


class CharTask(Task):
  """A task with a character alphabet, fixed-length prompts and a verifier.

  Subclasses give `name`, `alphabet`, `prompt_len`, `max_answer_len`,
  `partial_credit`, and the two abstract methods below.
  """

  name: str
  alphabet: str
  partial_credit: float

  @property
  @abc.abstractmethod
  def max_answer_len(self) -> int:
    """Answer characters at most, EOS excluded."""

  @abc.abstractmethod
  def sample_problems(self, rng: np.random.Generator, n: int) -> list[str]:
    """n problem strings of length prompt_len - 1 (no BOS)."""

  @abc.abstractmethod
  def solve(self, problem: str) -> str:
    """The one correct answer to a problem string."""

  # Derived, shared by all tasks.

  @property
  def tokenizer(self) -> CharTokenizer:
    return CharTokenizer(self.alphabet)

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.vocab_size

  @property
  def completion_len(self) -> int:
    """Tokens the sampler must be able to generate: answer plus EOS."""
    return self.max_answer_len + 1

  def sample_prompts(self, rng, n: int) -> np.ndarray:
    """int32 [n, prompt_len] prompt ids; rng is a Generator or a seed."""
    rng = np.random.default_rng(rng)
    problems = self.sample_problems(rng, n)
    tok = self.tokenizer
    prompts_NP = np.array([[BOS_ID] + tok.encode(p) for p in problems],
                          np.int32).reshape(n, -1)
    if prompts_NP.shape[1] != self.prompt_len:
      raise AssertionError(f'{self.name}: prompts have {prompts_NP.shape[1]} '
                           f'ids, expected {self.prompt_len}.')
    return prompts_NP

  def answers(self, prompts_NP: np.ndarray) -> list[str]:
    """Correct answer text for each prompt row."""
    tok = self.tokenizer
    return [self.solve(tok.decode(p)) for p in np.asarray(prompts_NP)]

  def references(self, prompts_NP: np.ndarray) -> list[str]:
    return self.answers(prompts_NP)

  def targets(self, prompts_NP: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(targets_NC, answer_len_N): answer ids + EOS, PAD-padded, int32."""
    tok = self.tokenizer
    answers = self.answers(prompts_NP)
    targets_NC = np.full((len(answers), self.completion_len), PAD_ID, np.int32)
    answer_len_N = np.zeros(len(answers), np.int32)
    for i, a in enumerate(answers):
      ids = tok.encode(a) + [EOS_ID]
      targets_NC[i, :len(ids)] = ids
      answer_len_N[i] = len(a)
    return targets_NC, answer_len_N

  def reward(self, prompts_NP: np.ndarray, completions_NC: np.ndarray,
             lengths_N: np.ndarray | None = None) -> np.ndarray:
    """float32 [N] rewards (see the module docstring for the rule).

    completions_NC may be longer than `completion_len` (a sampler that decodes
    to a fixed budget). lengths_N, if given, is how many leading completion ids
    are valid; by default, up to and including the first EOS.
    """
    completions_NC = np.asarray(completions_NC)
    num, width = completions_NC.shape
    if lengths_N is None:
      is_eos_NC = completions_NC == EOS_ID
      lengths_N = np.where(is_eos_NC.any(1), is_eos_NC.argmax(1) + 1, width)
    lengths_N = np.asarray(lengths_N).reshape(num)
    targets_NC, answer_len_N = self.targets(prompts_NP)
    width_all = max(width, self.completion_len)
    # -1 matches no id, so target positions past answer+EOS never count.
    tgt_NC = np.full((num, width_all), -1, np.int64)
    tgt_NC[:, :self.completion_len] = np.where(
        np.arange(self.completion_len) < answer_len_N[:, None] + 1,
        targets_NC, -1)
    comp_NC = np.full((num, width_all), PAD_ID, np.int64)
    comp_NC[:, :width] = completions_NC
    valid_NC = np.arange(width_all) < lengths_N[:, None]
    match_NC = (comp_NC == tgt_NC) & valid_NC
    exact_N = match_NC.sum(1) == answer_len_N + 1
    in_answer_NC = np.arange(width_all) < answer_len_N[:, None]
    frac_N = (match_NC & in_answer_NC).sum(1) / np.maximum(answer_len_N, 1)
    return np.where(exact_N, 1.0, self.partial_credit * frac_N
                    ).astype(np.float32)

  def supervised_batch(self, rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Warm-start examples: (tokens int32 [n, S], loss_mask float32 [n, S]).

    tokens = prompt + answer + EOS, right-padded with PAD to sequence_len.
    loss_mask is 1 at the positions of the answer and EOS ids, aligned with
    `tokens`: a next-token loss weights (logits[:, :-1], tokens[:, 1:]) by
    loss_mask[:, 1:].
    """
    prompts_NP = self.sample_prompts(rng, n)
    targets_NC, answer_len_N = self.targets(prompts_NP)
    tokens_NS = np.concatenate([prompts_NP, targets_NC], axis=1)
    pos_C = np.arange(self.completion_len)
    mask_NC = (pos_C < answer_len_N[:, None] + 1).astype(np.float32)
    mask_NS = np.concatenate(
        [np.zeros_like(prompts_NP, np.float32), mask_NC], axis=1)
    return tokens_NS, mask_NS

  def decode(self, ids) -> str:
    """Text of a 1-D id sequence (PAD/BOS dropped, stops at EOS)."""
    return self.tokenizer.decode(ids)
