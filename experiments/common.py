"""Flags every benchmark shares, and the one call that ends each of them."""
import json
import sys

from absl import flags

from foremoe_jax.utils import results

RESULTS_DIR = flags.DEFINE_string(
    'results_dir', results.DEFAULT_DIR,
    'Also write the run info and result to <results_dir>/<bench>.json, which '
    'experiments.render_results turns into the README tables; empty: do not.')


def finish(bench: str, run: dict, result: dict) -> None:
  """Prints the result as the last line and saves it under --results_dir."""
  path = results.save(bench, run, result, results_dir=RESULTS_DIR.value)
  if path:
    print(f'# saved: {path}', flush=True)
  print(json.dumps(result), flush=True)


def progress(json_mode: bool):
  """Where a benchmark's progress lines go: stdout for a run people read;
  stderr under --json, so stdout stays the setup and one JSON line while a
  long run (the RL step's repetitions, the simulator's validation) still
  shows it is alive."""
  if not json_mode:
    return print
  return lambda *a, **k: print(*a, file=sys.stderr, flush=True)
