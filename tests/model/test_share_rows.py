"""A placement's shares reach each device as its own source row: the RL
step shards them over 'expert' ([M, L, 1, S] a device, not [M, L, D, S]),
and the dispatch reads the same row either way."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from foremoe_jax import placement as placement_lib
from foremoe_jax.model import expert_parallel as ep
from foremoe_jax.model.slot_assignment import own_share_row
from foremoe_jax.rl import step as step_lib


def _shares(num_devices, num_slots, seed=0):
  return np.random.default_rng(seed).random((num_devices, num_slots),
                                            ).astype(np.float32)


def test_own_row_is_the_same_from_all_rows_or_from_its_slice():
  mesh = ep.make_mesh(2, 4)
  share_DS = _shares(4, 12)
  whole = jax.shard_map(lambda s: own_share_row(s)[None], mesh=mesh,
                        in_specs=P(), out_specs=P(ep.EXPERT))(share_DS)
  sliced = jax.shard_map(lambda s: own_share_row(s)[None], mesh=mesh,
                         in_specs=P(ep.EXPERT), out_specs=P(ep.EXPERT))(
                             share_DS)
  # Device d (along 'expert') reads source row d, both ways.
  np.testing.assert_array_equal(np.asarray(whole), share_DS)
  np.testing.assert_array_equal(np.asarray(sliced), share_DS)


def test_rows_of_another_device_count_are_refused():
  mesh = ep.make_mesh(2, 4)
  with pytest.raises(ValueError, match='2 source devices on an expert axis '
                     'of 4'):
    jax.shard_map(own_share_row, mesh=mesh, in_specs=P(),
                  out_specs=P())(_shares(2, 12))


def test_device_placement_gives_each_device_its_row_only():
  mesh = ep.make_mesh(2, 4)
  p = placement_lib.identity_placement(3, 8, 4, 3)
  stacked = placement_lib.stack_placements([p, p])  # [M=2, L, ...]
  stacked = stacked._replace(slot_share=np.stack(
      [_shares(4, 12, seed=m)[None].repeat(3, 0) for m in range(2)]))
  dev = step_lib.device_placement(stacked, mesh)
  np.testing.assert_array_equal(np.asarray(dev.slot_share),
                                stacked.slot_share)
  for shard in dev.slot_share.addressable_shards:
    assert shard.data.shape == (2, 3, 1, 12)
    d = shard.index[2].start
    np.testing.assert_array_equal(np.asarray(shard.data)[:, :, 0],
                                  stacked.slot_share[:, :, d])
  for shard in dev.slot_expert.addressable_shards:
    assert shard.data.shape == (2, 3, 12)  # Whole on every device.
  assert isinstance(dev.slot_expert, jnp.ndarray)


def test_assignments_past_the_int32_keys_are_refused():
  """The slot search packs (expert, stop) into one int32: 256 experts with
  2**23 assignments (1M tokens x top-8) would wrap; traced only."""
  from foremoe_jax.model.slot_assignment import assign_slots  # pylint: disable=g-import-not-at-top
  spec = lambda n, dtype: jax.ShapeDtypeStruct((n,), dtype)
  ok, big = 2**23 - 2**16, 2**23
  jax.eval_shape(lambda e, v, s, w: assign_slots(e, v, s, w, 256),
                 spec(ok, jnp.int32), spec(ok, bool), spec(512, jnp.int32),
                 spec(512, jnp.float32))
  with pytest.raises(ValueError, match='overflow the int32 slot keys'):
    jax.eval_shape(lambda e, v, s, w: assign_slots(e, v, s, w, 256),
                   spec(big, jnp.int32), spec(big, bool),
                   spec(512, jnp.int32), spec(512, jnp.float32))
