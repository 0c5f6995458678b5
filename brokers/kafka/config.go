package kafka

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"reflect"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/rcrowley/go-metrics"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/onceco/once/internal/kafkaaddr"
)

// StartOffset says where a consumer group starts reading a partition that
// has no committed offset yet.
type StartOffset int

const (
	// StartOldest reads a partition with no committed offset from its first
	// retained record. It is the default, so that nothing produced before
	// the group first started is skipped.
	StartOldest StartOffset = iota
	// StartNewest reads a partition with no committed offset from the
	// records produced after the group joined: the partition's end at the
	// start of the session that claims it is committed as its offset.
	// Reading committed records (the default; see ReadUncommitted), that
	// end is the partition's last stable offset, as for a read-committed
	// Java consumer: the records of a transaction open at the start are
	// read once it commits. A partition whose start the session could not
	// mark (a warning is logged) and one whose committed offset is past
	// its end start at their end when claimed, read the same way, but
	// that start is committed only once one of their records is acked. A
	// committed offset below the partition's first record (the records
	// deleted by retention before the group read them) starts at the first
	// record left: the claim commits it and ends the session once, the
	// deleted records are logged at Error and counted.
	// Reading committed records, a committed offset past the last stable
	// offset is out of range. A partition added to a topic the group
	// already reads (it has no committed offset, another partition of the
	// topic has one) starts at its first record, so that the records
	// produced to it before the group noticed it are read. Under the
	// cooperative-sticky strategy, whose rebalance that adds it has no
	// session start, its claim commits its first offset and returns,
	// which ends the member's session: the next one reads it from there
	// (one rebalance more per partition added).
	StartNewest
)

// DeadLetterConfig says where Delivery.DeadLetter copies poison records:
// to a dead-letter topic per source topic. The zero value copies a record
// of "orders" to "orders.dlq", which must exist. Config.DeadLetter.
type DeadLetterConfig struct {
	// Topic names the dead-letter topic of a source topic. Default: the
	// topic followed by DefaultDeadLetterSuffix ("orders" → "orders.dlq").
	// It may not name a topic in Config.Topics. The dead-letter topics must
	// exist when Open runs (it checks, and fails with
	// ErrDeadLetterTopicMissing naming the topic), unless Create is set,
	// and may not be compacted (cleanup.policy compact: Open refuses it,
	// as compaction keeps only the last dead letter of a key, and the
	// broker refuses the copy of a record without a key).
	// The dead-letter producer never relies on the broker's auto-creation
	// (auto.create.topics.enable, off in most production clusters). A
	// dead-letter topic deleted after start holds its source partition at
	// the first poison record (retried with backoff, nothing acked past it)
	// until the topic exists again. Open asks it once per topic of
	// Config.Topics and uses those names (a panic is an error of Open).
	Topic func(topic string) string
	// Create lets Open create a missing dead-letter topic, with as many
	// partitions as its source topic and the broker's default replication
	// factor (default.replication.factor; with a Sarama.Version older than
	// 2.4, as many replicas as brokers, up to 3) and settings. The
	// principal needs the CREATE ACL. Default false: Open fails with
	// ErrDeadLetterTopicMissing instead, because a topic created with
	// defaults may not have the retention or replication a team wants for
	// its dead letters.
	Create bool
}

// Defaults applied by Open to zero fields of Config.
const (
	// DefaultCommitInterval is how often marked offsets are committed.
	DefaultCommitInterval = time.Second
	// DefaultRevokeTimeout bounds how long a revoked partition's in-flight
	// deliveries may take to be settled before they are abandoned.
	DefaultRevokeTimeout = 10 * time.Second
	// DefaultFetchMaxWait is the fetch long-poll wait. It is lower than
	// sarama's 500 ms because an offset commit waits behind a pending fetch
	// on the same broker connection, which slows rebalances and Close.
	DefaultFetchMaxWait = 100 * time.Millisecond
	// DefaultDeadLetterSuffix is appended to a topic's name to name its
	// dead-letter topic.
	DefaultDeadLetterSuffix = ".dlq"
	// DefaultMaxPendingPerPartition is the default bound on the records a
	// partition holds handed out but not yet marked.
	DefaultMaxPendingPerPartition = 2048
	// DefaultCloseTimeout bounds Close.
	DefaultCloseTimeout = 10 * time.Second
	// DefaultReconnectMinBackoff is the first wait before Open tries the
	// brokers again, and before the source rejoins its group after a
	// failure.
	DefaultReconnectMinBackoff = 100 * time.Millisecond
	// DefaultReconnectMaxBackoff caps those waits.
	DefaultReconnectMaxBackoff = 5 * time.Second
)

// Config configures a Source. Brokers, Group and Topics are required; every
// other field has a default. Durations and sizes left at zero take the value
// of the Sarama base configuration (sarama's own default when Sarama is nil)
// unless a Default* constant says otherwise.
type Config struct {
	// Brokers are the bootstrap broker addresses ("host:port"). Required;
	// Open refuses an address without a port.
	Brokers []string
	// Group is the consumer group id. Required. Every Source with the same
	// Group shares the partitions of Topics.
	Group string
	// Topics are the topics to consume. Required, without duplicates; each
	// a name Kafka accepts (ASCII letters, digits, '.', '_' and '-', at
	// most 249), as must be the name of its dead-letter topic: Open
	// refuses others.
	Topics []string

	// InitialOffset says where to start a partition that has no committed
	// offset for Group. Default StartOldest.
	InitialOffset StartOffset

	// SessionTimeout is the consumer-group session timeout: a member that
	// sends no heartbeat for this long is removed from the group. Zero keeps
	// the Sarama base value (10 s). The broker bounds it
	// (group.min.session.timeout.ms, 6 s by default, and
	// group.max.session.timeout.ms, 30 min): outside the bounds every join
	// is refused, and Receive fails with an error naming this field.
	SessionTimeout time.Duration
	// HeartbeatInterval is how often the member sends heartbeats; it must
	// be lower than SessionTimeout (a third of it is usual). Zero keeps the
	// Sarama base value (3 s).
	HeartbeatInterval time.Duration
	// RebalanceTimeout is how long the group coordinator waits for members
	// to rejoin during a rebalance. Zero keeps the Sarama base value (60 s).
	RebalanceTimeout time.Duration

	// CommitInterval is how often offsets marked by Ack are committed to
	// the group coordinator. Marked offsets are also committed when a
	// partition is revoked and on Close. Default DefaultCommitInterval. A
	// crash loses at most the marks of one interval; the records after the
	// last commit are delivered again and recognised as duplicates. At
	// least a millisecond (a unit mistake: 1 is 1 ns), as are
	// RevokeTimeout and CloseTimeout.
	CommitInterval time.Duration
	// RevokeTimeout bounds how long a revoked partition waits for its
	// delivered but unsettled deliveries to be acked before the final
	// commit; past it their contexts are cancelled and they are abandoned
	// without marking. It must be lower than RebalanceTimeout. Default
	// DefaultRevokeTimeout.
	RevokeTimeout time.Duration

	// KeyLanes, when above 1, splits each partition into that many streams
	// by a hash of the record key: records with different keys are handled
	// concurrently (up to the consumer's Config.Concurrency), records with
	// one key still one after another in offset order. Offsets are marked
	// only up to the first record not yet acked, so a committed offset
	// never passes a gap, and a crash redelivers at most what lies beyond
	// it (skipped as duplicates where it had committed). Records without a
	// key all share one lane. Use it when handlers are slow and the order
	// that matters is per key (per order, per account), not per partition.
	// Default 0: one stream per partition.
	KeyLanes int
	// MaxPendingPerPartition bounds the records of one partition that are
	// handed to the consumer and not yet marked: those being handled, and
	// those acked behind an older record still unsettled (with KeyLanes,
	// the records of other keys behind a slow or stuck key). At the bound
	// the partition's fetching is paused (sarama's ConsumerGroup.Pause)
	// and no record of it is handed out until its oldest pending record is
	// acked; other partitions go on. The memory a partition holds is thus
	// about MaxPendingPerPartition records, plus sarama's buffers
	// (Sarama.ChannelBufferSize records, as many again read ahead while
	// the consumer takes none, and one fetch of up to FetchDefault bytes).
	// It bounds what a crash hands out again only with OffsetsInDatabase,
	// whose rows are written in each transaction: at most this many records
	// per partition, those recorded done skipped. With offsets in Kafka a
	// crash also redelivers the records acked since the last commit
	// (CommitInterval), however many they are, recognised as duplicates.
	// It is the only bound on what a partition hands out:
	// the consumer's Config.ReceiveBuffer, shared by every partition, does
	// not apply to this source (consumer.StreamBounder), so the records
	// waiting in the process are up to this many per partition it holds.
	// Default DefaultMaxPendingPerPartition.
	MaxPendingPerPartition int

	// ReadUncommitted hands the consumer the records of transactions
	// that their producer aborted, or has not ended yet, too: sarama's
	// ReadUncommitted isolation level. Default false: the Source reads
	// committed records only (sarama.ReadCommitted, whatever
	// Sarama.Consumer.IsolationLevel says), so that a record of an
	// aborted transaction upstream, which was never published, has no
	// effect. A partition is then read up to its last stable offset: a
	// transaction left open upstream holds the partition's later records
	// until it ends (or the broker aborts it, past the producer's
	// transaction.timeout.ms). Records written without transactions are
	// read alike either way.
	ReadUncommitted bool

	// DeadLetter says where poison records are copied to.
	DeadLetter DeadLetterConfig

	// CloseTimeout bounds Close: the final offset commit, leaving the
	// group, and dead-letter copies still being written. Past it, Close
	// returns an error wrapping ErrCloseTimeout and leaves the clients to
	// finish closing in the background: offsets marked since the last
	// periodic commit are then not committed (their records are delivered
	// again and skipped as duplicates), and an unfinished dead-letter copy
	// may or may not be written (its record was not acked, so it is
	// handled again). Default DefaultCloseTimeout.
	CloseTimeout time.Duration

	// ReconnectMinBackoff and ReconnectMaxBackoff pace the retries of Open
	// while no broker can be reached, and the rejoins of the group after a
	// failure: the wait doubles from the first to the second, with jitter.
	// Defaults DefaultReconnectMinBackoff and DefaultReconnectMaxBackoff
	// (the names and meaning of amqp.Config's); each at least a
	// millisecond (a unit mistake: 5 is 5 ns).
	ReconnectMinBackoff, ReconnectMaxBackoff time.Duration

	// FetchMin, FetchDefault and FetchMax are sarama's
	// Consumer.Fetch.{Min,Default,Max} in bytes: the minimum bytes a fetch
	// waits for, the bytes requested per partition, and the most those
	// per-partition bytes grow to when a record does not fit (0: no limit
	// in sarama's base config). A response as a whole is bounded by
	// Sarama.Consumer.Fetch.MaxBytes (50 MiB in sarama's base config).
	// Zero keeps the Sarama base value.
	FetchMin, FetchDefault, FetchMax int32
	// FetchMaxWait is how long the broker may hold a fetch waiting for
	// FetchMin bytes. Default DefaultFetchMaxWait.
	FetchMaxWait time.Duration

	// Sarama is the base client configuration: TLS (Net.TLS), SASL
	// (Net.SASL), the protocol Version, ClientID, the balance strategy,
	// retries and everything Config does not name. Nil means
	// sarama.NewConfig(). Open copies it and never modifies it; it
	// overrides in the copies what the guarantees depend on: marked
	// offsets are committed periodically (Consumer.Offsets.AutoCommit, which
	// commits only offsets marked by Ack), the isolation level is
	// ReadCommitted (Consumer.IsolationLevel; see ReadUncommitted),
	// consumer errors are returned,
	// and the dead-letter producer is idempotent, not transactional
	// (Producer.Transaction.ID cleared), with RequiredAcks = WaitForAll,
	// Net.MaxOpenRequests = 1 and topic auto-creation off, sends each copy
	// at once (no Producer.Flush trigger, which a copy sent alone would
	// wait on), runs no Producer.Interceptors (they would rewrite the
	// copy's headers) and places it by its key (a partitioner that ignores
	// the key, random or round-robin, is replaced by sarama's hash
	// partitioner). sarama's sticky
	// and cooperative-sticky balance strategies, which keep the state of
	// their group and may not be shared between clients, are new instances
	// in each Source, so that one base serves several Sources; a strategy
	// of one's own is used as given.
	// Consumer.Interceptors must be empty (Open refuses them): they would
	// rewrite each record before it is deduplicated and dead-lettered.
	// Version must be at least 0.11 (sarama.V0_11_0_0), and
	// Consumer.Group.ResetInvalidOffsets true (sarama's default).
	Sarama *sarama.Config

	// OffsetsInDatabase keeps each partition's progress in PostgreSQL,
	// beside the processed events ("storing offsets outside Kafka"): the
	// consumer writes it in the transaction that commits the claims and
	// the handlers' effects (table <Store table>_offsets, dedup schema
	// version 4), a new owner of a partition starts at the position
	// recorded there (the group's committed offset serves only where the
	// table has none), and records recorded done above it (finished out
	// of order by KeyLanes) are skipped without running the handler.
	// Offsets are still committed to Kafka, after the database, for lag
	// tools, but never trusted over the table: the group's offsets may be
	// lost (offsets.retention.minutes, a deleted or renamed group) or the
	// database restored from a backup, and the consumer still handles
	// every record once. A record without an event id of its own is then
	// deduplicated by its position alone and gets no processed-events row.
	// Each take-over of a partition raises the row's epoch, which fences
	// the transactions of the previous owner: they roll back and their
	// records are left to the new owner. It costs one statement per
	// transaction (transactions of one partition take its row's lock in
	// turn) and one per take-over. The Source must be run by consumer.New,
	// which binds it to its pool and store (Receive fails otherwise), and
	// the pool's role needs SELECT, INSERT and UPDATE on the table (Run
	// fails at once, naming what is missing, otherwise); a wrapper must
	// forward BindProgress and RecordProgress (embedding *Source does),
	// and one that decorates its deliveries must unwrap them (a method
	// Unwrap() consumer.Delivery; Run stops with an error saying so at
	// the first transaction otherwise); the cooperative rebalance protocol
	// (cooperative-sticky, or any balance strategy that declares it,
	// sarama.RebalanceProtocolBalanceStrategy) is refused, and so is a Sarama.Version older
	// than 2.8, which has no topic ids to tell a re-created topic from
	// the old one. Default false. See docs/kafka.md.
	OffsetsInDatabase bool

	// MeterProvider provides the meter of the consumer-lag gauge. Default
	// otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
	// Logger receives warnings about consume errors, failed offset commits
	// and reconnects. Default slog.Default().
	Logger *slog.Logger
}

// withDefaults returns a copy of c with defaults applied.
func (c Config) withDefaults() Config {
	if c.CommitInterval == 0 {
		c.CommitInterval = DefaultCommitInterval
	}
	if c.RevokeTimeout == 0 {
		c.RevokeTimeout = DefaultRevokeTimeout
	}
	if c.FetchMaxWait == 0 {
		c.FetchMaxWait = DefaultFetchMaxWait
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = DefaultCloseTimeout
	}
	if c.MaxPendingPerPartition == 0 {
		c.MaxPendingPerPartition = DefaultMaxPendingPerPartition
	}
	if c.DeadLetter.Topic == nil {
		c.DeadLetter.Topic = func(topic string) string { return topic + DefaultDeadLetterSuffix }
	}
	if c.ReconnectMinBackoff == 0 {
		c.ReconnectMinBackoff = DefaultReconnectMinBackoff
	}
	if c.ReconnectMaxBackoff == 0 {
		c.ReconnectMaxBackoff = DefaultReconnectMaxBackoff
	}
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// deadLetterTopicOf asks name, the user's Config.DeadLetter.Topic, for the
// dead-letter topic of topic; a panic is an error naming the field.
func deadLetterTopicOf(name func(string) string, topic string) (d string, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("kafka: Config.DeadLetter.Topic(%q) panicked: %v", topic, r)
		}
	}()
	return name(topic), nil
}

// validate checks c (with defaults applied) and returns an error naming the
// first wrong field. It replaces Config.DeadLetter.Topic by the names it
// checked.
func (c *Config) validate() error {
	if len(c.Brokers) == 0 {
		return errors.New("kafka: Config.Brokers is empty")
	}
	// Dialling an address without a port fails every time: it is not a
	// broker that cannot be reached yet.
	if err := kafkaaddr.Check("kafka", "Config.Brokers", c.Brokers); err != nil {
		return err
	}
	if strings.TrimSpace(c.Group) == "" {
		return errors.New("kafka: Config.Group is empty")
	}
	if len(c.Topics) == 0 {
		return errors.New("kafka: Config.Topics is empty")
	}
	seen := make(map[string]bool, len(c.Topics))
	for i, t := range c.Topics {
		if strings.TrimSpace(t) == "" {
			return fmt.Errorf("kafka: Config.Topics[%d] is empty", i)
		}
		if err := checkTopicName(t); err != nil {
			return fmt.Errorf("kafka: Config.Topics[%d]: %w", i, err)
		}
		if seen[t] {
			return fmt.Errorf("kafka: Config.Topics lists %q twice", t)
		}
		seen[t] = true
	}
	names := make(map[string]string, len(c.Topics))
	for _, t := range c.Topics {
		d, err := deadLetterTopicOf(c.DeadLetter.Topic, t)
		switch {
		case err != nil:
			return err
		case d == "":
			return fmt.Errorf("kafka: Config.DeadLetter.Topic(%q) is empty", t)
		case checkTopicName(d) != nil:
			return fmt.Errorf("kafka: Config.DeadLetter.Topic(%q): %w", t, checkTopicName(d))
		case seen[d]:
			return fmt.Errorf("kafka: Config.DeadLetter.Topic(%q) is %q, a topic in Config.Topics: dead letters would be consumed again", t, d)
		}
		names[t] = d
	}
	// The names checked here are the names used: the user's function is
	// not asked again for each copy, where another answer would name a
	// topic nobody checked, and a panic would crash the process.
	c.DeadLetter.Topic = func(topic string) string { return names[topic] }
	if c.KeyLanes < 0 {
		return fmt.Errorf("kafka: Config.KeyLanes is negative (%d)", c.KeyLanes)
	}
	if uint64(c.KeyLanes) > math.MaxUint32 {
		// Lanes are a 32-bit hash of the key modulo KeyLanes.
		return fmt.Errorf("kafka: Config.KeyLanes %d exceeds %d", c.KeyLanes, uint32(math.MaxUint32))
	}
	if c.MaxPendingPerPartition < 0 {
		return fmt.Errorf("kafka: Config.MaxPendingPerPartition is negative (%d)", c.MaxPendingPerPartition)
	}
	if c.InitialOffset != StartOldest && c.InitialOffset != StartNewest {
		return fmt.Errorf("kafka: Config.InitialOffset %d is neither StartOldest nor StartNewest", c.InitialOffset)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"SessionTimeout", c.SessionTimeout},
		{"HeartbeatInterval", c.HeartbeatInterval},
		{"RebalanceTimeout", c.RebalanceTimeout},
		{"CommitInterval", c.CommitInterval},
		{"RevokeTimeout", c.RevokeTimeout},
		{"FetchMaxWait", c.FetchMaxWait},
		{"CloseTimeout", c.CloseTimeout},
		{"ReconnectMinBackoff", c.ReconnectMinBackoff},
		{"ReconnectMaxBackoff", c.ReconnectMaxBackoff},
	} {
		if d.v < 0 {
			return fmt.Errorf("kafka: Config.%s is negative (%v)", d.name, d.v)
		}
	}
	// sarama's lower bounds, checked here so that the error names the
	// field of Config rather than one of Config.Sarama.
	for _, d := range []struct {
		name     string
		v, least time.Duration
		above    bool // strictly above least
	}{
		{"SessionTimeout", c.SessionTimeout, 2 * time.Millisecond, true},
		{"HeartbeatInterval", c.HeartbeatInterval, time.Millisecond, false},
		{"RebalanceTimeout", c.RebalanceTimeout, time.Millisecond, true},
		{"FetchMaxWait", c.FetchMaxWait, time.Millisecond, false},
	} {
		if d.v != 0 && (d.v < d.least || d.above && d.v == d.least) {
			bound := "at least"
			if d.above {
				bound = "above"
			}
			return fmt.Errorf("kafka: Config.%s (%v) must be %s %v", d.name, d.v, bound, d.least)
		}
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"CommitInterval", c.CommitInterval}, {"RevokeTimeout", c.RevokeTimeout}, {"CloseTimeout", c.CloseTimeout},
		{"ReconnectMinBackoff", c.ReconnectMinBackoff}, {"ReconnectMaxBackoff", c.ReconnectMaxBackoff},
	} {
		if d.v < time.Millisecond {
			// A unit mistake (CloseTimeout: 10 is 10 ns): every Close
			// would give up at once, without its final commit; every
			// revoke would abandon the deliveries in flight; commits
			// would run in a loop that holds a core; Open's retries and
			// the group's rejoins would dial back to back through an
			// outage, a warning logged for each.
			return fmt.Errorf("kafka: Config.%s %v is below a millisecond (a time.Duration counts nanoseconds)", d.name, d.v)
		}
	}
	for _, f := range []struct {
		name string
		v    int32
	}{{"FetchMin", c.FetchMin}, {"FetchDefault", c.FetchDefault}, {"FetchMax", c.FetchMax}} {
		if f.v < 0 {
			return fmt.Errorf("kafka: Config.%s is negative (%d)", f.name, f.v)
		}
	}
	if c.ReconnectMinBackoff > c.ReconnectMaxBackoff {
		return fmt.Errorf("kafka: Config.ReconnectMinBackoff %v exceeds Config.ReconnectMaxBackoff %v", c.ReconnectMinBackoff, c.ReconnectMaxBackoff)
	}
	if c.Sarama != nil && !c.Sarama.Version.IsAtLeast(sarama.V0_11_0_0) {
		return fmt.Errorf("kafka: Config.Sarama.Version %s is older than 0.11.0.0 (the idempotent dead-letter producer needs 0.11)", c.Sarama.Version)
	}
	return nil
}

// maxTopicName is the longest topic name Kafka accepts.
const maxTopicName = 249

// checkTopicName returns an error when Kafka would refuse name as a
// topic's: it allows ASCII letters, digits, '.', '_' and '-', at most
// maxTopicName of them, and neither "." nor "..". (The fallback ids rely
// on it too: a topic name holds no '/' nor '@'.)
func checkTopicName(name string) error {
	if len(name) > maxTopicName {
		return fmt.Errorf("topic name %.20q... is %d characters long; Kafka allows %d", name, len(name), maxTopicName)
	}
	if name == "." || name == ".." {
		return fmt.Errorf("topic name %q is not allowed by Kafka", name)
	}
	for _, r := range name {
		if !topicNameRune(r) {
			return fmt.Errorf("topic name %q holds %q; Kafka allows ASCII letters, digits, '.', '_' and '-'", name, r)
		}
	}
	return nil
}

// topicNameRune reports whether Kafka allows r in a topic name.
func topicNameRune(r rune) bool {
	switch {
	case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9':
		return true
	}
	return r == '.' || r == '_' || r == '-'
}

// consumerConfig returns the sarama configuration of the consumer group.
func (c *Config) consumerConfig() (*sarama.Config, error) {
	sc := c.base()
	if c.SessionTimeout > 0 {
		sc.Consumer.Group.Session.Timeout = c.SessionTimeout
	}
	if c.HeartbeatInterval > 0 {
		sc.Consumer.Group.Heartbeat.Interval = c.HeartbeatInterval
	}
	if c.RebalanceTimeout > 0 {
		sc.Consumer.Group.Rebalance.Timeout = c.RebalanceTimeout
	}
	if c.FetchMin > 0 {
		sc.Consumer.Fetch.Min = c.FetchMin
	}
	if c.FetchDefault > 0 {
		sc.Consumer.Fetch.Default = c.FetchDefault
	}
	if c.FetchMax > 0 {
		sc.Consumer.Fetch.Max = c.FetchMax
	}
	sc.Consumer.MaxWaitTime = c.FetchMaxWait
	switch c.InitialOffset {
	case StartNewest:
		sc.Consumer.Offsets.Initial = sarama.OffsetNewest
	default:
		sc.Consumer.Offsets.Initial = sarama.OffsetOldest
	}
	// sarama's "auto-commit" commits the offsets marked with MarkOffset, on
	// a ticker, on revoke and on session release. Only Ack marks, so only
	// settled records are ever committed.
	sc.Consumer.Offsets.AutoCommit.Enable = true
	sc.Consumer.Offsets.AutoCommit.Interval = c.CommitInterval
	sc.Consumer.Return.Errors = true
	// sarama's zero value reads the records of aborted transactions too;
	// an explicit ReadUncommitted in the base cannot be told from it.
	sc.Consumer.IsolationLevel = sarama.ReadCommitted
	if c.ReadUncommitted {
		sc.Consumer.IsolationLevel = sarama.ReadUncommitted
	}

	if sc.Consumer.Group.Heartbeat.Interval >= sc.Consumer.Group.Session.Timeout {
		return nil, fmt.Errorf("kafka: Config.HeartbeatInterval (%v) must be lower than Config.SessionTimeout (%v)",
			sc.Consumer.Group.Heartbeat.Interval, sc.Consumer.Group.Session.Timeout)
	}
	if c.RevokeTimeout >= sc.Consumer.Group.Rebalance.Timeout {
		return nil, fmt.Errorf("kafka: Config.RevokeTimeout (%v) must be lower than Config.RebalanceTimeout (%v)",
			c.RevokeTimeout, sc.Consumer.Group.Rebalance.Timeout)
	}
	if err := sc.Validate(); err != nil {
		return nil, fmt.Errorf("kafka: Config.Sarama (consumer): %w", err)
	}
	if !sc.Consumer.Group.ResetInvalidOffsets {
		// sarama then never claims a partition whose committed offset is
		// out of range, and ends the session: the group rebalances
		// without end and the partition is never consumed.
		return nil, errors.New("kafka: Config.Sarama.Consumer.Group.ResetInvalidOffsets is false: a partition whose committed offset is out of range " +
			"(its records deleted by retention) would end every session of the group and never be consumed; leave it true (records out of range start at Config.InitialOffset)")
	}
	if len(sc.Consumer.Interceptors) > 0 {
		// sarama runs them on each record before the Source sees it (twice
		// on one held past Consumer.MaxProcessingTime): the id deduplicated
		// on and the dead-letter copy, documented as the original byte for
		// byte, would be the interceptor's. Cleared, a transforming one
		// would leave every handler the raw records without a word.
		return nil, errors.New("kafka: Config.Sarama.Consumer.Interceptors is set: they would rewrite each record before the consumer deduplicates it " +
			"and copies it to the dead-letter topic (a copy is the original, byte for byte); transform payloads with consumer.Config.Decoder, and give the Source a base without them")
	}
	if name := cooperativeStrategy(sc); c.OffsetsInDatabase && name != "" {
		return nil, fmt.Errorf("kafka: Config.OffsetsInDatabase needs the eager rebalance protocol, and Config.Sarama's balance strategies include %q, which takes part in the cooperative one: "+
			"a partition added by a cooperative rebalance would start at the group's committed offset, not at the database's", name)
	}
	if c.OffsetsInDatabase && !sc.Version.IsAtLeast(sarama.V2_8_0_0) {
		// The rows tell a re-created topic from the old one by its id.
		return nil, fmt.Errorf("kafka: Config.OffsetsInDatabase needs Config.Sarama.Version 2.8 or later (it is %s): the offsets table tells a topic deleted and created again "+
			"from the old one by the topic's id, which older protocol versions do not carry; the new topic would take the old one's positions, and records without ids would be handled again", sc.Version)
	}
	return sc, nil
}

// producerConfig returns the sarama configuration of the dead-letter
// producer.
func (c *Config) producerConfig() (*sarama.Config, error) {
	sc := c.base()
	sc.Producer.Idempotent = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Return.Successes = true
	sc.Producer.Return.Errors = true
	if sc.Producer.Retry.Max < 1 {
		sc.Producer.Retry.Max = 1
	}
	sc.Net.MaxOpenRequests = 1
	sc.Metadata.AllowAutoTopicCreation = false
	// Not transactional: a transactional producer refuses every send made
	// outside a transaction, and each dead letter would be retried
	// without end.
	sc.Producer.Transaction.ID = ""
	// No flush trigger: a copy is sent alone and waited for, so a trigger
	// set for batching (Flush.Messages or Flush.Bytes, met by no single
	// copy) would hold it until Flush.Frequency, or for ever without one,
	// and the partition at its poison record. Copies of several
	// partitions in flight at once are still batched together.
	sc.Producer.Flush.Messages, sc.Producer.Flush.Bytes, sc.Producer.Flush.Frequency = 0, 0, 0
	// No interceptor: those of the base instrument the service's own
	// producers (OpenTelemetry's writes each record's traceparent), and
	// would rewrite a copy's headers, its traceparent that links it to
	// the failure's span among them, after its size was checked.
	sc.Producer.Interceptors = nil
	// Copies are keyed like their originals so that one key's copies land
	// on one dead-letter partition, in order: a partitioner that ignores
	// the key (sarama's random or round-robin, chosen in the base for the
	// service's own producers) would spread them.
	if sc.Producer.Partitioner == nil || !sc.Producer.Partitioner("").RequiresConsistency() {
		sc.Producer.Partitioner = sarama.NewHashPartitioner
	}
	if err := sc.Validate(); err != nil {
		return nil, fmt.Errorf("kafka: Config.Sarama (dead-letter producer): %w", err)
	}
	return sc, nil
}

// base returns a shallow copy of the Sarama base configuration with its own
// metric registry, so that the consumer and the producer clients do not
// share sarama's metrics, and its own balance strategies (ownStrategies).
func (c *Config) base() *sarama.Config {
	var sc sarama.Config
	if c.Sarama != nil {
		sc = *c.Sarama
	} else {
		sc = *sarama.NewConfig()
	}
	sc.MetricRegistry = metrics.NewRegistry()
	g := &sc.Consumer.Group.Rebalance
	g.GroupStrategies = ownStrategies(g.GroupStrategies)
	if g.Strategy != nil {
		g.Strategy = ownStrategies([]sarama.BalanceStrategy{g.Strategy})[0]
	}
	return &sc
}

// Types of sarama's stateful balance strategies.
var (
	stickyType            = reflect.TypeOf(sarama.NewBalanceStrategySticky())
	cooperativeStickyType = reflect.TypeOf(sarama.NewBalanceStrategyCooperativeSticky())
)

// ownStrategies returns a copy of strategies in which sarama's sticky and
// cooperative-sticky strategies are new instances. They keep the state of
// the group they plan for (a plan's movements; cooperative-sticky the
// member's generation, sent in its subscription), and sarama says they
// must not be shared between consumer-group clients: Sources opened from
// one base configuration would plan on the same maps at once (Go's fatal
// "concurrent map writes") and send each other's generation. The others
// of sarama's are stateless; a strategy of the user's is kept as it is.
func ownStrategies(strategies []sarama.BalanceStrategy) []sarama.BalanceStrategy {
	if strategies == nil {
		return nil
	}
	out := make([]sarama.BalanceStrategy, len(strategies))
	for i, st := range strategies {
		switch reflect.TypeOf(st) {
		case stickyType:
			st = sarama.NewBalanceStrategySticky()
		case cooperativeStickyType:
			st = sarama.NewBalanceStrategyCooperativeSticky()
		}
		out[i] = st
	}
	return out
}
