package oncetest_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/oncetest"
)

// docs/testing.md shows handler_example_test.go as it is, so the guide's
// code is the code the suite compiles and runs.
func TestTestingGuideShowsTheExample(t *testing.T) {
	guide, err := os.ReadFile("../docs/testing.md")
	require.NoError(t, err)
	code, err := os.ReadFile("handler_example_test.go")
	require.NoError(t, err)
	body := string(code)
	body = body[strings.Index(body, "type Payment"):]
	assert.Contains(t, string(guide), body, "docs/testing.md must show oncetest/handler_example_test.go from `type Payment` on")
	lines := strings.Count(strings.TrimSpace(body[strings.Index(body, "func TestPaymentIsRecordedOnce"):]), "\n") + 1
	assert.LessOrEqual(t, lines, 30, "the handler test fits in 30 lines")
}

// Drain returns once every message is settled, dead letters included, and
// the schema of one test is not another's.
func TestDrainSettlesEveryMessage(t *testing.T) {
	pool := oncetest.Postgres(t)
	other := oncetest.Postgres(t)
	_, err := pool.Exec(context.Background(), `CREATE TABLE seen (id text)`)
	require.NoError(t, err)
	_, err = other.Exec(context.Background(), `SELECT 1 FROM seen`)
	require.Error(t, err, "each call has a schema of its own")

	b := memsource.New(memsource.Options{Streams: 2})
	for _, id := range []string{"a", "b", "bad", "c"} {
		b.Publish(consumer.Message{ID: id, Value: []byte(`"` + id + `"`), Key: []byte(id)})
	}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[string]) error {
		if ev.Payload == "bad" {
			return consumer.Permanent(errors.New("bad"))
		}
		_, err := tx.Exec(ctx, `INSERT INTO seen VALUES ($1)`, ev.ID)
		return err
	}
	c, err := consumer.New(pool, b.Source(), h, consumer.Config{Name: "drain"})
	require.NoError(t, err)
	stats := oncetest.Drain(t, c, b)
	assert.Equal(t, uint64(3), stats.Handled)
	assert.Equal(t, uint64(1), stats.DeadLettered)
	oncetest.RequireEachOnce(t, pool, `SELECT id FROM seen`, "a", "b", "c")
}
