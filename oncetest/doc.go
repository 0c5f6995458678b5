// Package oncetest helps a service test its once handlers against a real
// PostgreSQL, with no sleeps:
//
//   - Postgres gives each test a pool on a schema of its own, on the server
//     at DATABASE_URL or on a throwaway server the package starts once per
//     test binary (from the PostgreSQL binaries of the machine; Debian's
//     postgresql package) and stops when the binary ends.
//   - Drain runs a consumer over a memsource broker until every message
//     published to it is settled, then stops it (DrainWithin: with a bound
//     of the test's own, for tests that run in parallel).
//   - RequireEachOnce checks that a query returns each expected key exactly
//     once: the effect of each event, once.
//
// A handler test in full:
//
//	func TestPaymentIsRecordedOnce(t *testing.T) {
//		pool := oncetest.Postgres(t)
//		_, err := pool.Exec(context.Background(), `CREATE TABLE payments (order_id text, amount int)`)
//		require.NoError(t, err)
//		b := memsource.New(memsource.Options{})
//		for _, id := range []string{"e1", "e1", "e2"} { // e1 delivered twice
//			b.Publish(consumer.Message{ID: id, Value: []byte(`{"order_id":"` + id + `","amount":5}`)})
//		}
//		c, err := consumer.New(pool, b.Source(), handlePayment, consumer.Config{Name: "billing"})
//		require.NoError(t, err)
//		oncetest.Drain(t, c, b)
//		oncetest.RequireEachOnce(t, pool, `SELECT order_id FROM payments`, "e1", "e2")
//	}
package oncetest
