package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/onceco/once/outbox"
)

// A park the database refuses to commit (here a deferred constraint
// trigger; a lost connection or a failed commit alike) did not happen: the
// row stays unparked, is published again, and nothing counts or logs it as
// parked until a park commits.
func TestUncommittedParkIsNotCounted(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE refuse_parks (on_ bool NOT NULL);
INSERT INTO refuse_parks VALUES (true);
CREATE FUNCTION refuse_park() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF (SELECT on_ FROM refuse_parks) THEN
		RAISE EXCEPTION 'parks refused';
	END IF;
	RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER refuse_park AFTER UPDATE ON outbox DEFERRABLE INITIALLY DEFERRED
	FOR EACH ROW WHEN (NEW.parked_at IS NOT NULL) EXECUTE FUNCTION refuse_park();`)
	require.NoError(t, err)
	rd := sdkmetric.NewManualReader()
	startRelay(t, pool, k.publisher(t), outbox.RelayConfig{
		PollInterval: 20 * time.Millisecond, MaxAttempts: 1,
		InfraBackoff:  outbox.Backoff{Initial: 10 * time.Millisecond, Max: 20 * time.Millisecond},
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd)),
	})
	addCommitted(t, pool, d.unroutable("a", "a/1"))
	require.Eventually(t, func() bool { return metricValue(t, rd, outbox.FailuresMetric) >= 3 },
		30*time.Second, 5*time.Millisecond, "the park fails to commit again and again")
	assert.Equal(t, 1, rows(t, pool, "parked_at IS NULL AND attempts = 0"), "nothing committed")
	assert.Zero(t, metricValue(t, rd, outbox.ParkedMetric), "no park committed")
	assert.Zero(t, metricValue(t, rd, outbox.RejectedMetric), "no rejection committed")

	_, err = pool.Exec(ctx, `UPDATE refuse_parks SET on_ = false`)
	require.NoError(t, err)
	waitRows(t, pool, "parked_at IS NOT NULL", 1, 30*time.Second)
	require.Eventually(t, func() bool { return metricValue(t, rd, outbox.ParkedMetric) == 1 },
		10*time.Second, 5*time.Millisecond, "the committed park counted")
	assert.EqualValues(t, 1, metricValue(t, rd, outbox.ParkedMetric))
}
