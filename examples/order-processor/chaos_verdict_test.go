package main

import (
	"context"
	"encoding/json"
	"math/rand"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/netcut"
	"github.com/onceco/once/internal/pgtest"
)

// verdictRun returns a chaos run over a small generated traffic whose
// database (a schema of the test database) holds what a run without a
// fault leaves: every valid event handled once by the service's handlers
// with its processed_events row, every poison message dead-lettered (the
// returned records), each paid order's confirmation published and shipped
// once. The broker is amqp, so that counting reads PostgreSQL only.
func verdictRun(t *testing.T) (*chaosRun, []deadLetter) {
	t.Helper()
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	require.NoError(t, resetDemoTables(ctx, pool))
	o := &options{broker: "amqp", topic: "orders-verdict", name: "order-processor-verdict", shipping: true}
	plan := Generate(Mix{Orders: 60, Seed: 7, Duplicates: 0.1, IDless: 0.1, Malformed: 0.05, Violations: 0.1})
	r := &chaosRun{cfg: ChaosConfig{Broker: "amqp", Members: 1}, o: o, pool: pool, plan: plan, logs: t.TempDir(),
		faults: map[string]int{}, crashes: map[string]int{}, exitedAt: map[int]time.Time{}}

	orders := &Orders{UnknownOrderWait: time.Millisecond, Confirmed: destination(o)}
	var dlq []deadLetter
	deadLetter := func(id string, kind consumer.ErrorKind) {
		dlq = append(dlq, deadLetterOf(id, kind))
	}
	for _, m := range plan.Messages {
		switch m.Kind {
		case kindDuplicate, kindIDlessDup:
			continue // skipped as duplicates
		case kindMalformed:
			deadLetter(m.ID, consumer.KindDecode)
			continue
		}
		id, err := EventID(&consumer.Message{ID: m.ID, Value: m.Value, Type: m.Type})
		require.NoError(t, err)
		err = inTx(t, pool, func(ctx context.Context, tx pgx.Tx) error {
			var err error
			switch m.Type {
			case TypeCreated:
				var p OrderCreated
				require.NoError(t, json.Unmarshal(m.Value, &p))
				err = consumer.Call(ctx, tx, orders.Created, ev(id, p))
			case TypePaid:
				var p OrderPaid
				require.NoError(t, json.Unmarshal(m.Value, &p))
				err = consumer.Call(ctx, tx, orders.Paid, ev(id, p))
			case TypeCancelled:
				var p OrderCancelled
				require.NoError(t, json.Unmarshal(m.Value, &p))
				err = consumer.Call(ctx, tx, orders.Cancelled, ev(id, p))
			}
			if err != nil {
				return err
			}
			_, err = tx.Exec(ctx, `INSERT INTO processed_events (consumer, event_id) VALUES ($1, $2)`, o.name, id)
			return err
		})
		if m.Kind == kindEvent || m.Kind == kindIDless {
			require.NoError(t, err, "%s (%s)", id, m.Kind)
			continue
		}
		require.Error(t, err, "%s (%s) breaks a rule", id, m.Kind)
		deadLetter(id, consumer.KindHandler)
	}

	// The second hop: each outbox row published, then shipped once.
	rows, err := pool.Query(ctx, `UPDATE outbox SET sent_at = now() WHERE type = $1 RETURNING event_id, body`, TypeConfirmed)
	require.NoError(t, err)
	type confirmed struct {
		id   string
		body []byte
	}
	var sent []confirmed
	for rows.Next() {
		var c confirmed
		require.NoError(t, rows.Scan(&c.id, &c.body))
		sent = append(sent, c)
	}
	require.NoError(t, rows.Err())
	for _, c := range sent {
		var p OrderConfirmed
		require.NoError(t, json.Unmarshal(c.body, &p))
		require.NoError(t, inTx(t, pool, func(ctx context.Context, tx pgx.Tx) error {
			if err := consumer.Call(ctx, tx, Ship, ev(c.id, p)); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `INSERT INTO processed_events (consumer, event_id) VALUES ($1, $2)`, shippingName(o), c.id)
			return err
		}))
	}
	require.Positive(t, plan.LedgerRows)
	require.Positive(t, plan.Violations)
	require.Positive(t, plan.Malformed)
	return r, dlq
}

// deadLetterOf is a dead-letter record of event id with kind.
func deadLetterOf(id string, kind consumer.ErrorKind) deadLetter {
	return deadLetter{Headers: map[string]string{consumer.HeaderEventID: id, consumer.HeaderErrorKind: string(kind)}}
}

// countVerdict counts r with dlq and returns the result.
func countVerdict(t *testing.T, r *chaosRun, dlq []deadLetter) *ChaosResult {
	t.Helper()
	res, err := r.count(context.Background(), dlq)
	require.NoError(t, err)
	return res
}

// firstOfKind returns the event id of the plan's first message of kind and
// type typ ("" for any).
func firstOfKind(t *testing.T, r *chaosRun, kind, typ string) string {
	t.Helper()
	for _, m := range r.plan.Messages {
		if m.Kind == kind && (typ == "" || m.Type == typ) {
			id, err := EventID(&consumer.Message{ID: m.ID, Value: m.Value, Type: m.Type})
			require.NoError(t, err)
			return id
		}
	}
	t.Fatalf("no message of kind %s and type %q in the plan", kind, typ)
	return ""
}

// execSQL runs sql on r's database.
func execSQL(t *testing.T, r *chaosRun, sql string, args ...any) {
	t.Helper()
	_, err := r.pool.Exec(context.Background(), sql, args...)
	require.NoError(t, err)
}

// The verdict passes on what a run without a fault leaves, and fails on
// an effect lost, an effect doubled, an effect of an event never sent, or
// a poison message not dead-lettered.
func TestChaosVerdictCountsEffects(t *testing.T) {
	t.Run("every effect once", func(t *testing.T) {
		r, dlq := verdictRun(t)
		res := countVerdict(t, r, dlq)
		assert.True(t, res.Pass(), "problems: %v", res.Problems)
		assert.Equal(t, res.UniqueEvents, res.EffectsOnce)
	})
	t.Run("a payment lost", func(t *testing.T) {
		r, dlq := verdictRun(t)
		id := firstOfKind(t, r, kindEvent, TypePaid)
		execSQL(t, r, `DELETE FROM shipments WHERE event_id = $1 || '/confirmed'`, id)
		execSQL(t, r, `DELETE FROM processed_events WHERE event_id = $1 || '/confirmed'`, id)
		execSQL(t, r, `DELETE FROM outbox WHERE event_id = $1 || '/confirmed'`, id)
		execSQL(t, r, `UPDATE orders SET status = 'created' WHERE id = (SELECT order_id FROM payments WHERE event_id = $1)`, id)
		execSQL(t, r, `DELETE FROM payments WHERE event_id = $1`, id)
		execSQL(t, r, `DELETE FROM processed_events WHERE event_id = $1`, id)
		res := countVerdict(t, r, dlq)
		assert.False(t, res.Pass())
		assert.Equal(t, 1, res.Lost)
	})
	t.Run("a payment doubled", func(t *testing.T) {
		r, dlq := verdictRun(t)
		id := firstOfKind(t, r, kindEvent, TypePaid)
		execSQL(t, r, `INSERT INTO payments SELECT * FROM payments WHERE event_id = $1`, id)
		res := countVerdict(t, r, dlq)
		assert.False(t, res.Pass())
		assert.Equal(t, 1, res.Doubled)
	})
	t.Run("a claim recorded under an id never sent instead of its event's", func(t *testing.T) {
		r, dlq := verdictRun(t)
		id := firstOfKind(t, r, kindEvent, TypeCreated)
		execSQL(t, r, `UPDATE processed_events SET event_id = 'evt-never-sent' WHERE consumer = $1 AND event_id = $2`, r.o.name, id)
		res := countVerdict(t, r, dlq)
		assert.False(t, res.Pass(), "the processed_events rows are not those of the events sent")
	})
	t.Run("a shipping claim recorded under an id never sent instead of its event's", func(t *testing.T) {
		r, dlq := verdictRun(t)
		id := firstOfKind(t, r, kindEvent, TypePaid)
		execSQL(t, r, `UPDATE processed_events SET event_id = 'evt-never-sent/confirmed' WHERE consumer = $1 AND event_id = $2 || '/confirmed'`,
			shippingName(r.o), id)
		res := countVerdict(t, r, dlq)
		assert.False(t, res.Pass(), "the shipping consumer's processed_events rows are not those of the confirmations")
	})
	t.Run("a payment of an event never sent", func(t *testing.T) {
		r, dlq := verdictRun(t)
		execSQL(t, r, `INSERT INTO orders (id, customer, amount_cents, status, created_event) VALUES ('o-ghost', 'c', 100, 'paid', 'evt-ghost-1')`)
		execSQL(t, r, `INSERT INTO payments (order_id, payment_id, event_id, amount_cents) VALUES ('o-ghost', 'pay-ghost', 'evt-ghost-2', 100)`)
		res := countVerdict(t, r, dlq)
		assert.False(t, res.Pass())
	})
	t.Run("a poison message not dead-lettered", func(t *testing.T) {
		r, dlq := verdictRun(t)
		id := firstOfKind(t, r, kindMalformed, "")
		var kept []deadLetter
		for _, d := range dlq {
			if d.Headers[consumer.HeaderEventID] != id {
				kept = append(kept, d)
			}
		}
		res := countVerdict(t, r, kept)
		assert.False(t, res.Pass())
		assert.Equal(t, res.Poison-1, res.PoisonDeadLettered)
	})
}

// A second payment that won its race (RabbitMQ gives no order) holds the
// effect and the claim, and its rival is dead-lettered: a pass.
func TestChaosVerdictPassesASecondPaymentThatWonItsRace(t *testing.T) {
	r, dlq := verdictRun(t)
	second := firstOfKind(t, r, kindSecondPayment, "")
	var order string
	for _, m := range r.plan.Messages {
		if m.ID == second {
			var p OrderPaid
			require.NoError(t, json.Unmarshal(m.Value, &p))
			order = p.OrderID
		}
	}
	var firstID string
	require.NoError(t, r.pool.QueryRow(context.Background(), `SELECT event_id FROM payments WHERE order_id = $1`, order).Scan(&firstID))
	for _, q := range []string{
		`UPDATE payments SET event_id = $2, payment_id = 'pay2-' || order_id WHERE event_id = $1`,
		`UPDATE processed_events SET event_id = $2 WHERE event_id = $1`,
		`UPDATE processed_events SET event_id = $2 || '/confirmed' WHERE event_id = $1 || '/confirmed'`,
		`UPDATE outbox SET event_id = $2 || '/confirmed' WHERE event_id = $1 || '/confirmed'`,
		`UPDATE shipments SET event_id = $2 || '/confirmed' WHERE event_id = $1 || '/confirmed'`,
	} {
		execSQL(t, r, q, firstID, second)
	}
	var raced []deadLetter
	for _, d := range dlq {
		if d.Headers[consumer.HeaderEventID] != second {
			raced = append(raced, d)
		}
	}
	raced = append(raced, deadLetterOf(firstID, consumer.KindHandler))
	res := countVerdict(t, r, raced)
	assert.True(t, res.Pass(), "problems: %v", res.Problems)
}

// The verdict fails when a fault of the schedule was not injected.
func TestChaosVerdictFailsOnAFaultNotInjected(t *testing.T) {
	r, dlq := verdictRun(t)
	r.cfg.Kills = 1
	r.scheduled = faultKinds(r.schedule())
	res := countVerdict(t, r, dlq)
	assert.False(t, res.Pass(), "no kill happened")
	assert.Contains(t, strings.Join(res.Problems, "\n"), "kill", "problems: %v", res.Problems)

	r.faults["kill"] = 1
	res = countVerdict(t, r, dlq)
	assert.True(t, res.Pass(), "problems: %v", res.Problems)
}

// faultRun is a chaos run with no member to restart after a fault.
func faultRun(t *testing.T) *chaosRun {
	return &chaosRun{cfg: ChaosConfig{Broker: "kafka"}, rng: rand.New(rand.NewSource(1)), logs: t.TempDir(),
		faults: map[string]int{}, crashes: map[string]int{}, exitedAt: map[int]time.Time{}}
}

// A fault counts as injected only when it hit something: a kill with no
// member running, a kill of a member that had exited on its own, or a cut
// with no connection to cut is not one.
func TestChaosFaultThatHitNothingIsNotCounted(t *testing.T) {
	ctx := context.Background()
	t.Run("a kill with no member running", func(t *testing.T) {
		r := faultRun(t)
		require.NoError(t, r.apply(ctx, "", fault{kind: "kill"}))
		assert.Zero(t, r.faults["kill"])
	})
	t.Run("a kill of a member that had exited", func(t *testing.T) {
		r := faultRun(t)
		m, err := r.launch(r.newMemberID(), exec.Command("sh", "-c", "exit 3"), "")
		require.NoError(t, err)
		<-m.exited
		assert.False(t, m.kill(), "the process had exited with 3")
	})
	t.Run("a kill of a running member", func(t *testing.T) {
		r := faultRun(t)
		_, err := r.launch(r.newMemberID(), exec.Command("sleep", "60"), "")
		require.NoError(t, err)
		require.NoError(t, r.apply(ctx, "", fault{kind: "kill"}))
		assert.Equal(t, 1, r.faults["kill"])
		assert.Empty(t, r.live())
	})
	t.Run("a cut with no connection", func(t *testing.T) {
		r := faultRun(t)
		inner, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		ln := &netcut.Listener{Listener: inner}
		defer ln.Close()
		r.cut = ln.Cut
		require.NoError(t, r.apply(ctx, "", fault{kind: "cut"}))
		assert.Zero(t, r.faults["cut"])
	})
}

// The verdict fails when a member process ended by itself: the driver ends
// members only by SIGKILL, by SIGTERM (exit status 0), or at an armed
// crash point (exit status 86); any other end is a failure the member
// should have ridden out (the consumer retries through a PostgreSQL restart
// or a cut connection), even if the members started after it made up for
// it.
func TestChaosVerdictFailsOnAMemberThatExitedByItself(t *testing.T) {
	t.Run("exit status 1", func(t *testing.T) {
		r, dlq := verdictRun(t)
		m, err := r.launch(r.newMemberID(), exec.Command("sh", "-c", "echo failed >&2; exit 1"), "")
		require.NoError(t, err)
		<-m.exited
		res := countVerdict(t, r, dlq)
		assert.False(t, res.Pass(), "a member exited with status 1")
		assert.Contains(t, strings.Join(res.Problems, "\n"), "exit status 1", "problems: %v", res.Problems)
	})
	t.Run("crash exit status without a crash point", func(t *testing.T) {
		r, dlq := verdictRun(t)
		m, err := r.launch(r.newMemberID(), exec.Command("sh", "-c", "exit 86"), "")
		require.NoError(t, err)
		<-m.exited
		res := countVerdict(t, r, dlq)
		assert.False(t, res.Pass(), "a member exited with status 86, no crash point armed")
	})
	t.Run("ended by the driver", func(t *testing.T) {
		r, dlq := verdictRun(t)
		killed, err := r.launch(r.newMemberID(), exec.Command("sleep", "60"), "")
		require.NoError(t, err)
		require.True(t, killed.kill())
		stopped, err := r.launch(r.newMemberID(), exec.Command("sh", "-c", "trap 'exit 0' TERM; echo ready; while :; do sleep 0.05; done"), "")
		require.NoError(t, err)
		// SIGTERM once the shell has set its trap.
		require.Eventually(t, func() bool {
			out, _ := os.ReadFile(stopped.out)
			return strings.Contains(string(out), "ready")
		}, 10*time.Second, 10*time.Millisecond)
		stopped.stop()
		crashed, err := r.launch(r.newMemberID(), exec.Command("sh", "-c", "exit 86"), "after-commit")
		require.NoError(t, err)
		<-crashed.exited
		res := countVerdict(t, r, dlq)
		assert.True(t, res.Pass(), "problems: %v", res.Problems)
	})
}

// The driver's publish retries through a broker it cannot reach and then
// fails the run with the error.
func TestChaosPublishFailsWhenTheBrokerIsGone(t *testing.T) {
	ctx := context.Background()
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders"))
	require.NoError(t, err)
	o := &options{broker: "kafka", kafkaBrokers: kf.ListenAddrs(), topic: "orders"}
	r := &chaosRun{o: o}
	r.pub, err = newPublisher(ctx, o)
	require.NoError(t, err)
	require.NoError(t, r.publish(ctx, []outMsg{{Key: "o-1", Value: []byte(`{}`), ID: "evt-1", Type: TypeCreated}}))
	kf.Close()
	assert.Error(t, r.publish(ctx, []outMsg{{Key: "o-2", Value: []byte(`{}`), ID: "evt-2", Type: TypeCreated}}))
}

// The duplicates a member reported are its order consumer's: the last
// count of its progress lines or of its "stopped:" line, not the shipping
// consumer's line that follows it.
func TestReportedDuplicatesAreTheOrderConsumers(t *testing.T) {
	for _, tc := range []struct {
		name, log string
		want      uint64
	}{
		{"killed", "10:00:00 member 1: received 50  handled 40  duplicates skipped 7  dead-lettered 3  retries 0  10 msg/s\n", 7},
		{"stopped", "10:00:00 member 1: received 50  handled 40  duplicates skipped 7  dead-lettered 3  retries 0  10 msg/s\n" +
			"stopped: received 60, handled 48, duplicates skipped 9, dead-lettered 3\n" +
			"shipping stopped: received 20, handled 19, duplicates skipped 1, dead-lettered 0\n", 9},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := t.TempDir() + "/member.log"
			require.NoError(t, os.WriteFile(path, []byte(tc.log), 0o644))
			assert.Equal(t, tc.want, reportedDuplicates(path))
		})
	}
}

// A valid event handled and also dead-lettered by a business rule ran its
// handler twice (a copy the claim did not skip): the verdict fails, even
// when the same event also has a dead letter whose cause passes (crash-loop
// or waiting for its order).
func TestChaosVerdictFailsOnAHandledEventDeadLetteredByARule(t *testing.T) {
	for _, tc := range []struct {
		name  string
		other []consumer.ErrorKind
	}{
		{"alone", nil},
		{"beside a crash-loop dead letter", []consumer.ErrorKind{consumer.KindCrashLoop}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, dlq := verdictRun(t)
			id := firstOfKind(t, r, kindEvent, TypePaid)
			for _, k := range tc.other {
				dlq = append(dlq, deadLetterOf(id, k))
			}
			rerun := deadLetterOf(id, consumer.KindHandler)
			rerun.Headers[consumer.HeaderErrorMessage] = ErrAlreadyPaid.Error()
			dlq = append(dlq, rerun)
			res := countVerdict(t, r, dlq)
			assert.False(t, res.Pass(), "%s was handled, then its handler ran again and a rule dead-lettered it", id)
		})
	}
}

// onKafka makes r a run on an embedded Kafka broker holding the
// order.confirmed records the relay would have published: one per outbox
// row, under its id.
func onKafka(t *testing.T, r *chaosRun) {
	t.Helper()
	ctx := context.Background()
	r.o.partitions = 2
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(int32(r.o.partitions), topicsOf(r.o.topic)...))
	require.NoError(t, err)
	t.Cleanup(kf.Close)
	r.cfg.Broker, r.o.broker, r.o.kafkaBrokers = "kafka", "kafka", kf.ListenAddrs()
	rows, err := r.pool.Query(ctx, `SELECT event_id, convert_from(key, 'UTF8'), body FROM outbox`)
	require.NoError(t, err)
	var msgs []outMsg
	for rows.Next() {
		var m outMsg
		require.NoError(t, rows.Scan(&m.ID, &m.Key, &m.Value))
		m.Type = TypeConfirmed
		msgs = append(msgs, m)
	}
	require.NoError(t, rows.Err())
	pub, err := newKafkaPublisher(r.o.kafkaBrokers, confirmedName(r.o))
	require.NoError(t, err)
	defer pub.Close()
	require.NoError(t, pub.Publish(ctx, msgs))
}

// With -offsets-in-database the verdict fails unless the database holds
// the order consumer's position in every partition: without it the
// members did not keep their offsets there, and deleting the group tested
// nothing (they resumed from the topic's beginning, skipping every record
// as a duplicate, and passed all the same).
func TestChaosVerdictFailsWhenOffsetsAreNotInTheDatabase(t *testing.T) {
	r, dlq := verdictRun(t)
	onKafka(t, r)
	r.cfg.OffsetsInDatabase = true
	res := countVerdict(t, r, dlq)
	assert.False(t, res.Pass(), "no offsets in the database")

	for p := range r.o.partitions {
		execSQL(t, r, `INSERT INTO processed_events_offsets (consumer, topic, partition, next_offset) VALUES ($1, $2, $3, 10)`,
			r.o.name, r.o.topic, p)
	}
	res = countVerdict(t, r, dlq)
	assert.True(t, res.Pass(), "problems: %v", res.Problems)
}

// An order can draw two "paid twice" messages; when the first of them won
// the race against the order's payment (RabbitMQ gives no order), the
// verdict passes as for a single rival.
func TestChaosVerdictPassesTheFirstOfTwoSecondPaymentsThatWonItsRace(t *testing.T) {
	r, dlq := verdictRun(t)
	second := firstOfKind(t, r, kindSecondPayment, "")
	var sm outMsg
	for _, m := range r.plan.Messages {
		if m.ID == second {
			sm = m
		}
	}
	var p OrderPaid
	require.NoError(t, json.Unmarshal(sm.Value, &p))
	// A second "paid twice" for the same order, later in the traffic, and
	// dead-lettered as the order was paid.
	third := sm
	third.ID = "evt-third-payment"
	third.Value, _ = json.Marshal(OrderPaid{OrderID: p.OrderID, PaymentID: "pay2b-" + p.OrderID, AmountCents: p.AmountCents})
	r.plan.Messages = append(r.plan.Messages, third)
	r.plan.Sent[kindSecondPayment]++
	r.plan.Violations++
	dlq = append(dlq, deadLetterOf(third.ID, consumer.KindHandler))

	// The first "paid twice" won: it holds the payment, its claim and the
	// second hop; the order's own payment was dead-lettered.
	var firstID string
	require.NoError(t, r.pool.QueryRow(context.Background(), `SELECT event_id FROM payments WHERE order_id = $1`, p.OrderID).Scan(&firstID))
	for _, q := range []string{
		`UPDATE payments SET event_id = $2, payment_id = 'pay2-' || order_id WHERE event_id = $1`,
		`UPDATE processed_events SET event_id = $2 WHERE event_id = $1`,
		`UPDATE processed_events SET event_id = $2 || '/confirmed' WHERE event_id = $1 || '/confirmed'`,
		`UPDATE outbox SET event_id = $2 || '/confirmed' WHERE event_id = $1 || '/confirmed'`,
		`UPDATE shipments SET event_id = $2 || '/confirmed' WHERE event_id = $1 || '/confirmed'`,
	} {
		execSQL(t, r, q, firstID, second)
	}
	var raced []deadLetter
	for _, d := range dlq {
		if d.Headers[consumer.HeaderEventID] != second {
			raced = append(raced, d)
		}
	}
	raced = append(raced, deadLetterOf(firstID, consumer.KindHandler))
	res := countVerdict(t, r, raced)
	assert.True(t, res.Pass(), "problems: %v", res.Problems)
}

// A dead letter whose error the crash guard could not know (the message's
// runs were spent by failures in processes that ended before dead-lettering
// it: a waiting-for-its-order dead letter whose ack a kill took, say) is no
// rule's: its cause may have passed, like a crash loop's, and the event
// handled later (a replay of its first dead letter) is resolved, not run
// twice.
func TestChaosVerdictPassesAHandledEventWithARunsSpentDeadLetter(t *testing.T) {
	for _, tc := range []struct {
		name    string
		waiting bool
	}{{"beside its waiting-for-its-order dead letter", true}, {"alone", false}} {
		t.Run(tc.name, func(t *testing.T) {
			r, dlq := verdictRun(t)
			id := firstOfKind(t, r, kindEvent, TypePaid)
			if tc.waiting {
				w := deadLetterOf(id, consumer.KindHandler)
				w.Headers[consumer.HeaderErrorMessage] = ErrUnknownOrder.Error()
				dlq = append(dlq, w)
			}
			spent := deadLetterOf(id, consumer.KindHandler)
			spent.Headers[consumer.HeaderErrorMessage] = "the handler failed 3 times (Retry.MaxAttempts); the process that ran it last " +
				"ended before dead-lettering it, and the last error is not known"
			dlq = append(dlq, spent)
			res := countVerdict(t, r, dlq)
			assert.True(t, res.Pass(), "%v", res.Problems)
		})
	}
}
