package console_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/console"
	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
)

// serve answers one GET of path and returns the status and the body.
func serve(t *testing.T, h http.Handler, path string) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	return rec.Code, rec.Body.String()
}

// A dead-letter destination the console could not read is not shown as
// an empty one: the consumers page says why it could not be read, and
// neither a count of 0 nor "Empty.".
func TestOverviewDoesNotShowAnUnreadableQueueAsEmpty(t *testing.T) {
	k := testenv.NewKafka(t)
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "never.created.dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	h, err := console.New(console.Config{Queues: []dlq.Queue{q}, Logger: testenv.Logger()})
	require.NoError(t, err)

	code, body := serve(t, h, "/")
	assert.Equal(t, http.StatusOK, code)
	assert.Contains(t, body, "never.created.dlq")
	assert.Contains(t, body, "could not be read")
	assert.False(t, strings.Contains(body, "Empty."), "an unreadable queue is shown as an empty one")
	assert.False(t, strings.Contains(body, "never.created.dlq</a>: 0"), "an unreadable queue is shown with a count of 0")
}

// With the database down, the consumers page still shows the dead
// letters it could read, and says the consumers could not be read, rather
// than being an error page.
func TestOverviewWithTheDatabaseDownShowsTheDeadLetters(t *testing.T) {
	_, dl := deadLetters(t)
	pool, err := pgxpool.New(context.Background(), "postgres://once@127.0.0.1:1/once?connect_timeout=1")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	h, err := console.New(console.Config{DB: pool, Queues: []dlq.Queue{dl}, Logger: testenv.Logger()})
	require.NoError(t, err)

	code, body := serve(t, h, "/")
	require.Equal(t, http.StatusOK, code, "the consumers page is an error page")
	assert.Contains(t, body, "The consumers could not be read")
	assert.Contains(t, body, "kafka topic orders.dlq</a>: 4", "the dead letters are shown")
	assert.Contains(t, body, "handler")
}
