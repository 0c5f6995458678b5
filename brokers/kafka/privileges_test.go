package kafka

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/internal/testlog"
)

// limitedRole creates a login role that may use schema and read and
// write every table in it but the privileges revoke lists on
// processed_events_offsets, and returns a pool connecting as that role
// (search_path schema). The role is dropped when the test ends.
func limitedRole(t *testing.T, admin *pgxpool.Pool, schema, revoke string) (*pgxpool.Pool, string) {
	t.Helper()
	ctx := context.Background()
	role := "offsets_" + strings.ReplaceAll(uniq("role"), "-", "_")
	_, err := admin.Exec(ctx, `CREATE ROLE `+role+` LOGIN`)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), `DROP OWNED BY `+role)
		_, _ = admin.Exec(context.Background(), `DROP ROLE `+role)
	})
	sch := pgx.Identifier{schema}.Sanitize()
	_, err = admin.Exec(ctx, `GRANT USAGE ON SCHEMA `+sch+` TO `+role+`;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA `+sch+` TO `+role)
	require.NoError(t, err)
	if revoke != "" {
		_, err = admin.Exec(ctx, `REVOKE `+revoke+` ON processed_events_offsets FROM `+role)
		require.NoError(t, err)
	}
	cfg := admin.Config()
	cfg.ConnConfig.User = role
	limited, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(limited.Close)
	return limited, role
}

// migratedSchema is a test schema with the store's tables and the
// effects table.
func migratedSchema(t *testing.T) (*pgxpool.Pool, string, *dedup.Store) {
	t.Helper()
	db, schema := pgtest.Schema(t)
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(context.Background(), db))
	_, err = db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)
	return db, schema, store
}

// A database role that may not update the offsets table passed the start
// (the table's shape was checked, not what the role may do with it) and
// then failed every take-over of its partitions inside the group
// session's Setup, at level Warn, while the session heartbeated: the
// consumer consumed nothing, for ever. Run now refuses to start, naming
// the table and the privilege.
func TestOffsetsInDatabaseRefusesARoleWithoutPrivileges(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	c.produce(mixedEvents(topic, 0, 2)...)
	db, schema, _ := migratedSchema(t)
	for _, revoke := range []string{"UPDATE", "SELECT, INSERT"} {
		t.Run(strings.ReplaceAll(revoke, ", ", "-"), func(t *testing.T) {
			limited, _ := limitedRole(t, db, schema, revoke)
			src := c.open(c.dbOffsetsConfig(uniq("g"), topic))
			cn, err := consumer.New(limited, src, recordEffect, consumerConfig("svc"))
			require.NoError(t, err)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			err = cn.Run(ctx)
			require.Error(t, err)
			require.NoError(t, ctx.Err(), "Run returned at once, not at its deadline: %v", err)
			t.Log(err)
			assert.Contains(t, err.Error(), "processed_events_offsets")
			for _, p := range strings.Split(revoke, ", ") {
				assert.Contains(t, err.Error(), p)
			}
			assert.Zero(t, cn.Stats().Received)
		})
	}
}

// A role that loses a privilege on the offsets table after the start
// fails every take-over: waiting does not grant it, so the failure is
// logged at level Error, not Warn. So is a table renamed or dropped under
// the running Source (42P01), which no wait brings back either. The
// take-over is still retried, and undoing the change lets the Source
// resume.
func TestOffsetsInDatabaseTakeOverRefusedIsAnError(t *testing.T) {
	for name, tc := range map[string]struct{ break_, repair, says string }{
		"privilege revoked": {`REVOKE UPDATE ON processed_events_offsets FROM {role}`, `GRANT UPDATE ON processed_events_offsets TO {role}`, "permission denied"},
		"table renamed": {`ALTER TABLE processed_events_offsets RENAME TO offsets_aside`,
			`ALTER TABLE offsets_aside RENAME TO processed_events_offsets`, "does not exist"},
	} {
		t.Run(name, func(t *testing.T) { takeOverRefused(t, tc.break_, tc.repair, tc.says) })
	}
}

func takeOverRefused(t *testing.T, breakSQL, repairSQL, says string) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	db, schema, store := migratedSchema(t)
	limited, role := limitedRole(t, db, schema, "")

	logs := &testlog.ErrorLog{}
	cfg := c.dbOffsetsConfig(uniq("g"), topic)
	cfg.Logger = slog.New(logs)
	src := c.open(cfg)
	ctx := context.Background()
	require.NoError(t, src.BindProgress(ctx, consumer.ProgressBinding{Consumer: "svc", Pool: limited, Store: store, Logger: testLogger()}))
	_, err := db.Exec(ctx, strings.ReplaceAll(breakSQL, "{role}", role))
	require.NoError(t, err)

	c.produce(msg(topic, 0, `{"n":1}`))
	got := make(chan *delivery, 1)
	go func() {
		rctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		defer cancel()
		if d, err := src.Receive(rctx); err == nil {
			got <- d.(*delivery)
		}
		close(got)
	}()
	require.Eventually(t, func() bool { return len(logs.Errors()) > 0 }, 20*time.Second, 10*time.Millisecond,
		"the refused take-over is logged at level Error")
	t.Log(logs.Errors()[0])
	assert.Contains(t, logs.Errors()[0], says)

	_, err = db.Exec(ctx, strings.ReplaceAll(repairSQL, "{role}", role))
	require.NoError(t, err)
	select {
	case d, ok := <-got:
		require.True(t, ok, "Receive failed")
		assert.Equal(t, int64(0), d.raw.Offset)
	case <-time.After(30 * time.Second):
		t.Fatal("the Source did not resume after the change was undone")
	}
}

// Two consumer groups consuming a topic under one consumer name share its
// offsets rows: each take-over fences the other group, which then stops
// consuming the partition until its next rebalance, and the two split the
// records between them. The fenced group logged a warning that looked like
// an ordinary rebalance; it now logs an error naming the other group and
// consumer.Config.Name.
func TestOffsetsInDatabaseTwoGroupsUnderOneNameAreAnError(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	db, _, _ := migratedSchema(t)
	c.produce(msg(topic, 0, `{"n":0}`))

	logs := &testlog.ErrorLog{}
	groupA, groupB := uniq("ga"), uniq("gb")
	cfgA := c.dbOffsetsConfig(groupA, topic)
	cfgA.Logger = slog.New(logs)
	srcA, err := Open(t.Context(), cfgA)
	require.NoError(t, err)
	a := startConsumer(t, db, srcA, consumerConfig("svc"), recordEffect)
	waitEffectsByN(t, db, 1)

	srcB, err := Open(t.Context(), c.dbOffsetsConfig(groupB, topic))
	require.NoError(t, err)
	b := startConsumer(t, db, srcB, consumerConfig("svc"), recordEffect)
	require.Eventually(t, func() bool {
		var g string
		err := db.QueryRow(context.Background(), `SELECT kafka_group FROM processed_events_offsets WHERE consumer = 'svc'`).Scan(&g)
		return err == nil && g == groupB
	}, 30*time.Second, 10*time.Millisecond, "B took the partition over")

	c.produce(msg(topic, 0, `{"n":1}`))
	require.Eventually(t, func() bool { return len(logs.Errors()) > 0 }, 30*time.Second, 10*time.Millisecond,
		"A, fenced by another group, logs an error")
	t.Log(logs.Errors()[0])
	assert.Contains(t, logs.Errors()[0], groupB)
	assert.Contains(t, logs.Errors()[0], "Config.Name")
	waitEffectsByN(t, db, 2)
	require.NoError(t, b.stop())
	require.NoError(t, a.stop())
	requireEachOnce(t, db, 2)
}

// A member fenced by another group under its consumer name leaves the
// partition until its own group's next rebalance. Its ConsumeClaim
// returned instead, which ends sarama's whole session: its group rejoined
// at once and took the partition back, fencing the other group in turn,
// so that the two took it from each other at about every commit (a
// rebalance and an Error log each). With no rebalance from outside, the
// partition is taken over once more (by the second group) and stays.
func TestOffsetsInDatabaseTwoGroupsUnderOneNameDoNotTakeThePartitionInTurn(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	db, _, _ := migratedSchema(t)
	c.produce(msg(topic, 0, `{"n":0}`))
	srcA, err := Open(t.Context(), c.dbOffsetsConfig(uniq("ga"), topic))
	require.NoError(t, err)
	a := startConsumer(t, db, srcA, consumerConfig("svc"), recordEffect)
	waitEffectsByN(t, db, 1)
	epochOf := func() (epoch int64, group string) {
		require.NoError(t, db.QueryRow(context.Background(),
			`SELECT epoch, kafka_group FROM processed_events_offsets WHERE consumer = 'svc'`).Scan(&epoch, &group))
		return epoch, group
	}
	before, _ := epochOf()

	groupB := uniq("gb")
	srcB, err := Open(t.Context(), c.dbOffsetsConfig(groupB, topic))
	require.NoError(t, err)
	b := startConsumer(t, db, srcB, consumerConfig("svc"), recordEffect)
	const n = 20
	for i := 1; i <= n; i++ {
		c.produce(msg(topic, 0, fmt.Sprintf(`{"n":%d}`, i)))
		waitEffectsByN(t, db, i+1)
	}
	after, group := epochOf()
	assert.Equal(t, before+1, after, "the partition was taken over %d times for %d records", after-before, n)
	assert.Equal(t, groupB, group)
	require.NoError(t, b.stop())
	require.NoError(t, a.stop())
	requireEachOnce(t, db, n+1)
}
