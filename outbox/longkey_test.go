package outbox_test

import (
	"context"
	"crypto/rand"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/outbox"
)

// A row the broker refuses is charged in place, which enters it in the
// index of refused rows by (topic, key, seq); PostgreSQL's index entries
// hold about 2.7 kB. Add took any Topic and Key: a row with a 3 kB key
// (or topic) published until the broker refused it once, and then the
// settlement that charges it failed ("index row size exceeds btree
// version 4 maximum 2704"), and was written again after every backoff,
// for ever: the relay published no other row of any key. Add refuses such
// a message; a row at both limits is charged and parked, and the outbox
// goes on.
func TestRowWithTheLongestKeyTheBrokerRefusesDoesNotStopTheOutbox(t *testing.T) {
	ctx := context.Background()
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)

	longKey := randomBytes(t, outbox.MaxKeyLength+1)
	for name, m := range map[string]outbox.Message{
		"key too long":   {Topic: "t", Key: longKey, Body: []byte("x")},
		"topic too long": {Topic: strings.Repeat("t", outbox.MaxTopicLength+1), Body: []byte("x")},
	} {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return outbox.Add(ctx, tx, m) })
		require.ErrorIs(t, err, outbox.ErrInvalidMessage, name)
	}

	startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 1,
		Logger: testLogger()})
	// No broker has this topic (nor takes a name this long): refused.
	refused := outbox.Message{ID: "refused", Topic: strings.Repeat("t", outbox.MaxTopicLength),
		Key: randomBytes(t, outbox.MaxKeyLength), Body: []byte("refused")}
	addCommitted(t, pool, refused)
	waitRows(t, pool, "parked_at IS NOT NULL", 1, 30*time.Second)
	addCommitted(t, pool, d.msg("b", "b/1"))
	assert.Equal(t, []string{"b/1"}, bodies(d.read(t, 1)), "another key's row is published")
	waitRows(t, pool, "parked_at IS NULL", 0, 30*time.Second)
}

// randomBytes returns n random bytes: PostgreSQL compresses a repetitive
// value in an index entry, and random ones not.
func randomBytes(t *testing.T, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return b
}
