package docs_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"os"
	"reflect"
	"regexp"
	"runtime"
	"strings"
	"testing"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/brokers/kafka"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/outbox"
	"github.com/onceco/once/outbox/kafkaout"
)

// The functions below hold, between their "// begin" and "// end" lines,
// a Go example of docs/*.md as the page shows it (TestSnippetsAreShownAsTheyCompile
// compares them, blanks aside): the package compiles them, so an example
// that names a field, a function or a signature the API no longer has
// fails the build instead of a reader's.

type OrderPaid struct{ OrderID string }

func handle(context.Context, pgx.Tx, consumer.Event[OrderPaid]) error { return nil }

func amqpOpen(ctx context.Context, pool *pgxpool.Pool) error {
	// begin
	src, err := amqp.Open(ctx, amqp.Config{
		URL:       os.Getenv("AMQP_URL"), // amqp://user:pass@host:5672/vhost, or amqps://
		Queue:     "orders",
		QueueType: amqp.QueueQuorum,
		Exchanges: []amqp.Exchange{{Name: "shop", Kind: "topic"}},
		Bindings:  []amqp.Binding{{Exchange: "shop", RoutingKey: "order.*"}},
	})
	if err != nil {
		return err
	}
	c, err := consumer.New(pool, src, handle, consumer.Config{Name: "orders-svc"})
	if err != nil {
		return err
	}
	err = c.Run(ctx) // closes src on the way out
	// end
	return err
}

func kafkaOpen(ctx context.Context, pool *pgxpool.Pool, base *sarama.Config) error {
	// begin
	src, err := kafka.Open(ctx, kafka.Config{
		Brokers: []string{"kafka-1:9092", "kafka-2:9092"},
		Group:   "billing",          // the consumer group
		Topics:  []string{"orders"}, // dead letters go to "orders.dlq", checked by Open
		Sarama:  base,               // optional *sarama.Config: TLS, SASL, Version, ClientID...
	})
	if err != nil {
		return err
	}
	c, err := consumer.New(pool, src, handle, consumer.Config{Name: "billing"})
	if err != nil {
		return err
	}
	err = c.Run(ctx) // closes src on the way out: the final offset commit happens there
	// end
	return err
}

func kafkaTLS(pool *x509.CertPool, user, password string, newSCRAMClient func() sarama.SCRAMClient) *sarama.Config {
	// begin
	base := sarama.NewConfig()
	base.Version = sarama.V3_6_0_0
	base.Net.TLS.Enable = true
	base.Net.TLS.Config = &tls.Config{RootCAs: pool}
	base.Net.SASL.Enable = true
	base.Net.SASL.Mechanism = sarama.SASLTypeSCRAMSHA512
	base.Net.SASL.User, base.Net.SASL.Password = user, password
	base.Net.SASL.SCRAMClientGeneratorFunc = newSCRAMClient // see sarama's SCRAM example
	// end
	return base
}

func kafkaTombstones(cfg consumer.Config) consumer.Config {
	// begin
	cfg.Decoder = func(data []byte, v any) error {
		if len(data) == 0 {
			return nil // a tombstone: the zero payload, ev.Message.Value == nil
		}
		return consumer.JSON(data, v)
	}
	// end
	return cfg
}

func outboxWrite(body []byte) consumer.Handler[OrderPaid] {
	// begin
	handle := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[OrderPaid]) error {
		if _, err := tx.Exec(ctx, `UPDATE orders SET status = 'confirmed' WHERE id = $1`, ev.Payload.OrderID); err != nil {
			return err
		}
		return outbox.Add(ctx, tx, outbox.Message{
			ID:    ev.ID + "/confirmed",       // optional: Add generates a UUID when empty
			Topic: "order.confirmed",          // Kafka topic, or RabbitMQ exchange
			Key:   []byte(ev.Payload.OrderID), // order key; the Kafka record key
			Type:  "order.confirmed",          // "type" header / AMQP type property
			Body:  body,
		})
	}
	// end
	return handle
}

func outboxRelay(ctx context.Context, pool *pgxpool.Pool, brokers []string) error {
	// begin
	pub, err := kafkaout.New(kafkaout.Config{Brokers: brokers}) // or amqpout.New(amqpout.Config{URL: url})
	if err != nil {
		return err
	}
	relay, err := outbox.NewRelay(pool, pub, outbox.RelayConfig{})
	if err != nil {
		return err
	}
	go relay.Run(ctx) // beside consumer.Run, or alone in a process of its own
	// end
	return nil
}

func outboxParked(ctx context.Context, pool *pgxpool.Pool, seqs []int64) []any {
	// begin
	store, _ := outbox.New(outbox.Config{})
	parked, _ := store.Parked(ctx, pool, 100) // seq, event id, destination, attempts, last error
	store.Requeue(ctx, pool, seqs...)         // after fixing the cause: back to the relay, attempts reset
	store.Discard(ctx, pool, seqs...)         // never publish them; their keys go on
	b, _ := store.Backlog(ctx, pool)          // pending (and of them waiting) and parked counts; oldest pending: from their indexes
	st, _ := store.Status(ctx, pool)          // the same, and the kept sent rows' count: reads every kept row
	// end
	return []any{parked, b, st}
}

// block names the n-th ```go block (from 1) of a page.
type block struct {
	page string
	n    int
}

// shownHere are the blocks the functions above hold.
var shownHere = map[block]any{
	{"docs/amqp.md", 1}:   amqpOpen,
	{"docs/kafka.md", 1}:  kafkaOpen,
	{"docs/kafka.md", 2}:  kafkaTLS,
	{"docs/kafka.md", 3}:  kafkaTombstones,
	{"docs/outbox.md", 1}: outboxWrite,
	{"docs/outbox.md", 2}: outboxRelay,
	{"docs/outbox.md", 3}: outboxParked,
}

// shownElsewhere are the blocks another test keeps equal to code that
// compiles, and which one.
var shownElsewhere = map[block]string{
	{"README.md", 1}:               "consumer.TestReadmeShowsTheExample",
	{"docs/getting-started.md", 1}: "consumer.TestGettingStartedShowsTheExamplesCode",
	{"docs/getting-started.md", 2}: "examples/order-processor: getting_started_test.go",
	{"docs/http.md", 1}:            "idempotency: doc_service_test.go",
	{"docs/testing.md", 1}:         "oncetest: oncetest_test.go",
}

var goBlock = regexp.MustCompile("(?s)```go\n(.*?)```")

// goBlocks returns the Go blocks of a page.
func goBlocks(t *testing.T, page string) []string {
	t.Helper()
	var out []string
	for _, m := range goBlock.FindAllStringSubmatch(read(t, page), -1) {
		out = append(out, m[1])
	}
	return out
}

// body returns the lines between "// begin" and "// end" of the function
// name in this file.
func body(t *testing.T, src, name string) string {
	t.Helper()
	start := strings.Index(src, "\nfunc "+name+"(")
	require.GreaterOrEqual(t, start, 0, name)
	rest := src[start:]
	begin := strings.Index(rest, "// begin\n")
	end := strings.Index(rest, "// end\n")
	require.True(t, begin >= 0 && end > begin, "%s has no // begin ... // end", name)
	return rest[begin+len("// begin\n") : end]
}

// funcName is the name of the function fn, without its package.
func funcName(fn any) string {
	full := runtime.FuncForPC(reflect.ValueOf(fn).Pointer()).Name()
	return full[strings.LastIndex(full, ".")+1:]
}

var blanks = regexp.MustCompile(`\s+`)

// normal is code with every run of blanks made one space: gofmt's
// alignment of comments and tabs, the pages' spaces, differ in nothing
// else.
func normal(code string) string { return strings.TrimSpace(blanks.ReplaceAllString(code, " ")) }

// Each Go block of the README and docs/*.md is code that compiles: here,
// or in the test that shows it.
func TestSnippetsAreShownAsTheyCompile(t *testing.T) {
	src, err := os.ReadFile("snippets_test.go")
	require.NoError(t, err)
	count := map[string]int{}
	for _, page := range pages(t) {
		blocks := goBlocks(t, page)
		count[page] = len(blocks)
		for i, code := range blocks {
			b := block{page, i + 1}
			if _, ok := shownElsewhere[b]; ok {
				continue
			}
			fn, ok := shownHere[b]
			if !ok {
				t.Errorf("%s: Go block %d is shown by no test: add it to internal/docs/snippets_test.go", page, i+1)
				continue
			}
			name := funcName(fn)
			assert.Equal(t, normal(body(t, string(src), name)), normal(code),
				"%s: Go block %d must be %s's body in internal/docs/snippets_test.go", page, i+1, name)
		}
	}
	// A block removed or moved leaves no entry pointing past the page.
	for b := range shownHere {
		assert.LessOrEqual(t, b.n, count[b.page], "%s has no Go block %d", b.page, b.n)
	}
	for b := range shownElsewhere {
		assert.LessOrEqual(t, b.n, count[b.page], "%s has no Go block %d", b.page, b.n)
	}
}
