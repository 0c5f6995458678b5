package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

func TestMain(m *testing.M) {
	RunChildIfRequested()
	pgtest.Main(m)
}

func TestWorkloadCounts(t *testing.T) {
	w := Workload{Events: 2000, DupEvery: 10, PoisonEvery: 50, Partitions: 4}
	var got Counts
	seen := map[string]int{}
	w.Each("e", func(m Msg) bool {
		got.Messages++
		seen[m.ID]++
		if m.Poison {
			got.Poison++
		}
		require.Equal(t, m.Partition, int32(atoiSuffix(t, m.ID)%4), "a copy stays in its original's partition")
		return true
	})
	for _, n := range seen {
		if n == 1 {
			continue
		}
		require.Equal(t, 2, n)
	}
	got.Valid = len(seen) - got.Poison
	require.Equal(t, w.Counts(), got)
	require.Equal(t, Counts{Messages: 2200, Valid: 1960, Poison: 40}, got)
}

func atoiSuffix(t *testing.T, id string) int {
	n := 0
	for _, c := range id[1:] {
		require.True(t, c >= '0' && c <= '9', id)
		n = n*10 + int(c-'0')
	}
	return n
}

// rabbitURL returns AMQP_URL. Without it a test that needs RabbitMQ
// (needed) is skipped, and one that covers it beside Kafka runs on Kafka
// alone; under ONCE_REQUIRE_SERVERS=1 (make test) both fail instead, so
// that a run meant to cover RabbitMQ never passes without it.
func rabbitURL(t *testing.T, needed bool) string {
	t.Helper()
	u := os.Getenv("AMQP_URL")
	switch {
	case u != "":
	case os.Getenv("ONCE_REQUIRE_SERVERS") == "1":
		t.Fatal("AMQP_URL is not set and ONCE_REQUIRE_SERVERS=1: start a broker with scripts/rabbitmq.sh start DIR")
	case needed:
		t.Skip("AMQP_URL is not set")
	}
	return u
}

// TestSmoke runs the naive, the batched and the key-lanes rows on Kafka
// (and all but the last on RabbitMQ when AMQP_URL is set) with a small workload, paced phase included, and
// requires every row's effects to be exactly right.
func TestSmoke(t *testing.T) {
	o := Options{
		Workload:    Workload{Events: 300, DupEvery: 10, PoisonEvery: 50, Partitions: 4},
		Brokers:     []Broker{Kafka},
		Rows:        []Row{RowCeiling, RowNaive, RowHandwritten, RowOnceBatched, RowOnceKeyLanes},
		Pace:        300 * time.Millisecond,
		PaceMax:     500,
		DatabaseURL: pgtest.URL(),
	}
	if u := rabbitURL(t, false); u != "" {
		o.Brokers, o.AMQPURL = append(o.Brokers, RabbitMQ), u
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := Run(ctx, o)
	require.NoError(t, err)
	rows := 0
	for _, b := range o.Brokers {
		for _, r := range o.Rows {
			if r.ForBroker(b) {
				rows++
			}
		}
	}
	require.Len(t, rep.Results, rows)
	want := o.Workload.Counts()
	for _, r := range rep.Results {
		require.True(t, r.Correct, "%s %s: %s", r.Broker, r.Row, r.Check)
		require.Equal(t, want.Messages, r.Messages)
		require.Positive(t, r.Rate)
		require.Positive(t, r.PacedMsgs, "%s %s: the paced phase produced", r.Broker, r.Row)
		require.Positive(t, r.P99Ms)
		require.GreaterOrEqual(t, r.P99Ms, r.P50Ms)
		require.Positive(t, r.AllocsPerMsg)
		require.Positive(t, r.PeakRSSMB)
		if r.Row == RowNaive {
			require.InDelta(t, 1.0, r.VsNaive, 1e-9)
		}
	}
}

// TestRunsInARow runs two rows twice: the results carry their run, each
// ratio compares rows of the same run, and the wake-lag probe measured the
// paced phase.
func TestRunsInARow(t *testing.T) {
	o := Options{
		Workload:    Workload{Events: 300, DupEvery: 10, PoisonEvery: 50, Partitions: 4},
		Brokers:     []Broker{Kafka},
		Rows:        []Row{RowHandwritten, RowOnceBatchHandler},
		Pace:        300 * time.Millisecond,
		PaceMax:     500,
		Runs:        2,
		DatabaseURL: pgtest.URL(),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := Run(ctx, o)
	require.NoError(t, err)
	require.Len(t, rep.Results, 4)
	for i, r := range rep.Results {
		require.Equal(t, i/2+1, r.Run, "%s %s", r.Broker, r.Row)
		require.True(t, r.Correct, "%s %s: %s", r.Broker, r.Row, r.Check)
		require.Positive(t, r.WakeLagMaxMs, "the wake-lag probe ran in the paced phase")
		require.GreaterOrEqual(t, r.WakeLagMaxMs, r.WakeLagP99Ms)
		require.Zero(t, r.DiskSyncMaxMs, "no disk probe for a DATABASE_URL server")
	}
	for i := 1; i < len(rep.Results); i += 2 {
		lib, hand := rep.Results[i], rep.Results[i-1]
		require.InDelta(t, lib.Rate/hand.Rate, lib.VsHandwritten, 1e-9, "run %d", lib.Run)
	}
	var line string
	for _, x := range rep.Targets() {
		if strings.HasPrefix(x, "target kafka best library row >= the hand-written batched row: ") {
			line = x
		}
	}
	require.Equal(t, 2, len(strings.Split(line, " | ")), "one value per run: %q", line)
}

// TestCheckFindsWrongEffects: a business row written twice and a missing
// dead letter make a row incorrect.
func TestCheckFindsWrongEffects(t *testing.T) {
	ctx := context.Background()
	db, _ := pgtest.Schema(t)
	kc, err := startKafka(context.Background(), Kafka, "")
	require.NoError(t, err)
	defer kc.Close()
	spec := &rowSpec{Broker: Kafka, Schema: "oncebench_check_test", Topic: "check-test", Group: "check-test-group"}
	require.NoError(t, createSchema(ctx, db, spec.Schema))
	defer dropSchema(db, spec.Schema)
	require.NoError(t, kc.createTopics(spec.Topic, 1))
	// ev-0 and ev-1 valid, ev-2 poison.
	w := Workload{Events: 3, PoisonEvery: 3, Partitions: 1}
	_, err = db.Exec(ctx, `INSERT INTO oncebench_check_test.effects VALUES ('ev-0', 0, 'acct-0', 100), ('ev-1', 1, 'acct-1', 101)`)
	require.NoError(t, err)

	ok, msg, err := check(ctx, db, kc, spec, RowNaive, consumed{"ev-", Workload{Events: 2, Partitions: 1}})
	require.NoError(t, err)
	require.True(t, ok, msg)

	ok, msg, err = check(ctx, db, kc, spec, RowNaive, consumed{"ev-", w})
	require.NoError(t, err)
	require.False(t, ok, "a missing dead letter: %s", msg)
	require.Contains(t, msg, "dlq 0/1")

	_, err = db.Exec(ctx, `INSERT INTO oncebench_check_test.effects VALUES ('ev-1', 1, 'acct-1', 101)`)
	require.NoError(t, err)
	ok, msg, err = check(ctx, db, kc, spec, RowNaive, consumed{"ev-", Workload{Events: 2, Partitions: 1}})
	require.NoError(t, err)
	require.False(t, ok, "an effect written twice: %s", msg)
	require.Contains(t, msg, "rows 3 distinct 2/2")
}

func TestPercentile(t *testing.T) {
	var d []time.Duration
	for i := 1; i <= 100; i++ {
		d = append(d, time.Duration(i))
	}
	require.Equal(t, time.Duration(50), percentile(d, 0.5))
	require.Equal(t, time.Duration(99), percentile(d, 0.99))
	require.Equal(t, time.Duration(100), percentile(d, 1))
	require.Equal(t, time.Duration(0), percentile(nil, 0.99))
}

// TestLazyQueueRows: with AMQPLazy the rows' queues are declared lazy, by
// the bench and by the adapter alike (a declare whose arguments differ
// from the queue's would close the channel), and the rows stay exact. The
// header says where the node keeps its files (the ONCE_RABBITMQ_DIR that
// scripts/rabbitmq.sh exports): a broker on the database's disk stalls
// its WAL flushes.
func TestLazyQueueRows(t *testing.T) {
	url := rabbitURL(t, true)
	t.Setenv("ONCE_RABBITMQ_DIR", "/dev/shm/once-bench-rabbit-test")
	o := Options{
		Workload:    Workload{Events: 300, DupEvery: 10, PoisonEvery: 50, Partitions: 4},
		Brokers:     []Broker{RabbitMQ},
		Rows:        []Row{RowHandwritten, RowOnceBatchHandler},
		AMQPURL:     url,
		AMQPLazy:    true,
		DatabaseURL: pgtest.URL(),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := Run(ctx, o)
	require.NoError(t, err)
	require.True(t, rep.AMQPLazy)
	require.Len(t, rep.Results, 2)
	for _, r := range rep.Results {
		require.True(t, r.Correct, "%s %s: %s", r.Broker, r.Row, r.Check)
	}
	var table strings.Builder
	require.NoError(t, rep.WriteTable(&table))
	require.Contains(t, table.String(), "RabbitMQ queues: lazy")
	require.Equal(t, "/dev/shm/once-bench-rabbit-test", rep.RabbitMQDir)
	require.Contains(t, table.String(), "files: RabbitMQ /dev/shm/once-bench-rabbit-test\n",
		"DATABASE_URL given: no PostgreSQL directory; no Apache Kafka row: no Kafka directory")
}

// The diagnostic without fsync starts its own server: a server named by
// DATABASE_URL keeps its own settings, so the option is refused there
// rather than silently ignored.
func TestPGNoFsyncNeedsTheThrowawayServer(t *testing.T) {
	_, err := Run(context.Background(), Options{PGNoFsync: true, DatabaseURL: "postgres://127.0.0.1:1/none"})
	require.Error(t, err)
	require.Contains(t, err.Error(), "-pg-no-fsync")
}

// TestCheckFindsEffectsOfTheWrongEvents: as many business rows as valid
// events, each id once, is not enough: a valid event whose effect is
// missing beside an effect of no event of the workload, or an effect
// whose values are not its event's, makes a row incorrect.
func TestCheckFindsEffectsOfTheWrongEvents(t *testing.T) {
	ctx := context.Background()
	db, _ := pgtest.Schema(t)
	kc, err := startKafka(context.Background(), Kafka, "")
	require.NoError(t, err)
	defer kc.Close()
	spec := &rowSpec{Broker: Kafka, Schema: "oncebench_check_ids_test", Topic: "check-ids-test", Group: "check-ids-test-group"}
	require.NoError(t, createSchema(ctx, db, spec.Schema))
	defer dropSchema(db, spec.Schema)
	require.NoError(t, kc.createTopics(spec.Topic, 1))
	want := consumed{"ev-", Workload{Events: 3, Partitions: 1}}
	reset := func(values string) {
		_, err := db.Exec(ctx, `TRUNCATE oncebench_check_ids_test.effects; INSERT INTO oncebench_check_ids_test.effects VALUES `+values)
		require.NoError(t, err)
	}

	reset(`('ev-0', 0, 'acct-0', 100), ('ev-1', 1, 'acct-1', 101), ('ev-2', 2, 'acct-2', 102)`)
	ok, msg, err := check(ctx, db, kc, spec, RowNaive, want)
	require.NoError(t, err)
	require.True(t, ok, msg)

	reset(`('ev-0', 0, 'acct-0', 100), ('ev-1', 1, 'acct-1', 101), ('ev-9', 9, 'acct-9', 109)`)
	ok, msg, err = check(ctx, db, kc, spec, RowNaive, want)
	require.NoError(t, err)
	require.False(t, ok, "ev-2 lost, an effect of no event written: %s", msg)
	require.Contains(t, msg, "rows 3 distinct 3/3, valid events without their row 1, rows of no valid event 1")

	reset(`('ev-0', 0, 'acct-0', 100), ('ev-1', 1, 'acct-1', 101), ('ev-2', 1, 'acct-1', 101)`)
	ok, msg, err = check(ctx, db, kc, spec, RowNaive, want)
	require.NoError(t, err)
	require.False(t, ok, "ev-2 written with ev-1's values: %s", msg)
}

// TestPacedPhaseWithoutMeasuredMessages: a paced phase too short for its
// rate to produce a message after the warm-up has no latency to give; the
// row fails rather than report a p99 of 0 ms that meets every tail target.
func TestPacedPhaseWithoutMeasuredMessages(t *testing.T) {
	o := Options{
		Workload:    Workload{Events: 300, PoisonEvery: 50, Partitions: 4},
		Brokers:     []Broker{Kafka},
		Rows:        []Row{RowOnceBatchHandler},
		Pace:        300 * time.Millisecond,
		PaceMax:     1, // one message, at the start of the phase
		DatabaseURL: pgtest.URL(),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := Run(ctx, o)
	require.NoError(t, err)
	require.Len(t, rep.Results, 1)
	r := rep.Results[0]
	require.False(t, r.Correct)
	// The subprocess says why on stderr, and the report keeps it.
	require.Contains(t, r.Error, "row subprocess")
	require.Contains(t, r.Error, "none of its 1 messages was produced after the warm-up")
	require.NotContains(t, strings.Join(rep.Targets(), "\n"), ", met")
}

// TestFailedRowKeepsTheReport: a row whose subprocess fails (here the
// library's rows, refused an invalid Concurrency) is reported failed, with
// its error, beside the rows that ran, which keep their figures in the
// table and in the JSON; the report then says the effects were not right
// everywhere.
func TestFailedRowKeepsTheReport(t *testing.T) {
	o := Options{
		Workload:    Workload{Events: 300, DupEvery: 10, PoisonEvery: 50, Partitions: 4},
		Brokers:     []Broker{Kafka},
		Rows:        []Row{RowHandwritten, RowOnceBatched, RowNaive},
		Concurrency: -1,
		DatabaseURL: pgtest.URL(),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := Run(ctx, o)
	require.NoError(t, err)
	require.Len(t, rep.Results, 3, "the row after the failed one ran too")
	hand, lib, naive := rep.Results[0], rep.Results[1], rep.Results[2]
	require.True(t, hand.Correct, hand.Check)
	require.Positive(t, hand.Rate)
	require.True(t, naive.Correct, naive.Check)
	require.False(t, lib.Correct)
	require.Contains(t, lib.Error, "row subprocess")
	require.Contains(t, lib.Error, "Concurrency must not be negative", "the subprocess's reason")
	require.Zero(t, lib.VsHandwritten)

	var table strings.Builder
	require.NoError(t, rep.WriteTable(&table))
	var libLine, handLine string
	for _, l := range strings.Split(table.String(), "\n") {
		switch {
		case strings.Contains(l, string(RowOnceBatched)+"|"):
			libLine = l
		case strings.Contains(l, string(RowHandwritten)+"|"):
			handLine = l
		}
	}
	require.Contains(t, libLine, "FAILED (row subprocess")
	require.NotContains(t, libLine, " 0 |", "no figure of a row that measured none")
	require.Contains(t, handLine, fmt.Sprintf("%.0f", hand.Rate))
	require.Contains(t, table.String(), "effects exactly right in every row: NO")

	path := filepath.Join(t.TempDir(), "bench.json")
	require.NoError(t, rep.WriteJSON(path))
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	var got struct {
		Rows []map[string]any `json:"rows"`
	}
	require.NoError(t, json.Unmarshal(raw, &got))
	require.Len(t, got.Rows, 3)
	require.Equal(t, lib.Error, got.Rows[1]["error"])
	require.NotContains(t, got.Rows[0], "error", "a row that ran has no error")
}

// TestCheckFindsTheWrongDeadLetter: as many dead letters as poison
// messages is not enough; each must be a poison message's copy, not a
// valid event's.
func TestCheckFindsTheWrongDeadLetter(t *testing.T) {
	ctx := context.Background()
	db, _ := pgtest.Schema(t)
	kc, err := startKafka(context.Background(), Kafka, "")
	require.NoError(t, err)
	defer kc.Close()
	spec := &rowSpec{Broker: Kafka, Schema: "oncebench_check_dlq_test", Topic: "check-dlq-test", Group: "check-dlq-test-group"}
	require.NoError(t, createSchema(ctx, db, spec.Schema))
	defer dropSchema(db, spec.Schema)
	require.NoError(t, kc.createTopics(spec.Topic, 1))
	// ev-0 and ev-1 valid, ev-2 poison.
	want := consumed{"ev-", Workload{Events: 3, PoisonEvery: 3, Partitions: 1}}
	_, err = db.Exec(ctx, `INSERT INTO oncebench_check_dlq_test.effects VALUES ('ev-0', 0, 'acct-0', 100), ('ev-1', 1, 'acct-1', 101)`)
	require.NoError(t, err)

	deadLetter := func(topic, id string) {
		sc := saramaConfig()
		sc.Producer.Return.Successes = true
		p, err := sarama.NewSyncProducer(kc.addrs, sc)
		require.NoError(t, err)
		defer p.Close()
		_, _, err = p.SendMessage(&sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder(id), Value: sarama.StringEncoder("x"),
			Headers: []sarama.RecordHeader{{Key: []byte("id"), Value: []byte(id)}}})
		require.NoError(t, err)
	}
	deadLetter(spec.Topic+".dlq", "ev-0")
	ok, msg, err := check(ctx, db, kc, spec, RowNaive, want)
	require.NoError(t, err)
	require.False(t, ok, "a valid event dead-lettered, the poison one not: %s", msg)

	// The same state with the poison message's copy is right.
	spec.Topic, spec.Group = "check-dlq-test-2", "check-dlq-test-2-group"
	require.NoError(t, kc.createTopics(spec.Topic, 1))
	deadLetter(spec.Topic+".dlq", "ev-2")
	ok, msg, err = check(ctx, db, kc, spec, RowNaive, want)
	require.NoError(t, err)
	require.True(t, ok, msg)
}

// TestCheckFindsTheWrongDeadLetterOnRabbitMQ: the same on a dead-letter
// queue, whose messages keep their message id.
func TestCheckFindsTheWrongDeadLetterOnRabbitMQ(t *testing.T) {
	url := rabbitURL(t, true)
	ctx := context.Background()
	db, _ := pgtest.Schema(t)
	spec := &rowSpec{Broker: RabbitMQ, AMQPURL: url, Schema: "oncebench_check_dlq_amqp_test"}
	require.NoError(t, createSchema(ctx, db, spec.Schema))
	defer dropSchema(db, spec.Schema)
	want := consumed{"ev-", Workload{Events: 3, PoisonEvery: 3, Partitions: 1}}
	_, err := db.Exec(ctx, `INSERT INTO oncebench_check_dlq_amqp_test.effects VALUES ('ev-0', 0, 'acct-0', 100), ('ev-1', 1, 'acct-1', 101)`)
	require.NoError(t, err)
	for _, tc := range []struct {
		id      string
		correct bool
	}{{"ev-0", false}, {"ev-2", true}} {
		spec.Queue = fmt.Sprintf("oncebench.check-dlq.%d", time.Now().UnixNano())
		require.NoError(t, declareQueue(url, spec.Queue, nil))
		require.NoError(t, declareQueue(url, spec.Queue+amqp.DeadLetterQueueSuffix, nil))
		p, err := newAMQPPublisher(url)
		require.NoError(t, err)
		require.NoError(t, p.publish(spec.Queue+amqp.DeadLetterQueueSuffix, amqpPublishing(Msg{ID: tc.id, Value: []byte("x")}, time.Time{})))
		require.NoError(t, p.Close())
		ok, msg, err := check(ctx, db, nil, spec, RowNaive, want)
		deleteQueues(url, spec.Queue)
		require.NoError(t, err)
		require.Equal(t, tc.correct, ok, "dead letter %s: %s", tc.id, msg)
	}
}

// TestHandWrittenWorkerPerPartition: the hand-written row gives each
// Kafka partition its worker on every broker of the Kafka protocol, Apache
// Kafka's as kfake's, and shares one queue among its workers on RabbitMQ.
func TestHandWrittenWorkerPerPartition(t *testing.T) {
	for _, b := range []Broker{Kafka, ApacheKafka} {
		for p := range int32(4) {
			require.Equal(t, int(p), handWorker(b, &consumer.Message{Partition: p}, 4), "%s partition %d", b, p)
		}
	}
	require.Equal(t, 0, handWorker(RabbitMQ, &consumer.Message{Partition: -1}, 4))
}

// TestHungRowIsKilledAtItsDeadline: a row's subprocess that never gets
// anywhere (its Kafka "broker" accepts connections and never answers) is
// killed at its deadline, and the row fails saying so, instead of the
// bench waiting for it.
func TestHungRowIsKilledAtItsDeadline(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	go func() {
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				_ = c.Close()
			}
		}()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c) // held open, never answered
		}
	}()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel() // kills the subprocess if it is still running
	spec := &rowSpec{Row: RowCeiling, Broker: Kafka, Brokers: []string{ln.Addr().String()}, Topic: "hung", Group: "hung-group",
		Backlog: 10, Timeout: time.Minute}
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		_, err := runSubprocess(ctx, spec, 2*time.Second)
		done <- err
	}()
	select {
	case err := <-done:
		require.Error(t, err)
		require.Contains(t, err.Error(), "killed after its deadline of 2s")
		require.Less(t, time.Since(start), 20*time.Second)
	case <-time.After(20 * time.Second): // the bound of this test, not a wait for a result
		t.Fatalf("the row's subprocess still runs %s after a deadline of 2s", time.Since(start))
	}
}

// TestRowDeadline: by default a row's subprocess has three times the time
// each of its phases may take, its paced phase and a minute; the option
// overrides it.
func TestRowDeadline(t *testing.T) {
	spec := &rowSpec{Timeout: time.Minute + 22*time.Second, Pace: 3 * time.Second}
	require.Equal(t, 3*(time.Minute+22*time.Second)+3*time.Second+time.Minute, rowDeadline(Options{}, spec))
	require.Equal(t, 10*time.Minute, rowDeadline(Options{RowTimeout: 10 * time.Minute}, spec))
}

// TestBrokerThatDoesNotStartKeepsTheReport: a broker that cannot start
// (here Apache Kafka, its jars missing) fails its rows, each reported
// with the reason, and the rows of the broker before it are kept.
func TestBrokerThatDoesNotStartKeepsTheReport(t *testing.T) {
	t.Setenv("ONCE_KAFKA_LIBS", t.TempDir()) // no jars
	o := Options{
		Workload:    Workload{Events: 300, DupEvery: 10, PoisonEvery: 50, Partitions: 4},
		Brokers:     []Broker{Kafka, ApacheKafka},
		Rows:        []Row{RowHandwritten, RowOnceBatchHandler},
		DatabaseURL: pgtest.URL(),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := Run(ctx, o)
	require.NoError(t, err)
	require.Len(t, rep.Results, 4)
	for _, r := range rep.Results[:2] {
		require.Equal(t, Kafka, r.Broker)
		require.True(t, r.Correct, "%s %s: %s", r.Broker, r.Row, r.Check)
	}
	for _, r := range rep.Results[2:] {
		require.Equal(t, ApacheKafka, r.Broker)
		require.False(t, r.Correct)
		require.Contains(t, r.Error, "holds no kafka_2.13 jar", "%s %s", r.Broker, r.Row)
	}
	require.Contains(t, rep.Targets(), "effects exactly right in every row: NO")
}
