"""Checkpoints of the policy (orbax), so a crashed job resumes where it was.

Host-side shell around `orbax.checkpoint.CheckpointManager`: parameters,
optimizer state and a small JSON record of the phase ('warmstart_done' or
'rl') and step. Restores lay arrays out like the given templates (shardings
included), so a resumed run continues on the same mesh.
"""
from __future__ import annotations

import orbax.checkpoint as ocp


class Checkpointer:

  def __init__(self, directory: str, max_to_keep: int = 2):
    self._mgr = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))

  def save(self, step: int, params, *, phase: str, opt_state=None) -> None:
    items = dict(params=ocp.args.StandardSave(params),
                 meta=ocp.args.JsonSave({'phase': phase, 'step': int(step),
                                         'has_opt_state': opt_state is not None}))
    if opt_state is not None:
      items['opt_state'] = ocp.args.StandardSave(opt_state)
    self._mgr.save(int(step), args=ocp.args.Composite(**items), force=True)
    self._mgr.wait_until_finished()

  def restore_latest(self, params_template):
    """{'phase', 'step', 'params'} of the latest checkpoint, or None."""
    step = self._mgr.latest_step()
    if step is None:
      return None
    r = self._mgr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(params_template),
        meta=ocp.args.JsonRestore()))
    return dict(phase=r.meta['phase'], step=r.meta['step'], params=r.params)

  def restore_opt_state(self, step: int, opt_state_template):
    r = self._mgr.restore(step, args=ocp.args.Composite(
        opt_state=ocp.args.StandardRestore(opt_state_template)))
    return r.opt_state
