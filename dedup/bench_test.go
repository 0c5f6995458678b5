package dedup_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/dedup"
)

// benchPayload is a typical event body whose SHA-256 is the fingerprint.
var benchPayload = make([]byte, 1024)

func reportIDs(b *testing.B, ids int) {
	b.ReportMetric(float64(ids)/b.Elapsed().Seconds(), "ids/s")
}

// benchClaim claims one new id per op and commits it.
func benchClaim(b *testing.B, ctx context.Context, pool *pgxpool.Pool, s *dedup.Store, fingerprint bool) {
	n := 0
	for b.Loop() {
		c := dedup.Claim{Consumer: "bench", EventID: fmt.Sprintf("evt-%d", n), Source: "topic", Partition: 1, Offset: int64(n)}
		if fingerprint {
			sum := sha256.Sum256(benchPayload)
			c.Fingerprint = sum[:]
		}
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			r, err := s.Claim(ctx, tx, c)
			if err == nil && r.Outcome != dedup.Claimed {
				err = fmt.Errorf("%s: %v", c.EventID, r.Outcome)
			}
			return err
		})
		if err != nil {
			b.Fatal(err)
		}
		n++
	}
	reportIDs(b, n)
}

// benchClaimBatch claims 100 new ids per op in one transaction.
func benchClaimBatch(b *testing.B, ctx context.Context, pool *pgxpool.Pool, s *dedup.Store, fingerprint bool) {
	const size = 100
	claims := make([]dedup.Claim, size)
	n := 0
	for b.Loop() {
		for i := range claims {
			claims[i] = dedup.Claim{Consumer: "bench", EventID: fmt.Sprintf("evt-%d", n), Source: "topic", Partition: 1, Offset: int64(n)}
			if fingerprint {
				sum := sha256.Sum256(benchPayload)
				claims[i].Fingerprint = sum[:]
			}
			n++
		}
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			rs, err := s.ClaimBatch(ctx, tx, claims)
			if err == nil && rs[size-1].Outcome != dedup.Claimed {
				err = fmt.Errorf("%v", rs[size-1].Outcome)
			}
			return err
		})
		if err != nil {
			b.Fatal(err)
		}
	}
	reportIDs(b, n)
}

func BenchmarkClaim(b *testing.B) {
	ctx, pool, s := setup(b)
	benchClaim(b, ctx, pool, s, false)
}

func BenchmarkClaimBatch100(b *testing.B) {
	ctx, pool, s := setup(b)
	benchClaimBatch(b, ctx, pool, s, false)
}

// BenchmarkClaimFingerprint measures the cost of a fingerprint per message:
// a SHA-256 of a 1 KiB payload, hashed and stored (32 bytes) with each id.
// Each op claims one unit (a single id, or a batch of 100) without and one
// with fingerprints, alternating which goes first, into the same table, so
// that load on the machine weighs on both alike; it reports ns/id for each
// and their difference, fp-ns/id.
func BenchmarkClaimFingerprint(b *testing.B) {
	for _, size := range []int{1, 100} {
		name := "single"
		if size > 1 {
			name = fmt.Sprintf("batch%d", size)
		}
		b.Run(name, func(b *testing.B) {
			ctx, pool, s := setup(b)
			var spent [2]time.Duration // without, with
			n, op := 0, 0
			claims := make([]dedup.Claim, size)
			for b.Loop() {
				op++
				for k := range 2 {
					fp := (op+k)%2 == 1
					for i := range claims {
						claims[i] = dedup.Claim{Consumer: "bench", EventID: fmt.Sprintf("evt-%d", n), Source: "topic", Partition: 1, Offset: int64(n)}
						n++
					}
					start := time.Now()
					err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
						if fp {
							for i := range claims {
								sum := sha256.Sum256(benchPayload)
								claims[i].Fingerprint = sum[:]
							}
						}
						var err error
						if size == 1 {
							_, err = s.Claim(ctx, tx, claims[0])
						} else {
							_, err = s.ClaimBatch(ctx, tx, claims)
						}
						return err
					})
					if err != nil {
						b.Fatal(err)
					}
					if fp {
						spent[1] += time.Since(start)
					} else {
						spent[0] += time.Since(start)
					}
				}
			}
			perID := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / float64(n/2) }
			b.ReportMetric(perID(spent[0]), "none-ns/id")
			b.ReportMetric(perID(spent[1]), "sha256-ns/id")
			b.ReportMetric(perID(spent[1]-spent[0]), "fp-ns/id")
			reportIDs(b, n)
		})
	}
}

// BenchmarkSHA256 is the hashing part of the fingerprint's cost alone.
func BenchmarkSHA256(b *testing.B) {
	b.SetBytes(int64(len(benchPayload)))
	for b.Loop() {
		sha256.Sum256(benchPayload)
	}
}
