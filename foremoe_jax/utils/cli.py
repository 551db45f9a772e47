"""Entry-point shell: a bad flag or config is one line, not a traceback.

`run(main)` replaces `absl.app.run(main)` for the experiments that take a
`--config` file. Before any work starts it turns
  * an unknown `--config.a.b` override into one line naming the field and the
    nearest valid name,
  * a malformed flag value into absl's one-line message,
  * a `ConfigError` raised by `main` (config validation) into one line,
each printed to stderr with exit status 2 (a usage error, as absl uses).
"""
from __future__ import annotations

import difflib
import importlib.util
import sys

from absl import app, flags

from foremoe_jax import config as config_lib

USAGE_ERROR = 2


def flat_fields(config, prefix: str = '') -> list[str]:
  """Every field of a ConfigDict as a dotted path, nested dicts included."""
  out = []
  for name, value in config.items():
    path = f'{prefix}{name}'
    out.append(path)
    if hasattr(value, 'items'):
      out += flat_fields(value, path + '.')
  return out


def _config_file(argv) -> str | None:
  for a in argv[1:]:
    if a.startswith('--config='):
      return a.split('=', 1)[1]
  flag = flags.FLAGS['config'] if 'config' in flags.FLAGS else None
  return flag.default if flag is not None and isinstance(flag.default, str) \
      else None


def _load(path: str):
  """get_config() of a config file `path[:arg]`, as config_flags loads it."""
  path, _, arg = path.partition(':')
  spec = importlib.util.spec_from_file_location('_cli_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def unknown_override(argv, config) -> str | None:
  """One line for the first `--config.X` override that names no field."""
  fields = flat_fields(config)
  known = set(fields)
  for a in argv[1:]:
    if not a.startswith('--config.'):
      continue
    name = a[len('--config.'):].split('=', 1)[0]
    if name not in known:
      near = difflib.get_close_matches(name, fields, n=1, cutoff=0.5)
      hint = f'; did you mean --config.{near[0]}?' if near else ''
      return f'unknown config field --config.{name}{hint}'
  return None


def _parse(argv):
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _exit(f'flag error: {e}')
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    # ml_collections raises these while applying a --config.* override.
    line = None
    path = _config_file(argv)
    if path:
      try:
        line = unknown_override(argv, _load(path))
      except Exception:  # pylint: disable=broad-except
        line = None
    _exit(line or f'flag error: {str(e).splitlines()[0]}')


def _exit(line: str):
  print(line, file=sys.stderr, flush=True)
  sys.exit(USAGE_ERROR)


def run(main) -> None:
  """absl.app.run(main) with one-line errors for bad flags and configs."""
  def guarded(argv):
    try:
      return main(argv)
    except config_lib.ConfigError as e:
      _exit(f'config error: {e}')
  app.run(guarded, flags_parser=_parse)
