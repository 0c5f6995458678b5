package main

import (
	"context"
	"flag"
	"fmt"
	"strconv"
	"strings"
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

// offsetsProblems reports, in the mode, the partitions of the orders topic
// whose position the database does not hold: the members did not keep
// their offsets in PostgreSQL, and the group's deletion tested nothing
// (they would resume from the topic's beginning, skip every record as a
// duplicate, and pass all the same).
func (r *chaosRun) offsetsProblems(ctx context.Context) ([]string, error) {
	if !r.cfg.OffsetsInDatabase || !r.isKafka() {
		return nil, nil
	}
	rows, err := r.pool.Query(ctx, `SELECT partition, next_offset FROM processed_events_offsets WHERE consumer = $1 AND topic = $2`,
		r.o.name, r.o.topic)
	if err != nil {
		return nil, err
	}
	next := map[int32]int64{}
	for rows.Next() {
		var p int32
		var n int64
		if err := rows.Scan(&p, &n); err != nil {
			rows.Close()
			return nil, err
		}
		next[p] = n
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	var missing []string
	for p := range int32(r.o.partitions) {
		if next[p] <= 0 {
			missing = append(missing, strconv.Itoa(int(p)))
		}
	}
	if len(missing) == 0 {
		return nil, nil
	}
	return []string{fmt.Sprintf("offsets in the database: no position of %s in partitions [%s] of %s: the members did not keep their offsets in PostgreSQL",
		r.o.name, strings.Join(missing, " "), r.o.topic)}, nil
}
