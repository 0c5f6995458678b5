package idempotency_test

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
	"github.com/onceco/once/internal/pgtest"
)

// signalWriter signals on writing when a write of at least min bytes
// begins.
type signalWriter struct {
	http.ResponseWriter
	min     int
	writing chan struct{}
}

func (w *signalWriter) Write(p []byte) (int, error) {
	if len(p) >= w.min {
		select {
		case w.writing <- struct{}{}:
		default:
		}
	}
	return w.ResponseWriter.Write(p)
}

// A replay is sent after the request's read-only transaction has ended:
// a client that reads a large stored response slowly (or not at all)
// held a pool connection, idle in transaction, for as long as the write
// to it took, and a few such clients took every connection from the
// requests behind them.
func TestSlowReaderOfAReplayHoldsNoConnection(t *testing.T) {
	const size = 16 << 20 // more than the sockets' buffers hold
	big := strings.Repeat("x", size)
	h := func(w http.ResponseWriter, r *http.Request) {
		if _, err := idempotency.Tx(r.Context()).Exec(r.Context(), `INSERT INTO effects (key, body) VALUES ($1, '')`, idempotency.Key(r.Context())); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if r.URL.Path == "/big" {
			_, _ = w.Write([]byte(big))
		}
	}
	s := newService(t, idempotency.Config{}, http.HandlerFunc(h))
	one := pgtest.NewPoolWith(t, s.schema, func(c *pgxpool.Config) { c.MaxConns = 1 })
	mw, err := idempotency.New(one, idempotency.Config{Scope: idempotency.SingleScope, Schema: s.schema, MaxResponseBytes: 2 * size})
	require.NoError(t, err)
	writing := make(chan struct{}, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mw.Handler(http.HandlerFunc(h)).ServeHTTP(&signalWriter{ResponseWriter: w, min: size, writing: writing}, r)
	}))
	t.Cleanup(srv.Close)
	s.url = srv.URL

	first := s.post("/big", "big", "b")
	require.Equal(t, http.StatusOK, first.status)
	require.Len(t, first.body, size)
	<-writing

	// A client that asks for the replay and reads none of it.
	conn, err := net.Dial("tcp", srv.Listener.Addr().String())
	require.NoError(t, err)
	defer conn.Close()
	_, err = fmt.Fprintf(conn, "POST /big HTTP/1.1\r\nHost: x\r\nIdempotency-Key: big\r\nContent-Length: 1\r\n\r\nb")
	require.NoError(t, err)
	<-writing // the replay is being written

	hurried := &http.Client{Timeout: 10 * time.Second}
	s.client = hurried
	r, err := s.tryPost("/small", "small", "b")
	require.NoError(t, err, "a request behind the slow reader got no connection")
	assert.Equal(t, http.StatusOK, r.status, r.body)

	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	require.NoError(t, err)
	assert.Equal(t, "true", resp.Header.Get(idempotency.ReplayedHeader))
	_ = resp.Body.Close()
}
