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

With `context_facts=N` a problem becomes a long-context retrieval: its
first fact ("Ana has 7 pears.") sits at a random place among N facts about
other people ("Ben has 3 coins."), and the rest of the problem follows them
("Ana buys 5 more. How many pears does Ana have now?"). The answer needs
the one fact whose name matches, wherever it is: a few far tokens among
many, the long-context case sparse attention (MSA) is for
(experiments/msa_from_dense.py).
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
# The same five problems with the first fact split off, for context_facts:
# (fact, rest of the problem, operation).
_SPLIT_TEMPLATES = (
    ('{n} has {a} {x}.', '{n} buys {b} more. How many {x} does {n} have now?',
     '+'),
    ('{n} has {a} {x}.', '{n} finds {b} more. How many {x} does {n} have?',
     '+'),
    ('{n} has {a} {x}.', '{n} gives away {b}. How many {x} are left?', '-'),
    ('{n} has {a} {x}.', '{n} lost {b} of them. How many {x} does {n} have?',
     '-'),
    ('{n} has {a} boxes.', '{n} puts {b} {x} in each box. How many {x} is '
     'that?', '*'),
)
SPECIAL_TOKENS = ('<pad>', '<s>', '</s>')


def generate(rng: np.random.Generator, n: int, max_operand: int = 12,
             context_facts: int = 0) -> list[dict[str, str]]:
  """n records {"question", "answer"}; answer = "<a> op <b> = <r> #### <r>".

  context_facts > 0: the problem's first fact hides among that many facts
  about other names (module docstring)."""
  if context_facts < 0:
    raise ValueError(f'context_facts must be >= 0, got {context_facts}.')
  templates = _SPLIT_TEMPLATES if context_facts else _TEMPLATES
  out = []
  for _ in range(n):
    template = templates[rng.integers(len(templates))]
    op = template[-1]
    a, b = (int(v) for v in rng.integers(1, max_operand + 1, 2))
    if op == '-' and b > a:
      a, b = b, a
    result = {'+': a + b, '-': a - b, '*': a * b}[op]
    name = NAMES[rng.integers(len(NAMES))]
    fill = dict(n=name, x=ITEMS[rng.integers(len(ITEMS))], a=a, b=b)
    if context_facts:
      others = [m for m in NAMES if m != name]
      facts = [f'{others[rng.integers(len(others))]} has '
               f'{int(rng.integers(1, max_operand + 1))} '
               f'{ITEMS[rng.integers(len(ITEMS))]}.'
               for _ in range(context_facts)]
      facts.insert(int(rng.integers(context_facts + 1)),
                   template[0].format(**fill))
      question = ' '.join(facts + [template[1].format(**fill)])
    else:
      question = template[0].format(**fill)
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
                 seed: int = 0, vocab_size: int = 320,
                 context_facts: int = 0) -> dict[str, str]:
  """Writes train.jsonl, eval.jsonl, tokenizer.json and tokenizer_config.json
  into out_dir; returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  rng = np.random.default_rng(seed)
  train = generate(rng, num_train, context_facts=context_facts)
  evals = generate(rng, num_eval, context_facts=context_facts)
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
