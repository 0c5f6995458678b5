package consumer

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// BatchHandler handles several events in one transaction, so that it can
// write them with multi-row statements (INSERT ... SELECT FROM unnest, or
// pgx.CopyFrom): the fastest way to PostgreSQL. The events are new (their
// ids were claimed in tx), belong to one stream (or to no stream), and come
// in stream order. Return nil to commit them all. On an error the
// transaction is rolled back and the batch halved, each half handled again
// (first the first), until the failing event is alone; it then meets the
// retry policy alone (a batch of one) while the others commit, so one bad
// event cannot hold back the others and costs about 2·log2(Batch.Size)
// transactions. A RetryAfter(d) is waited before each halving, so that a
// dependency that asked for d is not called again sooner. Handlers must
// therefore accept batches of any size from 1 to Config.Batch.Size, and see
// good events more than once (rolled back) when a bad one shares their
// batch.
type BatchHandler[T any] func(ctx context.Context, tx pgx.Tx, events []Event[T]) error

// NewBatch returns a consumer that decodes every message into T and calls
// h with batches of events. Errors as for New; Config.Hooks.Middleware is
// refused (ErrInvalidConfig): it wraps calls with one event, and a batch
// holds one event only when the load is light, so wrap h itself.
func NewBatch[T any](pool *pgxpool.Pool, src Source, h BatchHandler[T], cfg Config) (*Consumer[T], error) {
	if h == nil {
		return nil, fmt.Errorf("%w: handler is nil", ErrInvalidConfig)
	}
	if err := decodable[T](cfg); err != nil {
		return nil, err
	}
	if len(cfg.Hooks.Middleware) > 0 {
		// It would wrap the batches of one only, which light load makes.
		return nil, fmt.Errorf("%w: Hooks.Middleware wraps a Handler's calls, one event each; a BatchHandler's calls "+
			"carry batches of any size, so wrap the BatchHandler itself", ErrInvalidConfig)
	}
	p, err := newPipeline(pool, src, cfg, batchPreparer(h))
	if err != nil {
		return nil, err
	}
	p.batchCall = func(ctx context.Context, tx pgx.Tx, jobs []*job) error {
		q := openQueue(tx)
		defer q.close()
		events := make([]Event[T], len(jobs))
		for i, j := range jobs {
			events[i] = *j.event.(*Event[T])
			var err error
			if events[i].Payload, err = runPayload(events[i].Payload, j.ran, j.idt.payload, p.cfg.Decoder); err != nil {
				return err
			}
			j.ran = true
			events[i].queue = q
		}
		return h(ctx, tx, events)
	}
	return &Consumer[T]{p: p}, nil
}

// batchPreparer decodes each message for h: one allocation for the event,
// shared by the job's call (a batch of one) and its place in a batch.
func batchPreparer[T any](h BatchHandler[T]) preparer {
	return func(m *Message, idt identity, dec Decoder) (prepared, ErrorKind, error) {
		b := &batchBound[T]{h: h, data: idt.payload, dec: dec}
		if err := decodeInto(&b.ev.Payload, idt.payload, dec); err != nil {
			return prepared{}, KindDecode, &DecodeError{Err: err}
		}
		b.ev.ID, b.ev.Type, b.ev.Message, b.ev.Attempt = idt.id, idt.typ, m, 1
		return prepared{call: b, event: &b.ev}, "", nil
	}
}

// batchBound is a message decoded for a BatchHandler: its event, and the
// call of the handler with a batch of one.
type batchBound[T any] struct {
	ev   Event[T]
	h    BatchHandler[T]
	data []byte // the payload's bytes, decoded again for a later run
	dec  Decoder
}

func (b *batchBound[T]) run(ctx context.Context, tx pgx.Tx, qtx *queueTx, attempt int, again bool) error {
	one := b.ev
	var err error
	if one.Payload, err = runPayload(one.Payload, again, b.data, b.dec); err != nil {
		return err
	}
	one.Attempt = attempt
	one.queue = openQueue(qtx)
	defer one.queue.close()
	return b.h(ctx, tx, []Event[T]{one})
}
