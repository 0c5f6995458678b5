package consumer

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/isnil"
	"github.com/onceco/once/internal/pgtext"
)

// ErrInvalidConfig is wrapped by every configuration error New returns.
var ErrInvalidConfig = errors.New("once: invalid config")

// Decoder decodes a payload into v, a pointer to the handler's payload type.
type Decoder func(data []byte, v any) error

// JSON decodes with encoding/json: unknown fields are ignored, so JSON of a
// different shape decodes into a zero value. Use StrictJSON to reject it.
func JSON(data []byte, v any) error { return json.Unmarshal(data, v) }

// StrictJSON decodes with encoding/json and rejects unknown fields and
// trailing data.
func StrictJSON(data []byte, v any) error {
	d := json.NewDecoder(bytesReader(data))
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil {
		return err
	}
	// Only white space may follow: Decoder.More reports false for a
	// closing bracket or brace, so `{...}}` would pass it.
	if _, err := d.Token(); err != io.EOF {
		return errors.New("trailing data after JSON value")
	}
	return nil
}

// NoFingerprint is a Config.Identify.Fingerprint that stores none: a repeated id is
// a duplicate whatever its payload, and no id conflict is ever reported.
func NoFingerprint(*Message) []byte { return nil }

// IDConflictPolicy says what to do with a message whose event id was
// processed before with a different payload fingerprint.
type IDConflictPolicy int

const (
	// DeadLetterConflicts dead-letters the message with kind
	// KindIDConflict; both fingerprints and the original's processed-at time
	// are in its headers. The default.
	DeadLetterConflicts IDConflictPolicy = iota
	// SkipConflicts acks the message like a duplicate and logs a warning.
	SkipConflicts
)

// Config configures a Consumer. Only Name is required; every other field has
// a documented default, and the zero value of each part is its defaults.
// New returns an error wrapping ErrInvalidConfig, naming the field, for a
// value it cannot use, a nil pointer in an interface field (Envelope,
// Telemetry's providers) among them: set none to take the default.
type Config struct {
	// Name identifies the consumer: processed events are recorded per Name,
	// so two services consuming the same topic under different names each
	// handle every event, and two replicas of one service must share it.
	// Required; at most 200 bytes of UTF-8 text without NUL, which
	// PostgreSQL's text refuses.
	Name string

	// Store is the processed-events store, made by dedup.New (New
	// refuses one that was not, such as new(dedup.Store)). Defaults to
	// dedup.New with the default table "processed_events" on the pool's
	// search_path.
	Store *dedup.Store
	// SkipMigrate stops Run from migrating the store's tables at start
	// (for a schema managed with goose or golang-migrate); Run then only
	// checks their shape with dedup.Store.Check and fails, naming what
	// differs, when they are missing or of another shape. Defaults to
	// false: Run migrates (idempotently) to dedup.SchemaVersion.
	SkipMigrate bool

	// Decoder decodes payloads. Defaults to JSON. A []byte payload type
	// receives the raw bytes without decoding. An error dead-letters the
	// message at once with kind KindDecode: the same bytes fail the same
	// way on every try. A Decoder whose failure may pass (it depends on a
	// service, such as a schema registry, that is down for a moment)
	// returns its error wrapped in RetryAfter(d, err): the message is
	// decoded again after d (a Router's too), in its place in its stream
	// (on an ordered stream the messages after it wait, as for a
	// handler's retry), counted against Retry.MaxAttempts, and
	// dead-lettered with kind KindDecode once they are spent (Permanent
	// around it wins, as in Classify); the handler's runs, once it
	// decodes, are counted apart. It is never cut short (it takes no
	// context): one that hangs holds its stream, or the receive loop,
	// until it returns, and is logged at Error once it has run past
	// HandlerTimeout (see HandlerTimeout).
	Decoder Decoder
	// Envelope, when set, opens each message into id, type and payload
	// (e.g. JSONEnvelope for CloudEvents' structured JSON). Defaults to nil:
	// the whole value is the payload.
	Envelope Envelope
	// Identify says where a message's event id and type come from and how
	// a repeated id is checked.
	Identify IdentifyConfig

	// Concurrency bounds how many transactions (a message, or a batch of
	// one stream's messages) run at once, across all streams. Messages of
	// one stream (a Kafka partition) are always handled one after another.
	// A stream's message waiting between two tries (its retry's backoff, a
	// RetryAfter, an infrastructure failure's backoff, a dead-letter
	// destination that is down) runs no transaction and takes none of
	// them: the other streams go on meanwhile. (So does an unordered
	// message, or a copy waiting for its original: a stand-in worker takes
	// the batches that come meanwhile, and the source's own bound, the
	// RabbitMQ prefetch, bounds the messages waiting so.) Each running
	// transaction holds one connection of the pool, so
	// Concurrency defaults to the pool's MaxConns (pgxpool's own default is
	// the greater of 4 and the number of CPUs; set pool_max_conns to run
	// more). A Concurrency above MaxConns is accepted, with a warning: the
	// extra transactions wait for a connection, which is never charged to a
	// message (see HandlerTimeout) but adds latency. With the default every
	// connection may hold a transaction: a handler that queries the pool
	// instead of its tx then waits for a connection that only its own
	// return frees (until HandlerTimeout, a failure charged to it). Such a
	// handler needs a pool larger than Concurrency. The crash guard opens
	// one more connection, outside the pool, at the first attempt of a
	// suspect (the lock every such attempt holds), and keeps it until Run
	// ends: count it against the server's max_connections. At most 262,143
	// (2^18 - 1), PostgreSQL's own bound on max_connections, which no pool
	// can pass: Run starts a worker for each at its start, a few kilobytes
	// each, so a larger value (math.MaxInt, meant as no bound) could not
	// run.
	Concurrency int
	// ReceiveBuffer is how many received messages may wait to be handled,
	// across all streams, before receiving blocks; the broker's own buffers
	// come on top. A stream may take any share of it, so one busy stream
	// never holds up the others while there is room. Defaults to
	// 2 × Concurrency × Batch.Size, at least 256: enough for every worker
	// to find a full batch waiting when it finishes one. It counts
	// messages, not bytes: the memory it holds is about ReceiveBuffer times
	// the message size, so lower it for large messages. A source that
	// bounds each stream by itself (StreamBounder: the Kafka adapter's
	// MaxPendingPerPartition) is not bound by it, so that a stream stuck
	// with a backlog does not take it all and stop the others. At most
	// 1,048,576 (2^20), which the default does not pass either: Run makes
	// room for that many messages at its start, a few dozen bytes each
	// whatever waits, so a larger value (math.MaxInt, meant as no bound)
	// could not run.
	ReceiveBuffer int
	// Batch says how many messages share a transaction.
	Batch BatchConfig

	// HandlerTimeout bounds each call of the handler (a BatchHandler's
	// call with its whole batch). It does not bound what the consumer does
	// itself: waiting for a pool connection, the claim, sending queued
	// statements and the commit are infrastructure time, never charged to
	// a message. A handler past its timeout that returns an error, or nil
	// after the timeout cut one of its statements (pgx closes the
	// connection under it), fails like a handler error (ClassRetry, then
	// the dead-letter queue), whatever its error (one that returns nil past
	// it with no statement cut left its transaction whole, and commits), but
	// for one cut in a statement that was waiting for another session's
	// lock (a migration that rewrites the table, or waits in line for its
	// lock behind a long query; a long transaction): that wait is not the
	// message's doing, and is retried as infrastructure, the log naming the
	// server processes in the way (the consumer asks the database, on a
	// connection of its own, what handler calls past half their timeout
	// wait for; not behind a connection pooler, whose process ids are not
	// the server's: there such a cut is charged). A handler call that has run for DatabaseTimeout is cut
	// before its timeout, as infrastructure, when the server says its
	// transaction's server process is gone (a connection whose server
	// vanished without a word: a failover, a dropped connection; not
	// asked once the transaction is older than the sessions'
	// idle_in_transaction_session_timeout or transaction_timeout, which
	// end a session too). One that ignores its context still holds its stream
	// until it returns, and once it has run for twice HandlerTimeout it is
	// logged at Error,
	// naming its message, and counted in Stats.StuckCalls (not under
	// NoHandlerTimeout).
	// Defaults to DefaultHandlerTimeout (one minute): the handler holds a
	// transaction and a pool connection all along, and on RabbitMQ its
	// delivery, which the broker takes back after its consumer_timeout (30
	// minutes by default), so Retry.MaxAttempts runs of it must fit well
	// within that. -1 lifts the bound (the consumer's context alone ends the
	// call); other negative values, and positive ones below a millisecond
	// (a unit mistake: 30 is 30 ns, and would cut every call before its
	// first statement), are refused with ErrInvalidConfig.
	//
	// The other functions a service hands the consumer (the Hooks but
	// Middleware, Decoder, Envelope, Identify.EventID and a custom
	// Identify.Fingerprint) are not cut short: the Decoder, Envelope,
	// EventID and Fingerprint take no context, and a hook runs once its
	// messages' fate is settled (AfterCommit and OnOutcome after the
	// commit, which cutting them would not undo), and Go cannot stop a
	// function that ignores its context. One that has run past
	// HandlerTimeout (DefaultHandlerTimeout under NoHandlerTimeout) is
	// logged at Error once, naming the function, the message's topic,
	// partition, offset (the queue, -1 and -1 on RabbitMQ) and event id,
	// and how long it has run, and counted in Stats.StuckCalls; it holds
	// its stream (an unordered message: a worker) until it returns. A
	// Source's Ack, DeadLetter, RecordProgress and FirstPositionDone are
	// watched the same way: they take a context, but one that ignores it
	// would otherwise hold its stream without a word.
	HandlerTimeout time.Duration
	// DatabaseTimeout is how long the consumer waits for an answer from the
	// database before it asks whether anyone is still there. A connection
	// whose server vanished without a word reaching the consumer's host (a
	// failover's old primary, a middlebox or load balancer that dropped
	// the connection) leaves a statement on it unanswered until the
	// operating system gives up on the connection, about a quarter of an
	// hour with Linux's defaults, and its stream stands still meanwhile.
	//
	// Taking a pool connection once one is free (pgxpool's ping of a
	// connection that idled, a new connection's dial) is bounded by
	// DatabaseTimeout; waiting for a connection others hold is not. Every
	// other step of the consumer's own (the BEGIN with the claims, the
	// recording of progress, the COMMIT, a rollback, the crash guard's
	// records, its statements after a handler ended the transaction
	// itself), each handler call (also under NoHandlerTimeout), and each send of
	// the statements handlers queued (Event.Queue) that has waited
	// DatabaseTimeout has its connection's server process asked after, on
	// a connection opened for the question (pg_stat_activity), every
	// quarter of DatabaseTimeout: while it is there, in its transaction
	// (a slow statement, a claim waiting for another transaction's claim
	// of the same id, a COMMIT running deferred triggers or waiting for a
	// synchronous standby, a handler working outside the database), the
	// wait goes on; gone, the call is cut. A step of the consumer's is
	// cut also when the server cannot be reached to ask. A handler call
	// whose transaction is older than the sessions'
	// idle_in_transaction_session_timeout or transaction_timeout (read at
	// start) is not asked after: the server may have ended it for that,
	// the handler's doing. Behind a connection pooler whose process ids
	// are not the server's (PgBouncer; compared with pg_backend_pid() at
	// start, and at the watchdog's ticks until that succeeds), nothing
	// is asked, and each step of the consumer's is cut at
	// DatabaseTimeout, a slow one too.
	//
	// A cut closes the connection, and the pool's others with it
	// (pgxpool.Pool.Reset: what stranded one has most likely stranded them
	// all; those in use are closed when released), and the transaction is
	// retried on a new connection as infrastructure: never charged to a
	// message, logged at Warn. A COMMIT cut so loses nothing: its retry
	// finds the claims committed, if the commit happened, and acks the
	// messages as duplicates. Defaults to DefaultDatabaseTimeout (30
	// seconds); NoDatabaseTimeout (-1) lifts the bound and the questions;
	// other negative values, and positive ones below a millisecond (a unit
	// mistake: 30 is 30 ns, and would cut every step), are refused with
	// ErrInvalidConfig.
	DatabaseTimeout time.Duration
	// ShutdownTimeout bounds how long Run waits, once its context is
	// cancelled, for messages in flight to finish; then their transactions
	// are rolled back and they are left unacked for redelivery, and the
	// consumer's own statements end too, also on a database that stopped
	// answering. The handlers' contexts are cancelled then; Run still waits
	// for the user's functions (handlers, hooks, decoders) to return, so
	// one that ignores its context or blocks holds Run up past the
	// timeout, logged by the watchdog as at any other time (see
	// HandlerTimeout). Defaults to 10s.
	ShutdownTimeout time.Duration

	// Retry bounds the retries of failing handlers and says which errors
	// are failures of the message and which of the infrastructure.
	Retry RetryPolicy
	// InfraBackoff paces retries after infrastructure failures.
	InfraBackoff Backoff
	// CrashGuard dead-letters a message that keeps crashing the process.
	CrashGuard CrashGuardConfig
	// Retention deletes this consumer's old processed-event rows.
	Retention RetentionConfig

	// Hooks observe and extend what happens to messages (outcomes,
	// retries, after-commit actions, handler middleware). Defaults to none.
	Hooks Hooks
	// Telemetry says where logs, spans and metrics go.
	Telemetry TelemetryConfig
}

// IdentifyConfig says how a consumer finds a message's event id and type,
// and what a repeated id with another payload means. Config.Identify.
type IdentifyConfig struct {
	// IDHeaders are the headers an event id is read from when the broker
	// has no native id property, first match wins. Defaults to "id",
	// "ce_id", "message-id".
	IDHeaders []string
	// TypeHeaders are the headers the event type is read from when the
	// broker has no native type property. Defaults to "type", "ce_type".
	TypeHeaders []string
	// EventID, when set, replaces the id rule altogether: it returns the id of
	// m, or an error that dead-letters m with kind KindMissingID and no event
	// id (the ids m carries are not its id under EventID; a redrive of the
	// dead letter asks EventID again). One whose failure may pass (it looks
	// the id up in a service that is down for a moment) returns its error
	// wrapped in RetryAfter(d, err): m is identified again after d, in its
	// place in its stream, as a Decoder's RetryAfter is (see Decoder; OnRetry
	// Reason RetryDecode), counted against Retry.MaxAttempts, and
	// dead-lettered with kind KindMissingID once they are spent (Permanent
	// around it wins). An empty id with no error takes Message.FallbackID (the
	// position, on Kafka), and without one dead-letters m with KindMissingID
	// too. It runs on the consumer's goroutines, one message at a time per
	// stream; a panic in it dead-letters the message with kind KindPanic; one
	// that hangs is never cut, but logged (see Config.HandlerTimeout).
	// Defaults to nil: Message.ID, then IDHeaders, then the envelope's id,
	// then Message.FallbackID. It is not asked for the id of a redriven copy
	// of this consumer's own dead letter (HeaderRedriveEventID); on a copy of
	// another consumer's, m.FallbackID is the first delivery's
	// (HeaderRedriveFallbackID), not the copy's position.
	EventID func(m *Message) (string, error)
	// MaxIDLength bounds event ids, in bytes; longer ones are dead-lettered
	// with kind KindInvalidID. Defaults to 256; at most 2048, since an id
	// is part of the dedup tables' primary keys, which PostgreSQL's btree
	// bounds at about 2,700 bytes a key. It bounds the ids events carry:
	// an id equal to the message's Message.FallbackID (the adapter's own,
	// a Kafka position on a topic named with up to 249 characters) is
	// bound by 2048 bytes alone.
	MaxIDLength int
	// Fingerprint computes the fingerprint stored with a claim and compared
	// when the same id arrives again; a message for which it returns nil
	// stores none, and is a duplicate of its id whatever its payload. Set
	// it to NoFingerprint to turn fingerprints off. Defaults to the SHA-256
	// of the message value.
	Fingerprint func(m *Message) []byte
	// OnConflict says what happens to a repeated id with a different
	// fingerprint. Defaults to DeadLetterConflicts.
	OnConflict IDConflictPolicy
}

// BatchConfig says how many messages of one stream share a transaction.
// Config.Batch.
type BatchConfig struct {
	// Size is the most messages of one stream handled in one transaction:
	// one statement claims all their ids, the handlers run in turn, one
	// commit, then the acks. Batches form from what is already waiting (see
	// Linger), so under light load a batch is one message and latency
	// stays low. A failing handler rolls the batch back; the messages
	// before it run again as a batch, it runs alone under the retry policy,
	// and the rest continue: order is kept and no other message's effect
	// is lost or doubled. Handlers in a batch share a transaction, so
	// effects outside it (HTTP calls) may repeat when another message of
	// the batch fails. A batch's transaction lasts as long as its
	// handlers together: a server's idle_in_transaction_session_timeout
	// or transaction_timeout (PostgreSQL 17) that ends it is charged to
	// no message; the batch is halved until its runs fit, and only a
	// message whose handler alone runs past the limit is charged. Set
	// those limits above Size times a handler's time, or lower Size. A
	// batch that fails for memory (53200: among others, the shared lock
	// table, which the locks of all its handlers may overflow together)
	// is halved too, charged to no message; a message whose run alone
	// overflows the lock table twice in a row is charged (its handler
	// alone overflows it). The server out of memory is never charged.
	// Defaults to 100; 1 gives one transaction per message.
	Size int
	// Linger is how long to wait for a batch to fill once its first
	// message is there. Defaults to 0: no wait.
	Linger time.Duration
}

// RetryPolicy bounds the retries of a failing handler, and classifies
// errors. Attempt n (n >= 2) waits InitialBackoff * 2^(n-2), capped at
// MaxBackoff, with ±20% jitter. Config.Retry.
type RetryPolicy struct {
	// MaxAttempts is how many times the handler runs before the message is
	// dead-lettered, the first run included, and runs cut short by a crash
	// of the process included where the crash guard saw them. Defaults to
	// 5; 1 means no retry.
	MaxAttempts int
	// InitialBackoff is the wait before the second attempt. Defaults to
	// 200ms, or to MaxBackoff when that is set and shorter. New refuses a
	// positive backoff below a millisecond (a unit mistake: 10 is 10 ns),
	// here and in MaxBackoff and InfraBackoff.
	InitialBackoff time.Duration
	// MaxBackoff caps the wait between attempts. Defaults to 10s, or to
	// InitialBackoff when that is longer (the wait then never grows). Set
	// both, and InitialBackoff may not exceed it.
	MaxBackoff time.Duration
	// Classify, when set, decides what an error met while handling a
	// message is (ClassInfrastructure, ClassRetry or ClassPermanent): the
	// handler's own error, the failure of a statement it queued, or a
	// COMMIT the database refused (one that lost its connection is
	// infrastructure, and not asked about). def is the default class (see Classify); return it for
	// errors you do not know. It runs on the worker's goroutine and must
	// not block; a panic in it is logged and def is used. Defaults to nil:
	// def. For example, to treat a unique violation as permanent:
	//
	//	Classify: func(err error, def consumer.ErrorClass) consumer.ErrorClass {
	//		var pgErr *pgconn.PgError
	//		if errors.As(err, &pgErr) && pgErr.Code == "23505" {
	//			return consumer.ClassPermanent
	//		}
	//		return def
	//	},
	Classify func(err error, def ErrorClass) ErrorClass
}

// Backoff paces the retries after infrastructure failures (database or
// broker unreachable), which go on until they succeed or the consumer stops:
// such a message is never dead-lettered. Config.InfraBackoff.
type Backoff struct {
	// Initial is the first wait. Defaults to 100ms, or to Max when that is
	// set and shorter. New refuses a positive Initial or Max below a
	// millisecond (a unit mistake: 10 is 10 ns).
	Initial time.Duration
	// Max caps the wait. Defaults to 5s, or to Initial when that is longer
	// (the wait then never grows). Set both, and Initial may not exceed it.
	Max time.Duration
}

// CrashGuardConfig bounds how often one message may crash the process.
// Config.CrashGuard; docs/guarantees.md says how crashes are counted.
type CrashGuardConfig struct {
	// MaxCrashes is how many times a message may crash the process (a
	// crash, an OOM kill, a stall past the shutdown deadline) while it runs
	// alone before it is dead-lettered with kind KindCrashLoop. Counted
	// durably, and only for messages that may have been in flight at a
	// crash; such a message runs isolated from every other, so a crash is
	// charged to it alone. Crashed runs also count towards
	// Retry.MaxAttempts. An attempt alone whose transaction loses its
	// database session (its handler's statement crashed the server, or
	// was killed for its memory) counts as a crash too, not as a run; the
	// messages of a transaction that lost its session twice run alone
	// after.
	// Defaults to 3.
	MaxCrashes int
}

// minRetentionMaxAge is the shortest Retention.MaxAge New accepts.
const minRetentionMaxAge = time.Second

// minDuration is the shortest HandlerTimeout, DatabaseTimeout,
// Retention.Interval and backoff New accepts: a shorter one is a unit
// mistake (30 meant as seconds is 30 ns), with which nothing can work.
const minDuration = time.Millisecond

// RetentionConfig deletes a consumer's processed-event rows once they are
// old enough that no redelivery can need them. Config.Retention.
type RetentionConfig struct {
	// MaxAge, when positive, makes Run delete this consumer's
	// processed-event rows (those of its Name only) older than MaxAge,
	// every Interval, in short batches. Age is measured by the database's
	// clock, which wrote the rows (dedup.Cutoff), so a skew between the
	// consumer's host and the database's does not shorten the window. It
	// must exceed the longest time a message can take to be redelivered
	// (see docs/operations.md).
	// Defaults to 0: rows are kept. A positive MaxAge below one second
	// (a unit mistake: 24 is 24 ns) is refused by New.
	MaxAge time.Duration
	// Interval is how often retention runs. Defaults to 1h. A positive
	// Interval below a millisecond (a unit mistake: 24 is 24 ns, with
	// which sweeps run back to back) is refused by New.
	Interval time.Duration
	// DutyCycle is the share of its time a sweep may spend deleting: after
	// each statement it waits so that deleting takes at most this share
	// (dedup.DutyCycle), leaving the table and its indexes to the
	// consumer's own claims. Retention then deletes at about DutyCycle
	// times its full speed (measured: 322k rows/s at full speed on two
	// cores, so about 32k rows/s at the default), which must stay above
	// the rate at which this consumer claims ids. In (0, 1]; 1 does not
	// wait. Defaults to 0.1.
	DutyCycle float64
}

// TelemetryConfig says where a consumer's logs, spans and metrics go.
// Config.Telemetry; docs/operations.md lists every span attribute and
// metric.
type TelemetryConfig struct {
	// Logger receives warnings (infrastructure failures, dead letters),
	// errors (the database refusing the consumer's role its own work:
	// SQLSTATE 42501 or class 28, retried as infrastructure) and, at debug
	// level, per-message events, with the message's context so a
	// handler that logs carries the trace id. Payloads are never logged.
	// Defaults to slog.Default().
	Logger *slog.Logger
	// TracerProvider makes the per-message consumer spans. Defaults to
	// otel.GetTracerProvider(); while that is OpenTelemetry's default,
	// with no provider installed, no span is made (the handler's context
	// still carries the producer's span context), and a provider set
	// later with otel.SetTracerProvider gets every span from then on.
	TracerProvider trace.TracerProvider
	// MeterProvider makes the consumer's metrics. Defaults to
	// otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
}

const maxNameLength = 200

// maxReceiveBuffer is the greatest ReceiveBuffer: Run makes a channel of
// that many slots at its start (dispatcher.unordered), a few dozen bytes
// each whatever waits in it, so math.MaxInt, meant as no bound, panicked
// Run, and a billion took tens of gigabytes. A million is far above what
// keeps every worker in full batches (2 × Concurrency × Batch.Size).
const maxReceiveBuffer = 1 << 20

// maxConcurrency is the greatest Concurrency: PostgreSQL's most
// connections (max_connections is at most 2^18 - 1, its MAX_BACKENDS), so
// no pool holds more and no more transactions could ever run at once. Run
// starts a worker goroutine for each unit of Concurrency at its start, a
// few kilobytes each whatever runs: math.MaxInt or 1<<30, meant as no
// bound, took terabytes and got the process killed.
const maxConcurrency = 1<<18 - 1

// maxIDLimit is the greatest Identify.MaxIDLength: an id of that many bytes,
// beside a Name of maxNameLength, fits a btree key of the dedup tables'
// primary keys (consumer, event_id), which PostgreSQL refuses past 2,704
// bytes (8 kB pages) on every try.
const maxIDLimit = 2048

// The store refuses a claim whose key is longer than dedup.MaxKeyLength:
// the longest name and id must fit, or this fails to compile.
var _ [dedup.MaxKeyLength - maxNameLength - maxIDLimit]struct{}

// DefaultHandlerTimeout is Config.HandlerTimeout's default.
const DefaultHandlerTimeout = time.Minute

// NoHandlerTimeout lifts the bound on each handler call when set as
// Config.HandlerTimeout. Such a call is still cut when its connection's
// server process is found gone (Config.DatabaseTimeout), and a cancel of
// its statement by the sessions' statement_timeout while it waited for
// another session's lock is still infrastructure.
const NoHandlerTimeout time.Duration = -1

// DefaultDatabaseTimeout is Config.DatabaseTimeout's default.
const DefaultDatabaseTimeout = 30 * time.Second

// NoDatabaseTimeout lifts, set as Config.DatabaseTimeout, the bound on
// taking a pool connection and the questions after the sessions of long
// waits: only the operating system ends a wait on a stranded connection.
const NoDatabaseTimeout time.Duration = -1

// withDefaults validates c and returns it with defaults filled in.
func (c Config) withDefaults() (Config, error) {
	if err := c.validate(); err != nil {
		return c, err
	}
	if c.Store == nil {
		s, err := dedup.New(dedup.Config{})
		if err != nil {
			return c, err
		}
		c.Store = s
	}
	if c.Decoder == nil {
		c.Decoder = JSON
	}
	id := &c.Identify
	if id.IDHeaders == nil {
		id.IDHeaders = []string{"id", "ce_id", "message-id"}
	}
	if id.TypeHeaders == nil {
		id.TypeHeaders = []string{"type", "ce_type"}
	}
	setDefault(&id.MaxIDLength, 256)
	if id.Fingerprint == nil {
		id.Fingerprint = sha256Value
	}
	setDefault(&c.Batch.Size, 100)
	setDefault(&c.Retry.MaxAttempts, 5)
	setDefault(&c.Retry.InitialBackoff, capped(200*time.Millisecond, c.Retry.MaxBackoff))
	setDefault(&c.Retry.MaxBackoff, 10*time.Second)
	setDefault(&c.InfraBackoff.Initial, capped(100*time.Millisecond, c.InfraBackoff.Max))
	setDefault(&c.InfraBackoff.Max, 5*time.Second)
	setDefault(&c.CrashGuard.MaxCrashes, 3)
	setDefault(&c.ShutdownTimeout, 10*time.Second)
	setDefault(&c.HandlerTimeout, DefaultHandlerTimeout)
	setDefault(&c.DatabaseTimeout, DefaultDatabaseTimeout)
	setDefault(&c.Retention.Interval, time.Hour)
	if c.Retention.DutyCycle == 0 {
		c.Retention.DutyCycle = 0.1
	}
	if c.Telemetry.Logger == nil {
		c.Telemetry.Logger = slog.Default()
	}
	return c, nil
}

// validate checks what no default can repair, naming the field.
func (c *Config) validate() error {
	if c.Name == "" {
		return fmt.Errorf("%w: Name is required", ErrInvalidConfig)
	}
	if len(c.Name) > maxNameLength {
		return fmt.Errorf("%w: Name is longer than %d bytes", ErrInvalidConfig, maxNameLength)
	}
	if !pgtext.Storable(c.Name) {
		return fmt.Errorf("%w: Name is not UTF-8 text without NUL, which PostgreSQL cannot store", ErrInvalidConfig)
	}
	checks := []struct {
		field string
		bad   bool
	}{
		{"Identify.MaxIDLength", c.Identify.MaxIDLength < 0},
		{"Batch.Size", c.Batch.Size < 0},
		{"Batch.Linger", c.Batch.Linger < 0},
		{"Concurrency", c.Concurrency < 0},
		{"ReceiveBuffer", c.ReceiveBuffer < 0},
		{"Retry.MaxAttempts", c.Retry.MaxAttempts < 0},
		{"Retry.InitialBackoff", c.Retry.InitialBackoff < 0},
		{"Retry.MaxBackoff", c.Retry.MaxBackoff < 0},
		{"InfraBackoff.Initial", c.InfraBackoff.Initial < 0},
		{"InfraBackoff.Max", c.InfraBackoff.Max < 0},
		{"CrashGuard.MaxCrashes", c.CrashGuard.MaxCrashes < 0},
		{"ShutdownTimeout", c.ShutdownTimeout < 0},
		{"Retention.MaxAge", c.Retention.MaxAge < 0},
		{"Retention.Interval", c.Retention.Interval < 0},
	}
	for _, ch := range checks {
		if ch.bad {
			return fmt.Errorf("%w: %s must not be negative", ErrInvalidConfig, ch.field)
		}
	}
	if c.HandlerTimeout < NoHandlerTimeout {
		return fmt.Errorf("%w: HandlerTimeout must not be negative, but for NoHandlerTimeout (-1)", ErrInvalidConfig)
	}
	if c.DatabaseTimeout < NoDatabaseTimeout {
		return fmt.Errorf("%w: DatabaseTimeout must not be negative, but for NoDatabaseTimeout (-1)", ErrInvalidConfig)
	}
	for _, d := range []struct {
		field string
		v     time.Duration
	}{
		// A unit mistake (HandlerTimeout: 30 is 30 ns): every handler
		// call is cut before its first statement and every message
		// dead-lettered; every step of the consumer's is cut and nothing
		// is consumed; retention sweeps back to back; a handler's
		// retries are spent within microseconds, and an outage's
		// infrastructure retries spin, a warning logged for each.
		{"HandlerTimeout", c.HandlerTimeout},
		{"DatabaseTimeout", c.DatabaseTimeout},
		{"Retention.Interval", c.Retention.Interval},
		{"Retry.InitialBackoff", c.Retry.InitialBackoff},
		{"Retry.MaxBackoff", c.Retry.MaxBackoff},
		{"InfraBackoff.Initial", c.InfraBackoff.Initial},
		{"InfraBackoff.Max", c.InfraBackoff.Max},
	} {
		if d.v > 0 && d.v < minDuration {
			return fmt.Errorf("%w: %s %v is below %v (a time.Duration counts nanoseconds)", ErrInvalidConfig, d.field, d.v, minDuration)
		}
	}
	if c.Store != nil && c.Store.ProcessedTable() == "" {
		// A Store not made by dedup.New has no tables nor statements:
		// Run panicked migrating it.
		return fmt.Errorf("%w: Store was not made by dedup.New", ErrInvalidConfig)
	}
	for _, f := range []struct {
		field string
		v     any
	}{
		{"Envelope", c.Envelope},
		{"Telemetry.TracerProvider", c.Telemetry.TracerProvider},
		{"Telemetry.MeterProvider", c.Telemetry.MeterProvider},
	} {
		if f.v != nil && isnil.Value(f.v) {
			// A nil pointer in the interface (left unset when tracing
			// is off, or a constructor's error dropped): a nil Envelope
			// dead-lettered every message as a panic, a nil provider
			// panicked New.
			return fmt.Errorf("%w: %s is a nil %T", ErrInvalidConfig, f.field, f.v)
		}
	}
	for i, mw := range c.Hooks.Middleware {
		if mw == nil {
			// Every handler call would panic through it.
			return fmt.Errorf("%w: Hooks.Middleware[%d] is nil", ErrInvalidConfig, i)
		}
	}
	if c.Concurrency > maxConcurrency {
		return fmt.Errorf("%w: Concurrency %d exceeds %d, PostgreSQL's most connections: Run starts a worker for each at its start",
			ErrInvalidConfig, c.Concurrency, maxConcurrency)
	}
	if c.ReceiveBuffer > maxReceiveBuffer {
		return fmt.Errorf("%w: ReceiveBuffer %d exceeds %d: Run makes room for that many messages at its start", ErrInvalidConfig, c.ReceiveBuffer, maxReceiveBuffer)
	}
	if c.Identify.MaxIDLength > maxIDLimit {
		return fmt.Errorf("%w: Identify.MaxIDLength %d exceeds %d bytes, more than the dedup tables' keys can hold", ErrInvalidConfig, c.Identify.MaxIDLength, maxIDLimit)
	}
	if p := c.Identify.OnConflict; p != DeadLetterConflicts && p != SkipConflicts {
		return fmt.Errorf("%w: Identify.OnConflict %d is not a known policy", ErrInvalidConfig, p)
	}
	if a := c.Retention.MaxAge; a > 0 && a < minRetentionMaxAge {
		// A unit mistake (MaxAge: 24 is 24 ns): every sweep would delete
		// the claims as they commit, and redeliveries would run again.
		return fmt.Errorf("%w: Retention.MaxAge %v is below %v: the window must outlast the longest redelivery", ErrInvalidConfig, a, minRetentionMaxAge)
	}
	// Written so that NaN, which fails every comparison, is refused too.
	if d := c.Retention.DutyCycle; !(d >= 0 && d <= 1) {
		return fmt.Errorf("%w: Retention.DutyCycle %v is not in (0, 1]", ErrInvalidConfig, d)
	}
	if c.Retry.InitialBackoff > 0 && c.Retry.MaxBackoff > 0 && c.Retry.InitialBackoff > c.Retry.MaxBackoff {
		return fmt.Errorf("%w: Retry.InitialBackoff %v exceeds Retry.MaxBackoff %v", ErrInvalidConfig, c.Retry.InitialBackoff, c.Retry.MaxBackoff)
	}
	if c.InfraBackoff.Initial > 0 && c.InfraBackoff.Max > 0 && c.InfraBackoff.Initial > c.InfraBackoff.Max {
		return fmt.Errorf("%w: InfraBackoff.Initial %v exceeds InfraBackoff.Max %v", ErrInvalidConfig, c.InfraBackoff.Initial, c.InfraBackoff.Max)
	}
	return nil
}

// fitPool sets the defaults that depend on the pool (Concurrency, and
// ReceiveBuffer from it) and warns when Concurrency exceeds its MaxConns.
func (c *Config) fitPool(pool interface{ Config() *pgxpool.Config }) {
	maxConns := int(pool.Config().MaxConns)
	// A pool's MaxConns may be set past what any server takes: the
	// default stops at maxConcurrency, as a set Concurrency must.
	setDefault(&c.Concurrency, min(max(1, maxConns), maxConcurrency))
	setDefault(&c.ReceiveBuffer, defaultReceiveBuffer(c.Concurrency, c.Batch.Size))
	if c.Concurrency > maxConns {
		c.Telemetry.Logger.Warn("once: Concurrency exceeds the pool's MaxConns; the extra transactions wait for a connection",
			"consumer", c.Name, "concurrency", c.Concurrency, "max_conns", maxConns)
	}
}

// defaultReceiveBuffer is 2 × concurrency × batch, at least 256 and at
// most maxReceiveBuffer; computed so that it cannot overflow, as a huge
// Batch.Size would make it.
func defaultReceiveBuffer(concurrency, batch int) int {
	if batch > maxReceiveBuffer/(2*concurrency) {
		return maxReceiveBuffer
	}
	return max(256, 2*concurrency*batch)
}

// capped is def, a first wait's default, or limit, a cap the service set
// alone, when that is shorter: the backoff's limit is the greater of its
// first wait and its cap, so a default above the cap would lift it.
func capped(def, limit time.Duration) time.Duration {
	if limit > 0 {
		return min(def, limit)
	}
	return def
}

func setDefault[T int | time.Duration](v *T, def T) {
	if *v == 0 {
		*v = def
	}
}
