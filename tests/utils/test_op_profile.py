"""The op profile: exclusive times of nested spans, categories, a real trace."""
import jax
import jax.numpy as jnp
import pytest

from foremoe_jax.model import grouped_swiglu
from foremoe_jax.utils import op_profile


def test_exclusive_seconds_subtracts_nested_spans_by_hand():
  # Thread 1: a while loop [0, 10) s holding two 3 s dots, then a 2 s copy.
  # Thread 2: one 4 s all-to-all. (ns)
  s = 10**9
  lines = [[(0, 10 * s, 'while.1'), (1 * s, 3 * s, 'dot.2'),
            (5 * s, 3 * s, 'dot.2'), (10 * s, 2 * s, 'copy.3')],
           [(0, 4 * s, 'all-to-all.4')]]
  excl, count = op_profile.exclusive_seconds(lines)
  assert excl == {'while.1': 4.0, 'dot.2': 6.0, 'copy.3': 2.0,
                  'all-to-all.4': 4.0}
  assert count['dot.2'] == 2
  b = op_profile.breakdown(excl, count, {'dot.2': 'jit(f)/grouped_swiglu/dot'})
  assert b['thread_seconds'] == 16.0
  assert b['shares'] == pytest.approx(dict(
      expert_ffn=6 / 16, matmul=0.0, collective=4 / 16, copy=2 / 16,
      other=4 / 16))
  assert b['top_ops'][0]['op'] == 'dot.2'


def test_categories():
  c = op_profile.category
  assert c('ynn_fusion.3') == 'matmul'
  assert c('ynn_fusion.3', 'jit(u)/transpose(jvp(grouped_swiglu))/dot') == (
      'expert_ffn')
  assert c('all-to-all.32') == c('Wait: pending_threads=1/8') == 'collective'
  assert c('dynamic-slice_bitcast_fusion.79') == 'copy'
  assert c('wrapped_broadcast.104') == 'copy'
  assert c('multiply_add_fusion') == 'other'
  assert c('while.908') == c('ThunkExecutor::Execute') == 'other'


def test_hlo_op_names():
  text = ('  %dot.1 = f32[2,2]{1,0} dot(%a, %b), metadata={op_name="jit(f)/'
          'grouped_swiglu/dot_general" source_file="x.py"}\n'
          '  ROOT %copy.2 = f32[2]{0} copy(%c), metadata={op_name="jit(f)/c"}\n')
  assert op_profile.hlo_op_names(text) == {
      'dot.1': 'jit(f)/grouped_swiglu/dot_general', 'copy.2': 'jit(f)/c'}


def test_a_traced_step_attributes_the_expert_swiglu(tmp_path):
  """A projection, then the grouped SwiGLU, differentiated: the trace's
  ops under the SwiGLU's scope (forward and backward) are expert_ffn, and
  they dominate at these sizes (12 x the projection's FLOPs).

  The trace is a few milliseconds, so one preempted copy on a loaded CI
  machine can move a share by 0.1: five calls are traced, and the test
  asserts an order between categories, not a share fixed to a threshold."""
  m, f, s, r = 64, 256, 3, 512
  k = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(k[0], (r, m))
  label = jax.random.randint(k[1], (r,), 0, s)
  w = [jax.random.normal(k[i + 2], sh) * 0.05
       for i, sh in enumerate([(s, m, f), (s, m, f), (s, f, m)])]
  wa = jax.random.normal(k[5], (m, m))

  def loss(x, wa, *w):
    y = grouped_swiglu.grouped_swiglu(jnp.tanh(x @ wa), label, *w, tile=64,
                                      kind='tiles')
    return (y ** 2).sum()

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  compiled = grad.lower(x, wa, *w).compile()
  jax.block_until_ready(compiled(x, wa, *w))
  with jax.profiler.trace(str(tmp_path)):
    for _ in range(5):
      jax.block_until_ready(compiled(x, wa, *w))
  names = op_profile.hlo_op_names(compiled.as_text())
  excl, count = op_profile.exclusive_seconds(
      op_profile.device_thread_events(str(tmp_path)))
  b = op_profile.breakdown(excl, count, names)
  assert sum(b['shares'].values()) == pytest.approx(1.0)
  shares = b['shares']
  assert shares['expert_ffn'] == max(shares.values())
  assert shares['expert_ffn'] > 3 * shares['matmul'] > 0
  scoped = [op for op in b['top_ops']
            if grouped_swiglu.SCOPE in op['op_name']]
  assert scoped and all(op['category'] == 'expert_ffn' for op in scoped)
  assert any('transpose' in op['op_name'] for op in scoped)  # Backward too.
