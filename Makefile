# Two commands do all the set-up on a fresh machine (see README):
#   make run    the main job on embedded defaults
#   make test   the test suite
# Both create .venv and install into it when setup.cfg or pyproject.toml changed.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
STAMP  := $(VENV)/.installed

.PHONY: run test test-quick converge bench clean seekdisk

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# the CPU build that lies on these machines; setup.cfg's range accepts it, so
	# GPU users keep the CUDA build they installed
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/capes demo

test: $(STAMP)
	$(VENV)/bin/pytest -q

# everything but the tests marked slow (real processes, whole runs): a minute or less
test-quick: $(STAMP)
	$(VENV)/bin/pytest -q -m "not slow"

converge: $(STAMP)
	$(VENV)/bin/capes converge-test --noise 1%,10%,50% --reward diff,diff_avg,diff_ewma \
	    --seeds 30 --jobs 2 --json converge-grid.json --plot converge-grid.png

# the emulated seek disk (tools/seekdisk, docs/targets.md): needs libfuse3-dev, pkg-config
seekdisk:
	$(MAKE) -C tools/seekdisk

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
