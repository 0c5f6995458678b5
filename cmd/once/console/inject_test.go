package console_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/cmd/once/console"
	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
)

// injection is markup and script in every shape a page could let through:
// a tag, an attribute breaker (both quotes), an event handler, closing
// tags of text elements, a script-ish string and a javascript: URL.
// Rendered as markup, it leaves a <b id="injected"> in the page, or runs
// and sets window.__owned, or opens a dialog.
const injection = `"'><b id="injected">x</b><script>window.__owned=1</script>` +
	`<img src=x onerror="window.__owned=1;alert(1)"></textarea></pre></title>'-alert(1)-'javascript:alert(1)`

// jsURL is a link target that runs script when followed; a page that put
// it into a link or a form's action as it is would run it on a click.
const jsURL = `javascript:window.__owned=1;alert(1)//`

// injectingQueue puts the injection into everything of its records that a
// page shows: the queue's name, the key, the payload (text, and JSON whose
// strings hold it), the headers the pages summarize (event id, type,
// consumer, error kind, message and stack, the original topic), a header
// whose name is the injection, the AMQP properties and the destination
// they give, a ref, and the reason a record cannot be replayed. Its
// replays are the queue's own, reported with the injection in each
// outcome, or, with replayFails, fail with it in the error.
type injectingQueue struct {
	dlq.Queue
	replayFails bool
}

func (q injectingQueue) Name() string { return "kafka topic " + injection }

func (q injectingQueue) Browse(ctx context.Context, fn func(*dlq.Record) error) error {
	return q.Queue.Browse(ctx, func(r *dlq.Record) error {
		inject(r)
		return fn(r)
	})
}

func (q injectingQueue) Replay(ctx context.Context, f dlq.Filter, opts dlq.ReplayOptions) (dlq.Report, error) {
	if q.replayFails {
		return dlq.Report{}, errors.New("the broker refused " + injection)
	}
	rep, err := q.Queue.Replay(ctx, f, opts)
	for i := range rep.Outcomes {
		o := &rep.Outcomes[i]
		ref := o.Record.Ref // which the console counts the outcomes by
		inject(o.Record)
		o.Record.Ref = ref
		o.Result += injection
		o.Reason += injection
		o.Destination += injection
	}
	return rep, err
}

// inject puts the injection into r, as injectingQueue describes. The
// records of deadLetters are, by offset: 0 fail-1, 1 panic-1, 2 bin-1,
// 3 fail-2.
func inject(r *dlq.Record) {
	r.Key = []byte(injection)
	if r.Offset%2 == 0 {
		r.Value = []byte(injection)
	} else {
		r.Value = []byte(`{"note":` + jsonString(injection) + `,"nested":{` + jsonString(injection) + `:[` + jsonString(jsURL) + `]}}`)
	}
	var kept []dlq.Header
	for _, h := range r.Headers {
		switch h.Key {
		case consumer.HeaderEventID, consumer.HeaderFallbackID:
			if r.Offset == 2 {
				// Without an id: not replayable, with a reason
				// that names the (injected) kind.
				continue
			}
			h.Value += injection
		case consumer.HeaderEventType, consumer.HeaderConsumer, consumer.HeaderErrorKind,
			consumer.HeaderErrorMessage, consumer.HeaderErrorStack, consumer.HeaderOriginalTopic:
			h.Value += injection
		}
		kept = append(kept, h)
	}
	r.Headers = append(kept, dlq.Header{Key: injection, Value: injection}, dlq.Header{Key: "link", Value: jsURL})
	if r.Offset == 3 {
		// As a RabbitMQ record, with a ref of the queue's own making.
		r.Ref = "3" + injection
		r.Properties = &dlq.Properties{MessageID: injection, Type: injection, ContentType: injection}
		r.Headers = append(r.Headers, dlq.Header{Key: amqp.HeaderOriginalExchange, Value: injection},
			dlq.Header{Key: amqp.HeaderOriginalRoutingKey, Value: injection})
	}
}

// unreadableQueue fails every read with the injection in its error.
type unreadableQueue struct{ dlq.Queue }

func (unreadableQueue) Name() string { return "rabbitmq queue " + injection }

func (unreadableQueue) Browse(context.Context, func(*dlq.Record) error) error {
	return errors.New("access refused " + injection)
}

func jsonString(s string) string {
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(s) + `"`
}

// withoutCSP serves a handler without its Content-Security-Policy: the
// browser then runs whatever markup a page lets through, so the test
// proves the pages' escaping, not the policy that would block a script.
func withoutCSP(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { h.ServeHTTP(cspDropper{w}, r) })
}

type cspDropper struct{ http.ResponseWriter }

func (w cspDropper) WriteHeader(code int) {
	w.Header().Del("Content-Security-Policy")
	w.ResponseWriter.WriteHeader(code)
}

func (w cspDropper) Write(b []byte) (int, error) {
	w.Header().Del("Content-Security-Policy")
	return w.ResponseWriter.Write(b)
}

// No page of the console renders text from a dead letter, a queue, the
// database or the request as markup: with the injection in every field
// (the queues' names, keys, payloads, headers' names and values, AMQP
// properties, refs, the consumer's name in processed_events, the errors of
// a queue that cannot be read and of a replay that fails, the query
// parameters and the way back of a listing), no element of it appears in
// any page (overview, listing, record, confirmation, result, error pages),
// no link leads to javascript:, no script runs and no dialog opens, in
// Chromium, even with the Content-Security-Policy taken off; and the text
// is shown as it is. Each page carries the console's policy (no script at
// all), nosniff and a charset.
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
	h, err := console.New(console.Config{DB: svc.Pool, AllowReplay: true, By: "inject-test", Logger: testenv.Logger(),
		Queues: []dlq.Queue{injectingQueue{Queue: dl}, injectingQueue{Queue: dl, replayFails: true}, unreadableQueue{dl}}})
	require.NoError(t, err)
	// srv is the console as it is, for its headers; the browser sees
	// bare, the console without its policy.
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	bare := httptest.NewServer(withoutCSP(h))
	t.Cleanup(bare.Close)

	// The check sees the injection when a page renders it raw, as no
	// page of the console may.
	raw := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		_, _ = w.Write([]byte("<!doctype html><html><body><p>" + injection + `<a href="` + jsURL + `">x</a></p></body></html>`))
	}))
	t.Cleanup(raw.Close)
	step(t, ctx, chromedp.Navigate(raw.URL), chromedp.WaitReady(chromedp.CSS("body")))
	require.Eventually(t, func() bool { return dialogs.Load() > 0 }, 10*time.Second, 10*time.Millisecond, "the raw page's alert was not seen")
	require.Equal(t, "element script or handler javascript link ran ", rendered(t, ctx, "the raw page"), "the check does not see a rendered injection")
	dialogs.Store(0)

	headers := func(where string, do func() (*http.Response, error)) {
		t.Helper()
		resp, err := do()
		require.NoError(t, err, where)
		_ = resp.Body.Close()
		assert.Contains(t, resp.Header.Get("Content-Security-Policy"), "default-src 'none'", where)
		assert.NotContains(t, resp.Header.Get("Content-Security-Policy"), "script-src", where)
		assert.Equal(t, "nosniff", resp.Header.Get("X-Content-Type-Options"), where)
		assert.Equal(t, "text/html; charset=utf-8", resp.Header.Get("Content-Type"), where)
	}
	// clean checks the page the browser shows, reached by where, and
	// that it shows the injection as text in css.
	clean := func(where string, css ...string) {
		t.Helper()
		assert.Empty(t, rendered(t, ctx, where), "the injection was rendered as markup on %s", where)
		assert.Zero(t, dialogs.Swap(0), "a dialog opened on %s", where)
		for _, c := range css {
			assert.Contains(t, text(t, ctx, c), injection, "%s on %s", c, where)
		}
	}
	visit := func(path, wait string, css ...string) {
		t.Helper()
		step(t, ctx, chromedp.Navigate(bare.URL+path), chromedp.WaitVisible(chromedp.CSS(wait)))
		clean(path, css...)
		headers(path, func() (*http.Response, error) { return http.Get(srv.URL + path) })
	}
	// click follows a link or a button of the page to the page with
	// wait, and checks that page.
	click := func(sel, wait string, css ...string) {
		t.Helper()
		step(t, ctx, chromedp.Click(chromedp.CSS(sel)), chromedp.WaitVisible(chromedp.CSS(wait)))
		clean("the page after "+sel, css...)
	}
	value := func(css string) string {
		t.Helper()
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		v, err := chromedp.Run(sctx, chromedp.Evaluate[string](`document.querySelector(`+jsonString(css)+`).value`))
		require.NoError(t, err, css)
		return v
	}

	visit("/", "#consumers", "#consumers", "header", "main")
	assert.Contains(t, text(t, ctx, "main"), "It could not be read: access refused "+injection)
	visit("/dlq?q=0", "#records", "#records", "h1")
	for _, ref := range []string{"0:0", "0:1", "0:2", "3" + injection} {
		visit("/record?q=0&ref="+url.QueryEscape(ref), "#facts", "h1", "#facts", "#key", "#headers")
		assert.Contains(t, text(t, ctx, "#headers"), jsURL)
		if ref != "0:2" {
			assert.Contains(t, text(t, ctx, "#event-id"), injection)
		}
		if ref == "0:0" || ref == "0:2" {
			assert.Equal(t, injection, text(t, ctx, "#payload"))
		} else {
			// JSON, as it is: its strings with their escapes.
			assert.Contains(t, text(t, ctx, "#payload"), jsonString(injection))
		}
	}
	assert.Contains(t, text(t, ctx, "#facts"), "message-id="+injection+" type="+injection)
	assert.Contains(t, text(t, ctx, "#facts"), injection+"/"+injection, "the AMQP destination")
	visit("/record?q=0&ref=0:2", "#facts")
	assert.Contains(t, text(t, ctx, "#facts"), "no: ", "bin-1 is shown as not replayable")
	assert.Contains(t, text(t, ctx, "#facts"), "(kind decode"+injection+")")
	visit("/record?q=0&ref=0:1", "#facts")
	assert.Contains(t, text(t, ctx, "#payload"), jsURL)

	// A replay from a listing whose filter holds the injection: its
	// confirmation, its result, and the way back.
	back := "dlq?q=0&search=" + url.QueryEscape(injection)
	visit("/record?q=0&ref=0:0&back="+url.QueryEscape(back), "#replay-one", "#reason")
	click("#replay-one", "#to-replay", "#to-replay", "h1")
	assert.Equal(t, back, value(`input[name="back"]`))
	headers("the confirmation", func() (*http.Response, error) {
		return http.PostForm(srv.URL+"/replay", url.Values{"q": {"0"}, "ref": {"0:0"}, "back": {back}})
	})
	click("#confirm", "#outcomes", "#outcomes")
	click("#back", "#records", "#records")
	assert.Equal(t, injection, value("#search"), "the search shown as it was given")
	// The same, with a back that would be a javascript: link.
	visit("/record?q=0&ref=0:0&back="+url.QueryEscape(jsURL), "#replay-one")
	click("#replay-one", "#to-replay")

	// The error pages: a replay that fails, a queue that cannot be
	// read, a record that is not there.
	back1 := "dlq?q=1&search=" + url.QueryEscape(injection)
	visit("/record?q=1&ref=0:0&back="+url.QueryEscape(back1), "#replay-one")
	click("#replay-one", "#to-replay")
	click("#confirm", "#error", "#error")
	headers("the failed replay", func() (*http.Response, error) {
		return http.PostForm(srv.URL+"/replay", url.Values{"q": {"1"}, "ref": {"0:0"}, "back": {back1}, "confirm": {"yes"}})
	})
	click("#back", "#records")
	assert.Equal(t, injection, value("#search"))
	visit("/dlq?q=2", "#error", "#error")
	visit("/record?q=2&ref=0:0", "#error", "#error")
	visit("/record?q=0&ref="+url.QueryEscape(injection)+"&back="+url.QueryEscape(back), "#error", "#error")

	// The rest of the query string, echoed into forms, links and error
	// pages.
	inj := url.QueryEscape(injection)
	visit("/dlq?q=0&search="+inj+"&kind="+inj+"&consumer="+inj+"&id="+inj, "#records")
	for _, name := range []string{"search", "consumer", "id"} {
		assert.Equal(t, injection, value(`#filter input[name="`+name+`"]`), name)
	}
	visit("/dlq?q=0&since="+inj, "#error")
	assert.Contains(t, text(t, ctx, "#error"), strconv.Quote(injection))
	visit("/dlq?q=0&last="+inj, "#error")
	assert.Contains(t, text(t, ctx, "#error"), strconv.Quote(injection))
	visit("/dlq?q=0&after="+url.QueryEscape("0:"+injection), "body")
	visit("/dlq?q=0&before="+url.QueryEscape("3"+injection), "body")
	visit("/dlq?q="+inj, "#error")
	visit("/record?q=0&ref=0:0&back="+inj, "#facts")
	visit("/record?q=0&ref=0:0&back="+url.QueryEscape(jsURL), "#facts")
}

// rendered reports what of the injection the page in ctx rendered as
// markup: "element ", "script or handler ", "javascript link ", "ran ",
// or "" for none.
func rendered(t *testing.T, ctx context.Context, where string) string {
	t.Helper()
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	found, err := chromedp.Run(sctx, chromedp.Evaluate[string](`[
		document.getElementById('injected') ? 'element ' : '',
		document.querySelectorAll('script, img, [onerror]').length ? 'script or handler ' : '',
		[...document.querySelectorAll('[href], [action], [formaction], [src]')].some(e =>
			['href', 'action', 'formaction', 'src'].some(a => /^\s*javascript:/i.test(e.getAttribute(a) || ''))) ? 'javascript link ' : '',
		typeof window.__owned !== 'undefined' ? 'ran ' : ''].join('')`))
	require.NoError(t, err, where)
	return found
}
