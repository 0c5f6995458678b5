// Package amqpout publishes outbox records to RabbitMQ through amqp091-go,
// for an outbox.Relay.
//
// Records are published on a channel in confirm mode, mandatory, a batch at
// a time, and each is reported confirmed only when the broker acked it and
// did not return it: a record that no queue would receive is refused
// (outbox.Rejected) instead of vanishing. Each message carries the row's
// event id as its message-id property (which the consuming side of this
// library reads first), its type as the type property, the stored W3C
// trace context as "traceparent" and "tracestate" headers, the message's
// own headers (but for any named "id" or "type": the properties carry
// those), and is persistent unless Config.Transient. A record with a
// header named "CC" or "BCC", which RabbitMQ routes by and refuses as a
// string, is refused before it is sent (Publisher.Check).
//
// Messages of one channel reach a queue in the order they were published,
// so the relay's per-key order holds up to the queue; what a consumer does
// with the order (concurrent deliveries) is the consumer's.
package amqpout
