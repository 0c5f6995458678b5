package dlq_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/onceco/once/cmd/once/dlq"
)

// Redrive the handler failures of the last hour of consumer "billing",
// ten records a second. Replaying them again later, or while someone else
// does, leaves each event with one effect.
func ExampleKafkaQueue_Replay() {
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: []string{"kafka-1:9092"}, Topic: "orders.dlq"})
	if err != nil {
		log.Fatal(err)
	}
	sel := dlq.Filter{Consumer: "billing", Kinds: []string{"handler"}, Since: time.Now().Add(-time.Hour)}
	rep, err := q.Replay(context.Background(), sel, dlq.ReplayOptions{Rate: 10, By: "alice"})
	if err != nil {
		log.Fatal(err)
	}
	for _, o := range rep.Outcomes {
		if o.Result == dlq.Skipped {
			fmt.Println("skipped", o.Record.Ref, o.Reason)
		}
	}
	fmt.Printf("replayed %d of %d\n", rep.Replayed, rep.Selected)
}
