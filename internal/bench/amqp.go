package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
)

// amqpPrefetch is the prefetch of every RabbitMQ row, the naive one
// included: the adapter's default. At 512 the acks of batches committed
// out of order went out one delivery per frame, since held acks may fill
// only half the prefetch; 2048 and 4096 measured alike (docs/performance.md).
const amqpPrefetch = amqp.DefaultPrefetch

func amqpPublishing(m Msg, produced time.Time) amqp091.Publishing {
	p := amqp091.Publishing{MessageId: m.ID, ContentType: "application/json", DeliveryMode: amqp091.Persistent, Body: m.Value}
	if !produced.IsZero() {
		p.Headers = amqp091.Table{HeaderProduced: strconv.FormatInt(produced.UnixNano(), 10)}
	}
	return p
}

// amqpPublisher publishes persistent messages on a confirm-mode channel.
type amqpPublisher struct {
	conn    *amqp091.Connection
	ch      *amqp091.Channel
	pending []*amqp091.DeferredConfirmation
	// window is how many publishes may await their confirm before publish
	// waits for them; 0 waits only in Close.
	window int
}

func newAMQPPublisher(url string) (*amqpPublisher, error) {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Confirm(false)
	}
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	return &amqpPublisher{conn: conn, ch: ch, window: 1000}, nil
}

func (p *amqpPublisher) publish(queue string, pub amqp091.Publishing) error {
	dc, err := p.ch.PublishWithDeferredConfirm("", queue, false, false, pub)
	if err != nil {
		return err
	}
	p.pending = append(p.pending, dc)
	if p.window > 0 && len(p.pending) >= p.window {
		return p.confirmAll()
	}
	return nil
}

// confirmAll waits for the broker's confirm of every pending publish.
func (p *amqpPublisher) confirmAll() error {
	for _, dc := range p.pending {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		ok, err := dc.WaitContext(ctx)
		cancel()
		if err != nil {
			return err
		}
		if !ok {
			return errors.New("rabbitmq nacked a publish")
		}
	}
	p.pending = p.pending[:0]
	return nil
}

// Close waits for the pending confirms and closes the connection.
func (p *amqpPublisher) Close() error {
	err := p.confirmAll()
	if cerr := p.conn.Close(); err == nil {
		err = cerr
	}
	return err
}

// amqpQueueArgs are the declare arguments of a row's queue: x-queue-mode
// lazy when lazy is set, else none (a default classic queue).
func amqpQueueArgs(lazy bool) amqp091.Table {
	if lazy {
		return amqp091.Table{"x-queue-mode": "lazy"}
	}
	return nil
}

// declareQueue declares the row's queue (durable, classic) empty, with
// args.
func declareQueue(url, queue string, args amqp091.Table) error {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	_, err = ch.QueueDeclare(queue, true, false, false, false, args)
	return err
}

// publishBacklog publishes the workload to queue before the row starts.
func publishBacklog(url, queue, prefix string, w Workload) error {
	p, err := newAMQPPublisher(url)
	if err != nil {
		return err
	}
	var perr error
	w.Each(prefix, func(m Msg) bool {
		perr = p.publish(queue, amqpPublishing(m, time.Time{}))
		return perr == nil
	})
	if err := p.Close(); perr == nil {
		perr = err
	}
	return perr
}

// queueCounts returns the ready messages of queue and of its dead-letter
// queue.
func queueCounts(url, queue string) (ready, dead int, err error) {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return 0, 0, err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return 0, 0, err
	}
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return 0, 0, fmt.Errorf("queue %s: %w", queue, err)
	}
	dlq, err := ch.QueueDeclarePassive(queue+amqp.DeadLetterQueueSuffix, true, false, false, false, nil)
	if err != nil {
		return 0, 0, fmt.Errorf("queue %s: %w", queue+amqp.DeadLetterQueueSuffix, err)
	}
	return q.Messages, dlq.Messages, nil
}

// queueIDs takes n messages off queue and returns their message ids. It
// consumes them: the queue is left without them.
func queueIDs(url, queue string, n int) ([]string, error) {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return nil, err
	}
	if err := ch.Qos(1000, 0, false); err != nil {
		return nil, err
	}
	ds, err := ch.Consume(queue, "", false, true, false, false, nil)
	if err != nil {
		return nil, fmt.Errorf("queue %s: %w", queue, err)
	}
	ids := make([]string, 0, n)
	idle := time.NewTimer(time.Minute)
	defer idle.Stop()
	for len(ids) < n {
		select {
		case d, ok := <-ds:
			if !ok {
				return nil, fmt.Errorf("queue %s: the channel closed after %d of %d messages", queue, len(ids), n)
			}
			ids = append(ids, d.MessageId)
			if len(ids)%500 == 0 || len(ids) == n {
				if err := d.Ack(true); err != nil { // and every one before it
					return nil, err
				}
			}
			idle.Reset(time.Minute)
		case <-idle.C:
			return nil, fmt.Errorf("queue %s: %d of %d messages after a minute without one", queue, len(ids), n)
		}
	}
	return ids, nil
}

// deleteQueues deletes queue and its dead-letter queue, if they exist.
func deleteQueues(url, queue string) {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return
	}
	defer conn.Close()
	for _, q := range []string{queue, queue + amqp.DeadLetterQueueSuffix} {
		ch, err := conn.Channel() // a failed delete closes the channel
		if err != nil {
			return
		}
		_, _ = ch.QueueDelete(q, false, false, false)
		_ = ch.Close()
	}
}

// openAMQPSource opens the adapter's source on the row's queue.
func openAMQPSource(ctx context.Context, spec *rowSpec, logger *slog.Logger) (consumer.Source, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return amqp.Open(ctx, amqp.Config{URL: spec.AMQPURL, Queue: spec.Queue, Prefetch: amqpPrefetch, Ordered: spec.Ordered,
		QueueArgs: amqpQueueArgs(spec.Lazy), Logger: logger})
}

// amqpPacer publishes paced messages, stamping each with its produce time.
type amqpPacer struct {
	p     *amqpPublisher
	queue string
}

func newAMQPPacer(spec *rowSpec) (*amqpPacer, error) {
	p, err := newAMQPPublisher(spec.AMQPURL)
	if err != nil {
		return nil, err
	}
	p.window = 0 // a paced publish must not wait for earlier confirms
	return &amqpPacer{p: p, queue: spec.Queue}, nil
}

func (a *amqpPacer) send(m Msg) error { return a.p.publish(a.queue, amqpPublishing(m, time.Now())) }

// Close waits for the confirms and closes the connection.
func (a *amqpPacer) Close() error { return a.p.Close() }
