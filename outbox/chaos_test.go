package outbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/outbox"
)

// Two relay processes run on one outbox while writers add rows and a
// consumer of this library reads the destination; one relay process or the
// other is SIGKILLed at random moments (before, during or after a publish,
// between the broker's confirm and the delete) and started again. At the
// end every row written has exactly one effect downstream, and on Kafka the
// first copies of each key's messages are in the order written.
func TestRelaysKilledAtRandom(t *testing.T) {
	forEachBroker(t, func(t *testing.T, b broker) {
		seed := time.Now().UnixNano()
		rng := rand.New(rand.NewPCG(uint64(seed), 0))
		t.Logf("seed %d", seed)
		pool, schema := migrated(t)
		d := b.destination(t)
		ctx := context.Background()
		_, err := pool.Exec(ctx, `CREATE TABLE effects (event_id text NOT NULL, body text NOT NULL)`)
		require.NoError(t, err)
		effect := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[[]byte]) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1, $2)`, ev.ID, string(ev.Payload))
			return err
		}
		c, err := consumer.New(pool, d.source(t, "downstream"), effect, consumer.Config{Name: "downstream", Logger: testLogger()})
		require.NoError(t, err)
		run(t, c.Run)

		relays := [2]*exec.Cmd{}
		start := func(i int) {
			relays[i] = childCommand(context.Background(), b, schema, "run")
			require.NoError(t, relays[i].Start())
		}
		kill := func(i int) {
			_ = relays[i].Process.Signal(syscall.SIGKILL)
			_ = relays[i].Wait()
		}
		start(0)
		start(1)
		t.Cleanup(func() { kill(0); kill(1) })

		// Writers write until the last kill; then one relay is left to
		// finish.
		const writers, perTx, kills = 4, 5, 12
		var stopWriting atomic.Bool
		var written atomic.Int64
		var wg sync.WaitGroup
		for w := range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				next := map[string]int{}
				for !stopWriting.Load() {
					var msgs []outbox.Message
					for j := range perTx {
						key := fmt.Sprintf("w%d-k%d", w, j%3)
						msgs = append(msgs, d.msg(key, fmt.Sprintf("%s/%d", key, next[key])))
						next[key]++
					}
					addCommitted(t, pool, msgs...)
					written.Add(perTx)
					time.Sleep(5 * time.Millisecond) // spreads the writes over the kills
				}
			}()
		}
		for range kills {
			time.Sleep(time.Duration(50+rng.IntN(250)) * time.Millisecond) // the chaos schedule, not a wait for a result
			i := rng.IntN(2)
			kill(i)
			start(i)
		}
		stopWriting.Store(true)
		wg.Wait()
		total := int(written.Load())
		waitRows(t, pool, "true", 0, 60*time.Second)
		require.Eventually(t, func() bool {
			var n int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(DISTINCT event_id) FROM effects`).Scan(&n))
			return n == total
		}, 60*time.Second, 10*time.Millisecond, "every row reaches the consumer")
		var effects int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effects`).Scan(&effects))
		assert.Equal(t, total, effects, "one effect per row")
		st := c.Stats()
		t.Logf("%d rows, %d relay kills; downstream: %d handled, %d duplicates skipped", total, kills, st.Handled, st.Duplicates)

		kd, ok := d.(*kafkaDest)
		if !ok {
			return // RabbitMQ: the consumer took the messages; order is not its promise there
		}
		next := map[string]int{}
		for _, m := range firstCopies(kd.read(t, total)) {
			key, n, _ := strings.Cut(m.Body, "/")
			require.Equal(t, strconv.Itoa(next[key]), n, "key %s: first copies in the order written", key)
			next[key]++
		}
	})
}
