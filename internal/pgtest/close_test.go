package pgtest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// errorRecorder is a testing.TB whose Errorf is recorded, not reported.
type errorRecorder struct {
	testing.TB
	errors []string
}

func (r *errorRecorder) Errorf(format string, args ...any) {
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}

// TestClosePoolDoesNotWaitForeverForALeakedConnection: a connection that a
// test never released is reported instead of hanging the test binary.
func TestClosePoolDoesNotWaitForeverForALeakedConnection(t *testing.T) {
	pool := NewPool(t, "public")
	conn, err := pool.Acquire(context.Background())
	require.NoError(t, err)
	defer conn.Release()

	rec := &errorRecorder{TB: t}
	start := time.Now()
	closePool(rec, pool, 200*time.Millisecond)
	assert.Less(t, time.Since(start), 5*time.Second)
	require.Len(t, rec.errors, 1)
	assert.Contains(t, rec.errors[0], "never released")

	released := NewPool(t, "public")
	rec = &errorRecorder{TB: t}
	closePool(rec, released, time.Minute)
	assert.Empty(t, rec.errors, "a pool whose connections are all released closes at once")
}
