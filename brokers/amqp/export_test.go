package amqp

import "time"

// HeaderStrings exposes the header conversion to the external tests.
var HeaderStrings = headerStrings

// AckStats returns the ack frames sent on the source's current session,
// the acks not sent yet and the spans of tags sent one by one.
func AckStats(s *Source) (frames, unsent, spans int) {
	s.mu.Lock()
	sess := s.sess
	s.mu.Unlock()
	if sess == nil {
		return 0, 0, 0
	}
	return sess.acker.stats()
}

// MergeSpans exposes the span merge to tests, as [lo, hi] pairs.
func MergeSpans(spans [][2]uint64, tags []uint64) [][2]uint64 {
	in := make([]span, len(spans))
	for i, s := range spans {
		in[i] = span{s[0], s[1]}
	}
	var out [][2]uint64
	for _, s := range mergeSpans(in, tags) {
		out = append(out, [2]uint64{s.lo, s.hi})
	}
	return out
}

// Heartbeat returns the heartbeat interval the current session's
// connection negotiated with the broker.
func Heartbeat(s *Source) time.Duration {
	s.mu.Lock()
	sess := s.sess
	s.mu.Unlock()
	if sess == nil {
		return 0
	}
	return sess.conn.Config.Heartbeat
}

// TopicMatch exposes the topic exchange's matching to tests.
var TopicMatch = topicMatch

// CheckDeliveryLimit exposes the x-delivery-limit rule to tests.
var CheckDeliveryLimit = checkDeliveryLimit

// DeliveryLimitRisk exposes the delivery limit that drops messages to
// tests.
var DeliveryLimitRisk = deliveryLimitRisk
