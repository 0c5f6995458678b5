// Package kafkaout publishes outbox records to Kafka through sarama, for
// an outbox.Relay.
//
// The producer is idempotent with acks=all and one request in flight per
// broker, so the broker keeps each partition's records in the order the
// relay sends them and drops the copies of a retried batch. Each record
// carries the row's event id in the "id" header and its type in "type" (the
// headers the consuming side of this library reads by default), the stored
// W3C trace context ("traceparent", "tracestate"), the message's own
// headers, its key (which picks the partition, so one key's records stay in
// one partition) and its value.
//
// A re-publish (after a relay crashed between the broker's confirm and the
// row being marked) is a second record with the same id: the next hop's
// consumer skips it as a duplicate.
package kafkaout
