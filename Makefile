# knownstate: `make verify` runs the gate, `make test` runs the test suite. Both set everything up first.
.PHONY: setup verify lint test test-fast mutants bench clean

setup:
	@bash scripts/setup.sh

# JOBS runs the gate's kinds as that many processes side by side (README, "--jobs"); JOBS=1, one
# after another. The runs and verdicts are the same either way.
JOBS ?= 2

verify: setup
	.venv/bin/knownstate verify --jobs $(JOBS)

# 100 columns, pyflakes and one format (DESIGN.md, Lessons 6); the settings are in pyproject.toml.
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

# WORKERS pytest processes (pytest-xdist), each with its own PostgreSQL and Toxiproxy; a test
# file stays whole on one worker, in its order. WORKERS=0 runs the suite in this one process.
# Three on two cores: the tests wait on servers much of their time, and beside other load three
# processes get a larger share of the cores (fresh clone beside two CPU hogs: 22.4 min with two
# workers, 20.1 min with three; both green). Four do not pay: with the heaviest files first,
# beside two hogs the tests took 1,045 s with four and 1,092 s with three, within the noise.
# --durations: the 25 slowest tests, so the suite's time is measured where it goes.
WORKERS ?= 3
# The heaviest files first (tests/conftest.py, HEAVY), not xdist's order by count of tests.
PYTEST = .venv/bin/python -m pytest tests -n $(WORKERS) --dist loadfile --no-loadscope-reorder

test: lint
	$(PYTEST) --durations=25

test-fast: setup
	$(PYTEST) -m "not slow"

mutants: setup
	.venv/bin/knownstate mutants

clean:
	rm -rf .venv tools
