package outbox_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/onceco/once/internal/testlog"
	"github.com/onceco/once/outbox"
	"github.com/onceco/once/outbox/amqpout"
	"github.com/onceco/once/outbox/kafkaout"
)

type staticToken string

func (s staticToken) Token() (*sarama.AccessToken, error) {
	return &sarama.AccessToken{Token: string(s)}, nil
}

// A broker that refuses the publisher itself (SASL settings or a password
// it does not accept) was retried as a broker that cannot be reached,
// logged at level Warn among the blips of any network and counted only as
// a failure: an operator saw nothing alarming while the outbox stopped
// moving. It is still retried (the rows stay, uncharged, until the broker's
// side is fixed), but logged at level Error, naming what was refused, and
// counted by RefusalsMetric.
func TestBrokerRefusingThePublisherIsAnError(t *testing.T) {
	cases := map[string]func(t *testing.T) (outbox.Publisher, outbox.Message){
		"kafka": func(t *testing.T) (outbox.Publisher, outbox.Message) {
			kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders"),
				kfake.EnableSASL(), kfake.Superuser("PLAIN", "svc", "s3cret-pw"))
			require.NoError(t, err)
			t.Cleanup(kf.Close)
			sc := saramaConfig()
			sc.Metadata.Retry.Max = 0
			sc.Net.SASL.Enable = true
			sc.Net.SASL.Mechanism = sarama.SASLTypeOAuth
			sc.Net.SASL.TokenProvider = staticToken("s3cret-token")
			p, err := kafkaout.New(kafkaout.Config{Brokers: kf.ListenAddrs(), Sarama: sc})
			require.NoError(t, err)
			t.Cleanup(func() { _ = p.Close() })
			return p, outbox.Message{Topic: "orders", Key: []byte("k"), Body: []byte("{}")}
		},
		"rabbitmq": func(t *testing.T) (outbox.Publisher, outbox.Message) {
			r := rabbitOrSkip(t)
			url := strings.Replace(r.url, "guest:guest@", "guest:wrong-pw@", 1)
			require.NotEqual(t, r.url, url, "AMQP_URL has the user guest:guest")
			p, err := amqpout.New(amqpout.Config{URL: url, ConfirmTimeout: 2 * time.Second, DialTimeout: 2 * time.Second})
			require.NoError(t, err)
			t.Cleanup(func() { _ = p.Close() })
			return p, outbox.Message{Topic: "", RoutingKey: "orders", Body: []byte("{}")}
		},
	}
	for name, setup := range cases {
		t.Run(name, func(t *testing.T) {
			pub, msg := setup(t)
			pool, _ := migrated(t)
			addCommitted(t, pool, msg)
			logs := &testlog.ErrorLog{}
			rd := sdkmetric.NewManualReader()
			startRelay(t, pool, pub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond,
				Logger:        slog.New(logs),
				MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd)),
				InfraBackoff:  outbox.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
			require.Eventually(t, func() bool { return metricValue(t, rd, outbox.FailuresMetric) >= 3 },
				30*time.Second, 10*time.Millisecond, "the relay retries")
			errs := logs.Errors()
			require.NotEmpty(t, errs, "the refusal is logged at level Error")
			t.Log(errs[0])
			assert.Contains(t, errs[0], "refuses the publisher")
			assert.NotContains(t, errs[0], "s3cret")
			assert.NotContains(t, errs[0], "wrong-pw")
			assert.Positive(t, metricValue(t, rd, outbox.RefusalsMetric), "the refusals are counted")
			assert.Equal(t, 1, rows(t, pool, "sent_at IS NULL AND parked_at IS NULL AND attempts = 0"),
				"the row is kept, uncharged")
		})
	}
}

// A database that refuses the relay what it needs (here the DELETE of the
// rows the broker confirmed: a role granted SELECT and INSERT only) refuses
// it on every attempt: the relay was logging it at level Warn, like a
// database failing over, while it published nothing more. It still
// retries (a GRANT lets it resume), but logs the refusal at level Error.
func TestDatabaseRefusingTheRelayIsAnError(t *testing.T) {
	k := newKafka(t)
	pool, schema := migrated(t)
	ctx := context.Background()
	role := uniq("relay_ro")
	role = strings.ReplaceAll(role, "-", "_")
	_, err := pool.Exec(ctx, `CREATE ROLE `+role+` LOGIN`)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DROP OWNED BY `+role)
		_, _ = pool.Exec(context.Background(), `DROP ROLE `+role)
	})
	_, err = pool.Exec(ctx, `GRANT USAGE ON SCHEMA `+schema+` TO `+role+`; GRANT SELECT, INSERT, UPDATE ON outbox TO `+role)
	require.NoError(t, err)
	cfg := pool.Config()
	cfg.ConnConfig.User = role
	limited, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(limited.Close)

	d := k.destination(t)
	addCommitted(t, pool, d.msg("k", "m"))
	logs := &testlog.ErrorLog{}
	startRelay(t, limited, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, SkipMigrate: true,
		Logger:       slog.New(logs),
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	d.read(t, 1)
	require.Eventually(t, func() bool { return len(logs.Errors()) > 0 }, 10*time.Second, 10*time.Millisecond,
		"the refusal is logged at level Error")
	t.Log(logs.Errors()[0])
	assert.Contains(t, logs.Errors()[0], "permission denied")
	_, err = pool.Exec(ctx, `GRANT DELETE ON outbox TO `+role)
	require.NoError(t, err)
	waitRows(t, pool, "true", 0, 10*time.Second)
}
