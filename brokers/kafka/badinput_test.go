package kafka

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// badOrder is the payload type of the bad-input catalogue.
type badOrder struct {
	OrderID string `json:"order_id"`
	Amount  int    `json:"amount"`
}

// The outcomes of the catalogue: handled (the handler's transaction
// committed), or a dead-letter kind.
const handled = "handled"

// badInput is one row of the catalogue: a message, the consumer it meets,
// and the outcome it must have.
type badInput struct {
	name    string
	value   []byte
	headers []sarama.RecordHeader // raw bytes: invalid UTF-8 is possible
	strict  bool                  // consumer.StrictJSON instead of the default decoder
	router  bool                  // a Router with one handler for order.created
	want    string                // handled or a consumer.ErrorKind
	// wantID is the event id of a handled message: "" means the default
	// id header's; "fallback" means Kafka's topic/partition/offset@topic-id.
	wantID string
}

func hdr(k, v string) sarama.RecordHeader {
	return sarama.RecordHeader{Key: []byte(k), Value: []byte(v)}
}

const tenMiB = 10 << 20

// bigJSON is a valid order of about n bytes.
func bigJSON(n int) []byte {
	var b bytes.Buffer
	b.WriteString(`{"order_id":"big","amount":7,"note":"`)
	b.WriteString(strings.Repeat("x", n))
	b.WriteString(`"}`)
	return b.Bytes()
}

// badInputs is the catalogue. Each message carries an id header (unless the
// row is about ids) and type order.created.
func badInputs() []badInput {
	typ := hdr("type", "order.created")
	return []badInput{
		{name: "empty body", value: []byte{}, want: string(consumer.KindDecode)},
		{name: "empty body, strict", value: []byte{}, strict: true, want: string(consumer.KindDecode)},
		{name: "not JSON", value: []byte("order 42, paid"), want: string(consumer.KindDecode)},
		{name: "truncated JSON", value: []byte(`{"order_id":"o-1","amo`), want: string(consumer.KindDecode)},
		// encoding/json ignores unknown fields: an object of another shape
		// decodes into the zero value and reaches the handler.
		{name: "JSON object of the wrong shape, default decoder", value: []byte(`{"sku":"A-1","qty":3}`), want: handled},
		{name: "JSON object of the wrong shape, StrictJSON", value: []byte(`{"sku":"A-1","qty":3}`), strict: true, want: string(consumer.KindDecode)},
		{name: "JSON array instead of object, default decoder", value: []byte(`[1,2,3]`), want: string(consumer.KindDecode)},
		{name: "JSON of the right shape with a wrong field type", value: []byte(`{"order_id":"o-1","amount":"ten"}`), want: string(consumer.KindDecode)},
		{name: "trailing data, default decoder", value: []byte(`{"order_id":"o-1","amount":1} {}`), want: string(consumer.KindDecode)},
		{name: "trailing data, StrictJSON", value: []byte(`{"order_id":"o-1","amount":1} {}`), strict: true, want: string(consumer.KindDecode)},
		{name: "JSON null, default decoder", value: []byte(`null`), want: handled},
		{name: "valid payload, unknown type (router)", value: []byte(`{"order_id":"o-1","amount":1}`), router: true,
			headers: []sarama.RecordHeader{hdr("type", "order.refunded")}, want: string(consumer.KindUnknownType)},
		{name: "valid payload, no type (router)", value: []byte(`{"order_id":"o-1","amount":1}`), router: true,
			headers: []sarama.RecordHeader{}, want: string(consumer.KindUnknownType)},
		{name: "no id header: Kafka fallback topic/partition/offset", value: []byte(`{"order_id":"o-1","amount":1}`),
			headers: []sarama.RecordHeader{typ}, want: handled, wantID: "fallback"},
		{name: "empty id header: Kafka fallback", value: []byte(`{"order_id":"o-1","amount":1}`),
			headers: []sarama.RecordHeader{hdr("id", ""), typ}, want: handled, wantID: "fallback"},
		{name: "id of 256 bytes (the limit)", value: []byte(`{"order_id":"o-1","amount":1}`),
			headers: []sarama.RecordHeader{hdr("id", strings.Repeat("i", 256)), typ}, want: handled, wantID: strings.Repeat("i", 256)},
		{name: "id of 257 bytes", value: []byte(`{"order_id":"o-1","amount":1}`),
			headers: []sarama.RecordHeader{hdr("id", strings.Repeat("i", 257)), typ}, want: string(consumer.KindInvalidID)},
		{name: "id of 1 MiB", value: []byte(`{"order_id":"o-1","amount":1}`),
			headers: []sarama.RecordHeader{hdr("id", strings.Repeat("i", 1<<20)), typ}, want: string(consumer.KindInvalidID)},
		{name: "id with invalid UTF-8", value: []byte(`{"order_id":"o-1","amount":1}`),
			headers: []sarama.RecordHeader{{Key: []byte("id"), Value: []byte("evt-\xff\xfe")}, typ}, want: string(consumer.KindInvalidID)},
		{name: "id with a NUL byte", value: []byte(`{"order_id":"o-1","amount":1}`),
			headers: []sarama.RecordHeader{hdr("id", "evt-\x00-1"), typ}, want: string(consumer.KindInvalidID)},
		{name: "other header with invalid UTF-8 key and value", value: []byte(`{"order_id":"o-1","amount":1}`),
			headers: []sarama.RecordHeader{hdr("id", "utf8-1"), {Key: []byte("x-\xc3\x28"), Value: []byte("\xff\xfe\xfd")}}, want: handled, wantID: "utf8-1"},
		{name: "type header with invalid UTF-8 (router)", value: []byte(`{"order_id":"o-1","amount":1}`), router: true,
			headers: []sarama.RecordHeader{{Key: []byte("type"), Value: []byte("order.\xffcreated")}}, want: string(consumer.KindUnknownType)},
		{name: "garbage traceparent", value: []byte(`{"order_id":"o-1","amount":1}`),
			headers: []sarama.RecordHeader{hdr("id", "tp-1"), hdr("traceparent", "zz-not-a-trace-\x00-\xff"), typ}, want: handled, wantID: "tp-1"},
		{name: "traceparent of all zeros", value: []byte(`{"order_id":"o-1","amount":1}`),
			headers: []sarama.RecordHeader{hdr("id", "tp-2"), hdr("traceparent", "00-00000000000000000000000000000000-0000000000000000-01"), typ}, want: handled, wantID: "tp-2"},
		{name: "10 MiB valid body", value: bigJSON(tenMiB), want: handled},
		{name: "10 MiB invalid body", value: append(bigJSON(tenMiB), '}'), want: string(consumer.KindDecode)},
	}
}

// bigMessageConfigs raise the limits that stand between a 10 MiB record and
// the consumer: the broker's message.max.bytes, the producer's
// MaxMessageBytes (both also bound the dead-letter copy), sarama's fetch
// sizes adapt by themselves (Consumer.Fetch.Max is unlimited by default).
const maxMessageBytes = 12 << 20

// The bad-input catalogue through the real adapter: each row's message,
// followed by a good one, on a partition of its own. Each row ends with its
// outcome (handled or dead-lettered with the row's kind, byte-identical),
// nothing panics, nothing is lost, and the good message behind it is
// handled.
func TestBadInputCatalogue(t *testing.T) {
	c := newCluster(t, kfake.BrokerConfigs(map[string]string{"message.max.bytes": fmt.Sprint(maxMessageBytes)}))
	db, _ := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), `CREATE TABLE bad_effects (run text NOT NULL, event_id text NOT NULL, order_id text NOT NULL, amount int NOT NULL)`)
	require.NoError(t, err)

	for i, row := range badInputs() {
		t.Run(row.name, func(t *testing.T) {
			topic, group := uniq("bad"), uniq("g")
			c.createTopic(topic, 1)
			c.createTopic(topic+".dlq", 1)
			headers := row.headers
			if headers == nil {
				headers = []sarama.RecordHeader{hdr("id", fmt.Sprintf("bad-%d", i)), hdr("type", "order.created")}
			}
			goodID := fmt.Sprintf("good-%d", i)
			bad := &sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder("k"), Value: sarama.ByteEncoder(row.value), Headers: headers}
			good := &sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder("k"),
				Value:   sarama.StringEncoder(`{"order_id":"good","amount":1}`),
				Headers: []sarama.RecordHeader{hdr("id", goodID), hdr("type", "order.created")}}
			sc := saramaConfig()
			sc.Producer.Return.Successes = true
			sc.Producer.RequiredAcks = sarama.WaitForAll
			sc.Producer.Partitioner = sarama.NewManualPartitioner
			sc.Producer.MaxMessageBytes = maxMessageBytes
			p, err := sarama.NewSyncProducer(c.addrs, sc)
			require.NoError(t, err)
			defer p.Close()
			require.NoError(t, p.SendMessages([]*sarama.ProducerMessage{bad, good}), "the broker accepts the record")

			cfg := c.config(group, topic)
			cfg.Sarama = saramaConfig()
			cfg.Sarama.Producer.MaxMessageBytes = maxMessageBytes // the dead-letter copy of a 10 MiB record
			src, err := Open(t.Context(), cfg)
			require.NoError(t, err)
			name := uniq("svc")
			ccfg := consumerConfig(name)
			if row.strict {
				ccfg.Decoder = consumer.StrictJSON
			}
			h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[badOrder]) error {
				_, err := tx.Exec(ctx, `INSERT INTO bad_effects (run, event_id, order_id, amount) VALUES ($1, $2, $3, $4)`,
					topic, ev.ID, ev.Payload.OrderID, ev.Payload.Amount)
				return err
			}
			var cons *consumer.Consumer[any]
			var plain *consumer.Consumer[badOrder]
			if row.router {
				r := consumer.NewRouter[any](consumer.RouterConfig{UnknownTypes: consumer.DeadLetterUnknownTypes})
				require.NoError(t, consumer.Handle(r, "order.created", h))
				cons, err = consumer.NewRouted(db, src, r, ccfg)
			} else {
				plain, err = consumer.New(db, src, h, ccfg)
			}
			require.NoError(t, err)
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			stats := func() consumer.Stats {
				if cons != nil {
					return cons.Stats()
				}
				return plain.Stats()
			}
			go func() {
				if cons != nil {
					done <- cons.Run(ctx)
				} else {
					done <- plain.Run(ctx)
				}
			}()
			effects := func() map[string]int {
				rows, err := db.Query(context.Background(), `SELECT event_id, count(*) FROM bad_effects WHERE run = $1 GROUP BY event_id`, topic)
				require.NoError(t, err)
				out := map[string]int{}
				var id string
				var n int
				_, err = pgx.ForEachRow(rows, []any{&id, &n}, func() error { out[id] = n; return nil })
				require.NoError(t, err)
				return out
			}
			require.Eventually(t, func() bool { return effects()[goodID] == 1 }, 60*time.Second, 20*time.Millisecond,
				"the good message after the bad one is handled")
			// Both settled. Not "received twice": a group rebalance (a
			// 10 MiB record under -race on a busy machine can outlast a
			// session) delivers the acked-but-uncommitted ones again, and
			// those are duplicates.
			if !assert.Eventually(t, func() bool {
				s := stats()
				return s.Handled+s.DeadLettered == 2
			}, 30*time.Second, 10*time.Millisecond) {
				t.Fatalf("both settled: stats %+v", stats())
			}
			cancel()
			require.NoError(t, <-done, "Run ends cleanly: no panic, no fatal error")
			assert.Equal(t, map[int32]int64{0: 2}, c.committed(group, topic, 1), "both records acked")

			dl := c.readAll(topic + ".dlq")
			got := effects()
			delete(got, goodID)
			s := stats()
			switch row.want {
			case handled:
				assert.Empty(t, dl, "nothing dead-lettered")
				assert.Equal(t, uint64(2), s.Handled)
				wantID := row.wantID
				switch wantID {
				case "":
					wantID = fmt.Sprintf("bad-%d", i)
				case "fallback":
					wantID = topic + "/0/0@" + c.topicID(topic)
				}
				assert.Equal(t, map[string]int{wantID: 1}, got, "the bad message has exactly one effect, under its id")
			default:
				assert.Empty(t, got, "a dead-lettered message has no effect")
				assert.Equal(t, uint64(1), s.DeadLettered)
				require.Len(t, dl, 1, "one dead-letter record")
				h := map[string]string{}
				for _, rh := range dl[0].Headers {
					h[string(rh.Key)] = string(rh.Value)
				}
				assert.Equal(t, row.want, h[consumer.HeaderErrorKind])
				assert.True(t, bytes.Equal(row.value, dl[0].Value), "the original bytes, unchanged (%d bytes, got %d)", len(row.value), len(dl[0].Value))
				assert.NotEmpty(t, h[consumer.HeaderErrorMessage])
			}
		})
	}
}

// A record over the broker's limit (kfake's default message.max.bytes is
// 1 MiB, as Kafka's) is refused at produce time: it never reaches a
// consumer. The producer sees sarama's or the broker's size error.
func TestBadInputOverBrokerLimitRejectedAtProduce(t *testing.T) {
	c := newCluster(t)
	topic := uniq("big")
	c.createTopic(topic, 1)
	sc := saramaConfig()
	sc.Producer.Return.Successes = true
	sc.Producer.Partitioner = sarama.NewManualPartitioner
	p, err := sarama.NewSyncProducer(c.addrs, sc)
	require.NoError(t, err)
	defer p.Close()
	_, _, err = p.SendMessage(&sarama.ProducerMessage{Topic: topic, Value: sarama.ByteEncoder(bigJSON(tenMiB))})
	var cfgErr sarama.ConfigurationError
	require.ErrorAs(t, err, &cfgErr, "sarama's own Producer.MaxMessageBytes (1 MB) refuses it before sending")
	assert.Contains(t, err.Error(), "Producer.MaxMessageBytes")

	sc.Producer.MaxMessageBytes = maxMessageBytes
	p2, err := sarama.NewSyncProducer(c.addrs, sc)
	require.NoError(t, err)
	defer p2.Close()
	_, _, err = p2.SendMessage(&sarama.ProducerMessage{Topic: topic, Value: sarama.ByteEncoder(bigJSON(tenMiB))})
	require.Error(t, err, "the broker refuses it past message.max.bytes")
	assert.ErrorIs(t, err, sarama.ErrMessageSizeTooLarge)
	assert.Empty(t, c.readAll(topic), "nothing was written")
}
