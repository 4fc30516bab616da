# One command installs everything, one runs the tests: see README.md.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.keras_mwms-installed
# The slowest cases are listed at the end of every run, so CI logs show where the time goes.
PYTEST_ARGS ?= --durations=25

.PHONY: install test lint docs demo guides bench-quick version-smoke keras-nightly gpu-check-bundle gpu-check clean

install: $(STAMP)

# Reinstalls only when the package metadata or the pins change, so a second run is instant.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[tensorflow-cpu,jax,torch,ray,dev,docs]"
	# The benchmark's tf-keras peer runs on tensorflow-cpu; its declared `tensorflow` would be a
	# second, 600 MB TensorFlow (and 2 more minutes) over the same module.
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt tf-keras
	$(BIN)/python -c "import keras, tensorflow, jax, torch, tf_keras, ray; print('installed keras', keras.__version__, '| tensorflow', tensorflow.__version__, '| jax', jax.__version__, '| torch', torch.__version__, '| tf-keras', tf_keras.__version__, '| ray', ray.__version__)"
	touch $(STAMP)

# The suite, the version smoke (`version-smoke`, about 11 min here) and the CI benchmark
# (`bench-quick`, under 3 min here): CI runs all three through `make test`, so its log shows the
# compatibility table, the ratio table and, last, where the time went (build/suite-budget.txt:
# per test file its wall seconds, share, processes started and their CPU seconds; then the
# smoke's and the benchmark's wall seconds). `$(BIN)/python -m pytest` alone runs just the suite.
# The smoke runs beside the suite, whose lone processes and waits leave a core idle much of the
# time; its log follows the suite's. The benchmark runs alone, after both (it measures time).
test: install
	@mkdir -p build && rm -f build/suite-budget.txt build/suite-budget.json
	@started=$$(date +%s); \
	$(BIN)/python scripts/version_smoke.py $(KERAS_SMOKE) > build/version-smoke.log 2>&1 & smoke=$$!; \
	trap 'kill $$smoke 2>/dev/null' INT TERM; \
	$(BIN)/python -m pytest $(PYTEST_ARGS); suite=$$?; suite_s=$$(( $$(date +%s) - started )); \
	wait $$smoke; smoked=$$?; smoke_s=$$(( $$(date +%s) - started )); \
	echo "== make version-smoke (run beside the suite): exit $$smoked"; cat build/version-smoke.log; \
	bench=1; bench_s=0; \
	if test $$suite -eq 0 && test $$smoked -eq 0; then \
	    bench_started=$$(date +%s); $(MAKE) --no-print-directory bench-quick; bench=$$?; \
	    bench_s=$$(( $$(date +%s) - bench_started )); fi; \
	echo "== where make test's time went"; cat build/suite-budget.txt 2>/dev/null; \
	echo "make test: pytest $$suite_s s (exit $$suite), version smoke beside it until $$smoke_s s (exit $$smoked), bench-quick $$bench_s s (exit $$bench), $$(( $$(date +%s) - started )) s in all"; \
	test $$suite -eq 0 && test $$smoked -eq 0 && test $$bench -eq 0

lint: install
	$(BIN)/ruff check keras_mwms tests guides

# Every runnable guide in its short smoke mode, on every backend (as CI does in `make test`).
guides: install
	$(BIN)/python -m pytest tests/test_guides.py

# The documentation site (mkdocs.yml, docs/) into build/site; strict, so any warning fails it
# (NO_MKDOCS_2_WARNING silences the theme's MkDocs 2 banner, not a warning of the build).
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir build/site

demo: install
	$(BIN)/python -m keras_mwms.launch --workers 2 -m keras_mwms.demo

# The CI benchmark (< 5 min on 2 cores): all-reduce and fit of every backend vs its native peer;
# prints the tables (ratio keras_mwms/native last), writes build/bench-quick/benchmark.{json,png}.
bench-quick: install
	$(BIN)/python -m keras_mwms.benchmark --quick --out build/bench-quick

# Every other supported Keras minor release (newest patch each; 3.16 as the keras-nightly
# constraints.txt pins, `pinned-nightly`) as a pure-Python overlay over this venv
# (build/keras-overlays/, backends as pinned): per backend, 2 workers vs one process of plain
# Keras (SGD and Adam; on torch one all-reduce per step), plus BackupAndRestore kill/resume on
# torch; prints the compatibility table (scripts/version_smoke.py). The installed release's cell
# runs in the suite's shared gangs (tests/test_versions.py); `make version-smoke KERAS_SMOKE=installed`
# runs it here too.
KERAS_SMOKE ?= 3.12.4 3.13.2 3.14.1 pinned-nightly
version-smoke: install
	$(BIN)/python scripts/version_smoke.py $(KERAS_SMOKE)

# Not in CI: the newest keras-nightly the index serves, as an overlay, through the same smoke and
# tests/test_callbacks.py; prints what broke (exit 0 either way).
keras-nightly: install
	KERAS_MWMS_ALLOW_UNTESTED_KERAS=1 $(BIN)/python scripts/version_smoke.py nightly --callbacks --report-only

# GPU machines (not CI): `make gpu-check-bundle` here puts the wheels Keras needs (this venv's
# versions, for Python 3.12 and this one) into build/gpu-bundle; carry that folder with the
# checkout to a machine whose Python has torch and/or JAX with CUDA (no Keras, no TensorFlow, no
# network) and run `make gpu-check` there: under 8 minutes, report in build/gpu-check/report.md
# (and $OUT). `GPU_CHECK_ARGS=--allow-cpu make gpu-check` self-tests the script on a CPU machine.
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
gpu-check-bundle: install
	$(BIN)/python scripts/gpu_check.py --make-bundle build/gpu-bundle

gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py --bundle build/gpu-bundle --out build/gpu-check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
