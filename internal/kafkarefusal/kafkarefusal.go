// Package kafkarefusal tells a broker that refuses a client's
// configuration (its TLS or SASL settings) from one that cannot be
// reached. sarama takes both for brokers that are down: a failed TLS
// handshake becomes "run out of available brokers" with the handshake's
// error appended, and a SASL mechanism the broker does not offer loses
// even that. Retrying a refusal never helps, so the clients of this module
// probe the brokers when they find none reachable, and return a refusal at
// once.
package kafkarefusal

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"github.com/rcrowley/go-metrics"

	"github.com/onceco/once/internal/tlsfail"
)

// Error is a broker's refusal of the client's configuration.
type Error struct {
	// Broker is the address of the broker that refused.
	Broker string
	// What was refused: "TLS" (the handshake failed: a certificate not
	// trusted or not presented, TLS to a port that speaks none) or "SASL"
	// (the mechanism is not offered, or the credentials are wrong).
	What string
	// Err is the refusal as the client library reported it.
	Err error
}

// Error names the broker, what it refused and the sarama settings that
// configure it.
func (e *Error) Error() string {
	field := "Net.TLS"
	if e.What == "SASL" {
		field = "Net.SASL"
	}
	return fmt.Sprintf("broker %s refused the %s settings (sarama Config.%s): %v", e.Broker, e.What, field, e.Err)
}

// Unwrap returns the refusal as the client library reported it.
func (e *Error) Unwrap() error { return e.Err }

// Classify returns the refusal err is, coming from broker, or nil when
// err may be a broker that cannot be reached (or something else).
func Classify(broker string, err error) *Error {
	if err == nil {
		return nil
	}
	// errors.Is, not errors.As: sarama wraps the broker's message with
	// the code in an error that matches the code only so.
	for _, k := range []error{sarama.ErrSASLAuthenticationFailed, sarama.ErrUnsupportedSASLMechanism, sarama.ErrIllegalSASLState} {
		if errors.Is(err, k) {
			return &Error{Broker: broker, What: "SASL", Err: err}
		}
	}
	if tlsfail.Refused(err) {
		return &Error{Broker: broker, What: "TLS", Err: err}
	}
	return nil
}

// MaxProbeWait bounds how long Probe waits for the brokers' answers: a
// refusal comes within a few round trips of the connection, and a broker
// that has not answered by then is taken for one that cannot be reached
// (its probe goes on in the background until sarama's timeouts).
const MaxProbeWait = 5 * time.Second

// Probe connects to each of brokers with sc, as sarama does (TLS and SASL
// included), and returns the first refusal of the configuration; nil when
// no broker refused it (every one reachable and satisfied, or
// unreachable), or when ctx ended or MaxProbeWait passed first. It never
// modifies sc.
func Probe(ctx context.Context, brokers []string, sc *sarama.Config) *Error {
	ctx, cancel := context.WithTimeout(ctx, MaxProbeWait)
	defer cancel()
	probes := []func(string, *sarama.Config) *Error{probe, crossProbe, saslProbe}
	results := make(chan *Error, len(probes)*len(brokers))
	for _, addr := range brokers {
		for _, p := range probes {
			go func() { results <- p(addr, sc) }()
		}
	}
	for range len(probes) * len(brokers) {
		select {
		case r := <-results:
			if r != nil {
				return r
			}
		case <-ctx.Done():
			return nil
		}
	}
	return nil
}

// probe opens one connection to addr with sc's settings and asks for its
// API versions.
func probe(addr string, sc *sarama.Config) *Error {
	return Classify(addr, request(addr, sc))
}

// crossProbe asks addr for its API versions with TLS the other way round
// from sc (and no SASL, which a broker does not ask before that request):
// an answer means that the port speaks TLS where sc does not, or the
// reverse, which a broker that is down or slow never fakes. A TLS client
// at a plain port is not refused in a way it can tell: Apache Kafka reads
// the TLS hello as the size of a request too large and closes the
// connection, other servers wait for the rest of that request.
func crossProbe(addr string, base *sarama.Config) *Error {
	sc := *base
	sc.Net.SASL.Enable = false
	var why string
	if base.Net.TLS.Enable {
		sc.Net.TLS.Enable, sc.Net.TLS.Config = false, nil
		why = "the port speaks Kafka without TLS, and Net.TLS.Enable is set"
	} else {
		// Whether the port speaks TLS at all, not whom to trust.
		sc.Net.TLS.Enable, sc.Net.TLS.Config = true, &tls.Config{InsecureSkipVerify: true}
		why = "the port speaks TLS, and Net.TLS.Enable is not set"
	}
	if request(addr, &sc) != nil {
		return nil
	}
	return &Error{Broker: addr, What: "TLS", Err: errors.New(why)}
}

// errProbeToken is the token provider's error in saslProbe: its SASL
// handshake was accepted, and no credentials are sent.
var errProbeToken = errors.New("kafkarefusal: no token (probing whether the listener asks for SASL)")

type probeToken struct{}

func (probeToken) Token() (*sarama.AccessToken, error) { return nil, errProbeToken }

// saslProbe finds whether addr's listener asks for SASL where sc does not
// authenticate: a broker that asks for it closes the connection of a
// client that does not at its first request that needs it, which looks
// like a broker going down. When a metadata request (for one topic
// name, whose answer is short) without SASL fails, it sends a SASL
// handshake for OAUTHBEARER and no credentials: a listener that asks for
// SASL accepts the handshake (the token provider then fails before
// anything is sent) or answers that it offers other mechanisms; a plain
// listener answers that no SASL is expected.
func saslProbe(addr string, base *sarama.Config) *Error {
	if base.Net.SASL.Enable || metadata(addr, base) == nil {
		return nil
	}
	sc := *base
	sc.Net.SASL.Enable, sc.Net.SASL.Handshake = true, true
	sc.Net.SASL.Mechanism, sc.Net.SASL.Version = sarama.SASLTypeOAuth, sarama.SASLHandshakeV1
	sc.Net.SASL.TokenProvider = probeToken{}
	err := request(addr, &sc)
	if !errors.Is(err, errProbeToken) && !errors.Is(err, sarama.ErrUnsupportedSASLMechanism) {
		return nil
	}
	return &Error{Broker: addr, What: "SASL", Err: errors.New("the listener asks for SASL authentication, and Net.SASL.Enable is not set")}
}

// metadata asks addr, with sc, for the metadata of one topic name: nil
// when the broker answered.
func metadata(addr string, base *sarama.Config) error {
	sc := *base
	sc.MetricRegistry = metrics.NewRegistry()
	b := sarama.NewBroker(addr)
	if err := b.Open(&sc); err != nil {
		return err
	}
	defer func() { _ = b.Close() }()
	req := sarama.NewMetadataRequest(sc.Version, []string{"once-probe"})
	req.AllowAutoTopicCreation = false
	_, err := b.GetMetadata(req)
	return err
}

// request opens one connection to addr with sc (TLS and SASL as sc says)
// and asks for its API versions: nil when the broker answered.
func request(addr string, base *sarama.Config) error {
	sc := *base
	sc.MetricRegistry = metrics.NewRegistry()
	b := sarama.NewBroker(addr)
	if err := b.Open(&sc); err != nil {
		return err // a config sarama refuses: no refusal, and no answer
	}
	defer func() { _ = b.Close() }()
	connected, err := b.Connected() // waits for the handshakes
	if err == nil && connected {
		// The TLS handshake runs at the first request; sarama goes on
		// after a failed API versions request when SASL is off.
		_, err = b.ApiVersions(&sarama.ApiVersionsRequest{})
	}
	if err == nil && !connected {
		err = sarama.ErrNotConnected
	}
	return err
}

// Explain returns err, or, when err says that sarama found no broker to
// talk to (sarama.ErrOutOfBrokers) and a probe of brokers with sc finds
// one refusing the settings, that refusal, which says why.
func Explain(ctx context.Context, brokers []string, sc *sarama.Config, err error) error {
	if !errors.Is(err, sarama.ErrOutOfBrokers) {
		return err
	}
	if r := Probe(ctx, brokers, sc); r != nil {
		return r
	}
	return err
}
