package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/dedup"
)

// The hand-written row's batches: what a careful engineer picks without
// the library.
const (
	handMaxBatch = 100
	handLinger   = 5 * time.Millisecond
	// handConsumer is the hand-written row's consumer name in
	// processed_events.
	handConsumer = "handwritten"
)

// handClaimSQL claims a batch's ids in one statement: the new ones come
// back. Sorted so that two batches sharing ids (RabbitMQ's workers share
// the queue) lock them in one order and cannot deadlock.
const handClaimSQL = `INSERT INTO processed_events (consumer, event_id)
SELECT $1, id FROM unnest($2::text[]) AS u(id) ORDER BY id COLLATE "C"
ON CONFLICT DO NOTHING RETURNING event_id`

const handInsertSQL = `INSERT INTO effects (event_id, n, account, amount)
SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::bigint[])`

// runHandwritten is the hand-written batched consumer: per worker, a batch
// of up to 100 deliveries or what arrived within 5 ms of its first; BEGIN,
// one unnest claim, one multi-row business insert, COMMIT; then poison to
// the dead-letter queue and every delivery acked, in order. Kafka: one
// worker per partition (offsets are marked in order); RabbitMQ:
// spec.Naive workers sharing the queue.
func runHandwritten(ctx context.Context, src consumer.Source, pool *pgxpool.Pool, spec *rowSpec) error {
	store, err := dedup.New(dedup.Config{Schema: spec.Schema})
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx, pool); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var once sync.Once
	var failed error
	fail := func(err error) {
		once.Do(func() { failed = err })
		cancel()
	}
	n := max(1, spec.Naive)
	chans := make([]chan consumer.Delivery, n)
	for i := range chans {
		chans[i] = make(chan consumer.Delivery, 2*handMaxBatch)
	}
	var wg sync.WaitGroup
	for i := range n {
		ch := chans[i]
		if spec.Broker == RabbitMQ {
			ch = chans[0]
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for batch := range batches(ctx, ch) {
				if err := handleHandBatch(ctx, pool, batch); err != nil && ctx.Err() == nil {
					fail(err)
				}
			}
		}()
	}
	for {
		d, err := src.Receive(ctx)
		if err != nil {
			if ctx.Err() == nil {
				fail(err)
			}
			break
		}
		select {
		case chans[handWorker(spec.Broker, d.Message(), n)] <- d:
		case <-ctx.Done():
		}
	}
	for _, ch := range chans {
		close(ch)
	}
	wg.Wait()
	return failed
}

// handWorker returns which of n workers handles m: on Kafka the one of
// its partition, so that each partition's offsets are marked in order;
// on RabbitMQ the workers share the queue (worker 0's channel).
func handWorker(b Broker, m *consumer.Message, n int) int {
	if p := m.Partition; p >= 0 && b.IsKafka() {
		return int(p) % n
	}
	return 0
}

// batches yields, until ch closes or ctx ends, batches of up to
// handMaxBatch deliveries: the first one waited for, then whatever
// arrives within handLinger of it.
func batches(ctx context.Context, ch <-chan consumer.Delivery) func(func([]consumer.Delivery) bool) {
	return func(yield func([]consumer.Delivery) bool) {
		timer := time.NewTimer(time.Hour)
		defer timer.Stop()
		for {
			d, ok := <-ch
			if !ok || ctx.Err() != nil {
				return
			}
			batch := []consumer.Delivery{d}
			timer.Reset(handLinger)
		fill:
			for len(batch) < handMaxBatch {
				select {
				case d, ok := <-ch:
					if !ok {
						break fill
					}
					batch = append(batch, d)
				case <-timer.C:
					break fill
				}
			}
			if !yield(batch) {
				return
			}
		}
	}
}

// handRows is a batch decoded: the business rows of its valid messages
// (by id, the first copy's values) and which deliveries are poison.
type handRows struct {
	ids, accounts []string
	ns, amounts   []int64
	poison        []bool
	poisonErr     []error
}

func decodeHandBatch(batch []consumer.Delivery) handRows {
	r := handRows{poison: make([]bool, len(batch)), poisonErr: make([]error, len(batch))}
	seen := make(map[string]bool, len(batch))
	for i, d := range batch {
		m := d.Message()
		var p payload
		if err := json.Unmarshal(m.Value, &p); err != nil {
			r.poison[i], r.poisonErr[i] = true, err
			continue
		}
		id := handID(m)
		if seen[id] {
			continue // a copy within the batch
		}
		seen[id] = true
		r.ids, r.ns, r.accounts, r.amounts = append(r.ids, id), append(r.ns, p.N), append(r.accounts, p.Account), append(r.amounts, p.Amount)
	}
	return r
}

func handID(m *consumer.Message) string {
	if m.ID != "" {
		return m.ID
	}
	return m.Headers["id"]
}

// handleHandBatch writes a batch in one transaction, retried on failure,
// then dead-letters its poison and acks every delivery in order.
func handleHandBatch(ctx context.Context, pool *pgxpool.Pool, batch []consumer.Delivery) error {
	rows := decodeHandBatch(batch)
	var err error
	for attempt := 1; attempt <= 5; attempt++ {
		if err = commitHandBatch(ctx, pool, rows); err == nil || ctx.Err() != nil {
			break
		}
	}
	if err != nil {
		return err
	}
	for i, d := range batch {
		if rows.poison[i] {
			dl := &consumer.DeadLetter{Kind: consumer.KindDecode, Error: rows.poisonErr[i].Error(), Consumer: handConsumer,
				EventID: handID(d.Message()), FailedAt: time.Now()}
			if err := d.DeadLetter(ctx, dl); err != nil {
				return err
			}
		}
		if err := d.Ack(ctx); err != nil {
			return err
		}
	}
	return nil
}

// commitHandBatch claims the batch's ids and inserts the business rows of
// the new ones, in one transaction.
func commitHandBatch(ctx context.Context, pool *pgxpool.Pool, r handRows) error {
	if len(r.ids) == 0 {
		return nil
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		claimed, err := claimHand(ctx, tx, r.ids)
		if err != nil {
			return err
		}
		ids, ns, accounts, amounts := r.ids[:0:0], r.ns[:0:0], r.accounts[:0:0], r.amounts[:0:0]
		for i, id := range r.ids {
			if claimed[id] {
				ids, ns, accounts, amounts = append(ids, id), append(ns, r.ns[i]), append(accounts, r.accounts[i]), append(amounts, r.amounts[i])
			}
		}
		if len(ids) == 0 {
			return nil
		}
		_, err = tx.Exec(ctx, handInsertSQL, ids, ns, accounts, amounts)
		return err
	})
}

func claimHand(ctx context.Context, tx pgx.Tx, ids []string) (map[string]bool, error) {
	rows, err := tx.Query(ctx, handClaimSQL, handConsumer, ids)
	if err != nil {
		return nil, err
	}
	claimed := make(map[string]bool, len(ids))
	var id string
	_, err = pgx.ForEachRow(rows, []any{&id}, func() error {
		claimed[id] = true
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	return claimed, nil
}
