package main

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"
)

// The embedded broker (kfake) starts no session timer for a member that
// joins a group for the first time until its answer to that JoinGroup is
// handed to the connection's writer. For a member killed while the
// JoinGroup waits (a fresh member joining during a rebalance, killed by the
// next fault) that hand-over succeeds or fails at random (the reply channel
// has a buffer, and a select picks between it and the closed connection),
// so in about half the cases the dead member never expires: once the leader
// syncs, it stays in the group with its partitions and nothing consumes
// them until something else rebalances the group; in the drain, nothing
// does. Apache Kafka
// expires such a member after its session timeout. deadMemberReaper does
// what that coordinator would: it removes, with a LeaveGroup on its behalf,
// a member of a stable group whose process has been dead for longer than a
// session and a rebalance, and the run reports how many it removed.
type deadMemberReaper struct {
	kf     *kfake.Cluster
	groups []string
	// deadSince reports when the member process with this Kafka client id
	// exited; ok is false while it runs (or for a client that is not a
	// member).
	deadSince func(clientID string) (at time.Time, ok bool)
	// grace is how long a dead member may stay: a real coordinator expires
	// it within its session timeout, or removes it at the end of a
	// rebalance it does not rejoin.
	grace time.Duration
	logf  func(format string, args ...any)

	mu      sync.Mutex
	broker  *sarama.Broker
	evicted int
}

// sweep removes the dead members kept past grace and returns how many.
func (d *deadMemberReaper) sweep(now time.Time) (int, error) {
	n := 0
	for _, group := range d.groups {
		info := d.kf.GroupInfo(group)
		if info == nil || info.State != "Stable" {
			continue
		}
		for _, m := range info.Members {
			at, dead := d.deadSince(m.ClientID)
			if !dead || now.Sub(at) < d.grace {
				continue
			}
			if err := d.leave(group, m.MemberID); err != nil {
				return n, err
			}
			n++
			d.logf("the embedded broker kept %s (exited %s ago) in group %s with partitions %v; removed it as a real coordinator would",
				m.ClientID, now.Sub(at).Round(time.Millisecond), group, m.Assignment)
		}
	}
	d.mu.Lock()
	d.evicted += n
	d.mu.Unlock()
	return n, nil
}

// leave sends a LeaveGroup for member.
func (d *deadMemberReaper) leave(group, member string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.broker == nil {
		b := sarama.NewBroker(d.kf.ListenAddrs()[0])
		if err := b.Open(saramaConfig()); err != nil {
			return err
		}
		d.broker = b
	}
	resp, err := d.broker.LeaveGroup(&sarama.LeaveGroupRequest{GroupId: group, MemberId: member})
	if err != nil {
		_ = d.broker.Close()
		d.broker = nil
		return err
	}
	if resp.Err != sarama.ErrNoError && resp.Err != sarama.ErrUnknownMemberId {
		return resp.Err
	}
	return nil
}

// run sweeps every interval until ctx ends.
func (d *deadMemberReaper) run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			if _, err := d.sweep(now); err != nil {
				d.logf("removing a dead member from the embedded broker's group: %v", err)
			}
		}
	}
}

// Evicted returns how many dead members the reaper removed.
func (d *deadMemberReaper) Evicted() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.evicted
}

func (d *deadMemberReaper) close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.broker != nil {
		_ = d.broker.Close()
	}
}

// memberOfClientID returns the member id of a chaos member's Kafka client id.
func memberOfClientID(clientID string) (int, bool) {
	s, ok := strings.CutPrefix(clientID, memberAppPrefix)
	if !ok {
		return 0, false
	}
	id, err := strconv.Atoi(s)
	return id, err == nil
}

// startReaper starts the dead-member reaper on kf's groups of this run.
func (r *chaosRun) startReaper(kf *kfake.Cluster) *deadMemberReaper {
	ff := fastFailover
	d := &deadMemberReaper{kf: kf, groups: []string{r.o.name, shippingName(r.o)}, deadSince: r.memberDeadSince,
		grace: ff.session + ff.rebalance + time.Second, logf: r.logf}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); d.run(ctx, 250*time.Millisecond) }()
	r.closers = append(r.closers, func() { cancel(); <-done; d.close() })
	return d
}

// memberDeadSince reports when the member with Kafka client id clientID
// exited.
func (r *chaosRun) memberDeadSince(clientID string) (time.Time, bool) {
	id, ok := memberOfClientID(clientID)
	if !ok {
		return time.Time{}, false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	at, ok := r.exitedAt[id]
	return at, ok
}
