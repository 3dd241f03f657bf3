# The two commands in README.md: `make example` and `make test`.
# Both run the idempotent set-up first (system packages, virtualenv, guest image).
VENV ?= .venv
PYTEST_ARGS ?=

.PHONY: setup example test bench clean-cache

setup:
	@scripts/setup.sh

example: setup
	cd examples && ../$(VENV)/bin/pytest --forkd-snapshot=base $(PYTEST_ARGS)

test: setup
	$(VENV)/bin/pytest tests $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/forkd bench

clean-cache:
	rm -rf "$${XDG_CACHE_HOME:-$$HOME/.cache}/pytest-forkd"
