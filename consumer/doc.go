// Package consumer turns an at-least-once broker into exactly-once effects.
//
// Brokers deliver at least once: a retry, a crash between "work done" and
// "ack", a rebalance, and the same event arrives twice. A Consumer removes
// the second effect by remembering what it did in the same transaction as
// the work: for each message it begins a PostgreSQL transaction, claims the
// event id in the processed_events table (package dedup), runs your typed
// Handler with that transaction, commits, and only then acks the message.
// If the claim finds the id already there, the handler is skipped and the
// message acked as a duplicate. The claim row exists if and only if the
// handler's writes committed, so a crash at any point leads to a
// redelivery that is either handled (nothing committed) or skipped
// (everything committed), never to a lost or doubled effect.
//
// # The message's way
//
//	Source.Receive ─▶ event id ─▶ decode ─▶ BEGIN ─▶ claim ─▶ handler ─▶ COMMIT ─▶ Ack
//	                     │           │                 │         │          │
//	                  missing:    fails:          duplicate:  error: retry  fails: back off,
//	                    DLQ         DLQ           skip, Ack   then DLQ      retry (no ack)
//
// Event ids come from the broker's id property (AMQP message-id), a header
// (Config.Identify.IDHeaders), an Envelope, or the adapter's fallback (Kafka:
// topic/partition/offset@topic-id). A payload fingerprint is stored with each claim:
// a repeated id with a different payload is an id conflict and is
// dead-lettered (Config.Identify.OnConflict) instead of being silently skipped.
//
// # Failures
//
// Outcomes are errors: Permanent dead-letters at once, RetryAfter asks for
// a later attempt, any other error is retried per Config.Retry and then
// dead-lettered; a panic is caught and treated as a failure with its stack
// in the dead letter. Infrastructure failures (IsTransient: the database
// unreachable, a lost connection, a COMMIT whose connection was lost) are
// never poison: the message is neither dead-lettered nor acked, and the
// consumer retries it with backoff until the infrastructure is back. A
// COMMIT the database refuses (a deferred constraint) is the handler's
// failure. A message that kills the
// process every time it is handled is recognised by a durable attempt
// count and dead-lettered after Config.CrashGuard.MaxCrashes; so is one
// whose handler ends its database session every time (a statement that
// crashes the server): the messages of a transaction that lost its
// session twice run alone after, and one that loses it again alone is
// charged.
//
// # Order and concurrency
//
// Messages of one stream (a Kafka partition; an AMQP queue with its
// Config.Ordered) are handled one after another in order; different
// streams, and messages without a stream (AMQP by default), are handled
// concurrently up to Config.Concurrency.
//
// # Adapters
//
// A broker adapter implements Source and Delivery (see brokers/kafka and
// brokers/amqp) and proves itself against package conformance. Package
// memsource is an in-memory Source for unit tests.
//
// # Telemetry
//
// Each message gets an OpenTelemetry consumer span, child of the producer's
// span when its headers carry one (read with the global propagator, else
// from a W3C traceparent header), else the root of a trace of its own (a
// span in Run's context is no message's parent), and the consumer exports
// the metrics once.consumer.messages (by outcome), .retries,
// .dead_letters (by kind), .handler.duration, .commit.duration, .inflight,
// .batch.size and .stuck_calls (by function), and the
// messaging conventions' messaging.client.consumed.messages and
// messaging.process.duration (docs/operations.md lists them). Logs go to
// log/slog (Config.Telemetry.Logger), never with payloads.
package consumer
