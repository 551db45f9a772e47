"""Flags every benchmark shares, and the one call that ends each of them."""
import json

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
