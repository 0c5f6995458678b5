package consumer

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// BenchmarkPrepare measures the per-message work before the database: id
// derivation, JSON decoding into a struct, and the payload fingerprint.
func BenchmarkPrepare(b *testing.B) {
	for _, fp := range []bool{false, true} {
		b.Run(fmt.Sprintf("fingerprint=%v", fp), func(b *testing.B) {
			cfg := Config{Name: "bench"}
			if !fp {
				cfg.Identify.Fingerprint = NoFingerprint
			}
			cfg, err := cfg.withDefaults()
			if err != nil {
				b.Fatal(err)
			}
			type payload struct {
				Order  string `json:"order"`
				Amount int64  `json:"amount"`
				Pad    string `json:"pad"`
			}
			m := &Message{
				Value:   []byte(`{"order":"o-12345","amount":4200,"pad":"` + string(make200()) + `"}`),
				Headers: map[string]string{"id": "evt-0001", "type": "order.paid"},
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				idt, _, err := cfg.identify(m)
				if err != nil {
					b.Fatal(err)
				}
				if _, _, err := bind(func(context.Context, pgx.Tx, Event[payload]) error { return nil }, m, idt, cfg.Decoder); err != nil {
					b.Fatal(err)
				}
				if cfg.Identify.Fingerprint != nil {
					_ = cfg.Identify.Fingerprint(m)
				}
			}
		})
	}
}

func make200() []byte {
	b := make([]byte, 140)
	for i := range b {
		b[i] = 'x'
	}
	return b
}

// BenchmarkTelemetry measures a message's span and outcome metric with the
// default (no-op) providers: the cost every message pays when
// OpenTelemetry is not configured.
func BenchmarkTelemetry(b *testing.B) {
	cfg, err := Config{Name: "bench"}.withDefaults()
	if err != nil {
		b.Fatal(err)
	}
	tel, err := newTelemetry(&cfg, "kafka", "orders-group")
	if err != nil {
		b.Fatal(err)
	}
	m := &Message{Topic: "orders", Partition: 3, Offset: 123456, Headers: map[string]string{"id": "evt-0001"}}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		start := time.Now()
		tel.received(ctx, m)
		c, span := tel.startSpan(ctx, nil, m)
		tel.outcome(c, span, "handled")
		tel.processed(c, m, start, "")
		span.End()
	}
}

// A message decoded for its handler is one allocation (with a payload the
// decoder does not allocate for, []byte): not a closure beside an escaped
// payload, and for a BatchHandler not an event beside those.
func TestPreparingAMessageForItsHandlerIsOneAllocation(t *testing.T) {
	m := &Message{Value: []byte("payload")}
	idt := identity{id: "e1", typ: "t", payload: m.Value}
	h := func(context.Context, pgx.Tx, Event[[]byte]) error { return nil }
	bh := func(context.Context, pgx.Tx, []Event[[]byte]) error { return nil }
	var sink prepared
	single := testing.AllocsPerRun(100, func() {
		c, _, err := bind(h, m, idt, JSON)
		if err != nil {
			t.Fatal(err)
		}
		sink = prepared{call: c}
	})
	prepBatch := batchPreparer(BatchHandler[[]byte](bh))
	batch := testing.AllocsPerRun(100, func() {
		p, _, err := prepBatch(m, idt, JSON)
		if err != nil {
			t.Fatal(err)
		}
		sink = p
	})
	_ = sink
	if batch > 1 {
		t.Errorf("preparing for a BatchHandler allocates %.0f times a message, want 1", batch)
	}
	if single > 1 {
		t.Errorf("bind allocates %.0f times a message, want 1", single)
	}
}
