package dlq

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"
)

// Queue is one dead-letter topic (Kafka) or queue (RabbitMQ). Its methods
// may be called from several goroutines; each call uses connections of its
// own.
type Queue interface {
	// Name says which broker and destination: "kafka topic orders.dlq",
	// "rabbitmq queue orders.dlq".
	Name() string
	// Browse calls fn for every record present when it starts, in order
	// (partition by partition on Kafka, queue order on RabbitMQ), without
	// consuming or reordering anything. An error from fn stops it and is
	// returned.
	Browse(ctx context.Context, fn func(*Record) error) error
	// Replay redrives the records f selects (see the package doc) and
	// returns what it did. Records that are not replayable are reported as
	// skipped. It stops at the first publish that fails, with that error.
	Replay(ctx context.Context, f Filter, opts ReplayOptions) (Report, error)
	// Close releases what the Queue holds; reads and replays in progress
	// fail.
	Close() error
}

// ReplayOptions tune Queue.Replay.
type ReplayOptions struct {
	// DryRun reports what would be replayed and publishes nothing.
	DryRun bool
	// Rate bounds publishes per second; 0 means no bound.
	Rate float64
	// By names who asked for the redrive (once-redriven-by); optional.
	By string
	// Force replays records of kinds that a redrive cannot fix
	// (id-conflict, invalid-id, missing-id), and RabbitMQ copies written
	// without their original headers (amqp.HeaderOriginalDropped), which
	// the exchange's other consumers may take for a new event; both are
	// skipped otherwise (Record.Replayable).
	Force bool
	// Keep, on RabbitMQ, leaves replayed records in the dead-letter queue;
	// by default each is removed once the broker confirmed its redrive.
	// Kafka dead letters are never removed.
	Keep bool
	// Progress, when set, is called after each selected record with the
	// count done so far, the total selected and the record's outcome.
	Progress func(done, total int, o Outcome)
	// Now gives the redrive time; nil means time.Now.
	Now func() time.Time
}

// Outcome is what Replay did with one selected record.
type Outcome struct {
	// Record is the record's Summary, without its key and payload: a
	// Report of a large replay does not hold every payload it
	// republished.
	Record *Record `json:"record"`
	// Result is "replayed", "would replay" (dry run) or "skipped".
	Result string `json:"result"`
	// Reason says why a record was skipped.
	Reason string `json:"reason,omitempty"`
	// Destination is where it was (or would be) published.
	Destination string `json:"destination,omitempty"`
}

// The Outcome results.
const (
	Replayed    = "replayed"
	WouldReplay = "would replay"
	Skipped     = "skipped"
)

// Report is the result of a Replay. When Replay stops on an error, it
// covers the records handled before the error.
type Report struct {
	// Selected counts the records the filter selected.
	Selected int `json:"selected"`
	// Replayed counts the records published (and confirmed).
	Replayed int `json:"replayed"`
	// Skipped counts the records that are not replayable, and on
	// RabbitMQ those no longer in the queue when a long replay took its
	// messages again (AMQPConfig.MaxHold).
	Skipped int `json:"skipped"`
	// DryRun is set when nothing was published on purpose.
	DryRun bool `json:"dry_run"`
	// Outcomes has one entry per record handled, in order.
	Outcomes []Outcome `json:"outcomes"`
}

// ErrBadOptions is wrapped by Replay's errors for invalid ReplayOptions.
var ErrBadOptions = errors.New("dlq: invalid replay options")

func (o *ReplayOptions) validate() error {
	if !(o.Rate >= 0) || math.IsInf(o.Rate, 1) {
		// NaN fails every comparison, and neither it nor an infinite
		// rate gives a publish interval.
		return fmt.Errorf("%w: rate %v is not a number of records per second (0 or more)", ErrBadOptions, o.Rate)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return nil
}

// errGone is returned by a publish for a record no longer in the queue
// when the replay took the queue's messages again: the record is skipped.
var errGone = errors.New("no longer in the queue: removed, or held by another client, since the replay started")

// replayLoop is the broker-independent part of a replay: it skips what is
// not replayable, paces the publishes and reports progress. publish sends
// one record and returns its destination once the broker confirmed it.
func replayLoop(ctx context.Context, recs []*Record, opts ReplayOptions, publish func(*Record, []Header) (string, error)) (Report, error) {
	rp := newReplayer(len(recs), opts, publish)
	defer rp.stop()
	for _, r := range recs {
		if err := rp.step(ctx, r); err != nil {
			return rp.rep, err
		}
	}
	return rp.rep, nil
}

// replayer is replayLoop one record at a time, for a replay that reads
// the records it publishes as it goes (KafkaQueue.Replay) and so holds
// one at a time. Its Report keeps each record's Summary: the payloads of
// a large replay are not held until it ends.
type replayer struct {
	rep     Report
	total   int
	opts    ReplayOptions
	pace    *pacer
	publish func(*Record, []Header) (string, error)
}

func newReplayer(total int, opts ReplayOptions, publish func(*Record, []Header) (string, error)) *replayer {
	return &replayer{rep: Report{Selected: total, DryRun: opts.DryRun, Outcomes: make([]Outcome, 0, total)},
		total: total, opts: opts, pace: newPacer(opts.Rate), publish: publish}
}

// step replays (or skips) r, the next selected record.
func (rp *replayer) step(ctx context.Context, r *Record) error {
	o := Outcome{Record: r.Summary(), Destination: r.Destination()}
	switch err := r.Replayable(rp.opts.Force); {
	case err != nil:
		o.Result, o.Reason = Skipped, err.Error()
		rp.rep.Skipped++
	case rp.opts.DryRun:
		o.Result = WouldReplay
	default:
		if err := rp.pace.wait(ctx); err != nil {
			return err
		}
		dest, err := rp.publish(r, redriveHeaders(r, rp.opts.Now(), rp.opts.By))
		if errors.Is(err, errGone) {
			o.Result, o.Reason = Skipped, err.Error()
			rp.rep.Skipped++
			break
		}
		if err != nil {
			return fmt.Errorf("dlq: redrive of %s (event %s) to %s: %w", r.Ref, r.EventID(), r.Destination(), err)
		}
		o.Result, o.Destination = Replayed, dest
		rp.rep.Replayed++
	}
	rp.done(o)
	return nil
}

// skip reports r skipped for reason, without publishing it.
func (rp *replayer) skip(r *Record, reason string) {
	rp.rep.Skipped++
	rp.done(Outcome{Record: r.Summary(), Destination: r.Destination(), Result: Skipped, Reason: reason})
}

func (rp *replayer) done(o Outcome) {
	rp.rep.Outcomes = append(rp.rep.Outcomes, o)
	if rp.opts.Progress != nil {
		rp.opts.Progress(len(rp.rep.Outcomes), rp.total, o)
	}
}

func (rp *replayer) stop() { rp.pace.stop() }

// pacer spaces publishes 1/rate apart; the first goes at once. A rate
// whose interval is below the clock's nanosecond is no bound; one whose
// interval passes the longest Duration waits that long.
type pacer struct {
	t       *time.Ticker
	started bool
}

func newPacer(rate float64) *pacer {
	every := paceInterval(rate)
	if every == 0 {
		return &pacer{}
	}
	return &pacer{t: time.NewTicker(every)}
}

// paceInterval is the interval between publishes at rate, 0 for no bound.
func paceInterval(rate float64) time.Duration {
	if !(rate > 0) {
		return 0
	}
	f := float64(time.Second) / rate
	if f < 1 {
		return 0
	}
	if f >= float64(math.MaxInt64) { // a float too large for a Duration converts to anything
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(f)
}

func (p *pacer) wait(ctx context.Context) error {
	if p.t == nil || !p.started {
		p.started = true
		return ctx.Err()
	}
	select {
	case <-p.t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (p *pacer) stop() {
	if p.t != nil {
		p.t.Stop()
	}
}

// Collect returns the records of q that f selects, in order.
func Collect(ctx context.Context, q Queue, f Filter) ([]*Record, error) {
	var out []*Record
	err := q.Browse(ctx, func(r *Record) error {
		if f.Match(r) {
			out = append(out, r)
		}
		return nil
	})
	return out, err
}
