package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
	"time"

	"github.com/onceco/once/cmd/once/dlq"
)

// Exit codes, documented in doc.go and docs/operations.md.
const (
	exitOK      = 0
	exitFailure = 1
	exitUsage   = 2
	// 3 is reserved: it meant an operation this version could not do.
	exitNotFound = 4
)

// usageError is a bad command line: exit code 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return &usageError{fmt.Sprintf(format, args...)} }

// notFoundError is a selection that matched nothing: exit code 4.
type notFoundError struct{ msg string }

func (e *notFoundError) Error() string { return e.msg }

// app is the command line: what it writes to and reads the environment
// from, so tests run it in-process.
type app struct {
	stdout, stderr io.Writer
	getenv         func(string) string
	// terminal reports whether stderr is a terminal (progress bars).
	terminal bool
	now      func() time.Time
	// wrapQueue, when set, wraps every dead-letter Queue the commands
	// open (tests watch what a command does with the records).
	wrapQueue func(dlq.Queue) dlq.Queue
	// kafkaTimeout is the -kafka-timeout of the Kafka client the command
	// configured (0: none), named in the hint of a broker's silence.
	kafkaTimeout time.Duration
}

func newApp(stdout, stderr io.Writer, getenv func(string) string) *app {
	a := &app{stdout: stdout, stderr: stderr, getenv: getenv, now: time.Now}
	if f, ok := stderr.(*os.File); ok {
		if st, err := f.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
			a.terminal = true
		}
	}
	return a
}

// command is one subcommand.
type command struct {
	name    string
	summary string
	usage   string
	run     func(a *app, ctx context.Context, args []string) error
}

func commands() []command {
	return []command{
		{"dlq list", "list dead letters of a Kafka topic or RabbitMQ queue", dlqListUsage, (*app).dlqList},
		{"dlq show", "show one dead letter: headers, reason, payload", dlqShowUsage, (*app).dlqShow},
		{"dlq replay", "redrive dead letters to where they were first published", dlqReplayUsage, (*app).dlqReplay},
		{"migrate", "move the processed-events tables up or down a schema version; status", migrateUsage, (*app).migrate},
		{"status", "per consumer: rows, crash suspects, dead letters by kind, lag", statusUsage, (*app).status},
		{"retention", "delete one consumer's old rows in bounded batches", retentionUsage, (*app).retention},
		{"ui", "serve the web console", uiUsage, (*app).ui},
	}
}

// run runs the command line args and returns the exit code.
func (a *app) run(ctx context.Context, args []string) int {
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "--help" || args[0] == "-help" {
		if len(args) > 1 {
			return a.help(strings.Join(args[1:], " "))
		}
		a.overview(a.stdout)
		return exitOK
	}
	cmd, rest, ok := find(args)
	if !ok && (len(args) == 1 || strings.HasPrefix(args[1], "-")) && isGroup(args[0]) {
		// "once dlq": a group of commands, not an unknown one.
		fmt.Fprintf(a.stderr, "once %s: give one of its commands:\n", args[0])
		for _, c := range commands() {
			if strings.HasPrefix(c.name, args[0]+" ") {
				fmt.Fprintf(a.stderr, "  %-12s %s\n", c.name, c.summary)
			}
		}
		fmt.Fprintf(a.stderr, "Run 'once help %s' for their flags.\n", args[0])
		return exitUsage
	}
	if !ok {
		fmt.Fprintf(a.stderr, "once: unknown command %q\n\n", strings.Join(args, " "))
		a.overview(a.stderr)
		return exitUsage
	}
	err := cmd.run(a, ctx, rest)
	return a.exitCode(cmd, err)
}

// isGroup reports whether word starts commands of more than one word
// (dlq).
func isGroup(word string) bool {
	for _, c := range commands() {
		if strings.HasPrefix(c.name, word+" ") {
			return true
		}
	}
	return false
}

func find(args []string) (command, []string, bool) {
	for _, c := range commands() {
		words := strings.Fields(c.name)
		if len(args) >= len(words) && strings.Join(args[:len(words)], " ") == c.name {
			return c, args[len(words):], true
		}
	}
	return command{}, nil, false
}

func (a *app) exitCode(cmd command, err error) int {
	var ue *usageError
	var nf *notFoundError
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, flag.ErrHelp):
		// -h or -help: the command's help, as "once help CMD".
		return a.help(cmd.name)
	case errors.As(err, &ue):
		fmt.Fprintf(a.stderr, "once %s: %v\nRun 'once help %s' for its flags.\n", cmd.name, err, cmd.name)
		return exitUsage
	case errors.As(err, &nf):
		fmt.Fprintf(a.stderr, "once %s: %v\n", cmd.name, err)
		return exitNotFound
	default:
		// A broker's or a replay's error may quote a dead letter's
		// headers (its event id, its destination).
		// A broker's refusal of the TLS or SASL settings names the
		// flags that set them.
		fmt.Fprintf(a.stderr, "once %s: %s%s\n", cmd.name, safe(err.Error()), kafkaHint(err, a.kafkaTimeout))
		return exitFailure
	}
}

func (a *app) overview(w io.Writer) {
	fmt.Fprint(w, `once operates once consumers: dead letters, tables, a web console.

Usage: once <command> [flags]

Commands:
`)
	for _, c := range commands() {
		fmt.Fprintf(w, "  %-12s %s\n", c.name, c.summary)
	}
	fmt.Fprintf(w, "  %-12s %s\n", "help [cmd]", "this text, or a command's flags")
	fmt.Fprint(w, `
Connections come from flags or the environment:
  DATABASE_URL        PostgreSQL (-database-url)
  ONCE_KAFKA_BROKERS  Kafka bootstrap brokers, comma-separated (-kafka)
  ONCE_AMQP_URL       RabbitMQ URL (-amqp)

Kafka with TLS or SASL (every command that reads Kafka; 'once help dlq list'):
  ONCE_KAFKA_TLS=true        TLS, trusting the system's roots (-kafka-tls)
  ONCE_KAFKA_CA_FILE         CA certificates, PEM (-kafka-ca)
  ONCE_KAFKA_CERT_FILE       client certificate, PEM (-kafka-cert)
  ONCE_KAFKA_KEY_FILE        its key, PEM (-kafka-key)
  ONCE_KAFKA_SASL_MECHANISM  PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (-kafka-sasl)
  ONCE_KAFKA_SASL_USER       SASL user (-kafka-user)
  ONCE_KAFKA_SASL_PASSWORD   SASL password; no flag takes it (or -kafka-password-file)
  ONCE_KAFKA_SASL_PASSWORD_FILE  file holding the SASL password (-kafka-password-file)

Exit codes:
  0  success
  1  failure: a broker or the database failed, a replay stopped
  2  usage: unknown command, bad or missing flag
  4  not found: the selection matched nothing (dlq show, dlq replay)
`)
}

func (a *app) help(name string) int {
	for _, c := range commands() {
		if c.name == name || strings.HasPrefix(c.name, name+" ") {
			fmt.Fprintf(a.stdout, "once %s: %s\n\n%s\n", c.name, c.summary, c.usage)
			fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
			fs.SetOutput(a.stdout)
			// An empty environment: the flags say which variable each
			// connection comes from, and its value (a URL with a
			// password) is not for printing.
			noEnv := func(string) string { return "" }
			_ = c.run(&app{stdout: io.Discard, stderr: io.Discard, getenv: noEnv, now: a.now}, helpContext(fs), nil)
			fmt.Fprintln(a.stdout, "\nFlags:")
			fs.PrintDefaults()
			if c.name == name {
				return exitOK
			}
		}
	}
	if name == "dlq" {
		return exitOK
	}
	fmt.Fprintf(a.stderr, "once help: unknown command %q\n", name)
	return exitUsage
}

// helpContext carries a flag set into a command, which then only defines
// its flags on it and returns: how help learns each command's flags from
// the code that parses them.
type helpKey struct{}

func helpContext(fs *flag.FlagSet) context.Context {
	return context.WithValue(context.Background(), helpKey{}, fs)
}

// flags returns the command's flag set, and whether the command should
// stop after defining its flags (help).
func (a *app) flags(ctx context.Context, name string) (*flag.FlagSet, bool) {
	if fs, ok := ctx.Value(helpKey{}).(*flag.FlagSet); ok {
		return fs, true
	}
	fs := flag.NewFlagSet("once "+name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return fs, false
}

// parse parses args into fs; a bad flag is a usage error, and -h or
// -help returns flag.ErrHelp.
func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return &usageError{err.Error() + durationHint(fs, err)}
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	return nil
}

// badValue is how package flag names the flag whose value it could not
// read.
var badValue = regexp.MustCompile(`^invalid value ".*" for flag -([^:]+): `)

// durationHint says what a duration looks like when err is a duration
// flag's value that does not parse: flag's "parse error" alone does not,
// and a day (30d), the unit most often tried, is none of Go's.
func durationHint(fs *flag.FlagSet, err error) string {
	m := badValue.FindStringSubmatch(err.Error())
	if m == nil {
		return ""
	}
	f := fs.Lookup(m[1])
	if f == nil {
		return ""
	}
	g, ok := f.Value.(flag.Getter)
	if !ok {
		return ""
	}
	if _, ok := g.Get().(time.Duration); !ok {
		return ""
	}
	return " (want a duration such as 90s, 30m or 720h: the units are ns, us, ms, s, m and h; a day is 24h)"
}

// writeJSON writes v as indented JSON.
func (a *app) writeJSON(v any) error {
	enc := json.NewEncoder(a.stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// parseTime reads a time bound: RFC 3339, a date (2006-01-02, UTC), or a
// duration meaning that long before now ("2h", "30m").
func parseTime(s string, now time.Time) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	if t, err := time.Parse("2006-01-02", s); err == nil {
		return t, nil
	}
	if d, err := time.ParseDuration(s); err == nil && d >= 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, usagef("time %q: want RFC 3339 (2026-11-25T10:00:00Z), a date (2026-11-25) or a duration ago (2h)", s)
}

// splitList splits a comma-separated flag value, dropping empty items.
func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}
