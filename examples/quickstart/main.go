// Command quickstart shows the consumer's promise in a few seconds, with no
// broker to install: it publishes payment events, with redelivered copies
// and poison among them, to an in-memory broker; consumes them into a
// PostgreSQL ledger; "crashes" the consumer between commit and ack halfway
// through; restarts it; and checks that the ledger holds each payment
// exactly once.
//
// It uses DATABASE_URL when set, else a throwaway PostgreSQL server that it
// starts and removes (go run ./examples/quickstart). Its tables are in a
// schema of its own, quickstart, made afresh on each run.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"sort"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/oncetest"
)

type payment struct {
	Account string `json:"account"`
	Amount  int64  `json:"amount"`
}

func main() {
	n := flag.Int("n", 5000, "payments to publish")
	flag.Parse()
	if err := run(*n); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

func run(n int) error {
	ctx := context.Background()
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		srv, err := oncetest.StartServer(ctx, true)
		if err != nil {
			return err
		}
		defer srv.Close()
		url = srv.URL()
		fmt.Println("started a throwaway PostgreSQL:", url)
	}
	pool, err := openPool(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()

	broker := memsource.New(memsource.Options{Streams: 4})
	sent := publish(broker, n)

	handle := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[payment]) error {
		if ev.Payload.Amount <= 0 {
			return consumer.Permanent(fmt.Errorf("payment of %d is not positive", ev.Payload.Amount))
		}
		_, err := tx.Exec(ctx, `INSERT INTO ledger VALUES ($1, $2, $3)`, ev.ID, ev.Payload.Account, ev.Payload.Amount)
		return err
	}
	cfg := consumer.Config{
		Name: "quickstart-ledger",
		// The demo's poison is expected: keep the log to the report.
		Telemetry: consumer.TelemetryConfig{Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))},
	}

	// First run: after half the messages, acks stop reaching the broker, as
	// if the process died right after each commit.
	crashAt := int64(sent.total / 2)
	first, err := consumer.New(pool, &lostAcks{Source: broker.Source(), after: crashAt}, handle, cfg)
	if err != nil {
		return err
	}
	start := time.Now()
	if err := until(first, func(s consumer.Stats) bool { return s.Received >= uint64(sent.total) }); err != nil {
		return err
	}
	fmt.Printf("run 1: handled %d, then lost the acks of %d messages (a crash between commit and ack)\n",
		first.Stats().Handled, sent.total-int(crashAt))

	// Second run: the broker redelivers every unacked message.
	second, err := consumer.New(pool, broker.Source(), handle, cfg)
	if err != nil {
		return err
	}
	if err := until(second, func(consumer.Stats) bool { return broker.Acked() == sent.total }); err != nil {
		return err
	}
	elapsed := time.Since(start)
	return report(ctx, pool, broker, sent, first.Stats(), second.Stats(), elapsed)
}

// schema holds the demo's tables. Each run drops it whole and makes it
// again: the library's tables go with the versions once_schema_versions
// records of them (a table dropped under its recorded version is not
// created again, and the next run failed), and no table of the database's
// other schemas is touched.
const schema = "quickstart"

// openPool makes schema afresh, with the ledger, on url's database and
// returns a pool whose connections use it.
func openPool(ctx context.Context, url string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+schema+` CASCADE; CREATE SCHEMA `+schema+`;
		CREATE TABLE ledger (event_id text, account text, amount bigint)`); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// sent counts what was published, by kind.
type sent struct {
	total, unique, copies, malformed, invalid int
	sum                                       int64
}

func publish(b *memsource.Broker, n int) sent {
	var s sent
	pub := func(id string, value []byte) {
		b.Publish(consumer.Message{Key: []byte(id), Value: value, Headers: map[string]string{"id": id}})
		s.total++
	}
	for i := 0; i < n; i++ {
		id := fmt.Sprintf("pay-%05d", i)
		switch i % 200 {
		case 7:
			pub(id, []byte(`{"account": "acc-`)) // cut short: not JSON
			s.malformed++
			continue
		case 13:
			v, _ := json.Marshal(payment{Account: "acc-1", Amount: -5})
			pub(id, v)
			s.invalid++
			continue
		}
		v, _ := json.Marshal(payment{Account: fmt.Sprintf("acc-%d", i%50), Amount: int64(100 + i%900)})
		pub(id, v)
		s.unique++
		s.sum += int64(100 + i%900)
		if i%10 == 3 { // a producer retry publishes it again
			pub(id, v)
			s.copies++
		}
	}
	return s
}

// lostAcks drops every Ack after the first `after` deliveries.
type lostAcks struct {
	consumer.Source
	after, seen int64
}

type lostAck struct{ consumer.Delivery }

func (lostAck) Ack(context.Context) error { return nil }

func (s *lostAcks) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := s.Source.Receive(ctx)
	if err != nil || atomic.AddInt64(&s.seen, 1) <= s.after {
		return d, err
	}
	return lostAck{d}, nil
}

// until runs c until done(stats) holds and c has settled what it received,
// then stops it.
func until(c *consumer.Consumer[payment], done func(consumer.Stats) bool) error {
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- c.Run(ctx) }()
	deadline := time.After(2 * time.Minute)
	for {
		s := c.Stats()
		if done(s) && s.Handled+s.Duplicates+s.DeadLettered+s.Skipped == s.Received {
			cancel()
			return <-errc
		}
		select {
		case err := <-errc:
			cancel()
			return err
		case <-deadline:
			cancel()
			return errors.New("timed out waiting for the consumer")
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func report(ctx context.Context, pool *pgxpool.Pool, b *memsource.Broker, s sent, r1, r2 consumer.Stats, elapsed time.Duration) error {
	var rows, distinct int
	var sum int64
	err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT event_id), coalesce(sum(amount), 0) FROM ledger`).Scan(&rows, &distinct, &sum)
	if err != nil {
		return err
	}
	// Dead letters are at least once: a poison message whose ack was lost
	// is dead-lettered again when redelivered. Count distinct events.
	kinds := map[string]int{}
	seen := map[string]bool{}
	for _, d := range b.DeadLetters() {
		if id := d.Headers[consumer.HeaderEventID]; !seen[id] {
			seen[id] = true
			kinds[d.Headers[consumer.HeaderErrorKind]]++
		}
	}
	var kindList []string
	for k, v := range kinds {
		kindList = append(kindList, fmt.Sprintf("%s=%d", k, v))
	}
	sort.Strings(kindList)

	fmt.Println()
	fmt.Printf("published         %6d  (%d payments, %d redelivered copies, %d malformed, %d invalid)\n",
		s.total, s.unique, s.copies, s.malformed, s.invalid)
	fmt.Printf("handled           %6d  (run 1: %d, run 2: %d)\n", r1.Handled+r2.Handled, r1.Handled, r2.Handled)
	fmt.Printf("duplicates skipped%6d  (run 1: %d, run 2: %d, the redelivered unacked ones)\n",
		r1.Duplicates+r2.Duplicates, r1.Duplicates, r2.Duplicates)
	fmt.Printf("dead-lettered     %6d  %v (%d records: a redelivered poison message is dead-lettered again)\n",
		len(seen), kindList, len(b.DeadLetters()))
	fmt.Printf("ledger rows       %6d  (want %d, one per payment)\n", rows, s.unique)
	fmt.Printf("ledger sum    %10d  (want %d)\n", sum, s.sum)
	fmt.Printf("elapsed       %10s  (%.0f msg/s over both runs, fsync on)\n", elapsed.Round(time.Millisecond),
		float64(r1.Received+r2.Received)/elapsed.Seconds())
	ok := rows == s.unique && distinct == s.unique && sum == s.sum &&
		kinds[string(consumer.KindDecode)] == s.malformed && kinds[string(consumer.KindHandler)] == s.invalid &&
		len(seen) == s.malformed+s.invalid
	if !ok {
		fmt.Println("verdict: FAIL: the ledger does not match what was published")
		return errors.New("verdict failed")
	}
	// What the demo is for: messages whose acks were lost came back.
	if r2.Received == 0 || r2.Duplicates == 0 {
		fmt.Println("verdict: FAIL: nothing was redelivered")
		return errors.New("no message whose ack was lost was redelivered and skipped (nothing published?)")
	}
	fmt.Println("verdict: PASS: every payment exactly once, every poison message dead-lettered, nothing lost")
	return nil
}
