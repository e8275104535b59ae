# Tessera's front door. Every target first runs scripts/bootstrap.sh, which
# installs what is missing (Debian packages, the pinned LibTorch) and takes
# seconds when nothing is.
#
#   make build   configure and build into build/ (binaries in build/bin/)
#   make test    build, check the module rules (make check-modules), then run every test with ctest
#   make check-modules  every file includes only headers of what its target links, and
#                docs/modules.dot is current
#   make demo    build, then train a small model end to end on this machine
#   make bench   build, then run the CPU benchmarks (BENCH="trainer ..." picks some)
#   make bench-gpu  build, then run the GPU benchmarks (needs a CUDA build and a GPU)
#   make gpu-check  on a machine with a GPU: build with CUDA (or take the GPU_BUNDLE), run every
#                GPU test, the trainer's --check, gpt2-124m and qwen3-0.6b through a coordinator
#                and worker, and bench-gpu; one JSON + a summary (scripts/gpu_check.py)
#   make gpu-bundle  here, for a GPU machine without a package registry: a CUDA build's
#                binaries and the libraries they need in GPU_BUNDLE (scripts/gpu_bundle.sh)
#   make thread-safety  build the control plane and the trainer's plain-C++ libraries with
#                clang-14, -Wthread-safety -Werror (into build-tsa/): every ABSL_GUARDED_BY and
#                lock annotation checked, every dropped absl::Status an error (.ci/run runs it)
#   make fuzz    build the fuzz targets (tests/fuzz, with clang into build-fuzz/), then run
#                each for FUZZ_SECONDS (FUZZERS="job_spec ..." picks some)
#   make chaos   build, then run the chaos soak (tests/chaos, as root): kills and partitions at
#                random while jobs train, for CHAOS_DURATION (15m); CHAOS_SEED replays a run
#                (0: a new seed, printed); counts as JSON in CHAOS_RESULTS. Not part of `make test`
#   make image   build the GPU and CPU container images with buildah (scripts/image.sh,
#                docs/image.md); make image-test builds them unless present, then tests inside
#
# `make test` also builds the fuzz targets and runs their ctest: each target for a fixed number
# of iterations over its seed corpus, and every checked-in regression input.
#
# Variables: BUILD_DIR (build), BUILD_TYPE (Release), WITH_CUDA (AUTO|ON|OFF), WERROR (ON|OFF),
# JOBS (number of cores), CTEST_ARGS (extra ctest arguments, e.g. -L unit),
# FUZZ_DIR (build-fuzz), FUZZ_SECONDS (60), FUZZ_CTEST_ARGS (extra ctest arguments of the fuzz
# build, e.g. -L fuzz-regression for the regression inputs alone).

BUILD_DIR  ?= build
BUILD_TYPE ?= Release
WITH_CUDA  ?= AUTO
# ON: the project's own code must build without a compiler warning (CI's build); OFF for a
# compiler the project does not build with (another GCC or Clang may warn where GCC 12 does not).
WERROR     ?= ON
JOBS       ?= $(shell nproc)
CTEST_ARGS ?=
FUZZ_DIR   ?= build-fuzz
TSA_DIR    ?= build-tsa
FUZZ_SECONDS ?= 60
FUZZ_CTEST_ARGS ?=
FUZZERS    ?=
GPU_BUNDLE ?= .gpu-bundle
GPU_CHECK_ARGS ?=
CHAOS_DURATION ?= 15m
CHAOS_SEED ?= 0
CHAOS_RESULTS ?= $(BUILD_DIR)/chaos-results.json
CHAOS_ARGS ?=

.PHONY: all bootstrap configure build test check-modules demo bench bench-gpu gpu-check gpu-bundle fuzz-build fuzz \
  thread-safety \
  format clean

all: build

bootstrap:
	@scripts/bootstrap.sh

configure: bootstrap
	@mkdir -p $(BUILD_DIR)
	@cmake -S . -B $(BUILD_DIR) -G Ninja \
	  -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DTESSERA_WITH_CUDA=$(WITH_CUDA) \
	  -DTESSERA_WERROR=$(WERROR) \
	  -DTESSERA_PYTHON="$$(scripts/bootstrap.sh --print-python)" \
	  -DTESSERA_TOOLS_PYTHON="$$(scripts/bootstrap.sh --print-tools-python)" > $(BUILD_DIR)/configure.log 2>&1 \
	  || { cat $(BUILD_DIR)/configure.log; exit 1; }
	@grep -E '^-- Tessera' $(BUILD_DIR)/configure.log || true

build: configure
	@cmake --build $(BUILD_DIR) -j $(JOBS)

test: build fuzz-build check-modules
	@cd $(BUILD_DIR) && ctest -j $(JOBS) --output-on-failure $(CTEST_ARGS)
	@cd $(FUZZ_DIR) && ctest -j $(JOBS) --output-on-failure $(FUZZ_CTEST_ARGS)

# The module rules the compiler cannot see: every file includes only headers of the libraries its
# target links (scripts/check_includes.py), and docs/modules.dot is the graph the build draws.
check-modules: configure
	@python3 scripts/check_includes.py $(BUILD_DIR)
	@scripts/module_graph.sh --check $(BUILD_DIR)

demo: build
	@scripts/demo.sh $(BUILD_DIR)

bench: build
	@scripts/bench.sh $(BUILD_DIR) cpu $(BENCH)

bench-gpu: build
	@scripts/bench.sh $(BUILD_DIR) gpu $(BENCH)

# With a bundle from `make gpu-bundle` nothing is built or installed (the machine may reach no
# package registry); otherwise this builds with CUDA first. A bundle that came as its archive
# (GPU_BUNDLE.tgz, the smaller thing to copy) is unpacked beside it first.
gpu-check:
	@if [ ! -f "$(GPU_BUNDLE)/BUNDLE" ] && [ -f "$(GPU_BUNDLE).tgz" ]; then \
	  echo "gpu-check: unpacking $(GPU_BUNDLE).tgz"; \
	  tar -xzf "$(GPU_BUNDLE).tgz" -C "$$(dirname "$(GPU_BUNDLE)")" || exit 1; \
	fi
	@if [ -f "$(GPU_BUNDLE)/BUNDLE" ]; then \
	  echo "gpu-check: binaries from the bundle $(GPU_BUNDLE):"; sed 's/^/  /' "$(GPU_BUNDLE)/BUNDLE"; \
	  python3 scripts/gpu_check.py --build-dir="$(GPU_BUNDLE)" $(GPU_CHECK_ARGS); \
	else \
	  $(MAKE) --no-print-directory build WITH_CUDA=ON && \
	  python3 scripts/gpu_check.py --build-dir="$(BUILD_DIR)" $(GPU_CHECK_ARGS); \
	fi

gpu-bundle:
	@$(MAKE) --no-print-directory build WITH_CUDA=ON
	@scripts/gpu_bundle.sh $(BUILD_DIR) $(GPU_BUNDLE)

# libFuzzer is Clang's and the main build uses GCC: the fuzz targets are a build of their own.
fuzz-build: bootstrap
	@mkdir -p $(FUZZ_DIR)
	@cmake -S tests/fuzz -B $(FUZZ_DIR) -G Ninja \
	  -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 > $(FUZZ_DIR)/configure.log 2>&1 \
	  || { cat $(FUZZ_DIR)/configure.log; exit 1; }
	@cmake --build $(FUZZ_DIR) -j $(JOBS)

# Clang's thread-safety analysis over everything that carries lock annotations and needs no
# LibTorch; under clang, absl::Status is [[nodiscard]] too, so -Werror also stops a dropped Status.
thread-safety: bootstrap
	@mkdir -p $(TSA_DIR)
	@cmake -S . -B $(TSA_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
	  -DCMAKE_CXX_FLAGS="-Wthread-safety -Werror" \
	  -DTESSERA_WITH_TORCH=OFF \
	  > $(TSA_DIR)/configure.log 2>&1 || { cat $(TSA_DIR)/configure.log; exit 1; }
	@cmake --build $(TSA_DIR) -j $(JOBS)
	@echo "thread-safety: clang -Wthread-safety -Werror build passed"

fuzz: fuzz-build
	@tests/fuzz/run_fuzzers.sh $(FUZZ_DIR) $(FUZZ_SECONDS) $(FUZZERS)

format:
	@git ls-files '*.cc' '*.h' | xargs clang-format -i

clean:
	@rm -rf $(BUILD_DIR) $(FUZZ_DIR) $(TSA_DIR)

# Container images (docs/image.md): buildah, no daemon or registry needed; not part of `make test`.
.PHONY: image image-test
image:
	@scripts/image.sh build

image-test:
	@scripts/image.sh test

# The chaos soak (tests/chaos/chaos_soak.h): needs root for its network namespaces.
.PHONY: chaos
chaos: configure
	@cmake --build $(BUILD_DIR) -j $(JOBS) --target tessera-chaos-soak
	@$(BUILD_DIR)/tests/tessera-chaos-soak --duration=$(CHAOS_DURATION) --seed=$(CHAOS_SEED) \
	  --results=$(CHAOS_RESULTS) $(CHAOS_ARGS)
