package consumer

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A handler call the watchdog chose to ask after while its transaction was
// younger than the shorter of idle_in_transaction_session_timeout and
// transaction_timeout (sessionEnd), whose answer came once the
// transaction had reached it, may have lost its server process to the
// server itself: the handler idled past the setting, its own failure,
// which the next statement reports. It was cut as stranded and retried as
// infrastructure, uncharged (seen in TestHandlerIdlePastIdleInTransaction
// TimeoutIsChargedNotStranded when the server's end fell between the
// choice and the answer). A call whose transaction is still younger at
// the answer is cut.
func TestCallWhoseSessionTheServerMayHaveEndedMeanwhileIsNotCutAsStranded(t *testing.T) {
	const sessionEnd = 250 * time.Millisecond
	for _, tc := range []struct {
		name    string
		answer  time.Duration // after the transaction began
		wantCut bool
	}{
		{"answered once the transaction reached sessionEnd", sessionEnd, false},
		{"answered before", sessionEnd - time.Millisecond, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var w watchdog
			txBegan := time.Now().Add(-sessionEnd / 2)
			var c userCall
			cut := false
			w.beginHandler(&c, "handler", nil, "e2", 1, 0, 42, func() { cut = true }, txBegan)
			defer w.end(&c)
			probes := w.callsToAsk(time.Now(), 0, sessionEnd)
			require.Len(t, probes, 1, "the call is asked after")
			w.cutStranded(probes, map[uint32]bool{}, txBegan.Add(tc.answer), sessionEnd)
			assert.Equal(t, tc.wantCut, cut)
			assert.Equal(t, tc.wantCut, w.wasStranded(&c))
		})
	}
}
