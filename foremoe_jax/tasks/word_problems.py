"""A generated dataset of arithmetic word problems, and a BPE tokenizer for it.

The stand-in for GSM8K on CPU: `make_dataset` writes train/eval JSONL files in
GSM8K's layout ({"question": ..., "answer": "<working> #### <number>"}) and
trains a small byte-level BPE `tokenizer.json` on their text with the Hugging
Face `tokenizers` library, so `DatasetTask` runs on it exactly as it would on
real files and a real checkpoint's tokenizer (configs/tiny_dataset.py;
`python -m experiments.make_word_problems`).

Problems are one operation on small numbers ("Ana has 7 pears. She buys 5
more. How many pears does Ana have now?" -> 12), so a tiny model can learn
them in a few hundred warm-start steps.
"""
from __future__ import annotations

import json
import os

import numpy as np

NAMES = ('Ana', 'Ben', 'Cleo', 'Dev', 'Eli', 'Fay', 'Gus', 'Ivy', 'Jon', 'Kai',
         'Lea', 'Max', 'Nia', 'Oz', 'Pam', 'Raj')
ITEMS = ('apples', 'pears', 'books', 'coins', 'cards', 'shells', 'pens',
         'stamps', 'marbles', 'plums')
# (template, operation); a and b are drawn so every answer is >= 0.
_TEMPLATES = (
    ('{n} has {a} {x}. {n} buys {b} more. How many {x} does {n} have now?',
     '+'),
    ('{n} has {a} {x} and finds {b} more. How many {x} does {n} have?', '+'),
    ('{n} has {a} {x}. {n} gives away {b}. How many {x} are left?', '-'),
    ('{n} had {a} {x} and lost {b} of them. How many {x} does {n} have?',
     '-'),
    ('{n} fills {a} boxes with {b} {x} each. How many {x} is that?', '*'),
)
SPECIAL_TOKENS = ('<pad>', '<s>', '</s>')


def generate(rng: np.random.Generator, n: int, max_operand: int = 12
             ) -> list[dict[str, str]]:
  """n records {"question", "answer"}; answer = "<a> op <b> = <r> #### <r>"."""
  out = []
  for _ in range(n):
    template, op = _TEMPLATES[rng.integers(len(_TEMPLATES))]
    a, b = (int(v) for v in rng.integers(1, max_operand + 1, 2))
    if op == '-' and b > a:
      a, b = b, a
    result = {'+': a + b, '-': a - b, '*': a * b}[op]
    question = template.format(n=NAMES[rng.integers(len(NAMES))],
                               x=ITEMS[rng.integers(len(ITEMS))], a=a, b=b)
    out.append(dict(question=question,
                    answer=f'{a} {op} {b} = {result} #### {result}'))
  return out


def write_jsonl(path: str, records) -> None:
  with open(path, 'w', encoding='utf-8') as f:
    for r in records:
      f.write(json.dumps(r) + '\n')


def train_bpe_tokenizer(texts, vocab_size: int):
  """A byte-level BPE `tokenizers.Tokenizer` trained on texts, with
  <pad>, <s> and </s> as its first ids."""
  # Imported here: only dataset generation trains a tokenizer.
  from tokenizers import (  # pylint: disable=g-import-not-at-top
      Tokenizer, decoders, models, pre_tokenizers, trainers)
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False)
  tok.train_from_iterator(texts, trainer)
  return tok


def make_dataset(out_dir: str, *, num_train: int = 4000, num_eval: int = 256,
                 seed: int = 0, vocab_size: int = 320) -> dict[str, str]:
  """Writes train.jsonl, eval.jsonl, tokenizer.json and tokenizer_config.json
  into out_dir; returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  rng = np.random.default_rng(seed)
  train, evals = generate(rng, num_train), generate(rng, num_eval)
  paths = {k: os.path.join(out_dir, f) for k, f in (
      ('train', 'train.jsonl'), ('eval', 'eval.jsonl'),
      ('tokenizer', 'tokenizer.json'),
      ('tokenizer_config', 'tokenizer_config.json'))}
  write_jsonl(paths['train'], train)
  write_jsonl(paths['eval'], evals)
  tok = train_bpe_tokenizer(
      [r[k] for r in train for k in ('question', 'answer')], vocab_size)
  tok.save(paths['tokenizer'])
  pad, bos, eos = SPECIAL_TOKENS
  with open(paths['tokenizer_config'], 'w', encoding='utf-8') as f:
    json.dump(dict(pad_token=pad, bos_token=bos, eos_token=eos), f, indent=1)
  return paths
