package main

import (
	"context"
	"errors"
	"os"
	"os/signal"
	"regexp"
	"strings"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/kafka"
	"github.com/onceco/once/consumer"
)

// The getting-started guide's router and consumer (docs/getting-started.md,
// its second code block), compiled here; TestGettingStartedShowsTheRouter
// keeps the guide and this example the same. It is not run: it needs a
// Kafka cluster and a database.
func ExampleOrders_Router() {
	var pool *pgxpool.Pool // the service's pool
	brokers := []string{"localhost:9092"}
	o := &Orders{}
	run := func() error {
		// getting-started begin
		r := consumer.NewRouter[OrderEvent](consumer.RouterConfig{}) // unknown types are dead-lettered
		if err := errors.Join(
			consumer.AddHandler(r, o.Created), // each payload type names its event type
			consumer.AddHandler(r, o.Paid),
			consumer.AddHandler(r, o.Cancelled),
		); err != nil {
			return err
		}

		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		src, err := kafka.Open(ctx, kafka.Config{Brokers: brokers, Group: "order-processor", Topics: []string{"orders"}})
		// or: src, err := amqp.Open(ctx, amqp.Config{URL: url, Queue: "orders"})
		if err != nil {
			return err
		}
		c, err := consumer.NewRouted(pool, src, r, consumer.Config{
			Name:     "order-processor",                         // the dedup scope: replicas share it
			Identify: consumer.IdentifyConfig{EventID: EventID}, // see "Event ids" below
			Retry:    consumer.RetryPolicy{MaxAttempts: 4},
		})
		if err != nil {
			return err
		}
		return c.Run(ctx) // until ctx is cancelled: then drains, commits, acks, closes
		// getting-started end
	}
	_ = run
}

// The guide's second code block is ExampleOrders_Router's body between the
// markers, unindented: the code a reader copies compiles.
func TestGettingStartedShowsTheRouter(t *testing.T) {
	src, err := os.ReadFile("getting_started_test.go")
	require.NoError(t, err)
	s := string(src)
	begin, end := "// getting-started begin\n", "\t\t// getting-started end"
	body := s[strings.Index(s, begin)+len(begin) : strings.Index(s, end)]
	var lines []string
	for _, l := range strings.Split(strings.TrimRight(body, "\n"), "\n") {
		lines = append(lines, strings.TrimPrefix(l, "\t\t"))
	}
	guide, err := os.ReadFile("../../docs/getting-started.md")
	require.NoError(t, err)
	blocks := regexp.MustCompile("(?s)```go\n(.*?)```").FindAllStringSubmatch(string(guide), -1)
	require.GreaterOrEqual(t, len(blocks), 2)
	assert.Equal(t, strings.Join(lines, "\n")+"\n", blocks[1][1],
		"docs/getting-started.md's second code block must be ExampleOrders_Router's body")
}
