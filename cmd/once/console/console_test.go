package console_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/console"
	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// deadLetters makes dead letters with a real consumer on kfake and fixes
// the service: fail-1 and fail-2 (handler), panic-1 (panic), bin-1
// (decode, a binary value); ok-1 is handled.
func deadLetters(t *testing.T) (*testenv.Service, *dlq.KafkaQueue) {
	k := testenv.NewKafka(t)
	topic := "orders" // the cluster is the test's own
	k.CreateTopic(topic, 1)
	k.CreateTopic(topic+".dlq", 1)
	pool, _ := pgtest.Schema(t)
	msg := func(id string, v []byte) *sarama.ProducerMessage {
		return &sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder("key-" + id), Value: sarama.ByteEncoder(v),
			Headers: []sarama.RecordHeader{{Key: []byte("id"), Value: []byte(id)}, {Key: []byte("type"), Value: []byte("payment.made")}}}
	}
	k.Produce(
		msg("ok-1", testenv.JSON(1, "ok")),
		msg("fail-1", testenv.JSON(2, "fail")),
		msg("panic-1", testenv.JSON(3, "panic")),
		msg("bin-1", []byte{0x00, 0x01, 0xfe, 0xff}),
		msg("fail-2", testenv.JSON(5, "fail")),
	)
	svc := testenv.StartService(t, pool, k.Source(testenv.Uniq("g"), topic), "billing")
	svc.WaitSettled(t, 5)
	require.EqualValues(t, 4, svc.C.Stats().DeadLettered)
	svc.Broken.Store(false)
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: topic + ".dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	return svc, q
}

// browser starts headless Chromium, closed when the test ends. Without a
// Chromium the test is skipped, or fails under ONCE_REQUIRE_SERVERS=1.
func browser(t *testing.T) context.Context {
	t.Helper()
	var path string
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			path = p
			break
		}
	}
	if path == "" {
		msg := "no Chromium found: install it with scripts/ensure-deps.sh chromium (Debian's chromium package)"
		if os.Getenv("ONCE_REQUIRE_SERVERS") == "1" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path), chromedp.NoSandbox, chromedp.DisableGPU, chromedp.WindowSize(1280, 800))
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(alloc)
	t.Cleanup(func() { cancel(); cancelAlloc() })
	require.NoError(t, chromedp.Do(ctx), "start Chromium")
	return ctx
}

// step runs actions with a bound.
func step(t *testing.T, ctx context.Context, actions ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	require.NoError(t, chromedp.Do(sctx, actions...))
}

func text(t *testing.T, ctx context.Context, css string) string {
	t.Helper()
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	s, err := chromedp.Run(sctx, chromedp.Text(chromedp.CSS(css)))
	require.NoError(t, err, css)
	return s
}

// waitURL waits until the page's location contains part.
func waitURL(t *testing.T, ctx context.Context, part string) {
	t.Helper()
	require.Eventually(t, func() bool {
		sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		loc, err := chromedp.Run(sctx, chromedp.Location())
		return err == nil && strings.Contains(loc, part)
	}, 30*time.Second, 20*time.Millisecond, "the page never went to %s", part)
}

// screenshot writes the page as name.png into $ONCE_SCREENSHOTS, when set
// (make screenshots).
func screenshot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	dir := os.Getenv("ONCE_SCREENSHOTS")
	if dir == "" {
		return
	}
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	png, err := chromedp.Run(sctx, chromedp.FullScreenshot(100))
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(dir, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, name+".png"), png, 0o644))
}

// countingQueue counts the replays the console asks of a queue: a replay
// publishes before the console answers, so a count still zero after a
// response shows that nothing was replayed, where the consumer's effects
// could only show it later.
type countingQueue struct {
	dlq.Queue
	replays atomic.Int32
}

func (q *countingQueue) Replay(ctx context.Context, f dlq.Filter, opts dlq.ReplayOptions) (dlq.Report, error) {
	q.replays.Add(1)
	return q.Queue.Replay(ctx, f, opts)
}

// In a real browser: the consumers page, the dead letters filtered by kind
// and by search, one record with its headers and payload, a replay with its
// confirmation, and the effect in the database once; replayed again, still
// once.
func TestConsoleInBrowser(t *testing.T) {
	ctx := browser(t)
	svc, dl := deadLetters(t)
	q := &countingQueue{Queue: dl}
	h, err := console.New(console.Config{DB: svc.Pool, Queues: []dlq.Queue{q}, AllowReplay: true, By: "browser-test", Logger: testenv.Logger()})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	step(t, ctx, chromedp.Navigate(srv.URL+"/"), chromedp.WaitVisible(chromedp.CSS("#consumers")))
	assert.Equal(t, "1", text(t, ctx, `tr[data-consumer="billing"] .processed`))
	summary := text(t, ctx, ".dlq-summary")
	for _, s := range []string{"handler", "panic", "decode"} {
		assert.Contains(t, summary, s)
	}
	assert.Equal(t, "replays allowed", text(t, ctx, "#mode"))
	screenshot(t, ctx, "console-overview")

	// The dead letters, filtered by kind through the form.
	step(t, ctx, chromedp.Click(chromedp.CSS("header a[href='dlq?q=0']")), chromedp.WaitVisible(chromedp.CSS("#records")))
	assert.Contains(t, text(t, ctx, "#count"), "records 1-4 of 4")
	step(t, ctx, chromedp.SetValue(chromedp.CSS("#kind"), "handler"), chromedp.Click(chromedp.CSS("#apply")))
	waitURL(t, ctx, "kind=handler")
	records := text(t, ctx, "#records")
	assert.Contains(t, records, "fail-1")
	assert.Contains(t, records, "fail-2")
	assert.NotContains(t, records, "panic-1")
	screenshot(t, ctx, "console-dead-letters")

	// Search by the error's text.
	step(t, ctx, chromedp.SetValue(chromedp.CSS("#kind"), ""), chromedp.SendKeys(chromedp.CSS("#search"), "event 2"),
		chromedp.Click(chromedp.CSS("#apply")))
	waitURL(t, ctx, "search=event")
	assert.Contains(t, text(t, ctx, "#count"), "records 1-1 of 1")

	// One record: the binary payload as a hex dump, then fail-1's.
	step(t, ctx, chromedp.Navigate(srv.URL+"/record?q=0&ref=0:2"), chromedp.WaitVisible(chromedp.CSS("#facts")))
	assert.Equal(t, "bin-1", text(t, ctx, "#event-id"))
	assert.Contains(t, text(t, ctx, "#payload"), "00 01 fe ff")
	step(t, ctx, chromedp.Navigate(srv.URL+"/dlq?q=0&search=event+2"), chromedp.WaitVisible(chromedp.CSS("#records")))
	step(t, ctx, chromedp.Click(chromedp.CSS(`tr[data-event-id="fail-1"] a`)), chromedp.WaitVisible(chromedp.CSS("#facts")))
	assert.Equal(t, "fail-1", text(t, ctx, "#event-id"))
	assert.Contains(t, text(t, ctx, "#reason"), "payment service rejected event 2")
	assert.Equal(t, `{"n":2,"mode":"fail"}`, text(t, ctx, "#payload"))
	headers := text(t, ctx, "#headers")
	assert.Contains(t, headers, "once-error-kind")
	assert.Contains(t, headers, "payment.made")
	screenshot(t, ctx, "console-record")

	// Replay it, confirm, and see the effect once.
	step(t, ctx, chromedp.Click(chromedp.CSS("#replay-one")), chromedp.WaitVisible(chromedp.CSS("#to-replay")))
	assert.Contains(t, text(t, ctx, "#to-replay"), "fail-1")
	assert.Zero(t, q.replays.Load(), "nothing is replayed before the confirmation")
	assert.Empty(t, svc.Effects(t)["fail-1"], "nothing happens before the confirmation")
	screenshot(t, ctx, "console-confirm")
	step(t, ctx, chromedp.Click(chromedp.CSS("#confirm")), chromedp.WaitVisible(chromedp.CSS("#result")))
	assert.Equal(t, "Replayed 1 of 1", text(t, ctx, "#result"))
	assert.Equal(t, int32(1), q.replays.Load(), "the confirmation replays")
	screenshot(t, ctx, "console-replayed")
	svc.WaitSettled(t, 6)
	assert.Equal(t, 1, svc.Effects(t)["fail-1"])
	step(t, ctx, chromedp.Navigate(srv.URL+"/"), chromedp.WaitVisible(chromedp.CSS("#consumers")))
	assert.Equal(t, "2", text(t, ctx, `tr[data-consumer="billing"] .processed`), "the effect appears on the consumers page")

	// A selection: every handler dead letter, fail-1 among them again.
	step(t, ctx, chromedp.Navigate(srv.URL+"/dlq?q=0&kind=handler"), chromedp.WaitVisible(chromedp.CSS("#records")))
	step(t, ctx,
		chromedp.Click(chromedp.CSS(`tr[data-event-id="fail-1"] input[type=checkbox]`)),
		chromedp.Click(chromedp.CSS(`tr[data-event-id="fail-2"] input[type=checkbox]`)),
		chromedp.Click(chromedp.CSS("#replay-selected")), chromedp.WaitVisible(chromedp.CSS("#to-replay")))
	step(t, ctx, chromedp.Click(chromedp.CSS("#confirm")), chromedp.WaitVisible(chromedp.CSS("#result")))
	assert.Equal(t, "Replayed 2 of 2", text(t, ctx, "#result"))
	svc.WaitSettled(t, 8)
	effects := svc.Effects(t)
	assert.Equal(t, 1, effects["fail-1"], "replayed twice, one effect")
	assert.Equal(t, 1, effects["fail-2"])
	assert.Len(t, effects, 3, "%v", effects)
}

// Read-only, the console shows no replay control and refuses a replay; with
// replays allowed it still refuses a cross-origin one. Mounted under a
// prefix its links stay under it.
func TestConsoleReadOnlyAndCrossOrigin(t *testing.T) {
	svc, dl := deadLetters(t)
	q := &countingQueue{Queue: dl}
	ro, err := console.New(console.Config{DB: svc.Pool, Queues: []dlq.Queue{q}, Logger: testenv.Logger()})
	require.NoError(t, err)
	mux := http.NewServeMux()
	mux.Handle("/ops/", http.StripPrefix("/ops", ro))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	body := get(t, srv.URL+"/ops/dlq?q=0")
	assert.Contains(t, body, "read-only")
	assert.Contains(t, body, `href="record?q=0&amp;ref=0%3a0&amp;back=dlq%3fq%3d0"`, "relative links work under a prefix")
	assert.NotContains(t, body, `type="checkbox" name="ref"`, "no record can be ticked for a replay")
	assert.NotContains(t, body, "replay-selected")
	assert.Contains(t, get(t, srv.URL+"/ops/record?q=0&ref=0%3a0"), "fail-1")
	resp, err := http.PostForm(srv.URL+"/ops/replay", url.Values{"q": {"0"}, "ref": {"0:0"}, "confirm": {"yes"}})
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusForbidden, resp.StatusCode)

	rw, err := console.New(console.Config{DB: svc.Pool, Queues: []dlq.Queue{q}, AllowReplay: true, Logger: testenv.Logger()})
	require.NoError(t, err)
	srv2 := httptest.NewServer(rw)
	t.Cleanup(srv2.Close)
	req, err := http.NewRequest(http.MethodPost, srv2.URL+"/replay", strings.NewReader("q=0&ref=0:0&confirm=yes"))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Sec-Fetch-Site", "cross-site")
	resp, err = http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusForbidden, resp.StatusCode)
	assert.Zero(t, q.replays.Load(), "nothing was replayed: not read-only, not cross-origin")
	assert.Equal(t, uint64(5), svc.C.Stats().Received, "nothing was replayed")

	assert.Equal(t, http.StatusNotFound, status(t, srv2.URL+"/record?q=0&ref=9:9"))
	assert.Equal(t, http.StatusNotFound, status(t, srv2.URL+"/dlq?q=7"))
	_, err = console.New(console.Config{})
	require.Error(t, err)
}

func get(t *testing.T, u string) string {
	t.Helper()
	resp, err := http.Get(u)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(b)
}

func status(t *testing.T, u string) int {
	t.Helper()
	resp, err := http.Get(u)
	require.NoError(t, err)
	resp.Body.Close()
	return resp.StatusCode
}
