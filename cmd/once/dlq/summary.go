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
	var t Tally
	for _, r := range recs {
		t.Add(r)
	}
	return t.Counts()
}

// Tally is Summarize one record at a time, so that counting a large queue
// (in Queue.Browse) keeps none of its records. The zero value is empty.
type Tally struct {
	m map[tallyKey]*KindCount
}

type tallyKey struct{ consumer, kind string }

// Add counts r.
func (t *Tally) Add(r *Record) {
	if t.m == nil {
		t.m = map[tallyKey]*KindCount{}
	}
	k := tallyKey{r.Consumer(), r.Kind()}
	c := t.m[k]
	if c == nil {
		c = &KindCount{Consumer: k.consumer, Kind: k.kind}
		t.m[k] = c
	}
	c.Count++
	if r.Replayable(false) == nil {
		c.Replayable++
	}
	if at := r.FailedAt(); at.After(c.Last) {
		c.Last = at
	}
}

// Counts returns the counts so far, sorted by consumer then kind.
func (t *Tally) Counts() []KindCount {
	out := make([]KindCount, 0, len(t.m))
	for _, c := range t.m {
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
