package console_test

import (
	"strconv"
	"strings"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/console"
	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
)

// The consumers page counts at most dlq.TallyGroups consumer and kind
// pairs, and the records of the others in one row, without links: no
// filter selects them alone, and a link to "no consumer" would list
// other records.
func TestOverviewCountsThePairsPastTheBoundInOneRow(t *testing.T) {
	k := testenv.NewKafka(t)
	k.CreateTopic("orders.dlq", 1)
	msgs := make([]*sarama.ProducerMessage, dlq.TallyGroups+2)
	for i := range msgs {
		msgs[i] = &sarama.ProducerMessage{Topic: "orders.dlq", Value: sarama.StringEncoder("{}"), Headers: []sarama.RecordHeader{
			{Key: []byte(consumer.HeaderConsumer), Value: []byte("c-" + strconv.Itoa(i))},
			{Key: []byte(consumer.HeaderErrorKind), Value: []byte("handler")},
		}}
	}
	k.Produce(msgs...)
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "orders.dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	h, err := console.New(console.Config{Queues: []dlq.Queue{q}, Logger: testenv.Logger()})
	require.NoError(t, err)
	code, body := serve(t, h, "/")
	require.Equal(t, 200, code)
	assert.True(t, strings.Contains(body, `<td colspan="2" class="muted">other consumers and kinds</td>
<td class="num">2</td>`), "the row of the others")
	assert.Equal(t, dlq.TallyGroups, strings.Count(body, `<tr><td><a href="dlq?q=0&amp;consumer=c-`), "a row of links per pair kept")
}
