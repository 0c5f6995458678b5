package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/outbox"
)

// outboxWithSeq is the library's outbox table (the columns of schema
// version 2) with seq made as seqDDL says.
func outboxWithSeq(seqDDL string) string {
	return `CREATE TABLE outbox (
    seq         ` + seqDDL + `,
    event_id    text        NOT NULL,
    topic       text        NOT NULL,
    routing_key text        NOT NULL DEFAULT '',
    key         bytea,
    type        text        NOT NULL DEFAULT '',
    headers     jsonb       NOT NULL DEFAULT '{}',
    trace       jsonb       NOT NULL DEFAULT '{}',
    body        bytea       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    attempts    integer     NOT NULL DEFAULT 0,
    not_before  timestamptz,
    last_error  text,
    parked_at   timestamptz,
    sent_at     timestamptz,
    waiting     boolean     NOT NULL DEFAULT false)`
}

// The relay publishes each key's rows in seq order, which docs/outbox.md
// says is the order they were written in: the library's identity counts
// up. Check asked only that seq have some default, so a table whose seq
// came from a sequence counting down, cycling or caching values per
// session (rows written one after another from two sessions got seqs in
// the other order), from a random or clock default, or from a generated
// expression (a user's DDL, a migration that replaced the identity) was
// adopted, and the relay published each key's messages in another order
// than they were written, without a word.
// Check and Migrate refuse such a table now, naming the fix, and the
// table fixed as the error says passes.
func TestCheckRefusesASeqThatDoesNotCountUp(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name, setup, seqDDL, want, fix string
	}{
		{name: "sequence counting down",
			setup:  `CREATE SEQUENCE outbox_down INCREMENT BY -1`,
			seqDDL: `bigint PRIMARY KEY DEFAULT nextval('outbox_down')`,
			want:   "which counts down",
			fix:    `ALTER SEQUENCE outbox_down INCREMENT BY 1 NO MINVALUE NO MAXVALUE NO CYCLE START WITH 1 RESTART WITH 1`},
		{name: "identity cycling",
			seqDDL: `bigint GENERATED ALWAYS AS IDENTITY (MAXVALUE 1000 CYCLE) PRIMARY KEY`,
			want:   "which cycles",
			fix:    `ALTER SEQUENCE outbox_seq_seq INCREMENT BY 1 NO MINVALUE NO MAXVALUE NO CYCLE START WITH 1 RESTART WITH 1`},
		{name: "identity caching values per session",
			seqDDL: `bigint GENERATED ALWAYS AS IDENTITY (CACHE 20) PRIMARY KEY`,
			want:   "which caches 20 values per session",
			fix:    `ALTER SEQUENCE outbox_seq_seq CACHE 1`},
		{name: "random default",
			seqDDL: `bigint PRIMARY KEY DEFAULT (random() * 1e15)::bigint`,
			want:   "not the next value of a sequence",
			fix: `ALTER TABLE outbox ALTER COLUMN seq DROP DEFAULT;
ALTER TABLE outbox ALTER COLUMN seq ADD GENERATED ALWAYS AS IDENTITY`},
		{name: "generated expression",
			seqDDL: `bigint GENERATED ALWAYS AS (hashtext(event_id)) STORED PRIMARY KEY`,
			want:   "generated from an expression",
			fix: `ALTER TABLE outbox ALTER COLUMN seq DROP EXPRESSION;
ALTER TABLE outbox ALTER COLUMN seq ADD GENERATED ALWAYS AS IDENTITY`},
	} {
		t.Run(c.name, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			if c.setup != "" {
				_, err := pool.Exec(ctx, c.setup)
				require.NoError(t, err)
			}
			_, err := pool.Exec(ctx, outboxWithSeq(c.seqDDL))
			require.NoError(t, err)
			s, err := outbox.New(outbox.Config{})
			require.NoError(t, err)

			err = s.Check(ctx, pool)
			require.ErrorIs(t, err, outbox.ErrSchemaMismatch)
			assert.ErrorContains(t, err, c.want)
			assert.ErrorContains(t, err, "the relay publishes each key's rows in seq order")
			require.ErrorIs(t, s.Migrate(ctx, pool), outbox.ErrSchemaMismatch, "Migrate adopts no such table")
			r, err := outbox.NewRelay(pool, nopPublisher{}, outbox.RelayConfig{SkipMigrate: true, Logger: testLogger()})
			require.NoError(t, err)
			require.ErrorIs(t, r.Run(ctx), outbox.ErrSchemaMismatch, "a relay that does not migrate refuses it at start")

			_, err = pool.Exec(ctx, c.fix)
			require.NoError(t, err)
			require.NoError(t, s.Migrate(ctx, pool), "the table fixed as the error says is adopted")
		})
	}
}

// A table whose seq counted down, fixed as Check says, publishes each
// key's messages in the order they were written.
func TestSeqFixedAsCheckSaysKeepsKeyOrder(t *testing.T) {
	ctx := context.Background()
	k := newKafka(t)
	pool, _ := pgtest.Schema(t)
	_, err := pool.Exec(ctx, `CREATE SEQUENCE outbox_down INCREMENT BY -1`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, outboxWithSeq(`bigint PRIMARY KEY DEFAULT nextval('outbox_down')`))
	require.NoError(t, err)
	require.ErrorIs(t, outbox.Migrate(ctx, pool), outbox.ErrSchemaMismatch)

	_, err = pool.Exec(ctx, `ALTER SEQUENCE outbox_down INCREMENT BY 1 NO MINVALUE NO MAXVALUE NO CYCLE START WITH 1 RESTART WITH 1`)
	require.NoError(t, err)
	require.NoError(t, outbox.Migrate(ctx, pool))
	d := k.destination(t)
	want := make([]string, 20)
	for i := range want {
		want[i] = fmt.Sprint("m", i)
		addCommitted(t, pool, d.msg("k", want[i])) // one transaction after another: an order to keep
	}
	startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, BatchSize: 7})
	waitRows(t, pool, "true", 0, 30*time.Second)
	assert.Equal(t, want, bodies(d.read(t, len(want))))
}

// A seq that counts up is taken however it was made: a bigserial (a
// default that is the next value of its own sequence), or a default of a
// sequence the column does not own, in another schema.
func TestCheckAcceptsASeqThatCountsUp(t *testing.T) {
	ctx := context.Background()
	for name, seqDDL := range map[string]string{
		"bigserial":           `bigserial PRIMARY KEY`,
		"a shared sequence":   `bigint PRIMARY KEY DEFAULT nextval('public.outbox_shared_seq')`,
		"identity by default": `bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY`,
	} {
		t.Run(name, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			_, err := pool.Exec(ctx, `CREATE SEQUENCE IF NOT EXISTS public.outbox_shared_seq`)
			require.NoError(t, err)
			_, err = pool.Exec(ctx, outboxWithSeq(seqDDL))
			require.NoError(t, err)
			require.NoError(t, outbox.Migrate(ctx, pool))
		})
	}
}

// A sequence set back, or a new one put in the identity's place, by a
// migration gave new rows seqs below those of rows still pending, which
// the relay published first: a key's messages out of order, until Add
// failed on a seq taken. Check refuses such a table now, naming the
// setval that fixes it, and the table fixed so publishes each key's
// messages in the order they were written.
func TestCheckRefusesASeqBehindTheTable(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct{ name, migration, seqName string }{
		{name: "identity restarted", seqName: "outbox_seq_seq",
			migration: `ALTER TABLE outbox ALTER COLUMN seq RESTART WITH 1`},
		{name: "identity replaced by a new sequence", seqName: "outbox_new_seq",
			migration: `ALTER TABLE outbox ALTER COLUMN seq DROP IDENTITY;
CREATE SEQUENCE outbox_new_seq;
ALTER TABLE outbox ALTER COLUMN seq SET DEFAULT nextval('outbox_new_seq')`},
	} {
		t.Run(c.name, func(t *testing.T) {
			k := newKafka(t)
			d := k.destination(t)
			pool, _ := migrated(t)
			var want []string
			add := func(n int) {
				for range n {
					want = append(want, fmt.Sprint("m", len(want)))
					addCommitted(t, pool, d.msg("k", want[len(want)-1])) // one after another: an order to keep
				}
			}
			add(5) // pending, seqs 1 to 5
			_, err := pool.Exec(ctx, c.migration)
			require.NoError(t, err)

			s, err := outbox.New(outbox.Config{})
			require.NoError(t, err)
			err = s.Check(ctx, pool)
			require.ErrorIs(t, err, outbox.ErrSchemaMismatch)
			assert.ErrorContains(t, err, "is not above the table's highest seq (5)")
			assert.ErrorContains(t, err, "SELECT setval('"+c.seqName+"', (SELECT max(seq) FROM \"outbox\"))")
			require.ErrorIs(t, s.Migrate(ctx, pool), outbox.ErrSchemaMismatch)

			_, err = pool.Exec(ctx, `SELECT setval('`+c.seqName+`', (SELECT max(seq) FROM "outbox"))`)
			require.NoError(t, err)
			require.NoError(t, s.Migrate(ctx, pool))
			add(5)
			startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, BatchSize: 3})
			waitRows(t, pool, "true", 0, 30*time.Second)
			assert.Equal(t, want, bodies(d.read(t, len(want))))
		})
	}
}
