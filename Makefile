# The README's two commands: `make run` (the demo) and `make test`.
GO        ?= go
FUZZTIME  ?= 30s
BENCHTIME ?= 1s

.PHONY: run test bench bench-scale bench-micro fuzz lint screenshots

## run: the order-processor demo: embedded Kafka (kfake), a throwaway PostgreSQL, orders with
## duplicates, poison and a SIGKILL mid-stream, then a report and a verdict
run:
	scripts/ensure-deps.sh postgres
	$(GO) run ./examples/order-processor

## test: every test, with the race detector; starts the servers it needs
test:
	scripts/test.sh

## bench: the side-by-side benchmark (docs/performance.md): ceilings, naive, once per message and
## batched, then the outbox relay next to the broker's confirmed-publish ceiling and its latency
## across the hop, for Kafka (in-process kfake, and Apache Kafka: a throwaway node), and RabbitMQ (AMQP_URL,
## else a throwaway node started and stopped here); a durable throwaway PostgreSQL unless
## DATABASE_URL is set. RabbitMQ queues are declared lazy (-amqp-lazy: what classic queues do by
## default from RabbitMQ 3.12; BENCHFLAGS="-amqp-lazy=false" for the installed broker's default).
## The throwaway brokers keep their files in BENCH_BROKER_DIR (/dev/shm, memory, if it has 2 GiB free):
## on one disk their writes stall PostgreSQL's WAL flushes, which brokers on hosts of their own
## would not (docs/performance.md). BENCHFLAGS="-n 100000". The consumer rows run BENCH_RUNS times in a row,
## and the targets give every run's value. Then the Kafka offsets-in-PostgreSQL rows
## (OFFSETS_BENCH_N records each, twice).
BENCH_RUNS ?= 3
# /dev/shm when it is writable with 2 GiB free (Apache Kafka's log grows to about 600 MB in a
# make bench; containers often give /dev/shm 64 MB), else /tmp.
BENCH_BROKER_DIR ?= $(shell [ -w /dev/shm ] && [ "$$(df -Pk /dev/shm | awk 'NR==2 {print $$4}')" -ge 2097152 ] 2>/dev/null && echo /dev/shm || echo /tmp)
OFFSETS_BENCH_N ?= 100000
bench:
	scripts/ensure-deps.sh postgres rabbitmq kafka
	@set -e; \
	if [ -z "$$AMQP_URL" ]; then \
	  rabbit_dir=$$(mktemp -d $(BENCH_BROKER_DIR)/once-bench-rabbit-XXXXXX); \
	  trap 'scripts/rabbitmq.sh stop "$$rabbit_dir"; rm -rf "$$rabbit_dir"' EXIT; \
	  eval "$$(scripts/rabbitmq.sh start "$$rabbit_dir")"; \
	fi; \
	$(GO) run ./internal/bench/cmd/oncebench -runs $(BENCH_RUNS) -amqp-lazy -kafka-dir $(BENCH_BROKER_DIR) $(BENCHFLAGS)
	@echo "== Kafka offsets kept in PostgreSQL (kafka.Config.OffsetsInDatabase) beside offsets in Kafka alone, records with and without producer ids (kfake, 4 partitions, effects checked exact)"
	ONCE_PG_DURABLE=1 $(GO) test -run '^$$' -bench '^BenchmarkConsumerOffsets$$' -benchtime $(OFFSETS_BENCH_N)x -count 2 ./brokers/kafka/

## bench-scale: the batched rows (Kafka) as processed_events grows to SCALE_ROWS rows (filled in SQL),
## the claim's plan, then retention while consuming (docs/performance.md); a durable throwaway
## PostgreSQL unless DATABASE_URL is set. JSON and a PNG plot in SCALE_OUT. About 5 minutes here.
SCALE_ROWS ?= 10000000
SCALE_OUT  ?= /tmp/once-bench-scale
bench-scale:
	scripts/ensure-deps.sh postgres
	mkdir -p $(SCALE_OUT)
	$(GO) run ./internal/bench/cmd/oncebench -scale -scale-rows $(SCALE_ROWS) -json $(SCALE_OUT)/scale.json -png $(SCALE_OUT)/scale.png $(BENCHFLAGS)

## bench-micro: Go micro-benchmarks of the hot path (allocations per message, claim statements)
bench-micro:
	scripts/ensure-deps.sh postgres
	ONCE_PG_DURABLE=1 $(GO) test -run '^$$' -bench . -benchmem -benchtime $(BENCHTIME) ./consumer/ ./dedup/

## fuzz: each fuzz target for FUZZTIME
fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzIdentify$$' -fuzztime $(FUZZTIME) ./consumer/
	$(GO) test -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZTIME) ./consumer/
	$(GO) test -run '^$$' -fuzz '^FuzzHeaderStrings$$' -fuzztime $(FUZZTIME) ./brokers/amqp/
	$(GO) test -run '^$$' -fuzz '^FuzzParseKey$$' -fuzztime $(FUZZTIME) ./idempotency/

## screenshots: a PNG of each page of the web console (once ui) into docs/img/, taken in headless
## Chromium by the console's browser test (cmd/once/console)
screenshots:
	scripts/ensure-deps.sh postgres chromium
	cd cmd/once && ONCE_SCREENSHOTS=$(CURDIR)/docs/img $(GO) test -count=1 -run '^TestConsoleInBrowser$$' ./console/

## lint: gofmt, go vet and golangci-lint (pinned, .golangci.yml) over every module of the workspace,
## the module-graph check (what a service importing consumer and brokers/kafka gets), and
## gorelease against the last tag once there is one
lint:
	scripts/lint.sh

.PHONY: chaos
CHAOS_FLAGS ?=
CHAOS_JSON  ?=
## chaos: fault injection (docs/reliability.md): the order-processor, built with -tags chaos, as
## 3 processes on Kafka (kfake), on three Apache Kafka nodes (RF 3, min.insync.replicas 2; broker
## SIGKILLs instead of cuts) and on RabbitMQ (AMQP_URL, else a throwaway node) under 20 SIGKILLs,
## every crash point, 2 PostgreSQL restarts, 5 broker cuts and group churn, each member running both
## hops (orders, an outbox relay, shipping) and 3 kills of the relay's leader; a table per broker,
## and JSON in CHAOS_JSON when set; then once more on kfake with the offsets kept in PostgreSQL
## (-offsets-in-database) and the group deleted with its offsets during the run.
## CHAOS_FLAGS adds flags (-seed N, -kills N, ...)
chaos:
	scripts/ensure-deps.sh postgres rabbitmq kafka
	@set -e; \
	if [ -z "$${AMQP_URL:-}" ]; then \
	  rabbit_dir=$$(mktemp -d /tmp/once-rabbit-XXXXXX); \
	  trap 'scripts/rabbitmq.sh stop "$$rabbit_dir"' EXIT; \
	  eval "$$(scripts/rabbitmq.sh start "$$rabbit_dir")"; \
	fi; \
	$(GO) run ./examples/order-processor chaos -broker all $(if $(CHAOS_JSON),-json $(CHAOS_JSON)) $(CHAOS_FLAGS); \
	$(GO) run ./examples/order-processor chaos -broker kafka -offsets-in-database $(if $(CHAOS_JSON),-json $(basename $(CHAOS_JSON))-offsets.json) $(CHAOS_FLAGS)
