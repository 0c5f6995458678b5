package console_test

import (
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/console"
	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
)

// In a real browser: the result of a replay was the answer to the POST
// that asked for it, so reloading the result page (F5, or a browser
// restoring its tabs) posted the replay again and redrove the records a
// second time. The replay sends the browser to its result page (POST,
// redirect, GET): a reload shows the result again and replays nothing.
func TestReloadingAReplayResultDoesNotReplayAgain(t *testing.T) {
	ctx := browser(t)
	svc, dl := deadLetters(t)
	q := &countingQueue{Queue: dl}
	h, err := console.New(console.Config{DB: svc.Pool, Queues: []dlq.Queue{q}, AllowReplay: true, Logger: testenv.Logger()})
	require.NoError(t, err)
	mux := http.NewServeMux() // under a prefix: the redirect stays under it
	mux.Handle("/ops/", http.StripPrefix("/ops", h))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	step(t, ctx, chromedp.Navigate(srv.URL+"/ops/record?q=0&ref=0:0"), chromedp.WaitVisible(chromedp.CSS("#replay-one")))
	step(t, ctx, chromedp.Click(chromedp.CSS("#replay-one")), chromedp.WaitVisible(chromedp.CSS("#confirm")))
	step(t, ctx, chromedp.Click(chromedp.CSS("#confirm")), chromedp.WaitVisible(chromedp.CSS("#result")))
	require.Equal(t, "Replayed 1 of 1", text(t, ctx, "#result"))
	require.Equal(t, int32(1), q.replays.Load())

	for range 2 {
		step(t, ctx, chromedp.Reload(), chromedp.WaitVisible(chromedp.CSS("#result")))
		assert.Equal(t, "Replayed 1 of 1", text(t, ctx, "#result"), "the reloaded result")
		assert.Contains(t, text(t, ctx, "#outcomes"), "fail-1")
	}
	assert.Equal(t, int32(1), q.replays.Load(), "a reload of the result page replayed the record again")
	svc.WaitSettled(t, 6)
	assert.Equal(t, uint64(6), svc.C.Stats().Received, "one redrive received, not one per reload")
}

// A confirmation posted twice (its button clicked again while the first
// click's replay ran, or the page that answered it reloaded) replayed
// its records twice: the second post waited for the first's replay and
// ran its own. The form names its replay; posted again it leads to that
// replay's result.
func TestConfirmationPostedTwiceReplaysOnce(t *testing.T) {
	svc, dl := deadLetters(t)
	q := &countingQueue{Queue: dl}
	h, err := console.New(console.Config{DB: svc.Pool, Queues: []dlq.Queue{q}, AllowReplay: true, Logger: testenv.Logger()})
	require.NoError(t, err)
	code, confirmation := post(t, h, url.Values{"q": {"0"}, "ref": {"0:0", "0:3"}})
	require.Equal(t, http.StatusOK, code, confirmation)
	form := formOf(confirmation)
	require.Equal(t, "yes", form.Get("confirm"), confirmation)

	var wg sync.WaitGroup
	bodies := make([]string, 2)
	for i := range bodies {
		wg.Go(func() {
			code, body := post(t, h, form)
			assert.Equal(t, http.StatusOK, code, body)
			bodies[i] = body
		})
	}
	wg.Wait()
	_, again := post(t, h, form)
	for _, body := range append(bodies, again) {
		assert.True(t, strings.Contains(body, "Replayed 2 of 2"), "each post shows the replay's result: %s", body)
	}
	assert.Equal(t, int32(1), q.replays.Load(), "one confirmation, posted three times, replayed more than once")
	svc.WaitSettled(t, 7)
	assert.Equal(t, uint64(7), svc.C.Stats().Received, "two redrives received, once each")
}
