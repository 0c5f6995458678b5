package bench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/idempotency"
)

// HTTP rows: the same command handler (one INSERT, 201 with the row's id)
// over real HTTP, every tenth request of a client a retry of its previous
// one, in a transaction of its own ("plain": a retry runs again) and behind
// the idempotency middleware (a retry is a replay).
const (
	HTTPPlain       Row = "http plain"
	HTTPIdempotency Row = "http idempotency"
)

// httpClients is the number of concurrent HTTP clients.
const httpClients = 16

// HTTPResult is one HTTP row.
type HTTPResult struct {
	Row      Row     `json:"row"`
	Requests int     `json:"requests"`
	Seconds  float64 `json:"seconds"`
	Rate     float64 `json:"requests_per_s"`
	P50Ms    float64 `json:"p50_ms"`
	P99Ms    float64 `json:"p99_ms"`
	// Effects are the business rows written, Keys the distinct keys sent.
	Effects int  `json:"effects"`
	Keys    int  `json:"keys"`
	Correct bool `json:"correct"`
	// sent is each client's number of requests: with the rule of
	// sendHTTP, the keys sent and how often each.
	sent []int
}

// HTTPReport holds the HTTP rows of a run.
type HTTPReport struct {
	Clients int          `json:"clients"`
	Rows    []HTTPResult `json:"rows"`
}

// runHTTP runs both HTTP rows with o.HTTPRequests requests each.
func runHTTP(ctx context.Context, db *pgxpool.Pool, o Options) (*HTTPReport, error) {
	rep := &HTTPReport{Clients: httpClients}
	for _, row := range []Row{HTTPPlain, HTTPIdempotency} {
		res, err := runHTTPRow(ctx, db, o, row)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", row, err)
		}
		o.logf("  %-28s %9.0f req/s  p50/p99 %.1f/%.1f ms  effects %d for %d keys", row, res.Rate, res.P50Ms, res.P99Ms, res.Effects, res.Keys)
		rep.Rows = append(rep.Rows, *res)
	}
	return rep, nil
}

func runHTTPRow(ctx context.Context, db *pgxpool.Pool, o Options, row Row) (*HTTPResult, error) {
	schema := schemaName("http", row)
	if err := createSchema(ctx, db, schema); err != nil {
		return nil, err
	}
	defer dropSchema(db, schema)
	cfg, err := pgxpool.ParseConfig(o.DatabaseURL)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = httpClients
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	h, err := httpHandler(ctx, pool, schema, row)
	if err != nil {
		return nil, err
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	res, err := sendHTTP(ctx, srv.URL, o.HTTPRequests)
	if err != nil {
		return nil, err
	}
	res.Row = row
	if err := checkHTTP(ctx, db, schema, res); err != nil {
		return nil, err
	}
	return res, nil
}

// checkHTTP counts the business rows an HTTP row left in schema and sets
// res.Effects and res.Correct: plain runs every retry again, so each key
// has a row per request sent with it; the middleware one per key.
func checkHTTP(ctx context.Context, db *pgxpool.Pool, schema string, res *HTTPResult) error {
	keys, want := httpKeys(res.sent)
	if res.Row == HTTPIdempotency {
		for i := range want {
			want[i] = 1
		}
	}
	e := pgx.Identifier{schema, "effects"}.Sanitize()
	var wrong int
	if err := db.QueryRow(ctx, `WITH want (key, n) AS (SELECT * FROM unnest($1::text[], $2::bigint[])),
got AS (SELECT event_id AS key, count(*) AS n FROM `+e+` GROUP BY event_id)
SELECT (SELECT count(*) FROM `+e+`),
  (SELECT count(*) FROM want FULL JOIN got USING (key) WHERE want.n IS DISTINCT FROM got.n)`, keys, want).
		Scan(&res.Effects, &wrong); err != nil {
		return err
	}
	total := res.Requests
	if res.Row == HTTPIdempotency {
		total = res.Keys
	}
	res.Correct = res.Effects == total && wrong == 0 && len(keys) == res.Keys
	return nil
}

// httpKeys returns the keys sendHTTP sent, given each client's number of
// requests, and how many requests carried each: a client's request i
// has a key of its own, c<client>-<i>, but every tenth repeats the one
// before.
func httpKeys(sent []int) (keys []string, requests []int64) {
	for client, n := range sent {
		for i := range n {
			if i%10 == 9 {
				requests[len(requests)-1]++
				continue
			}
			keys, requests = append(keys, fmt.Sprintf("c%d-%d", client, i)), append(requests, 1)
		}
	}
	return keys, requests
}

// httpHandler is the row's handler: placeOrder in a transaction of its
// own, or behind the middleware.
func httpHandler(ctx context.Context, pool *pgxpool.Pool, schema string, row Row) (http.Handler, error) {
	if row == HTTPIdempotency {
		if err := idempotency.Migrate(ctx, pool, schema); err != nil {
			return nil, err
		}
		mw, err := idempotency.New(pool, idempotency.Config{Scope: idempotency.SingleScope, Schema: schema})
		if err != nil {
			return nil, err
		}
		return mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			placeOrder(w, r, idempotency.Tx(r.Context()))
		})), nil
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		err := pgx.BeginFunc(r.Context(), pool, func(tx pgx.Tx) error {
			placeOrder(w, r, tx)
			return nil
		})
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
		}
	}), nil
}

// placeOrder writes one business row and answers 201 with its number.
func placeOrder(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	key := r.Header.Get(idempotency.DefaultHeader)
	if _, err := tx.Exec(r.Context(), `INSERT INTO effects (event_id, n, account, amount) VALUES ($1, 0, 'acct', $2)`,
		key, len(body)); err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_, _ = fmt.Fprintf(w, `{"order":%q}`, key)
}

// sendHTTP sends n requests from httpClients clients; every tenth request
// of a client repeats its previous one (same key and body).
func sendHTTP(ctx context.Context, url string, n int) (*HTTPResult, error) {
	tr := &http.Transport{MaxIdleConnsPerHost: httpClients}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: time.Minute}
	var (
		next    atomic.Int64
		keys    atomic.Int64
		mu      sync.Mutex
		lat     = make([]time.Duration, 0, n)
		firstEr error
		wg      sync.WaitGroup
		sent    = make([]int, httpClients)
	)
	start := time.Now()
	for client := range httpClients {
		wg.Go(func() {
			key := ""
			for i := 0; next.Add(1) <= int64(n) && ctx.Err() == nil; i++ {
				if i%10 != 9 || key == "" {
					key = fmt.Sprintf("c%d-%d", client, i)
					keys.Add(1)
				}
				t := time.Now()
				err := postOrder(ctx, c, url, key)
				d := time.Since(t)
				mu.Lock()
				sent[client]++
				lat = append(lat, d)
				if err != nil && firstEr == nil {
					firstEr = err
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if firstEr != nil {
		return nil, firstEr
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	slices.Sort(lat)
	return &HTTPResult{
		Requests: len(lat), Seconds: elapsed.Seconds(), Rate: float64(len(lat)) / elapsed.Seconds(),
		P50Ms: ms(percentile(lat, 0.50)), P99Ms: ms(percentile(lat, 0.99)), Keys: int(keys.Load()), sent: sent,
	}, nil
}

func postOrder(ctx context.Context, c *http.Client, url, key string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/orders", strings.NewReader(`{"item":"`+key+`"}`))
	if err != nil {
		return err
	}
	req.Header.Set(idempotency.DefaultHeader, key)
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	if resp.StatusCode != http.StatusCreated {
		return fmt.Errorf("status %d for key %s", resp.StatusCode, key)
	}
	return nil
}

// writeTable writes the HTTP rows, if any, as a Markdown table.
func (h *HTTPReport) writeTable(w io.Writer) error {
	if h == nil || len(h.Rows) == 0 {
		return nil
	}
	fmt.Fprintf(w, "\nHTTP commands: one INSERT per request, %d clients over HTTP, every tenth request a retry of the client's previous one\n\n", h.Clients)
	tw := tabwriter.NewWriter(w, 0, 0, 1, ' ', tabwriter.AlignRight|tabwriter.Debug)
	fmt.Fprintln(tw, "row\t requests\t req/s\t p50 ms\t p99 ms\t effects\t keys\t x plain\t correct\t")
	fmt.Fprintln(tw, "---\t ---\t ---\t ---\t ---\t ---\t ---\t ---\t ---\t")
	plain := h.Rows[0].Rate
	for _, x := range h.Rows {
		verdict := "yes"
		if !x.Correct {
			verdict = "NO"
		}
		fmt.Fprintf(tw, "%s\t %d\t %.0f\t %.1f\t %.1f\t %d\t %d\t %.2f\t %s\t\n",
			x.Row, x.Requests, x.Rate, x.P50Ms, x.P99Ms, x.Effects, x.Keys, x.Rate/plain, verdict)
	}
	return tw.Flush()
}

// Correct reports whether every HTTP row's effects were right.
func (h *HTTPReport) Correct() bool {
	for _, x := range h.allRows() {
		if !x.Correct {
			return false
		}
	}
	return true
}

func (h *HTTPReport) allRows() []HTTPResult {
	if h == nil {
		return nil
	}
	return h.Rows
}
