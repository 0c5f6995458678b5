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

// A row written by plain SQL whose headers (or trace) are JSON but not an
// object of strings cannot become a message: it is charged and parked with
// the reason, the rows of its key wait behind it, and every other row is
// published, where the relay once failed to read any batch holding it and
// published nothing at all.
func TestUndecodableRowIsParkedOthersGoOn(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	startRelay(t, pool, k.publisher(t), outbox.RelayConfig{
		PollInterval: 20 * time.Millisecond, MaxAttempts: 2,
		RetryBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond},
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond},
	})
	ctx := context.Background()
	addCommitted(t, pool, d.msg("a", "a/1"))
	d.read(t, 1)
	_, err := pool.Exec(ctx, `INSERT INTO outbox (event_id, topic, key, headers, trace, body)
VALUES ('bad-headers', $1, 'a', '{"retries": 3}', '{}', 'a/2'), ('bad-trace', $1, 'b', '{}', '["x"]', 'b/1')`, d.(*kafkaDest).topic)
	require.NoError(t, err)
	addCommitted(t, pool, d.msg("a", "a/3"), d.msg("c", "c/1"))

	waitRows(t, pool, "parked_at IS NOT NULL AND attempts = 2", 2, 30*time.Second)
	assert.Equal(t, 1, rows(t, pool, "event_id = 'bad-headers' AND last_error LIKE '%headers%'"))
	assert.Equal(t, 1, rows(t, pool, "event_id = 'bad-trace' AND last_error LIKE '%trace%'"))
	got := d.read(t, 2)
	assert.ElementsMatch(t, []string{"a/1", "c/1"}, bodies(got))
	assert.Equal(t, 1, rows(t, pool, "parked_at IS NULL AND sent_at IS NULL"), "a/3 waits behind the parked a/2")
}
