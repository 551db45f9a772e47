"""Multi-digit addition: "12+34=" -> "46".

A verifiable task for the sampler and the GRPO verifier (see `base.Task`).
Operands are zero-padded to `num_digits` digits so every prompt has the same
length; the answer is written without leading zeros, so its length varies and
the model must learn where to put EOS.

With `reverse_answer` the answer's digits come least significant first
("12+39=" -> "15" for 51), so each digit depends only on digits already seen
plus one carry; small causal models learn this order far faster (Lee et al.
2023, "Teaching Arithmetic to Small Transformers"). Measured with a 2-layer
d=64 dense transformer, warm start at batch 64, greedy exact answers:
2 digits plain ~10% after 300 steps (~50% after 1000); 2 digits reversed
~76% after 300; 3 digits, either order, ~1-2% after 300.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from foremoe_jax.tasks.base import CharTask


@dataclasses.dataclass(frozen=True)
class AdditionTask(CharTask):
  """a + b with a, b uniform in [0, 10**num_digits)."""

  num_digits: int = 2
  partial_credit: float = 0.0
  reverse_answer: bool = False
  name: str = 'addition'
  alphabet: str = '0123456789+='

  def __post_init__(self):
    if self.num_digits < 1:
      raise ValueError(f'num_digits must be >= 1, got {self.num_digits}.')

  @property
  def prompt_len(self) -> int:
    return 1 + 2 * self.num_digits + 2  # BOS, a, '+', b, '='

  @property
  def max_answer_len(self) -> int:
    return self.num_digits + 1  # The carry out of the top digit.

  def sample_problems(self, rng: np.random.Generator, n: int) -> list[str]:
    k = self.num_digits
    a_N, b_N = rng.integers(0, 10**k, size=(2, n))
    return [f'{a:0{k}d}+{b:0{k}d}=' for a, b in zip(a_N.tolist(), b_N.tolist())]

  def solve(self, problem: str) -> str:
    a, b = problem.rstrip('=').split('+')
    answer = str(int(a) + int(b))
    return answer[::-1] if self.reverse_answer else answer
