// Package kafkaaddr checks Kafka broker addresses before they are dialled.
// sarama takes a broker it cannot dial for one that is down, and every
// client of this module retries a broker that is down: an address that can
// never be dialled would be retried without end.
package kafkaaddr

import (
	"fmt"
	"net"
	"strconv"
	"strings"
)

// Check returns an error naming field[i] (for example
// "kafka: Config.Brokers[1]") for the first address of addrs that is
// empty, not host:port, or whose port is out of range; nil when every one
// can be dialled.
func Check(prefix, field string, addrs []string) error {
	for i, b := range addrs {
		name := fmt.Sprintf("%s: %s[%d]", prefix, field, i)
		if strings.TrimSpace(b) == "" {
			return fmt.Errorf("%s is empty", name)
		}
		_, port, err := net.SplitHostPort(b)
		switch {
		case err != nil:
			return fmt.Errorf("%s %q is not host:port: %w", name, b, err)
		case port == "":
			return fmt.Errorf("%s %q has no port", name, b)
		}
		if n, err := strconv.Atoi(port); err == nil && (n < 1 || n > 65535) {
			return fmt.Errorf("%s %q: port %d out of range", name, b, n)
		}
	}
	return nil
}
