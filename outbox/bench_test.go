package outbox_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/outbox"
)

// BenchmarkRelay measures the relay's throughput (rows written beforehand,
// then published and deleted) next to the publisher's own ceiling: the
// same records sent in the same batches straight to the broker, with no
// database. Run with a fixed count, e.g.
//
//	go test -run '^$' -bench Relay -benchtime 20000x ./outbox/
func BenchmarkRelay(b *testing.B) {
	brs := []broker{newKafka(b)}
	if u := os.Getenv("AMQP_URL"); u != "" {
		brs = append(brs, &rabbit{url: u})
	}
	for _, br := range brs {
		b.Run(br.name()+"/ceiling", func(b *testing.B) { benchCeiling(b, br) })
		b.Run(br.name()+"/relay", func(b *testing.B) { benchRelay(b, br) })
	}
}

const benchBatch = outbox.DefaultBatchSize

func benchBody(i int) (key, body string) {
	key = fmt.Sprintf("k%d", i%64)
	return key, fmt.Sprintf(`%s/%d {"order_id":"o-%d","status":"confirmed","amount":4200}`, key, i, i)
}

// benchCeiling publishes b.N records in batches of the relay's size.
func benchCeiling(b *testing.B, br broker) {
	d := br.destination(b)
	pub := br.publisher(b)
	recs := make([]outbox.Record, 0, benchBatch)
	flush := func() {
		for i, err := range pub.Publish(context.Background(), recs) {
			require.NoError(b, err, "record %d", i)
		}
		recs = recs[:0]
	}
	b.ResetTimer()
	for i := range b.N {
		m := d.msg(benchBody(i))
		recs = append(recs, outbox.Record{Seq: int64(i), EventID: fmt.Sprint(i), Topic: m.Topic, RoutingKey: m.RoutingKey,
			Key: m.Key, Body: m.Body, CreatedAt: time.Now()})
		if len(recs) == benchBatch {
			flush()
		}
	}
	if len(recs) > 0 {
		flush()
	}
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
}

// benchRelay writes b.N rows, then times the relay publishing all of them.
func benchRelay(b *testing.B, br broker) {
	pool, _ := migrated(b)
	d := br.destination(b)
	ctx := context.Background()
	for from := 0; from < b.N; from += 1000 {
		msgs := make([]outbox.Message, 0, 1000)
		for i := from; i < min(from+1000, b.N); i++ {
			msgs = append(msgs, d.msg(benchBody(i)))
		}
		require.NoError(b, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return outbox.Add(ctx, tx, msgs...) }))
	}
	b.ResetTimer()
	startRelay(b, pool, br.publisher(b), outbox.RelayConfig{SkipMigrate: true, BatchSize: benchRelayBatch()})
	for {
		var left int
		require.NoError(b, pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&left))
		if left == 0 {
			break
		}
		time.Sleep(2 * time.Millisecond) // a benchmark's poll of the table, not a wait for a result
	}
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
}

// benchRelayBatch is the relay's batch size: ONCE_OUTBOX_BATCH, else the
// default.
func benchRelayBatch() int {
	if n, err := strconv.Atoi(os.Getenv("ONCE_OUTBOX_BATCH")); err == nil {
		return n
	}
	return outbox.DefaultBatchSize
}

// BenchmarkLatency writes b.N rows at ONCE_OUTBOX_RATE rows a second
// (default 2000), one transaction each, with a relay and a consumer of this
// library downstream (Kafka, kfake), and reports the time from each
// writer's commit to the downstream handler seeing the message: p50 and p99.
//
//	go test -run '^$' -bench Latency -benchtime 10000x ./outbox/
func BenchmarkLatency(b *testing.B) {
	rate := 2000
	if n, err := strconv.Atoi(os.Getenv("ONCE_OUTBOX_RATE")); err == nil && n > 0 {
		rate = n
	}
	k := newKafka(b)
	pool, _ := migrated(b)
	d := k.destination(b)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE effects (event_id text NOT NULL)`)
	require.NoError(b, err)
	committed := make([]time.Time, b.N)
	seen := make([]time.Time, b.N)
	var received atomic.Int64
	handle := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[[]byte]) error {
		i, err := strconv.Atoi(strings.TrimPrefix(ev.ID, "lat-"))
		if err != nil || i < 0 || i >= len(seen) {
			return consumer.Permanent(fmt.Errorf("unexpected id %q", ev.ID))
		}
		if seen[i].IsZero() {
			seen[i] = time.Now()
			received.Add(1)
		}
		_, err = tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, ev.ID)
		return err
	}
	c, err := consumer.New(pool, d.source(b, "latency"), handle, consumer.Config{Name: "latency", Telemetry: consumer.TelemetryConfig{Logger: testLogger()}})
	require.NoError(b, err)
	run(b, c.Run)
	startRelay(b, pool, k.publisher(b), outbox.RelayConfig{SkipMigrate: true})

	b.ResetTimer()
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	for i := range b.N {
		<-tick.C
		m := d.msg(benchBody(i))
		m.ID = "lat-" + strconv.Itoa(i)
		require.NoError(b, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return outbox.Add(ctx, tx, m) }))
		committed[i] = time.Now()
	}
	require.Eventually(b, func() bool { return received.Load() == int64(b.N) }, time.Minute, time.Millisecond)
	b.StopTimer()
	lat := make([]time.Duration, b.N)
	for i := range lat {
		lat[i] = seen[i].Sub(committed[i])
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
	b.ReportMetric(float64(rate), "rows/s")
}
