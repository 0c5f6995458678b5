// Package dlq reads and redrives the dead letters of once consumers: the
// Kafka dead-letter topic (brokers/kafka) and the RabbitMQ dead-letter queue
// (brokers/amqp).
//
// Reading never consumes and never reorders. On Kafka a Queue reads the
// committed records of every partition, from its first retained offset to
// its last stable offset, with a plain partition consumer: no consumer
// group, nothing committed; the records of an aborted transaction are no
// dead letters, and those of a transaction still open are not read. On
// RabbitMQ it subscribes with manual acknowledgements, takes the messages
// that were ready when it started, and closes its channel without acking
// any of them: RabbitMQ puts unacked messages of a classic or quorum queue
// back at their positions, so the queue is as it was (each message is
// marked redelivered).
//
// A redrive (Queue.Replay) republishes a record to where it was first
// published (the Kafka topic of once-original-topic; the RabbitMQ exchange
// and routing key of once-original-exchange and once-original-routing-key)
// with its original key, properties, headers and bytes, without the
// diagnostic headers the dead-lettering added, and with the redrive headers
// of package consumer: once-redrive-event-id carries the event id the record
// was dead-lettered under, which the consumer that dead-lettered it
// (once-redrive-consumer) prefers over every other id source, so a redriven
// record is deduplicated against every other delivery of its event, even one
// whose id was derived from its Kafka position. The topic's other consumers
// identify the copy as they did its first delivery, with its first position
// (once-redrive-fallback-id) in place of the copy's.
// Replaying a selection twice, replaying a record that was handled
// meanwhile, or two people replaying at once each leaves one effect per
// event.
package dlq
