package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// chaosExe builds the order-processor with -tags chaos into the test's
// temporary directory: the members of a chaos run are that program.
func chaosExe(t *testing.T) string {
	t.Helper()
	exe, err := buildChaosExe(context.Background(), t.TempDir())
	require.NoError(t, err)
	return exe
}

// reducedChaos is the chaos run inside make test: less traffic and fewer
// kills than make chaos, but every kind of fault at least once.
func reducedChaos(t *testing.T, broker, amqpURL string) *ChaosResult {
	t.Helper()
	return reducedChaosWith(t, broker, amqpURL, func(*ChaosConfig) {})
}

// reducedChaosWith is reducedChaos with the configuration changed by set.
func reducedChaosWith(t *testing.T, broker, amqpURL string, set func(*ChaosConfig)) *ChaosResult {
	t.Helper()
	exe := chaosExe(t)
	var log bytes.Buffer
	cfg := ChaosConfig{
		Broker: broker, AMQPURL: amqpURL,
		Orders: 400, Seed: time.Now().UnixNano()%900000 + 100000,
		Kills: 3, CrashPoints: true, PGRestarts: 1, Cuts: 1, Members: 3, Rebalances: 1, RelayKills: 1, SchemaChanges: 1,
		Exe: exe, Output: &log,
	}
	set(&cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	res, err := RunChaos(ctx, cfg)
	require.NoError(t, err, "driver log:\n%s", log.String())
	var table bytes.Buffer
	res.Print(&table)
	t.Log("\n" + table.String())
	// What a slow drain waited for, even when the run passes.
	for _, l := range strings.Split(log.String(), "\n") {
		if strings.Contains(l, "draining") || strings.Contains(l, "backlog") || strings.Contains(l, "drain round") {
			t.Log(l)
		}
	}
	return res
}

// assertChaosVerdict checks a run's counts: nothing lost, nothing doubled,
// every poison message in the dead-letter queue, and every fault injected.
func assertChaosVerdict(t *testing.T, res *ChaosResult, faultKinds ...string) {
	t.Helper()
	assert.Zero(t, res.Lost, "lost: %v", res.LostIDs)
	assert.Zero(t, res.Doubled, "doubled: %v", res.DoubledIDs)
	assert.Positive(t, res.UniqueEvents)
	assert.Equal(t, res.UniqueEvents, res.EffectsOnce, "every valid event has exactly one effect")
	assert.Equal(t, int64(res.UniqueEvents), res.Processed, "one processed_events row per valid event")
	assert.Positive(t, res.Poison)
	assert.Equal(t, res.Poison, res.PoisonDeadLettered, "every poison message dead-lettered: %v", res.PoisonMissing)
	assert.Positive(t, res.SentByKind[kindDuplicate]+res.SentByKind[kindIDlessDup], "the traffic had duplicates")
	for _, k := range faultKinds {
		assert.Positive(t, res.Faults[k], "fault %s injected", k)
	}
	for _, p := range append(crashPointNames, relayCrashPoint) {
		assert.Equal(t, 1, res.CrashPoints[p], "crash point %s killed a member", p)
	}
	assertHop2(t, res)
	assert.True(t, strings.HasPrefix(res.OrdersCheck, "PASS"), res.OrdersCheck)
	assert.True(t, res.Pass(), "problems: %v", res.Problems)
}

// assertHop2 checks the second hop's counts: each paid order has one
// outbox row, published, and one shipment under that row's id; the relay
// leader was killed at least once.
func assertHop2(t *testing.T, res *ChaosResult) {
	t.Helper()
	h := res.Hop2
	if !assert.NotNil(t, h, "the second hop was counted") {
		return
	}
	assert.Positive(t, h.PaidOrders)
	assert.Equal(t, h.PaidOrders, h.OutboxRows, "one outbox row per paid order")
	assert.Equal(t, h.OutboxRows, h.OutboxPublished, "every outbox row published")
	assert.Zero(t, h.OutboxMismatch, "each row under its payment's id")
	assert.Equal(t, h.PaidOrders, h.ShippedOnce, "each paid order shipped exactly once")
	assert.Equal(t, h.PaidOrders, h.Shipments, "no other shipment")
	assert.Zero(t, h.ShippedWrongly)
	assert.Equal(t, h.PaidOrders, h.Processed)
	if h.WireRecords > 0 { // Kafka: the topic can be read back
		assert.Equal(t, int(h.PaidOrders), h.WireIDs, "one id per paid order on the wire")
		assert.GreaterOrEqual(t, h.WireRecords, h.WireIDs)
	}
	assert.Positive(t, res.Faults["relay-leader-kill"], "the leading relay's member was killed")
}

// The reduced chaos run on Kafka: kfake in this process behind a cutting
// listener, three member processes in one group killed at random, at each
// crash point and while another joins, PostgreSQL restarted under them.
func TestChaosKafka(t *testing.T) {
	start := time.Now()
	res := reducedChaos(t, "kafka", "")
	assertChaosVerdict(t, res, "kill", "crash-point", "pg-restart", "cut", "rebalance-kill", faultSchemaChange)
	assert.GreaterOrEqual(t, res.Starts, 3+3+5+1, "members restarted after each kill and crash")
	t.Logf("took %s", time.Since(start).Round(time.Second))
}

// The reduced chaos run on Kafka with the offsets kept in PostgreSQL
// (kafka.Config.OffsetsInDatabase), the group deleted with its offsets once
// during the run on top of the other faults.
func TestChaosKafkaOffsetsInDatabase(t *testing.T) {
	res := reducedChaosWith(t, "kafka", "", func(cfg *ChaosConfig) { cfg.OffsetsInDatabase = true })
	assertChaosVerdict(t, res, "kill", "crash-point", "pg-restart", "cut", "rebalance-kill", faultDeleteGroup, faultSchemaChange)
}

// The reduced chaos run on RabbitMQ: the members connect through a proxy
// the driver cuts.
func TestChaosRabbitMQ(t *testing.T) {
	u := requireAMQP(t)
	res := reducedChaos(t, "amqp", u)
	assertChaosVerdict(t, res, "kill", "crash-point", "pg-restart", "cut", faultSchemaChange)
}

// The JSON the -json flag writes holds the counts and the verdict.
func TestChaosCommandWritesJSON(t *testing.T) {
	exe := chaosExe(t)
	file := filepath.Join(t.TempDir(), "chaos.json")
	var out, errOut bytes.Buffer
	code := chaosMain(context.Background(), []string{"-broker", "kafka", "-orders", "100", "-kills", "1", "-pg-restarts", "0",
		"-cuts", "1", "-members", "2", "-rebalances", "0", "-relay-kills", "1", "-no-crash-points", "-exe", exe, "-json", file}, &out, &errOut)
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", out.String(), errOut.String())
	assert.Contains(t, out.String(), "verdict: PASS")
	data, err := os.ReadFile(file)
	require.NoError(t, err)
	var got []ChaosResult
	require.NoError(t, json.Unmarshal(data, &got))
	require.Len(t, got, 1)
	assert.Equal(t, "kafka", got[0].Broker)
	assert.Zero(t, got[0].Lost)
	assert.Zero(t, got[0].Doubled)
	assert.Equal(t, 1, got[0].Faults["kill"])
	assert.Equal(t, 1, got[0].Faults["cut"])
	assert.Equal(t, 1, got[0].Faults["relay-leader-kill"])
	require.NotNil(t, got[0].Hop2)
	assert.Positive(t, got[0].Hop2.PaidOrders)
	assert.Equal(t, got[0].Hop2.PaidOrders, got[0].Hop2.ShippedOnce)
	assert.Contains(t, got[0].Command, "-kills 1")
}

// Bad flags are a usage error.
func TestChaosCommandRejectsUnknownBroker(t *testing.T) {
	var out, errOut bytes.Buffer
	assert.Equal(t, 2, chaosMain(context.Background(), []string{"-broker", "nats"}, &out, &errOut))
	assert.Contains(t, errOut.String(), `-broker "nats"`)
}
