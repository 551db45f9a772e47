"""The HLO reader on hand-written text in each spelling XLA has used.

The compiled-step tests (one gradient all-reduce per step, no moves inside a
conditional) read whatever XLA prints, and XLA changed how it prints replica
groups between jax 0.10 and 0.11: a reader that missed one spelling would
count no all-reduce at all.
"""
from foremoe_jax.utils import hlo

_TEXT = """\
HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %x = f32[4] get-tuple-element(%p), index=1
  %in_loop = f32[4]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %t = (s32[], f32[4]) tuple(%i, %in_loop)
}

ENTRY %main (x: f32[4], y: f32[2,3]) -> f32[4] {
  %x = f32[4] parameter(0)
  %y = f32[2,3] parameter(1)
  %w = (s32[], f32[4]) while(%init), condition=%cond, body=%body
  %iota = f32[2,3]{1,0} all-reduce(%y), channel_id=2, replica_groups=[2,4]<=[8], to_apply=%add
  %axes = (f32[4]{0}, bf16[2,3]{1,0}) all-reduce(%x, %y), channel_id=3, replica_groups=mesh['data'=2,'expert'=4] {'expert'}, use_global_device_ids=true, to_apply=%add
  %both = f32[4]{0} all-reduce(%x), channel_id=4, replica_groups=mesh['data'=2,'expert'=4] {'data','expert'}, use_global_device_ids=true, to_apply=%add
  ROOT %r = f32[4] add(%x, %x)
}
"""


def test_all_reduces_reads_every_replica_group_spelling():
  got = {r['name']: r for r in hlo.all_reduces(_TEXT)}
  assert set(got) == {'in_loop', 'iota', 'axes', 'both'}
  assert {n: r['group_size'] for n, r in got.items()} == {
      'in_loop': 2, 'iota': 4, 'axes': 4, 'both': 8}
  assert {n: r['in_loop'] for n, r in got.items()} == {
      'in_loop': True, 'iota': False, 'axes': False, 'both': False}
  assert got['axes']['dtypes'] == ['f32', 'bf16']
  assert got['axes']['elements'] == 4 + 6


_COMPUTE = """\
HloModule m

%fused_dot (a: f32[2,2], b: f32[2,2]) -> f32[2,2] {
  %a = f32[2,2] parameter(0)
  %b = f32[2,2] parameter(1)
  ROOT %d = f32[2,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%layer_body (p: (s32[], f32[2,2])) -> (s32[], f32[2,2]) {
  %p = (s32[], f32[2,2]) parameter(0)
  %x = f32[2,2] get-tuple-element(%p), index=1
  %f = f32[2,2]{1,0} fusion(%x, %x), kind=kOutput, calls=%fused_dot
  %beside = f32[2,2]{1,0} all-to-all(%x), channel_id=1, replica_groups={{0,1}}, dimensions={0}
  ROOT %t = (s32[], f32[2,2]) tuple(%i, %f)
}

%fill_body (p: (s32[], f32[2,2])) -> (s32[], f32[2,2]) {
  %p = (s32[], f32[2,2]) parameter(0)
  %x = f32[2,2] get-tuple-element(%p), index=1
  %alone = f32[2,2]{1,0} all-to-all(%x), channel_id=2, replica_groups={{0,1}}, dimensions={0}
  ROOT %t = (s32[], f32[2,2]) tuple(%i, %alone)
}

%step_body (p: (s32[], f32[2,2])) -> (s32[], f32[2,2]) {
  %p = (s32[], f32[2,2]) parameter(0)
  %layers = (s32[], f32[2,2]) while(%p), condition=%cond, body=%layer_body
  %fills = (s32[], f32[2,2]) while(%p), condition=%cond, body=%fill_body
  %x = f32[2,2] get-tuple-element(%p), index=1
  %around = f32[2,2]{1,0} all-to-all(%x), channel_id=3, replica_groups={{0,1}}, dimensions={0}
  ROOT %t = (s32[], f32[2,2]) tuple(%i, %around)
}

ENTRY %main (x: f32[2,2]) -> f32[2,2] {
  %x = f32[2,2] parameter(0)
  %w = (s32[], f32[2,2]) while(%init), condition=%cond, body=%step_body
  ROOT %r = f32[2,2] add(%x, %x)
}
"""


def test_compute_computations_follow_fusions_and_loops_not_transfer_loops():
  """A collective beside a fused matmul, or beside a loop that runs one,
  shares its computation with compute; one in a loop of transfers alone
  does not."""
  computes = hlo.compute_computations(_COMPUTE)
  where = {c['computation'] for c in hlo.collectives(_COMPUTE)}
  assert where == {'layer_body', 'fill_body', 'step_body'}
  assert where & computes == {'layer_body', 'step_body'}
  assert 'fused_dot' in computes and 'main' in computes
