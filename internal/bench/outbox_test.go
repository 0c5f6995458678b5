package bench

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// TestOutboxRowsSmoke runs the outbox rows alone on Kafka (and RabbitMQ
// when AMQP_URL is set) with a small count: every row reaches the broker,
// the outbox is left empty, the rates and the latency are measured, and
// the table and the target line are printed.
func TestOutboxRowsSmoke(t *testing.T) {
	o := Options{
		Workload:   Workload{Partitions: 4},
		Brokers:    []Broker{Kafka},
		OutboxRows: 2000,
		Pace:       300 * time.Millisecond,
		PaceMax:    2000,
		// The schema of each row is created and dropped by the run.
		DatabaseURL: pgtest.URL(),
	}
	if u := rabbitURL(t, false); u != "" {
		o.Brokers, o.AMQPURL = append(o.Brokers, RabbitMQ), u
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rep, err := Run(ctx, o)
	require.NoError(t, err)
	require.Len(t, rep.Outbox, len(o.Brokers))
	for _, r := range rep.Outbox {
		require.True(t, r.Correct, "%s: %s", r.Broker, r.Check)
		require.Positive(t, r.CeilingRate, r.Broker)
		require.Positive(t, r.RelayRate, r.Broker)
		require.Len(t, r.RelayRates, r.Rounds, r.Broker)
		require.Len(t, r.CeilingRates, r.Rounds+1, "a ceiling before and after each relay round (%s)", r.Broker)
		require.Positive(t, r.VsCeiling, r.Broker)
		require.Positive(t, r.PacedMsgs, r.Broker)
		require.Positive(t, r.P50Ms, r.Broker)
		require.GreaterOrEqual(t, r.P99Ms, r.P50Ms, r.Broker)
		if r.Broker != RabbitMQ {
			// On Kafka (acks=all) a consumer reads a record only once the
			// high-water mark passed it, when the producer's answer goes
			// out too. RabbitMQ delivers a persistent message to its
			// consumer before the fsync that its publisher confirm waits
			// for, so there the downstream commit can come first.
			require.GreaterOrEqual(t, r.P50Ms, r.ConfirmP50Ms, "the downstream commit follows the broker's confirm (%s)", r.Broker)
		}
	}
	var out strings.Builder
	require.NoError(t, rep.WriteTable(&out))
	require.Contains(t, out.String(), "outbox relay >= 50% of the broker's confirmed-publish ceiling")
}

// Every row's schema, on every broker (apache-kafka has a hyphen), is an
// identifier the library accepts: the hand-written row hands it to
// dedup.Config.Schema.
func TestSchemaNamesAreValidIdentifiers(t *testing.T) {
	for _, b := range []Broker{Kafka, ApacheKafka, RabbitMQ} {
		for _, row := range append(AllRows, "outbox", HTTPPlain, HTTPIdempotency) {
			_, err := dedup.New(dedup.Config{Schema: schemaName(b, row)})
			require.NoError(t, err, "%s %s", b, row)
		}
	}
}

// The outbox rows' p50 and p99 are the nearest-rank percentiles, as the
// consumer rows' (percentile): of 1..100 ms, 50 and 99 ms.
func TestOutboxPercentilesAreNearestRank(t *testing.T) {
	var ds []time.Duration
	for i := 100; i >= 1; i-- {
		ds = append(ds, time.Duration(i)*time.Millisecond)
	}
	p50, p99 := percentiles(ds)
	require.InDelta(t, 50, p50, 1e-9)
	require.InDelta(t, 99, p99, 1e-9)
}

// TestCheckPublishedFindsTheWrongMessages: as many messages at the broker
// as rows is not enough; each must be a row's, once: a row published
// twice beside a row lost is wrong.
func TestCheckPublishedFindsTheWrongMessages(t *testing.T) {
	kc, err := startKafka(context.Background(), Kafka, "")
	require.NoError(t, err)
	defer kc.Close()
	for _, tc := range []struct {
		name  string
		ids   []string
		wrong int
	}{
		{"every row once", []string{"r0-0", "r0-1", "r1-0", "r1-1"}, 0},
		{"r0-0 twice, r1-1 lost", []string{"r0-0", "r0-0", "r0-1", "r1-0"}, 1},
	} {
		d := &outboxDest{b: Kafka, kc: kc, name: fmt.Sprintf("check-published-%d", time.Now().UnixNano()), partition: 2}
		require.NoError(t, d.create())
		sc := saramaConfig()
		sc.Producer.Return.Successes = true
		p, err := sarama.NewSyncProducer(kc.addrs, sc)
		require.NoError(t, err)
		for i, id := range tc.ids {
			m := d.message("x-", i)
			_, _, err := p.SendMessage(&sarama.ProducerMessage{Topic: d.name, Key: sarama.ByteEncoder(m.Key), Value: sarama.ByteEncoder(m.Body),
				Headers: []sarama.RecordHeader{{Key: []byte("id"), Value: []byte(id)}}})
			require.NoError(t, err)
		}
		require.NoError(t, p.Close())
		published, wrong, err := checkPublished(d, 2, 2)
		require.NoError(t, err)
		require.Equal(t, len(tc.ids), published, tc.name)
		require.Equal(t, tc.wrong, wrong, tc.name)
	}
}

// TestFailedOutboxRowKeepsTheReport: an outbox row that fails (here a
// paced phase whose rate writes no row) is reported failed, with its
// error, and the rest of the report (the HTTP rows, after it) still runs
// and is kept.
func TestFailedOutboxRowKeepsTheReport(t *testing.T) {
	o := Options{
		Workload:     Workload{Partitions: 4},
		Brokers:      []Broker{Kafka},
		OutboxRows:   300,
		Pace:         300 * time.Millisecond,
		PaceMax:      1, // no row due within the phase
		HTTPRequests: 200,
		DatabaseURL:  pgtest.URL(),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rep, err := Run(ctx, o)
	require.NoError(t, err)
	require.Len(t, rep.Outbox, 1)
	r := rep.Outbox[0]
	require.False(t, r.Correct)
	require.Contains(t, r.Error, "no row was written in the paced phase")
	require.Positive(t, r.RelayRate, "what was measured before the failure is kept")
	require.NotNil(t, rep.HTTP, "the HTTP rows ran after the failed outbox row")
	require.True(t, rep.HTTP.Correct())

	var out strings.Builder
	require.NoError(t, rep.WriteTable(&out))
	require.Contains(t, out.String(), "FAILED (")
	require.Contains(t, out.String(), "target kafka outbox relay >= 50% of the broker's confirmed-publish ceiling: ")
	require.Contains(t, out.String(), "(row failed), NOT met")
	require.Contains(t, out.String(), "effects exactly right in every row: NO")
}
