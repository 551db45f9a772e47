"""Weight transfer between placements: host schedule + device engine.

Data flow: planner (StepPlan) -> transfer -> RL step. ``schedule`` (numpy)
turns consecutive placements into the local copies and remote sends the
device engine runs, fits a plan to the engine's static budget, and counts
the weights moved; ``engine`` (jax, imported on its own) runs them under
shard_map: slot buffers filled by one ragged all-to-all per layer (or, in
``rounds`` mode, by cyclic-shift ppermute rounds), slot gradients returned
home the same way. This package's namespace imports no jax.
"""
from foremoe_jax.transfer.schedule import BudgetExceeded
from foremoe_jax.transfer.schedule import ExactTransition
from foremoe_jax.transfer.schedule import MODES
from foremoe_jax.transfer.schedule import StepTransfer
from foremoe_jax.transfer.schedule import Transition
from foremoe_jax.transfer.schedule import TransferBudget
from foremoe_jax.transfer.schedule import build_step_transfer
from foremoe_jax.transfer.schedule import fit_plan_to_budget
from foremoe_jax.transfer.schedule import rounds_needed
from foremoe_jax.transfer.schedule import step_wire_over_useful
from foremoe_jax.transfer.schedule import transition
