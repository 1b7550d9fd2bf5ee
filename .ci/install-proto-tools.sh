#!/usr/bin/env bash
# Installs the tools that regenerate proto/meshnode/v1 (see proto/README.md):
# protoc, protoc-gen-go, protoc-gen-go-grpc and buf. Idempotent: each tool is
# installed only when missing or at another version, so it is cheap to rerun.
#
# Versions are pinned so that regenerating gives byte-identical files:
# protoc-gen-go matches the google.golang.org/protobuf in go.mod, and
# protoc-gen-go-grpc v1.6.2 emits code for grpc >= v1.81 (go.mod has v1.85.0).
set -euo pipefail

PROTOC_GEN_GO_VERSION=v1.36.12
PROTOC_GEN_GO_GRPC_VERSION=v1.6.2
BUF_VERSION=1.75.0

GOBIN_DIR="$(go env GOBIN)"
[ -n "$GOBIN_DIR" ] || GOBIN_DIR="$(go env GOPATH)/bin"

log() { echo "install-proto-tools: $*"; }

# protoc: buf does not need it, but `protoc` users and some editors do.
if ! command -v protoc >/dev/null 2>&1; then
	log "installing protoc (Debian protobuf-compiler)"
	export DEBIAN_FRONTEND=noninteractive
	if ! apt-get install -y --no-install-recommends protobuf-compiler; then
		apt-get update
		apt-get install -y --no-install-recommends protobuf-compiler
	fi
fi

# go_tool_version prints the module version a Go binary was built from, or
# nothing when the binary is missing.
go_tool_version() {
	[ -x "$1" ] || return 0
	go version -m "$1" 2>/dev/null | awk '$1 == "mod" { print $3; exit }'
}

# GOFLAGS from the environment (e.g. -mod=vendor) must not leak into
# `go install pkg@version`, which always builds outside the main module.
if [ "$(go_tool_version "$GOBIN_DIR/protoc-gen-go")" != "$PROTOC_GEN_GO_VERSION" ]; then
	log "installing protoc-gen-go $PROTOC_GEN_GO_VERSION"
	GOFLAGS= go install "google.golang.org/protobuf/cmd/protoc-gen-go@$PROTOC_GEN_GO_VERSION"
fi
if [ "$(go_tool_version "$GOBIN_DIR/protoc-gen-go-grpc")" != "$PROTOC_GEN_GO_GRPC_VERSION" ]; then
	log "installing protoc-gen-go-grpc $PROTOC_GEN_GO_GRPC_VERSION"
	GOFLAGS= go install "google.golang.org/grpc/cmd/protoc-gen-go-grpc@$PROTOC_GEN_GO_GRPC_VERSION"
fi

# buf ships as an npm package whose binary comes inside the package.
have_buf=""
if command -v buf >/dev/null 2>&1; then
	have_buf="$(buf --version 2>/dev/null || true)"
fi
if [ "$have_buf" != "$BUF_VERSION" ]; then
	log "installing buf $BUF_VERSION (npm)"
	npm install -g --no-fund --no-audit "@bufbuild/buf@$BUF_VERSION"
fi

case ":$PATH:" in
*":$GOBIN_DIR:"*) ;;
*) log "note: add $GOBIN_DIR to PATH so buf finds the protoc-gen-* plugins" ;;
esac

log "protoc $(protoc --version | awk '{print $2}'), protoc-gen-go $(go_tool_version "$GOBIN_DIR/protoc-gen-go"), protoc-gen-go-grpc $(go_tool_version "$GOBIN_DIR/protoc-gen-go-grpc"), buf $(buf --version)"
