"""CompileLog sees every XLA compile, by function name, and only while open."""
import jax
import jax.numpy as jnp

from foremoe_jax.utils import compiles


def test_counts_compiles_by_name_and_forgets_on_exit():
  @jax.jit
  def update(x, *, n):
    return x * n

  f = jax.jit(update.__wrapped__, static_argnames='n')
  with compiles.CompileLog() as log:
    f(jnp.ones(3), n=2).block_until_ready()
    f(jnp.ones(3), n=2).block_until_ready()  # Cached: no compile.
    f(jnp.ones(3), n=3).block_until_ready()  # A new static value: one more.
    assert log.count('update') == 2
    assert [c.fun_name for c in log.take()].count('update') == 2
    assert log.take() == []
    assert log.seconds('update') > 0
  f(jnp.ones(3), n=4).block_until_ready()
  assert log.count('update') == 2  # Closed: no longer listening.
