"""Character tokenizer shared by the verifiable tasks.

Sits at the very start of the data flow: tasks turn problem strings into the
int32 prompt ids the sampler consumes, and generated ids back into text for
rewards and logs. Ids 0..2 are reserved for PAD, BOS and EOS in every task, so
the sampler and the loss can treat them uniformly; each task then adds its own
small character alphabet.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
NUM_SPECIAL = 3


class CharTokenizer:
  """Maps each character of a fixed alphabet to one id, after PAD/BOS/EOS."""

  def __init__(self, alphabet: str):
    if len(set(alphabet)) != len(alphabet):
      raise ValueError(f'alphabet {alphabet!r} repeats a character.')
    self.alphabet = alphabet
    self._char_to_id = {c: NUM_SPECIAL + i for i, c in enumerate(alphabet)}

  @property
  def vocab_size(self) -> int:
    return NUM_SPECIAL + len(self.alphabet)

  def encode(self, text: str) -> list[int]:
    try:
      return [self._char_to_id[c] for c in text]
    except KeyError as err:
      raise ValueError(f'{text!r} holds a character outside the alphabet '
                       f'{self.alphabet!r}.') from err

  def decode(self, ids: Sequence[int] | np.ndarray, stop_at_eos: bool = True
             ) -> str:
    """Text of `ids`; PAD and BOS are dropped, EOS ends the text.

    With stop_at_eos=False, EOS is rendered as '$' so logs show what the model
    produced after it.
    """
    out = []
    for i in np.asarray(ids).reshape(-1).tolist():
      if i == EOS_ID:
        if stop_at_eos:
          break
        out.append('$')
      elif i in (PAD_ID, BOS_ID):
        continue
      elif NUM_SPECIAL <= i < self.vocab_size:
        out.append(self.alphabet[i - NUM_SPECIAL])
      else:
        out.append('?')  # An id outside the vocabulary: show, don't crash.
    return ''.join(out)
