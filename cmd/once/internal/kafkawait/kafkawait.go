// Package kafkawait bounds how long a sarama client waits on a Kafka
// broker. sarama's defaults (30 s for the dial and for each request,
// metadata asked four times) make a broker that accepts connections and
// never answers (a port that is not Kafka's, a hung broker, a firewall)
// hold a caller for minutes; the once command, and packages dlq and
// inspect when they are given no configuration, wait Default instead.
package kafkawait

import (
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/IBM/sarama"
)

// Default is the bound of the dial and of each request: 8 s.
const Default = 8 * time.Second

// Bound makes the dial and each request of sc wait at most t, and
// metadata be asked twice at most (within 2t each): a broker that never
// answers then fails a caller within about three times t, and a few
// seconds. A produce may wait for its replicas t/2, so that the broker's
// answer comes within the client's wait.
func Bound(sc *sarama.Config, t time.Duration) {
	sc.Net.DialTimeout, sc.Net.ReadTimeout, sc.Net.WriteTimeout = t, t, t
	sc.Metadata.Retry.Max = 1
	sc.Metadata.Timeout = 2 * t
	sc.Producer.Timeout = t / 2
}

// NewConfig returns sarama.NewConfig() with Version 2.8 and Bound by
// Default: the configuration of a caller that gave none.
func NewConfig() *sarama.Config {
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_8_0_0
	Bound(sc, Default)
	return sc
}

// Explain returns err saying that a broker did not answer within t, where
// the configuration that bounded its requests is named by what, when err
// is a dial or a read that timed out; any other err as it is.
func Explain(err error, t time.Duration, what string) error {
	if err == nil || !errors.Is(err, os.ErrDeadlineExceeded) {
		return err
	}
	return fmt.Errorf("%w (a Kafka broker did not answer within %v, the bound of each request when %s)", err, t, what)
}
