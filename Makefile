# The README's two commands: `make run` (the demo) and `make test`.
GO        ?= go
FUZZTIME  ?= 30s
BENCHTIME ?= 1s

.PHONY: run test bench fuzz lint

## run: the order-processor demo: embedded Kafka (kfake), a throwaway PostgreSQL, orders with
## duplicates, poison and a SIGKILL mid-stream, then a report and a verdict
run:
	scripts/ensure-deps.sh postgres
	$(GO) run ./examples/order-processor

## test: every test, with the race detector; starts the servers it needs
test:
	scripts/test.sh

## bench: micro-benchmarks of the hot path (a throwaway PostgreSQL when DATABASE_URL is unset)
bench:
	scripts/ensure-deps.sh postgres
	$(GO) test -run '^$$' -bench . -benchmem -benchtime $(BENCHTIME) ./consumer/ ./dedup/

## fuzz: each fuzz target for FUZZTIME
fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzIdentify$$' -fuzztime $(FUZZTIME) ./consumer/
	$(GO) test -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZTIME) ./consumer/

## lint: gofmt and go vet
lint:
	@test -z "$$(gofmt -l .)" || (gofmt -l . && exit 1)
	$(GO) vet ./...
