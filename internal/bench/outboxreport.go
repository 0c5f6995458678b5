package bench

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// writeOutboxTable writes the outbox rows, if any: each broker's
// confirmed-publish ceiling and relay side by side, and the latency.
func writeOutboxTable(w io.Writer, rows []OutboxResult) error {
	if len(rows) == 0 {
		return nil
	}
	fmt.Fprintf(w, "\noutbox: %d rows in %d rounds: the ceiling, then rows written beforehand published and deleted by one relay (default RelayConfig,\n",
		rows[0].Rows, rows[0].Rounds)
	fmt.Fprintf(w, "batches of %d), then the ceiling again, and so on; x ceiling: the median over the rounds of the relay over the higher ceiling beside it;\n", rows[0].BatchSize)
	fmt.Fprintln(w, "ceiling: the same messages straight to the broker in batches of that size, confirmed (Kafka: sarama idempotent, acks=all; RabbitMQ: amqp091 confirms);")
	fmt.Fprintln(w, "msgs/s: medians")
	fmt.Fprintln(w, "latency: writer's commit to the downstream consumer's commit (a consumer of this library), and to the broker's confirm of the relay's publish;")
	fmt.Fprintln(w, "rows written at half the relay's rate (at most -pace-max) by 4 writers, after one warm-up row through both hops; the first sixth excluded")
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 1, ' ', tabwriter.AlignRight|tabwriter.Debug)
	fmt.Fprintln(tw, "broker\t ceiling msgs/s\t relay msgs/s\t x ceiling\t p50 ms\t p99 ms\t p50 to confirm ms\t p99 to confirm ms\t at rows/s\t correct\t")
	fmt.Fprintln(tw, "---\t ---\t ---\t ---\t ---\t ---\t ---\t ---\t ---\t ---\t")
	for _, x := range rows {
		verdict, check := "yes", x.Check
		if !x.Correct {
			verdict = "NO"
		}
		if x.Error != "" {
			verdict, check = "FAILED", strings.TrimPrefix(check+"; "+x.Error, "; ")
		}
		// No paced phase (-pace 0): no latency, "-" rather than 0.0 ms.
		paced := func(v float64, format string) string {
			if x.PacedMsgs == 0 {
				return "-"
			}
			return fmt.Sprintf(format, v)
		}
		fmt.Fprintf(tw, "%s\t %s\t %s\t %s\t %s\t %s\t %s\t %s\t %s\t %s (%s)\t\n",
			x.Broker, orDash(x.CeilingRate, "%.0f"), orDash(x.RelayRate, "%.0f"), orDash(x.VsCeiling, "%.2f"), paced(x.P50Ms, "%.1f"), paced(x.P99Ms, "%.1f"),
			paced(x.ConfirmP50Ms, "%.1f"), paced(x.ConfirmP99Ms, "%.1f"), paced(x.PacedRate, "%.0f"), verdict, check)
	}
	return tw.Flush()
}

// outboxTargets states the outbox target: the relay at least half of the
// broker's confirmed-publish ceiling.
func outboxTargets(rows []OutboxResult) []string {
	var out []string
	for _, x := range rows {
		t := target{fmt.Sprintf("target %s outbox relay >= 50%% of the broker's confirmed-publish ceiling", x.Broker),
			ratioValue(100*x.VsCeiling, "%.0f%%"), x.VsCeiling >= 0.5, 1}
		if x.Error != "" {
			t.value += " (row failed)"
			t.met = false
		} else {
			t = t.of(x.Correct)
		}
		out = append(out, t.String())
	}
	return out
}
