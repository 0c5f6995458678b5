package bench

import "fmt"

// sourceCeilingShare is the share of its broker's consume-and-ack ceiling
// (the ceiling row of the same run) the library's best row must reach.
const sourceCeilingShare = 0.7

// shortTailMs is the produce-to-ack p99 every library row must stay under
// at half its measured rate.
const shortTailMs = 25

// pipelineTargets states the targets of the consumer pipeline against this
// run: on RabbitMQ, the best library row against the broker's own
// consume-and-ack ceiling, and on every broker, each library row's tail at
// half its rate.
func (r *Report) pipelineTargets() []string {
	var out []string
	if best, ceiling := r.BestOnce(RabbitMQ), r.find(RabbitMQ, RowCeiling); best != nil && ceiling != nil && ceiling.Rate > 0 {
		share := best.Rate / ceiling.Rate
		out = append(out, fmt.Sprintf("target RabbitMQ best library row (%s) >= %.0f%% of the consume-and-ack ceiling (%.0f msgs/s): %.0f%%, %s",
			best.Row, 100*sourceCeilingShare, ceiling.Rate, 100*share, verdict(share >= sourceCeilingShare)))
	}
	for _, x := range r.Results {
		if len(x.Row) < 5 || x.Row[:5] != "once " || x.PacedMsgs == 0 {
			continue
		}
		out = append(out, fmt.Sprintf("target %s %s p99 <= %d ms at half its rate (%.0f msgs/s): %.1f ms, %s",
			x.Broker, x.Row, shortTailMs, x.PacedRate, x.P99Ms, verdict(x.P99Ms <= shortTailMs)))
	}
	return out
}

// find returns the result of row on broker b, or nil.
func (r *Report) find(b Broker, row Row) *Result {
	for i := range r.Results {
		if r.Results[i].Broker == b && r.Results[i].Row == row {
			return &r.Results[i]
		}
	}
	return nil
}

func verdict(ok bool) string {
	if ok {
		return "met"
	}
	return "NOT met"
}
