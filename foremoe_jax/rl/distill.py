"""MSA indexer distillation: the phase between the warm start and RL.

A model that was trained with dense attention (a Hugging Face checkpoint, or
our own warm start) becomes an MSA model in three steps (docs/design.md
§6.11): its index branches start from the layers' own q/k projections
(foremoe_jax/hf/msa_init.py), then they alone train toward the dense
attention of their layer, then RL runs with sparse attention on. This
module is the middle step.

During it the model runs with `model.msa_indexer_kl = 'dense'`: every MSA
layer computes dense attention (the model's outputs are exactly the dense
model's, whatever the index branch does) and a KL from that attention over
every causal key to the index branch's distribution, with q, k and the
layer input detached (pallas_kernels/msa/distill.py). Only the index
branch's parameters (`INDEX_PARAMS`) get gradients and optimizer moments;
everything else is a constant of the step, so the phase costs a forward,
the index branch's backward and Adam moments for ~1% of the parameters.

What it reports is what sparse attention will keep: the recall, the share
of each query's dense attention mass inside the blocks its index branch
selects, over all queries and over the `far` ones that see more than top_k
blocks (the others select all they see). Both are measured on a held-out
batch before the first step and after the last (summary.json), and per
logging step on the training batch (distill.jsonl, TensorBoard).

Data: the task's warm-start sequences (prompt + reference answer + EOS;
the PADs before and after are masked), evaluated on the task's held-out
ones (a dataset's eval records), or a plain text file cut into max_seq_len
windows (the last tenth held out for the evaluation).

Shape letters: B batch, T tokens, L MSA layers.
"""
from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from foremoe_jax.model import transformer
from foremoe_jax.rollout import sampler as sampler_lib
from foremoe_jax.utils import distributed
from foremoe_jax.utils import metrics as metrics_lib

DISTILL_FILE = 'distill.jsonl'
SUMMARY_FILE = 'msa_distill.json'
# The index branch's leaves (model/attention.py); nothing else trains here.
INDEX_PARAMS = ('qi_proj', 'ki_proj', 'qi_norm', 'ki_norm')


def is_index_param(path, _) -> bool:
  return any(name in path for name in INDEX_PARAMS)


def split_params(params: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(index-branch leaves, every other leaf) of a parameter State."""
  return nnx.split_state(params, is_index_param, ...)


def distill_graphdef(config, mesh):
  """The graphdef of config.model in distillation mode (same parameters as
  the training model's, dense attention, dense-target KL and recall)."""
  m = ml_collections.ConfigDict(config.model.to_dict())
  m.msa_indexer_kl = 'dense'
  m.msa_indexer_warmup = False
  abstract = nnx.eval_shape(lambda: transformer.Transformer(
      m, mesh, dispatch=config.parallel.dispatch, rngs=nnx.Rngs(0)))
  return nnx.split(abstract)[0]


def _stats(graphdef, index_params, rest_params, tokens_BT, valid_BT):
  """(KL, ModelAux) of one batch, every valid position weighted equally."""
  w_BT = valid_BT.astype(jnp.float32)
  w_BT = w_BT / jnp.maximum(w_BT.sum(), 1.0)
  model = nnx.merge(graphdef, index_params, rest_params)
  _, aux, _ = model(tokens_BT, valid_BT=valid_BT, indexer_weight_BT=w_BT,
                    return_hidden=True)
  return aux.indexer_loss, aux


def _metrics(kl, aux) -> dict:
  d = aux.indexer_distill
  return dict(kl=kl, recall=jnp.mean(d.recall),
              recall_far=jnp.nanmean(d.recall_far),
              recall_far_oracle=jnp.nanmean(d.recall_far_oracle),
              recall_L=d.recall)


def make_distill_step(graphdef, tx: optax.GradientTransformation):
  """(index params, opt state, rest params, tokens, valid) -> (index params,
  opt state, metrics); the metrics are the batch's before the update."""

  def step(index_params, opt_state, rest_params, tokens_BT, valid_BT):
    (kl, aux), grads = jax.value_and_grad(
        lambda ip: _stats(graphdef, ip, rest_params, tokens_BT, valid_BT),
        has_aux=True)(index_params)
    updates, opt_state = tx.update(grads, opt_state, index_params)
    return (optax.apply_updates(index_params, updates), opt_state,
            _metrics(kl, aux))

  return jax.jit(step, donate_argnums=(0, 1))


def make_distill_eval(graphdef):
  return jax.jit(lambda ip, rp, tokens_BT, valid_BT: _metrics(
      *_stats(graphdef, ip, rp, tokens_BT, valid_BT)))


class TextWindows:
  """Random max_seq_len windows of a tokenised text file (no PADs)."""

  source = 'the last tenth of the text file'

  def __init__(self, path: str, tokenizer, seq_len: int):
    with open(path, encoding='utf-8') as f:
      text = f.read()
    try:
      ids = np.asarray(tokenizer.encode(text), np.int32)
    except (KeyError, ValueError) as e:
      raise ValueError(f'msa_distill.text_file: {path} cannot be tokenised by '
                       f"the task's tokenizer: {str(e)[-200:]}") from None
    held = max(seq_len, len(ids) // 10)
    if len(ids) < seq_len + held:
      raise ValueError(f'msa_distill.text_file: {path} has {len(ids)} tokens; '
                       f'needs at least 2 windows ({2 * seq_len}): one '
                       f'window to train on and one held out')
    self.train_ids, self.eval_ids = ids[:-held], ids[-held:]
    self.seq_len = seq_len

  def _windows(self, ids, rng, n):
    starts = rng.integers(0, len(ids) - self.seq_len + 1, n)
    tokens = np.stack([ids[s:s + self.seq_len] for s in starts])
    return tokens, np.ones(tokens.shape, bool)

  def train_batch(self, rng, n):
    return self._windows(self.train_ids, rng, n)

  def eval_batch(self, rng, n):
    return self._windows(self.eval_ids, rng, n)


class TaskSequences:
  """The task's warm-start sequences. The evaluation batch is the task's
  held-out one (`Task.heldout_supervised_batch`: a dataset's eval records,
  a generated task's draws from their own generator), so it moves no
  training draw and, for a dataset, is never trained on."""

  def __init__(self, task):
    self.task = task
    self.source = task.heldout_source

  def _valid(self, tokens, mask):
    # From the first real prompt token (left PADs hidden) to the last
    # target (EOS): the PADs after it are no text of the sequence.
    upto_BT = np.cumsum(mask[:, ::-1] > 0, axis=1)[:, ::-1] > 0
    return sampler_lib.prompt_valid(tokens, self.task.pad_id) & upto_BT

  def train_batch(self, rng, n):
    tokens, mask = self.task.supervised_batch(rng, n)
    return tokens, self._valid(tokens, mask)

  def eval_batch(self, rng, n):
    tokens, mask = self.task.heldout_supervised_batch(rng, n)
    return tokens, self._valid(tokens, mask)


def window_len(config) -> int:
  """Tokens per text-file window: msa_distill.seq_len, else the model's
  max_seq_len."""
  return config.msa_distill.get('seq_len', 0) or config.model.max_seq_len


def data_source(dcfg, task, seq_len: int):
  if dcfg.get('text_file', ''):
    return TextWindows(dcfg.text_file, task.tokenizer, seq_len)
  return TaskSequences(task)


def _host(m: dict) -> dict:
  m = distributed.to_host(m)
  out = {k: float(v) for k, v in m.items() if k != 'recall_L'}
  out.update({f'recall_layer{i}': float(r)
              for i, r in enumerate(np.asarray(m['recall_L']))})
  return out


def run(config, task, graphdef, params, mesh, workdir: str, rng, *,
        guard_stop=lambda: False, tb=None):
  """Distils every MSA layer's index branch; returns (params, summary) with
  params the full State (index leaves trained, the rest untouched), or
  (None, None) when `guard_stop()` asks to stop first.

  summary: msa_recall_before/after, msa_recall_far_before/after,
  msa_recall_far_oracle (the best top_k blocks could keep: a property of
  the model and the block budget, not of the indexer),
  msa_distill_kl_before/after (held-out batch), msa_distill_s.
  """
  dcfg = config.msa_distill
  dgraph = distill_graphdef(config, mesh)
  index_params, rest_params = split_params(params)
  # The step donates its index parameters; the caller's stay valid.
  index_params = jax.tree.map(jnp.copy, index_params)
  tx = optax.adam(dcfg.learning_rate)
  opt_state = jax.tree.map(
      lambda x: x if isinstance(getattr(x, 'sharding', None),
                                jax.sharding.NamedSharding)
      else jax.device_put(x, jax.sharding.NamedSharding(
          mesh, jax.sharding.PartitionSpec())), tx.init(index_params))
  step_fn = make_distill_step(dgraph, tx)
  eval_fn = make_distill_eval(dgraph)
  source = data_source(dcfg, task, window_len(config))
  # The held-out batch: its own generator (and no data stream), so the
  # training draws (and a resumed run's) do not depend on whether it was
  # drawn.
  eval_rng = np.random.default_rng([config.seed, 7_001])
  put = lambda tree: distributed.global_arrays(tree, mesh)
  summary = {}
  if dcfg.eval_sequences:
    summary['msa_distill_eval_source'] = source.source
    eval_batch = put(source.eval_batch(eval_rng, dcfg.eval_sequences))
    before = _host(eval_fn(index_params, rest_params, *eval_batch))
    summary.update(msa_recall_before=before['recall'],
                   msa_recall_far_before=before['recall_far'],
                   msa_recall_far_oracle=before['recall_far_oracle'],
                   msa_distill_kl_before=before['kl'])
    _print(f"msa distill: evaluated on {source.source}")
    _print(f"msa distill: held-out recall {before['recall']:.3f} (far "
           f"{before['recall_far']:.3f}; the best {config.model.msa_top_k} "
           f"blocks would keep {before['recall_far_oracle']:.3f}), KL "
           f"{before['kl']:.4f} before")
  t0 = time.perf_counter()
  # A run stopped mid-phase reruns it whole (its checkpoint is the warm
  # start's): the earlier attempt's records go.
  metrics_lib.truncate_after(os.path.join(workdir, DISTILL_FILE), 0)
  with metrics_lib.MetricsWriter(workdir, DISTILL_FILE, mirror=tb) as writer:
    for i in range(dcfg.steps):
      if guard_stop():
        return None, None
      batch = put(source.train_batch(rng, dcfg.batch_size))
      index_params, opt_state, m = distributed.settle(
          step_fn(index_params, opt_state, rest_params, *batch))
      if (i + 1) % dcfg.log_every == 0 or i + 1 == dcfg.steps or i == 0:
        m = _host(m)
        writer.write(i + 1, dict(phase='msa_distill',
                                 elapsed_s=time.perf_counter() - t0, **m))
        _print(f"msa distill {i + 1:4d}/{dcfg.steps} | KL {m['kl']:.4f} | "
               f"recall {m['recall']:.3f} (far {m['recall_far']:.3f}) | "
               f"{time.perf_counter() - t0:.1f}s")
  summary['msa_distill_s'] = time.perf_counter() - t0
  if dcfg.eval_sequences:
    after = _host(eval_fn(index_params, rest_params, *eval_batch))
    summary.update(msa_recall_after=after['recall'],
                   msa_recall_far_after=after['recall_far'],
                   msa_distill_kl_after=after['kl'])
    _print(f"msa distill: held-out recall {after['recall']:.3f} (far "
           f"{after['recall_far']:.3f}), KL {after['kl']:.4f} after")
  return nnx.merge_state(index_params, rest_params), summary


def _print(line: str) -> None:
  if distributed.is_primary():
    print(line, flush=True)
