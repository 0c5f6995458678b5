package outbox

import (
	"context"
	"errors"
	"time"
)

// Record is one outbox row as the relay hands it to a Publisher.
type Record struct {
	// Seq is the row's position in the outbox: rows of one key are
	// published in Seq order.
	Seq int64
	// EventID is the message's stable event id (Message.ID, or the one Add
	// generated). Every publish of the row carries it.
	EventID string
	// Topic, RoutingKey, Key, Type and Body are the Message's.
	Topic      string
	RoutingKey string
	Key        []byte // nil when the message has no key
	Type       string
	// Headers are Message.Headers with the stored trace context
	// ("traceparent", "tracestate") added.
	Headers map[string]string
	Body    []byte
	// CreatedAt is when the row was written; publishers send it as the
	// message timestamp.
	CreatedAt time.Time
	// Attempts counts the earlier publishes the broker rejected.
	Attempts int

	// undecodable is why the row could not be read as a message (its
	// headers or trace are not a JSON object of strings): the relay
	// charges it without publishing it.
	undecodable error
}

// Publisher sends records to a broker; the relay calls it from one
// goroutine at a time. The kafkaout and amqpout packages implement it.
type Publisher interface {
	// Publish sends recs, in order, and returns once the broker has
	// confirmed or refused each: errs[i] is nil when recs[i] is confirmed
	// (durably, as the broker's strongest acknowledgement defines it). A
	// nil errs means every record was confirmed; any other errs must hold
	// one error per record: one of another length takes none of recs as
	// confirmed or charged, and is logged at level Error and retried like
	// an unavailable broker. A panic in Publish is logged at level Error
	// with its stack; the relay then publishes the records again in
	// halves, in order (a half that panics in halves again), and charges
	// a record whose publish panics alone like a refusal, the panic's value as its error (a record that makes the
	// publisher panic every time is parked after RelayConfig.MaxAttempts;
	// one that panics on every record has each charged so), holding the
	// later records of its key back; a record the publisher sent before it
	// panicked is sent again, with its id. An error wrapped with
	// Rejected is charged to its record (after RelayConfig.MaxAttempts the
	// row is parked); any other error is taken as the broker being
	// unreachable or overloaded, and the relay retries the record after
	// backing off, without counting it; wrapped with Refused, it is the
	// broker refusing the publisher itself, retried so too but logged as
	// an error. ctx has RelayConfig.PublishTimeout's deadline; when the
	// relay stops, ctx stays live for 5s more, so that a publish in flight
	// can collect the broker's answer. A publisher should give up when ctx
	// is done: one that does not return is given up by the relay past
	// PublishTimeout and a grace, logged at level Error, and the relay
	// stops leading until it returns (RelayConfig.PublishTimeout).
	Publish(ctx context.Context, recs []Record) (errs []error)
	// Close releases the publisher's connections.
	Close() error
}

// Checker is implemented by publishers that can tell, before sending,
// that a record will be refused (larger than the broker accepts, no
// destination). The relay calls Check on each record of a batch before
// Publish: an error wrapped with Rejected is charged to the record like a
// refusal at publish time, any other error keeps the record, uncharged,
// for a later batch (logged at level Warn, at most every 10 s), and in
// both cases the later records of its key in the batch are held back, so
// that they never overtake it. A panic in Check is charged to its record
// as a refusal, with the panic's value as its error. Check has no context:
// it runs under RelayConfig.PublishTimeout like Publish, and one that
// does not return is given up so too.
type Checker interface {
	Check(rec Record) error
}

// rejected marks an error as the broker's refusal of one message.
type rejected struct{ err error }

func (r *rejected) Error() string { return r.err.Error() }
func (r *rejected) Unwrap() error { return r.err }

// Rejected wraps err to say that the broker refused this record and will
// refuse it again (unknown topic or exchange, message too large, no queue
// bound for the routing key, not authorised): the relay counts it against
// the row, retries it a bounded number of times and then parks it. A nil
// err stays nil.
func Rejected(err error) error {
	if err == nil {
		return nil
	}
	return &rejected{err}
}

// refused marks an error as the broker's refusal of the publisher itself.
type refused struct{ err error }

func (r *refused) Error() string { return r.err.Error() }
func (r *refused) Unwrap() error { return r.err }

// Refused wraps err to say that the broker refuses the publisher itself,
// whatever it sends: its credentials, its permissions (a vhost, a cluster
// ACL), its TLS or SASL settings. Unlike Rejected it charges no record:
// the relay keeps every row and retries with InfraBackoff, as for a broker
// that cannot be reached (the fix is on one side or the other, and the
// outbox resumes once it is made), but logs it at level Error and counts
// it in RefusalsMetric. A nil err stays nil.
func Refused(err error) error {
	if err == nil {
		return nil
	}
	return &refused{err}
}

// IsRefused reports whether err was wrapped with Refused.
func IsRefused(err error) bool {
	var r *refused
	return errors.As(err, &r)
}

// IsRejected reports whether err was wrapped with Rejected.
func IsRejected(err error) bool {
	var r *rejected
	return errors.As(err, &r)
}
