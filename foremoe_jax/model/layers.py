"""Small building blocks of the decoder: RMSNorm, RoPE, SwiGLU MLP.

Mixed precision (WORKSPACE.md): every weight is cast to the compute dtype
`dtype` where it is used, so a float32 master copy computes exactly like its
bfloat16 cast; dtype None uses the weight as stored.

Shape letters: B batch, T tokens, H heads, D head dim, M model dim, F hidden.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype=jnp.float32,
               dtype=None, init: float = 1.0):
    self.scale = nnx.Param(jnp.full((dim,), init, param_dtype))
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    scale = self.scale[...]
    if self.dtype is not None:
      scale = scale.astype(self.dtype)
    return (x32 * rms * scale.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x_BTHD, positions_BT, theta: float):
  """Rotary embedding, half-split convention (as in Qwen/Llama checkpoints)."""
  half = x_BTHD.shape[-1] // 2
  freq_D = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle_BTD = positions_BT[..., None].astype(jnp.float32) * freq_D
  sin, cos = jnp.sin(angle_BTD)[:, :, None], jnp.cos(angle_BTD)[:, :, None]
  x1, x2 = jnp.split(x_BTHD.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHD.dtype)


def dense_init(fan_in: int):
  return nnx.initializers.normal(stddev=fan_in ** -0.5)


class SwiGLU(nnx.Module):
  """Dense SwiGLU FFN: the shared expert and the first dense layers."""

  def __init__(self, model_dim: int, hidden_dim: int, *, rngs: nnx.Rngs,
               param_dtype=jnp.float32, dtype=None):
    kw = dict(use_bias=False, param_dtype=param_dtype, dtype=dtype, rngs=rngs)
    self.gate = nnx.Linear(model_dim, hidden_dim,
                           kernel_init=dense_init(model_dim), **kw)
    self.up = nnx.Linear(model_dim, hidden_dim,
                         kernel_init=dense_init(model_dim), **kw)
    self.down = nnx.Linear(hidden_dim, model_dim,
                           kernel_init=dense_init(hidden_dim), **kw)

  def __call__(self, x_BTM):
    return self.down(jax.nn.silu(self.gate(x_BTM)) * self.up(x_BTM))
