package consumer_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// A route whose payload type is an interface with methods (registered with
// Handle, as AddHandler says to for an interface) cannot be filled by the
// default JSON decoder: NewRouted refuses it without a Decoder, naming the
// type, as New refuses such a payload type. It was accepted, and every
// message of that type was dead-lettered at once as decode.
func TestNewRoutedRefusesAnInterfacePayloadTheDefaultDecoderCannotFill(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	src := memsource.New(memsource.Options{}).Source()
	r := consumer.NewRouter[any](consumer.RouterConfig{})
	require.NoError(t, consumer.Handle(r, "order.paid", func(context.Context, pgx.Tx, consumer.Event[order]) error { return nil }))
	require.NoError(t, consumer.Handle(r, "order.named", func(context.Context, pgx.Tx, consumer.Event[fmt.Stringer]) error { return nil }))
	_, err := consumer.NewRouted(pool, src, r, consumer.Config{Name: "x"})
	require.ErrorIs(t, err, consumer.ErrInvalidConfig)
	assert.Contains(t, err.Error(), "order.named")
	assert.Contains(t, err.Error(), "fmt.Stringer")

	_, err = consumer.NewRouted(pool, src, r, consumer.Config{Name: "x", Decoder: func([]byte, any) error { return nil }})
	require.NoError(t, err, "a Decoder of its own may fill the interface")
	anyRouter := consumer.NewRouter[any](consumer.RouterConfig{})
	require.NoError(t, consumer.Handle(anyRouter, "t", func(context.Context, pgx.Tx, consumer.Event[any]) error { return nil }))
	_, err = consumer.NewRouted(pool, src, anyRouter, consumer.Config{Name: "x"})
	require.NoError(t, err, "any takes what JSON decodes")
}
