package console_test

import (
	"bytes"
	"context"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/console"
	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
)

// The page of a dead letter whose payload is megabytes, text or binary,
// stays small: it shows the payload's first bytes, says that it is cut and
// how long it is, and links to a download of every byte.
func TestRecordWithAHugePayloadStaysUsable(t *testing.T) {
	ctx := browser(t)
	u := testenv.AMQPURL(t)
	queue := testenv.Uniq("orders.dlq")
	testenv.DeleteQueues(t, u, queue)
	ch := testenv.AMQPChannel(t, u)
	_, err := ch.QueueDeclare(queue, true, false, false, false, nil)
	require.NoError(t, err)
	const size = 3 << 20
	textPayload := bytes.Repeat([]byte(`{"line":"a JSON document of many lines"},`+"\n"), size/42+1)[:size]
	binary := make([]byte, size)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range binary {
		binary[i] = byte(rng.Uint32())
	}
	payloads := map[string][]byte{"huge-text": textPayload, "huge-binary": binary}
	for _, id := range []string{"huge-text", "huge-binary"} {
		testenv.PublishAMQP(t, ch, queue, amqp091.Publishing{MessageId: id, Body: payloads[id], Headers: amqp091.Table{
			consumer.HeaderEventID: id, consumer.HeaderConsumer: "billing", consumer.HeaderErrorKind: "handler",
			"once-original-exchange": "", "once-original-routing-key": "orders",
		}})
	}
	q, err := dlq.NewAMQP(dlq.AMQPConfig{URL: u, Queue: queue})
	require.NoError(t, err)
	h, err := console.New(console.Config{Queues: []dlq.Queue{q}, Logger: testenv.Logger()})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	refs := map[string]string{}
	for _, m := range dataRef.FindAllStringSubmatch(get(t, srv.URL+"/dlq?q=0"), -1) {
		refs[m[2]] = m[1]
	}
	require.Len(t, refs, 2)
	for id, want := range payloads {
		page := srv.URL + "/record?q=0&ref=" + refs[id]
		html := get(t, page)
		assert.Less(t, len(html), 256<<10, "%s: the page is %d bytes", id, len(html))

		step(t, ctx, chromedp.Navigate(page), chromedp.WaitVisible(chromedp.CSS("#payload")))
		assert.Equal(t, id, text(t, ctx, "#event-id"))
		cut := text(t, ctx, "#payload-cut")
		assert.Contains(t, cut, "first 32,768 of its 3,145,728 bytes", id)
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		shown, err := chromedp.Run(sctx, chromedp.TextContent(chromedp.CSS("#payload")))
		cancel()
		require.NoError(t, err)
		if id == "huge-text" {
			assert.True(t, strings.HasPrefix(string(want), shown), "the text shown is the payload's start")
			assert.Len(t, shown, 32<<10, "the first 32 KiB are shown")
		} else {
			assert.Contains(t, shown, "00007ff0", "the hex dump goes to the last byte shown")
			assert.NotContains(t, shown, "00008000")
		}
		screenshot(t, ctx, "console-record-"+id)

		// The download has every byte, as a file.
		sctx, cancel = context.WithTimeout(ctx, 30*time.Second)
		attrs, err := chromedp.Run(sctx, chromedp.Attributes(chromedp.CSS("#payload-download")))
		cancel()
		require.NoError(t, err)
		href := attrs["href"]
		resp, err := http.Get(srv.URL + "/" + href)
		require.NoError(t, err)
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s: %s", href, got)
		assert.Equal(t, "application/octet-stream", resp.Header.Get("Content-Type"))
		assert.Contains(t, resp.Header.Get("Content-Disposition"), "attachment")
		assert.Equal(t, strconv.Itoa(size), resp.Header.Get("Content-Length"))
		assert.True(t, bytes.Equal(want, got), "%s: the download is not the payload (%d bytes)", id, len(got))
	}
}
