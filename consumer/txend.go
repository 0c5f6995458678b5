package consumer

import (
	"context"
	"errors"
	"strings"
)

// A handler's statement can end the consumer's transaction and leave its
// connection in another one: COMMIT AND CHAIN, or COMMIT; BEGIN sent in one
// string with the simple protocol (tx.Exec without arguments). The
// connection then looks as it did before, in a transaction, and the
// consumer's COMMIT would commit the one the handler opened, which holds
// none of the claims. A statement that may end the transaction
// (mayEndTx) is therefore watched: the transaction's id is read before it
// is sent, and its status asked after it (queueTx.watchEnd, checkEnd).
// Statements that cannot end it, all but a handful, cost nothing more.

// mayEndTx reports whether sql holds a statement that may end a
// transaction: one whose first word is COMMIT, END, ROLLBACK, ABORT or
// PREPARE (PREPARE TRANSACTION). It skips comments, quoted literals and
// identifiers and dollar-quoted strings, so a keyword inside them is not
// taken for a statement; where it cannot tell, it answers true. A
// procedure or a DO block cannot end a transaction block, and PREPARE
// cannot prepare a COMMIT: the first word of each statement is enough.
func mayEndTx(sql string) bool {
	start := true // at the beginning of a statement
	for i := 0; i < len(sql); {
		c := sql[i]
		switch {
		case c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v':
			i++
		case c == ';':
			start = true
			i++
		case c == '-' && i+1 < len(sql) && sql[i+1] == '-':
			for i < len(sql) && sql[i] != '\n' && sql[i] != '\r' {
				i++
			}
		case c == '/' && i+1 < len(sql) && sql[i+1] == '*':
			// Block comments nest.
			depth := 1
			for i += 2; i < len(sql) && depth > 0; {
				switch {
				case strings.HasPrefix(sql[i:], "/*"):
					depth++
					i += 2
				case strings.HasPrefix(sql[i:], "*/"):
					depth--
					i += 2
				default:
					i++
				}
			}
		case c == '\'':
			i = skipQuoted(sql, i, '\'', i > 0 && (sql[i-1] == 'e' || sql[i-1] == 'E'))
			start = false
		case c == '"':
			i = skipQuoted(sql, i, '"', false)
			start = false
		case c == '$':
			if end, ok := dollarQuoteEnd(sql, i); ok {
				i = end
			} else {
				i++
			}
			start = false
		case isWordByte(c):
			j := i
			for j < len(sql) && isWordByte(sql[j]) {
				j++
			}
			if start && isEndingWord(sql[i:j]) {
				return true
			}
			start = false
			i = j
		default:
			start = false
			i++
		}
	}
	return false
}

// skipQuoted returns the index after the literal or quoted identifier that
// opens at sql[i] with quote q (doubled inside it); backslash escapes a
// character in an E'...' string.
func skipQuoted(sql string, i int, q byte, backslash bool) int {
	for i++; i < len(sql); i++ {
		switch {
		case backslash && sql[i] == '\\':
			i++
		case sql[i] == q:
			if i+1 < len(sql) && sql[i+1] == q {
				i++
				continue
			}
			return i + 1
		}
	}
	return i
}

// dollarQuoteEnd returns the index after the dollar-quoted string opening
// at sql[i] ($$...$$ or $tag$...$tag$), and false when sql[i] opens none
// (a parameter such as $1, or a $ inside an identifier).
func dollarQuoteEnd(sql string, i int) (int, bool) {
	if i > 0 && isWordByte(sql[i-1]) {
		return 0, false
	}
	j := i + 1
	for j < len(sql) && sql[j] != '$' {
		c := sql[j]
		if !isWordByte(c) || (j == i+1 && c >= '0' && c <= '9') {
			return 0, false
		}
		j++
	}
	if j >= len(sql) {
		return 0, false
	}
	tag := sql[i : j+1]
	k := strings.Index(sql[j+1:], tag)
	if k < 0 {
		return len(sql), true
	}
	return j + 1 + k + len(tag), true
}

// isEndingWord reports whether w is the first word of a statement that
// may end a transaction.
func isEndingWord(w string) bool {
	for _, k := range [...]string{"COMMIT", "END", "ROLLBACK", "ABORT", "PREPARE"} {
		if strings.EqualFold(w, k) {
			return true
		}
	}
	return false
}

func isWordByte(c byte) bool {
	return c == '_' || c == '$' || c >= 0x80 || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')
}

// endWatch is a statement that may end the transaction, sent on behalf of
// the job at owner: status is the connection's transaction status before
// it, xid the transaction's id (0 when not read).
type endWatch struct {
	owner  int
	status byte
	xid    int64
}

// watchEnd prepares for sending sql on behalf of the job at owner: when
// sql may end the transaction (mayEndTx), it reads the transaction's id,
// unless known, for checkEnd to tell, once the statement's results are
// read, whether the transaction it was sent in ended (owner < 0: a
// BatchHandler's, for whether it ended rolled back; see endedBySQL: once
// its connection is out of any transaction, after a COMMIT of its own,
// there is none of the batch's left to end).
func (t *queueTx) watchEnd(ctx context.Context, owner int, sql string) {
	if t.closedBy != nil || t.batchAborted || !mayEndTx(sql) {
		return
	}
	c := t.Conn()
	if c == nil || c.IsClosed() || c.PgConn().IsBusy() || owner < 0 && c.PgConn().TxStatus() == 'I' {
		return
	}
	w := &endWatch{owner: owner, status: c.PgConn().TxStatus(), xid: t.xid}
	if w.status == 'T' && w.xid == 0 {
		if c.QueryRow(ctx, `SELECT txid_current()`).Scan(&w.xid) == nil {
			t.xid = w.xid
		}
	}
	t.watch = w
}

// checkEnd finds out, once the connection is free, whether the watched
// statement (watchEnd) ended the transaction, and if so records whose it
// was (closedBy) and whether it left nothing committed (rolledBack). A
// transaction it ended and replaced with another is found by asking the
// status of the first one's id: on the connection itself, in the new
// transaction, or, when that one is aborted too, on another connection
// (t.xidStatus).
func (t *queueTx) checkEnd(ctx context.Context) {
	w := t.watch
	if w == nil {
		return
	}
	c := t.Conn()
	if c == nil || c.IsClosed() {
		t.watch = nil
		return
	}
	pc := c.PgConn()
	if pc.IsBusy() {
		return // rows still open: checked once they are closed
	}
	t.watch = nil
	status := pc.TxStatus()
	if w.xid != 0 {
		var s *string
		var err error
		switch {
		case t.xidStatus != nil && status != 'E':
			s, err = t.xidStatus(ctx, c, w.xid)
		case status != 'E':
			err = c.QueryRow(ctx, `SELECT txid_status($1)`, w.xid).Scan(&s)
		case t.xidStatus != nil:
			s, err = t.xidStatus(ctx, nil, w.xid)
		default:
			err = errNoStatus
		}
		if err == nil && s != nil {
			if *s != "in progress" {
				t.endedBy(w.owner, *s == "aborted")
			}
			return
		}
	}
	// Without the transaction's id, only a connection out of any
	// transaction tells that it ended. (From an aborted transaction, a
	// ROLLBACK TO SAVEPOINT goes back to it, like a ROLLBACK; BEGIN to
	// another.)
	ended, rolledBack := status == 'I', w.status == 'E' || t.rolledBack
	if ended {
		t.endedBy(w.owner, rolledBack)
	}
}

// endedBy records that a statement of the job at owner (owner < 0: of the
// BatchHandler) ended the transaction, rolledBack or committed. A
// BatchHandler's COMMIT made all its events' claims durable, and what it
// sends after it keeps their effects: only its ROLLBACK is recorded.
func (t *queueTx) endedBy(owner int, rolledBack bool) {
	if owner < 0 {
		t.batchAborted = t.batchAborted || rolledBack
		return
	}
	t.closedBy, t.rolledBack = &owner, rolledBack
}

// errNoStatus: the status of a transaction could not be asked.
var errNoStatus = errors.New("no connection to ask a transaction's status on")
