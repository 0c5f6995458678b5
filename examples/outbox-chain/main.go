// Command outbox-chain shows exactly-once effects across two hops: an
// order service consumes "orders.paid", confirms each order and emits
// "orders.confirmed" through the transactional outbox; a shipping service
// consumes "orders.confirmed" and ships each order. Two relays run on the
// outbox (two replicas), and the leading relay's database session is
// killed right after the broker confirmed a batch and before the rows
// were deleted, so that batch goes out twice. At the end it counts: one
// confirmation per order, one outbox row published per order (copies on
// the wire allowed, each with its row's id), one shipment per order, and
// that the killed batch did go out again (else it fails: too few orders
// for the kill, which follows the third batch).
//
// It runs on an in-process Kafka-protocol broker (kfake) and DATABASE_URL
// (its tables in a schema of its own, outbox_chain, made afresh on each
// run), or a throwaway PostgreSQL server that it starts and removes.
//
//	go run ./examples/outbox-chain [-orders 2000]
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceco/once/brokers/kafka"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/oncetest"
	"github.com/onceco/once/outbox"
	"github.com/onceco/once/outbox/kafkaout"
)

type orderPaid struct {
	OrderID string `json:"order_id"`
	Amount  int64  `json:"amount"`
}

type orderConfirmed struct {
	OrderID string `json:"order_id"`
}

const (
	paidTopic      = "orders.paid"
	confirmedTopic = "orders.confirmed"
	partitions     = 3
)

func main() {
	orders := flag.Int("orders", 2000, "orders to pay")
	flag.Parse()
	if err := run(*orders); err != nil {
		fmt.Fprintln(os.Stderr, "outbox-chain:", err)
		os.Exit(1)
	}
}

func run(orders int) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pool, closeDB, err := database(ctx)
	if err != nil {
		return err
	}
	defer closeDB()
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, paidTopic, confirmedTopic))
	if err != nil {
		return err
	}
	defer kf.Close()
	brokers := kf.ListenAddrs()

	sent, err := publishPaid(brokers, orders)
	if err != nil {
		return err
	}
	fmt.Printf("published %d order.paid messages for %d orders (%d redelivered copies)\n", sent, orders, sent-orders)

	var crashedAt atomic.Int64
	kill := &killLeaderAfter{pool: pool, batch: 3, killed: &crashedAt}
	for i := range 2 {
		pub, err := kafkaout.New(kafkaout.Config{Brokers: brokers, Sarama: saramaConfig()})
		if err != nil {
			return err
		}
		defer pub.Close()
		relay, err := outbox.NewRelay(pool, kill.wrap(pub), outbox.RelayConfig{PollInterval: 100 * time.Millisecond,
			BatchSize: 100, Logger: quiet()})
		if err != nil {
			return err
		}
		go func() {
			if err := relay.Run(ctx); err != nil {
				fmt.Fprintf(os.Stderr, "relay %d: %v\n", i+1, err)
			}
		}()
	}

	orderSvc, err := startOrderService(ctx, pool, brokers)
	if err != nil {
		return err
	}
	shipping, err := startShipping(ctx, pool, brokers)
	if err != nil {
		return err
	}
	if err := waitUntilShipped(ctx, pool, orders, 2*time.Minute); err != nil {
		return err
	}
	cancel()
	<-orderSvc.done
	<-shipping.done
	return report(pool, brokers, orders, orderSvc.c.Stats(), shipping.c.Stats(), crashedAt.Load())
}

// schema holds the example's tables. Each run drops it whole and makes it
// again: the library's tables go with the versions once_schema_versions
// records of them (a table dropped under its recorded version is not
// created again, and the next run failed), and no table of the database's
// other schemas is touched.
const schema = "outbox_chain"

// database returns a pool on DATABASE_URL or on a throwaway server, with
// the example's tables created afresh in schema.
func database(ctx context.Context) (*pgxpool.Pool, func(), error) {
	url, stop := os.Getenv("DATABASE_URL"), func() {}
	if url == "" {
		srv, err := oncetest.StartServer(ctx, false)
		if err != nil {
			return nil, nil, err
		}
		url, stop = srv.URL(), func() { _ = srv.Close() }
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		stop()
		return nil, nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		stop()
		return nil, nil, err
	}
	_, err = pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+schema+` CASCADE; CREATE SCHEMA `+schema+`;
CREATE TABLE confirmed_orders (order_id text NOT NULL, amount bigint NOT NULL);
CREATE TABLE shipments (order_id text NOT NULL, event_id text NOT NULL)`)
	if err == nil {
		err = outbox.Migrate(ctx, pool)
	}
	if err != nil {
		pool.Close()
		stop()
		return nil, nil, err
	}
	return pool, func() { pool.Close(); stop() }, nil
}

func saramaConfig() *sarama.Config {
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_8_0_0
	sc.Producer.Retry.Backoff = 50 * time.Millisecond
	sc.Metadata.Retry.Backoff = 50 * time.Millisecond
	return sc
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// publishPaid sends one order.paid per order, and again every tenth one
// (a producer retry), each copy with the same id.
func publishPaid(brokers []string, orders int) (int, error) {
	sc := saramaConfig()
	sc.Producer.Return.Successes = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	p, err := sarama.NewSyncProducer(brokers, sc)
	if err != nil {
		return 0, err
	}
	defer p.Close()
	var msgs []*sarama.ProducerMessage
	for i := range orders {
		body, _ := json.Marshal(orderPaid{OrderID: "o-" + strconv.Itoa(i), Amount: int64(100 + i)})
		m := &sarama.ProducerMessage{Topic: paidTopic, Key: sarama.StringEncoder("o-" + strconv.Itoa(i)),
			Value: sarama.ByteEncoder(body), Headers: []sarama.RecordHeader{{Key: []byte("id"), Value: []byte("paid-" + strconv.Itoa(i))}}}
		msgs = append(msgs, m)
		if i%10 == 0 {
			msgs = append(msgs, &sarama.ProducerMessage{Topic: m.Topic, Key: m.Key, Value: m.Value, Headers: m.Headers})
		}
	}
	return len(msgs), p.SendMessages(msgs)
}

type service struct {
	c    interface{ Stats() consumer.Stats }
	done chan struct{}
}

// startOrderService is hop 1: confirm the order and emit order.confirmed
// through the outbox, in one transaction.
func startOrderService(ctx context.Context, pool *pgxpool.Pool, brokers []string) (*service, error) {
	handle := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[orderPaid]) error {
		if _, err := tx.Exec(ctx, `INSERT INTO confirmed_orders VALUES ($1, $2)`, ev.Payload.OrderID, ev.Payload.Amount); err != nil {
			return err
		}
		body, err := json.Marshal(orderConfirmed{OrderID: ev.Payload.OrderID})
		if err != nil {
			return consumer.Permanent(err)
		}
		return outbox.Add(ctx, tx, outbox.Message{ID: ev.ID + "/confirmed", Topic: confirmedTopic,
			Key: []byte(ev.Payload.OrderID), Type: "order.confirmed", Body: body})
	}
	return start(ctx, pool, brokers, "orders", paidTopic, handle)
}

// startShipping is hop 2: ship each confirmed order.
func startShipping(ctx context.Context, pool *pgxpool.Pool, brokers []string) (*service, error) {
	handle := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[orderConfirmed]) error {
		_, err := tx.Exec(ctx, `INSERT INTO shipments VALUES ($1, $2)`, ev.Payload.OrderID, ev.ID)
		return err
	}
	return start(ctx, pool, brokers, "shipping", confirmedTopic, handle)
}

func start[T any](ctx context.Context, pool *pgxpool.Pool, brokers []string, name, topic string, h consumer.Handler[T]) (*service, error) {
	src, err := kafka.Open(ctx, kafka.Config{Brokers: brokers, Group: name, Topics: []string{topic},
		Sarama: saramaConfig(), Logger: quiet(), DeadLetter: kafka.DeadLetterConfig{Create: true}})
	if err != nil {
		return nil, err
	}
	c, err := consumer.New(pool, src, h, consumer.Config{Name: name, Telemetry: consumer.TelemetryConfig{Logger: quiet()}})
	if err != nil {
		return nil, err
	}
	s := &service{c: c, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		if err := c.Run(ctx); err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		}
	}()
	return s, nil
}

// killLeaderAfter wraps the relays' publishers: after the broker confirmed
// the batch-th batch, it terminates the leading relay's database session,
// before the relay can delete the rows it just published.
type killLeaderAfter struct {
	pool    *pgxpool.Pool
	batch   int64
	batches atomic.Int64
	killed  *atomic.Int64
}

type killingPublisher struct {
	outbox.Publisher
	k *killLeaderAfter
}

func (k *killLeaderAfter) wrap(p outbox.Publisher) outbox.Publisher { return killingPublisher{p, k} }

func (p killingPublisher) Publish(ctx context.Context, recs []outbox.Record) []error {
	errs := p.Publisher.Publish(ctx, recs)
	if errs == nil && p.k.batches.Add(1) == p.k.batch {
		var ended int
		err := p.k.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_locks
WHERE locktype = 'advisory' AND classid = $1::bigint::oid AND objid = 'outbox'::regclass AND objsubid = 2 AND granted`,
			int64(0x6f626f78)).Scan(&ended)
		if err == nil && ended > 0 {
			p.k.killed.Store(int64(len(recs)))
		}
	}
	return errs
}

// waitUntilShipped waits until every order is shipped and the outbox is
// empty.
func waitUntilShipped(ctx context.Context, pool *pgxpool.Pool, orders int, within time.Duration) error {
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		var shipped, pending int
		if err := pool.QueryRow(ctx, `SELECT (SELECT count(DISTINCT order_id) FROM shipments), (SELECT count(*) FROM outbox)`).
			Scan(&shipped, &pending); err != nil {
			return err
		}
		if shipped == orders && pending == 0 {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return errors.New("not every order was shipped within " + within.String())
}

// report counts each hop's effects and what reached the wire.
func report(pool *pgxpool.Pool, brokers []string, orders int, hop1, hop2 consumer.Stats, killedBatch int64) error {
	ctx := context.Background()
	var confirmed, confirmedDistinct, shipments, shipmentsDistinct int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM confirmed_orders), (SELECT count(DISTINCT order_id) FROM confirmed_orders),
	(SELECT count(*) FROM shipments), (SELECT count(DISTINCT order_id) FROM shipments)`).
		Scan(&confirmed, &confirmedDistinct, &shipments, &shipmentsDistinct); err != nil {
		return err
	}
	wire, ids, err := countRecords(brokers, confirmedTopic)
	if err != nil {
		return err
	}
	fmt.Printf("hop 1 (orders)    %5d received, %d handled, %d duplicates skipped -> %d orders confirmed (want %d)\n",
		hop1.Received, hop1.Handled, hop1.Duplicates, confirmed, orders)
	fmt.Printf("relay             2 relays; the leader's session killed after the broker confirmed a batch of %d, before deleting it\n", killedBatch)
	fmt.Printf("                  %5d order.confirmed records on the wire, %d distinct ids (want %d): %d re-published copies\n",
		wire, ids, orders, wire-ids)
	fmt.Printf("hop 2 (shipping)  %5d received, %d handled, %d duplicates skipped -> %d shipments (want %d)\n",
		hop2.Received, hop2.Handled, hop2.Duplicates, shipments, orders)
	ok := confirmed == orders && confirmedDistinct == orders && ids == orders && shipments == orders && shipmentsDistinct == orders
	if !ok {
		fmt.Println("verdict: FAIL")
		return errors.New("an order does not have exactly one effect per hop")
	}
	// What the demo is for: a batch the broker confirmed went out again.
	if killedBatch == 0 || wire == ids {
		fmt.Println("verdict: FAIL: nothing was re-published")
		return errors.New("no relay session was killed after a confirmed batch (too few orders for the kill's batch?), so no copy was re-published")
	}
	fmt.Println("verdict: PASS: each order confirmed once, published once (copies share its id), shipped once")
	return nil
}

// countRecords reads topic to its end and counts records and distinct
// "id" headers.
func countRecords(brokers []string, topic string) (records, ids int, err error) {
	client, err := sarama.NewClient(brokers, saramaConfig())
	if err != nil {
		return 0, 0, err
	}
	defer client.Close()
	cons, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return 0, 0, err
	}
	defer cons.Close()
	seen := map[string]bool{}
	for p := range int32(partitions) {
		hwm, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return 0, 0, err
		}
		if hwm == 0 {
			continue
		}
		pc, err := cons.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			return 0, 0, err
		}
		for m := range pc.Messages() {
			records++
			for _, h := range m.Headers {
				if string(h.Key) == "id" {
					seen[string(h.Value)] = true
				}
			}
			if m.Offset >= hwm-1 {
				break
			}
		}
		_ = pc.Close()
	}
	return records, len(seen), nil
}
