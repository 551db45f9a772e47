"""Entry-point shell: a bad flag, config or setup is one line, not a traceback.

`run(main)` replaces `absl.app.run(main)` for the experiments. Before any
work starts it turns
  * a `--config` file that does not exist (or does not load) into one line
    naming the path and the configs beside it,
  * an unknown `--config.a.b` override into one line naming the field and the
    nearest valid name,
  * a malformed flag value into absl's one-line message,
and while `main` runs it turns
  * a `ConfigError` (config validation, a mesh the devices cannot hold
    (`check_mesh`), an unreadable Hugging Face checkpoint) into one line,
    with exit status 2 (a usage error, as absl uses);
  * a `KeyboardInterrupt` (a second Ctrl-C, after `PreemptionGuard` asked
    the first to finish the step) into one line, with 128 + the signal's
    number, as a shell reports a signal.
Each line goes to stderr, from process 0 only when several processes run
one job (they all hit the same error; `distributed.prints_output`). absl's
INFO logs (jax's "Unable to initialize backend 'tpu'" on a CPU host, orbax's
every write) are off unless `--verbosity` is given.
"""
from __future__ import annotations

import difflib
import importlib.util
import os
import shlex
import signal
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from foremoe_jax import config as config_lib
from foremoe_jax.utils import distributed

USAGE_ERROR = 2
# Set by experiments.launch: the command that starts the whole job again,
# which a child prints in its resume hint instead of its own command line.
RERUN_ENV = 'FOREMOE_RERUN_COMMAND'


# The attribute of the --config flag that holds its default file (the flag
# itself is defined with none: see `define_config_file`).
_DEFAULT_FILE = 'foremoe_default_file'


def define_config_file(default: str, name: str = 'config'):
  """`config_flags.DEFINE_config_file(name, default)` whose default loads
  when the flags are parsed, as a given --config does.

  ml_collections loads a default config file (and applies the
  --config.a.b overrides on the command line) while the flag is being
  defined, at import: a typo in an override, or a default that does not
  exist where the user runs, was then a traceback before `run` could make
  it one line. So the flag is defined without a default and `run` puts
  `--config=<default>` on the command line it parses when none is there.
  """
  holder = config_flags.DEFINE_config_file(
      name, None, f'Config file (default {default}); --{name}.a.b=v '
      'overrides a field.')
  setattr(flags.FLAGS[name], _DEFAULT_FILE, default)
  return holder


def with_default_config(argv: list[str], name: str = 'config') -> list[str]:
  """argv with `--config=<default>` after the program name when it names
  no config file and the flag was made by `define_config_file`."""
  if name not in flags.FLAGS:
    return argv
  default = getattr(flags.FLAGS[name], _DEFAULT_FILE, None)
  given = any(a == f'--{name}' or a.startswith(f'--{name}=')
              for a in argv[1:])
  if default is None or given:
    return argv
  return [argv[0], f'--{name}={default}', *argv[1:]]


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
  """The `--config` path of `argv` (`--config=P` or `--config P`; a default
  is already there, `with_default_config`), else None."""
  for i, a in enumerate(argv[1:], start=1):
    if a.startswith('--config='):
      return a.split('=', 1)[1]
    if a == '--config' and i + 1 < len(argv):
      return argv[i + 1]
  return None


def missing_config_file(path: str, cwd: str | None = None) -> str | None:
  """One line when the config file `path[:arg]` does not exist, naming the
  config files in its folder; None when it exists."""
  cwd = os.getcwd() if cwd is None else cwd
  file = path.partition(':')[0]
  if os.path.isfile(os.path.join(cwd, file)):
    return None
  folder = os.path.dirname(file) or '.'
  here = os.path.join(cwd, folder)
  names = sorted(f for f in os.listdir(here) if f.endswith('.py')
                 and not f.startswith('_')) if os.path.isdir(here) else []
  where = (f'; {folder}/ has {", ".join(names)}' if names else
           f'; run from the repository root, where configs/ is')
  return f'config file not found: --config={file} (from {cwd}){where}'


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


def _last_line(e: BaseException) -> str:
  lines = [l.strip() for l in str(e).splitlines() if l.strip()]
  return lines[-1] if lines else type(e).__name__


def _parse(argv):
  argv = with_default_config(list(argv))
  path = _config_file(argv)
  if path:
    missing = missing_config_file(path)
    if missing:
      _exit(missing)
  try:
    parsed = flags.FLAGS(argv)
  except flags.Error as e:
    # A config file that raises while loading comes as a whole traceback:
    # its first line (which flag) and last (the error) say it.
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    _exit('flag error: ' + ' '.join(lines[:1] + lines[1:][-1:]))
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    # ml_collections raises these while applying a --config.* override.
    line = None
    if path:
      try:
        line = unknown_override(argv, _load(path))
      except Exception:  # pylint: disable=broad-except
        line = None
    _exit(line or f'flag error: {str(e).splitlines()[0]}')
  if 'config' in flags.FLAGS:
    # config_flags defers a config file's load failure (a syntax error, a
    # get_config that raises) to the first use of the config.
    try:
      getattr(flags.FLAGS['config'].value, 'keys', None)
    except OSError as e:
      _exit(f'config error: {path} does not load: '
            f'{_last_line(e.__cause__ or e)}')
  return parsed


def _exit(line: str, status: int = USAGE_ERROR):
  if distributed.prints_output():
    print(line, file=sys.stderr, flush=True)
  sys.exit(status)


def python_command(executable: str | None = None,
                   cwd: str | None = None) -> str:
  """The interpreter running this process, as a command that works from
  `cwd` without an activated virtual environment: `.venv/bin/python` when
  it lives under `cwd`, else its absolute path (a bare `python` is often
  the system one, without the packages)."""
  exe = os.path.abspath(executable or sys.executable)
  cwd = os.path.abspath(cwd or os.getcwd())
  rel = os.path.relpath(exe, cwd)
  return shlex.quote(exe if rel.startswith(os.pardir) else rel)


def rerun_command(module: str, args, *, executable: str | None = None,
                  cwd: str | None = None, environ=None) -> str:
  """The command that runs `python -m module *args` again, runnable as
  printed; under experiments.launch, the launch command instead."""
  env = os.environ if environ is None else environ
  if env.get(RERUN_ENV):
    return env[RERUN_ENV]
  return (f'{python_command(executable, cwd)} -m {module} '
          f'{shlex.join(args)}').rstrip()


def interrupted_line(e: KeyboardInterrupt, hint: str = '') -> tuple[str, int]:
  """(one line, exit status) for a KeyboardInterrupt: a second signal
  during a `PreemptionGuard`, whose message names it ('second SIGTERM'),
  or a plain Ctrl-C (SIGINT)."""
  words = str(e).split()
  name = words[-1] if words and words[-1].startswith('SIG') else 'SIGINT'
  num = getattr(signal, name, signal.SIGINT)
  what = f'a second {name}' if str(e).startswith('second') else name
  return (f'aborted by {what}' + (f': {hint}' if hint else ''),
          128 + int(num))


def mesh_device_error(num_data: int, num_expert: int, devices: int,
                      processes: int = 1, platform: str = 'cpu'
                      ) -> str | None:
  """One line when a (num_data x num_expert) mesh does not fit the job's
  `devices` (over `processes` processes), naming what to change; None when
  it fits. One process may leave devices idle; several must fill the mesh
  exactly, or some process would hold no device of it."""
  need = num_data * num_expert
  if need <= devices and (processes == 1 or need == devices):
    return None
  mesh = (f'parallel.num_data x parallel.num_expert = {num_data} x '
          f'{num_expert} = {need} devices')
  fields = ('or set --config.parallel.num_data and '
            f'--config.parallel.num_expert to multiply to {devices}')
  if platform == 'cpu' and processes > 1:
    return (f'{mesh}, but the job has {devices} ({processes} processes x '
            f'{devices // processes}): give experiments.launch '
            f'--num_processes x --devices_per_process = {need}, {fields}')
  if platform == 'cpu':
    return (f'{mesh}, but this process has {devices} simulated CPU devices: '
            f'run with XLA_FLAGS=--xla_force_host_platform_device_count='
            f'{need}, {fields}')
  return (f'{mesh}, but the job has {devices} {platform} devices over '
          f'{processes} processes: set --config.parallel.num_data and '
          f'--config.parallel.num_expert to multiply to {devices}')


def check_mesh(config) -> None:
  """ConfigError when the job's devices cannot hold the config's mesh.

  Starts the jax backend: call it after `distributed.initialize_from_env`.
  """
  import jax  # pylint: disable=g-import-not-at-top
  line = mesh_device_error(config.parallel.num_data,
                           config.parallel.num_expert, jax.device_count(),
                           jax.process_count(), jax.default_backend())
  if line:
    raise config_lib.ConfigError(line)


def run(main, interrupt_hint: str = '') -> None:
  """absl.app.run(main) with one-line errors for bad flags and configs.

  interrupt_hint: what the line after an abort (a second Ctrl-C) tells the
  user, e.g. how to resume.
  """
  def guarded(argv):
    if not flags.FLAGS['verbosity'].present:
      logging.set_verbosity(logging.WARNING)
    try:
      return main(argv)
    except config_lib.ConfigError as e:
      _exit(f'config error: {e}')
    except KeyboardInterrupt as e:
      _exit(*interrupted_line(e, interrupt_hint))
  app.run(guarded, flags_parser=_parse)
