package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/kafkawait"
	"github.com/onceco/once/internal/kafkarefusal"
)

// defaultKafkaTimeout is -kafka-timeout's default: the bound of a dial
// and of each request to a Kafka broker.
const defaultKafkaTimeout = kafkawait.Default

// The environment variable of the SASL password: it has no flag, since a
// flag's value shows in ps and in the shell's history.
const envKafkaPassword = "ONCE_KAFKA_SASL_PASSWORD"

// kafkaFlags are the flags of a Kafka connection (brokers, TLS, SASL),
// the same on every command that reads Kafka; config maps them to the
// client configuration.
type kafkaFlags struct {
	getenv                func(string) string
	envErr                error // a variable that could not be read
	brokers               *string
	tls, insecure         *bool
	caFile, cert, key     *string
	mechanism, user, pass *string
	timeout               *time.Duration
	// used is where config notes the timeout it set, for the hint of
	// an error (the app's kafkaTimeout).
	used *time.Duration
}

func (a *app) kafkaFlagsOn(fs *flag.FlagSet) *kafkaFlags {
	var envErr error
	envBool := func(k string) bool {
		v := a.getenv(k)
		if v == "" {
			return false
		}
		b, err := strconv.ParseBool(v)
		if err != nil {
			envErr = usagef("env %s=%s: want true or false", k, safe(v))
		}
		return b
	}
	tlsDefault := envBool("ONCE_KAFKA_TLS")
	return &kafkaFlags{
		getenv:  a.getenv,
		envErr:  envErr,
		used:    &a.kafkaTimeout,
		timeout: fs.Duration("kafka-timeout", defaultKafkaTimeout, "bound of the dial and of each request to a Kafka broker: one that accepts the connection and never answers fails the command within about three times this, and a few seconds"),
		brokers: fs.String("kafka", a.getenv("ONCE_KAFKA_BROKERS"), "Kafka bootstrap `brokers`, comma-separated (env ONCE_KAFKA_BROKERS)"),
		tls:     fs.Bool("kafka-tls", tlsDefault, "connect to Kafka with TLS, trusting the system's roots (env ONCE_KAFKA_TLS=true); implied by -kafka-ca and -kafka-cert"),
		caFile:  fs.String("kafka-ca", a.getenv("ONCE_KAFKA_CA_FILE"), "PEM `file` of the CAs that sign the Kafka brokers' certificates, in place of the system's (env ONCE_KAFKA_CA_FILE)"),
		cert:    fs.String("kafka-cert", a.getenv("ONCE_KAFKA_CERT_FILE"), "PEM `file` of the client certificate shown to Kafka (mTLS; env ONCE_KAFKA_CERT_FILE); needs -kafka-key"),
		key:     fs.String("kafka-key", a.getenv("ONCE_KAFKA_KEY_FILE"), "PEM `file` of the client certificate's unencrypted key (env ONCE_KAFKA_KEY_FILE)"),
		insecure: fs.Bool("kafka-tls-insecure-skip-verify", false,
			"connect with TLS WITHOUT VERIFYING the brokers' certificates: anyone on the path can read and change the traffic and take the password (no environment variable)"),
		mechanism: fs.String("kafka-sasl", a.getenv("ONCE_KAFKA_SASL_MECHANISM"), "SASL `mechanism`: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (env ONCE_KAFKA_SASL_MECHANISM); the password comes from env "+envKafkaPassword+" or -kafka-password-file, never a flag"),
		user:      fs.String("kafka-user", a.getenv("ONCE_KAFKA_SASL_USER"), "SASL user `name` (env ONCE_KAFKA_SASL_USER)"),
		pass:      fs.String("kafka-password-file", a.getenv("ONCE_KAFKA_SASL_PASSWORD_FILE"), "`file` holding the SASL password, a trailing line break dropped (env ONCE_KAFKA_SASL_PASSWORD_FILE); or set env "+envKafkaPassword),
	}
}

// config returns the client configuration the flags say: TLS when any
// TLS flag is given, SASL when -kafka-sasl is. A bad combination, a file
// that cannot be read, is a usage error; no error holds the password.
// A warning goes to stderr when the brokers' certificates are not
// verified.
//
// The dial and each request wait at most -kafka-timeout, and metadata is
// asked twice at most (kafkawait.Bound): sarama's defaults (30 s each,
// four tries) make a broker that accepts connections and never answers
// hold a command for minutes; with the default -kafka-timeout it fails in
// about 30 s.
func (f *kafkaFlags) config(stderr io.Writer) (*sarama.Config, error) {
	if f.envErr != nil {
		return nil, f.envErr
	}
	if *f.timeout <= 0 {
		return nil, usagef("-kafka-timeout %v: want a duration above 0", *f.timeout)
	}
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_8_0_0
	kafkawait.Bound(sc, *f.timeout)
	*f.used = *f.timeout
	if *f.tls || *f.caFile != "" || *f.cert != "" || *f.key != "" || *f.insecure {
		tc, err := f.tlsConfig()
		if err != nil {
			return nil, err
		}
		sc.Net.TLS.Enable, sc.Net.TLS.Config = true, tc
		if *f.insecure {
			fmt.Fprintln(stderr, "once: WARNING: -kafka-tls-insecure-skip-verify: the Kafka brokers' certificates are not verified; anyone on the path can read and change the traffic")
		}
	}
	if err := f.saslConfig(sc); err != nil {
		return nil, err
	}
	return sc, nil
}

func (f *kafkaFlags) tlsConfig() (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: *f.insecure} //nolint:gosec // an explicit, loudly named opt-in
	if *f.caFile != "" {
		pem, err := os.ReadFile(*f.caFile)
		if err != nil {
			return nil, usagef("-kafka-ca: %v", err)
		}
		tc.RootCAs = x509.NewCertPool()
		if !tc.RootCAs.AppendCertsFromPEM(pem) {
			return nil, usagef("-kafka-ca %s: no PEM certificate in the file", *f.caFile)
		}
	}
	switch {
	case *f.cert != "" && *f.key != "":
		cert, err := tls.LoadX509KeyPair(*f.cert, *f.key)
		if err != nil {
			return nil, usagef("-kafka-cert %s, -kafka-key %s: %v", *f.cert, *f.key, err)
		}
		tc.Certificates = []tls.Certificate{cert}
	case *f.cert != "":
		return nil, usagef("-kafka-cert needs -kafka-key (env ONCE_KAFKA_KEY_FILE): the client certificate's key")
	case *f.key != "":
		return nil, usagef("-kafka-key needs -kafka-cert (env ONCE_KAFKA_CERT_FILE): the client certificate")
	}
	return tc, nil
}

func (f *kafkaFlags) saslConfig(sc *sarama.Config) error {
	envPass := f.getenv(envKafkaPassword)
	if *f.mechanism == "" {
		if *f.user != "" || *f.pass != "" {
			return usagef("-kafka-user and a password need -kafka-sasl (env ONCE_KAFKA_SASL_MECHANISM): PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512")
		}
		return nil
	}
	mechanism := strings.ToUpper(*f.mechanism)
	switch mechanism {
	case sarama.SASLTypePlaintext:
	case sarama.SASLTypeSCRAMSHA256:
		sc.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return &scramClient{mechanism: scram.Auth.AsSha256Mechanism} }
	case sarama.SASLTypeSCRAMSHA512:
		sc.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return &scramClient{mechanism: scram.Auth.AsSha512Mechanism} }
	default:
		return usagef("-kafka-sasl %s: want PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512", safe(*f.mechanism))
	}
	if *f.user == "" {
		return usagef("-kafka-sasl %s needs -kafka-user (env ONCE_KAFKA_SASL_USER)", mechanism)
	}
	var pass string
	switch {
	case *f.pass != "" && envPass != "":
		return usagef("the SASL password comes from env %s or -kafka-password-file, not both", envKafkaPassword)
	case *f.pass != "":
		b, err := os.ReadFile(*f.pass)
		if err != nil {
			return usagef("-kafka-password-file: %v", err)
		}
		pass = strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), "\r")
	default:
		pass = envPass
	}
	if pass == "" {
		return usagef("-kafka-sasl %s needs a password: set env %s, or give -kafka-password-file (a flag never takes it: it would show in ps)",
			mechanism, envKafkaPassword)
	}
	sc.Net.SASL.Enable = true
	sc.Net.SASL.Mechanism = sarama.SASLMechanism(mechanism)
	sc.Net.SASL.User, sc.Net.SASL.Password = *f.user, pass
	return nil
}

// scramClient is sarama's SCRAM exchange, made by franz-go's SCRAM
// implementation.
type scramClient struct {
	mechanism       func(scram.Auth) sasl.Mechanism
	user, pass, zid string
	session         sasl.Session
	started, isDone bool
}

func (c *scramClient) Begin(user, pass, zid string) error {
	c.user, c.pass, c.zid = user, pass, zid
	return nil
}

func (c *scramClient) Step(challenge string) (string, error) {
	if !c.started {
		c.started = true
		s, first, err := c.mechanism(scram.Auth{User: c.user, Pass: c.pass, Zid: c.zid}).Authenticate(context.Background(), "")
		if err != nil {
			return "", err
		}
		c.session = s
		return string(first), nil
	}
	done, next, err := c.session.Challenge([]byte(challenge))
	if err != nil {
		return "", err
	}
	c.isDone = done
	return string(next), nil
}

func (c *scramClient) Done() bool { return c.isDone }

// open opens the dead-letter queues names on the brokers kafkaBrokers
// (the -kafka value chosen) or at amqpURL, with the flags' TLS and SASL
// settings for Kafka, and amqpBase's settings for RabbitMQ.
func (f *kafkaFlags) open(stderr io.Writer, kafkaBrokers, amqpURL string, names []string, amqpBase dlq.AMQPConfig) ([]dlq.Queue, error) {
	var sc *sarama.Config
	if kafkaBrokers != "" && amqpURL == "" {
		var err error
		if sc, err = f.config(stderr); err != nil {
			return nil, err
		}
	}
	var qs []dlq.Queue
	for _, n := range names {
		q, err := openQueue(kafkaBrokers, sc, amqpURL, n, amqpBase)
		if err != nil {
			return nil, err
		}
		qs = append(qs, q)
	}
	return qs, nil
}

// kafkaHint names the flags that set what a broker refused, for an error
// that is a broker's refusal of the TLS or SASL settings; and says what
// an i/o timeout means when a Kafka client was configured with the
// timeout timeout (0: none was).
func kafkaHint(err error, timeout time.Duration) string {
	var r *kafkarefusal.Error
	if !errors.As(err, &r) {
		if timeout > 0 && errors.Is(err, os.ErrDeadlineExceeded) {
			return fmt.Sprintf(" (a Kafka broker did not answer within %v (-kafka-timeout): is -kafka the address of a Kafka listener, one without TLS unless -kafka-tls is given?)", timeout)
		}
		return ""
	}
	if r.What == "SASL" {
		return fmt.Sprintf(" (set with -kafka-sasl, -kafka-user, env %s or -kafka-password-file)", envKafkaPassword)
	}
	return " (set with -kafka-tls, -kafka-ca, -kafka-cert, -kafka-key)"
}
