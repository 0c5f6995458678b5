package freeport

import (
	"net"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A throwaway server restarted on its port (a Kafka broker or PostgreSQL
// killed by a chaos run) must find the port free again. A port of the
// ephemeral range can meanwhile become the local end of any outgoing
// connection, and the restart then fails with "address already in use";
// ports are taken below that range.
func TestPortsAreFreeAndBelowTheEphemeralRange(t *testing.T) {
	lo, _ := ephemeralRange()
	seen := map[int]bool{}
	for range 50 {
		p, err := Pick()
		require.NoError(t, err)
		assert.GreaterOrEqual(t, p, low)
		assert.Less(t, p, lo, "port %d is in the ephemeral range from %d", p, lo)
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		require.NoError(t, err, "port %d is free", p)
		require.NoError(t, l.Close())
		seen[p] = true
	}
	assert.Greater(t, len(seen), 40, "ports are spread, so that parallel picks rarely meet")
}

func TestEphemeralRangeParsesTheKernelsSetting(t *testing.T) {
	lo, hi := parseRange("32768\t60999\n")
	assert.Equal(t, 32768, lo)
	assert.Equal(t, 60999, hi)
	lo, hi = parseRange("garbage")
	assert.Equal(t, defaultEphemeralLow, lo)
	assert.Equal(t, 65535, hi)
}
