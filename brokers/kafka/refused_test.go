package kafka

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceco/once/internal/kafkatemp"
	"github.com/onceco/once/internal/netcut"
	"github.com/onceco/once/internal/testcert"
)

type staticToken string

func (s staticToken) Token() (*sarama.AccessToken, error) {
	return &sarama.AccessToken{Token: string(s)}, nil
}

// A broker that refuses the client's configuration (a SASL mechanism it
// does not offer, a certificate the client does not trust, a client
// certificate missing, TLS on one side only) refuses it on every attempt:
// Open returns that
// refusal at once, naming it, instead of retrying it as brokers that
// cannot be reached until ctx ends. (A wrong password is not among the
// cases: kfake closes the connection where Apache Kafka answers
// SASL_AUTHENTICATION_FAILED, which sarama returns and Open never
// retried.)
func TestOpenReturnsARefusalAtOnce(t *testing.T) {
	server := testcert.SelfSigned(t, "broker")
	roots := x509.NewCertPool()
	roots.AddCert(server.Leaf)
	client := testcert.SelfSigned(t, "client")
	clientCAs := x509.NewCertPool()
	clientCAs.AddCert(client.Leaf)

	for _, tc := range []struct {
		name   string
		opts   []kfake.Opt
		client func(sc *sarama.Config)
		want   string
	}{{
		name: "SASL mechanism not offered",
		opts: []kfake.Opt{kfake.EnableSASL(), kfake.Superuser("PLAIN", "svc", "s3cret-pw")},
		client: func(sc *sarama.Config) {
			sc.Net.SASL.Enable = true
			sc.Net.SASL.Mechanism = sarama.SASLTypeOAuth
			sc.Net.SASL.TokenProvider = staticToken("s3cret-token")
		},
		want: "SASL",
	}, {
		name: "untrusted certificate",
		opts: []kfake.Opt{kfake.TLS(&tls.Config{Certificates: []tls.Certificate{server}})},
		client: func(sc *sarama.Config) {
			sc.Net.TLS.Enable = true
			sc.Net.TLS.Config = &tls.Config{} // the system roots
		},
		want: "certificate",
	}, {
		name: "client certificate missing",
		opts: []kfake.Opt{kfake.TLS(&tls.Config{Certificates: []tls.Certificate{server},
			ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: clientCAs})},
		client: func(sc *sarama.Config) {
			sc.Net.TLS.Enable = true
			sc.Net.TLS.Config = &tls.Config{RootCAs: roots}
		},
		want: "certificate",
	}, {
		name: "TLS to a port without TLS",
		client: func(sc *sarama.Config) {
			sc.Net.TLS.Enable = true
			sc.Net.TLS.Config = &tls.Config{RootCAs: roots}
		},
		want: "the port speaks Kafka without TLS",
	}, {
		name: "no SASL at a SASL listener",
		opts: []kfake.Opt{kfake.EnableSASL(), kfake.Superuser("PLAIN", "svc", "s3cret-pw")},
		client: func(sc *sarama.Config) {
			sc.Net.SASL.Enable = false
		},
		want: "asks for SASL",
	}, {
		name: "no TLS to a TLS port",
		opts: []kfake.Opt{kfake.TLS(&tls.Config{Certificates: []tls.Certificate{server}})},
		client: func(sc *sarama.Config) {
			sc.Net.TLS.Enable = false
		},
		want: "the port speaks TLS",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCluster(t, append(tc.opts, kfake.SeedTopics(1, "orders", "orders.dlq"))...)
			sc := saramaConfig()
			tc.client(sc)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			src, err := Open(ctx, Config{Brokers: c.addrs, Group: "g", Topics: []string{"orders"}, Sarama: sc,
				Logger: testLogger(), ReconnectMinBackoff: 10 * time.Millisecond, ReconnectMaxBackoff: 50 * time.Millisecond})
			if src != nil {
				_ = src.Close()
			}
			require.Error(t, err)
			t.Log(err)
			assert.NoError(t, ctx.Err(), "the refusal was retried until the context ended: %v", err)
			assert.Contains(t, err.Error(), tc.want)
			assert.Contains(t, err.Error(), c.addrs[0], "the error names the broker that refused")
			assert.NotContains(t, err.Error(), "unreachable")
			assert.NotContains(t, err.Error(), "s3cret")
		})
	}
}

// Brokers that accept connections and then say nothing (here a network
// holding every byte the client sends) make each attempt last sarama's
// timeouts (30 s per read, per metadata retry). Open returns when its ctx
// ends, as documented, not minutes later.
func TestOpenReturnsWhenCtxEndsDuringAnAttempt(t *testing.T) {
	t.Parallel()
	c := newCluster(t, kfake.SeedTopics(1, "orders", "orders.dlq"))
	p, err := netcut.NewProxy(c.addrs[0])
	require.NoError(t, err)
	p.Pause()
	t.Cleanup(func() { _ = p.Close(); p.Resume() })
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	start := time.Now()
	src, err := Open(ctx, Config{Brokers: []string{p.Addr()}, Group: "g", Topics: []string{"orders"}, Sarama: saramaConfig(), Logger: testLogger()})
	elapsed := time.Since(start)
	if src != nil {
		_ = src.Close()
	}
	require.Error(t, err)
	t.Log(err)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Less(t, elapsed, 5*time.Second, "Open outlived its context")
}

// A principal the cluster authenticates but does not authorize for the
// group or a consumed topic (its ACLs are missing) was refused at every
// join of the group, which the Source retried without end: Open
// succeeded, and Receive blocked for ever while the warnings said
// "consuming failed". Open returns the refusal, naming the group or topic.
func TestOpenRefusesAPrincipalWithoutAccess(t *testing.T) {
	allow := func(rt kmsg.ACLResourceType, name string) kfake.ACL {
		return kfake.ACL{Resource: rt, Name: name, Pattern: kmsg.ACLResourcePatternTypeLiteral, Operation: kmsg.ACLOperationAll, Allow: true}
	}
	cluster := allow(kmsg.ACLResourceTypeCluster, "kafka-cluster")
	for _, tc := range []struct {
		name string
		acls []kfake.ACL
		want []string
	}{{
		name: "no group ACL",
		acls: []kfake.ACL{cluster, allow(kmsg.ACLResourceTypeTopic, "orders"), allow(kmsg.ACLResourceTypeTopic, "orders.dlq")},
		want: []string{`consumer group "g"`, "not authorized"},
	}, {
		name: "no topic ACL",
		acls: []kfake.ACL{cluster, allow(kmsg.ACLResourceTypeGroup, "g"), allow(kmsg.ACLResourceTypeTopic, "orders.dlq")},
		want: []string{`topic "orders"`, "not authorized"},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCluster(t, kfake.EnableSASL(), kfake.EnableACLs(), kfake.Superuser("PLAIN", "admin", "admin"),
				kfake.User("PLAIN", "svc", "s3cret-pw", tc.acls...), kfake.SeedTopics(1, "orders", "orders.dlq"))
			sc := saramaConfig()
			sc.Net.SASL.Enable = true
			sc.Net.SASL.User = "svc"
			sc.Net.SASL.Password = "s3cret-pw"
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			src, err := Open(ctx, Config{Brokers: c.addrs, Group: "g", Topics: []string{"orders"}, Sarama: sc, Logger: testLogger()})
			if src != nil {
				_ = src.Close()
			}
			require.Error(t, err)
			t.Log(err)
			assert.NoError(t, ctx.Err())
			for _, w := range tc.want {
				assert.Contains(t, err.Error(), w)
			}
			assert.NotContains(t, err.Error(), "s3cret")
		})
	}
}

// A principal allowed to see a topic or the group (DESCRIBE) but not to do
// with it what the Source does was not refused by Open: without READ on a
// consumed topic or on the group Receive blocked for ever, the fetches or
// joins refused; without WRITE on a dead-letter topic every poison
// record's copy was refused, retried without end, its partition held.
// Open refuses each, naming the topic or group and the operation.
func TestOpenRefusesAPrincipalThatCannotReadOrDeadLetter(t *testing.T) {
	acl := func(rt kmsg.ACLResourceType, name string, op kmsg.ACLOperation) kfake.ACL {
		return kfake.ACL{Resource: rt, Name: name, Pattern: kmsg.ACLResourcePatternTypeLiteral, Operation: op, Allow: true}
	}
	base := []kfake.ACL{acl(kmsg.ACLResourceTypeCluster, "kafka-cluster", kmsg.ACLOperationAll), acl(kmsg.ACLResourceTypeGroup, "g", kmsg.ACLOperationAll)}
	for _, tc := range []struct {
		name string
		acls []kfake.ACL
		want []string // nil: Open succeeds
	}{{
		name: "no READ on the topic",
		acls: append(base[:2:2], acl(kmsg.ACLResourceTypeTopic, "orders", kmsg.ACLOperationDescribe), acl(kmsg.ACLResourceTypeTopic, "orders.dlq", kmsg.ACLOperationAll)),
		want: []string{`topic "orders"`, "READ"},
	}, {
		name: "no WRITE on the dead-letter topic",
		acls: append(base[:2:2], acl(kmsg.ACLResourceTypeTopic, "orders", kmsg.ACLOperationAll),
			acl(kmsg.ACLResourceTypeTopic, "orders.dlq", kmsg.ACLOperationDescribe), acl(kmsg.ACLResourceTypeTopic, "orders.dlq", kmsg.ACLOperationRead)),
		want: []string{`dead-letter topic "orders.dlq"`, "WRITE"},
	}, {
		name: "no READ on the group",
		acls: []kfake.ACL{base[0], acl(kmsg.ACLResourceTypeGroup, "g", kmsg.ACLOperationDescribe),
			acl(kmsg.ACLResourceTypeTopic, "orders", kmsg.ACLOperationAll), acl(kmsg.ACLResourceTypeTopic, "orders.dlq", kmsg.ACLOperationAll)},
		want: []string{`consumer group "g"`, "READ"},
	}, {
		name: "READ and WRITE",
		acls: append(base[:2:2], acl(kmsg.ACLResourceTypeTopic, "orders", kmsg.ACLOperationRead), acl(kmsg.ACLResourceTypeTopic, "orders.dlq", kmsg.ACLOperationWrite)),
	}} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, kfake.EnableSASL(), kfake.EnableACLs(), kfake.Superuser("PLAIN", "admin", "admin"),
				kfake.User("PLAIN", "svc", "s3cret-pw", tc.acls...), kfake.SeedTopics(1, "orders", "orders.dlq"))
			sc := saramaConfig()
			sc.Net.SASL.Enable = true
			sc.Net.SASL.User = "svc"
			sc.Net.SASL.Password = "s3cret-pw"
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			src, err := Open(ctx, Config{Brokers: c.addrs, Group: "g", Topics: []string{"orders"}, Sarama: sc, Logger: testLogger()})
			if src != nil {
				_ = src.Close()
			}
			if tc.want == nil {
				require.NoError(t, err)
				return
			}
			require.Error(t, err)
			t.Log(err)
			assert.NoError(t, ctx.Err())
			assert.True(t, errors.Is(err, sarama.ErrTopicAuthorizationFailed) || errors.Is(err, sarama.ErrGroupAuthorizationFailed), "%v", err)
			for _, w := range tc.want {
				assert.Contains(t, err.Error(), w)
			}
		})
	}
}

// A Source that consumed, and then meets a refusal (its group ACL revoked
// on the cluster), keeps retrying, as Open's documentation says, and logs
// the refusal as an error saying that the cluster refuses the client, not
// as a failure to consume like any other.
func TestARefusalAfterStartIsLoggedAsSuch(t *testing.T) {
	c, asAdmin, src, refused := openWatchingRefusals(t)
	defer src.Close()

	prod, err := sarama.NewSyncProducer(c.addrs, func() *sarama.Config {
		pc := *asAdmin
		pc.Producer.Return.Successes = true
		return &pc
	}())
	require.NoError(t, err)
	defer prod.Close()
	_, _, err = prod.SendMessage(&sarama.ProducerMessage{Topic: "orders", Value: sarama.StringEncoder(`{}`)})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	d, err := src.Receive(ctx)
	require.NoError(t, err)
	require.NoError(t, d.Ack(ctx))

	admin, err := sarama.NewClusterAdmin(c.addrs, asAdmin)
	require.NoError(t, err)
	defer admin.Close()
	_, err = admin.DeleteACL(sarama.AclFilter{Version: 1, ResourceType: sarama.AclResourceGroup,
		ResourcePatternTypeFilter: sarama.AclPatternAny, Operation: sarama.AclOperationAny, PermissionType: sarama.AclPermissionAny}, false)
	require.NoError(t, err)
	select {
	case <-refused:
	case <-ctx.Done():
		t.Fatalf("the refusal was not logged as an error")
	}
}

// testLogWriter is where testLogger writes: stderr when ONCE_TEST_LOG is
// set, nowhere otherwise.
func testLogWriter() io.Writer {
	if os.Getenv("ONCE_TEST_LOG") != "" {
		return os.Stderr
	}
	return io.Discard
}

// Apache Kafka answers a wrong password with SASL_AUTHENTICATION_FAILED
// (kfake closes the connection instead), and closes the connection of a
// client that does not authenticate at the first request that needs it:
// Open returns each at once, naming the broker and what it refused, and
// never the password.
func TestOpenReturnsAWrongPasswordAtOnce(t *testing.T) {
	c := newApacheKafka(t, kafkatemp.Options{SASLUsers: map[string]string{"svc": "s3cret-right"}})
	for _, tc := range []struct {
		name   string
		client func(sc *sarama.Config)
		want   string
	}{{
		name: "wrong password",
		client: func(sc *sarama.Config) {
			sc.Net.SASL.Enable = true
			sc.Net.SASL.User, sc.Net.SASL.Password = "svc", "s3cret-wrong"
		},
		want: "refused the SASL settings",
	}, {
		name:   "no SASL",
		client: func(sc *sarama.Config) {},
		want:   "asks for SASL",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			sc := saramaConfig()
			tc.client(sc)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			src, err := Open(ctx, Config{Brokers: c.addrs, Group: "g", Topics: []string{"orders"}, Sarama: sc, Logger: testLogger()})
			if src != nil {
				_ = src.Close()
			}
			require.Error(t, err)
			t.Log(err)
			assert.NoError(t, ctx.Err(), "the refusal was retried until the context ended")
			assert.Contains(t, err.Error(), tc.want)
			assert.Contains(t, err.Error(), c.addrs[0], "the error names the broker that refused")
			assert.NotContains(t, err.Error(), "s3cret")
		})
	}
}

// Apache Kafka's plain listener answers a client that authenticates with
// SASL ILLEGAL_SASL_STATE (kfake goes on as if the listener asked for
// SASL), and closes the connection of a TLS client (it reads the TLS hello
// as the size of a request too large; kfake waits for the rest): Open
// returns each at once, naming the broker and what it refused.
func TestOpenReturnsARefusalOfApacheKafkaAtOnce(t *testing.T) {
	c := newClusterOf(t, apacheKafka)
	for _, tc := range []struct {
		name   string
		client func(sc *sarama.Config)
		want   string
	}{{
		name: "SASL at a plain listener",
		client: func(sc *sarama.Config) {
			sc.Net.SASL.Enable = true
			sc.Net.SASL.User, sc.Net.SASL.Password = "svc", "s3cret-pw"
		},
		want: "refused the SASL settings",
	}, {
		name: "TLS at a plain listener",
		client: func(sc *sarama.Config) {
			sc.Net.TLS.Enable = true
		},
		want: "the port speaks Kafka without TLS",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			sc := saramaConfig()
			tc.client(sc)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			src, err := Open(ctx, Config{Brokers: c.addrs, Group: uniq("g"), Topics: []string{uniq("orders")}, Sarama: sc, Logger: testLogger()})
			if src != nil {
				_ = src.Close()
			}
			require.Error(t, err)
			t.Log(err)
			assert.NoError(t, ctx.Err(), "the refusal was retried until the context ended")
			assert.Contains(t, err.Error(), tc.want)
			assert.Contains(t, err.Error(), c.addrs[0], "the error names the broker that refused")
			assert.NotContains(t, err.Error(), "s3cret")
		})
	}
}

// openWatchingRefusals starts a kfake cluster with SASL and ACLs whose
// user svc may use group g and topics orders and orders.dlq, and opens a
// Source as svc on orders; refused is closed at its first Error log. It
// returns the cluster, an admin's config, the Source and refused.
func openWatchingRefusals(t *testing.T) (*cluster, *sarama.Config, *Source, chan struct{}) {
	t.Helper()
	allow := func(rt kmsg.ACLResourceType, name string) kfake.ACL {
		return kfake.ACL{Resource: rt, Name: name, Pattern: kmsg.ACLResourcePatternTypeLiteral, Operation: kmsg.ACLOperationAll, Allow: true}
	}
	c := newCluster(t, kfake.EnableSASL(), kfake.EnableACLs(), kfake.Superuser("PLAIN", "admin", "admin"),
		kfake.User("PLAIN", "svc", "s3cret-pw", allow(kmsg.ACLResourceTypeCluster, "kafka-cluster"),
			allow(kmsg.ACLResourceTypeGroup, "g"), allow(kmsg.ACLResourceTypeTopic, "orders"), allow(kmsg.ACLResourceTypeTopic, "orders.dlq")),
		kfake.SeedTopics(1, "orders", "orders.dlq"))
	asAdmin := saramaConfig()
	asAdmin.Net.SASL.Enable = true
	asAdmin.Net.SASL.User, asAdmin.Net.SASL.Password = "admin", "admin"
	sc := saramaConfig()
	sc.Net.SASL.Enable = true
	sc.Net.SASL.User, sc.Net.SASL.Password = "svc", "s3cret-pw"
	refused := make(chan struct{})
	logs := &lineCounter{match: "level=ERROR", at: 1, then: func() { close(refused) }}
	src, err := Open(t.Context(), Config{Brokers: c.addrs, Group: "g", Topics: []string{"orders"}, Sarama: sc,
		SessionTimeout: time.Second, HeartbeatInterval: 100 * time.Millisecond, RevokeTimeout: 100 * time.Millisecond,
		ReconnectMinBackoff: 10 * time.Millisecond, ReconnectMaxBackoff: 100 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.MultiWriter(logs, testLogWriter()), nil))})
	require.NoError(t, err)
	return c, asAdmin, src, refused
}
