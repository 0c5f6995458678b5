// Package tlsfail tells a TLS handshake that failed for what the two
// sides are configured with (a certificate not trusted, not valid for the
// host, not presented; TLS to a port that speaks none) from a connection
// that failed: the first fails on every attempt, and retrying it never
// helps.
package tlsfail

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
)

// Refused reports whether err, or an error it wraps, is such a handshake
// failure: a certificate crypto/tls could not verify, a first record that
// is not TLS, or an alert the peer sent (crypto/tls reports those as a
// *net.OpError of Op "remote error", e.g. "remote error: tls: certificate
// required").
func Refused(err error) bool {
	if err == nil {
		return false
	}
	var (
		verify   *tls.CertificateVerificationError
		unknown  x509.UnknownAuthorityError
		hostname x509.HostnameError
		invalid  x509.CertificateInvalidError
		header   tls.RecordHeaderError
		op       *net.OpError
	)
	return errors.As(err, &verify) || errors.As(err, &unknown) || errors.As(err, &hostname) ||
		errors.As(err, &invalid) || errors.As(err, &header) ||
		errors.As(err, &op) && op.Op == "remote error"
}
