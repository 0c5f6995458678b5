// Package conformance is the test suite every consumer.Source adapter must
// pass, in the spirit of Watermill's shared pub/sub tests. An adapter's test
// implements Broker (publish, open a source, read the dead letters) on a
// real broker, declares its Features, and calls Run with a real PostgreSQL
// database (oncetest.Postgres gives each test a schema of its own):
//
//	func TestConformance(t *testing.T) {
//		conformance.Run(t, conformance.Suite{
//			Features:  conformance.Features{Ordered: true, FallbackID: true, RedeliverOnRestart: true},
//			NewBroker: newTestBroker,
//			NewDB:     func(t *testing.T) *pgxpool.Pool { return oncetest.Postgres(t) },
//		})
//	}
//
// Every test counts business effects (rows written in the handler's
// transaction) against what was published: each event's effect exactly
// once, nothing lost.
package conformance
