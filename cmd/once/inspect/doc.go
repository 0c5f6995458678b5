// Package inspect reads the state of once consumers: per consumer name,
// the rows of the processed-events table and of its attempts table (from
// PostgreSQL), the lag of a Kafka consumer group and the depth of RabbitMQ
// queues; and it applies retention to one consumer name in bounded
// batches.
package inspect
