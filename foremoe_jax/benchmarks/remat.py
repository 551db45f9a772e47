"""What each `model.remat_policy` keeps: compiled memory and the gradients.

For one model config, the loss-and-gradient step of the transformer
(next-token cross-entropy, expert-parallel on the given mesh) is compiled
under every policy. Reported per policy: XLA's memory analysis of the
compiled step (temporaries are where saved activations live) and the
largest gradient difference from the 'none' policy, which must be zero up
to float reassociation: remat changes what is stored, never the numbers.
It also reports the bytes the forward pass saves for the backward pass,
which is what a policy changes: the leaves of the pullback `jax.vjp`
returns, read while the step is traced, so one trace gives both the
compiled step and its residuals (the same account as
`jax.ad_checkpoint.print_saved_residuals`, which would trace the model a
second time).
"""
from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.ad_checkpoint  # pylint: disable=unused-import
import jax.numpy as jnp
import numpy as np
from flax import nnx

from foremoe_jax import config as config_lib
from foremoe_jax.model import sharding, transformer


def loss_fn(model_cfg, mesh, tokens_BT):
  """(params, params -> loss) of the model with `model_cfg`."""
  model = transformer.Transformer(model_cfg, mesh, rngs=nnx.Rngs(0))
  graphdef, params = sharding.split_model(model, mesh)

  def loss(params):
    logits, aux, _ = nnx.merge(graphdef, params)(tokens_BT[:, :-1])
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, tokens_BT[:, 1:, None], axis=-1)
    return nll.mean() + aux.indexer_loss

  return params, loss


def saved_residual_bytes(model_cfg, mesh, tokens_BT) -> int:
  """Bytes the forward pass keeps for the backward pass under the policy
  (jax's own account of the residuals, whatever the backend's allocator
  then does with them)."""
  return _residual_bytes(*loss_fn(model_cfg, mesh, tokens_BT))


def _residual_bytes(params, loss) -> int:
  # print_saved_residuals is the public API: one 'f32[16,32,64] <source>'
  # line per residual.
  text = io.StringIO()
  with contextlib.redirect_stdout(text):
    jax.ad_checkpoint.print_saved_residuals(loss, params)
  total = 0
  for line in text.getvalue().splitlines():
    m = re.match(r'([a-z]+)(\d*)\[([\d,]*)\]', line.strip())
    if m:
      bits = int(m.group(2)) if m.group(2) else 8
      dims = [int(d) for d in m.group(3).split(',') if d]
      total += int(np.prod(dims)) * max(bits // 8, 1)
  return total


def report(model_cfg, mesh, tokens_BT) -> dict:
  """{policy: {temp_bytes, argument_bytes, output_bytes,
  saved_residual_bytes, loss, grad_max_abs_diff_vs_none}} for every policy.

  temp_bytes is XLA's memory analysis of the compiled step. On XLA:CPU it
  does not fall with remat (measured: an 8-layer tanh MLP, 80 MB of temps
  without jax.checkpoint and 136 MB with it: its buffer assignment does not
  reuse the recompute's buffers), so saved_residual_bytes, what the forward
  keeps for the backward, is the backend-independent account.
  """
  out, ref = {}, None
  for policy in config_lib.REMAT_POLICIES:
    cfg = model_cfg.copy_and_resolve_references()
    cfg.remat_policy = policy
    params, loss_of = loss_fn(cfg, mesh, tokens_BT)
    residuals = []

    def loss_and_grad(params, loss_of=loss_of, residuals=residuals):
      loss, pullback = jax.vjp(loss_of, params)
      # The pullback is a pytree whose leaves are what the forward keeps
      # for the backward: their shapes are known here, at trace time.
      residuals.extend(jax.tree.leaves(pullback))
      (grads,) = pullback(jnp.ones_like(loss))
      return loss, grads

    compiled = jax.jit(loss_and_grad).lower(params).compile()
    mem = compiled.memory_analysis()
    loss, grads = compiled(params)
    grads = [np.asarray(g) for g in jax.tree.leaves(grads)]
    if ref is None:
      ref = grads
    diff = max(float(np.abs(a - b).max()) for a, b in zip(grads, ref))
    out[policy] = dict(
        temp_bytes=int(getattr(mem, 'temp_size_in_bytes', -1)),
        argument_bytes=int(getattr(mem, 'argument_size_in_bytes', -1)),
        output_bytes=int(getattr(mem, 'output_size_in_bytes', -1)),
        saved_residual_bytes=sum(int(r.size) * r.dtype.itemsize
                                 for r in residuals),
        loss=float(loss), grad_max_abs_diff_vs_none=diff)
  return out
