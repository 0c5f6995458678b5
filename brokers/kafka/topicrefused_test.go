package kafka

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// A consumed topic's READ ACL revoked while the group's stays: the group's
// heartbeats go on, so its session never ends and the refusal never
// reaches the consume loop; every fetch and every offset commit of the
// topic is refused, which sarama reports on the group's error channel.
// docs/kafka.md says a refusal met after the start is logged at error
// level as the cluster refusing the client, as a revoked group ACL is
// (TestARefusalAfterStartIsLoggedAsSuch): the partition consumes nothing,
// and a warning each retry is easy to miss.
func TestATopicRefusalAfterStartIsLoggedAsSuch(t *testing.T) {
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
	defer src.Close()

	pc := *asAdmin
	pc.Producer.Return.Successes = true
	prod, err := sarama.NewSyncProducer(c.addrs, &pc)
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
	orders := "orders"
	_, err = admin.DeleteACL(sarama.AclFilter{Version: 1, ResourceType: sarama.AclResourceTopic, ResourceName: &orders,
		ResourcePatternTypeFilter: sarama.AclPatternAny, Operation: sarama.AclOperationAny, PermissionType: sarama.AclPermissionAny}, false)
	require.NoError(t, err)
	select {
	case <-refused:
	case <-ctx.Done():
		t.Fatalf("the topic's refusal was not logged as an error")
	}

	// Undone on the cluster, the partition resumes without a restart.
	require.NoError(t, admin.CreateACLs([]*sarama.ResourceAcls{{
		Resource: sarama.Resource{ResourceType: sarama.AclResourceTopic, ResourceName: orders, ResourcePatternType: sarama.AclPatternLiteral},
		Acls:     []*sarama.Acl{{Principal: "User:svc", Host: "*", Operation: sarama.AclOperationAll, PermissionType: sarama.AclPermissionAllow}},
	}}))
	_, _, err = prod.SendMessage(&sarama.ProducerMessage{Topic: "orders", Value: sarama.StringEncoder(`{"n":2}`)})
	require.NoError(t, err)
	d, err = src.Receive(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), d.Message().Offset)
}
