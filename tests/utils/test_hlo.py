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
