package amqp

// HeaderStrings exposes the header conversion to the external tests.
var HeaderStrings = headerStrings

// AckStats returns the ack frames sent on the source's current session
// and the acks not sent yet.
func AckStats(s *Source) (frames, unsent int) {
	s.mu.Lock()
	sess := s.sess
	s.mu.Unlock()
	if sess == nil {
		return 0, 0
	}
	return sess.acker.stats()
}
