package amqp_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// The crash test re-executes the test binary as a consumer process that
// dies inside Delivery.Ack, after the message's transaction committed.
const (
	childEnv        = "ONCE_AMQP_TEST_CHILD" // "ack" or "handler"
	childQueueEnv   = "ONCE_AMQP_TEST_QUEUE"
	childSchemaEnv  = "ONCE_AMQP_TEST_SCHEMA"
	childCrashAtEnv = "ONCE_AMQP_TEST_CRASH_AT"
	crashMarker     = "child: exiting inside Ack"
)

// exitOnAck kills the process in the at-th call of Ack, before acking.
type exitOnAck struct {
	consumer.Source
	at    int64
	calls atomic.Int64
}

type exitingDelivery struct {
	consumer.Delivery
	s *exitOnAck
}

func (s *exitOnAck) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return &exitingDelivery{Delivery: d, s: s}, nil
}

func (d *exitingDelivery) Ack(ctx context.Context) error {
	if d.s.calls.Add(1) == d.s.at {
		fmt.Fprintln(os.Stderr, crashMarker, d.Message().ID)
		os.Exit(1)
	}
	return d.Delivery.Ack(ctx)
}

// runChild is the consumer process of the crash tests; childEnv says
// which: "ack" dies in the Ack of the childCrashAtEnv-th message,
// "handler" dies whenever it handles the event killerID.
func runChild() int {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	at, err := strconv.ParseInt(os.Getenv(childCrashAtEnv), 10, 64)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	pcfg, err := pgxpool.ParseConfig(os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	pcfg.ConnConfig.RuntimeParams["search_path"] = os.Getenv(childSchemaEnv)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	defer pool.Close()
	src, err := amqp.Open(ctx, amqp.Config{URL: os.Getenv("AMQP_URL"), Queue: os.Getenv(childQueueEnv)})
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	if os.Getenv(childEnv) == "handler" {
		return runCrashLoopChild(ctx, pool, src)
	}
	c, err := consumer.New(pool, &exitOnAck{Source: src, at: at}, recordEffect, consumer.Config{Name: "crash-test", Concurrency: 4})
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	if err := c.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	fmt.Fprintln(os.Stderr, "child: ran out of time without crashing")
	return 3
}

// killerID is the event whose handling kills the process.
const killerID = "killer"

// runCrashLoopChild consumes until it dies handling killerID (exit 1) or
// the consumer dead-letters it (a clean stop, exit 0). It handles one
// message at a time: every message in flight when the process dies has
// its crash attempt counted, so with more workers an innocent message
// handled alongside the killer each time would be dead-lettered too.
func runCrashLoopChild(ctx context.Context, pool *pgxpool.Pool, src consumer.Source) int {
	c, err := consumer.New(pool, src, func(ctx context.Context, tx pgx.Tx, ev consumer.Event[payload]) error {
		if ev.ID == killerID {
			fmt.Fprintln(os.Stderr, crashMarker, ev.ID)
			os.Exit(1)
		}
		return recordEffect(ctx, tx, ev)
	}, consumer.Config{Name: "crash-loop-test", Concurrency: 1, CrashGuard: consumer.CrashGuardConfig{MaxCrashes: crashLoopMax}})
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for c.Stats().DeadLettered == 0 && ctx.Err() == nil {
		<-tick.C
	}
	stop()
	if err := <-done; err != nil || ctx.Err() != nil {
		fmt.Fprintln(os.Stderr, "child:", err, ctx.Err())
		return 2
	}
	return 0
}

// crashLoopMax is consumer.Config.CrashGuard.MaxCrashes in the crash-loop test.
const crashLoopMax = 2

// TestCrashLoopDeadLettered: an event whose handling kills the process
// every time comes back with the redelivered flag after each crash; after
// CrashGuard.MaxCrashes such crashes the consumer dead-letters it with kind
// crash-loop instead of crash-looping the service, and every other event
// has exactly one effect.
func TestCrashLoopDeadLettered(t *testing.T) {
	t.Parallel()
	url := brokerURL(t)
	ctx := context.Background()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	ids := eventIDs("loop", 30)
	msgs := messagesFor(ids)
	msgs = append(msgs[:10:10], append(messagesFor([]string{killerID}), msgs[10:]...)...)
	require.NoError(t, a.publish("", q, msgs...))
	pool, schema := pgtest.Schema(t)
	_, err := pool.Exec(ctx, effectsDDL)
	require.NoError(t, err)

	crashes := 0
	for run := 1; ; run++ {
		require.LessOrEqual(t, run, crashLoopMax+3, "the killer event was never dead-lettered")
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), childEnv+"=handler", "AMQP_URL="+url, "DATABASE_URL="+pgtest.URL(),
			childQueueEnv+"="+q, childSchemaEnv+"="+schema, childCrashAtEnv+"=0")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		err := cmd.Run()
		if err == nil {
			break
		}
		var exit *exec.ExitError
		require.True(t, errors.As(err, &exit), "run %d: %v; stderr:\n%s", run, err, stderr.String())
		require.Equal(t, 1, exit.ExitCode(), "run %d stderr:\n%s", run, stderr.String())
		require.Contains(t, stderr.String(), crashMarker)
		crashes++
	}
	assert.GreaterOrEqual(t, crashes, crashLoopMax, "dead-lettered only after CrashGuard.MaxCrashes crashes")
	t.Logf("the killer event crashed the consumer %d times, then was dead-lettered", crashes)

	dead, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
	require.NoError(t, err)
	require.Len(t, dead, 1)
	h := amqp.HeaderStrings(dead[0].Headers)
	assert.Equal(t, string(consumer.KindCrashLoop), h[consumer.HeaderErrorKind])
	assert.Equal(t, killerID, h[consumer.HeaderEventID])
	assert.Equal(t, killerID, dead[0].MessageId)

	// The rest of the stream, by a consumer that does not crash; the last
	// child may have finished it, so one more event shows this one runs.
	tail := eventIDs("tail", 1)
	require.NoError(t, a.publish("", q, messagesFor(tail)...))
	ids = append(ids, tail...)
	src := openSource(t, amqp.Config{Queue: q})
	r := startConsumer(t, pool, src, consumer.Config{Name: "crash-loop-test"}, recordEffect)
	waitAllEffects(t, pool, a, q, len(ids), 60*time.Second)
	require.NoError(t, r.stop())
	requireExactlyOnce(t, pool, ids)
	requireLeftoversProcessed(t, a, q, ids)
}

// TestCrashBetweenCommitAndAck kills the consumer process after a
// message's transaction committed and before its ack: the broker delivers
// it again, the next consumer skips it as a duplicate, and every event has
// exactly one effect.
func TestCrashBetweenCommitAndAck(t *testing.T) {
	t.Parallel()
	url := brokerURL(t)
	ctx := context.Background()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	const n, crashAt = 40, 10
	ids := eventIDs("crash", n)
	require.NoError(t, a.publish("", q, messagesFor(ids)...))

	pool, schema := pgtest.Schema(t)
	_, err := pool.Exec(ctx, effectsDDL)
	require.NoError(t, err)

	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(),
		childEnv+"=ack",
		"AMQP_URL="+url,
		"DATABASE_URL="+pgtest.URL(),
		childQueueEnv+"="+q,
		childSchemaEnv+"="+schema,
		childCrashAtEnv+"="+strconv.Itoa(crashAt),
	)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err = cmd.Run()
	var exit *exec.ExitError
	require.True(t, errors.As(err, &exit), "the child must crash, got %v; stderr:\n%s", err, stderr.String())
	require.Equal(t, 1, exit.ExitCode(), "stderr:\n%s", stderr.String())
	require.Contains(t, stderr.String(), crashMarker)

	committed, distinct, err := effectCounts(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, committed, distinct, "the crashed process committed an event twice")
	require.GreaterOrEqual(t, committed, crashAt, "the crash came in the Ack of the %dth committed message", crashAt)
	t.Logf("the child committed %d events and acked %d before dying", committed, crashAt-1)

	src := openSource(t, amqp.Config{Queue: q})
	c, err := consumer.New(pool, src, recordEffect, consumer.Config{Name: "crash-test", Concurrency: 4})
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	require.Eventually(t, func() bool {
		_, d, err := effectCounts(ctx, pool)
		st := c.Stats()
		ready, rerr := a.ready(q)
		settled := st.Handled + st.Duplicates
		return err == nil && rerr == nil && d == n && ready == 0 &&
			settled >= uint64(n-(crashAt-1)) && settled == st.Received
	}, 60*time.Second, 20*time.Millisecond)
	stop()
	require.NoError(t, <-done)

	requireExactlyOnce(t, pool, ids)
	st := c.Stats()
	assert.Equal(t, uint64(n-committed), st.Handled, "the restarted consumer handles exactly what was not committed")
	assert.GreaterOrEqual(t, st.Duplicates, uint64(committed-(crashAt-1)),
		"every message committed but not acked comes back and is skipped as a duplicate")
	assert.Zero(t, st.DeadLettered)
	ready, err := a.ready(q)
	require.NoError(t, err)
	assert.Zero(t, ready, "every message was acked")
}
