package consumer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/isnil"
)

// pipeline carries every message through the same four stages, a single
// message being a batch of one:
//
//	dispatch.go  deliveries to workers: one lane per stream, in order
//	identify.go  id, type, decoded payload, fingerprint (user code guarded)
//	guard.go     the crash guard: durable records for messages that may have
//	             crashed a process; suspects run isolated
//	transact.go  claim and run: BEGIN with the claims, handlers, queued
//	             statements, COMMIT (execute.go retries and splits)
//	settle.go    ack, dead-letter or abandon, in stream order
//
// Errors are classified once (classify.go); every wait uses one backoff
// (internal/backoff).
type pipeline struct {
	cfg     Config
	pool    *pgxpool.Pool
	src     Source
	prepare preparer
	// sha256Fingerprint: Identify.Fingerprint is the default, the SHA-256
	// of the value, which each job then keeps in its own array (no
	// allocation per message).
	sha256Fingerprint bool
	// askXIDStatus is p.xidStatus, bound once: a method value made per
	// transaction would be an allocation each.
	askXIDStatus func(ctx context.Context, conn *pgx.Conn, xid int64) (*string, error)
	// batchCall, set for a BatchHandler, runs the handler once for the
	// claimed jobs of a batch.
	batchCall func(ctx context.Context, tx pgx.Tx, jobs []*job) error
	guard     *crashGuard
	// twins holds the ids unordered batches are claiming (twins.go).
	twins *twins
	// spare, set by the dispatcher, gives the unordered batches another
	// worker while one of theirs waits aside (pipeline.aside); it returns
	// the function that ends the wait.
	spare func() (end func())
	// unorderedRunning, set by the dispatcher, counts the unordered
	// batches running a transaction (batcher.running).
	unorderedRunning *atomic.Int32
	tel              *telemetry
	stats            counters
	// sem bounds the runs in progress to Config.Concurrency;
	// slotWaiters counts the workers waiting for one.
	sem         chan struct{}
	slotWaiters atomic.Int32
	started     atomic.Bool
	// stopping is set, and stopped closed, once Run's context is done: no
	// new transaction starts, a batch in progress is rolled back, and
	// waits between attempts end.
	stopping atomic.Bool
	stopped  chan struct{}
	stopOnce sync.Once
	// work is done at the shutdown deadline (ShutdownTimeout after Run's
	// context), when work in flight is cut short.
	work context.Context
	// broken is set when the source is given up on (sourcepanics.go).
	broken brokenSource
	// watch holds the calls in progress that the consumer does not cut
	// (watch.go); watchPrepare is set when identifying or
	// decoding a message calls one.
	watch        watchdog
	watchPrepare bool
	// handlerWatchAfter is Config.handlerWatchAfter.
	handlerWatchAfter time.Duration
	// sessionsRead is what readSessions read of the pool's sessions; nil
	// until a read succeeds (read at start, before any handler runs, and
	// read again at the watchdog's ticks while it fails: see sessions).
	sessionsRead atomic.Pointer[sessionSettings]
	// sessionsTried is when the watchdog last tried to read them again
	// (readSessionsAgain); the watchdog's goroutine alone uses it.
	sessionsTried time.Time
	// identifyCall names the user functions identifying a message calls.
	identifyCall string
	// streamsBounded: the source bounds each stream's deliveries by
	// itself (StreamBounder), and ReceiveBuffer does not.
	streamsBounded bool
}

func newPipeline(pool *pgxpool.Pool, src Source, cfg Config, prep preparer) (*pipeline, error) {
	if pool == nil {
		return nil, fmt.Errorf("%w: pool is nil", ErrInvalidConfig)
	}
	if isnil.Value(src) {
		// Also a nil pointer in the interface: a source whose Open
		// failed, its error dropped.
		return nil, fmt.Errorf("%w: source is nil", ErrInvalidConfig)
	}
	defaultFingerprint := cfg.Identify.Fingerprint == nil
	watchPrepare := cfg.Decoder != nil || cfg.Identify.EventID != nil || cfg.Envelope != nil || !defaultFingerprint
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	cfg.fitPool(pool)
	system, group, err := sourceNames(src)
	if err != nil {
		return nil, err
	}
	streamsBounded, err := boundsStreams(src)
	if err != nil {
		return nil, err
	}
	if err := warnDeliveryLimit(src, &cfg); err != nil {
		return nil, err
	}
	tel, err := newTelemetry(&cfg, system, group)
	if err != nil {
		return nil, fmt.Errorf("once: telemetry: %w", err)
	}
	p := &pipeline{cfg: cfg, pool: pool, src: src, prepare: prep, tel: tel,
		sem: make(chan struct{}, cfg.Concurrency), stopped: make(chan struct{}), twins: newTwins(), work: context.Background()}
	p.sha256Fingerprint = defaultFingerprint
	p.streamsBounded = streamsBounded
	p.watchPrepare = watchPrepare
	switch {
	case cfg.Envelope != nil && cfg.Identify.EventID != nil:
		p.identifyCall = "Envelope or Identify.EventID"
	case cfg.Envelope != nil:
		p.identifyCall = "Envelope"
	default:
		p.identifyCall = "Identify.EventID"
	}
	p.watch.after = cfg.watchAfter()
	p.handlerWatchAfter = cfg.handlerWatchAfter()
	p.askXIDStatus = p.xidStatus
	p.guard = newCrashGuard(p)
	return p, nil
}

// sourceNames asks src for the names telemetry reports (SystemNamer,
// GroupNamer): "unknown" and "" where it gives none. A panic in either is
// an error wrapping ErrSourceBroken.
func sourceNames(src Source) (system, group string, err error) {
	system = "unknown"
	if n, ok := src.(SystemNamer); ok {
		err = sourceCall("MessagingSystem", func() error { system = n.MessagingSystem(); return nil })
	}
	if g, ok := src.(GroupNamer); ok && err == nil {
		err = sourceCall("ConsumerGroup", func() error { group = g.ConsumerGroup(); return nil })
	}
	return system, group, err
}

// boundsStreams asks src whether it bounds its streams (StreamBounder);
// a panic in it is an error wrapping ErrSourceBroken.
func boundsStreams(src Source) (bounded bool, err error) {
	if b, ok := src.(StreamBounder); ok {
		err = sourceCall("BoundsStreams", func() error { bounded = b.BoundsStreams(); return nil })
	}
	return bounded, err
}

// warnDeliveryLimit logs a warning when src's broker takes a message away
// after no more redeliveries than cfg.CrashGuard.MaxCrashes
// (DeliveryLimiter): a crash loop would leave for the broker's own
// dead-letter exchange, or be dropped, before the crash guard dead-letters
// it. A warning, not a refusal: the limit is the queue's, which cannot
// change while it exists, and the broker still moves such a message
// aside. A panic in DeliveryLimit is an error wrapping ErrSourceBroken.
func warnDeliveryLimit(src Source, cfg *Config) error {
	l, ok := src.(DeliveryLimiter)
	if !ok {
		return nil
	}
	var limit int64
	if err := sourceCall("DeliveryLimit", func() error { limit = l.DeliveryLimit(); return nil }); err != nil {
		return err
	}
	if limit <= 0 || limit > int64(cfg.CrashGuard.MaxCrashes) {
		return nil
	}
	cfg.Telemetry.Logger.Warn("once: the broker takes a message away after it delivered it again no more times than CrashGuard.MaxCrashes: "+
		"a message that crashes the process every time goes to the queue's own dead-letter exchange (or is dropped without one), "+
		"without the consumer's dead-letter headers, before the crash guard dead-letters it as crash-loop, and lost connections "+
		"count towards the limit too; declare the queue with a delivery limit above CrashGuard.MaxCrashes, or set MaxCrashes below the limit",
		"consumer", cfg.Name, "delivery_limit", limit, "max_crashes", cfg.CrashGuard.MaxCrashes)
	return nil
}

func (p *pipeline) consume(ctx context.Context) error {
	if !p.started.CompareAndSwap(false, true) {
		return errors.New("once: Run called twice")
	}
	if err := p.start(ctx); err != nil {
		_ = p.closeSource()
		var outage *startOutage
		if ctx.Err() != nil && !errors.As(err, &outage) {
			return nil // stopped during start-up
		}
		return fmt.Errorf("once: consumer %q: %w", p.cfg.Name, err)
	}
	// In-flight work outlives ctx by up to ShutdownTimeout.
	work, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	p.work = work
	stopWatch := context.AfterFunc(ctx, p.stop)
	defer stopWatch()
	// A source given up on (sourcePanicked) ends the receive loop as a
	// fatal Receive error would.
	receiving, stopReceiving := context.WithCancel(ctx)
	defer stopReceiving()
	p.broken.stopReceiving = stopReceiving
	d := newDispatcher(p, work)
	// Retention ends with Run, also after a fatal source error, when ctx
	// may still be live.
	retain, stopRetention := context.WithCancel(ctx)
	defer stopRetention()
	var retaining sync.WaitGroup
	// The watchdog outlives the work in flight, whose hooks it watches,
	// also past the shutdown deadline: a user function that ignores its
	// context holds Run until it returns, and is logged as ever.
	watching, stopWatching := context.WithCancel(context.WithoutCancel(ctx))
	defer stopWatching()
	retaining.Add(1)
	go func() {
		defer retaining.Done()
		p.watchUserCalls(watching)
	}()
	if p.cfg.Retention.MaxAge > 0 {
		retaining.Add(1)
		go func() {
			defer retaining.Done()
			p.retention(retain)
		}()
	}

	fatal := d.receive(receiving)
	if err := p.brokenErr(); err != nil {
		fatal = err
	}

	p.stop() // after a fatal source error, ctx may still be live
	stopRetention()
	d.close()
	if !waitTimeout(&d.wg, p.cfg.ShutdownTimeout) {
		p.cfg.Telemetry.Logger.WarnContext(ctx, "once: shutdown timeout: rolling back messages in flight; they will be redelivered",
			"consumer", p.cfg.Name, "timeout", p.cfg.ShutdownTimeout)
		cancelWork()
		d.wg.Wait()
	}
	stopWatching()
	retaining.Wait()
	p.guard.close()
	if err := p.closeSource(); err != nil {
		return errors.Join(fatal, fmt.Errorf("once: closing source: %w", err))
	}
	return fatal
}

// closeSource closes the source; a panic in its Close is Close's error,
// wrapping ErrSourceBroken.
func (p *pipeline) closeSource() error {
	return sourceCall("Close", p.src.Close)
}

// detached returns a context with ctx's values that is not done with ctx
// but at the shutdown deadline: for the consumer's own statements that
// must outlive a lost delivery (a rollback, a crash-guard record), yet
// never Config.ShutdownTimeout, also on a database that stopped
// answering.
func (p *pipeline) detached(ctx context.Context) (context.Context, context.CancelFunc) {
	c, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(p.work, cancel)
	return c, func() { stop(); cancel() }
}

// cancelOnStop calls cancel when the consumer begins stopping, unless ctx
// ends first: for a wait that is not a sleep (pipeline.sleep) and must end
// at the shutdown as waits do.
func (p *pipeline) cancelOnStop(ctx context.Context, cancel context.CancelFunc) {
	go func() {
		select {
		case <-p.stopped:
			cancel()
		case <-ctx.Done():
		}
	}()
}

// stop begins the shutdown: no new transaction starts and waits end.
func (p *pipeline) stop() {
	p.stopOnce.Do(func() {
		p.stopping.Store(true)
		close(p.stopped)
	})
}

// start prepares the store: migrates its tables, or, when the user
// manages them (SkipMigrate), checks their shape, so that a table of
// another shape fails Run at once instead of every claim.
//
// A failure retrying can cure (the database restarting or failing over, a
// connection refused or cut: ClassInfrastructure) is retried after
// Config.InfraBackoff until ctx ends, as any infrastructure failure is,
// and then returned (a *startOutage: the consumer never started, which a
// database address that is wrong looks like too); any other (a table of
// another shape, a password or a permission refused) is returned at once.
// (A migration whose session the server ended for idling, the process held
// up between two of its statements, is tried again by the migration
// itself.)
func (p *pipeline) start(ctx context.Context) error {
	var refused, outage error
	err := p.infra(ctx, "preparing the store", Retry{}, func() error {
		err := p.startOnce(ctx)
		switch {
		case err == nil || ctx.Err() != nil:
		case Classify(err) != ClassInfrastructure:
			refused = err // not retried
			return nil
		default:
			outage = err
		}
		return err
	})
	switch {
	case refused != nil:
		return refused
	case err != nil && outage != nil:
		return &startOutage{err: outage}
	case err == nil:
		p.warnIfCommitsNotDurable(ctx)
		p.warnIfTablesUnlogged(ctx)
		p.readSessions(ctx)
	}
	return err
}

// startOutage is the last infrastructure failure of a start that ctx
// ended while it was retried.
type startOutage struct{ err error }

func (e *startOutage) Error() string {
	return "stopped before the database could be reached: " + e.err.Error()
}

func (e *startOutage) Unwrap() error { return e.err }

func (p *pipeline) startOnce(ctx context.Context) error {
	var err error
	if p.cfg.SkipMigrate {
		err = p.cfg.Store.Check(ctx, p.pool)
	} else {
		err = p.cfg.Store.Migrate(ctx, p.pool)
	}
	if err != nil {
		return err
	}
	if err := p.guard.bindTable(ctx); err != nil {
		return err
	}
	p.warnIfSchemaNewer(ctx)
	return p.bindProgress(ctx)
}

// warnIfSchemaNewer logs a warning when the store's tables are at a newer
// version than this release knows: a newer release migrated them, and
// recorded that this one runs on them (Migrate refuses them otherwise),
// as after a deploy rolled back. Nothing is wrong; it says why the newer
// release's features are gone.
func (p *pipeline) warnIfSchemaNewer(ctx context.Context) {
	v, err := p.cfg.Store.Version(ctx, p.pool)
	if err != nil || v <= dedup.SchemaVersion {
		return
	}
	p.cfg.Telemetry.Logger.WarnContext(ctx, "once: the dedup tables are at a newer schema version than this release knows, "+
		"which the release that migrated them recorded this one runs on (a deploy rolled back?); running",
		"consumer", p.cfg.Name, "schema_version", v, "release_schema_version", dedup.SchemaVersion)
}

// process takes deliveries of one stream assignment (or of one channel)
// through the stages, in order. With window set they are among the first
// messages of a new assignment, which the crash guard marks. It returns how
// many were claimed as new.
func (p *pipeline) process(work context.Context, dvs []received, window bool, s *settler) (claimed int) {
	release := p.takeSlot()
	defer release()
	return p.execute(p.identifyBatch(work, dvs), window, s)
}

// takeSlot waits for one of the Config.Concurrency slots of the runs in
// progress and returns the function that gives it back.
func (p *pipeline) takeSlot() (release func()) {
	select {
	case p.sem <- struct{}{}:
	default:
		p.slotWaiters.Add(1)
		p.sem <- struct{}{}
		p.slotWaiters.Add(-1)
	}
	return func() { <-p.sem }
}

// batch is deliveries of one stream assignment (or of one channel) that
// went through the identify stage together, ready for the others.
type batch struct {
	// ctx is the batch's: done when the consumer's work ends or when any
	// of the deliveries can no longer be acked.
	ctx     context.Context
	release func()
	// jobs are the messages to claim and run, in stream order;
	// unhandleable the ones identify gave a failure, to dead-letter.
	jobs, unhandleable []*job
	ordered            bool
}

// identifyBatch is the identify stage of dvs. It takes no transaction slot:
// an ordered lane identifies its next batch while the one before runs.
func (p *pipeline) identifyBatch(work context.Context, dvs []received) *batch {
	// The deliveries share their fate: if any can no longer be acked
	// (revoked partition, closed channel), the rest are abandoned.
	ctx, cancel := context.WithCancel(work)
	var stops []func() bool
	var watched context.Context
	for _, dv := range dvs {
		// Deliveries of one assignment or channel share their context:
		// watch each distinct one once.
		if c := dv.dctx; c != watched {
			watched = c
			stops = append(stops, context.AfterFunc(c, cancel))
		}
	}
	b := &batch{ctx: ctx, ordered: dvs[0].m.Stream != "", jobs: make([]*job, 0, len(dvs)),
		release: func() {
			for _, stop := range stops {
				stop()
			}
			cancel()
		}}
	// The batch's jobs in one allocation: a job kept after its batch (a
	// held dead letter, a twin's follower) keeps the others' memory until
	// it is settled, which a bounded number of batches in flight allows.
	slab := make([]job, len(dvs))
	for i, dv := range dvs {
		j := &slab[i]
		p.identify(ctx, dv, j)
		j.seq = i
		if j.failure == nil {
			b.jobs = append(b.jobs, j)
		} else {
			b.unhandleable = append(b.unhandleable, j)
		}
	}
	return b
}

// execute takes a prepared batch through the claim-and-run and settle
// stages and returns how many of its messages were claimed as new. The
// caller holds a slot (takeSlot).
func (p *pipeline) execute(b *batch, window bool, s *settler) (claimed int) {
	defer b.release()
	defer b.endSpans()
	n := int64(len(b.jobs) + len(b.unhandleable))
	p.tel.inflight.Add(b.ctx, n, p.tel.baseAdd...)
	defer p.tel.inflight.Add(b.ctx, -n, p.tel.baseAdd...)

	before := s.claimed
	if b.ordered {
		// A message that cannot be handled does not split the batch: the
		// others run in one transaction, and it is dead-lettered in its
		// place among the acks (settler.hold).
		s.hold(b.unhandleable)
		p.runGuarded(b.ctx, s, b.jobs, window)
		s.releaseHeld()
		return s.claimed - before
	}
	mine, followers := p.twins.register(b)
	p.runGuarded(b.ctx, s, mine, window)
	p.twins.release(b, mine)
	// No order to keep: the others do not wait for these dead letters,
	// which a blocked dead-letter destination (a RabbitMQ resource alarm)
	// can hold up for long.
	for _, j := range b.unhandleable {
		s.deadLetter(j.ctx, j, j.failure)
	}
	p.settleFollowers(b.ctx, s, followers)
	return s.claimed - before
}

// giveUp abandons deliveries received but never started, the consumer
// stopping, and everything after them in s's run: they are identified (for
// OnOutcome and their spans), never claimed nor run.
func (p *pipeline) giveUp(work context.Context, dvs []received, s *settler) {
	b := p.identifyBatch(work, dvs)
	defer b.release()
	defer b.endSpans()
	s.abandoned = true
	s.abandonAll(b.jobs)
	s.abandonAll(b.unhandleable)
}

// endSpans ends the span of every message of b.
func (b *batch) endSpans() {
	for _, j := range b.jobs {
		j.span.End()
	}
	for _, j := range b.unhandleable {
		j.span.End()
	}
}

// runGuarded passes jobs through the crash guard and runs what it plans.
// A job whose decoding asked to be tried again later (job.undecoded)
// splits them as a failing handler splits a batch: the jobs before it
// run, then it is decoded again (decodeAgain) and, once decoded, passed
// through the crash guard and run alone, and only then the jobs after it
// run. It never reaches the crash guard undecoded: the id it would be
// marked or looked up by may be another once an Envelope opens.
func (p *pipeline) runGuarded(ctx context.Context, s *settler, jobs []*job, window bool) {
	for len(jobs) > 0 {
		i := firstUndecoded(jobs)
		p.runDecoded(ctx, s, jobs[:i], window)
		if i == len(jobs) {
			return
		}
		if p.decodeAgain(ctx, s, jobs[i]) {
			p.runDecoded(ctx, s, jobs[i:i+1], window)
		}
		jobs = jobs[i+1:]
	}
}

// firstUndecoded returns the index of the first of jobs to be decoded
// again, len(jobs) when there is none.
func firstUndecoded(jobs []*job) int {
	for i, j := range jobs {
		if j.undecoded != nil {
			return i
		}
	}
	return len(jobs)
}

// runDecoded is runGuarded for jobs that are all decoded.
func (p *pipeline) runDecoded(ctx context.Context, s *settler, jobs []*job, window bool) {
	if len(jobs) == 0 {
		return
	}
	if s.abandoned {
		s.abandonAll(jobs)
		return
	}
	if !window && !anyRedelivered(jobs) {
		// The steady path: nothing for the crash guard to look at.
		p.run(ctx, s, jobs)
		return
	}
	runs := p.guard.plan(ctx, jobs, window)
	if runs == nil {
		s.abandonAll(jobs)
		return
	}
	for _, run := range runs {
		p.run(ctx, s, run)
	}
}

// anyRedelivered reports whether the broker says any of jobs may have been
// delivered before.
func anyRedelivered(jobs []*job) bool {
	for _, j := range jobs {
		if mayBeRedelivery(j.m) {
			return true
		}
	}
	return false
}

// retention deletes the consumer's old processed-event rows every
// Retention.Interval.
func (p *pipeline) retention(ctx context.Context) {
	t := time.NewTicker(p.cfg.Retention.Interval)
	defer t.Stop()
	for {
		n, err := p.expire(ctx)
		switch {
		case err != nil && ctx.Err() == nil && databaseRefused(err):
			// Refused at every pass until a grant: the table grows.
			p.cfg.Telemetry.Logger.ErrorContext(ctx, "once: retention refused by the database (authentication or privileges); "+
				"processed_events grows until that is fixed", "consumer", p.cfg.Name, "error", err)
		case err != nil && ctx.Err() == nil:
			p.cfg.Telemetry.Logger.WarnContext(ctx, "once: retention failed", "consumer", p.cfg.Name, "error", err)
		case n > 0:
			p.cfg.Telemetry.Logger.InfoContext(ctx, "once: retention removed processed events", "consumer", p.cfg.Name, "rows", n)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// expire deletes the consumer's rows older than Retention.MaxAge by the
// database's clock, which wrote their processed_at (dedup.Cutoff).
func (p *pipeline) expire(ctx context.Context) (int64, error) {
	cutoff, err := dedup.Cutoff(ctx, p.pool, p.cfg.Retention.MaxAge)
	if err != nil {
		return 0, err
	}
	return p.cfg.Store.DeleteOlderThan(ctx, p.pool, p.cfg.Name, cutoff, 1000, dedup.DutyCycle(p.cfg.Retention.DutyCycle))
}

func waitTimeout(wg *sync.WaitGroup, d time.Duration) bool {
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
		return true
	case <-time.After(d):
		return false
	}
}
