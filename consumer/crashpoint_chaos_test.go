//go:build chaos

package consumer_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// Each crash point kills the consumer process (exit status 86) at the step
// it names; a restarted consumer then ends with every effect exactly once.
func TestCrashPoints(t *testing.T) {
	for _, point := range consumer.CrashPoints {
		if point == "after-dead-letter" {
			continue // the table-backed test queue has no dead-letter destination
		}
		t.Run(point, func(t *testing.T) {
			pool, schema := pgtest.Schema(t)
			ctx := context.Background()
			_, err := pool.Exec(ctx, `CREATE TABLE queue (pos bigserial PRIMARY KEY, id text, value bytea, acked bool NOT NULL DEFAULT false);
				CREATE TABLE effects (event_id text NOT NULL, n int NOT NULL, seq bigserial)`)
			require.NoError(t, err)
			const total = 400
			for i := 0; i < total; i++ {
				_, err := pool.Exec(ctx, `INSERT INTO queue (id, value) VALUES ($1, $2)`, fmt.Sprintf("e%d", i), fmt.Sprintf(`{"n":%d}`, i))
				require.NoError(t, err)
			}
			cmd := exec.Command(os.Args[0], "-test.run=^TestCrashChild$", "-test.count=1")
			cmd.Env = append(os.Environ(), "ONCE_CRASH_CHILD=1", "ONCE_CRASH_AT=0", "ONCE_CRASH_POINT="+point+":3",
				"ONCE_CRASH_SCHEMA="+schema, "DATABASE_URL="+pgtest.URL())
			out, err := cmd.CombinedOutput()
			var exit *exec.ExitError
			require.ErrorAs(t, err, &exit, "%s", out)
			require.Equal(t, 86, exit.ExitCode(), "%s", out)
			assert.True(t, strings.Contains(string(out), "chaos crash at "+point), "%s", out)

			c, err := consumer.New(pool, &tableSource{pool: pool, ctx: ctx}, crashHandler, fastConfig("crash"))
			require.NoError(t, err)
			stop := start(t, c)
			require.Eventually(t, func() bool {
				var n int
				_ = pool.QueryRow(ctx, `SELECT count(*) FROM queue WHERE NOT acked`).Scan(&n)
				return n == 0
			}, 60*time.Second, 10*time.Millisecond)
			require.NoError(t, stop())
			got := countEffects(t, pool)
			require.Len(t, got, total)
			for id, n := range got {
				require.Equal(t, 1, n, "double effect for %s", id)
			}
		})
	}
}
