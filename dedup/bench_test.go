package dedup_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"testing"

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

// BenchmarkClaimFingerprint compares claims without and with a SHA-256
// fingerprint of a 1 KiB payload (hashing and storing 32 bytes per id):
// the difference in ns/op, divided by the ids per op, is its cost per
// message.
func BenchmarkClaimFingerprint(b *testing.B) {
	for _, fp := range []bool{false, true} {
		name := "none"
		if fp {
			name = "sha256"
		}
		b.Run("single/"+name, func(b *testing.B) {
			ctx, pool, s := setup(b)
			benchClaim(b, ctx, pool, s, fp)
		})
		b.Run("batch100/"+name, func(b *testing.B) {
			ctx, pool, s := setup(b)
			benchClaimBatch(b, ctx, pool, s, fp)
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
