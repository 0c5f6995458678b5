package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/internal/kafkatemp"
	"github.com/onceco/once/internal/kafkatest"
	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/internal/testcert"
)

// testCert is a certificate for 127.0.0.1 signed by itself, and its PEM
// files.
type testCert struct {
	tls               tls.Certificate
	certFile, keyFile string
}

func newTestCert(t *testing.T, cn string) testCert {
	t.Helper()
	c, certFile, keyFile := testcert.Files(t, cn)
	return testCert{tls: c, certFile: certFile, keyFile: keyFile}
}

func (c testCert) pool() *x509.CertPool { return testcert.Pool(c.tls) }

// securedDLQ makes two dead letters with a real consumer on k, then fixes
// the service; it returns the service and the dead-letter topic.
func securedDLQ(t *testing.T, k *testenv.Kafka) (*testenv.Service, string) {
	t.Helper()
	topic := testenv.Uniq("orders")
	k.CreateTopic(topic, 1)
	k.CreateTopic(topic+".dlq", 1)
	pool, _ := pgtest.Schema(t)
	msg := func(id string, v []byte) *sarama.ProducerMessage {
		return &sarama.ProducerMessage{Topic: topic, Value: sarama.ByteEncoder(v),
			Headers: []sarama.RecordHeader{{Key: []byte("id"), Value: []byte(id)}, {Key: []byte("type"), Value: []byte("order.paid")}}}
	}
	k.Produce(msg("fail-1", testenv.JSON(1, "fail")), msg("fail-2", testenv.JSON(2, "fail")))
	svc := testenv.StartService(t, pool, k.Source(testenv.Uniq("g"), topic), "billing")
	svc.WaitSettled(t, 2)
	require.EqualValues(t, 2, svc.C.Stats().DeadLettered)
	svc.Broken.Store(false)
	return svc, topic + ".dlq"
}

const saslPassword = "s3cret-pw"

// A cluster that asks for SASL is read and redriven with the mechanism,
// the user, and the password from the environment or a file: PLAIN and
// both SCRAM mechanisms.
func TestDLQOnASASLCluster(t *testing.T) {
	k := testenv.NewSecuredKafka(t, func() *sarama.Config {
		sc := testenv.Sarama()
		sc.Net.SASL.Enable = true
		sc.Net.SASL.Mechanism = sarama.SASLTypePlaintext
		sc.Net.SASL.User, sc.Net.SASL.Password = "admin", "admin-pw"
		return sc
	}, kfake.EnableSASL(), kfake.Superuser("PLAIN", "admin", "admin-pw"), kfake.Superuser("PLAIN", "ops", saslPassword),
		kfake.Superuser("SCRAM-SHA-256", "ops256", saslPassword), kfake.Superuser("SCRAM-SHA-512", "ops512", saslPassword))
	svc, dlqName := securedDLQ(t, k)
	brokers := strings.Join(k.Addrs, ",")

	for _, tc := range []struct{ mechanism, user string }{
		{"PLAIN", "ops"}, {"SCRAM-SHA-256", "ops256"}, {"SCRAM-SHA-512", "ops512"}, {"scram-sha-256", "ops256"},
	} {
		env := map[string]string{"ONCE_KAFKA_BROKERS": brokers, "ONCE_KAFKA_SASL_MECHANISM": tc.mechanism,
			"ONCE_KAFKA_SASL_USER": tc.user, "ONCE_KAFKA_SASL_PASSWORD": saslPassword}
		code, out, errOut := cli(t, env, "dlq", "list", "-dlq", dlqName)
		require.Equal(t, exitOK, code, "%s: %s", tc.mechanism, errOut)
		assert.Contains(t, out, "2 records", tc.mechanism)
		// The flags say the same, the password from a file (a trailing
		// line break is not part of it).
		pwFile := filepath.Join(t.TempDir(), "pw")
		require.NoError(t, os.WriteFile(pwFile, []byte(saslPassword+"\n"), 0o600))
		code, out, errOut = cli(t, map[string]string{}, "dlq", "show", "-kafka", brokers, "-kafka-sasl", tc.mechanism,
			"-kafka-user", tc.user, "-kafka-password-file", pwFile, "-dlq", dlqName, "-id", "fail-1")
		require.Equal(t, exitOK, code, "%s: %s", tc.mechanism, errOut)
		assert.Contains(t, out, "fail-1", tc.mechanism)
	}

	env := map[string]string{"ONCE_KAFKA_BROKERS": brokers, "ONCE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
		"ONCE_KAFKA_SASL_USER": "ops512", "ONCE_KAFKA_SASL_PASSWORD": saslPassword}
	code, out, errOut := cli(t, env, "dlq", "replay", "-dlq", dlqName, "-all")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "replayed 2")
	svc.WaitSettled(t, 4)
	effects := svc.Effects(t)
	assert.Equal(t, 1, effects["fail-1"])
	assert.Equal(t, 1, effects["fail-2"])

	// once ui reads the topic with the same settings.
	pr, pw := io.Pipe()
	var errb bytes.Buffer
	a := newApp(pw, &errb, func(k string) string { return env[k] })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan int, 1)
	go func() {
		done <- a.run(ctx, []string{"ui", "-addr", "127.0.0.1:0", "-dlq", dlqName})
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	require.NoError(t, err, "once ui did not start: %s", errb.String())
	go func() { _, _ = io.Copy(io.Discard, pr) }()
	resp, err := http.Get(strings.Fields(strings.TrimPrefix(line, "once console on "))[0])
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	assert.Contains(t, string(body), "kafka topic "+dlqName+"</a>: 2")
	cancel()
	assert.Equal(t, exitOK, <-done)
}

// A wrong password, a missing password, a mechanism the CLI does not
// know: each is said, and the password is never printed. There is no
// flag that takes a password (a flag's value shows in ps).
func TestDLQOnASASLClusterRefusals(t *testing.T) {
	k := testenv.NewSecuredKafka(t, func() *sarama.Config {
		sc := testenv.Sarama()
		sc.Net.SASL.Enable = true
		sc.Net.SASL.Mechanism = sarama.SASLTypePlaintext
		sc.Net.SASL.User, sc.Net.SASL.Password = "ops", saslPassword
		return sc
	}, kfake.EnableSASL(), kfake.Superuser("PLAIN", "ops", saslPassword), kfake.Superuser("SCRAM-SHA-256", "ops256", saslPassword))
	k.CreateTopic("orders.dlq", 1)
	brokers := strings.Join(k.Addrs, ",")
	// kfake closes the connection at a wrong password (Apache Kafka
	// answers that the authentication failed: TestDLQWrongPasswordOnApacheKafka).
	for _, tc := range []struct{ mechanism, user string }{{"PLAIN", "ops"}, {"SCRAM-SHA-256", "ops256"}} {
		env := map[string]string{"ONCE_KAFKA_BROKERS": brokers, "ONCE_KAFKA_SASL_MECHANISM": tc.mechanism,
			"ONCE_KAFKA_SASL_USER": tc.user, "ONCE_KAFKA_SASL_PASSWORD": "wr0ng-pw"}
		code, out, errOut := cli(t, env, "dlq", "list", "-dlq", "orders.dlq")
		t.Log(errOut)
		assert.Equal(t, exitFailure, code, tc.mechanism)
		assert.NotContains(t, out+errOut, "wr0ng-pw")
		assert.NotContains(t, out+errOut, saslPassword)
	}

	env := map[string]string{"ONCE_KAFKA_BROKERS": brokers}
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"-kafka-sasl", "PLAIN", "-kafka-user", "ops", "-kafka-password", saslPassword}, nil, "flag provided but not defined: -kafka-password"},
		{[]string{"-kafka-sasl", "PLAIN", "-kafka-user", "ops"}, nil, "ONCE_KAFKA_SASL_PASSWORD"},
		{[]string{"-kafka-sasl", "PLAIN"}, map[string]string{"ONCE_KAFKA_SASL_PASSWORD": saslPassword}, "-kafka-user"},
		{[]string{"-kafka-user", "ops"}, map[string]string{"ONCE_KAFKA_SASL_PASSWORD": saslPassword}, "-kafka-sasl"},
		{[]string{"-kafka-sasl", "GSSAPI", "-kafka-user", "ops"}, map[string]string{"ONCE_KAFKA_SASL_PASSWORD": saslPassword}, "PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512"},
		{[]string{"-kafka-sasl", "PLAIN", "-kafka-user", "ops", "-kafka-password-file", "/nonexistent/pw"},
			map[string]string{"ONCE_KAFKA_SASL_PASSWORD": saslPassword}, "not both"},
		{[]string{"-kafka-sasl", "PLAIN", "-kafka-user", "ops", "-kafka-password-file", "/nonexistent/pw"}, nil, "/nonexistent/pw"},
		{nil, map[string]string{"ONCE_KAFKA_TLS": "yes"}, "ONCE_KAFKA_TLS"},
	} {
		e := map[string]string{}
		for k, v := range env {
			e[k] = v
		}
		for k, v := range tc.env {
			e[k] = v
		}
		code, out, errOut := cli(t, e, append([]string{"dlq", "list", "-dlq", "orders.dlq"}, tc.args...)...)
		assert.Equal(t, exitUsage, code, "%v: %s", tc.args, errOut)
		assert.Contains(t, errOut, tc.want, "%v", tc.args)
		assert.NotContains(t, out+errOut, saslPassword, "%v", tc.args)
	}

	// Help names the settings, not their values.
	hidden := map[string]string{"ONCE_KAFKA_SASL_PASSWORD": saslPassword, "ONCE_KAFKA_SASL_USER": "ops-user-x"}
	for _, args := range [][]string{{"help", "dlq", "list"}, {"help", "ui"}, {"help", "status"}, {"dlq", "replay", "-h"}} {
		code, out, errOut := cli(t, hidden, args...)
		assert.Equal(t, exitOK, code, "%v: %s", args, errOut)
		for _, f := range []string{"-kafka-tls", "-kafka-ca", "-kafka-cert", "-kafka-key", "-kafka-sasl", "-kafka-user", "-kafka-password-file", "ONCE_KAFKA_SASL_PASSWORD"} {
			assert.Contains(t, out, f, "%v", args)
		}
		assert.NotContains(t, out+errOut, saslPassword, "%v", args)
		assert.NotContains(t, out+errOut, "ops-user-x", "%v", args)
	}
}

// A wrong password at Apache Kafka (SASL_AUTHENTICATION_FAILED) is said
// at once, naming the broker, what it refused and the settings that set
// it, and never the password.
func TestDLQWrongPasswordOnApacheKafka(t *testing.T) {
	c := kafkatest.Start(t, kafkatemp.Options{SASLUsers: map[string]string{"ops": saslPassword}})
	brokers := strings.Join(c.Brokers(), ",")
	env := map[string]string{"ONCE_KAFKA_BROKERS": brokers, "ONCE_KAFKA_SASL_MECHANISM": "PLAIN",
		"ONCE_KAFKA_SASL_USER": "ops", "ONCE_KAFKA_SASL_PASSWORD": saslPassword}
	// The right password reads (a topic that does not exist).
	code, _, errOut := cli(t, env, "dlq", "list", "-dlq", "orders.dlq")
	assert.Equal(t, exitFailure, code)
	assert.Contains(t, errOut, "orders.dlq")
	assert.NotContains(t, errOut, "SASL")

	_, schema := pgtest.Schema(t)
	code, _, errOut = cli(t, map[string]string{"DATABASE_URL": testenv.SchemaURL(schema)}, "migrate", "up")
	require.Equal(t, exitOK, code, errOut)
	env["ONCE_KAFKA_SASL_PASSWORD"] = "wr0ng-pw"
	for _, cmd := range [][]string{{"dlq", "list"}, {"dlq", "replay", "-all"}, {"status", "-database-url", testenv.SchemaURL(schema), "-group", "g", "-topic", "orders"}} {
		start := time.Now()
		code, out, errOut := cli(t, env, append(cmd, "-dlq", "orders.dlq")...)
		t.Log(errOut)
		assert.Equal(t, exitFailure, code, "%v", cmd)
		assert.Contains(t, errOut, "refused the SASL settings", "%v", cmd)
		assert.Contains(t, errOut, "-kafka-user", "%v: the error names the flags", cmd)
		assert.Contains(t, errOut, c.Brokers()[0], "%v", cmd)
		assert.NotContains(t, out+errOut, "wr0ng-pw", "%v", cmd)
		assert.NotContains(t, out+errOut, saslPassword, "%v", cmd)
		assert.Less(t, time.Since(start), 20*time.Second, "%v", cmd)
	}
}

// A cluster that speaks TLS is read and redriven with -kafka-ca; one that
// asks for a client certificate with -kafka-cert and -kafka-key. A
// certificate the CLI does not trust, or a client certificate missing,
// is said.
func TestDLQOnATLSCluster(t *testing.T) {
	server := newTestCert(t, "broker")
	client := newTestCert(t, "client")
	k := testenv.NewSecuredKafka(t, func() *sarama.Config {
		sc := testenv.Sarama()
		sc.Net.TLS.Enable = true
		sc.Net.TLS.Config = &tls.Config{RootCAs: server.pool(), Certificates: []tls.Certificate{client.tls}}
		return sc
	}, kfake.TLS(&tls.Config{Certificates: []tls.Certificate{server.tls},
		ClientAuth: tls.VerifyClientCertIfGiven, ClientCAs: client.pool()}))
	svc, dlqName := securedDLQ(t, k)
	brokers := strings.Join(k.Addrs, ",")

	code, out, errOut := cli(t, map[string]string{"ONCE_KAFKA_BROKERS": brokers, "ONCE_KAFKA_CA_FILE": server.certFile},
		"dlq", "list", "-dlq", dlqName)
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "2 records")
	code, out, errOut = cli(t, nil, "dlq", "replay", "-kafka", brokers, "-kafka-ca", server.certFile,
		"-kafka-cert", client.certFile, "-kafka-key", client.keyFile, "-dlq", dlqName, "-all")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "replayed 2")
	svc.WaitSettled(t, 4)
	assert.Equal(t, 1, svc.Effects(t)["fail-1"])

	// The system roots do not trust the broker's certificate.
	for _, env := range []map[string]string{nil, {"ONCE_KAFKA_TLS": "true"}} {
		args := []string{"dlq", "list", "-kafka", brokers, "-dlq", dlqName}
		if env == nil {
			args = append(args, "-kafka-tls")
		}
		code, _, errOut = cli(t, env, args...)
		assert.Equal(t, exitFailure, code)
		assert.Contains(t, errOut, "certificate")
		assert.Contains(t, errOut, "-kafka-ca", "the error names the flags")
	}
	// Unless verification is turned off, which is said.
	code, out, errOut = cli(t, nil, "dlq", "list", "-kafka", brokers, "-kafka-tls-insecure-skip-verify", "-dlq", dlqName)
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "records")
	assert.Contains(t, errOut, "not verified")
	// No TLS to a port that speaks TLS.
	code, _, errOut = cli(t, nil, "dlq", "list", "-kafka", brokers, "-dlq", dlqName)
	assert.Equal(t, exitFailure, code)
	assert.Contains(t, errOut, "TLS")

	code, _, errOut = cli(t, nil, "dlq", "list", "-kafka", brokers, "-kafka-cert", client.certFile, "-dlq", dlqName)
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, errOut, "-kafka-key")
	code, _, errOut = cli(t, nil, "dlq", "list", "-kafka", brokers, "-kafka-ca", client.keyFile, "-dlq", dlqName)
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, errOut, client.keyFile)
}

// A cluster that requires a client certificate (mTLS) is read with one,
// and one without it is said to be refused.
func TestDLQOnAnMTLSCluster(t *testing.T) {
	server := newTestCert(t, "broker")
	client := newTestCert(t, "client")
	k := testenv.NewSecuredKafka(t, func() *sarama.Config {
		sc := testenv.Sarama()
		sc.Net.TLS.Enable = true
		sc.Net.TLS.Config = &tls.Config{RootCAs: server.pool(), Certificates: []tls.Certificate{client.tls}}
		return sc
	}, kfake.TLS(&tls.Config{Certificates: []tls.Certificate{server.tls},
		ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: client.pool()}))
	k.CreateTopic("orders.dlq", 1)
	k.Produce(&sarama.ProducerMessage{Topic: "orders.dlq", Value: sarama.StringEncoder("{}")})
	env := map[string]string{"ONCE_KAFKA_BROKERS": strings.Join(k.Addrs, ","), "ONCE_KAFKA_CA_FILE": server.certFile,
		"ONCE_KAFKA_CERT_FILE": client.certFile, "ONCE_KAFKA_KEY_FILE": client.keyFile}
	code, out, errOut := cli(t, env, "dlq", "list", "-dlq", "orders.dlq")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "1 records")
	code, _, errOut = cli(t, nil, "dlq", "list", "-kafka", env["ONCE_KAFKA_BROKERS"], "-kafka-ca", server.certFile, "-dlq", "orders.dlq")
	t.Log(errOut)
	assert.Equal(t, exitFailure, code)
	assert.Contains(t, errOut, "certificate")
}
