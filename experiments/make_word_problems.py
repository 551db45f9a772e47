"""Writes the word-problem dataset and its BPE tokenizer (configs/tiny_dataset.py).

  python -m experiments.make_word_problems [--out_dir=data/word_problems]

Writes OUT/train.jsonl and OUT/eval.jsonl in GSM8K's layout ({"question",
"answer": "... #### 12"}) and OUT/tokenizer.json + OUT/tokenizer_config.json,
a byte-level BPE trained on their text (foremoe_jax/tasks/word_problems.py).
"""
import json

from absl import flags

from foremoe_jax.tasks import word_problems
from foremoe_jax.utils import cli
from foremoe_jax.utils.run_info import print_run_info

_OUT_DIR = flags.DEFINE_string('out_dir', 'data/word_problems',
                               'Output directory.')
_NUM_TRAIN = flags.DEFINE_integer('num_train', 4000, 'Training records.')
_NUM_EVAL = flags.DEFINE_integer('num_eval', 256, 'Held-out records.')
_VOCAB = flags.DEFINE_integer('vocab_size', 512, 'BPE vocabulary size.')
_SEED = flags.DEFINE_integer('seed', 0, 'Generator seed.')
_FACTS = flags.DEFINE_integer(
    'context_facts', 0, 'Long-context problems: the first fact hidden among '
    'this many facts about other names (raise task_kwargs.max_prompt_len: '
    'about 5 tokens a fact).')


def main(argv):
  del argv
  run = dict(out_dir=_OUT_DIR.value, num_train=_NUM_TRAIN.value,
             num_eval=_NUM_EVAL.value, vocab_size=_VOCAB.value,
             seed=_SEED.value, context_facts=_FACTS.value)
  print_run_info(run)
  paths = word_problems.make_dataset(
      _OUT_DIR.value, num_train=_NUM_TRAIN.value, num_eval=_NUM_EVAL.value,
      seed=_SEED.value, vocab_size=_VOCAB.value,
      context_facts=_FACTS.value)
  print(json.dumps(paths), flush=True)


if __name__ == '__main__':
  cli.run(main)
