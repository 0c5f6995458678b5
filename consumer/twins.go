package consumer

import (
	"bytes"
	"context"
	"sync"
)

// Twins: an unordered message whose id is already being claimed by
// another batch of this process (a producer's retry, a broker's
// redelivery, shortly after the first copy) does not race that batch to
// the database. Its claim would wait there on the other transaction's
// uncommitted row, holding its own batch, and every batch after it
// holding the same id, until that transaction ended: on RabbitMQ, where
// concurrent batches take neighbouring deliveries, one such wait chained
// transactions that could have run side by side. Instead the message
// follows its twin: its batch runs without it, and once the twin is
// settled it is acked as a duplicate when the twin's claim committed with
// the same fingerprint (the id's row is then committed: guarantee 2 holds
// as for any duplicate), else it is claimed and run like any message.
// Ordered streams run one batch at a time and have no twins in flight.

// twins maps the ids of the unordered jobs in flight to their claims.
type twins struct {
	mu  sync.Mutex
	ids map[string]*twinClaim
}

// twinClaim is one in-flight claim of an id, by its first job.
type twinClaim struct {
	owner *batch
	fp    []byte
	// done is the owner batch's: closed once all its jobs are settled.
	// committed is set before: the id's row is committed (the job was
	// handled, skipped or a duplicate).
	done      chan struct{}
	committed bool
}

// follower is a job held back behind its twin's claim.
type follower struct {
	j    *job
	twin *twinClaim
}

func newTwins() *twins { return &twins{ids: map[string]*twinClaim{}} }

// register records the claims of b's jobs and returns the jobs b runs
// itself and those that follow a twin of another batch. A batch registers
// all its ids at once, so a follower's twin always registered before it:
// batches can wait on each other only in that order, never in a cycle.
// The jobs to be decoded again (job.undecoded) come last in mine: there
// is no order to keep, and the others need not wait for their retries.
func (t *twins) register(b *batch) (mine []*job, followers []follower) {
	mine = make([]*job, 0, len(b.jobs))
	var undecoded []*job
	// One channel and one block of claims for the whole batch: every
	// claim of a batch is released at once.
	done := make(chan struct{})
	claims := make([]twinClaim, 0, len(b.jobs))
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, j := range b.jobs {
		c, ok := t.ids[j.idt.id]
		switch {
		case j.undecoded != nil:
			// Its id is not known for sure until it decodes (an
			// Envelope's), after a wait: it never follows, and nothing
			// follows it.
			undecoded = append(undecoded, j)
		case mayBeRedelivery(j.m):
			// A suspect of a crash goes through the crash guard, which
			// keeps a durable record for it: it never follows, and
			// nothing follows it.
			mine = append(mine, j)
		case !ok:
			// claims never grows past its capacity: the pointer stays
			// valid.
			claims = append(claims, twinClaim{owner: b, fp: j.fp, done: done})
			t.ids[j.idt.id] = &claims[len(claims)-1]
			mine = append(mine, j)
		case c.owner == b:
			// Twice in one batch: the batch claim tells them apart.
			mine = append(mine, j)
		default:
			followers = append(followers, follower{j: j, twin: c})
		}
	}
	return append(mine, undecoded...), followers
}

// release records whether the claims of b's jobs (all settled) committed
// and lets their followers go.
func (t *twins) release(b *batch, mine []*job) {
	t.mu.Lock()
	defer t.mu.Unlock()
	// Two passes: an id twice in the batch has one claim, committed if
	// either of its jobs left the row committed.
	// A job decoded again (decodeFailures) did not register its id,
	// which may have changed: its row says nothing of the claim's
	// fingerprint.
	for _, j := range mine {
		if c, ok := t.ids[j.idt.id]; ok && c.owner == b && rowCommitted(j) && j.decodeFailures == 0 {
			c.committed = true
		}
	}
	var done chan struct{}
	for _, j := range mine {
		if c, ok := t.ids[j.idt.id]; ok && c.owner == b {
			delete(t.ids, j.idt.id)
			done = c.done
		}
	}
	if done != nil {
		close(done)
	}
}

// rowCommitted reports whether a settled job left its id's row committed
// with its fingerprint: handled or skipped in a committed transaction, or
// found there already. A job skipped as an id conflict found the row of
// another payload.
func rowCommitted(j *job) bool {
	switch j.result {
	case ResultHandled, ResultDuplicate:
		return true
	case ResultSkipped:
		return !j.conflict
	}
	return false
}

// settleFollowers waits for each follower's twin, then acks the follower
// as a duplicate of the twin's committed claim, or runs it.
func (p *pipeline) settleFollowers(ctx context.Context, s *settler, followers []follower) {
	var rest []*job
	for _, f := range followers {
		if !p.followTwin(ctx, s, f.twin) {
			s.abandon(f.j)
			continue
		}
		if f.twin.committed && bytes.Equal(f.twin.fp, f.j.fp) {
			s.ack(f.j, ResultDuplicate)
			continue
		}
		rest = append(rest, f.j)
	}
	p.runGuarded(ctx, s, rest, false)
}

// followTwin waits for twin's batch to be settled, aside (pipeline.aside)
// when it is not yet: the twin may be waiting for its retry, an hour
// perhaps. It reports false when ctx ends first.
func (p *pipeline) followTwin(ctx context.Context, s *settler, twin *twinClaim) bool {
	select {
	case <-twin.done:
		return true
	default:
	}
	return p.aside(s, func() bool {
		select {
		case <-twin.done:
			return true
		case <-ctx.Done():
			return false
		}
	})
}
