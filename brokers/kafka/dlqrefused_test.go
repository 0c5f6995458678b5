package kafka

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceco/once/consumer"
)

// logLines keeps the lines a text logger writes.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, strings.TrimSpace(string(p)))
	return len(p), nil
}

// matching returns the lines holding every one of subs.
func (l *logLines) matching(subs ...string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
next:
	for _, line := range l.lines {
		for _, s := range subs {
			if !strings.Contains(line, s) {
				continue next
			}
		}
		out = append(out, line)
	}
	return out
}

// A dead-letter copy the cluster refuses on every attempt until someone
// fixes it there (the principal's WRITE ACL on the dead-letter topic
// revoked, the dead-letter topic deleted, both since Open checked them)
// holds its partition at the record: the core retries it, but only at
// level Warn, like a broker electing a leader, which passes by itself.
// The Source logs such a refusal at level Error, naming the dead-letter
// topic and the record; a copy that fails for a passing reason is not
// logged at Error. Once the cluster is fixed the copy is written.
func TestDeadLetterRefusedByTheClusterIsAnError(t *testing.T) {
	allow := func(rt kmsg.ACLResourceType, name string) kfake.ACL {
		return kfake.ACL{Resource: rt, Name: name, Pattern: kmsg.ACLResourcePatternTypeLiteral, Operation: kmsg.ACLOperationAll, Allow: true}
	}
	asAdmin := saramaConfig()
	asAdmin.Net.SASL.Enable = true
	asAdmin.Net.SASL.User, asAdmin.Net.SASL.Password = "admin", "admin"
	asSvc := saramaConfig()
	asSvc.Net.SASL.Enable = true
	asSvc.Net.SASL.User, asSvc.Net.SASL.Password = "svc", "s3cret-pw"

	var replicasBack atomic.Bool // NOT_ENOUGH_REPLICAS: the replicas are back
	for _, tc := range []struct {
		name    string
		refused bool
		// breakIt makes the copies fail; fixIt undoes it.
		breakIt, fixIt func(t *testing.T, c *cluster, admin sarama.ClusterAdmin)
	}{{
		name:    "WRITE revoked",
		refused: true,
		breakIt: func(t *testing.T, _ *cluster, admin sarama.ClusterAdmin) {
			_, err := admin.DeleteACL(sarama.AclFilter{Version: 1, ResourceType: sarama.AclResourceTopic, ResourceName: ptr("orders.dlq"),
				ResourcePatternTypeFilter: sarama.AclPatternAny, Operation: sarama.AclOperationAny, PermissionType: sarama.AclPermissionAny}, false)
			require.NoError(t, err)
		},
		fixIt: func(t *testing.T, _ *cluster, admin sarama.ClusterAdmin) {
			require.NoError(t, admin.CreateACLs([]*sarama.ResourceAcls{{
				Resource: sarama.Resource{ResourceType: sarama.AclResourceTopic, ResourceName: "orders.dlq", ResourcePatternType: sarama.AclPatternLiteral},
				Acls:     []*sarama.Acl{{Principal: "User:svc", Host: "*", Operation: sarama.AclOperationAll, PermissionType: sarama.AclPermissionAllow}},
			}}))
		},
	}, {
		name:    "topic deleted",
		refused: true,
		breakIt: func(t *testing.T, _ *cluster, admin sarama.ClusterAdmin) {
			require.NoError(t, admin.DeleteTopic("orders.dlq"))
		},
		fixIt: func(t *testing.T, _ *cluster, admin sarama.ClusterAdmin) {
			require.NoError(t, admin.CreateTopic("orders.dlq", &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1}, false))
		},
	}, {
		name: "NOT_ENOUGH_REPLICAS",
		breakIt: func(t *testing.T, c *cluster, _ sarama.ClusterAdmin) {
			c.kf.ControlKey(kmsg.Produce.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
				if replicasBack.Load() {
					c.kf.DropControl()
					return nil, nil, false
				}
				c.kf.KeepControl()
				preq := req.(*kmsg.ProduceRequest)
				if len(preq.Topics) == 0 || preq.Topics[0].Topic != "orders.dlq" {
					return nil, nil, false
				}
				resp := preq.ResponseKind().(*kmsg.ProduceResponse)
				for _, rt := range preq.Topics {
					st := kmsg.NewProduceResponseTopic()
					st.Topic = rt.Topic
					for _, rp := range rt.Partitions {
						sp := kmsg.NewProduceResponseTopicPartition()
						sp.Partition = rp.Partition
						sp.ErrorCode = kerrNotEnoughReplicas
						st.Partitions = append(st.Partitions, sp)
					}
					resp.Topics = append(resp.Topics, st)
				}
				return resp, nil, true
			})
		},
		fixIt: func(*testing.T, *cluster, sarama.ClusterAdmin) {
			replicasBack.Store(true)
		},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, kfake.EnableSASL(), kfake.EnableACLs(), kfake.Superuser("PLAIN", "admin", "admin"),
				kfake.User("PLAIN", "svc", "s3cret-pw", allow(kmsg.ACLResourceTypeCluster, "kafka-cluster"),
					allow(kmsg.ACLResourceTypeGroup, "g"), allow(kmsg.ACLResourceTypeTopic, "orders"), allow(kmsg.ACLResourceTypeTopic, "orders.dlq")),
				kfake.SeedTopics(1, "orders", "orders.dlq"))
			admin, err := sarama.NewClusterAdmin(c.addrs, asAdmin)
			require.NoError(t, err)
			defer admin.Close()
			prod, err := sarama.NewSyncProducer(c.addrs, func() *sarama.Config {
				pc := *asAdmin
				pc.Producer.Return.Successes = true
				return &pc
			}())
			require.NoError(t, err)
			defer prod.Close()
			_, _, err = prod.SendMessage(&sarama.ProducerMessage{Topic: "orders", Value: sarama.StringEncoder("poison")})
			require.NoError(t, err)

			logs := &logLines{}
			cfg := c.config("g", "orders")
			cfg.DeadLetter.Create = false
			cfg.Sarama = asSvc
			cfg.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(logs, testLogWriter()), nil))
			s := c.open(cfg)
			d := receive(t, s)

			tc.breakIt(t, c, admin)
			dl := &consumer.DeadLetter{Kind: consumer.KindDecode, Error: "not json", FailedAt: time.Now()}
			for attempt := 1; attempt <= 2; attempt++ {
				ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
				err = d.DeadLetter(ctx, dl)
				hung := ctx.Err()
				cancel()
				require.Error(t, err, "attempt %d", attempt)
				t.Log(err)
				require.NoError(t, hung, "the copy fails, it does not hang")
			}
			errs := logs.matching("level=ERROR", "orders.dlq", "offset=0")
			if tc.refused {
				assert.Len(t, errs, 2, "each refused copy is logged at level Error: %v", logs.matching("level=ERROR"))
			} else {
				assert.Empty(t, logs.matching("level=ERROR"), "a passing failure is not an error")
			}

			tc.fixIt(t, c, admin)
			require.Eventually(t, func() bool {
				ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
				defer cancel()
				return d.DeadLetter(ctx, dl) == nil
			}, 30*time.Second, 50*time.Millisecond, "the copy is written once the cluster is fixed")
			require.NoError(t, d.Ack(t.Context()))
			recs, err := readTopicAs(c.addrs, asAdmin, "orders.dlq")
			require.NoError(t, err)
			require.Len(t, recs, 1)
			assert.Equal(t, "poison", string(recs[0].Value))
		})
	}
}

// kerrNotEnoughReplicas is Kafka's NOT_ENOUGH_REPLICAS error code.
const kerrNotEnoughReplicas = 19

// A dead-letter topic made compacted after Open checked it (its
// cleanup.policy changed on the cluster) refuses the copy of a record
// without a key, on every attempt (INVALID_RECORD): the partition waits at
// the record until the policy is changed back, and the Source logs each
// refusal at level Error. Apache Kafka only: kfake accepts keyless records
// into a compacted topic.
func TestDeadLetterRefusedByACompactedTopicIsAnError(t *testing.T) {
	c := newClusterOf(t, apacheKafka)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	c.createTopic(topic+".dlq", 1)
	c.produce(msg(topic, 0, "poison"))
	logs := &logLines{}
	cfg := c.config(group, topic)
	cfg.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(logs, testLogWriter()), nil))
	s := c.open(cfg)
	d := receive(t, s)

	admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
	require.NoError(t, err)
	defer admin.Close()
	setPolicy := func(policy string) {
		require.NoError(t, admin.AlterConfig(sarama.TopicResource, topic+".dlq", map[string]*string{"cleanup.policy": ptr(policy)}, false))
	}
	setPolicy("compact")
	dl := &consumer.DeadLetter{Kind: consumer.KindDecode, Error: "not json", FailedAt: time.Now()}
	var refusals int
	require.Eventually(t, func() bool {
		// The broker applies the policy shortly after the change: a copy
		// may be written before it does.
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
		defer cancel()
		err := d.DeadLetter(ctx, dl)
		if err != nil {
			t.Log(err)
			require.ErrorIs(t, err, sarama.ErrInvalidRecord)
			refusals++
		}
		return refusals == 2
	}, 30*time.Second, 50*time.Millisecond, "the compacted topic refuses the keyless copy")
	assert.Len(t, logs.matching("level=ERROR", topic+".dlq", "offset=0"), 2,
		"each refused copy is logged at level Error: %v", logs.matching("level=ERROR"))

	setPolicy("delete")
	require.Eventually(t, func() bool {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		return d.DeadLetter(ctx, dl) == nil
	}, 30*time.Second, 50*time.Millisecond, "the copy is written once the policy is changed back")
	require.NoError(t, d.Ack(t.Context()))
}
