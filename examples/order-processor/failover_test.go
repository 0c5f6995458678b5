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
	// session is the session timeout it joins with (default: the
	// -fast-failover one).
	session time.Duration
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
	return &rawMember{t: t, b: b, group: group, session: fastFailover.session}
}

// join sends a JoinGroup with the -fast-failover timeouts and waits for its
// answer.
func (m *rawMember) join() (*sarama.JoinGroupResponse, error) {
	ff := fastFailover
	req := &sarama.JoinGroupRequest{Version: 5, GroupId: m.group, MemberId: m.id, ProtocolType: "consumer",
		SessionTimeout: int32(m.session.Milliseconds()), RebalanceTimeout: int32(ff.rebalance.Milliseconds())}
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

	// The follower joins 400 ms before the rebalance timeout: after a 1 s
	// session would have dropped the leader, with room before the
	// rebalance would end without the follower.
	joinAt := time.Now().Add(fastFailover.rebalance - 400*time.Millisecond)
	leaderJoined := leader.joinAsync()
	for time.Now().Before(joinAt) {
		_, err := follower.heartbeat()
		require.NoError(t, err)
		time.Sleep(min(fastFailover.heartbeat, time.Until(joinAt)))
	}
	r, err := follower.join()
	require.NoError(t, err)
	require.NoError(t, <-leaderJoined, "the leader's join is answered, not dropped")
	require.Equal(t, leader.gen, r.GenerationId, "both members are in the new generation")
}

// A member that joins for the first time and dies while its JoinGroup
// waits can stay in the embedded broker's group, partitions and all, after
// the leader syncs: kfake starts its session timer only when the answer to
// that JoinGroup is handed to the connection's writer, and for a closed
// connection that succeeds or not at random (the reply channel has a
// buffer), so in about half the cases the member never expires. The chaos
// driver's reaper removes a member whose process has been dead for longer
// than a session and a rebalance, as Apache Kafka's coordinator would have
// expired it. Here the dead member joined with a 60 s session, so that the
// broker keeps it whichever way that race goes, and the reaper, given no
// grace, must remove it and leave the live member alone.
func TestReaperRemovesADeadMemberTheEmbeddedBrokerKeeps(t *testing.T) {
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
	doomed := newRawMemberAt(t, px.Addr(), "g", memberAppName(7))
	doomed.session = time.Minute
	doomedJoined := doomed.joinAsync()
	leader.awaitRebalance("the new member's join starts a rebalance")
	require.Positive(t, px.Cut())
	require.Error(t, <-doomedJoined)
	diedAt := time.Now()
	_, err = leader.join()
	require.NoError(t, err)
	require.NoError(t, leader.sync())
	require.Len(t, ek.cluster.GroupInfo("g").Members, 2, "the embedded broker keeps the dead member")

	var logged []string
	reaper := &deadMemberReaper{kf: ek.cluster, groups: []string{"g"},
		deadSince: func(clientID string) (time.Time, bool) { return diedAt, clientID == memberAppName(7) },
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
	require.Len(t, ek.cluster.GroupInfo("g").Members, 1, "only the live member is left")
	n, err = reaper.sweep(time.Now())
	require.NoError(t, err)
	require.Zero(t, n, "a live member is left alone")
	require.Equal(t, 1, reaper.Evicted())

	// A member dead for less than the grace is left to the broker.
	reaper.grace = time.Hour
	reaper.deadSince = func(string) (time.Time, bool) { return time.Now(), true }
	n, err = reaper.sweep(time.Now())
	require.NoError(t, err)
	require.Zero(t, n, "within the grace")
}
