# trajbus: the two commands a newcomer needs are `make demo` and `make test`.
# Both do all set-up (virtualenv, install, Kafka jars from Maven Central, broker start/stop)
# and are idempotent.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
# Six pytest workers (pytest-xdist), each with its own broker: the broker and fault tests mostly
# wait on the network, on Kafka's timers and on restarts, so six of them share 2 cores (the test
# brokers run a lean JVM, tests/conftest.py; RELIABILITY.md, "Test suite time"). The slowest
# layer is collected first (pyproject's testpaths) so the long tests start early. Tests on the
# 3-node cluster stay together on one worker per xdist_group. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 6
XDIST := $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadgroup)

.PHONY: demo test test-fast test-unit test-kafka test-faults lint bench soak setup jars spark-jars browser promtool clean help

help:
	@echo "make demo   - run the main job: local Kafka, processors, simulated fleet, archive"
	@echo "make test   - set up and run the whole test suite against a real local broker"
	@echo "make test-unit - tests/unit: no broker, no Java, no set-up of Kafka (under a minute)"
	@echo "make test-kafka / test-faults - tests/kafka (a real broker) / tests/faults (kills, outages)"
	@echo "make bench  - run the benchmarks under bench/ and write BENCHMARKS.md"
	@echo "make soak   - the pipeline 10x under stress (CPU hogs, worker SIGKILL, broker restarts)"
	@echo "             then the scale test (20,000 open episodes: SIGKILL, join, leave)"
	@echo "make lint   - ruff + mypy (the whole trajbus package, imports between modules checked)"

setup: $(STAMP) jars browser promtool

# Headless Chromium renders the waterfall report in a test; without it that one test skips.
browser:
	@command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    (apt-get update -qq && apt-get install -y -qq --no-install-recommends \
	      chromium-headless-shell >/dev/null) ; } || \
	  echo "note: no headless Chromium; the HTML report rendering test will be skipped"

# promtool checks the shipped Prometheus alert rules (infra/monitoring/) in a test; without it
# that check skips (the metric names the rules and dashboard use are checked all the same).
promtool:
	@command -v promtool >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    (apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 || \
	     (apt-get update -qq && apt-get install -y -qq --no-install-recommends \
	      prometheus >/dev/null)) ; } || \
	  echo "note: no promtool; the alert rules' promtool check will be skipped"

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[test,bench]'
	@touch $(STAMP)

jars: $(STAMP)
	$(VENV)/bin/trajbus kafka jars

# hadoop-aws and the AWS SDK modules Spark needs for s3a:// (13 MB, into infra/spark/lib; see
# infra/spark/pom.xml). Not part of `setup`: the Spark-over-S3 test fetches them on first use.
spark-jars: $(STAMP)
	$(PY) -m trajbus.infra.s3a

demo: setup
	$(VENV)/bin/trajbus demo $(DEMO_ARGS)

test: setup
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# The layers (tests/unit, tests/kafka, tests/faults; see tests/conftest.py). tests/unit needs no
# broker and no Java, and sets none up: the fast loop while editing.
test-unit: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup tests/unit $(PYTEST_ARGS)

test-kafka: setup
	$(PY) -m pytest $(XDIST) tests/kafka $(PYTEST_ARGS)

test-faults: setup
	$(PY) -m pytest $(XDIST) tests/faults $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

# mypy checks the folders as the one installed package `trajbus` (.ci/typecheck.py lays them out
# so under build/mypy with symlinks), so calls between trajbus's modules are type-checked.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) .ci/typecheck.py

bench: setup
	$(PY) bench/run_all.py

# The soak, then the scale test (issue 18: 20,000 open episodes, worker SIGKILL/restart, a worker
# joining and leaving; not in `make test`); both run, the target fails if either did.
soak: setup
	rc=0; \
	$(PY) tests/soak.py $(SOAK_ARGS) || rc=1; \
	TRAJBUS_SCALE_TEST=1 $(PY) -m pytest -m slow -s tests/faults/test_scale_recovery.py || rc=1; \
	exit $$rc

clean:
	rm -rf .trajbus build *.egg-info
