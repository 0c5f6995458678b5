package dedup

import (
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5/pgtype"
)

// A batch claim's array arguments are encoded without an allocation per
// element: the ids (text[]), fingerprints (bytea[]) and offsets (int8[])
// of a batch of 100 cost about what those of a batch of one cost.
func TestClaimArraysEncodeWithoutAnAllocationPerElement(t *testing.T) {
	m := pgtype.NewMap()
	encode := func(n int) float64 {
		claims := make([]Claim, n)
		for i := range claims {
			claims[i] = Claim{Consumer: "c", EventID: "event-" + strconv.Itoa(i), Fingerprint: make([]byte, 32),
				Source: "q", Partition: -1, Offset: -1}
		}
		s := &Store{}
		_, args, err := s.claimBatch(claims)
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 0, 64<<10)
		return testing.AllocsPerRun(20, func() {
			var err error
			for _, a := range []struct {
				oid uint32
				v   any
			}{{pgtype.TextArrayOID, args[1]}, {pgtype.ByteaArrayOID, args[2]}, {pgtype.Int8ArrayOID, args[5]}} {
				if _, err = m.Encode(a.oid, pgtype.BinaryFormatCode, a.v, buf[:0]); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
	one, hundred := encode(1), encode(100)
	if hundred-one > 10 {
		t.Errorf("encoding the arrays of 100 claims allocates %.0f times, of one claim %.0f: an allocation per element", hundred, one)
	}
}
