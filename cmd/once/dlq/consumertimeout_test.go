package dlq_test

import (
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/rabbittemp"
)

// A replay slowed by its rate past the broker's consumer_timeout keeps
// working: it holds the queue's messages unacked for AMQPConfig.MaxHold at
// most, puts them back and takes them again, so the broker never closes
// its channel for an ack overdue. Every selected record is redriven once
// and removed; the others stay, in their order. (The node is the test's
// own: its consumer_timeout is 1.5 s, checked every 200 ms.)
func TestAMQPSlowReplayOutlastsTheConsumerTimeout(t *testing.T) {
	script, err := filepath.Abs(filepath.Join("..", "..", "..", "scripts", "rabbitmq.sh"))
	require.NoError(t, err)
	n := rabbittemp.Start(t, script)
	n.Ctl(t, "eval", "application:set_env(rabbit, consumer_timeout, 1500), application:set_env(rabbit, channel_tick_interval, 200).")
	url := n.URL
	ch := testenv.AMQPChannel(t, url)
	queue, target := "orders.dlq", "orders"
	for _, name := range []string{queue, target} {
		_, err := ch.QueueDeclare(name, true, false, false, false, nil)
		require.NoError(t, err)
	}
	const total = 8
	for i := range total {
		p := amsg("ev-"+strconv.Itoa(i), []byte(strconv.Itoa(i)))
		p.Headers[consumer.HeaderEventID] = "ev-" + strconv.Itoa(i)
		p.Headers["once-original-exchange"] = ""
		p.Headers["once-original-routing-key"] = target
		testenv.PublishAMQP(t, ch, queue, p)
	}
	q, err := dlq.NewAMQP(dlq.AMQPConfig{URL: url, Queue: queue, MaxHold: 500 * time.Millisecond})
	require.NoError(t, err)
	recs, err := dlq.Collect(ctxT(t), q, dlq.Filter{})
	require.NoError(t, err)
	require.Len(t, recs, total)
	var refs []string
	var left []string
	for i, r := range recs {
		if i%2 == 0 {
			refs = append(refs, r.Ref)
		} else {
			left = append(left, string(r.Value))
		}
	}

	// 4 records, one every 2 s: each wait alone outlasts the
	// consumer_timeout of the messages held.
	started := time.Now()
	rep, err := q.Replay(ctxT(t), dlq.Filter{Refs: refs}, dlq.ReplayOptions{Rate: 0.5})
	require.NoError(t, err)
	assert.Equal(t, 4, rep.Replayed)
	assert.Zero(t, rep.Skipped)
	assert.Greater(t, time.Since(started), 6*time.Second, "the replay was paced")

	var redriven []string
	for {
		d, ok, err := ch.Get(target, true)
		require.NoError(t, err)
		if !ok {
			break
		}
		redriven = append(redriven, string(d.Body))
	}
	assert.Equal(t, []string{"0", "2", "4", "6"}, redriven, "each selected record redriven once, in order")
	rest, err := dlq.Collect(ctxT(t), q, dlq.Filter{})
	require.NoError(t, err)
	var restValues []string
	for _, r := range rest {
		restValues = append(restValues, string(r.Value))
	}
	assert.Equal(t, left, restValues, "the records not selected stay in the queue, in their order")
}

// A selected message that another client takes while a slow replay has
// put the queue's messages back is reported as skipped, and the replay
// goes on with the others.
func TestAMQPSlowReplaySkipsAMessageGoneMeanwhile(t *testing.T) {
	url := testenv.AMQPURL(t)
	ch := testenv.AMQPChannel(t, url)
	queue, target := testenv.Uniq("gone.dlq"), testenv.Uniq("gone")
	testenv.DeleteQueues(t, url, queue, target)
	for _, name := range []string{queue, target} {
		_, err := ch.QueueDeclare(name, true, false, false, false, nil)
		require.NoError(t, err)
	}
	for i := range 3 {
		p := amsg("ev-"+strconv.Itoa(i), []byte(strconv.Itoa(i)))
		p.Headers[consumer.HeaderEventID] = "ev-" + strconv.Itoa(i)
		p.Headers["once-original-exchange"] = ""
		p.Headers["once-original-routing-key"] = target
		testenv.PublishAMQP(t, ch, queue, p)
	}
	q, err := dlq.NewAMQP(dlq.AMQPConfig{URL: url, Queue: queue, MaxHold: 200 * time.Millisecond})
	require.NoError(t, err)
	var taken []byte
	rep, err := q.Replay(ctxT(t), dlq.Filter{}, dlq.ReplayOptions{Rate: 4, Progress: func(done, _ int, _ dlq.Outcome) {
		if done == 1 {
			// The wait for the next publish outlasts MaxHold: the
			// messages are back in the queue, and another client
			// takes the first of them.
			d, ok, err := ch.Get(queue, true)
			require.NoError(t, err)
			require.True(t, ok, "the messages were put back during the wait")
			taken = d.Body
		}
	}})
	require.NoError(t, err)
	assert.Equal(t, "1", string(taken))
	assert.Equal(t, 2, rep.Replayed)
	assert.Equal(t, 1, rep.Skipped)
	require.Len(t, rep.Outcomes, 3)
	assert.Equal(t, dlq.Skipped, rep.Outcomes[1].Result)
	assert.Contains(t, rep.Outcomes[1].Reason, "no longer in the queue")
	var redriven []string
	for {
		d, ok, err := ch.Get(target, true)
		require.NoError(t, err)
		if !ok {
			break
		}
		redriven = append(redriven, string(d.Body))
	}
	assert.Equal(t, []string{"0", "2"}, redriven)
	left, err := dlq.Collect(ctxT(t), q, dlq.Filter{})
	require.NoError(t, err)
	assert.Empty(t, left)
}
