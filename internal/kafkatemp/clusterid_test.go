package kafkatemp

import (
	"encoding/base64"
	"testing"
)

// A cluster id never starts with "-", which the storage tool's parser
// would take for an option: about one random id in 64 once did, and the
// broker then failed to start.
func TestClusterIDIsNeverAnOption(t *testing.T) {
	for range 5000 {
		id := newClusterID()
		if id[0] == '-' {
			t.Fatalf("cluster id %q starts with '-'", id)
		}
		if b, err := base64.RawURLEncoding.DecodeString(id); err != nil || len(b) != 16 {
			t.Fatalf("cluster id %q is not 16 bytes of URL-safe base64: %v", id, err)
		}
	}
}
