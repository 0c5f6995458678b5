package consumer

// BeginStopping begins c's shutdown as a cancelled Run context would, at
// once: tests use it to stop a consumer at an exact point of a handler.
func BeginStopping[T any](c *Consumer[T]) { c.p.stop() }

// Stopping reports whether c's shutdown has begun.
func Stopping[T any](c *Consumer[T]) bool { return c.p.stopping.Load() }

// SlotWaiters is how many of c's workers wait for a transaction slot
// (Config.Concurrency).
func SlotWaiters[T any](c *Consumer[T]) int32 { return c.p.slotWaiters.Load() }

// UnorderedRunning is how many unordered batches c's batcher counts as
// running a transaction.
func UnorderedRunning[T any](c *Consumer[T]) int32 { return c.p.unorderedRunning.Load() }
