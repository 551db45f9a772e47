"""One RL step per planner method, all costs counted, on 8 simulated CPU devices.

  python -m experiments.bench_rl_step --json

Prints the setup, a line per repetition (unless --json), then one JSON line:
{"methods": {"static": {...}, "eplb_step": ..., "eplb_microstep": ...,
"foresight_split": ..., "foremoe": ...}, "speedup_step_vs_static",
"speedup_step_vs_eplb_step", "speedup_step_vs_foresight_split",
"recompute_forward_passes", "step_compiles", "max_rel_param_diff", ...}.
The logic lives in foremoe_jax/benchmarks/rl_step.py.
"""
import dataclasses
import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

from absl import app, flags, logging  # pylint: disable=g-import-not-at-top

from experiments import common
from foremoe_jax.benchmarks import rl_step
from foremoe_jax.utils.run_info import print_run_info

_JSON = flags.DEFINE_bool('json', False, 'Print only setup + one JSON line '
                          '(progress on stderr).')
# Five, not three: on a shared 2-core host one method's step moves by 5-10%
# between repetitions, and a median of three still carried that into the
# ratios (1.60x and 1.73x vs static for the same code in two runs).
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Interleaved repetitions.')
_WARM = flags.DEFINE_integer('warmstart_steps', 100,
                             'SFT steps before sampling (skews routing).')
_PROMPTS = flags.DEFINE_integer(
    'prompts', rl_step.RLStepBench.prompts, 'Prompts per RL step (times '
    'the generations, over the micro-steps, sets the tokens per micro-step).')
_MICROBATCHES = flags.DEFINE_integer(
    'microbatches', rl_step.RLStepBench.microbatches,
    'Micro-steps per RL step.')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  cfg = rl_step.RLStepBench(repeats=_REPEATS.value,
                            warmstart_steps=_WARM.value,
                            prompts=_PROMPTS.value,
                            microbatches=_MICROBATCHES.value)
  run = print_run_info({'bench': 'rl_step', **dataclasses.asdict(cfg)})
  result = rl_step.run(cfg, log=common.progress(_JSON.value))
  common.finish('bench_rl_step', run, result)


if __name__ == '__main__':
  app.run(main)
