# knownstate: `make verify` runs the gate, `make test` runs the test suite. Both set everything up first.
.PHONY: setup verify lint test test-fast mutants bench clean

setup:
	@bash scripts/setup.sh

verify: setup
	.venv/bin/knownstate verify

# 100 columns, pyflakes and one format (DESIGN.md, Lessons 6); the settings are in pyproject.toml.
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

# --durations: the 25 slowest tests, so the suite's time is measured where it goes.
test: lint
	.venv/bin/python -m pytest tests --durations=25

test-fast: setup
	.venv/bin/python -m pytest tests -m "not slow"

mutants: setup
	.venv/bin/knownstate mutants

clean:
	rm -rf .venv tools
