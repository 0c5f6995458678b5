package consumer_test

import (
	"context"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

type OrderPaid struct {
	OrderID string `json:"order_id"`
	Amount  int64  `json:"amount"`
}

// readmeExample is the README's first example, as the README shows it
// between the markers; TestReadmeShowsTheExample keeps the two equal, so
// the README shows code that compiles.
func readmeExample(ctx context.Context, pool *pgxpool.Pool, source consumer.Source) error {
	// README begin
	handle := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[OrderPaid]) error {
		_, err := tx.Exec(ctx, `INSERT INTO payments (order_id, amount) VALUES ($1, $2)`,
			ev.Payload.OrderID, ev.Payload.Amount)
		return err // nil: commit, then ack. error: roll back, retry, then dead-letter.
	}
	c, err := consumer.New(pool, source, handle, consumer.Config{Name: "billing"})
	// ...
	err = c.Run(ctx)
	// README end
	return err
}

// codeBlocks returns the ```go blocks of a Markdown file.
func codeBlocks(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	var blocks []string
	for _, m := range regexp.MustCompile("(?s)```go\n(.*?)```").FindAllStringSubmatch(string(b), -1) {
		blocks = append(blocks, m[1])
	}
	return blocks
}

// The README's first example is readmeExample's body (unindented), so the
// example a reader copies compiles.
func TestReadmeShowsTheExample(t *testing.T) {
	src, err := os.ReadFile("readme_test.go")
	require.NoError(t, err)
	s := string(src)
	body := s[strings.Index(s, "// README begin\n")+len("// README begin\n") : strings.Index(s, "\t// README end")]
	var lines []string
	for _, l := range strings.Split(strings.TrimRight(body, "\n"), "\n") {
		lines = append(lines, strings.TrimPrefix(l, "\t"))
	}
	blocks := codeBlocks(t, "../README.md")
	require.NotEmpty(t, blocks)
	assert.Equal(t, strings.Join(lines, "\n")+"\n", blocks[0],
		"the README's first example must be readmeExample's body in consumer/readme_test.go")
}

// The README's example runs: a payment delivered twice is recorded once.
func TestReadmeExampleRuns(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	_, err := pool.Exec(context.Background(), `CREATE TABLE payments (order_id text, amount bigint)`)
	require.NoError(t, err)
	b := memsource.New(memsource.Options{})
	for range 2 {
		b.Publish(consumer.Message{ID: "pay-1", Value: []byte(`{"order_id":"o-1","amount":5}`)})
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- readmeExample(ctx, pool, b.Source()) }()
	require.NoError(t, b.WaitAcked(context.Background(), 2))
	cancel()
	require.NoError(t, <-done)
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM payments`).Scan(&n))
	assert.Equal(t, 1, n)
}

// The getting-started guide's handler is the order-processor's, as it is in
// examples/order-processor/orders.go, which its module compiles.
func TestGettingStartedShowsTheExamplesCode(t *testing.T) {
	orders, err := os.ReadFile("../examples/order-processor/orders.go")
	require.NoError(t, err)
	blocks := codeBlocks(t, "../docs/getting-started.md")
	require.NotEmpty(t, blocks)
	for _, part := range strings.Split(blocks[0], "\n\n") {
		assert.Contains(t, string(orders), part, "docs/getting-started.md shows orders.go's code as it is")
	}
}
