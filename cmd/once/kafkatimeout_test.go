package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// Every command that reads Kafka fails within about half a minute, saying
// that the broker did not answer, when the -kafka address accepts
// connections and never answers (a port that is not Kafka's, a hung
// broker, a firewall): not after sarama's own timeouts and retries, which
// add up to minutes. -kafka-timeout sets the bound of each request.
func TestKafkaThatNeverAnswersFailsWithinTheTimeout(t *testing.T) {
	pool, schema := pgtest.Schema(t)
	store, err := dedup.New(dedup.Config{})
	assert.NoError(t, err)
	assert.NoError(t, store.Migrate(context.Background(), pool))
	env := map[string]string{"DATABASE_URL": testenv.SchemaURL(schema)}
	commands := map[string][]string{
		"dlq list":   {"dlq", "list", "-dlq", "orders.dlq"},
		"dlq show":   {"dlq", "show", "-dlq", "orders.dlq", "-ref", "0:0"},
		"dlq replay": {"dlq", "replay", "-dlq", "orders.dlq", "-all"},
		"status lag": {"status", "-group", "billing", "-topic", "orders"},
		"status dlq": {"status", "-dlq", "orders.dlq"},
	}
	for name, args := range commands {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			addr, _ := testenv.SilentBroker(t)
			started := time.Now()
			code, _, errOut := cli(t, env, append(args, "-kafka", addr)...)
			took := time.Since(started)
			assert.Less(t, took, 35*time.Second, "%s waited for the silent broker", name)
			assert.Equal(t, exitFailure, code, errOut)
			assert.Contains(t, errOut, "i/o timeout", name)
			assert.Contains(t, errOut, "did not answer within 8s (-kafka-timeout)", name)
		})
	}
	t.Run("flag", func(t *testing.T) {
		t.Parallel()
		addr, _ := testenv.SilentBroker(t)
		started := time.Now()
		code, _, errOut := cli(t, env, "dlq", "list", "-dlq", "orders.dlq", "-kafka", addr, "-kafka-timeout", "1s")
		assert.Less(t, time.Since(started), 10*time.Second, "-kafka-timeout 1s")
		assert.Equal(t, exitFailure, code, errOut)
		assert.Contains(t, errOut, "did not answer within 1s (-kafka-timeout)")
		code, _, errOut = cli(t, env, "dlq", "list", "-dlq", "orders.dlq", "-kafka", addr, "-kafka-timeout", "0s")
		assert.Equal(t, exitUsage, code, errOut)
		assert.Contains(t, errOut, "-kafka-timeout")
	})
}
