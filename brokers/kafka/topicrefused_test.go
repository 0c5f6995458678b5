package kafka

import (
	"context"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
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
	c, asAdmin, src, refused := openWatchingRefusals(t)
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
