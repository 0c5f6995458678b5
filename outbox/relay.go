package outbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceco/once/internal/backoff"
	"github.com/onceco/once/internal/isnil"
)

// ErrInvalidConfig is wrapped by NewRelay's errors for a bad RelayConfig.
var ErrInvalidConfig = errors.New("outbox: invalid relay config")

// Defaults of RelayConfig fields left zero.
const (
	DefaultBatchSize    = 500
	DefaultPollInterval = time.Second
	DefaultMaxAttempts  = 5
	// DefaultPublishTimeout is RelayConfig.PublishTimeout's default.
	DefaultPublishTimeout = time.Minute
)

// Backoff is an exponential backoff: Initial, doubled after each failure up
// to Max, with ±20% jitter.
type Backoff struct {
	// Initial is the first wait; at least a millisecond (a unit mistake:
	// 1 is 1 ns). Left at zero, it is the field's default capped at Max.
	Initial time.Duration
	// Max caps the wait; it must be at least Initial. Left at zero, it is
	// the field's default, or Initial when that is longer.
	Max time.Duration
}

// withDefaults fills in the half of b left at zero, as the consumer's
// backoffs do: Initial is initial capped at a Max that was set, Max is limit
// or a longer Initial that was set. Both set are kept as they are, to be
// checked.
func (b Backoff) withDefaults(initial, limit time.Duration) Backoff {
	switch {
	case b.Initial == 0 && b.Max == 0:
		return Backoff{Initial: initial, Max: limit}
	case b.Initial == 0 && b.Max > 0:
		b.Initial = min(initial, b.Max)
	case b.Max == 0 && b.Initial > 0:
		b.Max = max(limit, b.Initial)
	}
	return b
}

// delay is the jittered wait before attempt n+1 after n failures (n >= 1):
// the library's one backoff.
func (b Backoff) delay(n int) time.Duration {
	return backoff.Policy{Initial: b.Initial, Max: b.Max}.Delay(n)
}

// RelayConfig configures a Relay. Every field has a default.
type RelayConfig struct {
	// Store is the outbox table the relay publishes. Defaults to
	// New(Config{}): "outbox" on the pool's search_path.
	Store *Store
	// SkipMigrate stops Run from creating the table at start. Defaults to
	// false: Run migrates (idempotently).
	SkipMigrate bool

	// BatchSize is how many rows the relay reads, publishes and marks at a
	// time. Defaults to DefaultBatchSize (500). A read also stops once the
	// bodies of its rows reach 16 MiB (its first row is always read), so
	// that it arrives within the relay's bound on its statements.
	BatchSize int
	// PollInterval is how long the relay waits for a notification before
	// it looks for rows anyway (a notification is sent when a transaction
	// that added rows commits; polling covers one lost with a broken
	// connection, and rows whose retry is due). It is also how often a
	// relay that is not the leader tries to become it. Defaults to
	// DefaultPollInterval (1s); NewRelay refuses one below a millisecond
	// (a unit mistake: 1 is 1 ns).
	PollInterval time.Duration

	// KeepSent is how long a published row is kept (with sent_at set)
	// before the leader deletes it: an audit window. The leader deletes
	// expired rows in passes of about 100 ms with publishing between them,
	// so a large backlog of them delays the outbox's messages by a pass at
	// most. Defaults to 0: a row is deleted as soon as the broker confirmed
	// it.
	KeepSent time.Duration

	// MaxAttempts is how many times a row the broker rejects (Rejected) is
	// published before it is parked. Defaults to DefaultMaxAttempts (5); 1
	// parks it at the first rejection; at most math.MaxInt32, the most the
	// table's attempts column counts, which in effect never parks.
	MaxAttempts int
	// RetryBackoff paces the attempts of a rejected row. Defaults to 1s,
	// doubling up to 1m.
	RetryBackoff Backoff
	// InfraBackoff paces the retries after the broker or the database
	// failed (unreachable, timed out), which go on without bound and count
	// against no row. Defaults to 100ms, doubling up to 5s.
	InfraBackoff Backoff

	// PublishTimeout bounds each call to the publisher. Publish gets a
	// context with this deadline; a call of Publish, or of a Checker's
	// Check (which has no context), that has not returned PublishTimeout
	// plus a grace (5s, or PublishTimeout when shorter) after it began is
	// given up: the relay cannot stop the call's goroutine, so it logs the
	// call at level Error, naming it and how long it has run, sets
	// StalledMetric, ends its session (releasing leadership: another
	// relay on the table leads and publishes the rows, which nothing
	// settled) and does not lead again until the call returns, logging it
	// at level Error every PublishTimeout meanwhile: it never calls the
	// publisher from two goroutines. A record the call sends late is a
	// copy with its row's id, like one of a leader whose session was
	// killed. Set it above the publisher's own bounds (amqpout's
	// ConfirmTimeout; kafkaout returns when the context ends, but its
	// connect is bounded by its sarama settings alone). Defaults to
	// DefaultPublishTimeout (1m); NewRelay refuses one below a millisecond
	// (a unit mistake: 60 is 60 ns, past before any publish could end).
	PublishTimeout time.Duration

	// Logger receives leadership changes, parked rows and infrastructure
	// failures. Defaults to slog.Default().
	Logger *slog.Logger
	// MeterProvider makes the relay's metrics (PublishedMetric and the
	// others). Defaults to otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
	// TracerProvider makes a producer span per batch ("outbox publish"),
	// linked to the spans that wrote its rows. The messages themselves
	// carry their writer's trace context, so the next hop continues the
	// writer's trace. Defaults to otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
}

// withDefaults returns a copy of c with defaults applied, or an error
// naming the first invalid field.
func (c RelayConfig) withDefaults() (RelayConfig, error) {
	if c.Store == nil {
		c.Store = defaultStore
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.PollInterval == 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultMaxAttempts
	}
	c.RetryBackoff = c.RetryBackoff.withDefaults(time.Second, time.Minute)
	c.InfraBackoff = c.InfraBackoff.withDefaults(100*time.Millisecond, 5*time.Second)
	if c.PublishTimeout == 0 {
		c.PublishTimeout = DefaultPublishTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	switch {
	case c.BatchSize < 0:
		return c, fmt.Errorf("%w: BatchSize is negative (%d)", ErrInvalidConfig, c.BatchSize)
	case c.PollInterval < 0:
		return c, fmt.Errorf("%w: PollInterval is negative (%v)", ErrInvalidConfig, c.PollInterval)
	case c.KeepSent < 0:
		return c, fmt.Errorf("%w: KeepSent is negative (%v)", ErrInvalidConfig, c.KeepSent)
	case c.MaxAttempts < 0:
		return c, fmt.Errorf("%w: MaxAttempts is negative (%d)", ErrInvalidConfig, c.MaxAttempts)
	case c.MaxAttempts > math.MaxInt32:
		// It is compared with the rows' attempts, an integer column: a
		// larger value cannot be sent with them, and every settle of a
		// batch holding a refused record would fail.
		return c, fmt.Errorf("%w: MaxAttempts %d exceeds %d, the most the outbox's attempts column counts (use that for never parking)", ErrInvalidConfig, c.MaxAttempts, math.MaxInt32)
	case c.PublishTimeout < 0:
		return c, fmt.Errorf("%w: PublishTimeout is negative (%v)", ErrInvalidConfig, c.PublishTimeout)
	case c.Store.made() != nil:
		// A Store not made by New has no table nor statements: Run
		// panicked migrating it, or, with SkipMigrate, retried a name
		// the database cannot read for ever.
		return c, fmt.Errorf("%w: Store was not made by outbox.New", ErrInvalidConfig)
	}
	for _, f := range []struct {
		field string
		v     any
	}{{"MeterProvider", c.MeterProvider}, {"TracerProvider", c.TracerProvider}} {
		if f.v != nil && isnil.Value(f.v) {
			// A nil pointer in the interface (a provider left unset while
			// telemetry is off): NewRelay panicked on it.
			return c, fmt.Errorf("%w: %s is a nil %T", ErrInvalidConfig, f.field, f.v)
		}
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"PollInterval", c.PollInterval}, {"PublishTimeout", c.PublishTimeout}} {
		if d.v < time.Millisecond {
			// A unit mistake (PublishTimeout: 60 is 60 ns): every Publish
			// would get a context past its deadline, fail as the broker's
			// fault and be retried without end; PollInterval would poll
			// back to back.
			return c, fmt.Errorf("%w: %s %v is below a millisecond (a time.Duration counts nanoseconds)", ErrInvalidConfig, d.name, d.v)
		}
	}
	for _, b := range []struct {
		name string
		b    Backoff
	}{{"RetryBackoff", c.RetryBackoff}, {"InfraBackoff", c.InfraBackoff}} {
		if b.b.Initial <= 0 || b.b.Max < b.b.Initial {
			return c, fmt.Errorf("%w: %s needs 0 < Initial <= Max (got %v, %v)", ErrInvalidConfig, b.name, b.b.Initial, b.b.Max)
		}
		if b.b.Initial < time.Millisecond {
			// A unit mistake (Initial: 1 is 1 ns): a refused row would
			// spend its MaxAttempts at once, an outage's retries spin.
			return c, fmt.Errorf("%w: %s.Initial %v is below a millisecond (a time.Duration counts nanoseconds)", ErrInvalidConfig, b.name, b.b.Initial)
		}
	}
	return c, nil
}

// Relay publishes committed outbox rows and removes them once the broker
// confirmed them. Build it with NewRelay and start it with Run, in the
// producing service's process (beside its consumer.Consumer) or in a
// process of its own.
//
// Any number of relays may run on one table: one of them, the leader,
// publishes (it holds a PostgreSQL advisory lock on a connection of its
// own); the others wait and take over within PollInterval when the
// leader's session ends. A single publisher keeps each key's order without
// coordinating ranges of keys, and an outbox's throughput is bounded by
// the broker's confirmed-publish rate, which one relay's batches already
// approach.
type Relay struct {
	pool   *pgxpool.Pool
	pub    Publisher
	cfg    RelayConfig
	sql    relaySQL
	leader atomic.Bool
	ran    atomic.Bool
	// oid is the table's oid as the current session found it, which its
	// leader lock is keyed by and its statements check (newRelaySQL);
	// used by the session's goroutine only.
	oid uint32
	// markedAt is when the last read that marks waiting rows was sent
	// (fetchSQL); used by the session's goroutine only.
	markedAt time.Time
	// uncheckedLogged is when records the publisher could not check were
	// last logged (noteUnchecked); used by the session's goroutine only.
	uncheckedLogged time.Time
	// carried is what a session that ended could not write of the rows the
	// broker confirmed (takeCarried, carry); used by the session's
	// goroutine only.
	carried carriedSettlement
	// abandoned is the call to the publisher the relay gave up and that
	// has not returned yet (awaitAbandoned), nil when there is none; used
	// by the session's goroutine only. stalled is set meanwhile, for
	// StalledMetric.
	abandoned *abandonedCall
	stalled   atomic.Bool
	metrics   *relayMetrics
	tracer    trace.Tracer
}

// NewRelay returns a relay that reads the outbox through pool and
// publishes with pub. It fails with an error wrapping ErrInvalidConfig for
// a nil pool or publisher (also a nil pointer in the Publisher: that of a
// New whose error was dropped) or an invalid cfg (a nil pointer in its
// MeterProvider or TracerProvider, a Store not made by New). The relay
// does not close pub.
func NewRelay(pool *pgxpool.Pool, pub Publisher, cfg RelayConfig) (*Relay, error) {
	if pool == nil {
		return nil, fmt.Errorf("%w: pool is nil", ErrInvalidConfig)
	}
	if isnil.Value(pub) {
		// Also a nil pointer in the interface: a publisher whose New
		// failed, its error dropped.
		return nil, fmt.Errorf("%w: publisher is nil", ErrInvalidConfig)
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	r := &Relay{pool: pool, pub: pub, cfg: cfg, sql: newRelaySQL(cfg.Store.table)}
	if r.metrics, err = newRelayMetrics(cfg.MeterProvider, cfg.Store.label); err != nil {
		return nil, err
	}
	r.tracer = newTracer(cfg.TracerProvider)
	return r, nil
}

// Leader reports whether this relay currently holds the leader lock.
func (r *Relay) Leader() bool { return r.leader.Load() }

// Run relays until ctx is cancelled, then returns nil. It first creates
// the outbox table (unless RelayConfig.SkipMigrate) and returns that error
// if it fails for a reason waiting cannot cure (a table of another shape,
// a password or a permission refused); a database that is down,
// restarting or out of connections is waited for, the migration retried
// after RelayConfig.InfraBackoff and logged. With SkipMigrate it returns
// the error of Store.Check for a table of another shape (wrapping
// ErrSchemaMismatch). Losing the database
// connection, the broker failing or the table missing are logged and
// retried with RelayConfig.InfraBackoff; so are the broker refusing the
// publisher (Refused) and the database refusing the relay's role its
// login or a privilege on the table, which are logged at level Error. Once
// ctx is cancelled Run waits at most 5s for the broker's answer to the
// batch in flight; a batch left unanswered is published again by the next
// leader. A call to the publisher that does not return is given up after
// RelayConfig.PublishTimeout: the relay stops leading until it returns.
// Run may be called once. The relay's gauges (LeaderMetric,
// StalledMetric) are reported while Run runs: not before it is called
// (a relay made and not run reports none), nor once it returns.
func (r *Relay) Run(ctx context.Context) error {
	if !r.ran.CompareAndSwap(false, true) {
		return errors.New("outbox: Relay.Run called twice")
	}
	if err := r.metrics.start(r.Leader, r.stalled.Load); err != nil {
		return err
	}
	defer r.metrics.stop()
	if !r.cfg.SkipMigrate {
		if err := r.migrate(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
	} else if err := r.cfg.Store.Check(ctx, r.pool); errors.Is(err, ErrSchemaMismatch) && r.tableExists(ctx) {
		// A table of another shape; one that does not exist yet, or a
		// database that does not answer, is waited for below.
		return err
	}
	r.warnIfUnlogged(ctx)
	failures := 0
	for ctx.Err() == nil {
		if !r.awaitAbandoned(ctx) {
			break
		}
		led, err := r.session(ctx)
		if ctx.Err() != nil {
			break
		}
		var hung *hungCall
		if errors.As(err, &hung) {
			r.cfg.Logger.Error("outbox relay: a call to the publisher did not return within PublishTimeout; the relay gave it up "+
				"and stopped leading (another relay may lead; nothing of its batch was settled), and leads again once the call returns",
				"call", hung.name, "seq", hung.seq, "records", hung.records, "error", err)
			continue
		}
		if led {
			failures = 0
		}
		failures++
		if databaseRefused(err) {
			r.cfg.Logger.Error("outbox relay: the database refuses the relay's session (authentication or permissions); retrying until that is fixed", "error", err)
		} else {
			r.cfg.Logger.Warn("outbox relay: database session ended; reconnecting", "error", err)
		}
		if !backoff.Sleep(ctx, r.cfg.InfraBackoff.delay(failures)) {
			break
		}
	}
	return nil
}

// migrate runs the table's migration, retried after InfraBackoff for as
// long as the database is unavailable (down, restarting, out of
// connections) and ctx is live: a relay started during a database outage
// waits for it, as a consumer does. Any other failure is returned.
// (A migration whose session the server ended for idling, the process
// held up between two of its statements, is tried again by the migration
// itself.)
func (r *Relay) migrate(ctx context.Context) error {
	for failures := 1; ; failures++ {
		err := r.cfg.Store.Migrate(ctx, r.pool)
		if err == nil || ctx.Err() != nil || !databaseUnavailable(err) {
			return err
		}
		d := r.cfg.InfraBackoff.delay(failures)
		r.cfg.Logger.Warn("outbox relay: the database is unavailable to migrate the outbox table; retrying", "error", err, "backoff", d)
		if !backoff.Sleep(ctx, d) {
			return ctx.Err()
		}
	}
}

// databaseUnavailable reports whether err is the database unreachable, its
// connection lost, or the server shutting down, starting or out of
// connections or resources: what waiting cures. A refusal of the relay's
// role (databaseRefused) is not.
func databaseUnavailable(err error) bool {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return strings.HasPrefix(pe.Code, "08") || strings.HasPrefix(pe.Code, "53") ||
			strings.HasPrefix(pe.Code, "57P") || strings.HasPrefix(pe.Code, "58")
	}
	var ce *pgconn.ConnectError
	var ne net.Error
	return errors.As(err, &ce) || errors.As(err, &ne) || pgconn.Timeout(err) || pgconn.SafeToRetry(err) ||
		errors.Is(err, pgconn.ErrConnClosed) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}

// tableExists reports whether the outbox table exists (false when the
// database does not answer).
func (r *Relay) tableExists(ctx context.Context) bool {
	var exists bool
	err := r.pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, r.cfg.Store.table).Scan(&exists)
	return err == nil && exists
}

// readOnly reports whether err is the server refusing a write because it
// is read-only (25006): a standby, such as a primary demoted by a
// failover that the session is still connected to.
func readOnly(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "25006"
}

// carriedSettlement is the rows a session ended before it could remove
// them (or mark them sent), with the oid of the table they are rows of.
// Only confirmed rows are carried: a refusal not charged is met again.
type carriedSettlement struct {
	sent []int64
	oid  uint32
}

// carry keeps the rows of s the broker confirmed for the relay's next
// session.
func (r *Relay) carry(s settlement) {
	r.carried = carriedSettlement{sent: s.sent, oid: r.oid}
}

// takeCarried returns what the last session carried, to be written before
// the outbox is read again, unless the table was replaced since (its rows'
// seq then name other rows).
func (r *Relay) takeCarried() settlement {
	c := r.carried
	r.carried = carriedSettlement{}
	if len(c.sent) == 0 || c.oid != r.oid {
		return settlement{}
	}
	return settlement{sent: c.sent}
}

// databaseRefused reports whether err is PostgreSQL refusing the relay's
// role what it needs: the authentication (SQLSTATE class 28) or a
// privilege (42501), which waiting does not give.
func databaseRefused(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (strings.HasPrefix(pe.Code, "28") || pe.Code == "42501")
}

// leaderLockClass is the first key of the leader lock; the second is the
// outbox table's oid, so that each table (in each schema) has one leader.
const leaderLockClass = 0x6f626f78 // "obox"

// session opens a connection of its own (from the pool's ConnConfig, with
// the pool's BeforeConnect, AfterConnect and BeforeClose hooks), waits to become the leader and
// relays until the connection fails or ctx is done. It reports whether it
// led at all.
func (r *Relay) session(ctx context.Context) (led bool, err error) {
	// Made like the pool's connections, its hooks included: one that sets
	// the search_path (AfterConnect) decides which table the name is, and
	// one that fetches credentials (BeforeConnect) whether it connects.
	pc := r.pool.Config()
	cc := pc.ConnConfig.Copy()
	if pc.BeforeConnect != nil {
		if err := pc.BeforeConnect(ctx, cc); err != nil {
			return false, fmt.Errorf("connect: the pool's BeforeConnect: %w", err)
		}
	}
	if cc.RuntimeParams == nil {
		cc.RuntimeParams = map[string]string{}
	}
	// The batch query's cost estimate can pass jit_above_cost, and JIT
	// compiling it takes longer than running it.
	cc.RuntimeParams["jit"] = "off"
	// A row lock held by another transaction (a row edited by hand, a
	// Requeue in a longer transaction) fails the relay's statement within
	// settleTimeout, its connection kept: the settlement of a batch the
	// broker confirmed is then written again, and nothing is published
	// meanwhile. Waiting instead until settleTimeout closed the connection
	// (pgx closes one whose statement is cancelled): the next session read
	// the batch again and published all of it again.
	cc.RuntimeParams["lock_timeout"] = strconv.FormatInt(lockTimeout.Milliseconds(), 10)
	// A notification can arrive while the relay is busy with a batch (the
	// connection reads it with a statement's results): it is noted here,
	// so that the next wait returns at once instead of a PollInterval
	// later. pgx's default handler would queue every notification of the
	// session where the relay never reads it, and keep them all.
	notified := new(atomic.Bool)
	cc.OnNotification = func(*pgconn.PgConn, *pgconn.Notification) { notified.Store(true) }
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return false, fmt.Errorf("connect: %w", err)
	}
	defer func() {
		// Closing the session releases the leader lock: stop claiming to
		// lead first, so that two relays never both report Leader.
		r.leader.Store(false)
		if pc.BeforeClose != nil {
			pc.BeforeClose(conn)
		}
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	if pc.AfterConnect != nil {
		if err := pc.AfterConnect(ctx, conn); err != nil {
			return false, fmt.Errorf("connect: the pool's AfterConnect: %w", err)
		}
	}
	r.askForKeepalives(ctx, conn, cc.RuntimeParams)
	oid, err := lookUpTable(ctx, conn, r.cfg.Store.table)
	if err != nil {
		return false, err
	}
	if oid == nil {
		return false, fmt.Errorf("table %s does not exist (run outbox's Migrate, or leave RelayConfig.SkipMigrate false)", r.cfg.Store.table)
	}
	r.oid = *oid
	if err := r.becomeLeader(ctx, conn, *oid); err != nil {
		return false, err
	}
	r.leader.Store(true)
	r.cfg.Logger.Info("outbox relay: leading", "table", r.cfg.Store.table)
	channel := "once_outbox_" + strconv.FormatUint(uint64(*oid), 10)
	lctx, cancel := bounded(ctx)
	_, err = conn.Exec(lctx, "LISTEN "+pgx.Identifier{channel}.Sanitize())
	cancel()
	if err != nil {
		return true, fmt.Errorf("listen: %w", err)
	}
	return true, r.lead(ctx, conn, notified)
}

// lookUpTable returns the oid of table (nil: no such table) on conn.
func lookUpTable(ctx context.Context, conn *pgx.Conn, table string) (*uint32, error) {
	ctx, cancel := bounded(ctx)
	defer cancel()
	var oid *uint32
	if err := conn.QueryRow(ctx, `SELECT to_regclass($1)::oid`, table).Scan(&oid); err != nil {
		return nil, fmt.Errorf("look up table %s: %w", table, err)
	}
	return oid, nil
}

// leaderKeepalives are the server's TCP keepalive settings of the
// relay's session: the server gives up on a peer that stopped answering
// (a leader whose host died or was cut off, which sends no FIN) within
// about a minute, and the leader lock goes with the session. With the
// operating system's defaults it would keep the session, and the lock,
// for two hours and more, and no other relay could lead meanwhile.
var leaderKeepalives = []struct{ name, value string }{
	{"tcp_keepalives_idle", "30"},     // seconds without traffic before the first probe
	{"tcp_keepalives_interval", "10"}, // seconds between probes
	{"tcp_keepalives_count", "3"},     // probes unanswered before the server gives up
	{"tcp_user_timeout", "60000"},     // ms data sent may stay unacknowledged
}

// askForKeepalives sets leaderKeepalives on the session, except those the
// connection string sets (params). A server that refuses them (a platform
// without the socket option) is logged at level Warn: the relay leads all
// the same, and a dead leader's lock is then kept as long as the
// server's own settings say.
func (r *Relay) askForKeepalives(ctx context.Context, conn *pgx.Conn, params map[string]string) {
	var sets []string
	var args []any
	for _, k := range leaderKeepalives {
		if _, ok := params[k.name]; ok {
			continue
		}
		args = append(args, k.name, k.value)
		sets = append(sets, fmt.Sprintf("set_config($%d, $%d, false)", len(args)-1, len(args)))
	}
	if len(sets) == 0 {
		return
	}
	ctx, cancel := bounded(ctx)
	defer cancel()
	if _, err := conn.Exec(ctx, "SELECT "+strings.Join(sets, ", "), args...); err != nil {
		r.cfg.Logger.Warn("outbox relay: the server refused TCP keepalive settings for the relay's session; "+
			"if this relay's host dies, its leader lock is kept until the server's own keepalives give up",
			"table", r.cfg.Store.table, "error", err)
	}
}

// becomeLeader polls the leader lock every PollInterval until it has it.
func (r *Relay) becomeLeader(ctx context.Context, conn *pgx.Conn, oid uint32) error {
	for {
		ok, err := tryLeaderLock(ctx, conn, oid)
		if err != nil {
			return fmt.Errorf("leader lock: %w", err)
		}
		if ok {
			return nil
		}
		if !backoff.Sleep(ctx, r.cfg.PollInterval) {
			return ctx.Err()
		}
	}
}

// tryLeaderLock asks for the leader lock of the table oid on conn once,
// and reports whether the session holds it.
func tryLeaderLock(ctx context.Context, conn *pgx.Conn, oid uint32) (ok bool, err error) {
	ctx, cancel := bounded(ctx)
	defer cancel()
	err = conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1, $2)`, int32(leaderLockClass), int32(oid)).Scan(&ok)
	return ok, err
}

// lead relays batches while it is the leader. While a full batch is being
// published the next one is read, so that the database's work overlaps the
// broker's; anything less than a full batch is followed by a wait for a
// notification (at most PollInterval). It returns when ctx is done or the
// connection failed.
func (r *Relay) lead(ctx context.Context, conn *pgx.Conn, notified *atomic.Bool) error {
	failures := 0
	var lastCleanup time.Time
	cleaning := false // a cleanup pass stopped with rows left
	var ahead []Record
	// deferred is the last batch's settlement when relayBatch left it to
	// be written during the next publish (which it then returned rows
	// for), or one the database refused; it is written before the relay
	// reads the outbox again, waits or stops.
	deferred := r.takeCarried()
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
		defer cancel()
		if err := r.settleDeferred(sctx, conn, &deferred); err != nil {
			r.carry(deferred)
			r.cfg.Logger.Warn("outbox relay: marking published rows failed; the relay's next session writes it first "+
				"(a relay that leads meanwhile publishes them again)", "error", err)
		}
	}()
	for ctx.Err() == nil {
		batch, err := ahead, error(nil)
		ahead = nil
		if batch == nil {
			// A settlement the database refused is written first: its rows
			// are still in the outbox, and would be published again.
			if !deferred.empty() {
				sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
				err = r.settleDeferred(sctx, conn, &deferred)
				cancel()
			}
			if err == nil {
				batch, err = r.fetch(ctx, conn, nil)
			}
			if err == nil && len(batch) == 0 {
				// Nothing to publish, or a table replaced since the
				// session began, which its statements leave alone.
				if err := r.sameTable(ctx, conn); err != nil {
					return err
				}
			}
		}
		if err == nil && len(batch) > 0 {
			ahead, err = r.relayBatch(ctx, conn, batch, &deferred)
		}
		if err != nil && ctx.Err() == nil && (conn.IsClosed() || readOnly(err)) && !errors.As(err, new(*hungCall)) {
			// The batch failed for the database, which ends the session:
			// counted as a failed batch like the others, or a database
			// outage would never show in FailuresMetric.
			r.metrics.failures.Add(ctx, 1, r.metrics.attrs)
		}
		if conn.IsClosed() {
			return fmt.Errorf("relay: %w", err)
		}
		if readOnly(err) {
			// The session's server was demoted (a failover): a new
			// connection reaches the one the connection string names
			// now. What the broker confirmed is carried to it.
			return fmt.Errorf("relay: the server is read-only: %w", err)
		}
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			var hung *hungCall
			if errors.As(err, &hung) {
				// The session ends, and the leader lock with it: the
				// publisher may not be called again until the call
				// returns (Run waits for it).
				return err
			}
			failures++
			r.metrics.failures.Add(ctx, 1, r.metrics.attrs)
			d := r.cfg.InfraBackoff.delay(failures)
			if IsRefused(err) {
				r.metrics.refusals.Add(ctx, 1, r.metrics.attrs)
				r.cfg.Logger.Error("outbox relay: the broker refuses the publisher (credentials, permissions, TLS or SASL settings); "+
					"no row is charged, retrying until that is fixed", "error", err, "backoff", d)
			} else if errors.Is(err, errBrokenPublisher) {
				r.cfg.Logger.Error("outbox relay: the publisher broke its contract; "+
					"no row is deleted or charged, retrying until that is fixed", "error", err, "backoff", d)
			} else if databaseRefused(err) {
				r.cfg.Logger.Error("outbox relay: the database refuses the relay (authentication or permissions on the outbox table); "+
					"retrying until that is fixed", "error", err, "backoff", d)
			} else {
				r.cfg.Logger.Warn("outbox relay: publishing failed; retrying", "error", err, "backoff", d)
			}
			backoff.Sleep(ctx, d)
			continue
		}
		failures = 0
		cleanupMore := false
		if r.cfg.KeepSent > 0 && (cleaning || time.Since(lastCleanup) >= r.cleanupInterval()) {
			more, err := r.cleanup(ctx, conn)
			if err != nil && ctx.Err() == nil {
				r.cfg.Logger.Warn("outbox relay: removing sent rows failed", "error", err)
			}
			// A pass that stopped with rows left is followed by another
			// after the next publish (at once when there is none), until
			// the rows past KeepSent are gone.
			cleaning, cleanupMore = more, more
			if !more {
				lastCleanup = time.Now()
			}
		}
		if r.full(batch) || cleanupMore {
			continue
		}
		if err := r.wait(ctx, conn, notified); err != nil {
			return err
		}
	}
	return nil
}

// sameTable returns an error when the table's name no longer resolves to
// the table whose leader lock the session holds (dropped, or made again):
// the session must end, and the next look the table up again.
func (r *Relay) sameTable(ctx context.Context, conn *pgx.Conn) error {
	var oid *uint32
	sctx, cancel := bounded(ctx)
	defer cancel()
	if err := conn.QueryRow(sctx, `SELECT to_regclass($1)::oid`, r.cfg.Store.table).Scan(&oid); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("look up table %s: %w", r.cfg.Store.table, err)
	}
	if oid == nil || *oid != r.oid {
		return fmt.Errorf("table %s was dropped or replaced since this session began (oid %d): looking it up again", r.cfg.Store.table, r.oid)
	}
	return nil
}

// wait returns on a notification (at once for one that arrived since the
// last wait returned), after PollInterval, or when ctx is done; an error
// means the connection failed.
func (r *Relay) wait(ctx context.Context, conn *pgx.Conn, notified *atomic.Bool) error {
	if notified.Swap(false) {
		return nil
	}
	wctx, cancel := context.WithTimeout(ctx, r.cfg.PollInterval)
	defer cancel()
	err := conn.PgConn().WaitForNotification(wctx)
	notified.Store(false) // the one that ended this wait
	if err == nil || ctx.Err() != nil || (wctx.Err() != nil && !conn.IsClosed()) {
		return nil
	}
	return fmt.Errorf("wait for notification: %w", err)
}

// cleanupInterval is how often the leader deletes rows kept past KeepSent:
// a quarter of KeepSent, between 1s and 1m.
func (r *Relay) cleanupInterval() time.Duration {
	return min(max(r.cfg.KeepSent/4, time.Second), time.Minute)
}

// warnIfUnlogged logs a warning when the outbox table, or one of its
// partitions, is UNLOGGED (made so by hand, for speed): PostgreSQL empties
// such a table after a crash while the tables written beside the rows keep
// their changes, so the messages of committed transactions not yet
// published are lost. A table the relay cannot ask about is not judged.
func (r *Relay) warnIfUnlogged(ctx context.Context) {
	// The partitions too: PostgreSQL empties an UNLOGGED partition as it
	// does an UNLOGGED table, and a partitioned table's own persistence
	// says nothing of them.
	rows, err := r.pool.Query(ctx, `SELECT c.oid::regclass::text FROM pg_class c
WHERE (c.oid = to_regclass($1) OR c.oid IN (SELECT relid FROM pg_partition_tree(to_regclass($1)))) AND c.relpersistence = 'u'
ORDER BY 1`, r.cfg.Store.Table())
	var unlogged []string
	if err == nil {
		unlogged, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if err != nil {
		r.cfg.Logger.Debug("outbox relay: cannot read whether the outbox table is logged", "table", r.cfg.Store.Table(), "error", err)
		return
	}
	for _, table := range unlogged {
		r.cfg.Logger.Warn("outbox relay: the outbox table is UNLOGGED: PostgreSQL empties it after a crash while the tables written "+
			"beside its rows keep their changes, so the messages of committed transactions not yet published are lost; ALTER TABLE ... SET LOGGED",
			"table", table)
	}
}
