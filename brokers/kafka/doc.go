// Package kafka is the Kafka adapter of once: a consumer.Source built on a
// sarama consumer group, with an idempotent dead-letter producer.
//
// A Source reads Config.Topics as one member of Config.Group and hands every
// record to the consumer core as a consumer.Delivery:
//
//   - Message.FallbackID is "topic/partition/offset@topic-id" (the topic's
//     id, Kafka 2.8+; without ids, "topic/partition/offset"), so an event
//     without an id header is still deduplicated across redeliveries of the
//     same record, and a topic deleted and created again under the same
//     name (whose offsets start at 0 again) does not make its records look
//     like duplicates of the old topic's.
//   - Message.Stream is "topic/partition": the core handles the records of a
//     partition one after another, in offset order, and partitions
//     concurrently. With Config.KeyLanes it is "topic/partition#lane", the
//     lane a hash of the record key: one key's records in order, the
//     lanes of a partition concurrently.
//   - Message.Headers holds the record headers (the last value wins when a
//     key repeats), so the core finds the event id ("id", "ce_id",
//     "message-id"), the type and the W3C "traceparent" there. Message.ID
//     and Message.Type are empty: Kafka has no such native properties.
//
// # Offsets
//
// Ack marks the record's offset (offset+1) in the consumer-group session
// that delivered it. The core calls Ack only after the handler's transaction
// committed, after it recognised the record as a duplicate, or after the
// record's dead-letter copy was confirmed, so a committed offset never runs
// ahead of the database. Marks are made over the settled prefix of the
// partition's deliveries: an unsettled record is never skipped. Marked
// offsets are committed every Config.CommitInterval, when a partition is
// revoked, and on Close. A crash loses at most the marks made since the last
// commit: those records are delivered again, and the core's deduplication
// skips the ones whose transaction had committed.
//
// # Rebalances
//
// When a partition is revoked, the Source stops handing out its records and
// waits, at most Config.RevokeTimeout, until the deliveries it already
// handed out are acked, so that the final commit of the session includes
// them. Past the bound, the partition's remaining deliveries are abandoned:
// their Context is done, and their Ack marks nothing and returns ErrRevoked.
// An offset is never marked into a later generation for work that began in
// an earlier one. The partition's new owner therefore sees at most a
// redelivery of records whose work was abandoned, which the deduplication
// claim absorbs.
//
// # Dead letters
//
// DeadLetter produces a copy of the record to Config.DeadLetter.Topic of its
// topic ("<topic>.dlq" by default): the original key and value bytes
// unchanged, the original headers, and the diagnostic headers of
// consumer.DeadLetter.Headers written over them. It returns once all in-sync
// replicas have the copy (an idempotent producer with RequiredAcks =
// WaitForAll). Open checks that every dead-letter topic exists and
// fails with ErrDeadLetterTopicMissing naming the first missing one, or
// creates it when Config.DeadLetter.Create is set; it never relies on
// the broker's topic auto-creation. A dead-letter topic deleted later makes
// DeadLetter return an error, and the core retries without acking (the
// partition waits at that record). A retried DeadLetter may write the copy
// twice; dead-letter topics are at-least-once. A copy larger than the
// producer or the topic accepts is written without its value, with the
// HeaderValueDropped header (the original stays in its topic); one still
// too large without its value is written with its diagnostic headers
// alone, without the key and the original headers, and carries
// HeaderOriginalDropped as well. Close
// returns within Config.CloseTimeout whatever the dead-letter destination
// does.
//
// # Crash loops
//
// Kafka keeps no delivery count, so Message.Redelivered is always false.
// Each partition claim has a Delivery.Context of its own; the core takes a
// new context on a stream as a new assignment, and its crash guard marks
// the first consumer.Config.Batch.Size new records of the assignment (those
// that were in flight if the previous owner crashed) before they run. A
// mark left by a process that died makes its record a suspect, run alone
// with its crashes counted, so that a record that crashes the process
// every time is dead-lettered (kind crash-loop) after
// consumer.Config.CrashGuard.MaxCrashes crashes.
//
// # Telemetry
//
// The consumer lag of every claimed partition is an OpenTelemetry gauge
// named LagMetricName, from Config.MeterProvider; the records a claim
// skipped because its start was out of the partition's range (deleted by
// retention before they were handled) are counted as
// OutOfRangeMetricName; the joins of the group refused because of its
// other members (group.max.size reached, no rebalance strategy in common)
// as GroupRefusedMetricName.
//
// TLS, SASL, the protocol version and every other client setting come from
// Config.Sarama.
package kafka
