"""The launch audit (pallas_kernels/msa/launches.py): the HLO reader on a
hand-written module whose launches are counted by hand, and, where the
CUDA PJRT plugin is installed (`make gpu-launches`), XLA's own compile of
MSA calls for a compile-only H100."""
import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.msa import launches

# A module in the printer's format: a Triton kernel, a loop fusion, a
# cuDNN call, XLA's GEMM and a fusion reading it, a view, a slice and a
# scatter (in place), a loop of known trip count (body: a fusion and a
# copy; condition: a compare fusion), one of unknown trip count, and an
# asynchronous all-to-all (its start launches, its done waits).
MODULE = """\
HloModule jit_f, entry_computation_layout={(f32[4,8]{1,0})->f32[4,8]{1,0}}

%fused_add (p.0: f32[4,8]) -> f32[4,8] {
  %p.0 = f32[4,8]{1,0} parameter(0)
  ROOT %add.0 = f32[4,8]{1,0} add(%p.0, %p.0)
}

%body.1 (arg.0: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %arg.0 = (s32[], f32[4,8]{1,0}) parameter(0)
  %gte.0 = f32[4,8]{1,0} get-tuple-element(%arg.0), index=1
  %gte.1 = s32[] get-tuple-element(%arg.0), index=0
  %loop_add_fusion.2 = f32[4,8]{1,0} fusion(%gte.0), kind=kLoop, calls=%fused_add
  %copy.3 = s32[] copy(%gte.1)
  ROOT %tuple.0 = (s32[], f32[4,8]{1,0}) tuple(%copy.3, %loop_add_fusion.2)
}

%cond.1 (arg.1: (s32[], f32[4,8])) -> pred[] {
  %arg.1 = (s32[], f32[4,8]{1,0}) parameter(0)
  %gte.2 = s32[] get-tuple-element(%arg.1), index=0
  ROOT %loop_compare_fusion = pred[] fusion(%gte.2), kind=kLoop, calls=%fused_add
}

ENTRY %main.9 (x.1: f32[4,8], n.1: s32[]) -> f32[4,8] {
  %x.1 = f32[4,8]{1,0} parameter(0), metadata={op_name="x"}
  %n.1 = s32[] parameter(1)
  %bitcast.1 = f32[32]{0} bitcast(%x.1)
  %dynamic_slice_fusion = f32[1,8]{1,0} fusion(%x.1, %n.1), kind=kLoop, calls=%fused_add
  %input_scatter_fusion = f32[4,8]{1,0} fusion(%x.1, %n.1, %dynamic_slice_fusion), kind=kInput, calls=%fused_add
  %pallas_call.5 = (bf16[2,16]{1,0}, f32[2]{0}) custom-call(%x.1, %n.1), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/msa_index_scores/pallas_call"}, backend_config={debug = false, grid_x = 8 : i32, grid_y = 1 : i32, grid_z = 64 : i32, ir = "ML\\EFR", name = "msa_index_scores", num_stages = 2 : i32, num_warps = 4 : i32}
  %loop_add_fusion = f32[4,8]{1,0} fusion(%x.1), kind=kLoop, calls=%fused_add, metadata={op_name="jit(f)/add"}
  %cudnn.1 = (bf16[4,8]{1,0}, u8[0]{0}) custom-call(%x.1), custom_call_target="__cudnn$fmhaSoftmax"
  %gemm_fusion_dot.1 = bf16[4,8]{1,0} fusion(%x.1), kind=kCustom, calls=%fused_add, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %loop_multiply_fusion = f32[4,8]{1,0} fusion(%gemm_fusion_dot.1), kind=kLoop, calls=%fused_add, backend_config={"fusion_backend_config":{"kind":"__triton"}}
  %tuple.1 = (s32[], f32[4,8]{1,0}) tuple(%n.1, %loop_add_fusion)
  %while.7 = (s32[], f32[4,8]{1,0}) while(%tuple.1), condition=%cond.1, body=%body.1, backend_config={"known_trip_count":{"n":"3"}}
  %while.8 = (s32[], f32[4,8]{1,0}) while(%while.7), condition=%cond.1, body=%body.1
  %gte.9 = f32[4,8]{1,0} get-tuple-element(%while.8), index=1
  %all-to-all-start = ((f32[4,8]{1,0}), f32[4,8]{1,0}) all-to-all-start(%gte.9), replica_groups={{0,1}}
  ROOT %all-to-all-done = f32[4,8]{1,0} all-to-all-done(%all-to-all-start)
}
"""


def test_shape_bytes_by_hand():
  assert launches.shape_bytes('f32[2,3]{1,0}') == 24
  assert launches.shape_bytes('(f32[2,3]{1,0}, s32[])') == 28
  assert launches.shape_bytes('(bf16[8,16,128]{2,1,0}, pred[5])') == \
      8 * 16 * 128 * 2 + 5
  assert launches.shape_bytes('f8e4m3fn[10]') == 10
  assert launches.shape_bytes('u8[0]{0}') == 0


def test_launches_of_a_hand_counted_module():
  rows = launches.launches(MODULE)
  got = [(r['kind'], r['name'], r['times']) for r in rows]
  assert got[:2] == [('fusion', 'dynamic_slice_fusion', 1),
                     ('fusion', 'input_scatter_fusion', 1)]
  # A slice reads what it keeps; a scatter reads and writes its update and
  # indices, not the buffer it updates in place.
  assert rows[0]['read_bytes'] == rows[0]['write_bytes'] == 32
  assert rows[1]['read_bytes'] == rows[1]['write_bytes'] == 4 + 32
  rows = rows[2:]
  got = got[2:]
  assert got == [
      ('triton', 'msa_index_scores', 1),
      ('fusion', 'loop_add_fusion', 1),
      ('library', 'cudnn.1', 1),
      ('gemm', 'gemm_fusion_dot.1', 1),
      ('fusion', 'loop_multiply_fusion', 1),
      ('loop', 'while.7', 1),
      ('fusion', 'loop_compare_fusion', 4),   # trip count 3: 4 checks
      ('fusion', 'loop_add_fusion.2', 3),
      ('copy', 'copy.3', 3),
      ('loop', 'while.8', 1),
      ('fusion', 'loop_compare_fusion', 1),   # unknown: counted once
      ('fusion', 'loop_add_fusion.2', 1),
      ('copy', 'copy.3', 1),
      ('collective', 'all-to-all-start', 1)]
  triton = rows[0]
  assert triton['grid'] == [8, 1, 64]
  assert triton['write_bytes'] == 2 * 16 * 2 + 2 * 4
  assert triton['read_bytes'] == 4 * 8 * 4 + 4   # x and n
  assert rows[1]['source'] == 'jit(f)/add'
  assert rows[5]['trip_count'] == 3 and not rows[5]['host_sync']
  assert rows[9]['trip_count'] is None and rows[9]['host_sync']
  s = launches.summarize(rows)
  assert s['by_kind'] == {'collective': 1, 'copy': 4, 'fusion': 11,
                          'gemm': 1, 'library': 1, 'triton': 1}
  assert s['launches'] == 19
  assert s['collective_bytes'] == 3 * 4 * 8 * 4  # read 32 floats, write 64
  assert s['glue_launches'] == 15
  assert s['host_syncs'] == 1
  assert [l['trip_count'] for l in s['loops']] == [3, None]
  # Glue bytes: each fusion/copy's (read + write) times its launches.
  fusion = 2 * 4 * 8 * 4
  compare = 4 + 1
  copy = 4 + 4
  multiply = 4 * 8 * 2 + 4 * 8 * 4  # reads the GEMM's bf16, writes f32
  assert s['glue_bytes'] == (fusion * (1 + 3 + 1) + compare * 5 + copy * 4
                             + multiply)
  assert s['largest_glue'][0]['name'] == 'loop_add_fusion.2'


def test_a_module_without_entry_is_refused():
  with pytest.raises(ValueError, match='ENTRY'):
    launches.launches('HloModule m\n')


needs_plugin = pytest.mark.skipif(
    not launches.plugin_available(),
    reason='needs the CUDA PJRT plugin: make gpu-launches')


@needs_plugin
def test_xla_compiles_msa_decode_for_an_h100():
  """The whole decode step, compiled by XLA for a compile-only H100: four
  Pallas launches (the selection's two, the split-K decode kernel and the
  merge) and four small glue launches (the offsets, the index queries
  padded to a dot's 16 rows, the score launch's key-valid mask, the
  selection's transpose): no loop, no table built from the selection (the
  decode kernel reads it), and glue traffic a small fraction of the
  index-key cache the step must read."""
  from pallas_kernels.msa import pallas_path  # pylint: disable=g-import-not-at-top
  b, s, g, r, d, di, c, k = 2, 1024, 2, 16, 64, 64, 64, 4
  sds = jax.ShapeDtypeStruct
  bf = jnp.bfloat16
  fn = functools.partial(pallas_path.msa_decode, block_size=c, top_k=k,
                         backend='gpu', interpret=False)
  rows = launches.launches(launches.optimized_hlo(
      fn, sds((b, g * r, d), bf), sds((b, s, g, d), bf),
      sds((b, s, g, d), bf), sds((b, g, di), bf), sds((b, s, di), bf),
      sds((b,), jnp.int32)))
  names = [x['name'] for x in rows if x['kind'] == 'triton']
  assert names == ['msa_index_scores', 'msa_index_topk',
                   'msa_kv_outer_decode', 'msa_kv_outer_combine']
  summary = launches.summarize(rows)
  assert not summary['loops'] and summary['glue_launches'] <= 4
  assert summary['glue_bytes'] < 0.1 * b * s * di * 2


@needs_plugin
def test_kv_outer_training_step_has_no_loop():
  """Forward and backward by KV-outer: no XLA loop (the work items' block
  lookup is one comparison, the dK/dV sums one launch), so no host sync."""
  from pallas_kernels.msa import pallas_path  # pylint: disable=g-import-not-at-top
  t, g, r, d, di, c, k = 512, 2, 16, 64, 64, 64, 4
  sds = jax.ShapeDtypeStruct
  bf = jnp.bfloat16

  def step(q, k_, v, qi, ki, do):
    attend = lambda q_, k2, v2: pallas_path.msa_attention(
        q_, k2, v2, qi, ki, block_size=c, top_k=k, q_offset=0,
        backend='gpu', interpret=False)[0]
    return jax.vjp(attend, q, k_, v)[1](do)
  q = sds((1, t, g * r, d), bf)
  rows = launches.launches(launches.optimized_hlo(
      step, q, sds((1, t, g, d), bf), sds((1, t, g, d), bf),
      sds((1, t, g, di), bf), sds((1, t, di), bf), q))
  names = {x['name'] for x in rows if x['kind'] == 'triton'}
  assert {'msa_kv_outer_forward', 'msa_kv_outer_dkv', 'msa_kv_outer_dkv_sum',
          'msa_backward_dq_gpu'} <= names
  summary = launches.summarize(rows)
  assert summary['loops'] == [] and summary['host_syncs'] == 0


@needs_plugin
def test_union_tile_prefill_has_no_loop():
  """Prefill by union tiles: selection, the union tile forward, and XLA
  glue without loops or host syncs."""
  from pallas_kernels.msa import pallas_path  # pylint: disable=g-import-not-at-top
  t, g, r, d, di, c, k = 512, 2, 16, 64, 64, 64, 4
  sds = jax.ShapeDtypeStruct
  bf = jnp.bfloat16
  fn = lambda q, k_, v, qi, ki: pallas_path.msa_attention(
      q, k_, v, qi, ki, block_size=c, top_k=k, q_offset=0, backend='gpu',
      interpret=False, gpu_kernels='tiles')[0]
  rows = launches.launches(launches.optimized_hlo(
      fn, sds((1, t, g * r, d), bf), sds((1, t, g, d), bf),
      sds((1, t, g, d), bf), sds((1, t, g, di), bf), sds((1, t, di), bf)))
  names = [x['name'] for x in rows if x['kind'] == 'triton']
  assert names == ['msa_index_scores', 'msa_index_topk',
                   'msa_forward_gpu_tiles']
  assert launches.summarize(rows)['host_syncs'] == 0


@needs_plugin
def test_moe_layer_compiles_to_triton_matmuls_without_loops():
  """The expert-parallel layer, forward and backward, on 2 compile-only
  H100s with the GPU's choices: the grouped SwiGLU is Triton launches (no
  XLA GEMM over every group), and the exact dispatch has no loop."""
  from experiments import gpu_launches  # pylint: disable=g-import-not-at-top
  calls = gpu_launches.moe_calls(['pallas', 'ragged_dot'], ep=2, tokens=256,
                                 experts=8, d_model=64, d_ff=32)
  out = launches.audit(calls, unplaced=list(calls))
  gmm = out['moe layer x2, pallas']
  assert 'error' not in gmm, gmm
  names = [r['name'] for r in gmm['launches'] if r['kind'] == 'triton']
  assert names.count('grouped_tile_matmul') == 3  # forward
  assert names.count('grouped_tile_matmul_t') == 3  # dx, w read transposed
  assert names.count('grouped_slot_matmul_t') == 3
  # No row all-reduce (the ragged exchange's rows differ per device): the
  # loss's scalar is the only one.
  reduces = [r for r in gmm['launches'] if r['op'].startswith('all-reduce')]
  assert [r['shape'] for r in reduces] == ['f32[]'], reduces
  assert gmm['summary']['loops'] == []
  assert gmm['summary']['by_kind'].get('gemm', 0) == 0
  dense = out['moe layer x2, ragged_dot']['summary']
  assert dense['by_kind']['gemm'] >= 3  # XLA's own GEMMs
