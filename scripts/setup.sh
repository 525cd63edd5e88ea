#!/usr/bin/env bash
# Idempotent set-up for `make verify` and `make test`: a .venv with the packages, the PostgreSQL 15
# server binaries, libfaketime and Chromium (apt, when missing), Toxiproxy v2.12.0 built with Go into
# tools/, and the TypeScript client of web/ (npm ci from its lockfile, then built with esbuild).
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
# Chromium for the document session's browser check: wanted, not required (without it that one
# check says so and exits 3; every other check runs).
chromium_ok() { [ -n "${KNOWNSTATE_CHROMIUM:-}" ] || command -v chromium >/dev/null || command -v chromium-browser >/dev/null; }
if ! chromium_ok; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    need_apt+=(chromium)
  else
    say "Chromium is missing and cannot be installed here (needs root and apt-get): the browser check will say so and exit 3"
  fi
fi
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

# 3. The TypeScript client (web/): npm ci from the lockfile when it changed, the bundles rebuilt when
# a source changed. Playwright drives Debian's Chromium: no browser is ever downloaded.
if command -v npm >/dev/null; then
  if [ ! -f web/node_modules/.package-lock.json ] || [ web/package-lock.json -nt web/node_modules/.package-lock.json ]; then
    say "installing the web client's toolchain (npm ci in web/)"
    (cd web && npm ci --no-audit --no-fund --loglevel=error) || die "npm ci in web/ failed (is the npm registry reachable?)"
  fi
  if [ ! -f web/dist/knownstate-client.js ] || [ -n "$(find web/src web/build.mjs web/package.json -newer web/dist/knownstate-client.js 2>/dev/null | head -1)" ]; then
    say "building the web client (npm run build in web/)"
    (cd web && npm run --silent build) || die "npm run build in web/ failed: see the TypeScript errors above"
  fi
else
  say "npm is missing: the web client (web/) is not built; install Node.js 20 and npm, or the browser check will say so and exit 3"
fi

# 4. The virtualenv and the packages; reinstalled only when pyproject.toml changed.
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  $PY -m venv .venv || die "python3 -m venv failed: install python3-venv"
fi
stamp=.venv/.knownstate-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  say "installing knownstate and its packages into .venv"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  # queues: the pinned libraries of examples/queues, whose ground-truth tests run in `make test`
  .venv/bin/python -m pip install -q -e '.[test,queues]' || die "pip install -e .[test,queues] failed: see the pip output above"
  touch "$stamp"
fi
