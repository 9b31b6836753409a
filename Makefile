# Wormhole: `make run` for the quickstart demo, `make test` for the whole suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
RUN_STAMP := $(VENV)/.installed-run

.PHONY: run test lint bench soak install services clean

# What the quickstart needs: the package and its own dependencies (about 60 MB), no extras.
$(RUN_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e .
	touch $(RUN_STAMP)

# Everything the tests need: the connectors' client libraries, Spark, the brokers, the tools.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP) $(RUN_STAMP)

install: $(STAMP)

## The quickstart: produce rider positions into a file log, deliver them to two applications.
run: $(RUN_STAMP)
	$(BIN)/python -m wormhole.demo produce --out data/quickstart/rider-gps --riders 5000 --seconds 20
	$(BIN)/wormhole --log-level warning run pipelines/quickstart.yml --once
	$(BIN)/python -m wormhole.demo show pipelines/quickstart.yml

## System services the tests need (Debian packages, installed where missing).
services:
	bash scripts/install-services.sh postgresql mariadb-server memcached zookeeper prometheus tmux

lint: $(STAMP)
	$(BIN)/ruff check wormhole tests bench
	$(BIN)/ruff format --check wormhole tests bench
	$(BIN)/mypy wormhole
	$(BIN)/lint-imports

test: $(STAMP) services lint
	$(BIN)/python -m pytest

## The multiple-copy fault loop of `make test`, longer (SOAK_FAULTS faults a source; replay a
## run with WORMHOLE_CHAOS_SEED=N).
SOAK_FAULTS ?= 60
soak: $(STAMP) services
	WORMHOLE_COPIES_FAULTS=$(SOAK_FAULTS) $(BIN)/python -m pytest -s \
		tests/test_multiple_copy_faults.py

bench: $(STAMP)
	$(BIN)/python bench/filelog_throughput.py
	$(BIN)/python bench/publisher_log.py
	$(BIN)/python bench/metrics.py
	$(BIN)/python bench/tcp_delivery.py
	$(BIN)/python bench/postgres_throughput.py
	$(BIN)/python bench/postgres_snapshot.py
	$(BIN)/python bench/mysql_throughput.py
	$(BIN)/python bench/backfill.py
	$(BIN)/python bench/backfill_mysql.py
	$(BIN)/python bench/snapshots.py
	$(BIN)/python bench/snapshot_stages.py
	$(BIN)/python bench/spark_sink.py
	$(BIN)/python bench/spark_source.py
	$(BIN)/python bench/memcache_sink.py
	$(BIN)/python bench/search_sink.py
	$(BIN)/python bench/kafka_transport.py
	$(BIN)/python bench/caravans.py
	$(BIN)/python bench/registry.py
	$(BIN)/python bench/multiple_copy.py
	$(BIN)/python bench/multiple_copy_partitions.py

clean:
	rm -rf .wormhole out data/quickstart
