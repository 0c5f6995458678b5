// Package amqp is the RabbitMQ adapter of once: a consumer.Source that
// consumes one queue through github.com/rabbitmq/amqp091-go, for a
// consumer.Consumer that handles each event effectively once.
//
// Open connects, declares the topology from Config (the queue, classic or
// quorum; exchanges; bindings; the dead-letter queue "<queue>.dlq"), or only
// checks it with Config.Passive, applies the prefetch (Config.Prefetch,
// default DefaultPrefetch, 2048) and consumes with manual acknowledgements:
//
//	src, err := amqp.Open(ctx, amqp.Config{URL: "amqp://guest:guest@localhost:5672/", Queue: "orders"})
//	c, err := consumer.New(pool, src, handle, consumer.Config{Name: "orders-svc"})
//	err = c.Run(ctx)
//
// # Guarantees
//
// A delivery is acked only when the consumer says so: after the transaction
// that handled it committed, after it was recognised as a duplicate, or
// after its dead-letter copy was confirmed by the broker. Nothing is ever
// auto-acked. Acks are sent by a goroutine of the connection that
// coalesces runs of consecutive acked deliveries into one frame with the
// multiple flag; Close sends the pending ones. Dead-letter copies go out on
// a second connection of their own, so that a publishing connection that
// the broker blocks under a memory or disk alarm never holds back the acks
// (ErrPublisherBlocked).
//
// amqp091-go does not reconnect by itself (its experimental recovery is not
// used: it would send old delivery tags on a new channel). When the
// connection or the consuming channel is lost, Receive reconnects with
// exponential backoff and jitter (Config.ReconnectMinBackoff to
// Config.ReconnectMaxBackoff), logs through log/slog, counts the
// reconnection in the once.amqp.reconnects OpenTelemetry counter, declares
// the topology again, applies the prefetch and resumes. Deliveries of the
// lost channel have their Context cancelled and their Ack fails with
// ErrChannelClosed without acking: delivery tags belong to a channel. The
// broker delivers them again with the redelivered flag; one whose
// transaction had committed is then skipped as a duplicate.
//
// # Event ids
//
// Message.ID is the message-id property and Message.Type the type property.
// Without them the consumer reads the headers of consumer.Config.Identify.IDHeaders
// and TypeHeaders. Config.FallbackID opts in to a hash of exchange, routing
// key, type property and body as a last resort; by default a message
// without an id is dead-lettered with kind missing-id.
//
// # Order
//
// A queue consumed with a prefetch above one and a consumer with
// Concurrency above one gives no order across deliveries: Message.Stream is
// empty and the consumer handles deliveries concurrently. Config.Ordered
// makes the queue one stream, handled in delivery order.
//
// See docs/amqp.md for the dead-letter format, the configuration and
// performance figures.
package amqp
