"""The real-size configs are complete RL configs, and their smoke variants
differ from them in exactly the fields their docstrings list.

The configs' files are read where the configs name them: each test that
needs files changes into a folder laid out as the repository root after
`make_word_problems` and a GSM8K download (small generated records, GSM8K's
Parquet names, a tokenizer with a chat template as a chat checkpoint ships).
A smoke *run* takes minutes (WORKSPACE.md, "Running the real-size
configs"), so none runs here.
"""
import importlib
import json
import os
import shutil

import ml_collections
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from absl import flags
from ml_collections import config_flags

from configs import _real_rl
from foremoe_jax import config as config_lib
from foremoe_jax.tasks import task_from_config, word_problems

# Each config and the device count of the cluster its docstring names.
CLUSTERS = {'qwen3_30b_a3b': 64, 'deepseek_v3_like': 64, 'mixtral_8x7b': 64,
            'olmoe_1b_7b': 8}
MODULES = {n: importlib.import_module(f'configs.{n}') for n in CLUSTERS}
# A chat template that shows whether Qwen3's `enable_thinking` reached it.
CHAT_TEMPLATE = ('{% for m in messages %}<{{ m.role }}>{{ m.content }}\n'
                 '{% endfor %}{% if add_generation_prompt %}<assistant>'
                 '{% if enable_thinking is defined and not enable_thinking %}'
                 '<no-think>{% endif %}{% endif %}')


def flat(c, prefix=''):
  """Dotted field -> value of a ConfigDict (tuples as lists, so a smoke
  config rebuilt from to_dict() compares equal)."""
  out = {}
  for k, v in c.items():
    if isinstance(v, ml_collections.ConfigDict):
      out.update(flat(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = list(v) if isinstance(v, tuple) else v
  return out


@pytest.fixture(scope='module')
def root(tmp_path_factory):
  """A repository root's data/ as the configs expect it, and a checkpoint
  directory holding only its tokenizer."""
  root = tmp_path_factory.mktemp('root')
  paths = word_problems.make_dataset(str(root / 'data' / 'word_problems'),
                                     num_train=64, num_eval=16, seed=0,
                                     vocab_size=512)
  for split, src in (('train', _real_rl.GSM8K_TRAIN),
                     ('eval', _real_rl.GSM8K_TEST)):
    dst = root / src
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(paths[split]) as f:
      rows = [json.loads(line) for line in f]
    pq.write_table(pa.Table.from_pylist(rows), str(dst))
  ckpt = root / 'checkpoint'
  ckpt.mkdir()
  shutil.copy(paths['tokenizer'], ckpt / 'tokenizer.json')
  with open(paths['tokenizer_config']) as f:
    tok_cfg = json.load(f)
  (ckpt / 'tokenizer_config.json').write_text(
      json.dumps(dict(tok_cfg, chat_template=CHAT_TEMPLATE)))
  return root


@pytest.mark.parametrize('name', CLUSTERS)
def test_full_config_validates_as_shipped(name):
  # No tokenizer named yet (init_from_hf and tokenizer_path empty): the
  # shape and planning tools read the config without any files.
  config_lib.validate_config(MODULES[name].get_config())


@pytest.mark.parametrize('name', CLUSTERS)
def test_full_config_task_reads_gsm8k_layout(name, root, monkeypatch):
  monkeypatch.chdir(root)
  c = MODULES[name].get_config()
  c.task_kwargs.tokenizer_path = str(root / 'checkpoint')
  config_lib.validate_config(c)
  task = task_from_config(c)
  text = task.decode(task.eval_prompts(1, c.seed)[0])
  question = json.loads(open(root / 'data/word_problems/eval.jsonl')
                        .readline())['question']
  # The question inside verl's GSM8K instruction, as the chat's user turn;
  # Qwen3's thinking switch reaches the checkpoint's template.
  assert text.startswith(f'<user>{question} Let\'s think step by step')
  assert 'after "####".\n<assistant>' in text
  assert text.endswith('<no-think>') == (name == 'qwen3_30b_a3b')


def test_a_named_tokenizer_without_the_data_is_one_config_error(root,
                                                                 tmp_path,
                                                                 monkeypatch):
  monkeypatch.chdir(tmp_path)  # No data/ here.
  c = MODULES['qwen3_30b_a3b'].get_config()
  c.task_kwargs.tokenizer_path = str(root / 'checkpoint')
  with pytest.raises(config_lib.ConfigError,
                     match=r'task_kwargs: dataset file .*gsm8k.* not exist'):
    config_lib.validate_config(c)


@pytest.mark.parametrize('name', CLUSTERS)
def test_smoke_config_validates_as_shipped(name, root, monkeypatch):
  monkeypatch.chdir(root)
  c = MODULES[name].get_config('smoke')
  config_lib.validate_config(c)
  assert c.model.num_layers == 1
  assert c.model.dtype == c.model.param_dtype == 'float32'
  assert c.parallel.num_data * c.parallel.num_expert == 8  # Simulated CPUs.


# The sections of a run; tiny.py's other sections (msa_distill) are for
# MSA models only and optional (`config.get`).
RUN_SECTIONS = ('model', 'parallel', 'warmstart', 'sampler', 'rl', 'planner',
                'transfer')


@pytest.mark.parametrize('variant', _real_rl.VARIANTS)
@pytest.mark.parametrize('name', CLUSTERS)
def test_every_field_of_a_run_is_set(name, variant):
  """Every top-level field and run-section field configs/tiny.py sets (the
  complete CPU run) and every dataset-task field of configs/tiny_dataset.py
  exists here."""
  tiny = flat(importlib.import_module('configs.tiny').get_config())
  dataset = flat(importlib.import_module('configs.tiny_dataset').get_config())
  got = flat(MODULES[name].get_config(variant))
  need = {k for k in tiny if '.' not in k or k.split('.')[0] in RUN_SECTIONS}
  need |= {k for k in dataset if k.startswith('task_kwargs.')}
  assert not need - set(got), sorted(need - set(got))
  assert got['task'] == 'dataset'
  assert got['warmstart.steps'] == 0  # A pretrained checkpoint.


@pytest.mark.parametrize('name', CLUSTERS)
def test_mesh_is_the_named_cluster(name):
  module, devices = MODULES[name], CLUSTERS[name]
  c = module.get_config()
  p = c.parallel
  assert p.num_data * p.num_expert == devices
  assert f'= {devices} devices' in module.__doc__
  # The planner's nodes split the EP ring evenly; every expert has a home.
  assert p.num_expert % c.planner.num_nodes == 0
  assert p.slots_per_device * p.num_expert >= c.model.num_experts
  assert c.transfer.step_rounds == p.num_expert


@pytest.mark.parametrize('name', CLUSTERS)
def test_smoke_differs_only_in_the_documented_fields(name):
  module = MODULES[name]
  full, smoke = (flat(module.get_config(v)) for v in _real_rl.VARIANTS)
  assert set(full) == set(smoke)
  changed = {k for k in full if full[k] != smoke[k]}
  documented = set(_real_rl.SMOKE_COMMON) | set(module.SMOKE_REDUCED)
  assert changed == documented, (
      f'changed but not documented: {sorted(changed - documented)}; '
      f'documented but unchanged: {sorted(documented - changed)}')
  for field in module.SMOKE_REDUCED:
    assert f'`{field}`' in module.__doc__, field
  for field in _real_rl.SMOKE_COMMON:
    assert f'`{field}`' in _real_rl.__doc__, field


def test_config_flags_take_the_variant_and_overrides():
  path = os.path.join(os.path.dirname(_real_rl.__file__), 'qwen3_30b_a3b.py')
  argv = ['prog', f'--config={path}:smoke', '--config.rl.steps=3']
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file('config', flag_values=fv, sys_argv=argv)
  fv(argv)
  assert fv.config.model.num_layers == 1 and fv.config.rl.steps == 3
  with pytest.raises(ValueError, match="variant 'tiny'"):
    MODULES['qwen3_30b_a3b'].get_config('tiny')


# The families' published config.json fields that set the architecture
# (huggingface.co: mistralai/Mixtral-8x7B-v0.1, allenai/OLMoE-1B-7B-0924,
# Qwen/Qwen3-30B-A3B).
PUBLISHED_HF_CONFIGS = {
    'mixtral_8x7b': dict(
        model_type='mixtral', hidden_size=4096, intermediate_size=14336,
        max_position_embeddings=32768, num_attention_heads=32,
        num_experts_per_tok=2, num_hidden_layers=32, num_key_value_heads=8,
        num_local_experts=8, rms_norm_eps=1e-05, rope_theta=1e6,
        tie_word_embeddings=False, vocab_size=32000),
    'olmoe_1b_7b': dict(
        model_type='olmoe', hidden_size=2048, intermediate_size=1024,
        max_position_embeddings=4096, norm_topk_prob=False,
        num_attention_heads=16, num_experts=64, num_experts_per_tok=8,
        num_hidden_layers=16, num_key_value_heads=16, rms_norm_eps=1e-05,
        rope_theta=10000.0, tie_word_embeddings=False, vocab_size=50304),
    'qwen3_30b_a3b': dict(
        model_type='qwen3_moe', head_dim=128, hidden_size=2048,
        intermediate_size=6144, max_position_embeddings=40960,
        moe_intermediate_size=768, norm_topk_prob=True,
        num_attention_heads=32, num_experts=128, num_experts_per_tok=8,
        num_hidden_layers=48, num_key_value_heads=4, rms_norm_eps=1e-06,
        rope_theta=1e6, tie_word_embeddings=False, vocab_size=151936,
        decoder_sparse_step=1, mlp_only_layers=[]),
}


@pytest.mark.parametrize('name', sorted(PUBLISHED_HF_CONFIGS))
def test_family_config_matches_the_published_hf_config(name):
  """Each architecture field of a family's config is what its checkpoint's
  config.json says (read by the importer, which a random-init run and an
  export skip): Mixtral and OLMoE had the default norm eps 1e-6, not 1e-5."""
  from foremoe_jax.hf import convert, families  # pylint: disable=g-import-not-at-top
  ours = MODULES[name].model_config()
  theirs = families.model_config_from_hf(PUBLISHED_HF_CONFIGS[name], ours)
  diff = {f: (ours.get(f), theirs.get(f))
          for f in convert.ARCH_FIELDS + ('max_seq_len',)
          if ours.get(f) != theirs.get(f)}
  assert not diff, diff
