package idempotency_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
	"github.com/onceco/once/internal/pgtest"
)

// placeOrder is the benchmark's handler body: one insert in tx, answered
// with 201 and the row's id.
func placeOrder(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
	body, _ := io.ReadAll(r.Body)
	var id int64
	if err := tx.QueryRow(r.Context(), `INSERT INTO effects (key, body) VALUES ($1, $2) RETURNING id`,
		r.Header.Get(idempotency.DefaultHeader), string(body)).Scan(&id); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_, _ = fmt.Fprintf(w, `{"id":%d}`, id)
}

// BenchmarkHTTP compares requests per second over real HTTP, 10% of them
// retries of an earlier request, for the same handler in a transaction of
// its own ("plain": a retry runs it again) and behind the middleware
// ("idempotency": a retry is a replay). Set ONCE_PG_DURABLE=1 for a
// production-like fsync.
//
//	ONCE_PG_DURABLE=1 go test -run '^$' -bench HTTP -benchtime 5s ./idempotency/
func BenchmarkHTTP(b *testing.B) {
	b.Run("plain", func(b *testing.B) {
		pool := benchPool(b)
		benchRequests(b, pool, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			tx, err := pool.Begin(r.Context())
			if err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			defer tx.Rollback(context.WithoutCancel(r.Context())) //nolint:errcheck // a no-op after Commit
			rec := httptest.NewRecorder()                         // commit before answering, as the middleware does
			placeOrder(rec, r, tx)
			if err := tx.Commit(r.Context()); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			for k, v := range rec.Header() {
				w.Header()[k] = v
			}
			w.WriteHeader(rec.Code)
			_, _ = w.Write(rec.Body.Bytes())
		}))
	})
	b.Run("idempotency", func(b *testing.B) {
		pool := benchPool(b)
		mw, err := idempotency.New(pool, idempotency.Config{Scope: idempotency.SingleScope})
		require.NoError(b, err)
		benchRequests(b, pool, mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			placeOrder(w, r, idempotency.Tx(r.Context()))
		})))
	})
}

func benchPool(b *testing.B) *pgxpool.Pool {
	pool, schema := pgtest.Schema(b)
	ctx := context.Background()
	require.NoError(b, idempotency.Migrate(ctx, pool, ""))
	_, err := pool.Exec(ctx, `CREATE TABLE effects (id bigserial PRIMARY KEY, key text NOT NULL, body text NOT NULL)`)
	require.NoError(b, err)
	return pgtest.NewPoolWith(b, schema, func(c *pgxpool.Config) { c.MaxConns = 16 })
}

// benchRequests sends b.N requests from parallel clients; every tenth
// repeats the key of the request before it.
func benchRequests(b *testing.B, pool *pgxpool.Pool, h http.Handler) {
	srv := httptest.NewServer(h)
	defer srv.Close()
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}
	var seq atomic.Int64
	b.SetParallelism(4)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			n := seq.Add(1)
			if n%10 == 0 {
				n-- // a retry
			}
			key := fmt.Sprintf("order-%d", n)
			req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"item":"`+key+`"}`))
			req.Header.Set(idempotency.DefaultHeader, key)
			resp, err := c.Do(req)
			if err != nil {
				b.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode != http.StatusCreated && resp.StatusCode != http.StatusConflict {
				b.Errorf("status %d", resp.StatusCode)
				return
			}
		}
	})
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
	var effects int64
	require.NoError(b, pool.QueryRow(context.Background(), `SELECT count(*) FROM effects`).Scan(&effects))
	b.ReportMetric(float64(effects)/float64(b.N), "effects/req")
}
