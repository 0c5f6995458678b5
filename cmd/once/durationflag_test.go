package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

// A duration flag given in a form Go does not read (30d, a bare number)
// was refused with flag's "parse error" alone: nothing said what a
// duration looks like, nor that a day is not a unit. The error says so.
func TestBadDurationFlagSaysWhatADurationIs(t *testing.T) {
	for _, args := range [][]string{
		{"retention", "-consumer", "billing", "-older-than", "30d"},
		{"status", "-suspect-age", "5min"},
		{"dlq", "replay", "-all", "-dlq", "orders.dlq", "-amqp", "amqp://127.0.0.1:1/", "-max-hold", "10"},
		{"dlq", "list", "-dlq", "orders.dlq", "-kafka", "127.0.0.1:1", "-kafka-timeout", "8"},
	} {
		code, _, errOut := cli(t, nil, args...)
		assert.Equal(t, exitUsage, code, "%v: %s", args, errOut)
		assert.Contains(t, errOut, "want a duration such as 90s, 30m or 720h", args)
		assert.Contains(t, errOut, "a day is 24h", args)
		assert.Equal(t, 1, strings.Count(errOut, "invalid value"), args)
	}
	// Other bad values are not called durations.
	code, _, errOut := cli(t, nil, "dlq", "list", "-dlq", "orders.dlq", "-limit", "ten")
	assert.Equal(t, exitUsage, code, errOut)
	assert.NotContains(t, errOut, "duration")
}
