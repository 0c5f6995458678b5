package main

import (
	"encoding/json"
	"fmt"
	"math/rand"
	"sort"
)

// Mix says what the traffic generator produces.
type Mix struct {
	// Orders is how many orders are created. Of them, about 65% are then
	// paid, 15% cancelled, and the rest stay created.
	Orders int
	// Duplicates is the share of valid events published a second time with
	// the same id (a producer retry, a replay).
	Duplicates float64
	// IDless is the share of valid events published without an id header
	// and then published again, also without one. The service derives their
	// id from the payload (see EventID), so the copy is still a duplicate.
	IDless float64
	// Malformed is the share, relative to Orders, of messages that are not
	// valid JSON: dead-lettered with kind decode.
	Malformed float64
	// Violations is the share, relative to Orders, of events that break a
	// business rule (a payment for an order never created, a cancellation
	// of a paid order, a second payment, a payment of the wrong amount):
	// dead-lettered with kind handler.
	Violations float64
	// Seed makes the traffic reproducible.
	Seed int64
	// Unordered says that the broker gives no order (RabbitMQ, whose
	// deliveries are handled concurrently and whose redeliveries after a
	// crash come back out of place). The violations are then only those
	// whose outcome does not depend on order: a cancellation racing a
	// payment is won by whichever commits first, so "cancelled after paid"
	// is replaced by a payment of the wrong amount.
	Unordered bool
}

// The kinds of message the generator sends, as the report counts them.
const (
	kindEvent         = "events"                // valid events with an id header
	kindIDless        = "events without id"     // valid events without one (first copy)
	kindDuplicate     = "exact duplicates"      // same id, same payload, new message
	kindIDlessDup     = "id-less duplicates"    // the second copy of an id-less event
	kindMalformed     = "malformed"             // not JSON
	kindOrphanPayment = "paid, never created"   // rule violation
	kindCancelPaid    = "cancelled after paid"  // rule violation
	kindSecondPayment = "paid twice"            // rule violation
	kindWrongAmount   = "paid the wrong amount" // rule violation
)

// kindOrder is the order of kinds in the report.
var kindOrder = []string{kindEvent, kindIDless, kindDuplicate, kindIDlessDup, kindMalformed,
	kindOrphanPayment, kindCancelPaid, kindSecondPayment, kindWrongAmount}

// outMsg is one message to publish.
type outMsg struct {
	Key   string
	Value []byte
	// ID is the "id" header (the AMQP message-id); empty: none.
	ID string
	// Type is the "type" header (the AMQP type).
	Type string
	Kind string

	at int // position on the generator's timeline
}

// expectedOrder is what the orders table must hold for one order.
type expectedOrder struct {
	Status      string
	AmountCents int64
	Paid        bool
}

// Plan is a generated stream of messages and the database state it must
// produce.
type Plan struct {
	// Messages are the messages to publish, in order.
	Messages []outMsg
	// Sent counts the messages by kind.
	Sent map[string]int
	// Orders is the expected orders table.
	Orders map[string]expectedOrder
	// LedgerSum is the expected sum of payments.amount_cents; LedgerRows the
	// expected number of payments.
	LedgerSum  int64
	LedgerRows int
	// Malformed and Violations are the messages that must end in the
	// dead-letter queue with kinds decode and handler.
	Malformed, Violations int
}

// causalGap is the least distance, in messages, between an event and an
// event of the same order that depends on it (created, then paid or
// cancelled; paid, then a violation). On Kafka the order's key keeps them in
// order anyway; RabbitMQ hands deliveries to concurrent workers, from a
// prefetch window of 64, and this gap keeps two dependent events out of the
// same window, as for real orders whose payment comes seconds after their
// creation. (Closer together, a payment can reach the handler before its
// order commits: it is retried, see Orders.UnknownOrderWait, and a
// cancellation of a paid order handled before the payment would cancel the
// order instead, which this traffic's expectations do not model.)
const causalGap = 300

// Generate builds the traffic of m. The events of one order keep their
// order (they share a Kafka key); the orders interleave.
func Generate(m Mix) *Plan {
	rng := rand.New(rand.NewSource(m.Seed))
	p := &Plan{Sent: map[string]int{}, Orders: map[string]expectedOrder{}}
	seq := 0
	newID := func() string { seq++; return fmt.Sprintf("evt-%d-%07d", m.Seed, seq) }
	var msgs []outMsg
	add := func(key, typ string, payload any, at int, idless bool) {
		v, err := json.Marshal(payload)
		if err != nil {
			panic(err) // plain structs always marshal
		}
		msg := outMsg{Key: key, Value: v, Type: typ, Kind: kindEvent, at: at}
		if idless {
			msg.Kind = kindIDless
		} else {
			msg.ID = newID()
		}
		msgs = append(msgs, msg)
		// Copies come later on the timeline, after other orders' events.
		switch r := rng.Float64(); {
		case idless:
			c := msg
			c.Kind, c.at = kindIDlessDup, at+1+rng.Intn(2*causalGap)
			msgs = append(msgs, c)
		case r < m.Duplicates:
			c := msg
			c.Kind, c.at = kindDuplicate, at+1+rng.Intn(2*causalGap)
			msgs = append(msgs, c)
		}
	}
	var paid []string
	last := map[string]int{} // order id -> time of its last event
	for i := 0; i < m.Orders; i++ {
		id := fmt.Sprintf("o-%d-%06d", m.Seed, i)
		amount := int64(500 + rng.Intn(49500))
		t := i * 2
		add(id, TypeCreated, OrderCreated{OrderID: id, Customer: fmt.Sprintf("c-%d", rng.Intn(500)), AmountCents: amount},
			t, rng.Float64() < m.IDless)
		exp := expectedOrder{Status: "created", AmountCents: amount}
		t += causalGap + rng.Intn(causalGap)
		switch r := rng.Float64(); {
		case r < 0.65:
			add(id, TypePaid, OrderPaid{OrderID: id, PaymentID: "pay-" + id, AmountCents: amount}, t, rng.Float64() < m.IDless)
			exp.Status, exp.Paid = "paid", true
			p.LedgerSum += amount
			p.LedgerRows++
			paid = append(paid, id)
		case r < 0.80:
			add(id, TypeCancelled, OrderCancelled{OrderID: id, Reason: "customer changed their mind"}, t, rng.Float64() < m.IDless)
			exp.Status = "cancelled"
		}
		last[id] = t
		p.Orders[id] = exp
	}

	violations := int(float64(m.Orders)*m.Violations + 0.5)
	for i := 0; i < violations; i++ {
		kind := []string{kindOrphanPayment, kindCancelPaid, kindSecondPayment}[i%3]
		if kind == kindCancelPaid && m.Unordered {
			kind = kindWrongAmount
		}
		if kind != kindOrphanPayment && len(paid) == 0 {
			kind = kindOrphanPayment
		}
		var msg outMsg
		switch kind {
		case kindOrphanPayment:
			id := fmt.Sprintf("o-%d-ghost-%04d", m.Seed, i)
			v, _ := json.Marshal(OrderPaid{OrderID: id, PaymentID: "pay-" + id, AmountCents: 1000})
			msg = outMsg{Key: id, Value: v, Type: TypePaid, at: rng.Intn(m.Orders*2 + causalGap)}
		case kindCancelPaid:
			id := paid[rng.Intn(len(paid))]
			v, _ := json.Marshal(OrderCancelled{OrderID: id, Reason: "too late"})
			msg = outMsg{Key: id, Value: v, Type: TypeCancelled, at: last[id] + causalGap + rng.Intn(causalGap)}
		case kindSecondPayment:
			id := paid[rng.Intn(len(paid))]
			v, _ := json.Marshal(OrderPaid{OrderID: id, PaymentID: "pay2-" + id, AmountCents: p.Orders[id].AmountCents})
			msg = outMsg{Key: id, Value: v, Type: TypePaid, at: last[id] + causalGap + rng.Intn(causalGap)}
		case kindWrongAmount:
			id := paid[rng.Intn(len(paid))]
			v, _ := json.Marshal(OrderPaid{OrderID: id, PaymentID: "pay3-" + id, AmountCents: p.Orders[id].AmountCents + 1})
			msg = outMsg{Key: id, Value: v, Type: TypePaid, at: last[id] + causalGap + rng.Intn(causalGap)}
		}
		msg.ID, msg.Kind = newID(), kind
		msgs = append(msgs, msg)
		p.Violations++
	}

	malformed := int(float64(m.Orders)*m.Malformed + 0.5)
	for i := 0; i < malformed; i++ {
		id := fmt.Sprintf("o-%d-%06d", m.Seed, rng.Intn(m.Orders+1))
		full, _ := json.Marshal(OrderCreated{OrderID: id, Customer: "c-0", AmountCents: 100})
		msgs = append(msgs, outMsg{Key: id, Value: full[:len(full)/2], ID: newID(), Type: TypeCreated,
			Kind: kindMalformed, at: rng.Intn(m.Orders*2 + causalGap)})
		p.Malformed++
	}

	sort.SliceStable(msgs, func(i, j int) bool { return msgs[i].at < msgs[j].at })
	for _, msg := range msgs {
		p.Sent[msg.Kind]++
	}
	p.Messages = msgs
	return p
}
