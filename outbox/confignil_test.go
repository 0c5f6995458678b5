package outbox_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/outbox"
)

// NewRelay promises an error wrapping ErrInvalidConfig for an invalid
// configuration, and refuses a nil pointer in the Publisher. A nil pointer
// in RelayConfig's MeterProvider or TracerProvider (a provider left unset
// while telemetry is off, var mp *sdkmetric.MeterProvider) made NewRelay
// panic instead; a Store not made by New (&outbox.Store{}, whose doc says
// the zero value is not usable) was taken, and Run panicked migrating it,
// ending the process, or, with SkipMigrate, retried "invalid name syntax"
// for ever. Each is refused, naming the field.
func TestNewRelayRefusesNilProvidersAndAStoreNotMadeByNew(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	var mp *sdkmetric.MeterProvider
	var tp *sdktrace.TracerProvider
	for field, cfg := range map[string]outbox.RelayConfig{
		"MeterProvider":  {MeterProvider: mp},
		"TracerProvider": {TracerProvider: tp},
		"Store":          {Store: &outbox.Store{}},
	} {
		var err error
		require.NotPanics(t, func() { _, err = outbox.NewRelay(pool, nopPublisher{}, cfg) }, field)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, field)
		assert.Contains(t, err.Error(), field)
	}
}
