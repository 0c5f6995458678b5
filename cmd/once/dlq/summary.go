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
	// Others is set on the row that counts, together, the records whose
	// consumer and kind a Tally does not keep (its Consumer and Kind are
	// empty): those of the pairs past TallyGroups, or past TallyNameBytes
	// of names.
	Others bool `json:"others,omitempty"`
}

// A Tally keeps at most TallyGroups consumer and kind pairs, whose names
// take at most TallyNameBytes: the headers it counts by are a producer's
// to write, and a dead-letter destination written by others (a name per
// record, or names of megabytes) made a Tally as large as the records
// it counted. The records of any other pair are counted in one row,
// KindCount.Others. The library's consumers write a name per consumer
// and eight kinds.
const (
	TallyGroups    = 1000
	TallyNameBytes = 4 << 20
)

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
// (in Queue.Browse) keeps none of its records, and a bounded count of
// their consumers and kinds (TallyGroups). The zero value is empty.
type Tally struct {
	m      map[tallyKey]*KindCount
	others KindCount
	// names is the bytes of the consumer and kind names kept.
	names int
}

type tallyKey struct{ consumer, kind string }

// Add counts r.
func (t *Tally) Add(r *Record) {
	if t.m == nil {
		t.m = map[tallyKey]*KindCount{}
	}
	k := tallyKey{r.Consumer(), r.Kind()}
	c := t.m[k]
	switch {
	case c != nil:
	case len(t.m) >= TallyGroups || t.names+len(k.consumer)+len(k.kind) > TallyNameBytes:
		c = &t.others
		c.Others = true
	default:
		c = &KindCount{Consumer: k.consumer, Kind: k.kind}
		t.m[k] = c
		t.names += len(k.consumer) + len(k.kind)
	}
	c.Count++
	if r.Replayable(false) == nil {
		c.Replayable++
	}
	if at := r.FailedAt(); at.After(c.Last) {
		c.Last = at
	}
}

// Counts returns the counts so far, sorted by consumer then kind, and
// last the row of the others (KindCount.Others) when there are any.
func (t *Tally) Counts() []KindCount {
	out := make([]KindCount, 0, len(t.m)+1)
	for _, c := range t.m {
		out = append(out, *c)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Consumer != out[j].Consumer {
			return out[i].Consumer < out[j].Consumer
		}
		return out[i].Kind < out[j].Kind
	})
	if t.others.Count > 0 {
		out = append(out, t.others)
	}
	return out
}
