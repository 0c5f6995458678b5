package console_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

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
