"""Digit sorting: "5213=" -> "1235".

A verifiable task for the sampler and the GRPO verifier (see `base.Task`).
Digits are drawn with repetition, so the answer is a multiset sort; its length
always equals `num_digits`. The easy task: a 2-layer d=64 dense transformer
answers 4 or 5 digits exactly after 300 warm-start steps of batch 64, so RL on
it mostly tests the machinery, not the learning.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from foremoe_jax.tasks.base import CharTask


@dataclasses.dataclass(frozen=True)
class SortTask(CharTask):
  """Sort num_digits uniform random digits in ascending order."""

  num_digits: int = 4
  partial_credit: float = 0.0
  name: str = 'sort'
  alphabet: str = '0123456789='

  def __post_init__(self):
    if self.num_digits < 1:
      raise ValueError(f'num_digits must be >= 1, got {self.num_digits}.')

  @property
  def prompt_len(self) -> int:
    return 1 + self.num_digits + 1  # BOS, digits, '='

  @property
  def max_answer_len(self) -> int:
    return self.num_digits

  def sample_problems(self, rng: np.random.Generator, n: int) -> list[str]:
    digits_ND = rng.integers(0, 10, size=(n, self.num_digits))
    return [''.join(map(str, row)) + '=' for row in digits_ND.tolist()]

  def solve(self, problem: str) -> str:
    return ''.join(sorted(problem.rstrip('=')))
