package main

import (
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/netcut"
)

// rawMember is a consumer-group member speaking the group protocol by hand
// to the embedded broker, so that a test decides when it joins, syncs and
// heartbeats.
type rawMember struct {
	t     *testing.T
	b     *sarama.Broker
	group string
	id    string
	gen   int32
}

func newRawMember(t *testing.T, ek *embeddedKafka, group, clientID string) *rawMember {
	return newRawMemberAt(t, ek.addrs[0], group, clientID)
}

// newRawMemberAt is a rawMember that connects to addr.
func newRawMemberAt(t *testing.T, addr, group, clientID string) *rawMember {
	t.Helper()
	sc := saramaConfig()
	sc.ClientID = clientID
	sc.Net.ReadTimeout = fastFailover.rebalance + 5*time.Second
	b := sarama.NewBroker(addr)
	require.NoError(t, b.Open(sc))
	_, err := b.Connected()
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close() })
	return &rawMember{t: t, b: b, group: group}
}

// join sends a JoinGroup with the -fast-failover timeouts and waits for its
// answer.
func (m *rawMember) join() (*sarama.JoinGroupResponse, error) {
	ff := fastFailover
	req := &sarama.JoinGroupRequest{Version: 5, GroupId: m.group, MemberId: m.id, ProtocolType: "consumer",
		SessionTimeout: int32(ff.session.Milliseconds()), RebalanceTimeout: int32(ff.rebalance.Milliseconds())}
	require.NoError(m.t, req.AddGroupProtocolMetadata("range", &sarama.ConsumerGroupMemberMetadata{Topics: []string{"failover"}}))
	r, err := m.b.JoinGroup(req)
	if err == nil && r.Err == sarama.ErrMemberIdRequired {
		// Since JoinGroup v4 a new member is given its id first and
		// joins again with it, as sarama does.
		m.id, req.MemberId = r.MemberId, r.MemberId
		r, err = m.b.JoinGroup(req)
	}
	if err == nil && r.Err != sarama.ErrNoError {
		err = r.Err
	}
	if err == nil {
		m.id, m.gen = r.MemberId, r.GenerationId
	}
	return r, err
}

// joinAsync sends a JoinGroup; the channel has its outcome.
func (m *rawMember) joinAsync() <-chan error {
	c := make(chan error, 1)
	go func() { _, err := m.join(); c <- err }()
	return c
}

func (m *rawMember) sync() error {
	r, err := m.b.SyncGroup(&sarama.SyncGroupRequest{Version: 3, GroupId: m.group, GenerationId: m.gen, MemberId: m.id})
	if err == nil && r.Err != sarama.ErrNoError {
		err = r.Err
	}
	return err
}

func (m *rawMember) heartbeat() (sarama.KError, error) {
	r, err := m.b.Heartbeat(&sarama.HeartbeatRequest{Version: 3, GroupId: m.group, GenerationId: m.gen, MemberId: m.id})
	if err != nil {
		return 0, err
	}
	return r.Err, nil
}

// awaitRebalance waits until m's heartbeat says a rebalance is in progress.
func (m *rawMember) awaitRebalance(msg string) {
	require.Eventually(m.t, func() bool {
		kerr, err := m.heartbeat()
		return err == nil && kerr == sarama.ErrRebalanceInProgress
	}, 10*time.Second, 10*time.Millisecond, msg)
}

// stableGroupOfTwo returns a leader and a follower in one stable
// generation of group.
func stableGroupOfTwo(t *testing.T, ek *embeddedKafka, group string) (leader, follower *rawMember) {
	leader, follower = newRawMember(t, ek, group, "leader"), newRawMember(t, ek, group, "follower")
	_, err := leader.join()
	require.NoError(t, err)
	require.NoError(t, leader.sync())
	followerJoined := follower.joinAsync()
	leader.awaitRebalance("the follower's join starts a rebalance")
	_, err = leader.join()
	require.NoError(t, err)
	require.NoError(t, <-followerJoined)
	synced := make(chan error, 1)
	go func() { synced <- follower.sync() }()
	require.NoError(t, leader.sync())
	require.NoError(t, <-synced)
	return leader, follower
}

// The embedded broker (kfake) drops a member waiting in JoinGroup once the
// member's session timeout passes since its last heartbeat, without
// answering it (Apache Kafka keeps a member awaiting a join alive), and the
// member then waits for its client's read timeout, 30 s in sarama. So the
// -fast-failover timing must let a rebalance run its full RebalanceTimeout
// within a waiting member's session. This test holds a rebalance open for
// that long: the leader rejoins and waits; the follower heartbeats on and
// rejoins just before the rebalance timeout; the leader's join must be
// answered, with both members in the new generation.
func TestFastFailoverOutlastsARebalanceOnTheEmbeddedBroker(t *testing.T) {
	ek, err := startEmbeddedKafka(0, "failover", 1)
	require.NoError(t, err)
	t.Cleanup(ek.Close)
	leader, follower := stableGroupOfTwo(t, ek, "g")

	start := time.Now()
	leaderJoined := leader.joinAsync()
	for time.Since(start) < fastFailover.rebalance-300*time.Millisecond {
		_, err := follower.heartbeat()
		require.NoError(t, err)
		time.Sleep(fastFailover.heartbeat)
	}
	r, err := follower.join()
	require.NoError(t, err)
	require.NoError(t, <-leaderJoined, "the leader's join is answered, not dropped")
	require.Equal(t, leader.gen, r.GenerationId, "both members are in the new generation")
}

// A member that joins for the first time and dies while its JoinGroup
// waits is kept by the embedded broker, partitions and all, once the
// leader syncs: kfake starts its session timer only when the JoinGroup's
// answer is delivered. The chaos driver's reaper removes it, as Apache
// Kafka's coordinator would expire it; before the reaper, such a member
// left the chaos drain waiting on its partitions for good.
func TestDeadFirstJoinerIsRemovedFromTheEmbeddedBrokersGroup(t *testing.T) {
	ek, err := startEmbeddedKafka(0, "failover", 1)
	require.NoError(t, err)
	t.Cleanup(ek.Close)
	leader := newRawMember(t, ek, "g", "leader")
	_, err = leader.join()
	require.NoError(t, err)
	require.NoError(t, leader.sync())

	// A fresh member joins, and its process dies while the join waits
	// (its connection, through a proxy, is cut).
	px, err := netcut.NewProxy(ek.addrs[0])
	require.NoError(t, err)
	t.Cleanup(func() { _ = px.Close() })
	doomed := newRawMemberAt(t, px.Addr(), "g", memberKafkaClientID(7))
	doomedJoined := doomed.joinAsync()
	leader.awaitRebalance("the new member's join starts a rebalance")
	require.Positive(t, px.Cut())
	require.Error(t, <-doomedJoined)
	diedAt := time.Now()
	_, err = leader.join()
	require.NoError(t, err)
	require.NoError(t, leader.sync())

	// The broker keeps it past a session and a rebalance, and the leader
	// is told of no rebalance.
	kept := fastFailover.session + fastFailover.rebalance + time.Second
	for time.Since(diedAt) < kept {
		kerr, err := leader.heartbeat()
		require.NoError(t, err)
		require.Equal(t, sarama.ErrNoError, kerr, "no rebalance while the dead member is kept")
		time.Sleep(fastFailover.heartbeat)
	}
	info := ek.cluster.GroupInfo("g")
	require.Len(t, info.Members, 2, "the embedded broker still has the dead member")

	var logged []string
	reaper := &deadMemberReaper{kf: ek.cluster, groups: []string{"g"}, grace: kept,
		deadSince: func(clientID string) (time.Time, bool) { return diedAt, clientID == memberKafkaClientID(7) },
		logf:      func(format string, args ...any) { logged = append(logged, format) }}
	t.Cleanup(reaper.close)
	n, err := reaper.sweep(time.Now())
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Len(t, logged, 1)
	leader.awaitRebalance("removing the dead member rebalances the group")
	_, err = leader.join()
	require.NoError(t, err)
	require.NoError(t, leader.sync())
	info = ek.cluster.GroupInfo("g")
	require.Len(t, info.Members, 1, "only the live member is left")
	n, err = reaper.sweep(time.Now())
	require.NoError(t, err)
	require.Zero(t, n, "a live member is left alone")
	require.Equal(t, 1, reaper.Evicted())
}
