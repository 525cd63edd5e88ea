#!/usr/bin/env bash
# Idempotent set-up for `make verify` and `make test`: a .venv with the packages, the PostgreSQL 15
# server binaries and libfaketime (apt, when missing), and Toxiproxy v2.12.0 built with Go into tools/.
# A second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "setup: $*"; }
die() { echo "setup: $*" >&2; exit 1; }

TOXIPROXY_VERSION=v2.12.0
PY=${PYTHON:-python3}

# 1. apt packages: PostgreSQL server binaries and libfaketime.
need_apt=()
pg_ok() {
  local b; b=$(pg_config --bindir 2>/dev/null || true)
  [ -n "$b" ] && [ -x "$b/initdb" ] && [ -x "$b/postgres" ] && return 0
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1
}
pg_ok || need_apt+=(postgresql-15)
compgen -G "/usr/lib/*/faketime/libfaketime.so.1" >/dev/null || compgen -G "/usr/lib/faketime/libfaketime.so.1" >/dev/null || need_apt+=(libfaketime)
if [ ${#need_apt[@]} -gt 0 ]; then
  command -v apt-get >/dev/null || die "missing ${need_apt[*]} and no apt-get here: install them with your package manager"
  [ "$(id -u)" = 0 ] || die "missing ${need_apt[*]}: run 'sudo apt-get install ${need_apt[*]}' (needs root)"
  say "installing ${need_apt[*]} with apt-get"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null \
    || die "apt-get install ${need_apt[*]} failed: install them by hand"
fi

# 2. Toxiproxy server, built from source with Go into tools/bin (git-ignored).
if [ ! -x tools/bin/toxiproxy-server ] || [ "$(cat tools/bin/.toxiproxy-version 2>/dev/null)" != "$TOXIPROXY_VERSION" ]; then
  command -v go >/dev/null || die "Go is needed to build toxiproxy-server: install Go (https://go.dev/dl) or put a toxiproxy-server $TOXIPROXY_VERSION at tools/bin/toxiproxy-server"
  say "building toxiproxy-server $TOXIPROXY_VERSION with go install"
  mkdir -p tools/bin tools/go
  tmpbin=$(mktemp -d)
  GOBIN="$tmpbin" GOPATH="$PWD/tools/go" GOFLAGS=-modcacherw go install "github.com/Shopify/toxiproxy/v2/cmd/server@$TOXIPROXY_VERSION" \
    || die "go install github.com/Shopify/toxiproxy/v2/cmd/server@$TOXIPROXY_VERSION failed (is the Go module proxy reachable?)"
  mv "$tmpbin/server" tools/bin/toxiproxy-server
  rmdir "$tmpbin"
  echo "$TOXIPROXY_VERSION" > tools/bin/.toxiproxy-version
fi

# 3. The virtualenv and the packages; reinstalled only when pyproject.toml changed.
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  $PY -m venv .venv || die "python3 -m venv failed: install python3-venv"
fi
stamp=.venv/.knownstate-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  say "installing knownstate and its packages into .venv"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -e '.[test]' || die "pip install -e .[test] failed: see the pip output above"
  touch "$stamp"
fi
