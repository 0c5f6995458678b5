package console_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/console"
	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
)

// injection is markup and script in every shape a page could let through:
// a tag, an attribute breaker, an event handler, a closing tag of a text
// element, a script-ish string and a javascript: URL. Rendered as markup,
// it leaves a <b id="injected"> in the page, or runs and sets
// window.__owned, or opens a dialog.
const injection = `"'><b id="injected">x</b><script>window.__owned=1</script>` +
	`<img src=x onerror="window.__owned=1;alert(1)"></textarea></pre>'-alert(1)-'javascript:alert(1)`

// injectingQueue puts the injection into everything of its records that a
// page shows: the queue's name, the key, the payload (text, and JSON whose
// strings hold it), the headers the pages summarize (event id, type,
// consumer, error kind, message and stack) and a header whose name is
// the injection.
type injectingQueue struct{ dlq.Queue }

func (q injectingQueue) Name() string { return "kafka topic " + injection }

func (q injectingQueue) Browse(ctx context.Context, fn func(*dlq.Record) error) error {
	return q.Queue.Browse(ctx, func(r *dlq.Record) error {
		r.Key = []byte(injection)
		if r.Offset%2 == 0 {
			r.Value = []byte(injection)
		} else {
			r.Value = []byte(`{"note":` + jsonString(injection) + `}`)
		}
		for i, h := range r.Headers {
			switch h.Key {
			case consumer.HeaderEventID, consumer.HeaderEventType, consumer.HeaderConsumer, consumer.HeaderErrorKind,
				consumer.HeaderErrorMessage, consumer.HeaderErrorStack:
				r.Headers[i].Value = h.Value + injection
			}
		}
		r.Headers = append(r.Headers, dlq.Header{Key: injection, Value: injection})
		return fn(r)
	})
}

func jsonString(s string) string {
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(s) + `"`
}

// No page of the console renders text from a dead letter, the database or
// the query string as markup: with the injection in every field (the
// queue's name, keys, payloads, headers' names and values, the consumer's
// name in processed_events, the query parameters), no element of it
// appears in any page, no script runs and no dialog opens, in Chromium,
// and the text is shown as it is. Each page also carries the console's
// Content-Security-Policy (no script at all) and nosniff. (The pages were
// audited by reading; this proves it in a browser.)
func TestInjectedTextIsShownNeverRun(t *testing.T) {
	ctx := browser(t)
	var dialogs atomic.Int32
	require.NoError(t, chromedp.Listen(ctx, func(ev any) {
		if _, ok := ev.(*page.EventJavascriptDialogOpening); ok {
			dialogs.Add(1)
			// Dismissed from another goroutine, as Listen requires, so
			// that the page goes on.
			go func() {
				_ = chromedp.Do(ctx, chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
					_, err := cdp.Call(ctx, t, page.HandleJavaScriptDialog, page.HandleJavaScriptDialogParams{})
					return err
				}))
			}()
		}
	}))
	svc, dl := deadLetters(t)
	_, err := svc.Pool.Exec(context.Background(), `INSERT INTO processed_events (consumer, event_id) VALUES ($1, 'e')`, injection)
	require.NoError(t, err)
	h, err := console.New(console.Config{DB: svc.Pool, Queues: []dlq.Queue{injectingQueue{dl}}, AllowReplay: true, By: "inject-test", Logger: testenv.Logger()})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	// The check sees the injection when a page renders it raw, as no
	// page of the console may.
	raw := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		_, _ = w.Write([]byte("<!doctype html><html><body><p>" + injection + "</p></body></html>"))
	}))
	t.Cleanup(raw.Close)
	step(t, ctx, chromedp.Navigate(raw.URL), chromedp.WaitReady(chromedp.CSS("body")))
	require.Eventually(t, func() bool { return dialogs.Load() > 0 }, 10*time.Second, 10*time.Millisecond, "the raw page's alert was not seen")
	require.Equal(t, "element script or handler ran ", rendered(t, ctx, "the raw page"), "the check does not see a rendered injection")
	dialogs.Store(0)

	clean := func(where string) {
		t.Helper()
		assert.Empty(t, rendered(t, ctx, where), "the injection was rendered as markup on %s", where)
		assert.Zero(t, dialogs.Load(), "a dialog opened on %s", where)
	}
	visit := func(path, css string) {
		t.Helper()
		step(t, ctx, chromedp.Navigate(srv.URL+path), chromedp.WaitVisible(chromedp.CSS(css)))
		clean(path)
		resp, err := http.Get(srv.URL + path)
		require.NoError(t, err)
		_ = resp.Body.Close()
		assert.Contains(t, resp.Header.Get("Content-Security-Policy"), "default-src 'none'", path)
		assert.Equal(t, "nosniff", resp.Header.Get("X-Content-Type-Options"), path)
		assert.Equal(t, "text/html; charset=utf-8", resp.Header.Get("Content-Type"), path)
	}

	visit("/", "#consumers")
	assert.Contains(t, text(t, ctx, "#consumers"), `<b id="injected">`, "the consumer's name shown as text")
	visit("/dlq?q=0", "#records")
	assert.Contains(t, text(t, ctx, "#records"), "<script>window.__owned=1</script>", "the event ids shown as text")
	for _, ref := range []string{"0:0", "0:1"} {
		visit("/record?q=0&ref="+ref, "#facts")
		assert.Contains(t, text(t, ctx, "#event-id"), `<b id="injected">`)
		assert.Contains(t, text(t, ctx, "#reason"), `onerror="window.__owned=1;alert(1)"`)
		assert.Contains(t, text(t, ctx, "#payload"), "</textarea></pre>")
		assert.Contains(t, text(t, ctx, "#headers"), "javascript:alert(1)")
	}
	// The confirmation of a replay shows the records it would replay.
	step(t, ctx, chromedp.Click(chromedp.CSS("#replay-one")), chromedp.WaitVisible(chromedp.CSS("#to-replay")))
	clean("the replay's confirmation")
	assert.Contains(t, text(t, ctx, "#to-replay"), `<b id="injected">`)

	// The query string, echoed into forms, links and error pages.
	inj := url.QueryEscape(injection)
	visit("/dlq?q=0&search="+inj+"&kind="+inj, "body")
	visit("/record?q=0&ref="+inj, "body")
	visit("/dlq?q="+inj, "body")
	visit("/record?q=0&ref=0:0&back="+inj, "#facts")
}

// rendered reports what of the injection the page in ctx rendered as
// markup: "element ", "script or handler ", "ran ", or "" for none.
func rendered(t *testing.T, ctx context.Context, where string) string {
	t.Helper()
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	found, err := chromedp.Run(sctx, chromedp.Evaluate[string](`[
		document.getElementById('injected') ? 'element ' : '',
		document.querySelectorAll('script, img, [onerror]').length ? 'script or handler ' : '',
		typeof window.__owned !== 'undefined' ? 'ran ' : ''].join('')`))
	require.NoError(t, err, where)
	return found
}
