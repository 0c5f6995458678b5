package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/idempotency"
)

// WebOrder is the body of POST /orders: an order placed over HTTP. The
// service chooses the order's id, as most APIs do, so a retried request
// without protection would create a second order.
type WebOrder struct {
	Customer    string `json:"customer"`
	AmountCents int64  `json:"amount_cents"`
}

// PlaceOrder is the POST /orders handler, written to run behind the
// idempotency middleware: it creates the order in the request's
// transaction, in which the middleware claimed the Idempotency-Key and
// stores this response. It writes the same orders table as the consumer.
func (o *Orders) PlaceOrder(w http.ResponseWriter, r *http.Request) {
	var p WebOrder
	if err := json.NewDecoder(r.Body).Decode(&p); err != nil || p.Customer == "" || p.AmountCents <= 0 {
		// A 4xx is the answer to this request: stored and replayed.
		http.Error(w, "an order needs a customer and a positive amount_cents", http.StatusBadRequest)
		return
	}
	ctx := r.Context()
	var id string
	err := idempotency.Tx(ctx).QueryRow(ctx, `INSERT INTO orders (id, customer, amount_cents, status, created_event)
		VALUES ('web-' || gen_random_uuid(), $1, $2, 'created', $3) RETURNING id`,
		p.Customer, p.AmountCents, "http:"+idempotency.Key(ctx)).Scan(&id)
	if err != nil {
		// A 5xx is rolled back and not stored: the client's retry runs again.
		http.Error(w, "the order could not be placed; retry with the same Idempotency-Key", http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/orders/"+id)
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(map[string]string{"order_id": id})
}

// webHandler is the service's HTTP API: POST /orders behind the
// idempotency middleware, keys scoped per customer (the basic-auth user
// stands in for real authentication). It creates the idempotency_keys
// table next to processed_events.
func webHandler(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) (http.Handler, error) {
	if err := idempotency.Migrate(ctx, pool, ""); err != nil {
		return nil, err
	}
	mw, err := idempotency.New(pool, idempotency.Config{
		Scope: func(r *http.Request) string { user, _, _ := r.BasicAuth(); return user },
		// Concurrent copies of a request wait for the first and get its
		// answer, rather than a 409 to retry.
		Wait:   2 * time.Second,
		Logger: log,
	})
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw.Handler(http.HandlerFunc((&Orders{}).PlaceOrder)))
	return mux, nil
}

// serveWeb serves webHandler on addr until ctx ends; it returns the
// address it listens on.
func serveWeb(ctx context.Context, addr string, pool *pgxpool.Pool, log *slog.Logger) (string, error) {
	h, err := webHandler(ctx, pool, log)
	if err != nil {
		return "", err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return "", err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	return ln.Addr().String(), nil
}

// startWeb serves the HTTP API on o.httpAddr, if set, until ctx ends.
func startWeb(ctx context.Context, o *options, pool *pgxpool.Pool, log *slog.Logger, stdout io.Writer) error {
	if o.httpAddr == "" {
		return nil
	}
	addr, err := serveWeb(ctx, o.httpAddr, pool, log)
	if err != nil {
		return fmt.Errorf("http: %w", err)
	}
	fmt.Fprintf(stdout, "http: POST http://%s/orders with an Idempotency-Key header, basic-auth user as the customer\n", addr)
	return nil
}

// webRun is what the demo's HTTP clients did and got.
type webRun struct {
	keys, requests, created, replayed, refused, inFlight int
	unavailable, failed                                  int // 5xx (retried), anything else
	// wrong counts the sends whose last answer is not the one they must
	// get: 201 for a copy or a retry, 422 for a reuse, none at all after
	// the retries.
	wrong              int
	orderRows, keyRows int
	splitKeys          int // keys answered with more than one order id
	elapsed            time.Duration
}

// webKey is one order a client places: one key, sent by concurrent copies,
// perhaps retried later, perhaps reused (wrongly) for another order.
type webKey struct {
	key      string
	order    WebOrder
	copies   int
	retry    bool
	reuse    bool
	mu       sync.Mutex
	orderIDs map[string]bool
}

// placeWebOrders places orders through the HTTP API with the retries and
// duplicates real clients produce, checks that each key made one order,
// and adds those orders to what the plan expects in the orders table.
func placeWebOrders(ctx context.Context, o *options, pool *pgxpool.Pool, plan *Plan, log *slog.Logger) (*webRun, error) {
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	addr, err := serveWeb(sctx, "127.0.0.1:0", pool, log)
	if err != nil {
		return nil, err
	}
	keys := webTraffic(o.mix.Seed, max(20, o.mix.Orders/15))
	run := sendWebTraffic(ctx, "http://"+addr+"/orders", keys)
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	for _, k := range keys {
		for id := range k.orderIDs {
			plan.Orders[id] = expectedOrder{Status: "created", AmountCents: k.order.AmountCents}
		}
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM orders WHERE id LIKE 'web-%'`).Scan(&run.orderRows); err != nil {
		return nil, err
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys`).Scan(&run.keyRows); err != nil {
		return nil, err
	}
	return run, nil
}

// sendWebTraffic places the orders of keys at url, eight keys at a time,
// and counts the answers.
func sendWebTraffic(ctx context.Context, url string, keys []*webKey) *webRun {
	run := &webRun{keys: len(keys)}
	var mu sync.Mutex
	tally := func(status int, replayed bool) {
		mu.Lock()
		defer mu.Unlock()
		run.requests++
		switch {
		case status == http.StatusCreated && replayed:
			run.replayed++
		case status == http.StatusCreated:
			run.created++
		case status == http.StatusUnprocessableEntity:
			run.refused++
		case status == http.StatusConflict:
			run.inFlight++
		case status >= 500:
			run.unavailable++
		default:
			run.failed++
		}
	}
	start := time.Now()
	client := &http.Client{Timeout: 30 * time.Second}
	work := make(chan *webKey)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for k := range work {
				wrong := k.place(ctx, client, url, tally)
				mu.Lock()
				run.wrong += wrong
				mu.Unlock()
			}
		})
	}
	for _, k := range keys {
		work <- k
	}
	close(work)
	wg.Wait()
	run.elapsed = time.Since(start)
	for _, k := range keys {
		if len(k.orderIDs) != 1 {
			run.splitKeys++
		}
	}
	return run
}

// webTraffic generates n keys: each sent by 1 to 3 concurrent copies (a
// client retrying on its own timeout, a double click), a fifth retried
// after the first answer (a lost response), one in twenty-five reused for
// another amount (a client bug, refused with 422).
func webTraffic(seed int64, n int) []*webKey {
	rng := rand.New(rand.NewPCG(uint64(seed), 20))
	keys := make([]*webKey, n)
	for i := range keys {
		keys[i] = &webKey{
			key:      fmt.Sprintf("web-%d-%d", seed, i),
			order:    WebOrder{Customer: fmt.Sprintf("c%03d", i%40), AmountCents: 100 + rng.Int64N(100000)},
			copies:   1 + rng.IntN(3),
			retry:    rng.IntN(5) == 0,
			reuse:    rng.IntN(25) == 0,
			orderIDs: map[string]bool{},
		}
	}
	return keys
}

// place sends k's copies at once, then its retry and its reuse, and
// returns how many of them did not end with the answer they must get.
func (k *webKey) place(ctx context.Context, c *http.Client, url string, tally func(int, bool)) (wrong int) {
	var mu sync.Mutex
	expect := func(status, want int) {
		if status != want {
			mu.Lock()
			wrong++
			mu.Unlock()
		}
	}
	var wg sync.WaitGroup
	for range k.copies {
		wg.Go(func() { expect(k.send(ctx, c, url, k.order, tally), http.StatusCreated) })
	}
	wg.Wait()
	if k.retry {
		expect(k.send(ctx, c, url, k.order, tally), http.StatusCreated)
	}
	if k.reuse {
		other := k.order
		other.AmountCents++
		expect(k.send(ctx, c, url, other, tally), http.StatusUnprocessableEntity)
	}
	return wrong
}

// send posts order under k's key, as a client would: again after a 409 or
// a 5xx (the key makes that safe), up to 10 times. It returns the final
// answer's status, 0 when there was none.
func (k *webKey) send(ctx context.Context, c *http.Client, url string, order WebOrder, tally func(int, bool)) int {
	body, _ := json.Marshal(order)
	for attempt := 1; attempt <= 10 && ctx.Err() == nil; attempt++ {
		status, replayed, id, err := k.post(ctx, c, url, body, order.Customer)
		if err == nil {
			tally(status, replayed)
		}
		if err == nil && status < 500 && status != http.StatusConflict {
			if status == http.StatusCreated {
				k.mu.Lock()
				k.orderIDs[id] = true
				k.mu.Unlock()
			}
			return status
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(attempt) * 20 * time.Millisecond):
		}
	}
	return 0
}

func (k *webKey) post(ctx context.Context, c *http.Client, url string, body []byte, customer string) (int, bool, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(string(body)))
	if err != nil {
		return 0, false, "", err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(idempotency.DefaultHeader, k.key)
	req.SetBasicAuth(customer, "demo")
	resp, err := c.Do(req)
	if err != nil {
		return 0, false, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, false, "", err
	}
	var created struct {
		OrderID string `json:"order_id"`
	}
	if resp.StatusCode == http.StatusCreated {
		if err := json.Unmarshal(b, &created); err != nil || created.OrderID == "" {
			return 0, false, "", errors.New("a 201 without an order id")
		}
	}
	return resp.StatusCode, resp.Header.Get(idempotency.ReplayedHeader) == "true", created.OrderID, nil
}

// ok reports whether every key made exactly one order, every copy and
// retry was answered with it, and every reuse was refused.
func (r *webRun) ok() bool {
	return r == nil || r.splitKeys == 0 && r.created == r.keys && r.orderRows == r.keys && r.keyRows == r.keys && r.failed == 0 &&
		r.wrong == 0
}

// print writes the report's lines on the HTTP orders.
func (r *webRun) print(w io.Writer) {
	if r == nil {
		return
	}
	fmt.Fprintf(w, "http orders       %6d  keys sent to POST /orders in %s: %d requests, %d created, %d replayed (concurrent copies, retries), %d refused (422: a key reused for another order), %d in flight (409)\n",
		r.keys, r.elapsed.Round(time.Millisecond), r.requests, r.created, r.replayed, r.refused, r.inFlight)
	if r.unavailable+r.failed > 0 {
		fmt.Fprintf(w, "  http errors     %6d  5xx answers (retried with the same key), %d other answers (want 0)\n", r.unavailable, r.failed)
	}
	if r.wrong > 0 {
		fmt.Fprintf(w, "  wrong answers   %6d  copies or retries not answered with their order, reuses not refused, or no answer after 10 tries (want 0)\n", r.wrong)
	}
	fmt.Fprintf(w, "  web orders      %6d  in the orders table (want %d: one per key; %d keys answered with two orders, want 0)\n",
		r.orderRows, r.keys, r.splitKeys)
}
