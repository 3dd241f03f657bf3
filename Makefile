# The commands in README.md: `make example`, `make example-port` and `make test`; `make lint` and `make docs` are what CI adds.
# Both run the idempotent set-up first (system packages, virtualenv, guest image).
VENV ?= .venv
PYTEST_ARGS ?=
# What `make test` runs: the whole suite unless a part is named (TESTS="tests/unit tests/plugin"),
# in TEST_WORKERS pytest-xdist workers (0 runs it in one process).
TESTS ?= tests
TEST_WORKERS ?= 2

.PHONY: setup example example-port test test-fast lint bench clean-cache docs

setup:
	@scripts/setup.sh

example: setup
	cd examples && ../$(VENV)/bin/pytest --forkd-snapshot=base $(PYTEST_ARGS)

# A real project's test suite (toolz, from its sdist) run with `pytest --forkd-isolate`: examples/port_project.
example-port: setup
	$(VENV)/bin/python examples/port_project/run.py $(PYTEST_ARGS)

test: setup
	@scripts/setup.sh --test-tools
	$(VENV)/bin/pytest $(TESTS) -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The fast layer, for the edit-test loop: no QEMU, no container tooling, under 30 s (over the cores; -n 0: one process)
# (docs/contributing.md). Needs only the virtualenv.
test-fast:
	@test -x $(VENV)/bin/pytest || scripts/setup.sh
	$(VENV)/bin/pytest -m "not vm" tests $(PYTEST_ARGS)

# Lint, format check and strict type check, each reported; fails if any of them fails.
lint: setup
	@status=0; \
	echo "lint: ruff check"; $(VENV)/bin/ruff check . || status=1; \
	echo "lint: ruff format --check"; $(VENV)/bin/ruff format --check . || status=1; \
	echo "lint: mypy --strict"; $(VENV)/bin/mypy --strict || status=1; \
	exit $$status

# The documentation site (mkdocs.yml) into site/, in strict mode: a broken link, anchor or reference fails.
# Needs only the virtualenv (set up first if missing) and the docs extra (installed if missing), not QEMU.
docs:
	@test -x $(VENV)/bin/pip || scripts/setup.sh
	@$(VENV)/bin/python -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null \
		|| $(VENV)/bin/pip install -q --disable-pip-version-check -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

bench: setup
	$(VENV)/bin/forkd bench

clean-cache:
	rm -rf "$${XDG_CACHE_HOME:-$$HOME/.cache}/pytest-forkd"
