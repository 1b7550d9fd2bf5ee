# meshnode build. The cgo flags matter: without them ggml compiles with no SIMD.
#   make build     -> ./bin/meshnode (fast path: native SIMD + CPU_REPACK weights)
#   make test      -> the whole test suite (what .ci/run runs)
#   make portable  -> x86-64-v3 release build
#   make llamacpp-ref -> ./bin/llamacpp-ref: llama.cpp's own engine, the
#                     reference that bench and tests compare against
# A plain `go build ./...` still works; it is only slower (no SIMD, no repack).

GO        ?= go
OLLAMA_DIR = $(shell $(GO) list -m -f '{{.Dir}}' github.com/ollama/ollama)
MARCH     ?= native
GGML_INC   = -I$(OLLAMA_DIR)/ml/backend/ggml/ggml/include -I$(OLLAMA_DIR)/ml/backend/ggml/ggml/src

# ggml-cpu.cpp calls its AMX buffer type where the target has AMX-INT8
# (-march=native on Sapphire Rapids and later), but the ollama module
# builds no AMX sources: without -mno-amx-int8 every binary fails to link
# there. Compilers too old to know the flag know no AMX either.
NOAMX     := $(shell $(or $(CC),cc) -mno-amx-int8 -E -x c /dev/null >/dev/null 2>&1 && echo -mno-amx-int8)

export CGO_ENABLED  = 1
export CGO_CFLAGS   = -O3 -march=$(MARCH) $(NOAMX)
export CGO_CXXFLAGS = -O3 -march=$(MARCH) $(NOAMX)
export CGO_CPPFLAGS = -DGGML_USE_CPU_REPACK $(GGML_INC)
TAGS      ?= repack
# Where build writes the binary (deploy/gpu/bundle.sh sets it).
BIN       ?= bin/meshnode

.PHONY: build portable portable-check cuda-syntax test fuzz vet proto bench clean env serve llamacpp-ref

build:
	$(GO) build -tags '$(TAGS)' -o $(BIN) ./cmd/meshnode

portable:
	$(MAKE) build MARCH=x86-64-v3

# Prints the environment that `make` uses, for running go commands by hand:
#   eval "$$(make -s env)"; go test -tags repack ./ggufstage/
env:
	@echo "export CGO_ENABLED=1 CGO_CFLAGS='$(CGO_CFLAGS)' CGO_CXXFLAGS='$(CGO_CXXFLAGS)' CGO_CPPFLAGS='$(CGO_CPPFLAGS)'"

# llama.cpp's engine from the sources of the pinned ollama module (see
# deploy/llamacpp/Makefile); objects stay in ~/.cache/meshnode between builds.
llamacpp-ref:
	$(MAKE) -C deploy/llamacpp -j$(shell nproc) OUT=$(CURDIR)/bin MARCH=$(MARCH)

STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2

test: llamacpp-ref portable-check cuda-syntax
	$(GO) vet -tags '$(TAGS)' ./...
	test -z "$$(gofmt -l .)" || (gofmt -l .; echo "gofmt: the files above need formatting"; exit 1)
	$(GO) run $(STATICCHECK) -tags '$(TAGS)' ./...
	MESHNODE_LLAMACPP_REF=$(CURDIR)/bin/llamacpp-ref $(GO) test -tags '$(TAGS)' -count=1 -timeout 60m ./...
	$(GO) test -race -count=1 -timeout 20m ./stage/... ./node/ ./node/pipeline/ ./node/planner/ ./node/membership/ ./node/openai/ ./node/text/ ./node/sample/ ./node/wire/ ./node/weights/ ./node/admin/ ./node/childproc/ ./ggufstage/gguf/
	$(MAKE) fuzz

# Each fuzz target runs for FUZZTIME on top of its committed seed corpus
# (.ci/fuzz: a run that Go's fuzztime deadline race ends is tried again).
FUZZTIME ?= 10s
FUZZ = GO='$(GO)' FUZZTIME=$(FUZZTIME) .ci/fuzz
fuzz:
	$(FUZZ) FuzzRead ./ggufstage/gguf/ -tags '$(TAGS)'
	$(FUZZ) FuzzDecodeFrame ./node/wire/
	$(FUZZ) FuzzSocketStream ./node/pipeline/
	$(FUZZ) FuzzRender ./node/text/
	$(FUZZ) FuzzStream ./node/text/
	$(FUZZ) FuzzRequest ./node/openai/
	$(FUZZ) FuzzJSON ./node/sample/
	$(FUZZ) FuzzSchema ./node/sample/
	$(FUZZ) FuzzTokenizer ./ggufstage/ -tags '$(TAGS)'

# meshnode's own kernels (ggufstage/*.cpp) pick their instructions with
# target attributes, so they must compile for the portable release target
# too, not only for this machine's -march=native: a helper without the
# attribute builds here and fails 'make portable'. Compiling them alone
# (-c: the mismatch shows when inlining) takes seconds; the full portable
# build recompiles ggml.
portable-check:
	for f in ggufstage/*_amd64.cpp; do $(CXX) -c -o /dev/null -O3 -march=x86-64-v3 $(CGO_CPPFLAGS) $$f || exit 1; done

# The CUDA kernels (ggufstage/cuda, deploy/gpu) parsed and type-checked by
# clang against declarations of the CUDA API, where no toolkit is: they
# are built only on a GPU machine (deploy/gpu/build-cuda.sh).
cuda-syntax:
	deploy/gpu/cuda-syntax.sh

vet:
	$(GO) vet -tags '$(TAGS)' ./...
	test -z "$$(gofmt -l .)"
	$(GO) run $(STATICCHECK) -tags '$(TAGS)' ./...

proto:
	buf generate

bench: build llamacpp-ref
	./bin/meshnode bench

clean:
	rm -rf bin

serve: build
	./bin/meshnode serve
