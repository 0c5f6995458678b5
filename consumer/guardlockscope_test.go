package consumer_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// The lock a suspect's attempt holds (guard.go, lockAttempt) keeps two
// processes of one consumer from taking each other's running attempt for
// a crash: it is the message's in its store. A consumer of the same name
// on another store of the same database (a schema per tenant, per
// environment, per parallel test) shares no record with it, and must not
// wait for its attempts: waiting, it holds the isolation every other
// message of its own needs, and its whole stream stands still for as long
// as the other's handler runs (up to HandlerTimeout, and without end under
// NoHandlerTimeout).
func TestSuspectDoesNotWaitForTheSameIDInAnotherStore(t *testing.T) {
	poolA, _ := pgtest.Schema(t)
	poolB, _ := pgtest.Schema(t)
	effects(t, poolA)
	effects(t, poolB)
	cfg := fastConfig("tenant-consumer")

	// Consumer A, on its schema, holds a suspect's attempt of "evt-1".
	brokerA := memsource.New(memsource.Options{})
	brokerA.Publish(consumer.Message{Value: []byte(`{"n":1}`), Headers: map[string]string{"id": "evt-1"}, Redelivered: true})
	running, release := make(chan struct{}), make(chan struct{})
	var released sync.Once
	letGo := func() { released.Do(func() { close(release) }) }
	t.Cleanup(letGo)
	a, err := consumer.New(poolA, brokerA.Source(), func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		close(running)
		select {
		case <-release:
		case <-ctx.Done():
		}
		return insertEffect(ctx, tx, ev)
	}, cfg)
	require.NoError(t, err)
	stopA := start(t, a)
	<-running

	// Consumer B, of the same name on another schema, gets a redelivery of
	// its own "evt-1": another event, in another store.
	brokerB := memsource.New(memsource.Options{})
	brokerB.Publish(consumer.Message{Value: []byte(`{"n":2}`), Headers: map[string]string{"id": "evt-1"}, Redelivered: true})
	b, err := consumer.New(poolB, brokerB.Source(), insertEffect, cfg)
	require.NoError(t, err)
	stopB := start(t, b)

	// Well within A's HandlerTimeout (a minute), which B waited out.
	assert.Eventually(t, func() bool { return brokerB.Acked() == 1 }, 15*time.Second, 5*time.Millisecond,
		"B's suspect waited for A's attempt of the same id in another store")
	letGo()
	require.NoError(t, stopB())
	require.NoError(t, stopA())
	requireEffectsOnce(t, poolA, 1)
	requireEffectsOnce(t, poolB, 1)
}
