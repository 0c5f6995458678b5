package consumer

import (
	"context"

	"fmt"
	"github.com/jackc/pgx/v5"
	"testing"
)

// BenchmarkPrepare measures the per-message work before the database: id
// derivation, JSON decoding into a struct, and the payload fingerprint.
func BenchmarkPrepare(b *testing.B) {
	for _, fp := range []bool{false, true} {
		b.Run(fmt.Sprintf("fingerprint=%v", fp), func(b *testing.B) {
			cfg, err := Config{Name: "bench", NoFingerprint: !fp}.withDefaults()
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
				if cfg.Fingerprint != nil {
					_ = cfg.Fingerprint(m)
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
