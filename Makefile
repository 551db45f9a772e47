# Entry points: `make demo` (set-up + main job on 8 simulated CPU devices) and
# `make test` (set-up + whole test suite). Both create .venv on first use.
# `make gpu-check` runs on a GPU machine's own Python (scripts/gpu_check.sh).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# A fresh workdir per `make demo`; DEMO_DIR=... resumes or extends a given one.
DEMO_DIR ?= /tmp/foremoe_demo/$(shell date +%Y%m%d-%H%M%S)
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: venv demo demo-dataset demo-results test bench simulate gpu-check \
	gpu-rehearsal gpu-launches clean

venv: $(STAMP)

# pip compiles every installed module to bytecode one file at a time (38 of
# its 71 s on a 2-core host); compileall does the same on every core (24 s).
# The bytecode matters where PYTHONDONTWRITEBYTECODE is set: no process
# would cache what it compiles, and each would compile jax again (+6 s).
# A file that does not compile (a package's test data) is left as source,
# as pip leaves it. Left out: what no process here imports, the packages'
# own test suites (scipy's, sympy's, ...), pip, setuptools and debugpy (the
# notebook kernel does not load it): a quarter of the work (25 -> 19.5 s,
# 45 -> 33 CPU-s on a 2-core host).
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -e '.[test]'
	$(PY) -m compileall -q -j 0 \
	  -x '/tests/|/site-packages/(pip|setuptools|debugpy)/' \
	  $(VENV)/lib > /dev/null || true
	touch $(STAMP)

demo: venv
	$(PY) -m experiments.rl_train --config=configs/tiny.py --workdir=$(DEMO_DIR)

# The same job on a dataset task: word problems in GSM8K's file layout, a
# BPE tokenizer.json, math-verify rewards (configs/tiny_dataset.py).
demo-dataset: venv
	test -f data/word_problems/train.jsonl || \
	  $(PY) -m experiments.make_word_problems --out_dir=data/word_problems
	$(PY) -m experiments.rl_train --config=configs/tiny_dataset.py \
	  --workdir=$(DEMO_DIR)

# Both demos, timed, into results/demo.json and results/demo_dataset.json
# (experiments/record_demo.py), then the README and docs/results.md blocks.
demo-results: venv
	$(PY) -m experiments.record_demo --config=configs/tiny.py --name=demo
	test -f data/word_problems/train.jsonl || \
	  $(PY) -m experiments.make_word_problems --out_dir=data/word_problems
	$(PY) -m experiments.record_demo --config=configs/tiny_dataset.py \
	  --name=demo_dataset
	$(PY) -m experiments.render_results

# --max-worker-restart=0: a test that kills its worker (an XLA segfault)
# fails once, and the other worker finishes the suite. xdist's default
# restarts the worker and hands it the same file again (9 times, measured):
# a crash at compile time then repeats for the better part of an hour and
# looks like a hang.
test: venv
	$(PY) -m pytest -q -n 2 --max-worker-restart=0 --durations=15 tests

bench: venv
	$(PY) -m experiments.bench_rl_step --json
	$(PY) -m experiments.bench_moe_layer --json
	$(PY) -m experiments.bench_planner --json
	$(PY) -m experiments.bench_msa --json
	$(PY) -m experiments.bench_sampler --json
	$(PY) -m experiments.bench_rewards --json
	$(PY) -m experiments.render_results

# The cluster simulator (8-256 devices), validated on this machine first.
simulate: venv
	$(PY) -m experiments.simulate_cluster --json

# One NVIDIA GPU with CUDA JAX already installed (no venv, no network):
# bench_msa vs cuDNN, then the `gpu` tests; see scripts/gpu_check.sh.
gpu-check:
	bash scripts/gpu_check.sh

# The `gpu` tests on this host, no GPU (tests/gpu_rehearsal.py): every
# Triton kernel they launch runs in interpret mode, as the GPU would run it,
# and is compiled for an H100 at the shapes it ran with; a failed test, a
# kernel Triton refuses or one over shared memory fails it. Writes
# results/gpu_rehearsal.json. One process (the report gathers every test's
# kernels), on 2 cores: 9 minutes under jax 0.11.2, over half an hour under
# this venv's 0.10.2 (a slower interpreter). REHEARSAL_PY: another Python,
# e.g. one with the GPU machine's jax 0.11 (WORKSPACE.md).
REHEARSAL_PY ?= $(PY)
gpu-rehearsal: venv
	FOREMOE_GPU_REHEARSAL=1 $(REHEARSAL_PY) -m pytest -q -p no:cacheprovider \
	  -W ignore::DeprecationWarning -m gpu tests/*/*_gpu.py

# What an H100 launches for each MSA call (kernels, XLA glue, loops),
# compiled by XLA on this host: results/gpu_launches.json. The CUDA PJRT
# plugin (of jax's own version) and cuDNN (for the dense baseline's rows)
# go in a venv of their own, so the project's CPU runs never try to start
# CUDA.
LAUNCH_VENV := .venv-launches
gpu-launches:
	test -x $(LAUNCH_VENV)/bin/python || $(PYTHON) -m venv $(LAUNCH_VENV)
	$(LAUNCH_VENV)/bin/python -m pip install -q -e '.[test]'
	v=$$($(LAUNCH_VENV)/bin/python -c 'import jax; print(jax.__version__)') \
	  && $(LAUNCH_VENV)/bin/python -m pip install -q "jax-cuda13-plugin==$$v" \
	  "jax-cuda13-pjrt==$$v" "nvidia-cudnn-cu13>=9.12,<10"
	JAX_PLATFORMS=cpu $(LAUNCH_VENV)/bin/python -m experiments.gpu_launches \
	  --json

clean:
	rm -rf $(VENV) $(LAUNCH_VENV) build *.egg-info
