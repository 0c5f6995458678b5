package outbox_test

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/onceco/once/internal/testlog"
	"github.com/onceco/once/outbox"
)

// hangingPublisher is a publisher whose Publish or Check, while told to,
// blocks until released, ignoring its context: a custom publisher with a
// bug. It records how many of its calls ran at once.
type hangingPublisher struct {
	outbox.Publisher
	hangPublish, hangCheck atomic.Bool
	hung                   chan string // the name of a call that hangs
	release                chan struct{}
	releaseOnce            sync.Once
	calls, maxCalls        atomic.Int64
}

func newHangingPublisher(t *testing.T, pub outbox.Publisher) *hangingPublisher {
	return &hangingPublisher{Publisher: pub, hung: make(chan string, 1), release: make(chan struct{})}
}

// unblock releases the calls that hang, and makes no more of them hang.
func (p *hangingPublisher) unblock() {
	p.hangPublish.Store(false)
	p.hangCheck.Store(false)
	p.releaseOnce.Do(func() { close(p.release) })
}

func (p *hangingPublisher) enter(name string, hang bool) {
	n := p.calls.Add(1)
	for m := p.maxCalls.Load(); n > m && !p.maxCalls.CompareAndSwap(m, n); m = p.maxCalls.Load() {
	}
	if hang {
		select {
		case p.hung <- name:
		default:
		}
		<-p.release
	}
}

func (p *hangingPublisher) Publish(ctx context.Context, recs []outbox.Record) []error {
	p.enter("Publish", p.hangPublish.Load())
	defer p.calls.Add(-1)
	return p.Publisher.Publish(ctx, recs)
}

func (p *hangingPublisher) Check(rec outbox.Record) error {
	p.enter("Check", p.hangCheck.Load())
	defer p.calls.Add(-1)
	return p.Publisher.(outbox.Checker).Check(rec)
}

func waitHung(t *testing.T, p *hangingPublisher, want string) {
	t.Helper()
	select {
	case got := <-p.hung:
		require.Equal(t, want, got)
	case <-time.After(30 * time.Second):
		t.Fatalf("no call to %s hung", want)
	}
}

// A custom Publish that ignores its context and never returns held the
// relay still, with no log and no metric, and kept its leadership: no
// other relay could publish. Past PublishTimeout and its grace the relay
// gives the call up: it logs it at level Error, naming the call, sets
// StalledMetric, and ends its session so that another relay leads, which
// publishes every row in key order; it never calls the publisher while
// the call it gave up is out, and leads again once that call returned.
func TestHungPublishIsGivenUpAndAnotherRelayLeads(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	pub := newHangingPublisher(t, k.publisher(t))
	pub.hangPublish.Store(true)
	logs := &testlog.ErrorLog{}
	rd := sdkmetric.NewManualReader()
	a, _ := startRelay(t, pool, pub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, PublishTimeout: time.Second,
		Logger: slog.New(logs), MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd))})
	require.Eventually(t, a.Leader, 10*time.Second, 5*time.Millisecond)
	b, stopB := startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond})
	t.Cleanup(pub.unblock)

	addCommitted(t, pool, d.msg("k", "1"), d.msg("k", "2"), d.msg("j", "3"))
	waitHung(t, pub, "Publish")
	require.Eventually(t, b.Leader, 30*time.Second, 10*time.Millisecond, "the relay whose Publish hangs gives its leadership up")
	waitRows(t, pool, "true", 0, 30*time.Second)
	assert.Equal(t, []string{"1", "2"}, bodiesOfKey(d.read(t, 3), "k"))
	errs := logs.Errors()
	require.NotEmpty(t, errs, "the hung call is logged at level Error")
	t.Log(errs[0])
	assert.Contains(t, errs[0], "Publish")
	assert.EqualValues(t, 1, metricValue(t, rd, outbox.StalledMetric))
	assert.False(t, a.Leader())

	pub.unblock()
	require.Eventually(t, func() bool { return metricValue(t, rd, outbox.StalledMetric) == 0 }, 30*time.Second, 10*time.Millisecond,
		"the gauge falls once the call returned")
	stopB()
	require.Eventually(t, a.Leader, 30*time.Second, 10*time.Millisecond, "the relay leads again once the call returned")
	addCommitted(t, pool, d.msg("k", "4"))
	waitRows(t, pool, "true", 0, 30*time.Second)
	assert.EqualValues(t, 1, pub.maxCalls.Load(), "the publisher is never called from two goroutines")
}

// A custom Checker whose Check never returns (it has no context) held
// the relay still with no log, and its Run never returned after a stop.
// Past PublishTimeout and its grace the check is given up, logged at
// level Error naming Check, and a stop ends Run within its grace though
// the call still hangs.
func TestHungCheckIsGivenUpAndRunStops(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	pub := newHangingPublisher(t, k.publisher(t))
	pub.hangCheck.Store(true)
	logs := &testlog.ErrorLog{}
	r, stop := startRelay(t, pool, pub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, PublishTimeout: 100 * time.Millisecond,
		Logger: slog.New(logs)})
	t.Cleanup(pub.unblock)
	addCommitted(t, pool, d.msg("k", "1"))
	waitHung(t, pub, "Check")
	require.Eventually(t, func() bool { return len(logs.Errors()) > 0 }, 30*time.Second, 10*time.Millisecond,
		"the hung call is logged at level Error")
	t.Log(logs.Errors()[0])
	assert.Contains(t, logs.Errors()[0], "Check")
	require.Eventually(t, func() bool { return !r.Leader() }, 10*time.Second, 10*time.Millisecond)
	start := time.Now()
	stop()
	assert.Less(t, time.Since(start), 10*time.Second, "Run returns though the call it gave up still hangs")
	assert.Equal(t, 1, rows(t, pool, "attempts = 0"), "the row is kept, uncharged")
}
