package bench

import (
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
)

// Workload describes the events every row consumes: Events events, each
// with its own id; every DupEvery-th event is published a second time (a
// redelivered copy), every PoisonEvery-th is a value that does not decode.
type Workload struct {
	// Events is the number of distinct events.
	Events int `json:"events"`
	// DupEvery: event i is published twice when i%DupEvery == 0. 0: never.
	DupEvery int `json:"dup_every"`
	// PoisonEvery: event i is poison when i%PoisonEvery == PoisonEvery-1.
	// 0: never.
	PoisonEvery int `json:"poison_every"`
	// Partitions is the number of Kafka partitions; event i goes to
	// partition i%Partitions, its copy too.
	Partitions int `json:"partitions"`
	// HashIDs puts a hash of the event number before it in the id, so
	// that ids land all over processed_events' primary key, as UUIDs do,
	// instead of after one another.
	HashIDs bool `json:"hash_ids,omitempty"`
}

// dupLag is how many events later the copy of a duplicated event follows
// its original. It is a multiple of every partition count up to 4, so the
// copy lands in the original's partition.
const dupLag = 40

// Msg is one message of the workload.
type Msg struct {
	ID        string
	Partition int32
	Value     []byte
	Poison    bool
}

// Counts is what a workload publishes and what a correct consumer leaves.
type Counts struct {
	// Messages published (copies included).
	Messages int
	// Valid is the number of distinct events that decode: the business
	// rows a correct consumer writes.
	Valid int
	// Poison is the number of messages that do not decode: the dead
	// letters a correct consumer writes.
	Poison int
}

// Add returns the sum of two counts.
func (c Counts) Add(o Counts) Counts {
	return Counts{Messages: c.Messages + o.Messages, Valid: c.Valid + o.Valid, Poison: c.Poison + o.Poison}
}

var pad = strings.Repeat("x", 130)

func (w Workload) isDup(i int) bool { return w.DupEvery > 0 && i%w.DupEvery == 0 }
func (w Workload) isPoison(i int) bool {
	return w.PoisonEvery > 0 && i%w.PoisonEvery == w.PoisonEvery-1
}

func (w Workload) id(prefix string, i int) string {
	if !w.HashIDs {
		return prefix + strconv.Itoa(i)
	}
	h := fnv.New64a()
	h.Write([]byte(prefix))
	h.Write(strconv.AppendInt(nil, int64(i), 10))
	return fmt.Sprintf("%016x-%s%d", h.Sum64(), prefix, i)
}

func (w Workload) msg(prefix string, i int) Msg {
	m := Msg{ID: w.id(prefix, i), Partition: int32(i % max(1, w.Partitions))}
	if w.isPoison(i) {
		m.Poison = true
		m.Value = []byte(`{"n":` + strconv.Itoa(i) + `, not json ` + pad)
		return m
	}
	// ~200 bytes: an amount for an account, padded like a real event.
	m.Value = []byte(`{"n":` + strconv.Itoa(i) + `,"account":"acct-` + strconv.Itoa(i%64) +
		`","amount":` + strconv.Itoa(100+i%9900) + `,"note":"` + pad + `"}`)
	return m
}

// Each calls f for every message of the workload, in publishing order:
// event i, and the copy of event i-dupLag when that one is duplicated;
// the copies still owed come at the end. Ids are prefix followed by the
// event number. f returning false stops the walk.
func (w Workload) Each(prefix string, f func(Msg) bool) {
	for i := 0; i < w.Events; i++ {
		if !f(w.msg(prefix, i)) {
			return
		}
		if j := i - dupLag; j >= 0 && w.isDup(j) {
			if !f(w.msg(prefix, j)) {
				return
			}
		}
	}
	for j := max(0, w.Events-dupLag); j < w.Events; j++ {
		if w.isDup(j) {
			if !f(w.msg(prefix, j)) {
				return
			}
		}
	}
}

// Counts returns what the workload publishes and leaves.
func (w Workload) Counts() Counts {
	var c Counts
	for i := 0; i < w.Events; i++ {
		c.Messages++
		if w.isDup(i) {
			c.Messages++
		}
		if w.isPoison(i) {
			c.Poison++ // every copy of a poison message is dead-lettered
			if w.isDup(i) {
				c.Poison++
			}
		} else {
			c.Valid++
		}
	}
	return c
}
