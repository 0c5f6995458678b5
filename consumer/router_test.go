package consumer_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// shopEvent is a family of events: payload types that name their type.
type shopEvent interface{ consumer.EventTyper }

type itemAdded struct {
	Item string `json:"item"`
}

func (itemAdded) EventType() string { return "cart.item-added" }

type itemRemoved struct {
	Item string `json:"item"`
}

func (itemRemoved) EventType() string { return "cart.item-removed" }

// notShop has no EventType method: not a shopEvent.
type notShop struct{}

// AddHandler registers a handler under its payload type's EventType, and a
// router of a family makes a consumer of that family.
func TestAddHandlerTakesTheTypeFromThePayload(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	_, err := pool.Exec(context.Background(), `CREATE TABLE cart (event_id text, what text)`)
	require.NoError(t, err)
	write := func(ctx context.Context, tx pgx.Tx, id, what string) error {
		_, err := tx.Exec(ctx, `INSERT INTO cart VALUES ($1, $2)`, id, what)
		return err
	}
	r := consumer.NewRouter[shopEvent](consumer.RouterConfig{})
	require.NoError(t, consumer.AddHandler(r, func(ctx context.Context, tx pgx.Tx, ev consumer.Event[itemAdded]) error {
		return write(ctx, tx, ev.ID, "+"+ev.Payload.Item)
	}))
	require.NoError(t, consumer.AddHandler(r, func(ctx context.Context, tx pgx.Tx, ev consumer.Event[itemRemoved]) error {
		return write(ctx, tx, ev.ID, "-"+ev.Payload.Item)
	}))
	assert.Equal(t, []string{"cart.item-added", "cart.item-removed"}, r.Types())
	err = consumer.AddHandler(r, func(context.Context, pgx.Tx, consumer.Event[itemAdded]) error { return nil })
	require.ErrorIs(t, err, consumer.ErrInvalidConfig, "a second handler of one payload type is an error")

	b := memsource.New(memsource.Options{Streams: 1})
	for id, ev := range map[string]consumer.EventTyper{"a1": itemAdded{Item: "pen"}, "r1": itemRemoved{Item: "ink"}} {
		raw, err := json.Marshal(ev)
		require.NoError(t, err)
		b.Publish(consumer.Message{Value: raw, Headers: map[string]string{"id": id, "type": ev.EventType()}})
	}
	var c *consumer.Consumer[shopEvent]
	c, err = consumer.NewRouted(pool, b.Source(), r, fastConfig("cart"))
	require.NoError(t, err)
	stop := start(t, c)
	require.NoError(t, b.WaitAcked(context.Background(), 2))
	require.NoError(t, stop())

	rows, err := pool.Query(context.Background(), `SELECT event_id || what FROM cart ORDER BY 1`)
	require.NoError(t, err)
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	assert.Equal(t, []string{"a1+pen", "r1-ink"}, got)
	assert.Empty(t, b.DeadLetters())
}

// A router of a family refuses a handler whose payload type is not of it,
// naming both types; a router of any takes every type.
func TestRouterRefusesAPayloadOutsideItsFamily(t *testing.T) {
	r := consumer.NewRouter[shopEvent](consumer.RouterConfig{})
	err := consumer.Handle(r, "misc", func(context.Context, pgx.Tx, consumer.Event[notShop]) error { return nil })
	require.ErrorIs(t, err, consumer.ErrInvalidConfig)
	assert.Contains(t, err.Error(), "notShop")
	assert.Contains(t, err.Error(), "shopEvent")
	assert.Empty(t, r.Types(), "nothing was registered")

	anything := consumer.NewRouter[any](consumer.RouterConfig{})
	require.NoError(t, consumer.Handle(anything, "misc", func(context.Context, pgx.Tx, consumer.Event[notShop]) error { return nil }))
	require.NoError(t, consumer.AddHandler(anything, func(context.Context, pgx.Tx, consumer.Event[itemAdded]) error { return nil }))
	assert.Equal(t, []string{"cart.item-added", "misc"}, anything.Types())
}

// AddHandler takes a pointer payload type too: its EventType is called on
// a pointer to a zero value, never on a nil pointer, and the events are
// decoded into a new value each.
func TestAddHandlerTakesAPointerPayload(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	r := consumer.NewRouter[shopEvent](consumer.RouterConfig{})
	got := make(chan *itemAdded, 1)
	require.NoError(t, consumer.AddHandler(r, func(_ context.Context, _ pgx.Tx, ev consumer.Event[*itemAdded]) error {
		got <- ev.Payload
		return nil
	}))
	assert.Equal(t, []string{"cart.item-added"}, r.Types())

	b := memsource.New(memsource.Options{Streams: 1})
	b.Publish(consumer.Message{Value: []byte(`{"item":"pen"}`), Headers: map[string]string{"id": "a1", "type": "cart.item-added"}})
	c, err := consumer.NewRouted(pool, b.Source(), r, fastConfig("cart-pointer"))
	require.NoError(t, err)
	start(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(ctx, 1))
	assert.Equal(t, &itemAdded{Item: "pen"}, <-got)
	assert.Empty(t, b.DeadLetters())
}

// AddHandler refuses an interface payload type, which has no value to
// call EventType on, with an error instead of a nil dereference.
func TestAddHandlerRefusesAnInterfacePayload(t *testing.T) {
	r := consumer.NewRouter[shopEvent](consumer.RouterConfig{})
	err := consumer.AddHandler(r, func(context.Context, pgx.Tx, consumer.Event[shopEvent]) error { return nil })
	require.ErrorIs(t, err, consumer.ErrInvalidConfig)
	assert.Contains(t, err.Error(), "shopEvent")
	assert.Empty(t, r.Types())
}

// The zero Router is ready to use, with RouterConfig's defaults; a nil one
// is a configuration error, not a panic.
func TestZeroRouterTakesHandlers(t *testing.T) {
	var r consumer.Router[any]
	require.NoError(t, consumer.Handle(&r, "misc", func(context.Context, pgx.Tx, consumer.Event[notShop]) error { return nil }))
	require.NoError(t, consumer.AddHandler(&r, func(context.Context, pgx.Tx, consumer.Event[itemAdded]) error { return nil }))
	assert.Equal(t, []string{"cart.item-added", "misc"}, r.Types())

	var none *consumer.Router[any]
	err := consumer.Handle(none, "misc", func(context.Context, pgx.Tx, consumer.Event[notShop]) error { return nil })
	require.ErrorIs(t, err, consumer.ErrInvalidConfig)
	require.ErrorIs(t, consumer.AddHandler(none, func(context.Context, pgx.Tx, consumer.Event[itemAdded]) error { return nil }),
		consumer.ErrInvalidConfig)
}
