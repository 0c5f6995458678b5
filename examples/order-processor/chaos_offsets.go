package main

import (
	"context"
	"flag"
	"fmt"
	"time"

	"github.com/IBM/sarama"
)

// The chaos run with kafka.Config.OffsetsInDatabase: the members keep the
// group's offsets in PostgreSQL with the effects, and one fault deletes the
// consumer group with its committed offsets, as offsets.retention.minutes
// or an operator would. The members must then resume where the database
// says: from Kafka's point of view they start again at the topic's
// beginning.

// faultDeleteGroup is the fault that deletes the group and its offsets.
const faultDeleteGroup = "group-offsets-delete"

// offsetsFlag adds the chaos command's -offsets-in-database flag.
func offsetsFlag(fs *flag.FlagSet, cfg *ChaosConfig) {
	fs.BoolVar(&cfg.OffsetsInDatabase, "offsets-in-database", false,
		"kafka: members keep offsets in PostgreSQL (kafka.Config.OffsetsInDatabase); one fault deletes the group with its offsets")
}

// offsetsFaults are the faults of the mode: one group deletion.
func (r *chaosRun) offsetsFaults() []fault {
	if !r.cfg.OffsetsInDatabase || !r.isKafka() {
		return nil
	}
	return []fault{{kind: faultDeleteGroup}}
}

// offsetsArgs are the member's flags of the mode.
func (r *chaosRun) offsetsArgs() []string {
	if !r.cfg.OffsetsInDatabase {
		return nil
	}
	return []string{"-offsets-in-database"}
}

// deleteGroup kills every member and deletes the consumer group with its
// committed offsets, once its dead members' sessions expired (Kafka refuses
// to delete a group with members). The caller restarts the members.
func (r *chaosRun) deleteGroup(ctx context.Context) error {
	for _, m := range r.live() {
		m.kill()
		r.forget(m)
	}
	admin, err := sarama.NewClusterAdmin(r.o.kafkaBrokers, saramaConfig())
	if err != nil {
		return fmt.Errorf("delete group: %w", err)
	}
	defer admin.Close()
	deadline := time.Now().Add(time.Minute)
	for {
		err := admin.DeleteConsumerGroup(r.o.name)
		if err == nil {
			r.logf("deleted consumer group %s with its offsets", r.o.name)
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("delete group %s: %w", r.o.name, err)
		}
		pause(ctx, 200*time.Millisecond) // the dead members' sessions expire
	}
}
