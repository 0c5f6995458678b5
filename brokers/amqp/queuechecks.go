package amqp

import (
	"errors"
	"fmt"
	"strings"

	amqp091 "github.com/rabbitmq/amqp091-go"
)

// A RabbitMQ stream queue (x-queue-type "stream") keeps its messages for
// every consumer to read from an offset of its own, and an ack only gives
// the consumer credit: a message left unacked by a lost connection or a
// crash, or rejected to be retried, is never delivered again, and a new
// consumer without an x-stream-offset starts at the stream's end, past
// what was published while none ran. The source's promises need a queue
// that redelivers (classic or quorum); on a stream they would silently
// not hold. Without Config.Passive the source declares the queue with
// its type, which the broker refuses for a stream; with it, the source
// asks (checkPassiveQueue).

// checkPassiveQueue asks the broker, on a channel of its own, whether
// queue (which exists) is a stream queue: a declaration of queue as a
// durable stream succeeds only for a stream, and is refused
// (PRECONDITION_FAILED) for any other queue, changing nothing either way.
// A stream is refused with a configuration error. The refusal names the
// first property that differs, in the broker's order (durable, auto_delete,
// then the arguments): a queue that is not durable (its messages gone when
// the broker restarts) or auto-delete (deleted with its messages when its
// last consumer goes, as on a reconnect) is consumed, with a warning.
// unchecked reports that the broker refused the question itself (the user
// may not configure the queue, as Passive deployments often are): the
// session then refuses the first delivery that comes from a stream
// (fromStream) instead.
func (s *Source) checkPassiveQueue(conn *amqp091.Connection) (unchecked bool, err error) {
	queue := s.cfg.Queue
	if version, _ := conn.Properties["version"].(string); versionBefore(version, 3, 8) {
		// Before 3.8 the broker neither has streams nor compares
		// x-queue-type: the question would take any queue for one.
		return false, nil
	}
	ch, err := conn.Channel()
	if errors.Is(err, amqp091.ErrChannelMax) {
		// One channel per connection (the broker's channel_max, or the
		// URL's): the consuming channel is all there is, and asking would
		// fail on every connect. The first delivery tells instead.
		s.log.Warn("amqp: the connection allows no second channel to ask whether the queue is a stream queue; "+
			"a delivery from a stream will be refused instead", "error", err)
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("amqp: open channel: %w", err)
	}
	defer func() { _ = ch.Close() }()
	_, err = ch.QueueDeclare(queue, true, false, false, false, amqp091.Table{"x-queue-type": "stream"})
	var ae *amqp091.Error
	switch {
	case err == nil:
		return false, streamQueueError(queue, "the broker takes its declaration as a stream")
	case errors.As(err, &ae) && ae.Code == amqp091.PreconditionFailed:
		switch {
		case strings.Contains(ae.Reason, "inequivalent arg 'durable'"):
			s.log.Warn("amqp: the queue is not durable: the broker loses it, with every message in it, when it restarts; "+
				"declare the queue durable (Config.Passive declares nothing)", "reason", ae.Reason)
		case strings.Contains(ae.Reason, "inequivalent arg 'auto_delete'"):
			s.log.Warn("amqp: the queue is auto-delete: the broker deletes it, with every message in it, when its last consumer goes "+
				"(the source's reconnect included); declare the queue without auto-delete (Config.Passive declares nothing)", "reason", ae.Reason)
		}
		return false, nil
	case errors.As(err, &ae) && ae.Code == amqp091.AccessRefused:
		return true, nil
	default:
		return false, fmt.Errorf("amqp: ask whether queue %q is a stream queue: %w", queue, err)
	}
}

// fromStream reports whether d was delivered from a stream queue, whose
// deliveries carry the message's offset in the stream as the header
// x-stream-offset, a long. A message copied from a stream into another
// queue (by a shovel that keeps headers) carries it too; it is told from
// a stream's only where checkNotStream could ask.
func fromStream(d amqp091.Delivery) bool {
	_, ok := d.Headers["x-stream-offset"].(int64)
	return ok
}

// streamQueueError is the configuration error that refuses a stream
// queue; why says how the source knows it is one.
func streamQueueError(queue, why string) error {
	return &configError{fmt.Errorf("amqp: queue %q is a stream queue (%s): a stream does not deliver again a message left unacked "+
		"or rejected, and a new consumer starts at its end, so effectively-once handling cannot hold on it; consume a classic or quorum queue "+
		"bound to the same exchange instead", queue, why)}
}

// warnDroppingArgs logs a warning for each argument of the queues the
// source declares that has the broker drop messages nobody handled: a
// length limit that drops the oldest message when the queue is full
// (x-max-length or x-max-length-bytes, x-overflow drop-head, its default)
// and a message TTL (x-message-ttl), each unless the queue has a
// dead-letter exchange to move those messages to; and a queue TTL
// (x-expires), which deletes the queue with every message in it once no
// consumer has used it that long, as when every consumer is down. The
// source's queue and its dead-letter queue (whose messages are the
// dead letters) are both looked at. A policy may set or undo any of these,
// which the source cannot see; with Passive nothing is declared and the
// arguments are unknown.
func (s *Source) warnDroppingArgs() {
	if s.cfg.Passive {
		return
	}
	for _, q := range s.declaredQueues() {
		for _, why := range droppingArgs(q.args) {
			s.log.Warn("amqp: a queue argument has the broker drop messages that no consumer handled: "+why,
				"dropping_queue", q.queue, "field", q.field)
		}
	}
}

// droppingArgs says, for each argument of args that has the broker drop
// messages, how and what to change.
func droppingArgs(args amqp091.Table) []string {
	_, dlx := args[deadLetterExchangeArg]
	var out []string
	_, maxLen := args["x-max-length"]
	_, maxBytes := args["x-max-length-bytes"]
	overflow, _ := args["x-overflow"].(string)
	if (maxLen || maxBytes) && (overflow == "" || overflow == "drop-head") && !dlx {
		out = append(out, "a length limit (x-max-length, x-max-length-bytes) drops the oldest message when the queue is full "+
			"(x-overflow drop-head, the default); set x-overflow reject-publish, so that publishers are refused instead, "+
			"or give the queue an x-dead-letter-exchange")
	}
	if _, ttl := args["x-message-ttl"]; ttl && !dlx {
		out = append(out, "x-message-ttl drops a message that waited longer (a consumer down, a backlog); "+
			"leave it out, or give the queue an x-dead-letter-exchange")
	}
	if _, expires := args["x-expires"]; expires {
		out = append(out, "x-expires deletes the queue, with every message in it, once no consumer has used it that long "+
			"(every consumer down); leave it out")
	}
	return out
}
