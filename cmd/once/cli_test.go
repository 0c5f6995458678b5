package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/outbox"
)

func TestMain(m *testing.M) {
	switch os.Getenv("ONCE_TEST_MAIN") {
	case "1":
		// The test binary runs as the once command, its arguments
		// those of the command line (TestInterruptStopsACommandWaitingOnABroker).
		main()
	case "stuck":
		// A command stuck in a call that does not watch its context
		// (TestSecondInterruptQuits).
		ctx, _ := interruptible(context.Background())
		fmt.Fprintln(os.Stderr, "stuck")
		<-ctx.Done()
		select {}
	}
	pgtest.Main(m)
}

// cli runs the command line in-process with env and returns the exit
// code, stdout and stderr.
func cli(t *testing.T, env map[string]string, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	a := newApp(&out, &errb, func(k string) string { return env[k] })
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	code := a.run(ctx, args)
	return code, out.String(), errb.String()
}

func TestHelpListsEveryCommandAndExitCodes(t *testing.T) {
	code, out, _ := cli(t, nil, "help")
	require.Equal(t, exitOK, code)
	for _, c := range commands() {
		assert.Contains(t, out, c.name)
	}
	assert.Contains(t, out, "Exit codes")

	code, out, _ = cli(t, nil, "help", "dlq", "replay")
	require.Equal(t, exitOK, code)
	for _, f := range []string{"-dry-run", "-rate", "-by", "-keep", "-force", "-consumer", "-kind", "-since", "-json", "-all"} {
		assert.Contains(t, out, f, "help shows the flag")
	}
	code, out, _ = cli(t, nil, "help", "dlq")
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "once dlq list")
	assert.Contains(t, out, "once dlq show")

	code, _, errOut := cli(t, nil, "frobnicate")
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, errOut, "unknown command")
	code, _, errOut = cli(t, nil, "dlq", "list", "-nope")
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, errOut, "-nope")
	code, _, errOut = cli(t, nil, "dlq", "list", "-dlq", "x")
	assert.Equal(t, exitUsage, code, "no broker")
	assert.Contains(t, errOut, "-kafka")
	code, _, _ = cli(t, map[string]string{"ONCE_KAFKA_BROKERS": "127.0.0.1:1"}, "dlq", "replay", "-dlq", "x")
	assert.Equal(t, exitUsage, code, "a replay without a selection needs -all")
	code, _, _ = cli(t, map[string]string{"ONCE_KAFKA_BROKERS": "127.0.0.1:1"}, "dlq", "list", "-dlq", "x", "-since", "yesterday")
	assert.Equal(t, exitUsage, code)
	for _, cmd := range []string{"list", "show"} {
		code, _, errOut = cli(t, map[string]string{"ONCE_KAFKA_BROKERS": "127.0.0.1:1"}, "dlq", cmd, "-dlq", "x", "-id", "e-1", "-limit", "-1")
		assert.Equal(t, exitUsage, code, "dlq %s: a negative -limit is not \"all\": %s", cmd, errOut)
		assert.Contains(t, errOut, "-limit", "dlq %s", cmd)
	}
}

// kafkaDLQ makes dead letters with a real consumer on kfake: a handler
// failure, a panic, an undecodable binary value, and a record without a
// producer id; then fixes the service.
func kafkaDLQ(t *testing.T) (env map[string]string, svc *testenv.Service, topic string) {
	k := testenv.NewKafka(t)
	topic = testenv.Uniq("orders")
	k.CreateTopic(topic, 1)
	k.CreateTopic(topic+".dlq", 1)
	pool, schema := pgtest.Schema(t)
	msg := func(id string, v []byte) *sarama.ProducerMessage {
		m := &sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder("key-" + id), Value: sarama.ByteEncoder(v)}
		if id != "" {
			m.Headers = []sarama.RecordHeader{{Key: []byte("id"), Value: []byte(id)}, {Key: []byte("type"), Value: []byte("order.paid")}}
		}
		return m
	}
	k.Produce(
		msg("ok-1", testenv.JSON(1, "ok")),
		msg("fail-1", testenv.JSON(2, "fail")),
		msg("panic-1", testenv.JSON(3, "panic")),
		msg("bin-1", []byte{0x00, 0xff, 0xfe, 'x'}),
		msg("", testenv.JSON(5, "fail")), // offset 4: id orders/0/4
	)
	svc = testenv.StartService(t, pool, k.Source(testenv.Uniq("g"), topic), "billing")
	svc.WaitSettled(t, 5)
	require.EqualValues(t, 4, svc.C.Stats().DeadLettered)
	svc.Broken.Store(false)
	env = map[string]string{
		"ONCE_KAFKA_BROKERS": strings.Join(k.Addrs, ","),
		"DATABASE_URL":       testenv.SchemaURL(schema),
	}
	return env, svc, topic
}

func TestDLQListShowReplayOnKafka(t *testing.T) {
	env, svc, topic := kafkaDLQ(t)
	dlqName := topic + ".dlq"

	code, out, errOut := cli(t, env, "dlq", "list", "-dlq", dlqName)
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "REF")
	for _, s := range []string{"fail-1", "panic-1", "bin-1", topic + "/0/4", "handler", "panic", "decode", "4 records"} {
		assert.Contains(t, out, s)
	}

	code, out, _ = cli(t, env, "dlq", "list", "-dlq", dlqName, "-kind", "panic,decode", "-json")
	require.Equal(t, exitOK, code)
	var listed []recordSummary
	require.NoError(t, json.Unmarshal([]byte(out), &listed))
	require.Len(t, listed, 2)
	assert.Equal(t, []string{"panic-1", "bin-1"}, []string{listed[0].EventID, listed[1].EventID})
	assert.True(t, listed[0].Replayable)

	code, out, _ = cli(t, env, "dlq", "list", "-dlq", dlqName, "-since", "1h")
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "4 records")
	code, out, _ = cli(t, env, "dlq", "list", "-dlq", dlqName, "-since", "2000-01-01", "-until", "2000-01-02")
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "0 of 4 records in kafka topic "+dlqName+" match")
	// A filter's count is not the destination's.
	code, out, _ = cli(t, env, "dlq", "list", "-dlq", dlqName, "-kind", "panic")
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "1 of 4 records in kafka topic "+dlqName+" match")
	code, out, _ = cli(t, env, "dlq", "list", "-dlq", dlqName, "-kind", "handler", "-limit", "1")
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "1 of 2 matching records shown")
	// A window that ends before it starts (-since and -until swapped)
	// would select nothing, and a replay would say "0 selected".
	for _, cmd := range [][]string{{"dlq", "list"}, {"dlq", "show"}, {"dlq", "replay"}} {
		code, _, errOut = cli(t, env, append(cmd, "-dlq", dlqName, "-since", "1h", "-until", "2000-01-01")...)
		assert.Equal(t, exitUsage, code, "%v: %s", cmd, errOut)
		assert.Contains(t, errOut, "-since", cmd)
	}

	code, out, _ = cli(t, env, "dlq", "show", "-dlq", dlqName, "-id", "bin-1")
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "payload (4 bytes, hex)")
	assert.Contains(t, out, "00 ff fe 78")
	assert.Contains(t, out, "once-error-kind: decode")
	assert.Contains(t, out, "key: key-bin-1")
	code, out, _ = cli(t, env, "dlq", "show", "-dlq", dlqName, "-ref", "0:1")
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "panic-1")
	assert.Contains(t, out, `payload (22 bytes, text):`)
	assert.Contains(t, out, `{"n":3,"mode":"panic"}`)
	code, out, _ = cli(t, env, "dlq", "show", "-dlq", dlqName, "-ref", "0:0", "-json")
	require.Equal(t, exitOK, code)
	var shown []recordDetail
	require.NoError(t, json.Unmarshal([]byte(out), &shown))
	require.Len(t, shown, 1)
	assert.Equal(t, `{"n":2,"mode":"fail"}`, *shown[0].Value)
	code, _, _ = cli(t, env, "dlq", "show", "-dlq", dlqName, "-id", "nope")
	assert.Equal(t, exitNotFound, code)

	code, out, _ = cli(t, env, "dlq", "replay", "-dlq", dlqName, "-all", "-dry-run")
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "would replay 4")
	assert.Empty(t, svc.Effects(t)["fail-1"])

	// Plain progress lines on a pipe; one effect for each event however often it is replayed.
	code, out, errOut = cli(t, env, "dlq", "replay", "-dlq", dlqName, "-consumer", "billing", "-by", "oncall", "-rate", "50")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "replayed 4")
	assert.Contains(t, errOut, "[4/4] replayed")
	svc.WaitSettled(t, 9)
	code, _, _ = cli(t, env, "dlq", "replay", "-dlq", dlqName, "-all", "-json")
	require.Equal(t, exitOK, code)
	svc.WaitSettled(t, 14)
	effects := svc.Effects(t)
	for _, id := range []string{"ok-1", "fail-1", "panic-1", topic + "/0/4"} {
		assert.Equal(t, 1, effects[id], "event %s", id)
	}
	assert.Zero(t, effects["bin-1"], "still undecodable")

	code, out, _ = cli(t, env, "dlq", "list", "-dlq", dlqName, "-id", "bin-1", "-json")
	require.Equal(t, exitOK, code)
	require.NoError(t, json.Unmarshal([]byte(out), &listed))
	// The first replay redrove the original; the second the original and
	// that copy, whose redrive count went on to 2.
	require.Len(t, listed, 4, "dead-lettered again after each replay")
	counts := make([]int, len(listed))
	for i, l := range listed {
		counts[i] = l.RedriveCount
	}
	assert.Equal(t, []int{0, 1, 1, 2}, counts)
}

func TestStatusMigrateRetention(t *testing.T) {
	env, svc, topic := kafkaDLQ(t)
	code, out, errOut := cli(t, env, "migrate", "up")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "migrated")
	code, out, errOut = cli(t, env, "migrate", "status")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, fmt.Sprintf("schema version %d of %d", dedup.SchemaVersion, dedup.SchemaVersion))
	code, _, _ = cli(t, env, "migrate", "down")
	assert.Equal(t, exitUsage, code, "down needs -to")
	code, out, errOut = cli(t, env, "migrate", "down", "-to", "1")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "schema version 1")
	code, out, errOut = cli(t, env, "migrate", "up")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, fmt.Sprintf("schema version %d", dedup.SchemaVersion))
	code, _, _ = cli(t, env, "migrate", "sideways")
	assert.Equal(t, exitUsage, code)

	code, out, errOut = cli(t, env, "status", "-dlq", topic+".dlq", "-json")
	require.Equal(t, exitOK, code, errOut)
	var st statusReport
	require.NoError(t, json.Unmarshal([]byte(out), &st))
	require.Len(t, st.Consumers, 1)
	assert.Equal(t, "billing", st.Consumers[0].Name)
	assert.EqualValues(t, 1, st.Consumers[0].Processed)
	kinds := map[string]int{}
	for _, k := range st.DeadLetters {
		kinds[k.Kind] += k.Count
	}
	assert.Equal(t, map[string]int{"handler": 2, "panic": 1, "decode": 1}, kinds)
	assert.Nil(t, st.Outbox, "no outbox table: no outbox section")

	// With an outbox: its pending and parked rows.
	ctx := context.Background()
	require.NoError(t, outbox.Migrate(ctx, svc.Pool))
	require.NoError(t, pgx.BeginFunc(ctx, svc.Pool, func(tx pgx.Tx) error {
		return outbox.Add(ctx, tx,
			outbox.Message{Topic: "orders.confirmed", Key: []byte("o-1"), Body: []byte(`{}`)},
			outbox.Message{Topic: "no.such.topic", Key: []byte("o-2"), Body: []byte(`{}`)})
	}))
	_, err := svc.Pool.Exec(ctx, `UPDATE outbox SET parked_at = now(), attempts = 3, last_error = 'unknown topic' WHERE topic = 'no.such.topic'`)
	require.NoError(t, err)
	code, out, errOut = cli(t, env, "status", "-json")
	require.Equal(t, exitOK, code, errOut)
	st = statusReport{}
	require.NoError(t, json.Unmarshal([]byte(out), &st))
	require.NotNil(t, st.Outbox)
	assert.EqualValues(t, 1, st.Outbox.Status.Pending)
	assert.EqualValues(t, 1, st.Outbox.Status.Parked)
	require.Len(t, st.Outbox.Parked, 1)
	assert.Equal(t, "unknown topic", st.Outbox.Parked[0].LastError)
	code, out, _ = cli(t, env, "status")
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "1 pending")
	assert.Contains(t, out, "1 parked")
	assert.Contains(t, out, "no.such.topic")
	// A row of the parked key, as the relay marks it: waiting.
	require.NoError(t, pgx.BeginFunc(ctx, svc.Pool, func(tx pgx.Tx) error {
		return outbox.Add(ctx, tx, outbox.Message{Topic: "no.such.topic", Key: []byte("o-2"), Body: []byte(`{}`)})
	}))
	_, err = svc.Pool.Exec(ctx, `UPDATE outbox SET waiting = true WHERE topic = 'no.such.topic' AND parked_at IS NULL`)
	require.NoError(t, err)
	code, out, _ = cli(t, env, "status")
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "2 pending")
	assert.Contains(t, out, "1 of them waiting behind a refused row of their key")

	code, out, errOut = cli(t, env, "status", "-group", "nobody", "-topic", topic)
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "kafka lag")
	assert.Contains(t, out, "billing")

	code, out, errOut = cli(t, env, "retention", "-consumer", "billing", "-older-than", "1h", "-dry-run")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "0 rows")
	_, err = svc.Pool.Exec(context.Background(), `UPDATE processed_events SET processed_at = now() - interval '2 hours'`)
	require.NoError(t, err)
	code, out, errOut = cli(t, env, "retention", "-consumer", "billing", "-older-than", "1h", "-batch", "1")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "deleted 1 rows")
	assert.Contains(t, errOut, "deleted 1 rows")
	code, _, _ = cli(t, env, "retention", "-consumer", "billing")
	assert.Equal(t, exitUsage, code)
	code, _, _ = cli(t, map[string]string{"DATABASE_URL": "postgres://127.0.0.1:1/x?connect_timeout=1"}, "status")
	assert.Equal(t, exitFailure, code, "an unreachable database is a failure")
	code, _, errOut = cli(t, map[string]string{"DATABASE_URL": "postgres://127.0.0.1:1/x?connect_timeout=1"}, "status", "-suspect-age", "-1m")
	assert.Equal(t, exitUsage, code, "a negative -suspect-age is a usage error: %s", errOut)
	for _, args := range [][]string{{"status", "-table", "no such"}, {"status", "-schema", "a;b"},
		{"retention", "-table", "x;y", "-consumer", "billing", "-older-than", "1h"},
		{"retention", "-consumer", "billing", "-older-than", "1ms"},
		{"retention", "-consumer", "billing", "-older-than", "1h", "-duty-cycle", "0"},
		{"retention", "-consumer", "billing", "-older-than", "1h", "-duty-cycle", "1.5"},
		{"retention", "-consumer", "billing", "-older-than", "1h", "-duty-cycle", "NaN"}} {
		code, _, errOut = cli(t, map[string]string{"DATABASE_URL": "postgres://127.0.0.1:1/x?connect_timeout=1"}, args...)
		assert.Equal(t, exitUsage, code, "%v: a bad name is a usage error: %s", args, errOut)
	}
}

func TestDLQReplayOnRabbitMQ(t *testing.T) {
	url := testenv.AMQPURL(t)
	queue := testenv.Uniq("orders")
	testenv.DeleteQueues(t, url, queue, queue+".dlq")
	pool, schema := pgtest.Schema(t)
	svc := testenv.StartService(t, pool, testenv.OpenAMQPSource(t, url, queue), "billing")
	ch := testenv.AMQPChannel(t, url)
	for _, p := range []amqp091.Publishing{
		{MessageId: "pay-1", Body: testenv.JSON(1, "fail"), Type: "payment.made"},
		{MessageId: "pay-2", Body: testenv.JSON(2, "fail"), Type: "payment.made"},
		{MessageId: "", Body: testenv.JSON(3, "fail")},
	} {
		testenv.PublishAMQP(t, ch, queue, p)
	}
	svc.WaitSettled(t, 3)
	svc.Broken.Store(false)
	env := map[string]string{"ONCE_AMQP_URL": url}

	code, out, errOut := cli(t, env, "dlq", "list", "-dlq", queue+".dlq")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "3 records")
	for range 2 {
		code, out, errOut = cli(t, env, "dlq", "list", "-dlq", queue+".dlq", "-json")
		require.Equal(t, exitOK, code, errOut)
	}
	var listed []recordSummary
	require.NoError(t, json.Unmarshal([]byte(out), &listed))
	require.Len(t, listed, 3, "listing consumed nothing")

	code, out, errOut = cli(t, env, "dlq", "replay", "-dlq", queue+".dlq", "-id", "pay-*", "-keep")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "replayed 2")
	code, out, errOut = cli(t, env, "dlq", "replay", "-dlq", queue+".dlq", "-all", "-by", "oncall")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "replayed 3")
	svc.WaitSettled(t, 8)
	effects := svc.Effects(t)
	assert.Equal(t, 1, effects["pay-1"])
	assert.Equal(t, 1, effects["pay-2"])
	assert.Len(t, effects, 3, "%v", effects)

	code, out, _ = cli(t, env, "dlq", "list", "-dlq", queue+".dlq")
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "0 records", "replayed messages left the queue")
	code, out, errOut = cli(t, env, "status", "-amqp", url, "-queue", queue+","+queue+".dlq", "-database-url", testenv.SchemaURL(schema))
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "rabbitmq queues")
}

// On a terminal a replay draws one bar, redrawn in place; on a pipe it
// writes a line per record.
func TestReplayProgress(t *testing.T) {
	var buf bytes.Buffer
	a := &app{stderr: &buf, terminal: true}
	p := a.progress(false)
	r := &dlq.Record{Ref: "0:1", Headers: []dlq.Header{{Key: "once-event-id", Value: "e-1"}}}
	for i := 1; i <= 4; i++ {
		p.update(i, 4, dlq.Outcome{Record: r, Result: dlq.Replayed})
	}
	p.finish()
	out := buf.String()
	assert.Equal(t, 4, strings.Count(out, "\rreplaying ["))
	assert.Contains(t, out, "[##############################] 4/4")
	assert.True(t, strings.HasSuffix(out, "\n"))

	buf.Reset()
	a.terminal = false
	p = a.progress(false)
	p.update(1, 2, dlq.Outcome{Record: r, Result: dlq.Replayed})
	assert.Equal(t, "[1/2] replayed 0:1 e-1\n", buf.String())
}

// once ui serves the console on the address it prints, read-only by
// default, and stops when its context ends.
func TestUIServesTheConsole(t *testing.T) {
	pool, schema := pgtest.Schema(t)
	_, err := pool.Exec(context.Background(), `CREATE TABLE processed_events (consumer text, event_id text, fingerprint bytea,
		processed_at timestamptz DEFAULT now(), source text, partition int, "offset" bigint, PRIMARY KEY (consumer, event_id));
		CREATE TABLE processed_events_attempts (consumer text, event_id text, attempts int, last_seen timestamptz DEFAULT now());
		INSERT INTO processed_events (consumer, event_id) VALUES ('billing', 'e-1')`)
	require.NoError(t, err)
	pr, pw := io.Pipe()
	a := newApp(pw, io.Discard, func(string) string { return "" })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	go func() {
		done <- a.run(ctx, []string{"ui", "-addr", "127.0.0.1:0", "-database-url", testenv.SchemaURL(schema)})
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	require.NoError(t, err)
	go func() { _, _ = io.Copy(io.Discard, pr) }()
	require.Contains(t, line, "(read-only)")
	addr := strings.Fields(strings.TrimPrefix(line, "once console on "))[0]
	resp, err := http.Get(addr)
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Contains(t, string(body), `data-consumer="billing"`)
	cancel()
	select {
	case code := <-done:
		assert.Equal(t, exitOK, code)
	case <-time.After(15 * time.Second):
		t.Fatal("once ui did not stop")
	}
	code, _, errOut := cli(t, nil, "ui")
	assert.Equal(t, exitUsage, code, "nothing to show")
	assert.Contains(t, errOut, "-database-url")
	for _, addr := range []string{"8080", "127.0.0.1:http-ish", "127.0.0.1:99999"} {
		code, _, errOut = cli(t, map[string]string{"ONCE_KAFKA_BROKERS": "127.0.0.1:1"}, "ui", "-dlq", "orders.dlq", "-addr", addr)
		assert.Equal(t, exitUsage, code, "-addr %s: %s", addr, errOut)
		assert.Contains(t, errOut, "-addr", "-addr %s", addr)
	}
}

// A console bound to a loopback address answers only requests addressed
// to a loopback name: a page of another site whose name the attacker
// re-points at 127.0.0.1 (DNS rebinding) is same-origin for the browser,
// passes the cross-origin check, and would read dead letters and replay
// them.
func TestUIOnLoopbackRefusesOtherHostNames(t *testing.T) {
	env, svc, topic := kafkaDLQ(t)
	pr, pw := io.Pipe()
	a := newApp(pw, io.Discard, func(k string) string { return env[k] })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan int, 1)
	go func() {
		done <- a.run(ctx, []string{"ui", "-addr", "127.0.0.1:0", "-allow-replay", "-dlq", topic + ".dlq"})
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	require.NoError(t, err)
	go func() { _, _ = io.Copy(io.Discard, pr) }()
	base := strings.Fields(strings.TrimPrefix(line, "once console on "))[0]
	_, port, _ := strings.Cut(strings.TrimPrefix(strings.TrimSuffix(base, "/"), "http://"), ":")

	do := func(method, host, path, body string) (int, string) {
		req, err := http.NewRequest(method, base+strings.TrimPrefix(path, "/"), strings.NewReader(body))
		require.NoError(t, err)
		req.Host = host
		if method == http.MethodPost {
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			req.Header.Set("Origin", "http://"+host)
			req.Header.Set("Sec-Fetch-Site", "same-origin")
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(b)
	}
	for _, host := range []string{"127.0.0.1:" + port, "localhost:" + port, "[::1]:" + port} {
		code, body := do(http.MethodGet, host, "/record?q=0&ref=0:0", "")
		assert.Equal(t, http.StatusOK, code, host)
		assert.Contains(t, body, "fail-1", host)
	}
	evil := "rebound.attacker.example:" + port
	code, body := do(http.MethodGet, evil, "/record?q=0&ref=0:0", "")
	assert.Equal(t, http.StatusForbidden, code, "a dead letter read through another host name")
	assert.NotContains(t, body, "fail-1")
	code, _ = do(http.MethodPost, evil, "/replay", "q=0&ref=0:0&confirm=yes")
	assert.Equal(t, http.StatusForbidden, code, "a replay posted through another host name")
	client, err := sarama.NewClient(strings.Split(env["ONCE_KAFKA_BROKERS"], ","), testenv.Sarama())
	require.NoError(t, err)
	defer client.Close()
	hwm, err := client.GetOffset(topic, 0, sarama.OffsetNewest)
	require.NoError(t, err)
	assert.EqualValues(t, 5, hwm, "nothing was replayed to %s", topic)
	assert.Equal(t, uint64(5), svc.C.Stats().Received)

	cancel()
	select {
	case code := <-done:
		assert.Equal(t, exitOK, code)
	case <-time.After(15 * time.Second):
		t.Fatal("once ui did not stop")
	}
}

// Header text with control characters is quoted, so a dead letter cannot
// send escape sequences to the operator's terminal.
func TestTextOutputQuotesControlCharacters(t *testing.T) {
	assert.Equal(t, "plain text", safe("plain text"))
	assert.Equal(t, `"\x1b[2Jgotcha"`, safe("\x1b[2Jgotcha"))
	assert.Equal(t, `"two\nlines"`, safe("two\nlines"))
	assert.Equal(t, `"\xff"`, safe("\xff"))
}

// The 8-bit control characters (C1, U+0080 to U+009F) are controls too:
// U+009B is the one-character CSI that terminals taking C1 controls in
// UTF-8 (xterm among them) read as ESC [. A header or payload holding one
// is quoted or dumped in hex like one holding ESC.
func TestTextOutputQuotesC1ControlCharacters(t *testing.T) {
	assert.Equal(t, `"\u009b2Jgotcha"`, safe("\u009b2Jgotcha"))
	assert.False(t, dlq.Printable([]byte("\u009b2J")))
	assert.True(t, dlq.Printable([]byte("café, naïve, 東京\ttab")))
	var out bytes.Buffer
	a := newApp(&out, io.Discard, func(string) string { return "" })
	a.printRecord(&dlq.Record{Ref: "0:1", Value: []byte("\u009b2Jgotcha"),
		Headers: []dlq.Header{{Key: "x-note", Value: "\u009d0;pwned\u009c"}}}, false, false)
	assert.NotContains(t, out.String(), "\u009b")
	assert.NotContains(t, out.String(), "\u009d")
	assert.Contains(t, out.String(), "hex")
}

// Unicode's bidirectional controls (U+202A-U+202E, U+2066-U+2069, the
// marks U+200E, U+200F and U+061C) reorder the text around them on the
// screen: an event id "order-\u202e7-redro" reads as another one. They
// are quoted like controls; right-to-left letters are text.
func TestTextOutputQuotesBidiControls(t *testing.T) {
	for _, s := range []string{"order-\u202e7-redro", "a\u2066b\u2069", "x\u200fy", "x\u061cy", "\u202ax\u202c"} {
		assert.False(t, dlq.Printable([]byte(s)), "%q", s)
		assert.Equal(t, strconv.Quote(s), safe(s))
	}
	assert.True(t, dlq.Printable([]byte("שלום, مرحبا")), "right-to-left letters")
}

// The reason a dead letter is not replayable quotes header text (its
// kind, the headers of a copy written without its value): it is printed
// quoted like the headers themselves.
func TestNotReplayableReasonQuotesControlCharacters(t *testing.T) {
	evil := "\x1b]0;pwned\x07"
	r := &dlq.Record{Ref: "0:1", Headers: []dlq.Header{{Key: consumer.HeaderErrorKind, Value: evil},
		{Key: consumer.HeaderOriginalTopic, Value: "orders"}}}
	var out bytes.Buffer
	a := newApp(&out, io.Discard, func(string) string { return "" })
	a.printRecord(r, false, false)
	a.printReport(&namedQueue{"kafka topic orders.dlq"}, dlq.Report{Selected: 1, Skipped: 1,
		Outcomes: []dlq.Outcome{{Record: r, Result: dlq.Skipped, Reason: r.Replayable(false).Error()}}})
	assert.NotContains(t, out.String(), "\x1b")
	assert.NotContains(t, out.String(), "\x07")
	assert.Contains(t, out.String(), `\x1b]0;pwned\a`, "quoted")
}

// An error quotes what it names of a dead letter (its event id, its
// destination): a record whose original topic holds an escape sequence,
// and which cannot go back there, fails its replay with an error printed
// quoted.
func TestErrorsQuoteControlCharacters(t *testing.T) {
	k := testenv.NewKafka(t)
	name := testenv.Uniq("orders") + ".dlq"
	k.CreateTopic(name, 1)
	k.Produce(&sarama.ProducerMessage{Topic: name, Value: sarama.StringEncoder("{}"), Headers: []sarama.RecordHeader{
		{Key: []byte(consumer.HeaderEventID), Value: []byte("e-1")},
		{Key: []byte(consumer.HeaderErrorKind), Value: []byte("handler")},
		{Key: []byte(consumer.HeaderOriginalTopic), Value: []byte("gone\x1b]0;pwned\x07")},
	}})
	code, _, errOut := cli(t, map[string]string{"ONCE_KAFKA_BROKERS": strings.Join(k.Addrs, ",")}, "dlq", "replay", "-dlq", name, "-all")
	assert.Equal(t, exitFailure, code)
	assert.Contains(t, errOut, "gone")
	assert.NotContains(t, errOut, "\x1b")
	assert.NotContains(t, errOut, "\x07")
}

// namedQueue is a dlq.Queue of which printReport uses the name only.
type namedQueue struct{ name string }

func (q *namedQueue) Name() string                                          { return q.name }
func (q *namedQueue) Browse(context.Context, func(*dlq.Record) error) error { return nil }
func (q *namedQueue) Replay(context.Context, dlq.Filter, dlq.ReplayOptions) (dlq.Report, error) {
	return dlq.Report{}, nil
}
func (q *namedQueue) Close() error { return nil }

func TestReplayRefusesARateItCannotPace(t *testing.T) {
	env, svc, topic := kafkaDLQ(t)
	for _, rate := range []string{"NaN", "+Inf", "2e9"} {
		code, out, errOut := cli(t, env, "dlq", "replay", "-dlq", topic+".dlq", "-all", "-rate", rate)
		if rate == "2e9" {
			// Faster than the clock can space publishes: no bound at all.
			require.Equal(t, exitOK, code, errOut)
			assert.Contains(t, out, "replayed 4")
			continue
		}
		require.Equal(t, exitUsage, code, "-rate %s: %s", rate, errOut)
		assert.Contains(t, errOut, "-rate")
	}
	svc.WaitSettled(t, 9)
}

// A filter flag whose value names nothing (only commas or blanks) is not a
// filter: replay refuses it as it refuses no filter at all, rather than
// replay every record as if -all had been given.
func TestReplayRefusesAnEmptyFilter(t *testing.T) {
	env, _, topic := kafkaDLQ(t)
	for _, args := range [][]string{{"-kind", ","}, {"-ref", " , "}, {"-kind", " "}} {
		code, out, errOut := cli(t, env, append([]string{"dlq", "replay", "-dlq", topic + ".dlq"}, args...)...)
		assert.Equal(t, exitUsage, code, "%v: %s%s", args, out, errOut)
		assert.NotContains(t, out, "replayed 4", "%v", args)
	}
	code, _, errOut := cli(t, env, "dlq", "show", "-dlq", topic+".dlq", "-ref", ",")
	assert.Equal(t, exitUsage, code, errOut)
}

// A table name that is not all lower case, or a reserved word, is a
// valid dedup table (quoted); status and retention act on that table and
// on no other.
func TestStatusAndRetentionOnQuotedTableNames(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgtest.Schema(t)
	env := map[string]string{"DATABASE_URL": testenv.SchemaURL(schema)}
	for _, table := range []string{"Billing_Events", "billing_events", "order"} {
		store, err := dedup.New(dedup.Config{Table: table})
		require.NoError(t, err)
		require.NoError(t, store.Migrate(ctx, pool))
		require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := store.ClaimBatch(ctx, tx, []dedup.Claim{
				{Consumer: "billing", EventID: table + "-1", Partition: -1, Offset: -1},
				{Consumer: "billing", EventID: table + "-2", Partition: -1, Offset: -1},
			})
			return err
		}))
		_, err = pool.Exec(ctx, `UPDATE `+pgx.Identifier{table}.Sanitize()+` SET processed_at = now() - interval '2 hours'`)
		require.NoError(t, err)
	}
	count := func(table string) int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{table}.Sanitize()).Scan(&n))
		return n
	}

	for _, table := range []string{"Billing_Events", "order"} {
		code, out, errOut := cli(t, env, "status", "-table", table, "-json")
		require.Equal(t, exitOK, code, "status -table %s: %s", table, errOut)
		var st statusReport
		require.NoError(t, json.Unmarshal([]byte(out), &st))
		require.Len(t, st.Consumers, 1)
		assert.EqualValues(t, 2, st.Consumers[0].Processed)

		code, out, errOut = cli(t, env, "retention", "-table", table, "-consumer", "billing", "-older-than", "1h")
		require.Equal(t, exitOK, code, "retention -table %s: %s", table, errOut)
		assert.Contains(t, out, "deleted 2 rows")
		assert.Zero(t, count(table), "the named table's rows are gone")
	}
	assert.Equal(t, 2, count("billing_events"), "a table of another name keeps its rows")
}

// -to names the version of a migration down; given to up or status it is
// refused, not ignored: "migrate up -to 3" must not bring the tables to a
// version an older release refuses.
func TestMigrateRefusesToOutsideDown(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgtest.Schema(t)
	env := map[string]string{"DATABASE_URL": testenv.SchemaURL(schema)}
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.MigrateTo(ctx, pool, 1))
	for _, args := range [][]string{{"migrate", "up", "-to", "2"}, {"migrate", "-to", "2"}, {"migrate", "status", "-to", "2"}} {
		code, _, errOut := cli(t, env, args...)
		assert.Equal(t, exitUsage, code, "%v: %s", args, errOut)
	}
	v, err := store.Version(ctx, pool)
	require.NoError(t, err)
	assert.Equal(t, 1, v, "nothing migrated")
}

// -h (or -help) after a command prints that command's help with its
// flags, as "once help CMD" does, and succeeds.
func TestCommandHelpFlagPrintsTheFlags(t *testing.T) {
	for _, args := range [][]string{{"dlq", "list", "-h"}, {"dlq", "replay", "-dlq", "x", "-help"}, {"status", "--help"},
		{"migrate", "up", "-h"}, {"ui", "-h"}} {
		code, out, errOut := cli(t, nil, args...)
		assert.Equal(t, exitOK, code, "%v: %s", args, errOut)
		assert.Contains(t, out, "Flags:", "%v", args)
		assert.Contains(t, out, "Usage: once "+args[0], "%v", args)
		assert.NotContains(t, errOut, "see the flags below", "%v", args)
	}
	_, out, _ := cli(t, nil, "dlq", "replay", "-h")
	assert.Contains(t, out, "-dry-run")
}

// once status prints what the database holds of the consumers and of the
// outbox's parked rows (consumer names, event ids, destinations, a
// broker's error text) quoted when it holds control characters or line
// breaks, as the dlq commands print headers: an error of two lines would
// otherwise read as a second parked row, and an escape sequence would
// reach the terminal.
func TestStatusQuotesControlCharacters(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgtest.Schema(t)
	env := map[string]string{"DATABASE_URL": testenv.SchemaURL(schema)}
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, pool))
	_, err = pool.Exec(ctx, "INSERT INTO processed_events (consumer, event_id) VALUES ('bill\x1b[2Jing', 'e-1')")
	require.NoError(t, err)
	require.NoError(t, outbox.Migrate(ctx, pool))
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return outbox.Add(ctx, tx, outbox.Message{ID: "o-1\x1b]0;pwned\x07", Topic: "orders\rconfirmed", Body: []byte(`{}`)})
	}))
	_, err = pool.Exec(ctx, "UPDATE outbox SET parked_at = now(), attempts = 1, last_error = 'refused\n77  fake-row  orders.ok  0'")
	require.NoError(t, err)

	code, out, errOut := cli(t, env, "status")
	require.Equal(t, exitOK, code, errOut)
	for _, c := range []string{"\x1b", "\x07", "\r"} {
		assert.NotContains(t, out, c)
	}
	assert.NotContains(t, out, "\n77  fake-row", "an error's second line reads as a row")
	assert.Contains(t, out, `refused\n77`)
	assert.Contains(t, out, `"bill\x1b[2Jing"`)
}

// A retention that fails prints no count it did not take: a dry run that
// could not count says nothing of "0 rows would be deleted", in text or
// JSON, and exits 1.
func TestRetentionDryRunThatFailsPrintsNoCount(t *testing.T) {
	_, schema := pgtest.Schema(t) // no tables
	env := map[string]string{"DATABASE_URL": testenv.SchemaURL(schema)}
	for _, args := range [][]string{{}, {"-json"}} {
		code, out, errOut := cli(t, env, append([]string{"retention", "-consumer", "billing", "-older-than", "1h", "-dry-run"}, args...)...)
		assert.Equal(t, exitFailure, code, "%v: %s", args, errOut)
		assert.Contains(t, errOut, "processed_events", "%v", args)
		assert.Empty(t, out, "%v: a count of rows it could not count", args)
	}
}

// A retention whose first statement failed deleted nothing and checked
// nothing, yet printed "billing: deleted 0 rows processed before ..."
// (or, with -json, "deleted": 0 and "consumer_has_rows": true, a claim it
// never checked) before the error: a script reading the report took the
// run for one that found nothing old enough. It prints no report, as a dry
// run that could not count prints none, and exits 1.
func TestRetentionThatFailsBeforeDeletingPrintsNoReport(t *testing.T) {
	_, schema := pgtest.Schema(t) // no tables
	env := map[string]string{"DATABASE_URL": testenv.SchemaURL(schema)}
	for _, args := range [][]string{{}, {"-json"}} {
		code, out, errOut := cli(t, env, append([]string{"retention", "-consumer", "billing", "-older-than", "1h"}, args...)...)
		assert.Equal(t, exitFailure, code, "%v: %s", args, errOut)
		assert.Contains(t, errOut, "processed_events", "%v", args)
		assert.Empty(t, out, "%v: a report of a run that deleted and checked nothing", args)
	}
}

// A replay that could not read the dead letters prints no report: "0
// selected, replayed 0" would read as a filter that matched nothing.
func TestReplayThatCouldNotReadPrintsNoReport(t *testing.T) {
	env := map[string]string{"ONCE_KAFKA_BROKERS": "127.0.0.1:1"}
	for _, args := range [][]string{{}, {"-json"}} {
		code, out, errOut := cli(t, env, append([]string{"dlq", "replay", "-dlq", "orders.dlq", "-all"}, args...)...)
		assert.Equal(t, exitFailure, code, "%v: %s", args, errOut)
		assert.Contains(t, errOut, "connect to kafka", "%v", args)
		assert.Empty(t, out, "%v: a report of a replay that read nothing", args)
	}
}

// With both ONCE_KAFKA_BROKERS and ONCE_AMQP_URL in the environment, the
// broker flag given on the command line says which one: the other's
// environment default is no conflict.
func TestBrokerFlagOverridesTheOtherBrokersEnvironment(t *testing.T) {
	env, _, topic := kafkaDLQ(t)
	both := map[string]string{"ONCE_KAFKA_BROKERS": "127.0.0.1:1", "ONCE_AMQP_URL": "amqp://guest:guest@127.0.0.1:1/"}
	code, out, errOut := cli(t, both, "dlq", "list", "-kafka", env["ONCE_KAFKA_BROKERS"], "-dlq", topic+".dlq")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "4 records")
	code, _, errOut = cli(t, both, "dlq", "list", "-dlq", topic+".dlq")
	assert.Equal(t, exitUsage, code, "both from the environment, neither on the command line: %s", errOut)
	assert.Contains(t, errOut, "ONCE_AMQP_URL")
	code, _, errOut = cli(t, both, "dlq", "list", "-kafka", "127.0.0.1:1", "-amqp", "amqp://127.0.0.1:1/", "-dlq", "x")
	assert.Equal(t, exitUsage, code, "both on the command line: %s", errOut)
}

// A Kafka key is printed on its line like a header value: one holding a
// line break or a carriage return is quoted, so it cannot print lines
// that read as the record's own (a forged header) or overwrite them.
func TestShowQuotesAKeyWithLineBreaks(t *testing.T) {
	var out bytes.Buffer
	a := newApp(&out, io.Discard, func(string) string { return "" })
	a.printRecord(&dlq.Record{Ref: "0:1", Key: []byte("k-1\n  once-event-id: forged\r"), Value: []byte("{}"),
		Headers: []dlq.Header{{Key: consumer.HeaderEventID, Value: "e-1"}}}, false, false)
	assert.NotContains(t, out.String(), "\n  once-event-id: forged")
	assert.NotContains(t, out.String(), "\r")
	assert.Contains(t, out.String(), `key: "k-1\n  once-event-id: forged\r"`)
}

// A payload printed as text cannot overwrite what it printed: one with a
// carriage return that does not end a line (which would show
// {"amount":1} over {"amount":9999} on a terminal) is dumped in hex; lines
// ending in CRLF are still text.
func TestShowDumpsAPayloadThatOverwritesItself(t *testing.T) {
	var out bytes.Buffer
	a := newApp(&out, io.Discard, func(string) string { return "" })
	a.printRecord(&dlq.Record{Ref: "0:1", Value: []byte(`{"amount":9999}` + "\r" + `{"amount":1}   `),
		Headers: []dlq.Header{{Key: consumer.HeaderEventID, Value: "e-1"}}}, false, false)
	assert.NotContains(t, out.String(), "\r")
	assert.Contains(t, out.String(), "bytes, hex")
	out.Reset()
	a.printRecord(&dlq.Record{Ref: "0:2", Value: []byte("line 1\r\nline 2\r\n"),
		Headers: []dlq.Header{{Key: consumer.HeaderEventID, Value: "e-2"}}}, false, false)
	assert.Contains(t, out.String(), "text):\nline 1\r\nline 2\r\n")
}

// once dlq show -json prints what JSON text cannot hold, a key or a header
// that is not UTF-8 (Kafka keys and headers are bytes), in hex beside it
// (key_hex, value_hex), as it prints such a payload: encoding/json would
// write U+FFFD for each byte that is not UTF-8, and the bytes were lost.
func TestShowJSONKeepsBytesThatAreNotUTF8(t *testing.T) {
	r := &dlq.Record{Ref: "0:1", Key: []byte{0xff, 0x00, 'k'}, Value: []byte("{}"),
		Headers: []dlq.Header{{Key: consumer.HeaderEventID, Value: "e-1"}, {Key: "trace-bin", Value: "\xfe\xed"},
			{Key: "k-\xc3", Value: "v"}}}
	b, err := json.Marshal(detail(r))
	require.NoError(t, err)
	var got struct {
		KeyHex  string `json:"key_hex"`
		Headers []struct {
			Key      string `json:"key"`
			Value    string `json:"value"`
			KeyHex   string `json:"key_hex"`
			ValueHex string `json:"value_hex"`
		} `json:"headers"`
	}
	require.NoError(t, json.Unmarshal(b, &got), "%s", b)
	assert.Equal(t, "ff006b", got.KeyHex, "%s", b)
	require.Len(t, got.Headers, 3)
	assert.Equal(t, "e-1", got.Headers[0].Value)
	assert.Empty(t, got.Headers[0].ValueHex, "a header that is text has no hex")
	assert.Equal(t, "feed", got.Headers[1].ValueHex, "%s", b)
	assert.Equal(t, "6b2dc3", got.Headers[2].KeyHex, "%s", b)
	assert.Equal(t, "v", got.Headers[2].Value)
	// A key that is text stays text, without hex.
	b, err = json.Marshal(detail(&dlq.Record{Ref: "0:2", Key: []byte("k-1"), Value: []byte("{}")}))
	require.NoError(t, err)
	assert.Contains(t, string(b), `"key":"k-1"`)
	assert.NotContains(t, string(b), "key_hex")
}

// A tab in a dead letter's text (its consumer, event id, type) is quoted
// in the tables once prints: raw, it began a new column, and the record's
// other columns moved right, a consumer "billing\tpanic" showing the kind
// panic and its real kind under another heading.
func TestListQuotesATabInACell(t *testing.T) {
	k := testenv.NewKafka(t)
	name := testenv.Uniq("orders") + ".dlq"
	k.CreateTopic(name, 1)
	k.Produce(&sarama.ProducerMessage{Topic: name, Value: sarama.StringEncoder("{}"), Headers: []sarama.RecordHeader{
		{Key: []byte(consumer.HeaderEventID), Value: []byte("e-1")},
		{Key: []byte(consumer.HeaderConsumer), Value: []byte("billing\tpanic")},
		{Key: []byte(consumer.HeaderErrorKind), Value: []byte("handler")},
	}})
	code, out, errOut := cli(t, map[string]string{"ONCE_KAFKA_BROKERS": strings.Join(k.Addrs, ",")}, "dlq", "list", "-dlq", name)
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, `"billing\tpanic"`)
	assert.NotContains(t, out, "\t")
	var out2 bytes.Buffer
	a := newApp(&out2, io.Discard, func(string) string { return "" })
	a.printRecord(&dlq.Record{Ref: "0:1", Value: []byte("{}"), Headers: []dlq.Header{{Key: consumer.HeaderEventID, Value: "e-1\tforged"}}}, false, false)
	assert.Contains(t, out2.String(), `"e-1\tforged"`)
}

// "once dlq" alone, or with a word that is none of its subcommands, names
// the subcommands (exit 2), rather than calling dlq an unknown command.
func TestDLQWithoutASubcommandNamesThem(t *testing.T) {
	for _, args := range [][]string{{"dlq"}, {"dlq", "lst"}, {"dlq", "-dlq", "x"}} {
		code, _, errOut := cli(t, nil, args...)
		assert.Equal(t, exitUsage, code, "%v", args)
		assert.NotContains(t, errOut, `unknown command "dlq"`, "%v", args)
		for _, sub := range []string{"dlq list", "dlq show", "dlq replay"} {
			assert.Contains(t, errOut, sub, "%v", args)
		}
	}
	code, _, errOut := cli(t, nil, "dlqx")
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, errOut, `unknown command "dlqx"`)
}

// Help shows where a connection comes from (env DATABASE_URL, ...), not
// the value it has in the environment: the URLs hold passwords, and help
// output gets pasted into tickets.
func TestHelpDoesNotPrintTheEnvironmentsPasswords(t *testing.T) {
	env := map[string]string{"DATABASE_URL": "postgres://app:hunter2@db/app", "ONCE_AMQP_URL": "amqp://ops:s3cret@mq/",
		"ONCE_KAFKA_BROKERS": "kafka-1:9092"}
	for _, args := range [][]string{{"help", "status"}, {"help", "ui"}, {"help", "dlq"}, {"status", "-h"}, {"dlq", "replay", "-h"}, {"migrate", "-h"}} {
		code, out, errOut := cli(t, env, args...)
		assert.Equal(t, exitOK, code, "%v: %s", args, errOut)
		assert.Contains(t, out, "Flags:", "%v", args)
		for _, secret := range []string{"hunter2", "s3cret"} {
			assert.NotContains(t, out+errOut, secret, "%v", args)
		}
	}
}

// once status prints what it could read when a part of it fails (the
// dead letters of a topic that is missing, the lag of a topic that is
// missing), says what failed and exits 1: the consumers it read are not
// thrown away with the part that failed.
func TestStatusPrintsWhatItReadWhenAPartFails(t *testing.T) {
	env, _, topic := kafkaDLQ(t)
	code, out, errOut := cli(t, env, "status", "-dlq", "missing.dlq", "-group", "nobody", "-topic", topic)
	assert.Equal(t, exitFailure, code)
	assert.Contains(t, out, "billing", "the consumers are printed")
	assert.Contains(t, out, "kafka lag", "the lag is printed")
	assert.Contains(t, errOut, "missing.dlq")

	code, out, errOut = cli(t, env, "status", "-dlq", topic+".dlq", "-group", "nobody", "-topic", "missing", "-json")
	assert.Equal(t, exitFailure, code)
	var st statusReport
	require.NoError(t, json.Unmarshal([]byte(out), &st), out)
	require.Len(t, st.Consumers, 1)
	assert.NotEmpty(t, st.DeadLetters, "the dead letters are printed")
	require.Len(t, st.Errors, 1)
	assert.Contains(t, st.Errors[0], "missing")
	assert.Contains(t, errOut, "missing")
}

// once ui starts while the database is down when it has dead letters to
// show: the consumers page says the consumers could not be read and
// shows the dead letters, as it does when the database goes down later.
// With nothing but the database to show, it does not start.
func TestUIStartsWithTheDatabaseDown(t *testing.T) {
	k := testenv.NewKafka(t)
	k.CreateTopic("orders.dlq", 1)
	k.Produce(&sarama.ProducerMessage{Topic: "orders.dlq", Value: sarama.StringEncoder("{}")})
	down := "postgres://once@127.0.0.1:1/once?connect_timeout=1"
	pr, pw := io.Pipe()
	var errb bytes.Buffer
	a := newApp(pw, &errb, func(string) string { return "" })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan int, 1)
	go func() {
		done <- a.run(ctx, []string{"ui", "-addr", "127.0.0.1:0", "-database-url", down,
			"-kafka", strings.Join(k.Addrs, ","), "-dlq", "orders.dlq"})
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	require.NoError(t, err, "once ui did not start: %s", errb.String())
	go func() { _, _ = io.Copy(io.Discard, pr) }()
	addr := strings.Fields(strings.TrimPrefix(line, "once console on "))[0]
	resp, err := http.Get(addr)
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Contains(t, string(body), "The consumers could not be read")
	assert.Contains(t, string(body), "kafka topic orders.dlq</a>: 1")
	cancel()
	select {
	case code := <-done:
		assert.Equal(t, exitOK, code)
	case <-time.After(15 * time.Second):
		t.Fatal("once ui did not stop")
	}
	assert.Contains(t, errb.String(), "PostgreSQL", "the database being down is said at the start")

	code, _, errOut := cli(t, nil, "ui", "-addr", "127.0.0.1:0", "-database-url", down)
	assert.Equal(t, exitFailure, code, "nothing but the database to show: %s", errOut)
}

// once migrate says which tables it migrated, the offsets table of
// version 4 included (and not after a migration down below it), and its
// JSON names the schema too.
func TestMigrateNamesEveryTable(t *testing.T) {
	_, schema := pgtest.Schema(t)
	env := map[string]string{"DATABASE_URL": testenv.SchemaURL(schema)}
	code, out, errOut := cli(t, env, "migrate", "up")
	require.Equal(t, exitOK, code, errOut)
	for _, table := range []string{"processed_events", "processed_events_attempts", "processed_events_offsets"} {
		assert.Contains(t, out, table)
	}
	code, out, errOut = cli(t, env, "migrate", "down", "-to", "3")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "processed_events_attempts")
	assert.NotContains(t, out, "processed_events_offsets", "version 3 has no offsets table")
	code, out, errOut = cli(t, env, "migrate", "down", "-to", "0")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "dropped")
	code, out, errOut = cli(t, env, "migrate", "status", "-schema", schema, "-json")
	require.Equal(t, exitOK, code, errOut)
	var st map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &st))
	assert.Equal(t, schema, st["schema"])
}

// An event id that is not UTF-8 (an invalid-id dead letter keeps the id
// it was refused for) is listed in hex as well: JSON text cannot hold its
// bytes, and `dlq list -json` would print U+FFFD in their place.
func TestListJSONKeepsAnEventIDThatIsNotUTF8(t *testing.T) {
	r := &dlq.Record{Ref: "0:1", Value: []byte("{}"), Headers: []dlq.Header{{Key: consumer.HeaderEventID, Value: "e-\xff\xfe"}}}
	b, err := json.Marshal(summarize(r))
	require.NoError(t, err)
	var got struct {
		EventIDHex string `json:"event_id_hex"`
	}
	require.NoError(t, json.Unmarshal(b, &got), "%s", b)
	assert.Equal(t, "652dfffe", got.EventIDHex, "%s", b)
	b, err = json.Marshal(summarize(&dlq.Record{Ref: "0:2", Value: []byte("{}"), Headers: []dlq.Header{{Key: consumer.HeaderEventID, Value: "e-1"}}}))
	require.NoError(t, err)
	assert.NotContains(t, string(b), "event_id_hex", "an id that is text has no hex")
}

// migrate down moves the tables back; a -to above the version the
// database records would run migrations up (version 2 builds an index
// holding writes off the table) and report a "down" to a newer schema. It
// is refused, and nothing is migrated.
func TestMigrateDownRefusesAVersionAboveTheRecordedOne(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgtest.Schema(t)
	env := map[string]string{"DATABASE_URL": testenv.SchemaURL(schema)}
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.MigrateTo(ctx, pool, 1))
	code, out, errOut := cli(t, env, "migrate", "down", "-to", "3")
	assert.Equal(t, exitFailure, code, "down to a version above the recorded one: %s", out)
	assert.Contains(t, errOut, "version 1")
	v, err := store.Version(ctx, pool)
	require.NoError(t, err)
	assert.Equal(t, 1, v, "nothing migrated")

	// Down to the recorded version changes nothing, and is no error.
	code, out, errOut = cli(t, env, "migrate", "down", "-to", "1")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "schema version 1")
}

// A -kind that is no dead-letter kind (a typo) selected nothing: a
// replay printed "0 selected, replayed 0" and succeeded, as if nothing
// were left to replay. It is a usage error that lists the kinds, and the
// kinds are matched as written in the dead letters.
func TestDLQRefusesAnUnknownKind(t *testing.T) {
	env, _, topic := kafkaDLQ(t)
	for _, cmd := range []string{"replay", "list", "show"} {
		code, out, errOut := cli(t, env, "dlq", cmd, "-dlq", topic+".dlq", "-kind", "handler,handlr")
		assert.Equal(t, exitUsage, code, "dlq %s: %s%s", cmd, out, errOut)
		assert.Contains(t, errOut, `"handlr"`, "dlq %s", cmd)
		assert.Contains(t, errOut, "crash-loop", "dlq %s: the kinds are listed", cmd)
		assert.NotContains(t, out, "replayed", "dlq %s", cmd)
	}
	code, out, errOut := cli(t, env, "dlq", "list", "-dlq", topic+".dlq", "-kind", "handler, panic")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "3 of 4 records")
}

// A -ref that is no record ref (a Kafka ref written 0/3 or 0:03) selected
// nothing, and beside good refs a replay ran on those alone and
// succeeded. It is a usage error.
func TestDLQRefusesARefOfNoRecord(t *testing.T) {
	env, _, topic := kafkaDLQ(t)
	for _, ref := range []string{"0:0,0/3", "0:03", "0:-1", "p0:3", "0:3:1", "ABCDEF0123456789"} {
		for _, cmd := range []string{"replay", "list", "show"} {
			code, out, errOut := cli(t, env, "dlq", cmd, "-dlq", topic+".dlq", "-ref", ref)
			assert.Equal(t, exitUsage, code, "dlq %s -ref %s: %s%s", cmd, ref, out, errOut)
			assert.Contains(t, errOut, "-ref", "dlq %s -ref %s", cmd, ref)
			assert.NotContains(t, out, "replayed", "dlq %s -ref %s", cmd, ref)
		}
	}
	code, out, errOut := cli(t, env, "dlq", "list", "-dlq", topic+".dlq", "-ref", "0:0, 0:3,0123456789abcdef")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "2 of 4 records")
}

// dlq list -json prints the first -limit records (100 by default) as an
// array: a script reading it took them for all there are. The rest are
// said on stderr, as dlq show says them, and the array is unchanged.
func TestListJSONSaysWhatTheLimitLeftOut(t *testing.T) {
	env, _, topic := kafkaDLQ(t)
	code, out, errOut := cli(t, env, "dlq", "list", "-dlq", topic+".dlq", "-json", "-limit", "1")
	require.Equal(t, exitOK, code, errOut)
	var listed []recordSummary
	require.NoError(t, json.Unmarshal([]byte(out), &listed))
	assert.Len(t, listed, 1)
	assert.Contains(t, errOut, "1 of 4 records listed")
	code, out, errOut = cli(t, env, "dlq", "list", "-dlq", topic+".dlq", "-json", "-limit", "1", "-kind", "handler")
	require.Equal(t, exitOK, code, errOut)
	require.NoError(t, json.Unmarshal([]byte(out), &listed))
	assert.Len(t, listed, 1)
	assert.Contains(t, errOut, "1 of 2 matching records listed")
	code, _, errOut = cli(t, env, "dlq", "list", "-dlq", topic+".dlq", "-json")
	require.Equal(t, exitOK, code, errOut)
	assert.Empty(t, errOut, "all listed: nothing to say")
}

func TestHelpListsEveryEnvironmentVariableTheCommandsRead(t *testing.T) {
	code, out, _ := cli(t, nil, "help")
	require.Equal(t, exitOK, code)
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	read := map[string]bool{envKafkaPassword: true}
	getenv := regexp.MustCompile(`getenv\("([A-Z_]+)"\)`)
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		require.NoError(t, err)
		for _, m := range getenv.FindAllStringSubmatch(string(src), -1) {
			read[m[1]] = true
		}
	}
	require.Contains(t, read, "DATABASE_URL", "the variables are read through getenv")
	for name := range read {
		assert.Regexp(t, `(?m)^\s+`+name+`(=|\s)`, out, "help lists %s", name)
	}
}
