package conformance_test

import (
	"context"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/conformance"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// memBroker is a conformance.Broker on a memsource.Broker, with one
// promise of the adapter contract broken on request.
type memBroker struct {
	b     *memsource.Broker
	flaw  flaw
	opens atomic.Int32
}

// flaw is a way to break the adapter contract.
type flaw int

const (
	// honest breaks nothing.
	honest flaw = iota
	// unstableFallbackID gives a message another FallbackID on each
	// delivery to a new source, as one derived from a delivery tag would.
	unstableFallbackID
	// deadLetterLosesOriginal writes dead-letter copies with the value and
	// the diagnostic headers only: no key, none of the original headers.
	deadLetterLosesOriginal
	// redeliveryUnmarked never sets Message.Redelivered nor DeliveryCount,
	// as an unordered adapter that ignores the broker's flag would.
	redeliveryUnmarked
	// acksLost never passes an ack on to the broker, as an adapter that
	// buffers its acks (offsets) and drops them at Close would: every
	// message is delivered again after a restart.
	acksLost
	// cumulativeAck acks, with each delivery, every delivery its source
	// returned before it, as an AMQP ack with multiple set or one offset
	// commit for an unordered source would: a message still in flight is
	// acked by a later one's ack, and lost if the consumer stops before
	// it finished.
	cumulativeAck
	// sharedFallbackID gives every message without an id one FallbackID,
	// as one of a topic and partition without the offset would: the second
	// such message is skipped as a duplicate of the first.
	sharedFallbackID
)

func (b *memBroker) Publish(_ context.Context, msgs ...conformance.OutMessage) error {
	for _, m := range msgs {
		h := maps.Clone(m.Headers)
		if h == nil {
			h = map[string]string{}
		}
		if m.ID != "" {
			h["id"] = m.ID
		}
		if m.Type != "" {
			h["type"] = m.Type
		}
		b.b.Publish(consumer.Message{Key: m.Key, Value: m.Value, Headers: h})
	}
	return nil
}

func (b *memBroker) NewSource(*testing.T) consumer.Source {
	return &flawedSource{Source: b.b.Source(), b: b, open: b.opens.Add(1)}
}

func (b *memBroker) DeadLetters(context.Context) ([]conformance.DeadLetterRecord, error) {
	var out []conformance.DeadLetterRecord
	for _, d := range b.b.DeadLetters() {
		rec := conformance.DeadLetterRecord{Key: d.Message.Key, Value: d.Message.Value, Headers: d.Headers}
		if b.flaw == deadLetterLosesOriginal {
			rec.Key = nil
			rec.Headers = maps.Clone(rec.Headers)
			maps.DeleteFunc(rec.Headers, func(k, _ string) bool { return !strings.HasPrefix(k, "once-") })
		}
		out = append(out, rec)
	}
	return out, nil
}

// flawedSource is a memsource.Source whose deliveries carry the broker's
// flaw.
type flawedSource struct {
	*memsource.Source
	b    *memBroker
	open int32 // which source of the broker, from 1
	// delivered are the deliveries returned so far (cumulativeAck).
	delivered []consumer.Delivery
	mu        sync.Mutex
}

func (s *flawedSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	m := *d.Message()
	switch s.b.flaw {
	case unstableFallbackID:
		m.FallbackID = fmt.Sprintf("%s#%d", m.FallbackID, s.open)
	case redeliveryUnmarked:
		m.Redelivered, m.DeliveryCount = false, 0
	case sharedFallbackID:
		if m.FallbackID != "" {
			m.FallbackID = m.Topic + "/shared"
		}
	}
	fd := &flawedDelivery{Delivery: d, m: &m, dropAck: s.b.flaw == acksLost}
	if s.b.flaw == cumulativeAck {
		s.mu.Lock()
		fd.earlier = s.delivered
		s.delivered = append(s.delivered, d)
		s.mu.Unlock()
	}
	return fd, nil
}

type flawedDelivery struct {
	consumer.Delivery
	m       *consumer.Message
	dropAck bool
	// earlier are the deliveries its Ack acks too (cumulativeAck).
	earlier []consumer.Delivery
}

func (d *flawedDelivery) Message() *consumer.Message { return d.m }

func (d *flawedDelivery) Ack(ctx context.Context) error {
	if d.dropAck {
		return nil
	}
	for _, e := range d.earlier {
		if err := e.Ack(ctx); err != nil {
			return err
		}
	}
	return d.Delivery.Ack(ctx)
}

// suite is the suite on a memsource broker with flaw.
func suite(f flaw, features conformance.Features, opts memsource.Options) conformance.Suite {
	return conformance.Suite{
		Features: features,
		NewBroker: func(*testing.T) conformance.Broker {
			return &memBroker{b: memsource.New(opts), flaw: f}
		},
		NewDB: func(t *testing.T) *pgxpool.Pool { p, _ := pgtest.Schema(t); return p },
	}
}

// flawed are adapters that break one promise of the contract each, with
// the suite's test that must catch it.
var flawed = []struct {
	name     string
	suite    conformance.Suite
	caughtBy string
	// mayAlsoFail are tests the flaw fails only when their timing lets it.
	mayAlsoFail []string
}{
	{
		name: "unstable-fallback-id",
		suite: suite(unstableFallbackID, conformance.Features{Ordered: true, FallbackID: true, RedeliverOnRestart: true},
			memsource.Options{Streams: 2, FallbackID: true}),
		caughtBy: "FallbackIDStableAcrossRedelivery",
	},
	{
		name: "dead-letter-loses-original",
		suite: suite(deadLetterLosesOriginal, conformance.Features{RedeliverOnRestart: true},
			memsource.Options{}),
		caughtBy: "HandlerFailureDeadLettered",
	},
	{
		name:     "redelivery-unmarked",
		suite:    suite(redeliveryUnmarked, conformance.Features{RedeliverOnRestart: true}, memsource.Options{}),
		caughtBy: "StallLoopDeadLettered",
	},
	{
		name: "acks-lost",
		suite: suite(acksLost, conformance.Features{Ordered: true, RedeliverOnRestart: true},
			memsource.Options{Streams: 3}),
		caughtBy: "AckedNotRedelivered",
	},
	{
		// Without RedeliverOnRestart, FallbackIDStableAcrossRedelivery does
		// not run: MissingID alone sees the id-less messages.
		name: "shared-fallback-id",
		suite: suite(sharedFallbackID, conformance.Features{Ordered: true, FallbackID: true},
			memsource.Options{Streams: 2, FallbackID: true}),
		caughtBy: "MissingID",
	},
	{
		name:     "cumulative-ack",
		suite:    suite(cumulativeAck, conformance.Features{RedeliverOnRestart: true}, memsource.Options{}),
		caughtBy: "InFlightNotAckedByOthers",
		// good-1's ack settles stalls-1 when the two are handled side by
		// side.
		mayAlsoFail: []string{"StallLoopDeadLettered"},
	},
}

// childEnv names, in the environment of a child test process, the flawed
// adapter it runs the suite on.
const childEnv = "ONCE_CONFORMANCE_FLAWED"

// The suite fails an adapter that breaks a promise of the contract, in the
// test that covers that promise: each flawed adapter runs the whole suite
// in a child process, which must fail there.
func TestSuiteCatchesFlawedAdapters(t *testing.T) {
	if name := os.Getenv(childEnv); name != "" {
		for _, f := range flawed {
			if f.name == name {
				t.Run(f.name, func(t *testing.T) { conformance.Run(t, f.suite) })
			}
		}
		return
	}
	for _, f := range flawed {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			cmd := exec.Command(os.Args[0], "-test.run", "^TestSuiteCatchesFlawedAdapters$", "-test.v", "-test.count=1")
			cmd.Env = append(os.Environ(), childEnv+"="+f.name, "DATABASE_URL="+pgtest.URL())
			out, err := cmd.CombinedOutput()
			require.Error(t, err, "the suite passed an adapter whose flaw is %s:\n%s", f.name, out)
			failed := regexp.MustCompile(`--- FAIL: TestSuiteCatchesFlawedAdapters/`+regexp.QuoteMeta(f.name)+`/(\S+)`).FindAllStringSubmatch(string(out), -1)
			var tests []string
			for _, m := range failed {
				if !slices.Contains(f.mayAlsoFail, m[1]) {
					tests = append(tests, m[1])
				}
			}
			assert.Equal(t, []string{f.caughtBy}, tests, "the suite's tests that failed:\n%s", out)
		})
	}
}

// The honest adapter passes: the flaws alone fail the suite.
func TestSuitePassesTheHonestAdapter(t *testing.T) {
	conformance.Run(t, suite(honest, conformance.Features{Ordered: true, FallbackID: true, RedeliverOnRestart: true},
		memsource.Options{Streams: 2, FallbackID: true}))
}

// The honest adapter passes unordered as well, where the tests of
// unordered adapters run.
func TestSuitePassesTheHonestUnorderedAdapter(t *testing.T) {
	conformance.Run(t, suite(honest, conformance.Features{RedeliverOnRestart: true}, memsource.Options{}))
}
