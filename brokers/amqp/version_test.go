package amqp

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// versionBefore judges only versions it can read: an unknown one is not
// older.
func TestVersionBefore(t *testing.T) {
	for version, want := range map[string]bool{
		"3.7.28": true, "3.8.0": false, "3.10.20": false, "2.8": true, "4.0.5": false, "3": false, "": false, "x.y": false,
	} {
		assert.Equal(t, want, versionBefore(version, 3, 8), version)
	}
}
