# lamina: one non-recursive Makefile (style.md habit 18).
#   make            build build/lamina, build/lamina-worker and every test binary
#   make test       build and run every CPU test (CI)
#   make test-gpu   build and run the GPU tests (needs a CUDA device)
#   DEBUG=1         -O0 -g;  SAN=address,undefined  sanitizers
# Outputs go under build/ (build/san-*/ for sanitizer builds).

CC      ?= cc
CXX     ?= c++
NVCC    ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
PKGS    := libpcre2-8 libzmq libprotobuf-c
# The GPU architectures lamina ships for, listed once: code for sm_90 (H100/H200), sm_75,
# sm_86 and sm_89 (Turing, Ampere, Ada), and PTX for compute_90 and compute_80, which the
# driver compiles at first use for a card none of them runs (compute_90 for Blackwell,
# compute_80 for an A100, A30 or Jetson Orin: their tensor-core attention, cp.async and
# int8 tensor-core prefill, which compute_75's PTX, shipped before, lacked): the kernels
# then take the paths of the code's architecture (kernels/cuda/caps.h).
CUDA_ARCHS := -gencode=arch=compute_90,code=[sm_90,compute_90] \
              -gencode=arch=compute_75,code=sm_75 -gencode=arch=compute_80,code=compute_80 \
              -gencode=arch=compute_86,code=sm_86 -gencode=arch=compute_89,code=sm_89
# nvcc compiles a file's architectures this many at a time (the int8 decode
# products take minutes per architecture: one after the other they were the
# build's longest path)
NVCC_THREADS ?= 2
# NVCC_DEFS: extra defines for the CUDA files (-DLAMINA_MVQ_PROBE: the decode
# router's and the int8 products' marks for LAMINA_CUDA_PROBE, a diagnostic
# build; kernels/cuda/mvq.h)
NVCC_DEFS ?=

ifdef SAN
BUILD   := build/san
OPT     := -O1 -g -fno-omit-frame-pointer -fsanitize=$(SAN)
LDSAN   := -fsanitize=$(SAN)
else ifdef DEBUG
BUILD   := build/debug
OPT     := -O0 -g
else
BUILD   := build
OPT     := -O2 -g
endif

CFLAGS  := -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -I. -Ibuild/gen $(OPT) -MMD -MP \
           -pthread $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
# C++ for host tests of headers the CUDA kernels share with the host (tests/test_*.cpp):
# no exceptions or RTTI, so cc links them as it links the C tests
CXXFLAGS := -std=c++17 -D_GNU_SOURCE -Wall -Wextra -Werror -Wno-unknown-pragmas -fno-exceptions \
            -fno-rtti -I. -Ibuild/gen $(OPT) -MMD -MP -pthread
LDLIBS  := $(LDSAN) -pthread $(shell pkg-config --libs $(PKGS) 2>/dev/null) -lm

LIB_SRCS := $(wildcard common/*.c model/*.c kernels/cpu/*.c ipc/*.c) \
            $(filter-out worker/main.c,$(wildcard worker/*.c)) \
            $(filter-out coordinator/main.c,$(wildcard coordinator/*.c))
# protobuf-c code generated from proto/*.proto under build/gen (never committed).
PROTO_GEN := build/gen/proto/lamina.pb-c.c build/gen/proto/lamina.pb-c.h
LIB_OBJS := $(LIB_SRCS:%.c=$(BUILD)/%.o) $(BUILD)/proto/lamina.pb-c.o
LIB      := $(BUILD)/liblamina.a
TEST_SRCS := $(wildcard tests/test_*.c)
TESTS    := $(TEST_SRCS:tests/%.c=$(BUILD)/tests/%) \
            $(patsubst tests/%.cpp,$(BUILD)/tests/%,$(wildcard tests/test_*.cpp))
CU_SRCS  := $(wildcard kernels/cuda/*.cu)
CU_OBJS  := $(if $(NVCC),$(CU_SRCS:%.cu=$(BUILD)/%.o))
BINS     := $(BUILD)/lamina $(BUILD)/lamina-worker
# CUDA: every .cu builds where nvcc exists; the CUDA backend and the GPU tests
# link against the static runtime so the binaries run on any driver >= 13.
ifneq ($(NVCC),)
CUDA_HOME := $(patsubst %/bin/nvcc,%,$(NVCC))
CFLAGS   += -DLAMINA_CUDA -isystem $(CUDA_HOME)/include
CUDA_LIB := $(BUILD)/liblamina_cuda.a
CUDA_LDLIBS := $(CUDA_LIB) -L$(CUDA_HOME)/lib64 -lcudart_static -lstdc++ -ldl -lrt
GPU_TEST_SRCS := $(wildcard tests/gpu/test_*.c)
GPU_TESTS := $(GPU_TEST_SRCS:tests/gpu/%.c=$(BUILD)/tests/gpu/%)
# tools/cuda: diagnostics that need more of the toolkit (CUPTI), built where it is there.
CUDA_TOOLS := $(if $(wildcard $(CUDA_HOME)/include/cupti.h),$(BUILD)/tools/graph_trace)
endif

.PHONY: all test test-gpu clean cuda demo
TOOLS    := $(patsubst tools/%.c,$(BUILD)/tools/%,$(wildcard tools/*.c))
all: $(BINS) $(TESTS) $(TOOLS) $(CU_OBJS) $(GPU_TESTS) $(CUDA_TOOLS)

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

build/gen/proto/%.pb-c.c build/gen/proto/%.pb-c.h: proto/%.proto
	@mkdir -p build/gen
	protoc-c --c_out=build/gen $<

$(BUILD)/tests/%.o: tests/%.cpp
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) -c $< -o $@

$(BUILD)/proto/%.pb-c.o: build/gen/proto/%.pb-c.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

# Anything may include a generated header: make it exist before compiling.
$(LIB_OBJS) $(TESTS:%=%.o) $(TOOLS:%=%.o) $(BUILD)/coordinator/main.o $(BUILD)/worker/main.o: | $(PROTO_GEN)

$(BUILD)/kernels/cuda/%.o: kernels/cuda/%.cu
	@mkdir -p $(dir $@)
	$(NVCC) -O3 -std=c++17 -I. $(CUDA_ARCHS) $(NVCC_DEFS) --threads $(NVCC_THREADS) -Xcompiler -Wall,-Werror \
	    -MMD -MP -c $< -o $@

$(CUDA_LIB): $(CU_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/tests/gpu/%: $(BUILD)/tests/gpu/%.o $(LIB) $(CUDA_LIB)
	$(CC) -o $@ $< $(LIB) $(CUDA_LDLIBS) $(LDLIBS)

$(LIB): $(LIB_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/lamina: $(BUILD)/coordinator/main.o $(LIB) $(CUDA_LIB)
	$(CC) -o $@ $(BUILD)/coordinator/main.o $(LIB) $(CUDA_LDLIBS) $(LDLIBS)

$(BUILD)/tools/%: $(BUILD)/tools/%.o $(LIB) $(CUDA_LIB)
	$(CC) -o $@ $< $(LIB) $(CUDA_LDLIBS) $(LDLIBS)

$(BUILD)/tools/graph_trace: $(BUILD)/tools/cuda/graph_trace.o $(LIB) $(CUDA_LIB)
	$(CC) -o $@ $< $(LIB) $(CUDA_LDLIBS) -lcupti $(LDLIBS)

$(BUILD)/lamina-worker: $(BUILD)/worker/main.o $(LIB) $(CUDA_LIB)
	$(CC) -o $@ $(BUILD)/worker/main.o $(LIB) $(CUDA_LDLIBS) $(LDLIBS)

$(BUILD)/tests/%: $(BUILD)/tests/%.o $(LIB) $(CUDA_LIB) | $(BINS)
	$(CC) -o $@ $< $(LIB) $(CUDA_LDLIBS) $(LDLIBS)

cuda: $(CU_OBJS)

# The README's first command: a small synthetic qwen3next model, then text from a
# coordinator and two CPU workers (half the experts on the coordinator's CPU pool).
# With the project's shared fixtures next to the clone, the small trained
# qwen3next model (Python source) writes a continuation that reads as code;
# else a synthetic model with random weights (random text) stands in.
TRAINED_MODEL := ../shared/fixtures/small-model/qwen3next-small-q8_0.gguf
SYNTH_MODEL := models/demo-qwen3next-tiny-q8_0.gguf
$(SYNTH_MODEL): | $(BUILD)/lamina
	@mkdir -p models
	$(BUILD)/lamina gen-model --arch qwen3next --shape tiny --type q8_0 --heat zipf:1.0 --seed 7 -o $@

ifneq ($(wildcard $(TRAINED_MODEL)),)
demo: all
	$(BUILD)/lamina run -m $(TRAINED_MODEL) \
		-p "$$(printf 'import os\ndef list_files(directory):\n    """')" \
		-n 48 --greedy --devices cpu,cpu --resident 50%
else
demo: all $(SYNTH_MODEL)
	$(BUILD)/lamina run -m $(SYNTH_MODEL) -p "The quick brown fox" -n 48 --seed 1 \
		--devices cpu,cpu --resident 50%
endif

test: all
	@BUILD=$(BUILD) sh tests/run.sh $(TESTS)

test-gpu: all
	@test -n "$(NVCC)" || { echo "test-gpu: nvcc not found"; exit 1; }
	@BUILD=$(BUILD) SYS_GLOB='tests/gpu/sys_*.sh' sh tests/run.sh $(GPU_TESTS)

# Two-GPU system tests (NCCL between two real devices); each says so and fails with exit 2
# on a machine with fewer GPUs.
.PHONY: test-gpu2
test-gpu2: all
	@test -n "$(NVCC)" || { echo "test-gpu2: nvcc not found"; exit 1; }
	@BUILD=$(BUILD) SYS_GLOB='tests/gpu2/sys_*.sh' sh tests/run.sh

clean:
	rm -rf build

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
