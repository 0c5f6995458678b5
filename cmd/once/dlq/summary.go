package dlq

import (
	"sort"
	"time"
)

// KindCount counts the dead letters of one consumer and kind.
type KindCount struct {
	Consumer string `json:"consumer"`
	Kind     string `json:"kind"`
	Count    int    `json:"count"`
	// Replayable counts those a redrive would publish (Record.Replayable).
	Replayable int `json:"replayable"`
	// Last is the latest dead-lettering time among them.
	Last time.Time `json:"last,omitzero"`
}

// Summarize counts recs by consumer and kind, sorted by consumer then
// kind.
func Summarize(recs []*Record) []KindCount {
	type key struct{ consumer, kind string }
	m := map[key]*KindCount{}
	for _, r := range recs {
		k := key{r.Consumer(), r.Kind()}
		c := m[k]
		if c == nil {
			c = &KindCount{Consumer: k.consumer, Kind: k.kind}
			m[k] = c
		}
		c.Count++
		if r.Replayable(false) == nil {
			c.Replayable++
		}
		if at := r.FailedAt(); at.After(c.Last) {
			c.Last = at
		}
	}
	out := make([]KindCount, 0, len(m))
	for _, c := range m {
		out = append(out, *c)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Consumer != out[j].Consumer {
			return out[i].Consumer < out[j].Consumer
		}
		return out[i].Kind < out[j].Kind
	})
	return out
}
