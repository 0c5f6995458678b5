package amqpout

import (
	"context"
	"crypto/tls"
	"net"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/outbox"
)

func TestNewRejectsBadConfig(t *testing.T) {
	_, err := New(Config{})
	require.ErrorContains(t, err, "URL is required")
	_, err = New(Config{URL: "http://host"})
	require.ErrorContains(t, err, "Config.URL")
	_, err = New(Config{URL: "amqp://h/", ConfirmTimeout: -time.Second})
	require.ErrorContains(t, err, "negative")
	// AMQP heartbeats are whole seconds; amqp091 takes less than one for
	// none and adopts the broker's interval (60 s by default).
	_, err = New(Config{URL: "amqp://h/", Heartbeat: 500 * time.Millisecond})
	require.ErrorContains(t, err, "Config.Heartbeat")
	p, err := New(Config{URL: "amqp://h/"})
	require.NoError(t, err)
	assert.Equal(t, DefaultConfirmTimeout, p.cfg.ConfirmTimeout)
}

// A timeout in the wrong unit (ConfirmTimeout: 10, meant as seconds, is 10
// ns) was accepted: every batch was given up before its confirms could
// come and its connection dropped, and the relay retried without end;
// with DialTimeout no connect could finish. New refuses each, naming the
// field; a negative one is refused naming it too.
func TestNewRefusesTimeoutsBelowAMillisecond(t *testing.T) {
	for name, set := range map[string]func(*Config, time.Duration){
		"Config.DialTimeout":    func(c *Config, d time.Duration) { c.DialTimeout = d },
		"Config.ConfirmTimeout": func(c *Config, d time.Duration) { c.ConfirmTimeout = d },
	} {
		t.Run(name, func(t *testing.T) {
			for _, d := range []time.Duration{10, time.Millisecond - 1, -time.Second} {
				cfg := Config{URL: "amqp://h/"}
				set(&cfg, d)
				_, err := New(cfg)
				require.Error(t, err, "%v", d)
				assert.Contains(t, err.Error(), name, "%v", d)
			}
			cfg := Config{URL: "amqp://h/"}
			set(&cfg, time.Millisecond)
			_, err := New(cfg)
			require.NoError(t, err, "a millisecond is accepted")
		})
	}
}

func TestPublishingCarriesIDTypeTraceAndPersistence(t *testing.T) {
	p, err := New(Config{URL: "amqp://h/"})
	require.NoError(t, err)
	at := time.Unix(1700000000, 0)
	pub := p.publishing(outbox.Record{EventID: "e-1", Type: "order.confirmed", CreatedAt: at, Body: []byte("b"),
		Headers: map[string]string{"traceparent": "00-x"}})
	assert.Equal(t, "e-1", pub.MessageId)
	assert.Equal(t, "order.confirmed", pub.Type)
	assert.Equal(t, amqp091.Persistent, pub.DeliveryMode)
	assert.Equal(t, at, pub.Timestamp)
	assert.Equal(t, amqp091.Table{"traceparent": "00-x"}, pub.Headers)

	p.cfg.Transient = true
	assert.Equal(t, amqp091.Transient, p.publishing(outbox.Record{}).DeliveryMode)
}

func TestMissingExchangeIsReadFromTheCloseReason(t *testing.T) {
	assert.Equal(t, "orders", missingExchange(&amqp091.Error{Code: amqp091.NotFound,
		Reason: "NOT_FOUND - no exchange 'orders' in vhost '/'"}))
	assert.Empty(t, missingExchange(&amqp091.Error{Code: amqp091.NotFound, Reason: "NOT_FOUND - no queue 'q' in vhost '/'"}))
	assert.Empty(t, missingExchange(&amqp091.Error{Code: amqp091.ChannelError, Reason: "no exchange 'x' in vhost"}))
	assert.Empty(t, missingExchange(nil))
}

// A 403 close names an exchange the user may not write to (every record
// to it is refused), or, under topic permissions, one routing key of it
// (only records with that key are): RabbitMQ 3.x says "access to topic",
// later releases "write access to topic".
func TestRefusedPublishIsReadFromTheCloseReason(t *testing.T) {
	rec := func(exchange, routingKey string) outbox.Record {
		return outbox.Record{Topic: exchange, RoutingKey: routingKey}
	}
	whole := refusedPublish(&amqp091.Error{Code: amqp091.AccessRefused,
		Reason: "ACCESS_REFUSED - write access to exchange 'orders' in vhost '/' refused for user 'u'"})
	assert.True(t, whole.refuses(rec("orders", "any")))
	assert.False(t, whole.refuses(rec("other", "any")))
	for _, reason := range []string{
		"ACCESS_REFUSED - access to topic 'secret.x' in exchange 'amq.topic' in vhost '/' refused for user 'u'",
		"ACCESS_REFUSED - write access to topic 'secret.x' in exchange 'amq.topic' in vhost '/' refused for user 'u'",
	} {
		topic := refusedPublish(&amqp091.Error{Code: amqp091.AccessRefused, Reason: reason})
		assert.True(t, topic.refuses(rec("amq.topic", "secret.x")), reason)
		assert.False(t, topic.refuses(rec("amq.topic", "allowed.x")), reason)
	}
	assert.Nil(t, refusedPublish(&amqp091.Error{Code: amqp091.NotFound, Reason: "NOT_FOUND - no exchange 'x' in vhost '/'"}))
	assert.False(t, refusedPublish(nil).refuses(rec("", "q")))
}

// Headers RabbitMQ routes by ("CC", "BCC") must be arrays, which an
// outbox header cannot be: Check refuses them before they close the
// channel. Names are case-sensitive.
func TestCheckRefusesRoutingHeaders(t *testing.T) {
	p, err := New(Config{URL: "amqp://guest:guest@localhost:5672/"})
	require.NoError(t, err)
	for _, name := range []string{"CC", "BCC"} {
		err := p.Check(outbox.Record{RoutingKey: "q", EventID: "e", Headers: map[string]string{name: "x"}})
		assert.True(t, outbox.IsRejected(err), "%s: %v", name, err)
	}
	assert.NoError(t, p.Check(outbox.Record{RoutingKey: "q", EventID: "e", Headers: map[string]string{"cc": "x"}}))
}

// The publisher dials with a copy of Config.TLSConfig: amqp091 writes the
// URL's host into an empty ServerName of the config it is given, which
// would then name this broker for every other use of the caller's config
// (another publisher or source checking its broker's certificate).
func TestTLSConfigIsNotModified(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.Close() // no TLS, no AMQP
		}
	}()
	shared := &tls.Config{MinVersion: tls.VersionTLS12}
	p, err := New(Config{URL: "amqps://guest:guest@" + ln.Addr().String() + "/", TLSConfig: shared, DialTimeout: time.Second})
	require.NoError(t, err)
	defer p.Close()
	_, _, _, _, err = p.channel(context.Background())
	require.Error(t, err, "the server speaks neither TLS nor AMQP")
	assert.Empty(t, shared.ServerName, "the publisher wrote into the caller's tls.Config")
}

// A Config.URL that does not parse is refused without being printed: the
// parser's error quotes the URL, password and all.
func TestUnparsableURLDoesNotPrintThePassword(t *testing.T) {
	for _, url := range []string{"amqp://guest:s3cr%zzet@host/", "amqp://guest:s3cr\"et\x01@host/", "amqp://guest:s3cret@host:port/"} {
		_, err := New(Config{URL: url})
		require.ErrorContains(t, err, "Config.URL", url)
		assert.NotContains(t, err.Error(), "s3cr", "the password is printed")
	}
}

// A Config.TLSConfig with an amqp:// URL is refused, as amqp.Open refuses
// it: amqp091 ignores it there and connects without TLS, sending the
// password in clear text to a user who believes TLS is on.
func TestNewRefusesTLSConfigWithoutAmqps(t *testing.T) {
	_, err := New(Config{URL: "amqp://guest:s3cret@host/", TLSConfig: &tls.Config{}})
	require.ErrorContains(t, err, "Config.TLSConfig")
	assert.NotContains(t, err.Error(), "s3cret")
	_, err = New(Config{URL: "amqps://guest:s3cret@host/", TLSConfig: &tls.Config{}})
	require.NoError(t, err)
}

// Message.Headers named "id" or "type" are the publishers' (outbox.Message
// says so, and kafkaout drops them): on RabbitMQ they went out beside the
// message-id and type properties, so a message carried a second id, and a
// message without a Type carried the header's, which the consuming side
// reads as its event type.
func TestPublishingDropsHeadersNamedIDOrType(t *testing.T) {
	p, err := New(Config{URL: "amqp://h/"})
	require.NoError(t, err)
	pub := p.publishing(outbox.Record{EventID: "e-1", Body: []byte("b"),
		Headers: map[string]string{"id": "other", "type": "order.paid", "x-tenant": "t1", "traceparent": "00-x"}})
	assert.Equal(t, "e-1", pub.MessageId)
	assert.Empty(t, pub.Type)
	assert.Equal(t, amqp091.Table{"x-tenant": "t1", "traceparent": "00-x"}, pub.Headers)
}

// A heartbeat parameter in the URL takes the place of Config.Heartbeat
// (amqp091 reads it), and heartbeat=0 proposes none: the broker's interval
// (60 s by default) applies, and a dead broker goes unnoticed six times
// longer than the default. New refuses it, as amqp.Open does, without
// printing the password.
func TestNewRefusesHeartbeatZeroInTheURL(t *testing.T) {
	for _, url := range []string{"amqp://guest:s3cret@host/?heartbeat=0", "amqp://guest:s3cret@host/vh?heartbeat=00&connection_timeout=5000"} {
		_, err := New(Config{URL: url})
		require.ErrorContains(t, err, "heartbeat=0", url)
		assert.NotContains(t, err.Error(), "s3cret")
	}
	_, err := New(Config{URL: "amqp://guest:s3cret@host/?heartbeat=5"})
	require.NoError(t, err)
}
