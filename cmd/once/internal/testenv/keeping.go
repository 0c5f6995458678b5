package testenv

import (
	"context"
	"runtime"
	"sync/atomic"
	"weak"

	"github.com/onceco/once/cmd/once/dlq"
)

// KeepingQueue counts, at the end of each read of the queue, the records
// of that read something still holds (in Kept), for tests of what a
// command or a page keeps in memory.
type KeepingQueue struct {
	dlq.Queue
	Kept *atomic.Int64
}

// Browse reads the queue, then collects garbage and counts the records of
// the read still reachable.
func (q KeepingQueue) Browse(ctx context.Context, fn func(*dlq.Record) error) error {
	var read []weak.Pointer[dlq.Record]
	err := q.Queue.Browse(ctx, func(r *dlq.Record) error {
		read = append(read, weak.Make(r))
		return fn(r)
	})
	runtime.GC()
	n := 0
	for _, w := range read {
		if w.Value() != nil {
			n++
		}
	}
	q.Kept.Store(int64(n))
	return err
}
