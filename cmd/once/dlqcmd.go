package main

import (
	"context"
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/IBM/sarama"

	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/field"
	"github.com/onceco/once/consumer"
)

const dlqSelect = `The dead-letter destination is a Kafka topic (-kafka BROKERS -dlq TOPIC) or a
RabbitMQ queue (-amqp URL -dlq QUEUE). Reading consumes nothing, commits
nothing and keeps the order. Filters combine: -consumer, -kind, -id (exact,
or a prefix ending in *; an id that itself ends in * is given with \* in
its place, -id 'sku\*'), -since/-until (RFC 3339, a date, or a duration ago
such as 2h), -ref, -search. A filter that cannot narrow the selection (-id
'*', -search of blanks alone, an -until not in the past) is refused. In the
output "-" stands for no value; a value that is "-" itself is quoted.

A Kafka cluster that asks for TLS or SASL: -kafka-tls, -kafka-ca FILE,
-kafka-cert FILE -kafka-key FILE (mTLS), -kafka-sasl PLAIN|SCRAM-SHA-256|
SCRAM-SHA-512 -kafka-user NAME, and the password in env
ONCE_KAFKA_SASL_PASSWORD or -kafka-password-file FILE: no flag takes the
password itself, which would show in ps.`

const dlqListUsage = `Usage: once dlq list -kafka BROKERS|-amqp URL -dlq NAME [filters] [-json] [-limit N]

Lists dead letters: ref, when, consumer, kind, event id, type, redrives and
the error; the first -limit (100) of them, saying how many there are (with
-json, on stderr). ` + dlqSelect

const dlqShowUsage = `Usage: once dlq show -kafka BROKERS|-amqp URL -dlq NAME -ref REF|[filters] [-hex] [-payload-all] [-json]

Shows the selected dead letters: the reason, every header, the key or the
AMQP properties, and the payload as text when it is printable, else as a
hex dump (-hex forces it; so does a carriage return that does not end a
line, which would print the text over itself). A key, a header's name or a
header's value over 4 KiB is cut to its first 4 KiB, marked cut with its
length; so is a payload over 32 KiB to its first 32 KiB (-payload-all
prints it whole); -json prints every byte. Nothing selected: exit 4.
` + dlqSelect

const dlqReplayUsage = `Usage: once dlq replay -kafka BROKERS|-amqp URL -dlq NAME [filters]|-all [-dry-run] [-rate N] [-by NAME] [-keep] [-max-hold D] [-force] [-json]

Republishes the selected dead letters to their original Kafka topic (the
partition they were read from) or RabbitMQ exchange and routing key, with
their original key, properties, headers and bytes, and the redrive headers:
once-redrive-event-id (the event id they were dead-lettered under, which
the consumer that dead-lettered them, once-redrive-consumer, prefers over
every other id, so a replay is deduplicated like any redelivery),
once-redrive-fallback-id (their first position, which the topic's other
consumers use in place of the copy's), once-redrive-count,
once-redriven-at, once-redriven-by.
Replaying twice, or while someone else replays, leaves one effect per event.
A redriven record that fails again is dead-lettered again with these headers.

Kafka records with neither an event id nor once-fallback-id, records
without an original destination, records written without their value, and
RabbitMQ copies whose event id, fallback id or consumer header was cut are
skipped, even with -force; so are, unless -force, kinds a redrive cannot
fix (id-conflict, invalid-id, missing-id) and RabbitMQ copies written
without their original headers (once-original-dropped: the exchange's
other consumers may take the redrive for a new event). On RabbitMQ a replayed message
leaves the dead-letter queue once its redrive is confirmed (-keep leaves
it); Kafka dead letters stay. A RabbitMQ replay holds the queue's messages
unacked for -max-hold (10m) at most, then puts them back and takes them
again: keep it below the broker's consumer_timeout (30 minutes by
default), which closes the channel of a message unacked longer; each time
adds one to a quorum queue's x-delivery-count. A progress bar is drawn on a terminal, plain
lines otherwise. A selection that matches no record (or -all on an empty
destination), dry run or not, prints its report and exits 4, as dlq show
does: a script tells "nothing to replay" from a replay done (exit 0).
With -json, each record of the report is its summary and headers, without
its key and payload (dlq show -json prints them).
` + dlqSelect

// dlqFlags are the flags every dlq command shares.
type dlqFlags struct {
	fs                                             *flag.FlagSet
	stderr                                         io.Writer
	kafka                                          *kafkaFlags
	amqp, name                                     *string
	consumer, kind, id, since, until, refs, search *string
	// amqpBase is the base of a RabbitMQ queue's configuration (MaxHold,
	// set by dlq replay -max-hold).
	amqpBase dlq.AMQPConfig
}

func (a *app) dlqFlagsOn(fs *flag.FlagSet) *dlqFlags {
	return &dlqFlags{
		fs:       fs,
		stderr:   a.stderr,
		kafka:    a.kafkaFlagsOn(fs),
		amqp:     fs.String("amqp", a.getenv("ONCE_AMQP_URL"), "RabbitMQ `URL` (env ONCE_AMQP_URL)"),
		name:     fs.String("dlq", "", "the dead-letter topic or queue (required)"),
		consumer: fs.String("consumer", "", "only dead letters of this consumer `name`"),
		kind:     fs.String("kind", "", "only these `kinds`, comma-separated (decode, handler, panic, unknown-type, missing-id, invalid-id, id-conflict, crash-loop)"),
		id:       fs.String("id", "", "only this event `id`, or ids starting with a prefix ending in * (\\* for an id that ends in a star)"),
		since:    fs.String("since", "", "only dead-lettered at or after `time`"),
		until:    fs.String("until", "", "only dead-lettered before `time`, a time in the past"),
		refs:     fs.String("ref", "", "only these record `refs`, comma-separated (Kafka partition:offset)"),
		search:   fs.String("search", "", "only records whose id, type, error, consumer or kind contains `text`"),
	}
}

// queue builds the dead-letter Queue the flags name.
func (f *dlqFlags) queue() (dlq.Queue, error) {
	if *f.name == "" {
		return nil, usagef("-dlq is required: the dead-letter topic or queue")
	}
	kafkaBrokers, amqpURL := chosen(f.fs, *f.kafka.brokers, *f.amqp)
	qs, err := f.kafka.open(f.stderr, kafkaBrokers, amqpURL, []string{*f.name}, f.amqpBase)
	if err != nil {
		return nil, err
	}
	return qs[0], nil
}

// defaultMaxHold is dlq replay -max-hold's default, dlq.AMQPConfig.MaxHold's.
const defaultMaxHold = 10 * time.Minute

// flagGiven reports whether the flag name was given on the command line.
func flagGiven(fs *flag.FlagSet, name string) bool {
	given := false
	fs.Visit(func(f *flag.Flag) { given = given || f.Name == name })
	return given
}

// chosen returns the -kafka and -amqp values to use: one given on the
// command line drops the other's default from the environment, so that a
// shell with both ONCE_KAFKA_BROKERS and ONCE_AMQP_URL set can pick one.
func chosen(fs *flag.FlagSet, kafkaBrokers, amqpURL string) (string, string) {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	switch {
	case set["kafka"] && !set["amqp"]:
		return kafkaBrokers, ""
	case set["amqp"] && !set["kafka"]:
		return "", amqpURL
	}
	return kafkaBrokers, amqpURL
}

// openQueue opens the dead-letter queue name: a Kafka topic on
// kafkaBrokers with the client configuration sc, or a RabbitMQ queue at
// amqpURL with the settings of base (its URL and Queue are set here).
func openQueue(kafkaBrokers string, sc *sarama.Config, amqpURL, name string, base dlq.AMQPConfig) (dlq.Queue, error) {
	switch {
	case kafkaBrokers != "" && amqpURL != "":
		return nil, usagef("give -kafka or -amqp, not both (ONCE_KAFKA_BROKERS and ONCE_AMQP_URL set both: give one on the command line)")
	case kafkaBrokers != "":
		q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: splitList(kafkaBrokers), Topic: name, Sarama: sc})
		if err != nil {
			return nil, &usageError{err.Error()}
		}
		return q, nil
	case amqpURL != "":
		base.URL, base.Queue = amqpURL, name
		q, err := dlq.NewAMQP(base)
		if err != nil {
			return nil, &usageError{err.Error()}
		}
		return q, nil
	}
	return nil, usagef("give -kafka BROKERS or -amqp URL (or ONCE_KAFKA_BROKERS / ONCE_AMQP_URL)")
}

func (f *dlqFlags) filter(now time.Time) (dlq.Filter, error) {
	since, err := parseTime(*f.since, now)
	if err != nil {
		return dlq.Filter{}, err
	}
	until, err := parseTime(*f.until, now)
	if err != nil {
		return dlq.Filter{}, err
	}
	if !until.IsZero() && !until.Before(now) {
		// Every record dead-lettered so far is before it: like -id '*',
		// it reads as a filter and narrows nothing, and a replay would
		// take it for -all.
		return dlq.Filter{}, usagef("-until %s is not in the past: every record dead-lettered so far is before it, so it cannot narrow the selection (leave it out; dlq replay -all replays every record)",
			until.UTC().Format(time.RFC3339))
	}
	if !since.IsZero() && !until.IsZero() && !since.Before(until) {
		// A window that ends before it starts selects nothing: the
		// bounds were swapped ("0 selected" would read as none there).
		return dlq.Filter{}, usagef("-since %s is not before -until %s: no record can match (a duration means that long ago: -since 2h -until 1h)",
			since.UTC().Format(time.RFC3339), until.UTC().Format(time.RFC3339))
	}
	kinds := splitList(*f.kind)
	for _, k := range kinds {
		if !slices.Contains(deadLetterKinds, consumer.ErrorKind(k)) {
			// A typo selects nothing: with others beside it, a replay
			// would run on what they select and say nothing of it.
			return dlq.Filter{}, usagef("-kind %q is no dead-letter kind: want %s", k, kindList())
		}
	}
	refs := splitList(*f.refs)
	for _, r := range refs {
		if !recordRef.MatchString(r) {
			// Refs match as written: one in another spelling selects
			// nothing, silently.
			return dlq.Filter{}, usagef("-ref %q is no record ref: want partition:offset (Kafka, as 0:1234) or the 16 hex digits list shows (RabbitMQ)", r)
		}
	}
	filter := dlq.Filter{
		Consumer: *f.consumer, Kinds: kinds, EventID: *f.id,
		Since: since, Until: until, Refs: refs, Search: *f.search,
	}
	if err := filter.Check(); err != nil {
		// Named as the flag: "-id", "-search".
		return dlq.Filter{}, usagef("-%v", err)
	}
	return filter, nil
}

// recordRef is a record's Ref as the dlq package writes it: a Kafka
// partition:offset in decimal, or a RabbitMQ digest.
var recordRef = regexp.MustCompile(`^(?:(?:0|[1-9][0-9]{0,9}):(?:0|[1-9][0-9]{0,18})|[0-9a-f]{16})$`)

// deadLetterKinds are the kinds a consumer writes in once-error-kind.
var deadLetterKinds = []consumer.ErrorKind{
	consumer.KindDecode, consumer.KindHandler, consumer.KindPanic, consumer.KindUnknownType,
	consumer.KindMissingID, consumer.KindInvalidID, consumer.KindIDConflict, consumer.KindCrashLoop,
}

// kindList is deadLetterKinds, comma-separated.
func kindList() string {
	names := make([]string, len(deadLetterKinds))
	for i, k := range deadLetterKinds {
		names[i] = string(k)
	}
	return strings.Join(names, ", ")
}

// selects reports whether any filter flag was given. A list (-kind, -ref)
// selects only when it names something: one of commas and blanks alone is
// no filter, and must not stand for -all.
func (f *dlqFlags) selects() bool {
	for _, s := range []*string{f.consumer, f.id, f.since, f.until, f.search} {
		if *s != "" {
			return true
		}
	}
	return len(splitList(*f.kind)) > 0 || len(splitList(*f.refs)) > 0
}

// recordSummary is a dead letter in list output.
type recordSummary struct {
	Ref      string    `json:"ref"`
	Position int       `json:"position"`
	FailedAt time.Time `json:"failed_at,omitzero"`
	Consumer string    `json:"consumer"`
	// ConsumerHex, KindHex, EventIDHex, EventTypeHex and ErrorHex are
	// their field in hex when it is not UTF-8 (JSON text cannot hold its
	// bytes: the field shows U+FFFD in their place). The headers they
	// come from are a producer's bytes, and an error may quote a
	// payload's.
	ConsumerHex   string `json:"consumer_hex,omitempty"`
	Kind          string `json:"kind"`
	KindHex       string `json:"kind_hex,omitempty"`
	EventID       string `json:"event_id"`
	EventIDHex    string `json:"event_id_hex,omitempty"`
	EventType     string `json:"event_type,omitempty"`
	EventTypeHex  string `json:"event_type_hex,omitempty"`
	Error         string `json:"error"`
	ErrorHex      string `json:"error_hex,omitempty"`
	RedriveCount  int    `json:"redrive_count"`
	Destination   string `json:"destination"`
	Replayable    bool   `json:"replayable"`
	NotReplayable string `json:"not_replayable,omitempty"`
}

func summarize(r *dlq.Record) recordSummary {
	s := recordSummary{
		Ref: r.Ref, Position: r.Position, FailedAt: r.FailedAt(), Consumer: r.Consumer(), Kind: r.Kind(),
		EventID: r.EventID(), EventType: r.EventType(), Error: r.Error(), RedriveCount: r.RedriveCount(),
		Destination: r.Destination(), Replayable: true,
	}
	s.ConsumerHex, s.KindHex = hexUnlessUTF8(s.Consumer), hexUnlessUTF8(s.Kind)
	s.EventIDHex, s.EventTypeHex = hexUnlessUTF8(s.EventID), hexUnlessUTF8(s.EventType)
	s.ErrorHex = hexUnlessUTF8(s.Error)
	if err := r.Replayable(false); err != nil {
		s.Replayable, s.NotReplayable = false, err.Error()
	}
	return s
}

// hexUnlessUTF8 returns v in hex when it is not UTF-8, else "".
func hexUnlessUTF8(v string) string {
	if utf8.ValidString(v) {
		return ""
	}
	return hex.EncodeToString([]byte(v))
}

func (a *app) dlqList(ctx context.Context, args []string) error {
	fs, helpOnly := a.flags(ctx, "dlq list")
	df := a.dlqFlagsOn(fs)
	asJSON := fs.Bool("json", false, "print JSON")
	limit := fs.Int("limit", 100, "print at most `n` records (0: all)")
	if helpOnly {
		return nil
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	if *limit < 0 {
		return usagef("-limit %d: want a number of records (0: all)", *limit)
	}
	q, f, err := a.dlqOpen(df)
	if err != nil {
		return err
	}
	defer q.Close()
	// Summaries of the first -limit records, and a count of the rest: a
	// large topic is not held in memory.
	out := []recordSummary{}
	total, read, err := firstMatches(ctx, q, f, *limit, func(r *dlq.Record) { out = append(out, summarize(r)) })
	if err != nil {
		return err
	}
	filtered := df.selects()
	if *asJSON {
		if total > len(out) {
			// The array holds the first -limit: said where a script's
			// reader sees it, as dlq show says it.
			matching := ""
			if filtered {
				matching = "matching "
			}
			fmt.Fprintf(a.stderr, "%d of %d %srecords listed (-limit 0 for all)\n", len(out), total, matching)
		}
		return a.writeJSON(out)
	}
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "REF\tFAILED AT\tCONSUMER\tKIND\tEVENT ID\tTYPE\tREDRIVES\tERROR")
	for _, s := range out {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\n", s.Ref, formatTime(s.FailedAt), orDash(s.Consumer), orDash(s.Kind),
			orDash(s.EventID), orDash(s.EventType), s.RedriveCount, clip(s.Error, 60))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	// With a filter, its count is said to be one: not the destination's.
	switch {
	case total > len(out) && filtered:
		fmt.Fprintf(a.stdout, "%d of %d matching records shown (-limit 0 for all)\n", len(out), total)
	case total > len(out):
		fmt.Fprintf(a.stdout, "%d of %d records shown (-limit 0 for all)\n", len(out), total)
	case filtered:
		fmt.Fprintf(a.stdout, "%d of %d records in %s match\n", total, read, q.Name())
	default:
		fmt.Fprintf(a.stdout, "%d records in %s\n", total, q.Name())
	}
	return nil
}

// firstMatches reads q and passes the first limit records f selects (every
// one when limit is 0) to keep; it returns how many f selects, and how
// many it read.
func firstMatches(ctx context.Context, q dlq.Queue, f dlq.Filter, limit int, keep func(*dlq.Record)) (total, read int, err error) {
	err = q.Browse(ctx, func(r *dlq.Record) error {
		read++
		if f.Match(r) {
			total++
			if limit == 0 || total <= limit {
				keep(r)
			}
		}
		return nil
	})
	return total, read, err
}

func (a *app) dlqOpen(df *dlqFlags) (dlq.Queue, dlq.Filter, error) {
	f, err := df.filter(a.now())
	if err != nil {
		return nil, f, err
	}
	q, err := df.queue()
	if err != nil {
		return nil, f, err
	}
	return a.wrapped(q), f, nil
}

// wrapped is q through a.wrapQueue, when set.
func (a *app) wrapped(q dlq.Queue) dlq.Queue {
	if a.wrapQueue != nil {
		return a.wrapQueue(q)
	}
	return q
}

// recordDetail is a dead letter in show output.
type recordDetail struct {
	recordSummary
	Queue     string       `json:"queue"`
	Partition int32        `json:"partition"`
	Offset    int64        `json:"offset"`
	Headers   []dlq.Header `json:"headers"`
	// Key is the Kafka key as text when it is UTF-8; KeyHex otherwise.
	Key        *string         `json:"key,omitempty"`
	KeyHex     string          `json:"key_hex,omitempty"`
	Properties *dlq.Properties `json:"properties,omitempty"`
	// Value is the payload as text when printable; ValueHex otherwise.
	Value    *string `json:"value,omitempty"`
	ValueHex string  `json:"value_hex,omitempty"`
	Size     int     `json:"size"`
}

func detail(r *dlq.Record) recordDetail {
	d := recordDetail{recordSummary: summarize(r), Queue: r.Queue, Partition: r.Partition, Offset: r.Offset,
		Headers: r.Headers, Properties: r.Properties, Size: len(r.Value)}
	switch {
	case r.Key == nil:
	case utf8.Valid(r.Key):
		k := string(r.Key)
		d.Key = &k
	default:
		d.KeyHex = hex.EncodeToString(r.Key)
	}
	if dlq.Printable(r.Value) {
		v := string(r.Value)
		d.Value = &v
	} else {
		d.ValueHex = hex.EncodeToString(r.Value)
	}
	return d
}

func (a *app) dlqShow(ctx context.Context, args []string) error {
	fs, helpOnly := a.flags(ctx, "dlq show")
	df := a.dlqFlagsOn(fs)
	asJSON := fs.Bool("json", false, "print JSON")
	asHex := fs.Bool("hex", false, "print the payload as a hex dump even when it is text")
	payloadAll := fs.Bool("payload-all", false, "print every byte of the payload, not its first 32 KiB")
	limit := fs.Int("limit", 10, "show at most `n` records (0: all)")
	if helpOnly {
		return nil
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	if !df.selects() {
		return usagef("select records: -ref, or filters such as -id")
	}
	if *limit < 0 {
		return usagef("-limit %d: want a number of records (0: all)", *limit)
	}
	q, f, err := a.dlqOpen(df)
	if err != nil {
		return err
	}
	defer q.Close()
	var recs []*dlq.Record
	total, _, err := firstMatches(ctx, q, f, *limit, func(r *dlq.Record) { recs = append(recs, r) })
	if err != nil {
		return err
	}
	if total == 0 {
		return &notFoundError{"no record in " + q.Name() + " matches"}
	}
	if total > len(recs) {
		fmt.Fprintf(a.stderr, "%d records match; showing the first %d (-limit 0 for all)\n", total, len(recs))
	}
	if *asJSON {
		out := make([]recordDetail, len(recs))
		for i, r := range recs {
			out[i] = detail(r)
		}
		return a.writeJSON(out)
	}
	for i, r := range recs {
		if i > 0 {
			fmt.Fprintln(a.stdout, strings.Repeat("-", 72))
		}
		a.printRecord(r, *asHex, *payloadAll)
	}
	return nil
}

func (a *app) printRecord(r *dlq.Record, asHex, payloadAll bool) {
	w := a.stdout
	s := summarize(r)
	text := func(b []byte) string { return safe(string(b)) }
	// The summary's fields come from headers, which a record not written
	// by a consumer of this library may make as large as it likes.
	shown := func(v string) string {
		if v == "" {
			return "-"
		}
		return notPlaceholder(cutField([]byte(v), text))
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "ref\t%s\n", r.Ref)
	fmt.Fprintf(tw, "queue\t%s (position %d)\n", r.Queue, r.Position)
	fmt.Fprintf(tw, "consumer\t%s\n", shown(s.Consumer))
	fmt.Fprintf(tw, "kind\t%s\n", shown(s.Kind))
	fmt.Fprintf(tw, "event id\t%s\n", shown(s.EventID))
	fmt.Fprintf(tw, "event type\t%s\n", shown(s.EventType))
	fmt.Fprintf(tw, "failed at\t%s\n", formatTime(s.FailedAt))
	fmt.Fprintf(tw, "error\t%s\n", cutField([]byte(s.Error), text))
	fmt.Fprintf(tw, "destination\t%s\n", shown(s.Destination))
	fmt.Fprintf(tw, "redrives\t%d\n", s.RedriveCount)
	if s.Replayable {
		fmt.Fprintf(tw, "replayable\tyes\n")
	} else {
		fmt.Fprintf(tw, "replayable\tno: %s\n", cutField([]byte(s.NotReplayable), text))
	}
	_ = tw.Flush()
	fmt.Fprintln(w, "\nheaders:")
	for _, h := range r.Headers {
		fmt.Fprintf(w, "  %s: %s\n", cutField([]byte(h.Key), text), cutField([]byte(h.Value), text))
	}
	if r.Key != nil {
		fmt.Fprintf(w, "\nkey: %s\n", cutField(r.Key, printableOrHex))
	}
	if p := r.Properties; p != nil {
		fmt.Fprintf(w, "\nproperties: message-id=%q type=%q content-type=%q", p.MessageID, p.Type, p.ContentType)
		if !p.Timestamp.IsZero() {
			fmt.Fprintf(w, " timestamp=%s", p.Timestamp.UTC().Format(time.RFC3339))
		}
		fmt.Fprintln(w)
	}
	head := r.Value
	if !payloadAll {
		head = payloadHead(r.Value)
	}
	if !asHex && dlq.Printable(r.Value) && !overwrites(r.Value) {
		fmt.Fprintf(w, "\npayload (%d bytes, text):\n%s\n", len(r.Value), head)
	} else {
		fmt.Fprintf(w, "\npayload (%d bytes, hex):\n%s", len(r.Value), hex.Dump(head))
	}
	if len(head) < len(r.Value) {
		fmt.Fprintf(w, "… cut: the first %s of its %s bytes are shown (-payload-all or -json prints them all)\n",
			field.Count(len(head)), field.Count(len(r.Value)))
	}
}

// payloadShown is how many bytes of a payload dlq show prints unless
// -payload-all, as many as the console's record page shows: a dead
// letter of a hundred megabytes printed whole (four hundred as a hex
// dump) floods the terminal and its scrollback, and hides the headers
// above it.
const payloadShown = 32 << 10

// payloadHead returns the first payloadShown bytes of b (b itself when it
// is no longer), cut at the start of a character when b is printable
// text: a cut inside one would print a broken character.
func payloadHead(b []byte) []byte {
	if len(b) <= payloadShown {
		return b
	}
	shown := b[:payloadShown]
	if dlq.Printable(b) {
		for len(shown) > 0 && !utf8.RuneStart(b[len(shown)]) {
			shown = shown[:len(shown)-1]
		}
	}
	return shown
}

// overwrites reports whether text b, printed on a terminal, would print
// over itself: a carriage return that does not end a line takes the
// cursor back to the start of the line, and what follows hides what came
// before.
func overwrites(b []byte) bool {
	for i, c := range b {
		if c == '\r' && (i+1 == len(b) || b[i+1] != '\n') {
			return true
		}
	}
	return false
}

// printableOrHex returns b as text on one line (quoted when it breaks
// lines), or in hex when it is not text.
func printableOrHex(b []byte) string {
	if dlq.Printable(b) {
		return safe(string(b))
	}
	return "0x" + hex.EncodeToString(b)
}

// cutField returns a Kafka key, a header's name or a header's value as
// dlq show prints it: its first 4 KiB (field.Cut) in the form show gives
// them, and when that is not all, a mark that says how long it is. A
// producer's may be as large as the record; printed whole, a few would
// fill the terminal's scrollback. -json prints every byte.
func cutField(b []byte, show func([]byte) string) string {
	shown, cut := field.Cut(b)
	if !cut {
		return show(b)
	}
	return fmt.Sprintf("%s … cut: the first %s of its %s bytes are shown (-json prints them whole)",
		show(shown), field.Count(len(shown)), field.Count(len(b)))
}

func (a *app) dlqReplay(ctx context.Context, args []string) error {
	fs, helpOnly := a.flags(ctx, "dlq replay")
	df := a.dlqFlagsOn(fs)
	all := fs.Bool("all", false, "replay every record (required when no filter is given)")
	dry := fs.Bool("dry-run", false, "say what would be replayed; publish nothing")
	rate := fs.Float64("rate", 0, "publish at most `n` records per second (0: no limit)")
	by := fs.String("by", "", "who asks for the redrive, written in once-redriven-by")
	keep := fs.Bool("keep", false, "RabbitMQ: leave replayed messages in the dead-letter queue")
	maxHold := fs.Duration("max-hold", defaultMaxHold, "RabbitMQ: hold the queue's messages unacked this `long` at most, then put them back and take them again; keep it below the broker's consumer_timeout")
	force := fs.Bool("force", false, "also replay kinds a redrive cannot fix (id-conflict, invalid-id, missing-id), and RabbitMQ copies written without their original headers (once-original-dropped), which the exchange's other consumers may take for a new event")
	asJSON := fs.Bool("json", false, "print the report as JSON")
	if helpOnly {
		return nil
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	if !df.selects() && !*all {
		return usagef("select records with filters, or replay them all with -all")
	}
	if !(*rate >= 0) || math.IsInf(*rate, 1) {
		return usagef("-rate %v: want a number of records per second (0: no limit)", *rate)
	}
	if *maxHold <= 0 {
		return usagef("-max-hold %v: want a duration above 0", *maxHold)
	}
	if kb, _ := chosen(fs, *df.kafka.brokers, *df.amqp); kb != "" && flagGiven(fs, "max-hold") {
		return usagef("-max-hold is a RabbitMQ setting: a Kafka replay holds nothing")
	}
	df.amqpBase.MaxHold = *maxHold
	q, f, err := a.dlqOpen(df)
	if err != nil {
		return err
	}
	defer q.Close()
	bar := a.progress(*dry)
	rep, err := q.Replay(ctx, f, dlq.ReplayOptions{
		DryRun: *dry, Rate: *rate, By: *by, Keep: *keep, Force: *force, Progress: bar.update,
	})
	bar.finish()
	if err != nil && rep.Selected == 0 && len(rep.Outcomes) == 0 {
		// It stopped before it read a record: no report to print
		// ("0 selected" would read as a filter matching nothing).
		return err
	}
	if *asJSON {
		if jerr := a.writeJSON(replayJSON(rep)); jerr != nil {
			return jerr
		}
	} else {
		a.printReport(q, rep)
	}
	if err == nil && rep.Selected == 0 {
		// Nothing to replay is not a replay done: a script told apart
		// a filter that matched nothing (a misspelt id, records
		// replayed and removed meanwhile) from one that redrove what
		// it asked for only by parsing the report. Exit 4, as dlq
		// show; the report is printed all the same.
		return &notFoundError{noMatch(q, df.selects())}
	}
	return err
}

// replayReport is dlq replay's report in -json: dlq.Report with each
// record without its key and payload. The report says what was done to
// which record; with every payload in base64, that of a replay of
// thousands of large dead letters was gigabytes on stdout (dlq show
// -json prints them).
type replayReport struct {
	Selected int             `json:"selected"`
	Replayed int             `json:"replayed"`
	Skipped  int             `json:"skipped"`
	DryRun   bool            `json:"dry_run"`
	Outcomes []replayOutcome `json:"outcomes"`
}

// replayOutcome is a dlq.Outcome in replayReport.
type replayOutcome struct {
	Record      replayedRecord `json:"record"`
	Result      string         `json:"result"`
	Reason      string         `json:"reason,omitempty"`
	Destination string         `json:"destination,omitempty"`
}

// replayedRecord is a record of replayReport: its summary (as dlq list
// -json gives it), where it was read and its headers.
type replayedRecord struct {
	recordSummary
	Queue      string          `json:"queue"`
	Partition  int32           `json:"partition"`
	Offset     int64           `json:"offset"`
	Headers    []dlq.Header    `json:"headers"`
	Properties *dlq.Properties `json:"properties,omitempty"`
	Timestamp  time.Time       `json:"timestamp,omitzero"`
}

// replayJSON returns rep as dlq replay -json prints it.
func replayJSON(rep dlq.Report) replayReport {
	out := replayReport{Selected: rep.Selected, Replayed: rep.Replayed, Skipped: rep.Skipped, DryRun: rep.DryRun,
		Outcomes: make([]replayOutcome, len(rep.Outcomes))}
	for i, o := range rep.Outcomes {
		r := o.Record
		out.Outcomes[i] = replayOutcome{Result: o.Result, Reason: o.Reason, Destination: o.Destination,
			Record: replayedRecord{recordSummary: summarize(r), Queue: r.Queue, Partition: r.Partition, Offset: r.Offset,
				Headers: r.Headers, Properties: r.Properties, Timestamp: r.Timestamp}}
	}
	return out
}

// noMatch says that the selection matched no record of q: with no
// filter (-all), that q holds none.
func noMatch(q dlq.Queue, filtered bool) string {
	if !filtered {
		return "no record in " + q.Name()
	}
	return "no record in " + q.Name() + " matches"
}

func (a *app) printReport(q dlq.Queue, rep dlq.Report) {
	verb := "replayed"
	n := rep.Replayed
	if rep.DryRun {
		verb = "would replay"
		n = rep.Selected - rep.Skipped
	}
	for _, o := range rep.Outcomes {
		if rep.DryRun || o.Result == dlq.Skipped || a.terminal {
			line := fmt.Sprintf("%-12s %s %s -> %s", o.Result, o.Record.Ref, orDash(o.Record.EventID()), orDash(o.Destination))
			if o.Reason != "" {
				line = fmt.Sprintf("%-12s %s %s: %s", o.Result, o.Record.Ref, orDash(o.Record.EventID()), safe(o.Reason))
			}
			fmt.Fprintln(a.stdout, line)
		}
	}
	fmt.Fprintf(a.stdout, "%s: %d selected, %s %d, skipped %d\n", q.Name(), rep.Selected, verb, n, rep.Skipped)
}

// progress draws a bar on a terminal and writes a line per record
// otherwise.
type progress struct {
	w        io.Writer
	terminal bool
	dry      bool
	start    time.Time
	drawn    bool
}

func (a *app) progress(dry bool) *progress {
	return &progress{w: a.stderr, terminal: a.terminal, dry: dry, start: time.Now()}
}

func (p *progress) update(done, total int, o dlq.Outcome) {
	if !p.terminal {
		if !p.dry {
			fmt.Fprintf(p.w, "[%d/%d] %s %s %s\n", done, total, o.Result, o.Record.Ref, orDash(o.Record.EventID()))
		}
		return
	}
	const width = 30
	filled := width * done / max(total, 1)
	rate := float64(done) / max(time.Since(p.start).Seconds(), 0.001)
	fmt.Fprintf(p.w, "\rreplaying [%s%s] %d/%d  %.1f/s ", strings.Repeat("#", filled), strings.Repeat(".", width-filled), done, total, rate)
	p.drawn = true
}

func (p *progress) finish() {
	if p.drawn {
		fmt.Fprintln(p.w)
	}
}

func formatTime(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	// The zone said, as the console says it: read on a terminal of
	// another zone, a bare time reads as local, hours off.
	return t.UTC().Format("2006-01-02 15:04:05 UTC")
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return notPlaceholder(safe(s))
}

// notPlaceholder returns s quoted when it reads as what the output prints
// in place of a value ("-" for none, "(others)" in once status): a
// consumer named "-" is not the records without a consumer.
func notPlaceholder(s string) string {
	if s == "-" || s == "(others)" {
		return strconv.Quote(s)
	}
	return s
}

// safe returns s as it is when it is printable text on one line without a
// tab, else quoted with escapes, so that a header cannot send control
// sequences to the terminal, and cannot start a column of its own in the
// tables printed with a tabwriter.
func safe(s string) string {
	if dlq.Printable([]byte(s)) && !strings.ContainsAny(s, "\r\n\t") {
		return s
	}
	return strconv.Quote(s)
}

// clip cuts s to n runes on one line.
func clip(s string, n int) string {
	s = safe(strings.Join(strings.Fields(s), " "))
	r := []rune(s)
	if len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return s
}
