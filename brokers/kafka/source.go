package kafka

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/IBM/sarama"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/backoff"
	"github.com/onceco/once/internal/kafkarefusal"
)

// ErrRevoked is returned by Ack and DeadLetter when the delivery's partition
// was revoked (a rebalance, or the Source closing) and its revoke bound
// expired before the delivery was settled. Nothing is marked: the record is
// delivered again to the partition's next owner, which recognises it as a
// duplicate if its transaction had committed.
var ErrRevoked = errors.New("kafka: partition revoked")

// ErrDeadLetterTopicMissing is returned by Open, wrapped with the
// topic's name, when a dead-letter topic does not exist and
// Config.DeadLetter.Create is false.
var ErrDeadLetterTopicMissing = errors.New("kafka: dead-letter topic does not exist")

// ErrCloseTimeout is returned by Close, wrapped, when closing did not finish
// within Config.CloseTimeout (a group rebalance or a broker that does not
// answer can hold the final commit and the group's leave). Nothing is lost:
// offsets marked since the last periodic commit may not be committed, so
// their records are delivered again and skipped as duplicates. A service
// may log it and exit as after a clean stop; consumer.Consumer.Run returns
// it wrapped.
var ErrCloseTimeout = errors.New("kafka: Close did not finish within Config.CloseTimeout")

// Source is a consumer.Source reading a Kafka consumer group. Create it with
// Open and hand it to consumer.New, which calls Receive from one
// goroutine and Close once when it stops. The Ack and DeadLetter methods of
// its deliveries are safe for concurrent use.
type Source struct {
	cfg   Config
	group sarama.ConsumerGroup
	// groupClient is group's client, which closing group leaves open.
	groupClient sarama.Client
	dlqClient   sarama.Client // the dead-letter producer's client
	producer    sarama.SyncProducer
	lag         *lagGauge
	topicIDs    topicIDs

	deliveries chan *delivery
	// readAhead is how many records a claim reads on while Receive takes
	// none of them before it pauses the partition's fetching: sarama's
	// ChannelBufferSize.
	readAhead int
	// sessionTimeout is the consumer group's session timeout: Config's, or
	// the Sarama base value.
	sessionTimeout time.Duration
	// instanceID is the consumer group's static instance id, "" when none.
	instanceID string

	ctx       context.Context // ends the consume loop and every session
	cancel    context.CancelFunc
	startOnce sync.Once
	started   bool          // set by startOnce
	loopDone  chan struct{} // closed when the consume loop returned
	loopErr   error         // fatal error, set before loopDone is closed
	errsDone  chan struct{} // closed when the error drain returned

	closeOnce sync.Once
	closing   chan struct{} // closed by Close
	closeErr  error

	sendMu      sync.Mutex
	sendsClosed bool           // set by Close; no dead-letter send starts after it
	sends       sync.WaitGroup // dead-letter sends still running
	sending     atomic.Int32   // how many: sends' count, readable
	// soloMu is held shared by every dead-letter send while it is in the
	// producer, and exclusively by one that must go in a batch of its
	// own (send).
	soloMu sync.RWMutex

	waitingForRoom atomic.Int32 // claims paused at Config.MaxPendingPerPartition
	pendingMax     atomic.Int32 // the most pending records any claim held

	// committedAtStart holds, per session (sarama.ConsumerGroupSession),
	// its *sessionCommitted, until the session's Cleanup (checkStart).
	committedAtStart sync.Map
	startChecks      atomic.Int64 // claims whose start checkStart checked

	// Claims fenced by another group, held idle (holdFenced), and the
	// records they dropped.
	heldFenced    atomic.Int32
	fencedDropped atomic.Int64

	// With Config.OffsetsInDatabase (offsets.go):
	offsets   atomic.Pointer[offsetsBinding] // set by BindProgress
	positions positions                      // the take-over's rows, until ConsumeClaim
	skipped   atomic.Int64                   // records skipped as recorded done
	// misused is closed, once, with misuseErr set before, when
	// RecordProgress was given a delivery it cannot record (a wrapper
	// that does not unwrap): Receive then fails with misuseErr.
	misuseOnce sync.Once
	misused    chan struct{}
	misuseErr  error
}

var (
	_ consumer.Source        = (*Source)(nil)
	_ consumer.SystemNamer   = (*Source)(nil)
	_ consumer.StreamBounder = (*Source)(nil)
)

// BoundsStreams implements consumer.StreamBounder: each partition stops
// handing records out at Config.MaxPendingPerPartition unsettled ones, so
// the consumer's Config.ReceiveBuffer, shared by every partition, does
// not bound them too. With it, a partition stuck at a record with a
// backlog behind it filled the buffer and stopped the other partitions.
func (s *Source) BoundsStreams() bool { return true }

// Open validates cfg, connects the consumer-group client and the
// dead-letter producer to the cluster and checks that every dead-letter
// topic exists (creating the missing ones when Config.DeadLetter.Create is
// set). While none of Brokers can be reached it tries again with backoff
// (Config.ReconnectMinBackoff to ReconnectMaxBackoff), logging each
// failure, until ctx is done; then it returns the last failure. It returns
// at once:
//   - an error naming the field for an invalid Config;
//   - ErrDeadLetterTopicMissing naming the first missing dead-letter topic;
//   - a broker's refusal of the Sarama settings, naming the broker and what
//     it refused: the TLS handshake (a certificate not trusted or not
//     presented, TLS on one side only; Net.TLS) or SASL authentication (a
//     mechanism the broker does not offer, wrong credentials, a listener
//     that asks for SASL where the client does not authenticate, or the
//     reverse; Net.SASL);
//   - the cluster's refusal to authorize the client for Group or a topic of
//     Topics (its ACLs), naming the group or topic, and a principal that
//     may not READ Group or a topic of Topics, or WRITE a dead-letter
//     topic, naming the group or topic and the operation (Kafka 2.3+ with Sarama.Version at
//     least 2.3, which say what a principal may do with a topic).
//
// Brokers that close the connection without saying why are asked, aside,
// whether they expect TLS or SASL where the client does not, or the
// reverse; when they do not say so, they cannot be told from brokers that
// are down, and are retried. ctx bounds Open only, not the Source.
//
// The Source joins the group at the first Receive. After that, lost
// connections and rebalances are absorbed: Receive keeps blocking while the
// Source reconnects and rejoins, and the problems are logged to
// Config.Logger. A refusal met on a later connection (the credentials
// changed or the ACLs revoked on the cluster, a certificate expired) is
// retried too, and logged at level Error as the cluster refusing the
// client, with the error sarama reports: the settings worked once, so the
// change is on the cluster's side, and the consumer resumes without a
// restart when it is undone, where a Source that stopped would take the
// whole consumer down, and be refused again when restarted with the same
// Config.
func Open(ctx context.Context, cfg Config) (*Source, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	retry := backoff.Retrier{Policy: backoff.Policy{Initial: cfg.ReconnectMinBackoff, Max: cfg.ReconnectMaxBackoff}}
	var lastErr error
	for {
		s, err := connectWithin(ctx, cfg)
		if errors.Is(err, errAttemptGivenUp) {
			if lastErr == nil {
				return nil, fmt.Errorf("kafka: connect: %w (the first attempt had not finished)", context.Cause(ctx))
			}
			return nil, fmt.Errorf("kafka: brokers unreachable until the context ended (%w): %w", context.Cause(ctx), lastErr)
		}
		if err == nil || !unreachable(err) {
			return s, err
		}
		// sarama reports a broker refusing the TLS or SASL settings as
		// one that cannot be reached, and retrying cannot help.
		if cc, cerr := cfg.consumerConfig(); cerr == nil {
			if r := kafkarefusal.Probe(ctx, cfg.Brokers, cc); r != nil {
				return nil, fmt.Errorf("kafka: %w", r)
			}
		}
		lastErr = err
		wait := retry.Delay()
		cfg.Logger.WarnContext(ctx, "once/kafka: cannot reach the brokers; retrying",
			"group", cfg.Group, "error", err, "backoff", wait)
		if !backoff.Sleep(ctx, wait) {
			return nil, fmt.Errorf("kafka: brokers unreachable until the context ended (%w): %w", context.Cause(ctx), err)
		}
	}
}

// errAttemptGivenUp is connectWithin's error when ctx ended first.
var errAttemptGivenUp = errors.New("kafka: connection attempt given up")

// connectWithin runs connect aside and waits for it until ctx ends; it
// then returns errAttemptGivenUp, and the Source the attempt may still
// make is closed. An attempt at brokers that accept connections and then
// say nothing (a network holding the traffic, a TLS client at a port
// that speaks none) lasts sarama's timeouts, 30 s per read and per
// metadata retry: minutes that Open's ctx must not wait. An attempt that
// takes longer than slowAttempt has the brokers probed aside meanwhile,
// and a refusal the probe finds is returned without waiting for it.
func connectWithin(ctx context.Context, cfg Config) (*Source, error) {
	type result struct {
		s   *Source
		err error
	}
	done := make(chan result, 1)
	go func() {
		s, err := connect(ctx, cfg)
		done <- result{s, err}
	}()
	abandon := func() {
		go func() {
			if r := <-done; r.s != nil {
				_ = r.s.Close()
			}
		}()
	}
	slow := time.NewTimer(slowAttempt)
	defer slow.Stop()
	var refusal chan *kafkarefusal.Error // nil until the probe starts
	for {
		select {
		case r := <-done:
			return r.s, r.err
		case <-slow.C:
			if cc, err := cfg.consumerConfig(); err == nil {
				refusal = make(chan *kafkarefusal.Error, 1)
				go func() { refusal <- kafkarefusal.Probe(ctx, cfg.Brokers, cc) }()
			}
		case r := <-refusal:
			if r != nil {
				abandon()
				return nil, fmt.Errorf("kafka: %w", r)
			}
			refusal = nil
		case <-ctx.Done():
			abandon()
			return nil, errAttemptGivenUp
		}
	}
}

// slowAttempt is how long a connection attempt may take before the
// brokers are probed for a refusal of the settings beside it.
const slowAttempt = 2 * time.Second

// unreachable reports whether err from connect means that no broker could
// be reached, which waiting may cure.
func unreachable(err error) bool {
	var netErr net.Error
	return errors.Is(err, sarama.ErrOutOfBrokers) || errors.Is(err, sarama.ErrNotConnected) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.As(err, &netErr)
}

// connect makes the Source's clients, once; ctx bounds its waits (a dead-letter
// topic it created to be seen).
func connect(ctx context.Context, cfg Config) (*Source, error) {
	cc, err := cfg.consumerConfig()
	if err != nil {
		return nil, err
	}
	pc, err := cfg.producerConfig()
	if err != nil {
		return nil, err
	}
	lag, err := newLagGauge(cfg.MeterProvider, cfg.Group)
	if err != nil {
		return nil, err
	}
	dlqClient, err := sarama.NewClient(cfg.Brokers, pc)
	if err != nil {
		lag.close()
		return nil, fmt.Errorf("kafka: dead-letter producer: %w", err)
	}
	if err := ensureDeadLetterTopics(ctx, &cfg, dlqClient, pc); err != nil {
		_ = dlqClient.Close()
		lag.close()
		return nil, err
	}
	if err := checkAccess(&cfg, dlqClient); err != nil {
		_ = dlqClient.Close()
		lag.close()
		return nil, err
	}
	producer, err := sarama.NewSyncProducerFromClient(dlqClient)
	if err != nil {
		_ = dlqClient.Close()
		lag.close()
		return nil, fmt.Errorf("kafka: dead-letter producer: %w", err)
	}
	groupClient, err := sarama.NewClient(cfg.Brokers, cc)
	if err != nil {
		_ = producer.Close()
		_ = dlqClient.Close()
		lag.close()
		return nil, fmt.Errorf("kafka: consumer group %q: %w", cfg.Group, err)
	}
	gc := groupClient
	if cfg.InitialOffset == StartNewest && !cfg.ReadUncommitted {
		gc = lastStableClient{groupClient}
	}
	gc = &heldGoneClient{Client: gc, known: make(map[string][]int32)}
	group, err := sarama.NewConsumerGroupFromClient(cfg.Group, gc)
	if err != nil {
		_ = groupClient.Close()
		_ = producer.Close()
		_ = dlqClient.Close()
		lag.close()
		return nil, fmt.Errorf("kafka: consumer group %q: %w", cfg.Group, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &Source{
		cfg:            cfg,
		group:          group,
		groupClient:    groupClient,
		dlqClient:      dlqClient,
		producer:       producer,
		lag:            lag,
		topicIDs:       topicIDs{client: dlqClient, version: pc.Version},
		deliveries:     make(chan *delivery),
		readAhead:      cc.ChannelBufferSize,
		sessionTimeout: cc.Consumer.Group.Session.Timeout,
		instanceID:     cc.Consumer.Group.InstanceId,
		ctx:            ctx,
		cancel:         cancel,
		loopDone:       make(chan struct{}),
		errsDone:       make(chan struct{}),
		closing:        make(chan struct{}),
		misused:        make(chan struct{}),
	}
	go s.drainErrors()
	return s, nil
}

// checkAccess asks the cluster for the group's coordinator and for the
// metadata of Topics, which a cluster with ACLs refuses a principal not
// authorized for them: it would refuse every join of the group, and the
// Source would retry the joins without end. Other failures (no
// coordinator yet, a topic not created yet) are left to the joins.
func checkAccess(cfg *Config, client sarama.Client) error {
	if _, err := client.Coordinator(cfg.Group); errors.Is(err, sarama.ErrGroupAuthorizationFailed) {
		return fmt.Errorf("kafka: consumer group %q: the cluster refuses this client access to it (a group ACL of its principal is missing): %w", cfg.Group, err)
	}
	for _, t := range cfg.Topics {
		if _, err := client.Partitions(t); errors.Is(err, sarama.ErrTopicAuthorizationFailed) {
			return fmt.Errorf("kafka: topic %q: the cluster refuses this client access to it (a topic ACL of its principal is missing): %w", t, err)
		}
	}
	if err := checkGroupOperations(cfg, client); err != nil {
		return err
	}
	return checkTopicOperations(cfg, client)
}

// checkGroupOperations asks the group's coordinator (Kafka 2.3+,
// Sarama.Version as well) whether the client may READ Group: a principal
// allowed to see the group (DESCRIBE) but not to read it would have every
// join refused, Receive blocking for ever. A failure to ask, or a
// coordinator that does not say, is left to the joins.
func checkGroupOperations(cfg *Config, client sarama.Client) error {
	if !client.Config().Version.IsAtLeast(sarama.V2_3_0_0) {
		return nil
	}
	coordinator, err := client.Coordinator(cfg.Group)
	if err != nil {
		return nil
	}
	// A connection of its own, as topicIDs.lookupOnce explains.
	b := sarama.NewBroker(coordinator.Addr())
	if err := b.Open(client.Config()); err != nil {
		return nil
	}
	defer b.Close()
	resp, err := b.DescribeGroups(&sarama.DescribeGroupsRequest{Version: 3, Groups: []string{cfg.Group}, IncludeAuthorizedOperations: true})
	if err != nil {
		return nil
	}
	for _, g := range resp.Groups {
		ops := g.AuthorizedOperations
		if g.GroupId != cfg.Group || g.ErrorCode != 0 || ops == opsNotSupported || ops&opDescribe == 0 {
			continue
		}
		if ops&opRead == 0 {
			return fmt.Errorf("kafka: consumer group %q: the cluster does not allow this client to READ it (a group ACL of its principal is missing): %w",
				cfg.Group, sarama.ErrGroupAuthorizationFailed)
		}
	}
	return nil
}

// Topic operations as bits of a metadata response's authorized operations
// (KIP-430), and the value of a response that does not say.
const (
	opRead          = 1 << int32(sarama.AclOperationRead)
	opWrite         = 1 << int32(sarama.AclOperationWrite)
	opDescribe      = 1 << int32(sarama.AclOperationDescribe)
	opsNotSupported = math.MinInt32
)

// checkTopicOperations asks the cluster (Kafka 2.3+, Sarama.Version as
// well) what the client may do with Topics and their dead-letter topics:
// a principal allowed to see a topic (DESCRIBE) but not to READ a consumed
// one would have every fetch refused, Receive blocking for ever; one that
// may not WRITE a dead-letter topic would have every copy refused, its
// partition held at the first poison record. A failure to ask, or a
// cluster that does not say, is left to the consume and the copies.
func checkTopicOperations(cfg *Config, client sarama.Client) error {
	version := client.Config().Version
	if !version.IsAtLeast(sarama.V2_3_0_0) {
		return nil
	}
	need := make(map[string]int32, 2*len(cfg.Topics))
	names := make([]string, 0, 2*len(cfg.Topics))
	for _, t := range cfg.Topics {
		need[t] |= opRead
		dlq := cfg.DeadLetter.Topic(t)
		need[dlq] |= opWrite
	}
	for t := range need {
		names = append(names, t)
	}
	b := connectionOfItsOwn(client)
	if b == nil {
		return nil
	}
	defer b.Close()
	req := sarama.NewMetadataRequest(version, names)
	req.IncludeTopicAuthorizedOperations = true
	resp, err := b.GetMetadata(req)
	if err != nil {
		return nil
	}
	for _, tm := range resp.Topics {
		want, ok := need[tm.Name]
		ops := tm.TopicAuthorizedOperations
		// A topic listed without error is one the client may DESCRIBE: a
		// broker whose answer lacks it does not report the operations.
		if !ok || !errors.Is(tm.Err, sarama.ErrNoError) || ops == opsNotSupported || ops&opDescribe == 0 {
			continue
		}
		// A consumed topic first: the error names the operation missing.
		for _, op := range []struct {
			bit  int32
			name string
			what string
		}{{opRead, "READ", "topic"}, {opWrite, "WRITE", "dead-letter topic"}} {
			if want&op.bit != 0 && ops&op.bit == 0 {
				return fmt.Errorf("kafka: %s %q: the cluster does not allow this client to %s it (a topic ACL of its principal is missing): %w",
					op.what, tm.Name, op.name, sarama.ErrTopicAuthorizationFailed)
			}
		}
	}
	return nil
}

// MessagingSystem returns "kafka", the OpenTelemetry messaging.system.
func (s *Source) MessagingSystem() string { return "kafka" }

// ConsumerGroup implements consumer.GroupNamer: telemetry reports the
// group as messaging.consumer.group.name.
func (s *Source) ConsumerGroup() string { return s.cfg.Group }

var _ consumer.GroupNamer = (*Source)(nil)

// Receive returns the next record of any partition assigned to this member;
// the records of one partition come in offset order. The first call joins
// the consumer group. Receive blocks until a record arrives or ctx is done
// (it then returns ctx.Err()); it returns consumer.ErrSourceClosed after
// Close, and a fatal error (an invalid sarama configuration found by the
// broker client, a Config.SessionTimeout the group coordinator refuses, a
// static member fenced by another that joined with its
// Sarama.Consumer.Group.InstanceId) when the group cannot be consumed at
// all, and, with Config.OffsetsInDatabase, once RecordProgress was given a
// delivery it cannot find this Source's in (a wrapper without Unwrap).
// Call it from one goroutine.
func (s *Source) Receive(ctx context.Context) (consumer.Delivery, error) {
	select {
	case <-s.closing:
		return nil, consumer.ErrSourceClosed
	default:
	}
	if s.cfg.OffsetsInDatabase && s.offsets.Load() == nil {
		return nil, errNotBound
	}
	select {
	case <-s.misused:
		return nil, s.misuseErr
	default:
	}
	s.startOnce.Do(func() {
		s.started = true
		go s.consumeLoop()
	})
	select {
	case d := <-s.deliveries:
		return d, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-s.closing:
		return nil, consumer.ErrSourceClosed
	case <-s.misused:
		return nil, s.misuseErr
	case <-s.loopDone:
		select {
		case <-s.closing:
			return nil, consumer.ErrSourceClosed
		default:
		}
		return nil, s.loopErr
	}
}

// Close stops consuming and commits every offset marked by Ack (the final
// commit of the session), leaves the group so that its partitions go to the
// remaining members at once instead of after the session timeout, waits for
// running dead-letter sends and closes the clients. Deliveries not acked by
// then are abandoned: their records are delivered again later. Close
// returns within Config.CloseTimeout whatever the brokers do: past it, it
// returns an error and the rest of the closing goes on in the background
// (see Config.CloseTimeout). Close is safe to call more than once; later
// calls return the first call's result.
func (s *Source) Close() error {
	s.closeOnce.Do(func() {
		close(s.closing)
		s.sendMu.Lock()
		s.sendsClosed = true
		s.sendMu.Unlock()
		s.startOnce.Do(func() {}) // no consume loop may start after this
		done := make(chan error, 1)
		go func() { done <- s.shutdown() }()
		t := time.NewTimer(s.cfg.CloseTimeout)
		defer t.Stop()
		select {
		case s.closeErr = <-done:
		case <-t.C:
			s.cfg.Logger.Warn("once/kafka: Close timed out; the clients finish closing in the background",
				"group", s.cfg.Group, "close_timeout", s.cfg.CloseTimeout, "dead_letter_sends", s.sending.Load())
			// Closing the dead-letter client fails the sends that wait on
			// it, so that the producer can be closed once they returned.
			_ = s.dlqClient.Close()
			s.closeErr = fmt.Errorf("%w (%v): offsets marked since the last commit may not be committed", ErrCloseTimeout, s.cfg.CloseTimeout)
		}
	})
	return s.closeErr
}

// refreshBeforeLeave bounds Close's wait for the group's coordinator to be
// found again before the member leaves the group.
const refreshBeforeLeave = 2 * time.Second

// shutdown does Close's work: end the session (sarama commits the marked
// offsets when every ConsumeClaim returned), leave the group, wait for the
// dead-letter sends and close the clients.
func (s *Source) shutdown() error {
	s.cancel()
	if s.started {
		<-s.loopDone
	}
	// The group's client learns that the coordinator moved from a
	// heartbeat's refusal; a close before the next heartbeat would send the
	// LeaveGroup to the broker that no longer coordinates the group, which
	// refuses it, and the group would keep this member (and its
	// partitions) until its session timed out. A failure here leaves the
	// coordinator known before, which the leave then tries.
	// A source that never consumed has joined no group and leaves none.
	// The refresh is waited for at most refreshBeforeLeave: a cluster that
	// does not answer would hold Close for the client's retries, and the
	// leave then goes to the coordinator known before.
	if s.started {
		refreshed := make(chan struct{})
		go func() {
			defer close(refreshed)
			if err := s.groupClient.RefreshCoordinator(s.cfg.Group); err != nil {
				s.cfg.Logger.Debug("once/kafka: cannot find the group's coordinator before leaving the group", "group", s.cfg.Group, "error", err)
			}
		}()
		t := time.NewTimer(refreshBeforeLeave)
		select {
		case <-refreshed:
		case <-t.C:
		}
		t.Stop()
	}
	errs := []error{s.group.Close()}
	<-s.errsDone
	errs = append(errs, s.groupClient.Close())
	s.sends.Wait()
	errs = append(errs, s.producer.Close(), s.dlqClient.Close())
	s.lag.close()
	return errors.Join(errs...)
}

// sendsRunning returns the number of dead-letter sends running.
func (s *Source) sendsRunning() int { return int(s.sending.Load()) }

// claimsWaitingForRoom returns the number of partitions paused at
// Config.MaxPendingPerPartition.
func (s *Source) claimsWaitingForRoom() int { return int(s.waitingForRoom.Load()) }

// maxPendingSeen returns the most records one partition held pending.
func (s *Source) maxPendingSeen() int { return int(s.pendingMax.Load()) }

// consumeLoop joins the group and consumes until the Source is closed,
// joining again after every rebalance and after transient failures.
func (s *Source) consumeLoop() {
	defer close(s.loopDone)
	retry := backoff.Retrier{Policy: backoff.Policy{Initial: s.cfg.ReconnectMinBackoff, Max: s.cfg.ReconnectMaxBackoff}}
	h := &groupHandler{s: s}
	for {
		err := s.group.Consume(s.ctx, s.cfg.Topics, h)
		if s.ctx.Err() != nil {
			return
		}
		var cfgErr sarama.ConfigurationError
		if errors.As(err, &cfgErr) || errors.Is(err, sarama.ErrClosedConsumerGroup) {
			s.loopErr = fmt.Errorf("kafka: consumer group %q: %w", s.cfg.Group, err)
			return
		}
		if errors.Is(err, sarama.ErrInvalidSessionTimeout) {
			// The coordinator refuses every join with this timeout.
			s.loopErr = fmt.Errorf("kafka: consumer group %q: Config.SessionTimeout (%v) is outside the brokers' bounds (group.min.session.timeout.ms and group.max.session.timeout.ms): %w",
				s.cfg.Group, s.sessionTimeout, err)
			return
		}
		if errors.Is(err, sarama.ErrFencedInstancedId) {
			// A member that joined with the same static instance id
			// replaced this one: the coordinator fences this one for
			// good, as Kafka's own consumer takes it.
			s.loopErr = fmt.Errorf("kafka: consumer group %q: another member joined with this member's Config.Sarama.Consumer.Group.InstanceId (%q) and replaced it; "+
				"each replica needs an instance id of its own: %w", s.cfg.Group, s.instanceID, err)
			return
		}
		if err == nil {
			retry.Reset() // the session ended with a rebalance: rejoin now
			continue
		}
		wait := retry.Delay()
		if reason, why := groupRefusal(err); why != "" {
			// Retried, as it clears once the members it conflicts with
			// leave; but the member consumes nothing meanwhile, and a
			// warning among the rebalances' would go unnoticed.
			s.lag.joinRefused(reason)
			s.cfg.Logger.Error("once/kafka: the group coordinator refuses this member; retrying until that changes or the Source is closed",
				"group", s.cfg.Group, "cause", why, "error", err, "backoff", wait)
		} else if refused(err) {
			// See Open: retried, as the fix is on the cluster's side.
			s.cfg.Logger.Error("once/kafka: the cluster refuses this client (authorization, SASL or TLS); retrying until that is fixed on the cluster or the Source is closed",
				"group", s.cfg.Group, "error", err, "backoff", wait)
		} else {
			s.cfg.Logger.Warn("once/kafka: consuming failed; retrying",
				"group", s.cfg.Group, "error", err, "backoff", wait)
		}
		if !backoff.Sleep(s.ctx, wait) {
			return
		}
	}
}

// groupRefusal returns the reason (GroupRefusedMetricName's error.type)
// and the cause, with its fix, of a join that the group coordinator
// refuses because of the group's other members, which retrying alone does
// not clear; "" for any other error. Kafka's Java consumer fails on these;
// the Source retries them, as they clear once those members leave.
func groupRefusal(err error) (reason, why string) {
	switch {
	case errors.Is(err, sarama.ErrGroupMaxSizeReached):
		return "group_max_size_reached", "the group has as many members as the brokers' group.max.size allows; " +
			"this member joins once another leaves: run fewer members or raise group.max.size"
	case errors.Is(err, sarama.ErrInconsistentGroupProtocol):
		return "inconsistent_group_protocol", "another member of the group id uses another protocol type or has no rebalance strategy in common with this one " +
			"(Config.Sarama.Consumer.Group.Rebalance.GroupStrategies); this member joins once those members leave: " +
			"give every member of the group id a strategy in common, or this consumer a group id of its own"
	}
	return "", ""
}

// refused reports whether err is the cluster refusing the client: its
// ACLs, or a broker refusing the TLS or SASL settings.
func refused(err error) bool {
	return errors.Is(err, sarama.ErrGroupAuthorizationFailed) || errors.Is(err, sarama.ErrTopicAuthorizationFailed) ||
		errors.Is(err, sarama.ErrClusterAuthorizationFailed) || kafkarefusal.Classify("", err) != nil
}

// drainErrors logs the consumer group's errors: failed offset commits,
// fetch errors, ConsumeClaim errors.
func (s *Source) drainErrors() {
	defer close(s.errsDone)
	for err := range s.group.Errors() {
		if s.topicError(err) {
			continue // its topic is gone, as logged once
		}
		if refused(err) {
			// A topic's READ ACL revoked while the group's stays: the
			// heartbeats go on, the session never ends, and only the
			// fetches and commits of the topic, reported here, are
			// refused; its partitions consume nothing until it is fixed
			// on the cluster, as consumeLoop's refusals.
			s.cfg.Logger.Error("once/kafka: the cluster refuses this client (authorization, SASL or TLS); retrying until that is fixed on the cluster or the Source is closed",
				"group", s.cfg.Group, "error", err)
			continue
		}
		s.cfg.Logger.Warn("once/kafka: consumer group error", "group", s.cfg.Group, "error", err)
	}
}

// groupHandler is the sarama.ConsumerGroupHandler of a Source.
type groupHandler struct{ s *Source }

// Setup marks the start of the session's partitions that have no
// committed offset (nor, with Config.OffsetsInDatabase, a position in the
// offsets table), with StartNewest, and takes the session's partitions
// over in the database, with Config.OffsetsInDatabase, seeking them to the
// positions recorded there.
func (h *groupHandler) Setup(sess sarama.ConsumerGroupSession) error {
	if h.s.cfg.InitialOffset == StartNewest {
		positioned, err := h.s.positionedInDatabase(sess)
		if err != nil {
			return err
		}
		h.s.markStarts(sess, positioned)
	}
	if !h.s.cfg.OffsetsInDatabase {
		return nil
	}
	return h.s.takeOver(sess)
}

// markStarts marks, for each partition of sess without a committed offset,
// the partition's end (its last stable offset, reading committed records:
// partitionEnd) as where the group starts reading it, and commits the
// marks at once, so that the group keeps that start: a record produced to the partition later, while
// it has no record to ack (the member stopped, the partition moving to
// another member), is read by the next owner instead of being skipped by
// its own start at the newest record. A failure to ask the cluster is
// logged; those partitions then start where sarama resolves
// sarama.OffsetNewest, the same end (lastStableClient), at each claim.
//
// A partition without a committed offset while another partition of its
// topic has one was added to the topic after the group started reading it
// (the group committed every partition's start when it did): it starts at
// its first record instead, so that the records produced to it before the
// group claimed it are read. StartNewest says where a group new to a
// topic starts, not that a partition added later loses its first records.
// The starts that the session's other members commit at the same time,
// when the group is new to the topic, say nothing of the kind: they are
// marked with the generation (startMetadata) and not counted
// (committedAny). With Config.OffsetsInDatabase, a partition the table
// gives a position (positioned: positionedInDatabase) gets no start here,
// and shows the group reading its topic as a committed offset does
// (readInDatabase).
func (s *Source) markStarts(sess sarama.ConsumerGroupSession, positioned map[topicPartition]bool) {
	claims := sess.Claims()
	if len(claims) == 0 {
		return
	}
	fail := func(err error) {
		s.cfg.Logger.Warn("once/kafka: cannot read the group's committed offsets to keep the start of partitions without one",
			"group", s.cfg.Group, "error", err)
	}
	resp, err := s.fetchCommitted(s.withSiblings(claims))
	if err != nil {
		fail(err)
		return
	}
	marked := false
	defer func() {
		if marked {
			// At once, not at the first periodic commit: a member that
			// crashed before it would leave no start, and the next owner
			// would start at the end again, past the records this one
			// had not handled.
			sess.Commit()
		}
	}()
	gen := sess.GenerationID()
	for topic, partitions := range claims {
		read := committedAny(resp, topic, gen) || readInDatabase(resp, topic, gen, positioned)
		for _, p := range partitions {
			b := resp.GetBlock(topic, p)
			if b == nil || !errors.Is(b.Err, sarama.ErrNoError) || b.Offset >= 0 || positioned[topicPartition{topic, p}] {
				continue
			}
			start, err := s.partitionEnd(topic, p)
			if read {
				start, err = s.dlqClient.GetOffset(topic, p, sarama.OffsetOldest)
			}
			if err != nil {
				fail(err)
				continue
			}
			if read {
				s.cfg.Logger.Info("once/kafka: partition added to a topic the group reads; reading it from its first record",
					"group", s.cfg.Group, "topic", topic, "partition", p, "offset", start)
			}
			// Forward only: it moves no committed offset.
			sess.MarkOffset(topic, p, start, startMetadata(gen))
			marked = true
		}
	}
}

// rewindNewestStart handles, under StartNewest, a claim that sarama
// started at the partition's end (InitialOffset sarama.OffsetNewest)
// although the group has been reading the partition's topic, so that
// starting at the end would skip records the partition still holds:
//
//   - a partition without a committed offset while another partition of
//     its topic has one was added to the topic after the group began
//     reading it. Setup marks such a partition's first offset
//     (markStarts), but a cooperative rebalance that adds it runs no Setup,
//     and Setup may have failed to ask the cluster. Logged at Info.
//   - a committed offset below the partition's first offset: the records
//     between the two were deleted by retention before the group read
//     them, and sarama reset the claim to Config.InitialOffset
//     (Consumer.Group.ResetInvalidOffsets), which under StartNewest also
//     skipped the records left. The deleted ones are logged at Error and
//     counted, as checkStart does for StartOldest.
//
// In both cases it marks and commits the partition's first offset and
// reports true, and ConsumeClaim returns without handing a record out. A
// claim that returns unrevoked ends the member's session under either
// protocol, and the next session's claim starts at the committed first
// offset: one rebalance more. When the cluster cannot be asked, a warning
// is logged and the claim goes on at the end, as before (checkStart then
// still logs a loss).
func (s *Source) rewindNewestStart(sess sarama.ConsumerGroupSession, sc sarama.ConsumerGroupClaim) bool {
	if s.cfg.InitialOffset != StartNewest || sc.InitialOffset() != sarama.OffsetNewest {
		return false
	}
	topic, p := sc.Topic(), sc.Partition()
	fail := func(err error) bool {
		s.cfg.Logger.Warn("once/kafka: cannot tell whether a partition claimed at its end holds records the group has not read; it starts at its end",
			"group", s.cfg.Group, "topic", topic, "partition", p, "error", err)
		return false
	}
	resp, err := s.fetchCommitted(s.withSiblings(map[string][]int32{topic: {p}}))
	if err != nil {
		return fail(err)
	}
	b := resp.GetBlock(topic, p)
	if b == nil || !errors.Is(b.Err, sarama.ErrNoError) {
		return false
	}
	added := b.Offset < 0 && committedAny(resp, topic, sess.GenerationID())
	if b.Offset < 0 && !added {
		return false // a group new to the topic: StartNewest
	}
	first, err := s.dlqClient.GetOffset(topic, p, sarama.OffsetOldest)
	if err != nil {
		return fail(err)
	}
	switch {
	case added:
		s.cfg.Logger.Info("once/kafka: partition added to a topic the group reads, claimed without a start; committing its first record as its start and rejoining to read it from there",
			"group", s.cfg.Group, "topic", topic, "partition", p, "offset", first)
	case b.Offset < first:
		s.lag.skippedOutOfRange(topic, p, first-b.Offset)
		s.cfg.Logger.Error("once/kafka: the group's committed offset is out of the partition's range "+
			"(its records deleted by retention before they were handled, or the log truncated); the claim starts at the partition's first record left, "+
			"and the records between the two are not handled",
			"group", s.cfg.Group, "topic", topic, "partition", p, "committed", b.Offset,
			"start", first, "initial_offset", startName(sarama.OffsetNewest), "skipped", first-b.Offset)
	default:
		return false // in range, or past the end: checkStart's
	}
	sess.MarkOffset(topic, p, first, "")
	sess.Commit()
	return true
}

// withSiblings returns claims with every partition of each of their topics
// that the Source's client knows: those the group's other members hold
// too.
func (s *Source) withSiblings(claims map[string][]int32) map[string][]int32 {
	all := make(map[string][]int32, len(claims))
	for topic, partitions := range claims {
		known, err := s.dlqClient.Partitions(topic)
		if err != nil {
			known = nil
		}
		seen := make(map[int32]bool, len(partitions)+len(known))
		for _, p := range append(append([]int32(nil), partitions...), known...) {
			if !seen[p] {
				seen[p] = true
				all[topic] = append(all[topic], p)
			}
		}
	}
	return all
}

// committedAny reports whether resp holds a committed offset of any
// partition of topic that shows the group reading the topic before
// generation gen: a start marked in gen itself (startMetadata) is another
// member of the session setting up its claims beside this one, in a group
// new to the topic, and does not count. Without this, a member whose
// Setup asked after another member of its generation had committed its
// starts took its own partitions for partitions added to the topic, and
// read them from their first records.
func committedAny(resp *sarama.OffsetFetchResponse, topic string, gen int32) bool {
	for _, b := range resp.Blocks[topic] {
		if b != nil && errors.Is(b.Err, sarama.ErrNoError) && b.Offset >= 0 && b.Metadata != startMetadata(gen) {
			return true
		}
	}
	return false
}

// readInDatabase reports whether a partition of topic that the offsets
// table gives a position (positioned) shows the group reading the topic
// before generation gen, as committedAny does for committed offsets: its
// committed offset is not a start marked in gen. A member of a group new
// to the topic records in the table the start its markStarts committed in
// gen (recordStart), which says nothing of the kind; a position the table
// kept while Kafka forgot the group's offsets has no committed offset
// beside it, or another.
func readInDatabase(resp *sarama.OffsetFetchResponse, topic string, gen int32, positioned map[topicPartition]bool) bool {
	for tp := range positioned {
		if tp.topic != topic {
			continue
		}
		b := resp.GetBlock(topic, tp.partition)
		if b != nil && errors.Is(b.Err, sarama.ErrNoError) && (b.Offset < 0 || b.Metadata != startMetadata(gen)) {
			return true
		}
	}
	return false
}

// startMetadata is the metadata of the start markStarts commits for a
// partition in generation gen; an ack's mark replaces it with none.
func startMetadata(gen int32) string {
	return "once/kafka: StartNewest start, generation " + strconv.FormatInt(int64(gen), 10)
}

// fetchCommitted asks the group's coordinator for the group's committed
// offsets of partitions. The Source's own client keeps the coordinator it
// found first, while the group's client follows the coordinator when it
// moves to another broker (a rolling restart moves it) or its broker
// leaves the cluster: a question that fails, on a broker that answers it
// is no longer the coordinator or on one that cannot be reached, has the
// client find the coordinator again, and is asked again once.
func (s *Source) fetchCommitted(partitions map[string][]int32) (*sarama.OffsetFetchResponse, error) {
	resp, err := s.fetchCommittedOnce(partitions)
	if err == nil {
		return resp, nil
	}
	if rerr := s.dlqClient.RefreshCoordinator(s.cfg.Group); rerr != nil {
		return nil, fmt.Errorf("%w (finding the group's coordinator again: %w)", err, rerr)
	}
	return s.fetchCommittedOnce(partitions)
}

// fetchCommittedOnce is fetchCommitted's one question to the coordinator
// the client knows.
func (s *Source) fetchCommittedOnce(partitions map[string][]int32) (*sarama.OffsetFetchResponse, error) {
	coordinator, err := s.dlqClient.Coordinator(s.cfg.Group)
	if err != nil {
		return nil, err
	}
	// On a connection of its own: the client's connection to the
	// coordinator stays broken once it was cut (see topicIDs.lookupOnce),
	// and every later session's question would fail on it.
	b := sarama.NewBroker(coordinator.Addr())
	if err := b.Open(s.dlqClient.Config()); err != nil {
		return nil, err
	}
	defer b.Close()
	resp, err := b.FetchOffset(sarama.NewOffsetFetchRequest(s.topicIDs.version, s.cfg.Group, partitions))
	if err != nil {
		return nil, err
	}
	if !errors.Is(resp.Err, sarama.ErrNoError) {
		return nil, resp.Err
	}
	return resp, nil
}

// startName names a claim's initial offset for the logs: sarama's
// OffsetOldest and OffsetNewest by name, an offset as it is.
func startName(offset int64) string {
	switch offset {
	case sarama.OffsetOldest:
		return "oldest"
	case sarama.OffsetNewest:
		return "newest"
	}
	return strconv.FormatInt(offset, 10)
}

// Cleanup forgets what checkStart asked of the session.
func (h *groupHandler) Cleanup(sess sarama.ConsumerGroupSession) error {
	h.s.committedAtStart.Delete(sess)
	return nil
}

// ConsumeClaim hands the claim's records to Receive, one at a time and in
// offset order (claim.feed). When the claim ends (a rebalance revokes it,
// or the session ends) it stops handing records out and waits, at most
// Config.RevokeTimeout, until every record it handed out was acked (or the
// Source is closing), so that the session's final commit includes them.
// Then it revokes the claim: the contexts of its unsettled deliveries are
// cancelled and their Acks mark nothing.
func (h *groupHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, sc sarama.ConsumerGroupClaim) error {
	s := h.s
	topicID, err := s.topicIDs.lookup(sess.Context(), sc.Topic())
	if err != nil {
		// The session ended first: no record of the claim was handed out.
		s.cfg.Logger.Warn("once/kafka: claim ended before its topic id was known", "group", s.cfg.Group,
			"topic", sc.Topic(), "partition", sc.Partition(), "error", err)
		return nil
	}
	cl := newClaim(s, sess, sc, topicID)
	// The group's committed offset is where the claim starts without
	// OffsetsInDatabase, and with it where the table has no position.
	checkCommitted := !s.cfg.OffsetsInDatabase
	if s.cfg.OffsetsInDatabase {
		o, ok := s.positions.take(sc.Topic(), sc.Partition())
		if !ok {
			// Not in the session's take-over: its position is unknown.
			// Under the eager protocol, the only one Open allows with
			// OffsetsInDatabase, this does not happen: Setup takes every
			// claim of the session over before sarama starts any
			// ConsumeClaim, TakeOverPartitions returns a row for each
			// or fails (it waits for a previous owner's transaction on
			// the row rather than giving up, and fences that owner by
			// the epoch), and a Setup that fails starts no claim. It
			// guards against a partition sarama adds without a Setup
			// (the cooperative protocol). Returning ends the member's
			// session, a rebalance more, whose Setup takes the
			// partition over; nothing cheaper is safe: sarama started
			// the claim at the group's committed offset, not the
			// table's, and cannot seek a running claim, and a claim
			// held idle (as holdFenced does) would leave the partition
			// unconsumed until some other rebalance, which a stable
			// group may never have. No record of it was handed out.
			s.cfg.Logger.Error("once/kafka: partition claimed without a take-over in the database; not consuming it",
				"group", s.cfg.Group, "stream", cl.stream, "generation", sess.GenerationID())
			cl.revoke()
			return nil
		}
		cl.db = newClaimOffsets(o, sc.InitialOffset())
		if o.Next >= 0 && sc.InitialOffset() != o.Next {
			// sarama found the position out of the partition's range
			// and reset it (Consumer.Group.ResetInvalidOffsets).
			s.checkRecordedStart(cl, o.Next, sc.InitialOffset())
		}
		checkCommitted = o.Next < 0
		if o.Next < 0 && sc.InitialOffset() >= 0 {
			// The table has no position and the claim starts at one the
			// group's committed offset (or the session's start, with
			// StartNewest) gave: kept in the table, so that a partition
			// that gets no record here does not lose it when Kafka
			// forgets the group's offsets.
			s.recordStart(cl, sc.InitialOffset())
		}
	}
	if !s.cfg.OffsetsInDatabase && s.rewindNewestStart(sess, sc) {
		cl.revoke()
		return nil
	}
	if checkCommitted {
		s.checkStart(cl, sc.InitialOffset())
	}
	s.cfg.Logger.Debug("once/kafka: partition claimed", "group", s.cfg.Group, "stream", cl.stream,
		"generation", sess.GenerationID(), "offset", sc.InitialOffset())
	s.lag.track(cl)
	defer s.lag.untrack(cl)
	defer cl.revoke()

	cl.feed(sess.Context().Done())
	cl.awaitSettled(s.cfg.RevokeTimeout, s.closing)
	if cl.fencedByOther.Load() {
		s.lag.untrack(cl)
		s.holdFenced(sess, sc)
	}
	if cl.topicGone.Load() == topicDeleted {
		// Still tracked, so that sarama's errors about the partition are
		// known for its topic's (topicError).
		s.holdGone(sess, sc)
	}
	s.cfg.Logger.Debug("once/kafka: partition released", "group", s.cfg.Group, "stream", cl.stream,
		"generation", sess.GenerationID(), "last_offset", cl.last.Load())
	return nil
}

// holdFenced keeps a claim fenced by another group under the same
// consumer name until its session ends, the partition is revoked
// (Messages() closed) or the Source is closing. A ConsumeClaim that
// returned would end the member's whole session (sarama ends it when any
// of them returns): its group would rejoin at once and take the partition
// back, fencing the other group in turn. The partition's fetching is
// paused meanwhile (sarama's ConsumerGroup.Pause), and resumed when the
// claim ends, as sarama keeps a partition paused across its claims; the
// records fetched before the pause are read and dropped, so that
// sarama's fetching of the member's other partitions does not wait on
// them.
func (s *Source) holdFenced(sess sarama.ConsumerGroupSession, sc sarama.ConsumerGroupClaim) {
	part := map[string][]int32{sc.Topic(): {sc.Partition()}}
	s.group.Pause(part)
	defer s.group.Resume(part)
	s.heldFenced.Add(1)
	defer s.heldFenced.Add(-1)
	for {
		select {
		case _, ok := <-sc.Messages():
			if !ok {
				return
			}
			s.fencedDropped.Add(1)
		case <-sess.Context().Done():
			return
		case <-s.closing:
			return
		}
	}
}
