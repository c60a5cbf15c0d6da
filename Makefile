SHELL := /bin/bash
# trace_ext: one command per job.
#   make test   fresh machine -> virtualenv, dependencies, CUDA build (9.0a;10.0a when nvcc + CUDA torch exist), CPU suite
#   make demo   the TRACE alignment demo (CPU reference ops; kernels when a GPU is there)
#   make gpu    on the H200 (device tool): build for 9.0a, GPU tests, benchmarks; logs and results under $OUT
PY        ?= python3
VENV      ?= .venv
VPY       := $(VENV)/bin/python
TORCH_PIN ?= torch==2.14.1
DEPS      := "transformers>=5.17,<6" nvidia-cutlass==4.2.0.0 safetensors tqdm matplotlib pytest ninja numpy setuptools wheel
PYTEST_ARGS ?=

.PHONY: venv build test demo gpu gpu-build gpu-test gpu-bench gpu-profile gpu-sass clean

$(VPY):
	$(PY) -m venv $(VENV)

venv: $(VPY)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(TORCH_PIN) $(DEPS)

build: venv
	MAX_JOBS=$${MAX_JOBS:-2} $(VPY) -m pip install -v --no-build-isolation --no-deps . 2>&1 | tee build.log | grep -E "trace_ext build|error|Error|Successfully" ; test $${PIPESTATUS[0]} -eq 0
	$(VPY) -c "import trace_ext, json; print(json.dumps(trace_ext.backends(), default=str))"

test: build
	$(VPY) -m pytest tests -q -ra $(PYTEST_ARGS)

demo: venv
	cd /tmp && $(CURDIR)/$(VPY) -c "import trace_ext" 2>/dev/null || $(MAKE) -C $(CURDIR) build
	$(VPY) -m trace_ext.rl.demo --out demo_out $(DEMO_ARGS)

# ---- device machine (H200): python3 there is the image's torch 2.11; CUTLASS travels as a wheel in .whl/
GPU_OUT ?= $(if $(OUT),$(OUT),out)
GPU_TMP := /tmp/trace_ext_out

gpu-build:
	mkdir -p $(GPU_TMP)
	python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/nvidia_cutlass-*.whl
	# the image's default CXX (/opt/gcc) links parts of libstdc++ into the extension; formatting an integer in a
	# TORCH_CHECK message then segfaulted. The system gcc matches the libstdc++ that torch loads.
	PYTHONPATH=/tmp/site CC=$${TRACE_EXT_CC:-/usr/bin/gcc} CXX=$${TRACE_EXT_CXX:-/usr/bin/g++} TRACE_EXT_CUDA_ARCHS=9.0a MAX_JOBS=16 python3 -m pip install -v --no-build-isolation --no-deps . > $(GPU_TMP)/build.log 2>&1 || (tail -60 $(GPU_TMP)/build.log; exit 1)
	grep "trace_ext build" $(GPU_TMP)/build.log
	cd /tmp && python3 -c "import trace_ext, json; print(json.dumps(trace_ext.backends(), default=str))"

# one pytest process per file: a crash in one file cannot hide the results of the others
gpu-test:
	for t in $(or $(GPU_TESTS),tests/gpu/test_*.py tests/test_ops_quant.py); do \
	  echo "=== $$t"; python3 -m pytest $$t -q -rfE --tb=short -p no:cacheprovider $(PYTEST_ARGS) 2>&1 | grep -v "^  File\|Extension modules" | tail -60; \
	done 2>&1 | tee $(GPU_TMP)/tests.log | grep -E "^===|passed|failed|error|Error|Fatal|FAILED|ERROR" | head -80

gpu-bench:
	for b in $(or $(BENCHES),bench/bench_quant.py bench/bench_gemm.py bench/bench_kv.py); do \
	  [ -f $$b ] && BENCH_OUT=$(GPU_TMP) PYTHONUNBUFFERED=1 python3 $$b 2>&1 | tee -a $(GPU_TMP)/bench.log; done; true

# Nsight Compute on the hot kernels of bench/profile_kernels.py (clocks left alone; only trace_ext's kernels)
NCU          := ncu --clock-control none --kernel-name-base mangled -k regex:trace_ext
PROFILE_ALL  := quant gemm kv
NCU_SECTIONS := SpeedOfLight LaunchStats Occupancy WarpStateStats SchedulerStats ComputeWorkloadAnalysis MemoryWorkloadAnalysis
# section counters, one text report per case group
gpu-profile:
	for c in $(or $(PROFILE_CASES),$(PROFILE_ALL)); do \
	  echo "=== ncu $$c"; $(NCU) $(foreach s,$(NCU_SECTIONS),--section $(s)) \
	    python3 bench/profile_kernels.py $$c > $(GPU_TMP)/ncu_$$c.txt 2>&1; \
	  echo "rc=$$?"; grep -c "Section: GPU Speed Of Light" $(GPU_TMP)/ncu_$$c.txt; \
	done

# per-SASS-instruction execution counts and stall samples (source page as CSV) of the same kernels
gpu-sass:
	for c in $(or $(PROFILE_CASES),$(PROFILE_ALL)); do \
	  echo "=== ncu source $$c"; $(NCU) \
	    --section SourceCounters --section InstructionStats -f -o $(GPU_TMP)/rep_$$c python3 bench/profile_kernels.py $$c > $(GPU_TMP)/ncu_src_$$c.log 2>&1; \
	  echo "rc=$$?"; ncu -i $(GPU_TMP)/rep_$$c.ncu-rep --page source --csv --print-source sass > $(GPU_TMP)/sass_$$c.csv 2>&1; \
	  echo "rc=$$?"; ls -la $(GPU_TMP)/sass_$$c.csv; \
	done

gpu: gpu-build
	-$(MAKE) gpu-test
	-$(MAKE) gpu-bench
	mkdir -p $(GPU_OUT) && tar czf $(GPU_OUT)/results.tgz -C $(GPU_TMP) .

clean:
	rm -rf build dist *.egg-info build.log python/trace_ext/_build_config.py
