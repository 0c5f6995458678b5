package amqp_test

import (
	"context"
	"crypto/tls"
	"math"
	"net"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
)

func TestConfigErrorsNameTheField(t *testing.T) {
	ok := amqp.Config{URL: "amqp://u:secret@localhost:5672/", Queue: "q"}
	cases := []struct {
		name  string
		edit  func(c *amqp.Config)
		field string
	}{
		{"no URL", func(c *amqp.Config) { c.URL = "" }, "Config.URL"},
		{"bad scheme", func(c *amqp.Config) { c.URL = "http://u:secret@localhost/" }, "Config.URL"},
		{"TLS without amqps", func(c *amqp.Config) { c.TLSConfig = &tls.Config{} }, "Config.TLSConfig"},
		{"no queue", func(c *amqp.Config) { c.Queue = "" }, "Config.Queue"},
		{"unknown queue type", func(c *amqp.Config) { c.QueueType = "stream" }, "Config.QueueType"},
		{"contradicting x-queue-type", func(c *amqp.Config) {
			c.QueueType = amqp.QueueClassic
			c.QueueArgs = amqp091.Table{"x-queue-type": "quorum"}
		}, "Config.QueueArgs"},
		{"contradicting dead-letter x-queue-type", func(c *amqp.Config) {
			c.QueueType = amqp.QueueQuorum
			c.DeadLetter.QueueArgs = amqp091.Table{"x-queue-type": "classic"}
		}, "Config.DeadLetter.QueueArgs"},
		{"negative prefetch", func(c *amqp.Config) { c.Prefetch = -1 }, "Config.Prefetch"},
		{"huge prefetch", func(c *amqp.Config) { c.Prefetch = math.MaxUint16 + 1 }, "Config.Prefetch"},
		{"negative confirm timeout", func(c *amqp.Config) { c.ConfirmTimeout = -time.Second }, "Config.ConfirmTimeout"},
		{"backoff bounds swapped", func(c *amqp.Config) {
			c.ReconnectMinBackoff, c.ReconnectMaxBackoff = time.Second, time.Millisecond
		}, "Config.ReconnectMaxBackoff"},
		{"exchange without name", func(c *amqp.Config) { c.Exchanges = []amqp.Exchange{{Kind: "topic"}} }, "Config.Exchanges[0].Name"},
		{"binding to the default exchange", func(c *amqp.Config) { c.Bindings = []amqp.Binding{{RoutingKey: "k"}} }, "Config.Bindings[0].Exchange"},
		{"dead-letter queue is the queue", func(c *amqp.Config) { c.DeadLetter.Queue = "q" }, "Config.DeadLetter.Queue"},
		{"no queue on the default exchange", func(c *amqp.Config) { c.DeadLetter.NoQueue = true }, "Config.DeadLetter.NoQueue"},
		{"no queue, yet a queue named", func(c *amqp.Config) {
			// The name was dropped, and with it the routing key's
			// default: copies went out with an empty key, unroutable.
			c.DeadLetter = amqp.DeadLetterConfig{Exchange: "dlx", Queue: "q.dead", NoQueue: true}
		}, "Config.DeadLetter.Queue"},
		{"routing key off the queue on the default exchange", func(c *amqp.Config) { c.DeadLetter.RoutingKey = "elsewhere" }, "Config.DeadLetter.RoutingKey"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := ok
			tc.edit(&cfg)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, err := amqp.Open(ctx, cfg)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.field)
			assert.NotContains(t, err.Error(), "secret", "the password leaked into the error")
		})
	}
}

// A timeout in the wrong unit (DialTimeout: 10, meant as seconds, is 10 ns)
// was accepted: every dial timed out before it began, and Open took the
// broker for unreachable and retried until its context ended; every
// dead-letter copy's confirm was given up at once, and the poison message
// retried without end. Open refuses each at once, naming the field.
func TestOpenRefusesTimeoutsBelowAMillisecond(t *testing.T) {
	ok := amqp.Config{URL: "amqp://u:secret@localhost:5672/", Queue: "q"}
	for name, set := range map[string]func(*amqp.Config, time.Duration){
		"Config.DialTimeout":    func(c *amqp.Config, d time.Duration) { c.DialTimeout = d },
		"Config.ConfirmTimeout": func(c *amqp.Config, d time.Duration) { c.ConfirmTimeout = d },
	} {
		t.Run(name, func(t *testing.T) {
			for _, d := range []time.Duration{10, time.Millisecond - 1} {
				cfg := ok
				set(&cfg, d)
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
				_, err := amqp.Open(ctx, cfg)
				cancel()
				require.Error(t, err)
				assert.Contains(t, err.Error(), name, "%v", d)
				assert.NotErrorIs(t, err, context.DeadlineExceeded, "refused at once, not retried")
			}
		})
	}
}

// A reconnect backoff in the wrong unit (ReconnectMaxBackoff: 10, meant as
// seconds, is 10 ns) was accepted while DialTimeout and ConfirmTimeout
// below a millisecond are refused: through an outage the reconnects
// dialled back to back, a warning logged for each, and Open against a
// broker that was down ran until its context ended. Open refuses each at
// once, naming the field.
func TestOpenRefusesReconnectBackoffsBelowAMillisecond(t *testing.T) {
	ok := amqp.Config{URL: "amqp://u:secret@localhost:5672/", Queue: "q"}
	for name, set := range map[string]func(*amqp.Config, time.Duration){
		"Config.ReconnectMinBackoff": func(c *amqp.Config, d time.Duration) { c.ReconnectMinBackoff = d },
		"Config.ReconnectMaxBackoff": func(c *amqp.Config, d time.Duration) { c.ReconnectMinBackoff, c.ReconnectMaxBackoff = d, d },
	} {
		t.Run(name, func(t *testing.T) {
			for _, d := range []time.Duration{10, time.Millisecond - 1} {
				cfg := ok
				set(&cfg, d)
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
				_, err := amqp.Open(ctx, cfg)
				cancel()
				require.Error(t, err)
				assert.Contains(t, err.Error(), "Config.Reconnect", "%v", d)
				assert.Contains(t, err.Error(), "below a millisecond", "%v", d)
				assert.NotErrorIs(t, err, context.DeadlineExceeded, "refused at once, not retried")
			}
		})
	}
}

// TestOpenUnreachableRedactsPassword: a broker that does not answer is
// retried until the context ends, and the error hides the password.
func TestOpenUnreachableRedactsPassword(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close()) // nothing listens there now

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err = amqp.Open(ctx, amqp.Config{
		URL: "amqp://user:s3cr3t@" + addr + "/", Queue: "q", Logger: testLogger(t),
		ReconnectMinBackoff: 10 * time.Millisecond, ReconnectMaxBackoff: 20 * time.Millisecond,
	})
	require.Error(t, err)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Contains(t, err.Error(), "connection refused")
	assert.NotContains(t, err.Error(), "s3cr3t")
}

func TestHeaderStrings(t *testing.T) {
	ts := time.Date(2026, 11, 22, 1, 2, 3, 0, time.UTC)
	got := amqp.HeaderStrings(amqp091.Table{
		"s":       "text",
		"b":       []byte("bytes"),
		"bool":    true,
		"i8":      int8(-8),
		"i16":     int16(16),
		"i32":     int32(-32),
		"i64":     int64(1 << 40),
		"u8":      uint8(200),
		"f32":     float32(1.5),
		"f64":     2.25,
		"ts":      ts,
		"dec":     amqp091.Decimal{Scale: 2, Value: 12345},
		"void":    nil,
		"table":   amqp091.Table{"k": "v", "n": int32(1)},
		"array":   []any{"a", int64(2), []byte("c")},
		"x-death": []any{amqp091.Table{"count": int64(1), "queue": "q", "time": ts}},
	})
	assert.Equal(t, map[string]string{
		"s":       "text",
		"b":       "bytes",
		"bool":    "true",
		"i8":      "-8",
		"i16":     "16",
		"i32":     "-32",
		"i64":     "1099511627776",
		"u8":      "200",
		"f32":     "1.5",
		"f64":     "2.25",
		"ts":      "2026-11-22T01:02:03Z",
		"dec":     "123.45",
		"void":    "",
		"table":   `{"k":"v","n":1}`,
		"array":   `["a",2,"c"]`,
		"x-death": `[{"count":1,"queue":"q","time":"2026-11-22T01:02:03Z"}]`,
	}, got)
	assert.Empty(t, amqp.HeaderStrings(nil))
}

// AMQP heartbeats are whole seconds, and amqp091 takes a client interval
// below one second for none and uses the broker's (60 s by default): a
// Heartbeat of 500ms would find a dead peer after minutes instead of about
// a second. Open refuses it, naming the field.
func TestSubSecondHeartbeatRefused(t *testing.T) {
	cfg := amqp.Config{URL: brokerURL(t), Queue: queueName(t), Heartbeat: 500 * time.Millisecond, Logger: testLogger(t)}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	src, err := amqp.Open(ctx, cfg)
	if err == nil {
		defer src.Close()
		t.Fatalf("Open accepted Heartbeat %v; the connection negotiated a heartbeat of %v", cfg.Heartbeat, amqp.Heartbeat(src))
	}
	assert.Contains(t, err.Error(), "Config.Heartbeat")
}

// A heartbeat parameter in the URL (the RabbitMQ URI spec's query) takes
// the place of Config.Heartbeat in amqp091, and heartbeat=0 proposes none:
// the broker's interval (60 s by default) then applies, as with a
// sub-second Heartbeat. Open refuses it, naming the parameter.
func TestURLHeartbeatZeroRefused(t *testing.T) {
	u := brokerURL(t)
	sep := "?"
	if strings.Contains(u, "?") {
		sep = "&"
	}
	cfg := amqp.Config{URL: u + sep + "heartbeat=0", Queue: queueName(t), Heartbeat: 2 * time.Second, Logger: testLogger(t)}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	src, err := amqp.Open(ctx, cfg)
	if err == nil {
		defer src.Close()
		t.Fatalf("Open accepted a URL with heartbeat=0 and Heartbeat %v; the connection negotiated a heartbeat of %v", cfg.Heartbeat, amqp.Heartbeat(src))
	}
	assert.Contains(t, err.Error(), "heartbeat")
}

// A name over AMQP's 255 bytes, or an argument table holding a Go type
// AMQP cannot carry, is a configuration error like any other: Open fails
// at once naming the field. The broker never sees them (amqp091 refuses to
// write the frame and drops the connection), so they are not the broker's
// verdict, and retrying them cannot succeed.
func TestUnencodableConfigFailsAtOnce(t *testing.T) {
	url := brokerURL(t)
	long := strings.Repeat("n", 256)
	cases := []struct {
		name  string
		edit  func(c *amqp.Config)
		field string
	}{
		{"exchange name", func(c *amqp.Config) { c.Exchanges = []amqp.Exchange{{Name: long}} }, "Config.Exchanges[0].Name"},
		{"exchange kind", func(c *amqp.Config) { c.Exchanges = []amqp.Exchange{{Name: "x", Kind: long}} }, "Config.Exchanges[0].Kind"},
		{"exchange args", func(c *amqp.Config) {
			c.Exchanges = []amqp.Exchange{{Name: c.Queue + ".x", Args: amqp091.Table{"k": []string{"a"}}}}
		}, "Config.Exchanges[0].Args"},
		{"binding exchange", func(c *amqp.Config) { c.Bindings = []amqp.Binding{{Exchange: long}} }, "Config.Bindings[0].Exchange"},
		{"binding key", func(c *amqp.Config) { c.Bindings = []amqp.Binding{{Exchange: "amq.direct", RoutingKey: long}} }, "Config.Bindings[0].RoutingKey"},
		{"binding args", func(c *amqp.Config) {
			c.Bindings = []amqp.Binding{{Exchange: "amq.headers", Args: amqp091.Table{"x-match": "all", "n": uint64(1)}}}
		}, "Config.Bindings[0].Args"},
		{"queue args", func(c *amqp.Config) { c.QueueArgs = amqp091.Table{"x-max-length": uint64(10)} }, "Config.QueueArgs"},
		{"queue args key", func(c *amqp.Config) { c.QueueArgs = amqp091.Table{long: "v"} }, "Config.QueueArgs"},
		{"consumer tag", func(c *amqp.Config) { c.ConsumerTag = long }, "Config.ConsumerTag"},
		{"dead-letter queue", func(c *amqp.Config) { c.DeadLetter.Queue = long }, "Config.DeadLetter.Queue"},
		{"default dead-letter queue of a long queue", func(c *amqp.Config) { c.Queue += strings.Repeat("q", 255-len(c.Queue)) }, "Config.DeadLetter.Queue"},
		{"dead-letter exchange", func(c *amqp.Config) { c.DeadLetter.Exchange = long }, "Config.DeadLetter.Exchange"},
		{"dead-letter exchange kind", func(c *amqp.Config) {
			c.DeadLetter.Exchange, c.DeadLetter.ExchangeKind = c.Queue+".dlx", long
		}, "Config.DeadLetter.ExchangeKind"},
		{"dead-letter routing key", func(c *amqp.Config) {
			c.DeadLetter.Exchange, c.DeadLetter.RoutingKey = c.Queue+".dlx", long
		}, "Config.DeadLetter.RoutingKey"},
		{"dead-letter queue args", func(c *amqp.Config) { c.DeadLetter.QueueArgs = amqp091.Table{"x-max-length": uint(10)} }, "Config.DeadLetter.QueueArgs"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := amqp.Config{URL: url, Queue: queueName(t), Logger: testLogger(t),
				ReconnectMinBackoff: 10 * time.Millisecond, ReconnectMaxBackoff: 50 * time.Millisecond}
			tc.edit(&cfg)
			newAdmin(t).cleanupQueue(cfg.Queue)
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			src, err := amqp.Open(ctx, cfg)
			if err == nil {
				_ = src.Close()
				t.Fatal("Open accepted the configuration")
			}
			require.NotErrorIs(t, err, context.DeadlineExceeded, "Open retried the configuration until its context ended")
			assert.Contains(t, err.Error(), tc.field)
		})
	}
}

// TestUnparsableURLDoesNotPrintThePassword: a URL that does not parse (a
// password with a character that must be percent-encoded, left as it is)
// fails Open without any part of the password in the error. The parser
// quotes the URL escaped (%q), so a password with a quote, a control
// character or a non-ASCII letter was printed whole, and an invalid
// escape printed its three characters.
func TestUnparsableURLDoesNotPrintThePassword(t *testing.T) {
	for _, u := range []string{
		`amqp://user:pa"ss-word@localhost:5672/`,
		"amqp://user:pa\x01ss-word@localhost:5672/",
		"amqp://user:pä\"ss-word@localhost:5672/",
		`amqp://user:pa%zzss-word@localhost:5672/`,
		`amqp://user:pa%zzss-word"@localhost:5672/`,
	} {
		_, err := amqp.Open(context.Background(), amqp.Config{URL: u, Queue: "q"})
		require.Error(t, err)
		assert.Contains(t, err.Error(), "Config.URL")
		assert.NotContains(t, err.Error(), "ss-word", "the password leaked into the error")
		assert.NotContains(t, err.Error(), "%zz", "a part of the password leaked into the error")
	}
}

// TestArgumentIntOver32BitsRefused: amqp091 writes a Go int as AMQP's
// 32-bit signed integer, cutting off the high bits. An x-max-length-bytes
// of 10 GB given as an int declared the queue with 1,410,065,408 bytes (and,
// with x-overflow drop-head, the broker dropped messages past that); a
// value of 1<<32 declared it 0. Open refuses an int outside 32 bits in any
// argument table, naming the field; int64 carries it whole.
func TestArgumentIntOver32BitsRefused(t *testing.T) {
	url := brokerURL(t)
	a := newAdmin(t)
	cases := []struct {
		name  string
		edit  func(c *amqp.Config)
		field string
	}{
		{"queue args", func(c *amqp.Config) { c.QueueArgs = amqp091.Table{"x-max-length-bytes": 10_000_000_000} }, "Config.QueueArgs"},
		{"nested", func(c *amqp.Config) {
			c.Bindings = []amqp.Binding{{Exchange: "amq.headers", Args: amqp091.Table{"x-match": "all", "n": []any{1 << 32}}}}
		}, "Config.Bindings[0].Args"},
		{"dead-letter queue args", func(c *amqp.Config) { c.DeadLetter.QueueArgs = amqp091.Table{"x-max-length": -1 << 33} }, "Config.DeadLetter.QueueArgs"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := amqp.Config{URL: url, Queue: queueName(t), Logger: testLogger(t)}
			tc.edit(&cfg)
			a.cleanupQueue(cfg.Queue)
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			src, err := amqp.Open(ctx, cfg)
			if err == nil {
				_ = src.Close()
				t.Fatal("Open accepted the configuration")
			}
			require.NotErrorIs(t, err, context.DeadlineExceeded)
			assert.Contains(t, err.Error(), tc.field)
			assert.Contains(t, err.Error(), "int64")
		})
	}
	q := queueName(t)
	a.cleanupQueue(q)
	openSource(t, amqp.Config{Queue: q, QueueArgs: amqp091.Table{"x-max-length-bytes": int64(10_000_000_000), "x-max-length": 1000}})
}
