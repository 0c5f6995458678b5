package consumer_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// A nil pointer in one of Config's interfaces (a provider left unset when
// tracing is off, `var tp *sdktrace.TracerProvider`, or a constructor's
// error dropped) makes the interface non-nil. New refuses it, naming the
// field, as it refuses a nil pointer in the Source: a nil Envelope was
// accepted and dead-lettered every message as a panic, and a nil
// TracerProvider or MeterProvider made New panic.
func TestNewRefusesANilPointerInAConfigInterface(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	src := memsource.New(memsource.Options{}).Source()
	var (
		env *consumer.JSONEnvelope
		tp  *sdktrace.TracerProvider
		mp  *sdkmetric.MeterProvider
	)
	cases := map[string]struct {
		cfg   consumer.Config
		field string
	}{
		"envelope":        {consumer.Config{Name: "x", Envelope: env}, "Envelope"},
		"tracer provider": {consumer.Config{Name: "x", Telemetry: consumer.TelemetryConfig{TracerProvider: tp}}, "Telemetry.TracerProvider"},
		"meter provider":  {consumer.Config{Name: "x", Telemetry: consumer.TelemetryConfig{MeterProvider: mp}}, "Telemetry.MeterProvider"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			var err error
			require.NotPanics(t, func() { _, err = consumer.New(pool, src, insertEffect, tc.cfg) })
			require.ErrorIs(t, err, consumer.ErrInvalidConfig)
			assert.Contains(t, err.Error(), tc.field)
		})
	}
}

// New and NewBatch of a payload type that is an interface with methods
// (an event family meant for NewRouted) and no Decoder: the default JSON
// decoder cannot fill a nil interface, so every message was dead-lettered
// at once as decode. New refuses it, saying what to use; with a Decoder of
// its own (which may fill the interface), or for any, it is accepted.
func TestNewRefusesAnInterfacePayloadTheDefaultDecoderCannotFill(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	src := memsource.New(memsource.Options{}).Source()
	h := func(context.Context, pgx.Tx, consumer.Event[fmt.Stringer]) error { return nil }
	_, err := consumer.New(pool, src, h, consumer.Config{Name: "x"})
	require.ErrorIs(t, err, consumer.ErrInvalidConfig)
	assert.Contains(t, err.Error(), "NewRouted")
	bh := func(context.Context, pgx.Tx, []consumer.Event[fmt.Stringer]) error { return nil }
	_, err = consumer.NewBatch(pool, src, bh, consumer.Config{Name: "x"})
	require.ErrorIs(t, err, consumer.ErrInvalidConfig)

	_, err = consumer.New(pool, src, h, consumer.Config{Name: "x", Decoder: func([]byte, any) error { return nil }})
	require.NoError(t, err, "a Decoder of its own may fill the interface")
	_, err = consumer.New(pool, src, func(context.Context, pgx.Tx, consumer.Event[any]) error { return nil }, consumer.Config{Name: "x"})
	require.NoError(t, err, "any takes what JSON decodes")
}
