package main

import (
	"context"
	"io"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/kafkatest"
	"github.com/onceco/once/internal/pgtest"
)

// The default demo, with a smaller load: embedded Kafka, a consumer process
// killed mid-stream, a second run, and its own verdict must pass.
func TestDemoKafkaVerdictPasses(t *testing.T) {
	_, schema := pgtest.Schema(t)
	t.Setenv("KAFKA_BROKERS", "")
	code, out := runCommand(t, context.Background(), "demo", "-schema", schema, "-orders", "1500", "-seed", "42", "-metrics-addr", "off")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "verdict: PASS")
	require.Contains(t, out, "then SIGKILL")
	require.Contains(t, out, "hop 2: each paid order confirmed once through the outbox, published (copies share its id), shipped once")
	require.Regexp(t, `listening on 127\.0\.0\.1:\d+`, out)
}

// The same demo against Apache Kafka itself (a throwaway node shared by
// the test binary, topic auto-creation off): the demo creates its topics,
// kills a consumer process mid-stream, and its verdict must pass.
func TestDemoApacheKafkaVerdictPasses(t *testing.T) {
	broker := kafkatest.Shared(t)
	_, schema := pgtest.Schema(t)
	t.Setenv("KAFKA_BROKERS", strings.Join(broker.Brokers(), ","))
	code, out := runCommand(t, context.Background(), "demo", "-schema", schema, "-orders", "1000", "-seed", "43", "-metrics-addr", "off")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "verdict: PASS")
	require.Contains(t, out, "then SIGKILL")
	require.Contains(t, out, "hop 2: each paid order confirmed once through the outbox, published (copies share its id), shipped once")
	require.Contains(t, out, "Kafka: "+broker.Brokers()[0])
}

// The same demo against RabbitMQ (AMQP_URL), its queue and dead-letter
// queue created for the run and deleted after it.
func TestDemoRabbitMQVerdictPasses(t *testing.T) {
	requireAMQP(t)
	_, schema := pgtest.Schema(t)
	code, out := runCommand(t, context.Background(), "demo", "-broker", "amqp", "-schema", schema, "-orders", "1000", "-metrics-addr", "off")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "verdict: PASS")
	require.Contains(t, out, "then SIGKILL")
	require.Contains(t, out, "hop 2: each paid order confirmed once through the outbox, published (copies share its id), shipped once")
}

// The demo exits non-zero when it cannot run: here an unreachable Kafka
// address.
func TestDemoFailsWithoutBroker(t *testing.T) {
	_, schema := pgtest.Schema(t)
	t.Setenv("KAFKA_BROKERS", "127.0.0.1:1")
	code, _ := runCommand(t, context.Background(), "demo", "-schema", schema, "-orders", "10", "-metrics-addr", "off")
	require.Equal(t, 1, code)
}

// The demo runs again on the schema of an earlier run (DATABASE_URL and
// the default -schema order_demo): it empties the tables the library
// migrated and versioned instead of dropping them under their recorded
// version, and its verdict passes again.
func TestDemoRunsAgainOnItsSchema(t *testing.T) {
	_, schema := pgtest.Schema(t)
	t.Setenv("KAFKA_BROKERS", "")
	for run := 1; run <= 2; run++ {
		code, out := runCommand(t, context.Background(), "demo", "-schema", schema, "-orders", "200", "-seed", "44",
			"-metrics-addr", "off", "-crash=false")
		require.Equal(t, 0, code, "run %d:\n%s", run, out)
		require.Contains(t, out, "verdict: PASS", "run %d", run)
	}
}

// The sample output of README.md and docs/getting-started.md is the
// demo's: line for line once numbers, durations and addresses are set
// aside, from "published" to the verdict (the lines printed only when
// needed aside), and each line above it one the demo prints.
func TestDocsShowTheDemosOutput(t *testing.T) {
	_, schema := pgtest.Schema(t)
	t.Setenv("KAFKA_BROKERS", "")
	code, out := runCommand(t, context.Background(), "demo", "-schema", schema, "-orders", "1500", "-seed", "45", "-metrics-addr", "off")
	require.Equal(t, 0, code, out)
	number := regexp.MustCompile(`(\d+(\.\d+)?(ns|µs|ms|s|m|h)?)+`)
	shape := func(l string) string { return strings.Join(strings.Fields(number.ReplaceAllString(l, "N")), " ") }
	// Lines printed only in some runs: a replay, HTTP errors, mismatches.
	sometimes := regexp.MustCompile(`^\s*(run 3|http errors|wrong answers|replayed|mismatch|\.\.\. and)`)
	split := func(text string) (head, report []string) {
		lines := strings.Split(strings.TrimSpace(text), "\n")
		for i, l := range lines {
			if strings.HasPrefix(l, "published ") {
				head = lines[:i]
				for _, l := range lines[i:] {
					if !sometimes.MatchString(l) {
						report = append(report, shape(l))
					}
				}
				return head, report
			}
		}
		return lines, nil
	}
	outHead, outReport := split(out)
	printed := map[string]bool{}
	for _, l := range outHead {
		printed[shape(l)] = true
	}
	for _, doc := range []string{"../../README.md", "../../docs/getting-started.md"} {
		text, err := os.ReadFile(doc)
		require.NoError(t, err)
		var sample string
		for i, block := range strings.Split(string(text), "```") {
			if i%2 == 1 && strings.Contains(block, "\nverdict: ") {
				sample = strings.TrimPrefix(block, "\n")
			}
		}
		require.NotEmpty(t, sample, "%s shows the demo's output", doc)
		head, report := split(sample)
		assert.Equal(t, outReport, report, "%s: the sample from \"published\" on", doc)
		for _, l := range head {
			if strings.HasPrefix(l, "PostgreSQL:") || strings.HasPrefix(l, "metrics:") {
				continue // not printed with DATABASE_URL set and -metrics-addr off
			}
			assert.True(t, printed[shape(l)], "%s: the demo prints no line like %q", doc, l)
		}
	}
}

// The demo's killed first run is started with the demo's own settings:
// with -offsets-in-database, its consumer too keeps its offsets in
// PostgreSQL.
func TestKilledRunTakesTheDemosOffsetsInDatabase(t *testing.T) {
	pool, schema := pgtest.Schema(t)
	ctx := context.Background()
	require.NoError(t, resetDemoTables(ctx, pool))
	o := &options{broker: "kafka", topic: "orders", name: "killed-" + schema, schema: schema, partitions: 2,
		unknownOrderWait: 100 * time.Millisecond, maxAttempts: 4, offsetsInDB: true,
		mix: Mix{Orders: 100, Seed: 46}}
	k, err := startEmbeddedKafka(0, o.topic, int32(o.partitions))
	require.NoError(t, err)
	defer k.Close()
	o.kafkaBrokers, o.fastFailover = k.addrs, true
	plan := Generate(o.mix)
	pub, err := newKafkaPublisher(o.kafkaBrokers, o.topic)
	require.NoError(t, err)
	require.NoError(t, pub.Publish(ctx, plan.Messages))
	require.NoError(t, pub.Close())

	committed, err := killedRun(ctx, o, pgtest.URL(), pool, plan.uniqueEvents(), io.Discard)
	require.NoError(t, err)
	require.EqualValues(t, plan.uniqueEvents(), committed)
	var rows int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM processed_events_offsets WHERE consumer = $1`, o.name).Scan(&rows))
	require.Positive(t, rows, "the killed run's consumer wrote its offsets in the database")
}

// A RabbitMQ demo stopped midway (Ctrl-C) removes the queues it declared
// for the run, the second hop's too: they are on the user's broker.
func TestDemoRabbitMQStoppedMidwayRemovesItsQueues(t *testing.T) {
	url := requireAMQP(t)
	_, schema := pgtest.Schema(t)
	t.Setenv("DATABASE_URL", pgtest.URL())
	t.Setenv("BROKER", "")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errOut syncBuffer
	done := make(chan int, 1)
	go func() {
		done <- realMain(ctx, []string{"demo", "-broker", "amqp", "-schema", schema, "-orders", "1000", "-seed", "471",
			"-metrics-addr", "off"}, &out, &errOut)
	}()
	waitMatch(t, &out, regexp.MustCompile(`published \d+ messages`))
	cancel() // the first signal
	select {
	case code := <-done:
		require.Equal(t, 1, code, "stdout:\n%s\nstderr:\n%s", out.String(), errOut.String())
	case <-time.After(60 * time.Second):
		t.Fatalf("the demo did not stop within 60s of its context being cancelled\nstdout:\n%s", out.String())
	}
	requireNoQueues(t, url, "orders-demo-471")
}

// requireNoQueues checks that RabbitMQ has none of the queues of a demo
// run on topic (deleting those it finds).
func requireNoQueues(t *testing.T, url, topic string) {
	t.Helper()
	conn, err := amqp091.Dial(url)
	require.NoError(t, err)
	defer conn.Close()
	for _, q := range []string{topic, topic + ".dlq", topic + ".confirmed", topic + ".confirmed.dlq"} {
		ch, err := conn.Channel()
		require.NoError(t, err)
		_, err = ch.QueueDeclarePassive(q, true, false, false, false, nil)
		var aerr *amqp091.Error
		if assert.ErrorAs(t, err, &aerr, "queue %s is still on the broker", q) {
			assert.Equal(t, amqp091.NotFound, aerr.Code, q)
		}
		if err == nil {
			_, _ = ch.QueueDelete(q, false, false, false)
			_ = ch.Close()
		}
	}
}

// A RabbitMQ demo without the second hop (-shipping=false) leaves no queue
// of the run behind either.
func TestDemoRabbitMQWithoutSecondHopLeavesNoQueues(t *testing.T) {
	url := requireAMQP(t)
	_, schema := pgtest.Schema(t)
	code, out := runCommand(t, context.Background(), "demo", "-broker", "amqp", "-schema", schema, "-orders", "200", "-seed", "472",
		"-shipping=false", "-metrics-addr", "off")
	require.Equal(t, 0, code, out)
	requireNoQueues(t, url, "orders-demo-472")
}
