package freeport

import (
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
)

// low is the lowest port Pick returns: above the well-known and most
// registered services' ports.
const low = 20000

// defaultEphemeralLow is Linux's default start of the ephemeral range,
// used where the kernel's setting cannot be read.
const defaultEphemeralLow = 32768

// Pick returns a random loopback port below the ephemeral range that
// nothing listens on now. It falls back to a port the kernel chooses when
// none of its tries is free.
func Pick() (int, error) {
	hi, _ := ephemeralRange()
	if hi > low+1 {
		for range 100 {
			p := low + rand.IntN(hi-low)
			if l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p)); err == nil {
				_ = l.Close()
				return p, nil
			}
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// ephemeralRange returns the kernel's ephemeral port range.
func ephemeralRange() (lo, hi int) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return defaultEphemeralLow, 65535
	}
	return parseRange(string(b))
}

func parseRange(s string) (lo, hi int) {
	f := strings.Fields(s)
	if len(f) == 2 {
		a, errA := strconv.Atoi(f[0])
		b, errB := strconv.Atoi(f[1])
		if errA == nil && errB == nil && a > 0 && a <= b {
			return a, b
		}
	}
	return defaultEphemeralLow, 65535
}
